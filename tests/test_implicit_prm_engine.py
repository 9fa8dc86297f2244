"""The implicit PRM (PRIME) through the real megatron engine at TP=2 and PP=2 (gloo) against plain PyTorch on the
same weights: token rewards, PRIME's loss, its outcome accuracy, the global gradient norm and a gradient, 1e-5."""

import pytest
import torch

from dist_utils import right_padded_rows, run_distributed, tiny_qwen2_config

BETA = 0.5
LAYOUTS = [(2, 1), (1, 2)]
LABELS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])


def _hf_config():
    return tiny_qwen2_config(tied=False)


def _batch():
    return right_padded_rows(5)


def _engine_results_at_layouts(prm_dir, ref_dir):
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(*LAYOUTS[0], seed=4, device="cpu")
    results = {}
    for tp, pp in LAYOUTS:
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=4)
        results[(tp, pp)] = _engine_results(prm_dir, ref_dir)
    return results


def _engine_results(prm_dir, ref_dir):
    from grpo_mega.algo.implicit_reward import implicit_token_rewards
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine, build_reference_engine
    from grpo_mega.stages.implicit_prm import implicit_prm_loss_fn

    # clip_grad 0: the gradient buffers keep the raw gradient after the step
    engine = build_policy_engine(_hf_config(), optim=OptimConfig(lr=1e-3, clip_grad=0.0), total_steps=2,
                                 max_tokens_per_micro_batch=24)
    reference = build_reference_engine(_hf_config(), max_tokens_per_micro_batch=24)
    load_initial_weights(engine, prm_dir)
    load_initial_weights(reference, ref_dir)
    batch = _batch()
    ref_logprobs, _ = reference.forward_logprobs(batch)
    prm_logprobs, _ = engine.forward_logprobs(batch)
    rewards = implicit_token_rewards(prm_logprobs, ref_logprobs, batch["loss_mask"], BETA)
    step = engine.train_step({**batch, "ref_logprobs": ref_logprobs, "outcome_labels": LABELS},
                             implicit_prm_loss_fn(BETA))
    norm_grad = None
    for name, param in engine.stage.named_parameters():
        if name.endswith("final_layernorm.weight"):
            norm_grad = param.main_grad.detach().clone()
    return {"rewards": rewards, "loss": step["loss"], "grad_norm": step["grad_norm"],
            "accuracy": step["outcome_accuracy"], "norm_grad": norm_grad}


def _plain_pytorch(prm_dir, ref_dir):
    """The same quantities from transformers models and the algo functions, in one process."""
    from transformers import Qwen2ForCausalLM

    from grpo_mega.algo.implicit_reward import (implicit_outcome_loss, implicit_token_rewards,
                                                outcome_prediction_accuracy)

    batch = _batch()

    def logprobs(model):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        picked = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return torch.cat([torch.zeros(len(picked), 1), picked], dim=1)  # position t: log p(token t)

    prm = Qwen2ForCausalLM.from_pretrained(prm_dir, torch_dtype=torch.float32)
    ref = Qwen2ForCausalLM.from_pretrained(ref_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        ref_logprobs = logprobs(ref)
    rewards = implicit_token_rewards(logprobs(prm), ref_logprobs, batch["loss_mask"], BETA)
    loss = implicit_outcome_loss(rewards, LABELS)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in prm.parameters() if p.grad is not None))
    return {"rewards": rewards.detach(), "loss": float(loss.detach()), "grad_norm": float(grad_norm),
            "accuracy": outcome_prediction_accuracy(rewards.detach(), LABELS), "norm_grad": prm.model.norm.weight.grad}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    made = []
    for seed in (0, 1):  # the implicit PRM, its reference: different weights, so the rewards are not 0
        folder = tmp_path_factory.mktemp(f"hf{seed}")
        torch.manual_seed(seed)
        Qwen2ForCausalLM(_hf_config()).save_pretrained(folder)
        made.append(str(folder))
    return made


@pytest.fixture(scope="module")
def layout_results(folders):
    return run_distributed(_engine_results_at_layouts, 2, *folders)


@pytest.mark.parametrize("tp, pp", LAYOUTS)
def test_token_rewards_loss_and_gradients_match_plain_pytorch(folders, layout_results, tp, pp):
    expected = _plain_pytorch(*folders)
    assert expected["rewards"].abs().max() > 0.1  # the two models differ: a wrong side would show
    for rank, by_layout in enumerate(layout_results):
        got = by_layout[(tp, pp)]
        torch.testing.assert_close(got["rewards"], expected["rewards"], atol=1e-5, rtol=0)
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        assert got["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
        if got["norm_grad"] is not None:  # the last pipeline stage's
            torch.testing.assert_close(got["norm_grad"], expected["norm_grad"], atol=1e-5, rtol=0)
        elif pp == 1:
            pytest.fail(f"rank {rank} has no final norm at PP=1")
