"""Issue 60: reward code users bring from verl and TRL. verl's ``compute_score(data_source, solution_str,
ground_truth, extra_info)`` and TRL's ``reward(completions, **kwargs) -> list[float]`` are told apart from grpo-mega's
``fn(prompt, completion, answer, **extra)`` by their parameters and called as their trainers call them; functions
are given as modules or files (verl's ``custom_reward_function.path``); several are summed with weights (TRL's
``reward_funcs`` / ``reward_weights``)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from grpo_mega.reward import RewardError, score_samples
from grpo_mega.reward.adapters import RewardRows, signature_kind
from grpo_mega.reward.registry import build_reward_function, get_reward_function

VERL_ROW = {"data_source": "openai/gsm8k", "extra_info": {"index": 7, "split": "train"},
            "reward_model": {"style": "rule", "ground_truth": "72"}, "ability": "math"}


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's documented custom reward: a number."""
    assert extra_info["index"] == 7
    return 1.0 if data_source == "openai/gsm8k" and solution_str.endswith(ground_truth) else 0.0


def verl_dict_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's dict form: its "score" is the reward, the rest is logging; **kwargs gets the other columns."""
    return {"score": 0.5 if kwargs["ability"] == "math" else 0.0, "acc": True}


def trl_accuracy(completions, solution, **kwargs):
    """TRL's form: lists in, one reward (or None: not applicable) per completion out."""
    return [None if s == "n/a" else float(c == s) for c, s in zip(completions, solution)]


def trl_conversational(prompts, completions, **kwargs):
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant" and c[0]["content"] == "hi")
            for p, c in zip(prompts, completions)]


def trl_with_ids(completions, completion_ids, **kwargs):
    return [0.0 for _ in completions]


def native(prompt, completion, answer, **extra):
    return 1.0


def test_signatures_are_told_apart_by_their_parameters():
    assert signature_kind(verl_compute_score) == "verl" and signature_kind(verl_dict_score) == "verl"
    assert signature_kind(trl_accuracy) == "trl" and signature_kind(trl_conversational) == "trl"
    assert signature_kind(native) == "native" and signature_kind(len) == "native"


def test_a_verl_function_gets_the_row_as_verl_gives_it():
    fn = get_reward_function(f"{__name__}:verl_compute_score")
    assert fn("Q", "so 72", "72", **VERL_ROW) == 1.0 and fn("Q", "so 71", "72", **VERL_ROW) == 0.0
    # without data.answer_field pointing at it, the gold is verl's reward_model.ground_truth
    assert fn("Q", "so 72", None, **VERL_ROW) == 1.0
    assert get_reward_function(f"{__name__}:verl_dict_score")("Q", "x", "72", **VERL_ROW) == 0.5


def test_a_verl_dict_without_score_is_a_failure_naming_the_form():
    def no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    from grpo_mega.reward.adapters import adapt

    with pytest.raises(RewardError, match="without a 'score' key"):
        score_samples(adapt(no_score, "no_score"), ["Q"], ["x"], ["1"], [VERL_ROW])


def test_a_trl_function_gets_lists_of_the_row_columns_and_its_none_is_not_applicable():
    layout = RewardRows(answer_field="solution")
    fn = get_reward_function(f"{__name__}:trl_accuracy", layout)
    assert fn("Q", "4", "4") == 1.0 and fn("Q", "5", "4") == 0.0 and fn("Q", "4", "n/a") is None
    results = score_samples(fn, ["Q", "Q"], ["4", "4"], ["4", "n/a"], on_error="zero")
    assert [r.score for r in results] == [1.0, 0.0] and [r.failed for r in results] == [False, True]
    assert "None: no reward function applies to it" in results[1].error


def test_a_trl_function_on_conversation_rows_gets_messages():
    fn = get_reward_function(f"{__name__}:trl_conversational", RewardRows(conversational=True))
    assert fn("2 + 2?", "hi", "4") == 1.0


def test_a_trl_function_that_needs_what_grpo_mega_does_not_pass_is_refused_when_loaded():
    with pytest.raises(ValueError, match="requires completion_ids, which grpo-mega does not pass"):
        get_reward_function(f"{__name__}:trl_with_ids")


def test_a_function_of_no_known_signature_is_refused_naming_the_three():
    def two(prompt, completion):
        return 0.0

    from grpo_mega.reward.adapters import adapt

    with pytest.raises(ValueError, match=r"signature \(prompt, completion\).*verl's compute_score.*TRL's"):
        adapt(two, "m:two")


