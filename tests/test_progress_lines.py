"""Issue 60: the commands that generate for minutes outside a training loop (``grpo-mega eval``, ``prm label``) say
what they are doing as they go: a line per phase, and one at most every 10 s while the hf engine generates."""

from __future__ import annotations

import io

import torch
from tiny_task import build_tiny_task

from grpo_mega.rollout import SamplingConfig
from grpo_mega.run import progress as progress_module
from grpo_mega.run.progress import PhaseProgress


def test_a_phase_says_its_start_its_progress_at_most_every_interval_and_its_end(monkeypatch):
    clock = iter([0.0, 0.0, 3.0, 11.0, 12.0, 25.0, 30.0])
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    progress = PhaseProgress("grpo-mega eval", out=out)
    progress.start("sample 1/1", 200, "prompts")
    for done in (64, 128, 150, 200):  # at 3 s (too soon), 11 s, 12 s (too soon), 25 s (the last: finish says it)
        progress(done, 200)
    progress.finish("accuracy 0.500")
    assert out.getvalue().splitlines() == ["grpo-mega eval: sample 1/1: 200 prompts",
                                           "grpo-mega eval: sample 1/1: 128/200 prompts, 11 s",
                                           "grpo-mega eval: sample 1/1: accuracy 0.500, 30 s"]


def test_a_rank_other_than_0_says_nothing():
    out = io.StringIO()
    progress = PhaseProgress("grpo-mega prm label", speaks=False, out=out, every_s=0)
    progress.start("sampling solutions", 4, "solutions")
    progress(1, 4)
    assert out.getvalue() == ""


def test_the_hf_engine_reports_each_generated_batch(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_mega.rollout.hf_engine import HFRolloutEngine

    model_dir, _ = build_tiny_task(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(model_dir), generation_batch_size=2)
    seen = []
    engine.on_progress = lambda done, total: seen.append((done, total))
    engine.generate([[5, 6, 7]] * 5, SamplingConfig(temperature=0, max_new_tokens=2))
    assert seen[-1] == (5, 5) and [done for done, _ in seen] == sorted(done for done, _ in seen) and len(seen) >= 2


def test_a_training_command_says_what_it_builds_before_its_first_step(capsys):
    """Issue 79: ``train`` with a vLLM PRM scorer printed nothing for its first 60 s (a tiny ``train`` 52-54 s under
    load, ``sft`` 44 s): the command's own process now says, once its checks passed, what comes before step 1, on
    stdout with the step lines (stderr stays one line per failure)."""
    from types import SimpleNamespace

    from grpo_mega.cli import _announce_start

    cfg = SimpleNamespace(rollout=SimpleNamespace(engine="hf"),
                          process_reward=SimpleNamespace(source="prm", scorer="vllm"))
    _announce_start(SimpleNamespace(command="train", nproc=2), cfg)
    _announce_start(SimpleNamespace(command="sft", nproc=1), cfg)
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "grpo-mega train: starting on 2 processes: importing torch, then building the policy, the rollout engine "
        "(rollout.engine=hf), the PRM (process_reward.scorer=vllm) (vLLM takes a minute or more to start); a line per "
        "step follows",
        "grpo-mega sft: starting on 1 process: importing torch, then building the policy; a line per step follows"]
    assert err == ""
