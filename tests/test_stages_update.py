"""The update runner on the real Megatron engine (2 gloo processes, TP=2): branches that a default run never
takes. Several updates per step compute old log-probs first (the ratio is exactly 1 at the first mini-batch);
the KL loss against a forward-only reference is 0 while the policy equals the reference and grows after.

Every case runs in one job of 2 processes (module fixture ``cases``; a spawn costs ~10 s of imports per process),
each from freshly seeded groups and its own engines."""

import pytest
import torch

from dist_utils import run_distributed

VOCAB = 301
G = 2


def _hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2,
    )


def _batch():
    """Eight rows (4 groups of G=2) of different lengths; the first 3 tokens are the prompt."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 9, 5, 12, 10, 8, 11])
    input_ids = torch.randint(0, VOCAB, (8, 12), generator=generator)
    attention_mask = (torch.arange(12) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    advantages = torch.randn(8, 1, generator=generator).expand(8, 12) * loss_mask
    rollout_logprobs = -torch.rand(8, 12, generator=generator) * loss_mask
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                advantages=advantages.contiguous(), rollout_logprobs=rollout_logprobs)


class _Timer:
    def __init__(self):
        self.phases = []

    def __call__(self, phase):
        import contextlib

        self.phases.append(phase)
        return contextlib.nullcontext()


def _run_updates(algorithm_overrides: dict, steps: int, weights_dir: str):
    from grpo_mega.config import AlgorithmConfig, OptimConfig
    from grpo_mega.engine import build_policy_engine, build_reference_engine
    from grpo_mega.stages import UpdateRunner

    algorithm = AlgorithmConfig(num_return_sequences_in_group=G, rollout_batch_size=4, response_length=9,
                                **algorithm_overrides)
    policy = build_policy_engine(_hf_config(), optim=OptimConfig(lr=1e-2), total_steps=steps,
                                 max_tokens_per_micro_batch=40)
    reference = None
    if algorithm.use_kl_loss:
        policy.save_model_weights(weights_dir)
        reference = build_reference_engine(_hf_config(), max_tokens_per_micro_batch=40)
        reference.load_model_weights(weights_dir)
    records = []
    original_train_step = policy.train_step

    def recording_train_step(batch, loss_fn):
        record = original_train_step(batch, loss_fn)
        records.append(record)
        return record

    policy.train_step = recording_train_step
    runner = UpdateRunner(policy, reference, algorithm, seed=0)
    results = []
    for step in range(1, steps + 1):
        timer, batch = _Timer(), _batch()
        metrics = runner.run(batch, 4, step, timer)
        results.append({"metrics": metrics, "phases": timer.phases, "has_old": "old_logprobs" in batch})
        policy.lr_schedule_step()
    return {"steps": results, "updates": records}


KL_ESTIMATORS = ["k1", "k2", "k3"]
# name: (algorithm overrides, steps)
CASES = {
    "ppo_epochs": ({"ppo_epochs": 2, "mini_batch_size": 2}, 1),
    "on_policy": ({}, 1),
    **{f"kl_{estimator}": ({"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_estimator": estimator}, 3)
       for estimator in KL_ESTIMATORS},
}


def _run_cases(root: str) -> dict:
    """``_run_updates`` for every case of CASES at TP=2, megatron's groups rebuilt (and reseeded) before each."""
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(2, 1, seed=3, device="cpu")
    results = {}
    for name, (overrides, steps) in CASES.items():
        destroy_model_parallel()
        init_model_parallel(2, 1, seed=3)
        results[name] = _run_updates(overrides, steps, f"{root}/{name}")
    return results


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Rank 0's results of every case, by name."""
    return run_distributed(_run_cases, 2, str(tmp_path_factory.mktemp("cases")))[0]


def test_ppo_epochs_with_mini_batches_compute_old_logprobs_and_start_at_ratio_one(cases):
    out = cases["ppo_epochs"]
    step = out["steps"][0]
    assert step["has_old"] and "old_logprob" in step["phases"]
    assert step["metrics"]["actor/optimizer_steps"] == 4  # 2 epochs x 2 mini-batches of 2 groups
    first, later = out["updates"][0], out["updates"][1:]
    # the policy has not moved yet at the first mini-batch: the ratio is 1 (up to float summation order)
    assert abs(first["actor/ppo_kl"]) < 1e-6 and first["actor/pg_clipfrac"] == 0.0
    assert max(abs(u["actor/ppo_kl"]) for u in later) > 1e-4  # the policy moved
    assert "rollout/logprob_diff_mean" in step["metrics"]


def test_one_update_per_step_is_on_policy_without_an_old_logprob_pass(cases):
    out = cases["on_policy"]
    step = out["steps"][0]
    assert not step["has_old"] and "old_logprob" not in step["phases"]
    assert step["metrics"]["actor/optimizer_steps"] == 1 and step["metrics"]["actor/ppo_kl"] == 0.0


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_loss_is_zero_while_policy_equals_reference_and_grows_after(cases, estimator):
    out = cases[f"kl_{estimator}"]
    kl = [s["metrics"]["actor/kl_loss"] for s in out["steps"]]
    assert all("ref" in s["phases"] for s in out["steps"])
    assert abs(kl[0]) < 1e-6  # step one: the reference is the policy
    if estimator == "k1":  # k1 = logp - logp_ref is signed: it moves away from 0
        assert abs(kl[2]) > 1e-4
    else:
        assert kl[1] > 1e-6 and kl[2] > 1e-6
