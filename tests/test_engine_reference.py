"""The forward-only engine (KL reference): the training engine's log-probs from the same weights, at TP=2 and PP=2,
with no optimizer, no gradient buffers and no parameter that requires a gradient; ``load_initial_weights`` fills
it (and the policy) from every ``model.init_from`` format."""

import logging

import pytest
import torch

from dist_utils import right_padded_rows, run_distributed, tiny_qwen2_config
from test_engine_lr_schedule import InterfaceOnly


def _hf_config():
    return tiny_qwen2_config(tied=False)


def _batch():
    return right_padded_rows(21)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


LAYOUTS = [(2, 1), (1, 2)]


def _reference_vs_policy_at_layouts(hf_dir, work_dir):
    """``_reference_vs_policy`` at each of LAYOUTS in turn, in one job of 2 processes (a spawn costs ~10 s of
    imports per process): megatron's groups are rebuilt for each layout; results by layout."""
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(*LAYOUTS[0], seed=4, device="cpu")
    results = {}
    for tp, pp in LAYOUTS:
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=4)
        results[(tp, pp)] = _reference_vs_policy(hf_dir, f"{work_dir}/tp{tp}_pp{pp}")
    return results


def _reference_vs_policy(hf_dir, work_dir):
    from megatron.core.distributed import DistributedDataParallel

    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.checkpoint.mcore_checkpoint import save_mcore_checkpoint
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import ForwardEngine, TrainingEngine, build_policy_engine, build_reference_engine
    from grpo_mega.sft import sft_loss

    policy_engine = build_policy_engine(
        _hf_config(), optim=OptimConfig(lr=1e-2), total_steps=2, max_tokens_per_micro_batch=24
    )
    reference_engine = build_reference_engine(_hf_config(), max_tokens_per_micro_batch=24)
    # Weight loading and checkpoints see the engines through their interfaces only.
    policy = InterfaceOnly(policy_engine, TrainingEngine)
    reference = InterfaceOnly(reference_engine, ForwardEngine)
    result = {"kinds": [], "logprobs": {}}
    batch = _batch()

    def compare(name):
        result["logprobs"][name] = (policy.forward_logprobs(batch), reference.forward_logprobs(batch))

    result["kinds"] += [load_initial_weights(policy, hf_dir), load_initial_weights(reference, hf_dir)]
    compare("hf")
    policy.train_step(batch, sft_loss)  # the policy moves away; the reference follows it through each format
    CheckpointManager(f"{work_dir}/run").save(policy, 1)
    result["kinds"].append(load_initial_weights(reference, f"{work_dir}/run"))
    compare("training_run")
    policy.train_step(batch, sft_loss)
    save_mcore_checkpoint(policy_engine.stage, f"{work_dir}/mcore", hf_dir)
    result["kinds"].append(load_initial_weights(reference, f"{work_dir}/mcore"))
    compare("mcore_model")

    records = _Records()
    logger = logging.getLogger("grpo_mega.checkpoint.initial_weights")
    logger.addHandler(records)
    try:
        result["kinds"].append(load_initial_weights(reference, None))
    finally:
        logger.removeHandler(records)
    result["warnings"] = records.messages
    stage = reference_engine.stage
    result["requires_grad"] = [name for name, p in stage.named_parameters() if p.requires_grad]
    result["training_modules"] = [name for name, m in stage.named_modules() if m.training]
    result["has_optimizer"] = any(hasattr(reference_engine, name) for name in ("optimizer", "scheduler", "train_step"))
    result["wrapped_in_ddp"] = isinstance(reference_engine.model, DistributedDataParallel)
    result["grads"] = [name for name, p in stage.named_parameters() if p.grad is not None]
    return result


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    Qwen2ForCausalLM(_hf_config()).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def layout_results(hf_dir, tmp_path_factory):
    """Rank by rank, ``_reference_vs_policy``'s results by layout."""
    return run_distributed(_reference_vs_policy_at_layouts, 2, hf_dir, str(tmp_path_factory.mktemp("work")))


@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_reference_engine_matches_policy_without_optimizer_or_gradients(layout_results, tp, pp):
    per_rank = [by_layout[(tp, pp)] for by_layout in layout_results]
    for result in per_rank:
        assert result["kinds"] == ["hf", "hf", "training_run", "mcore_model", "random"]
        for name, (policy_outputs, reference_outputs) in result["logprobs"].items():  # (log-probs, entropies)
            # To float32 rounding, not bit for bit: megatron's linear layers take another kernel path for
            # frozen weights (tensor_parallel.layers.linear_with_frozen_weight). The rounding differs between CPUs:
            # 1 ulp of log-probs ~ -9 on one machine, up to 3.5e-6 (~4 ulp) at TP=2 on another; a wrong weight
            # moves them by more than 1e-3 (below).
            torch.testing.assert_close(reference_outputs, policy_outputs, atol=1e-5, rtol=1e-5, msg=name)
        moved = (result["logprobs"]["mcore_model"][0][0] - result["logprobs"]["hf"][0][0]).abs().max().item()
        assert moved > 1e-3  # each format brought different weights, so each comparison means something
        assert result["requires_grad"] == [] and result["grads"] == []
        assert result["training_modules"] == []
        assert not result["has_optimizer"] and not result["wrapped_in_ddp"]
    assert "starts from random weights" in per_rank[0]["warnings"][0]