def test_several_functions_sum_with_their_weights_and_none_adds_nothing():
    fn = build_reward_function("math_verify", [f"{__name__}:trl_accuracy", f"{__name__}:native"], [2.0, 0.5],
                               RewardRows(answer_field="solution"))
    assert fn("Q", "4", "4") == 2.5 and fn("Q", "5", "4") == 0.5 and fn("Q", "4", "n/a") == 0.5
    with pytest.raises(ValueError, match="2 values for 1 reward.functions"):
        build_reward_function("math_verify", ["synthetic"], [1.0, 2.0])


def _file(path, body):
    path.write_text(textwrap.dedent(body))
    return path


def test_a_file_spec_loads_absolute_and_relative_to_the_current_folder(tmp_path, monkeypatch):
    _file(tmp_path / "my_reward.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0 if ground_truth in solution_str else 0.0
    """)
    absolute = get_reward_function(f"{tmp_path}/my_reward.py:compute_score")
    assert absolute("Q", "72", "72", **VERL_ROW) == 1.0
    monkeypatch.chdir(tmp_path)
    assert get_reward_function("my_reward.py:compute_score")("Q", "7", "72", **VERL_ROW) == 0.0
    with pytest.raises(ImportError, match=f"no such file {tmp_path}/missing.py"):
        get_reward_function("missing.py:compute_score")
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        get_reward_function("my_reward.py:nope")


def test_a_module_in_the_current_folder_imports_and_a_missing_one_names_the_folder(tmp_path, monkeypatch):
    _file(tmp_path / "cwd_reward_module.py", """
        def reward(prompt, completion, answer, **extra):
            return 3.0
    """)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert get_reward_function("cwd_reward_module:reward")("Q", "c", "a") == 3.0
    with pytest.raises(ImportError, match=f"searched the current folder {tmp_path}"):
        get_reward_function("no_such_reward_module:reward")


def _config(*overrides):
    return load_config(GRPOConfig, None, ["model.hf_config=x", "data.train_file=y", *overrides], validate)


def test_config_takes_functions_with_weights_and_refuses_the_mixups():
    cfg = _config("reward.functions=[math_verify, boxed_format]", "reward.weights=[1.0, 0.2]")
    assert cfg.reward.functions == ["math_verify", "boxed_format"] and cfg.reward.weights == [1.0, 0.2]
    with pytest.raises(ConfigError, match="reward.weights has 1 values for 2 reward.functions"):
        _config("reward.functions=[math_verify, boxed_format]", "reward.weights=[1.0]")
    replaced = _config("reward.function=synthetic", "reward.functions=[math_verify]")  # a config's, overridden
    assert replaced.reward.function == "math_verify" and replaced.reward.functions == ["math_verify"]
    with pytest.raises(ConfigError, match="reward.weights=.* weighs reward.functions, which is empty"):
        _config("reward.weights=[2.0]")
    with pytest.raises(ConfigError, match="reward.functions='nope' is no registered reward"):
        _config("reward.functions=[math_verify, nope]")


def test_process_supervision_from_the_function_refuses_a_verl_or_trl_function(tmp_path):
    reward_file = _file(tmp_path / "r.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    with pytest.raises(ConfigError, match="returns one score per completion \\(verl's signature"):
        _config("algorithm.supervision=process", "process_reward.source=function",
                f"reward.function={reward_file}:compute_score")


CALLS = []


def trl_recording(completions, solution, **kwargs):
    """TRL's form, recording the size of each call; raises on a completion "boom"."""
    CALLS.append(len(completions))
    if "boom" in completions:
        raise RuntimeError("verifier down")
    return [float(c == s) for c, s in zip(completions, solution)]


def test_a_trl_function_scores_a_batch_in_one_call_and_a_failing_batch_sample_by_sample():
    fn = get_reward_function(f"{__name__}:trl_recording", RewardRows(answer_field="solution"))
    CALLS.clear()
    results = score_samples(fn, ["Q"] * 4, ["4", "5", "4", "4"], ["4", "4", "4", "n"], [{"k": 1}] * 4)
    assert CALLS == [4] and [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]
    CALLS.clear()
    results = score_samples(fn, ["Q"] * 3, ["4", "boom", "4"], ["4"] * 3, on_error="zero", indices=[6, 7, 8])
    assert CALLS == [3, 1, 1, 1] and [r.failed for r in results] == [False, True, False]
    assert "raised on sample 7" in results[1].error and "verifier down" in results[1].error
    weighted = build_reward_function("math_verify", [f"{__name__}:trl_recording", f"{__name__}:native"], [2.0, 1.0],
                                     RewardRows(answer_field="solution"))
    CALLS.clear()
    assert [r.score for r in score_samples(weighted, ["Q"] * 2, ["4", "5"], ["4", "4"])] == [3.0, 1.0]
    assert CALLS == [2]
