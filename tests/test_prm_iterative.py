"""The PRM refresh of iterative RL: the replay mix (``prm.data.replay_mix``, what ``data.replay_files`` trains on)
and the windows of fresh prompts (the whole refresh runs in tests/test_quickstart_e2e.py; the replay option in
tests/test_prm_replay.py)."""

import pytest

from prm.data import replay_mix
from prm.iterative import RefreshPlan, prompt_window


def test_replay_mix_keeps_every_new_row_and_a_fraction_of_the_history():
    new = [f"new{i}" for i in range(5)]
    history = [f"old{i}" for i in range(40)]
    mixed = replay_mix(new, history, 0.1, seed=3)
    assert len(mixed) == 5 + 4
    assert set(new) <= set(mixed)
    replayed = [row for row in mixed if row.startswith("old")]
    assert len(set(replayed)) == 4 and set(replayed) <= set(history)
    assert mixed == replay_mix(new, history, 0.1, seed=3)  # deterministic in the seed
    assert mixed != replay_mix(new, history, 0.1, seed=4)
    assert sorted(replay_mix(new, [], 0.1, seed=0)) == sorted(new)
    assert len(replay_mix(new, history, 0.0, seed=0)) == 5
    with pytest.raises(ValueError, match="replay fraction"):
        replay_mix(new, history, 1.5, seed=0)


def test_prompt_windows_move_on_and_wrap_around(tmp_path):
    source = tmp_path / "train.jsonl"
    source.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(5)))
    second = prompt_window(source, 2, 2, tmp_path / "w1.jsonl").read_text().splitlines()
    assert second == ['{"prompt": "p2"}', '{"prompt": "p3"}']
    wrapped = prompt_window(source, 4, 3, tmp_path / "w2.jsonl").read_text().splitlines()
    assert wrapped == ['{"prompt": "p4"}', '{"prompt": "p0"}', '{"prompt": "p1"}']
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no prompts"):
        prompt_window(empty, 0, 2, tmp_path / "w3.jsonl")


def test_refresh_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="train_steps"):
        RefreshPlan(train_steps=0)
    with pytest.raises(ValueError, match="replay_fraction"):
        RefreshPlan(replay_fraction=1.5)
