"""`grpo-mega plan` with the PRM on vLLM (``process_reward.scorer: vllm``): its whole budget
(``process_reward.vllm_gpu_memory_utilization`` x the GPU: weights, workspace, KV cache) counted while it scores and
nothing elsewhere (it sleeps at level 1 on a GPU), in place of the engine PRM's weights and activations; colocated
and in async mode (on the rollout GPUs)."""

import pytest

from test_plan import _plan

PRM_CONFIG = "qwen2.5-math-7b_grpo_prm"
PRM_7B_PARAMETERS = 7.07e9
"""Qwen2.5-Math-PRM-7B (configs/models/qwen2.5-math-prm-7b): the 7B backbone with its two-layer classifier."""


def _without(items: dict, *names: str) -> dict:
    return {key: value for key, value in items.items() if key not in names}


def test_the_vllm_prm_adds_its_budget_while_it_scores_and_nothing_in_the_other_phases():
    engine = _plan(PRM_CONFIG)
    vllm = _plan(PRM_CONFIG, "process_reward.scorer=vllm", "process_reward.vllm_gpu_memory_utilization=0.2")
    prm = vllm.vllm_prm
    assert prm.sleeps and prm.replicas == vllm.hardware.world_size and prm.tensor_parallel == 1
    assert prm.budget == int(0.2 * vllm.gpu_bytes) and prm.kv_cache > 0
    assert prm.weights == pytest.approx(PRM_7B_PARAMETERS * 2, rel=0.02)  # bf16, a whole copy at TP1
    # every phase but the scoring: the engine's plan less the engine PRM's weights
    for name in ("update", "generation", "save"):
        assert vllm.phase(name).items == _without(engine.phase(name).items, "PRM weights"), name
    scoring = vllm.phase("prm_scoring").items
    assert scoring == {**vllm.phase("generation").items, **prm.resident}
    assert vllm.phase("prm_scoring").total - vllm.phase("generation").total == prm.budget
    assert vllm.fits, vllm.problems
    assert any("process_reward.scorer=vllm" in note and "asleep at level 1" in note for note in vllm.notes)


def test_the_scoring_phase_follows_the_gpu_share_and_the_vllm_prms_tensor_parallel():
    low = _plan(PRM_CONFIG, "process_reward.scorer=vllm", "process_reward.vllm_gpu_memory_utilization=0.25")
    high = _plan(PRM_CONFIG, "process_reward.scorer=vllm", "process_reward.vllm_gpu_memory_utilization=0.35")
    grown = high.phase("prm_scoring").total - low.phase("prm_scoring").total
    assert grown == int(0.35 * high.gpu_bytes) - int(0.25 * low.gpu_bytes)  # all of it the KV cache's
    assert high.vllm_prm.weights == low.vllm_prm.weights
    split = _plan(PRM_CONFIG, "process_reward.scorer=vllm", "process_reward.vllm_tensor_parallel=2",
                  "process_reward.vllm_gpu_memory_utilization=0.25")
    assert split.vllm_prm.weights == pytest.approx(low.vllm_prm.weights / 2, rel=0.02)
    assert split.vllm_prm.replicas == low.vllm_prm.replicas // 2
    assert split.vllm_prm.kv_cache > low.vllm_prm.kv_cache  # the same budget, half the weights


def test_a_budget_below_the_prms_weights_is_a_problem_naming_the_key():
    plan = _plan(PRM_CONFIG, "process_reward.scorer=vllm", "process_reward.vllm_gpu_memory_utilization=0.1")
    assert plan.vllm_prm.kv_cache <= 0  # 14 GiB of weights in 8 GiB
    assert not plan.fits
    assert any(p.startswith("prm_scoring: the vLLM PRM's budget") and "process_reward.vllm_gpu_memory_utilization" in p
               for p in plan.problems)


def test_async_rollouts_put_the_vllm_prm_on_the_rollout_gpus():
    overrides = ("rollout.mode=async", "rollout.async_ranks=4", "rollout.tensor_parallel=1",
                 "algorithm.rollout_is=tis", "rollout.gpu_memory_utilization=0.4")
    engine = _plan(PRM_CONFIG, *overrides)
    vllm = _plan(PRM_CONFIG, *overrides, "process_reward.scorer=vllm", "process_reward.vllm_gpu_memory_utilization=0.3")
    assert vllm.vllm_prm.replicas == 4
    for name in ("update", "save"):
        assert vllm.phase(name).items == engine.phase(name).items  # the training GPUs hold no PRM either way
    assert vllm.phase("generation").items == _without(engine.phase("generation").items, "PRM weights")
    assert vllm.phase("prm_scoring").total - vllm.phase("generation").total == vllm.vllm_prm.budget
    assert vllm.fits, vllm.problems
