"""Shared-prompt micro-batches (``grpo_mega.engine.shared_prefix``): the packing is exact.

The index tensors rebuild every row from the packed tokens; groups are kept whole on one rank unless they exceed
the budget; and through the Megatron engine at TP=2, PP=2 and DP=2 the packed path gives the same log-probs,
entropies, loss, gradient norm and updated weights as the row path, with fewer tokens through the layers.
"""

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config
from grpo_mega.data.batch import sequences_to_batch
from grpo_mega.engine.shared_prefix import prompt_groups, rank_shared_prefix_micro_batches

VOCAB = 301


def _grouped_batch(groups=5, group_size=4, seed=0):
    """``groups`` prompts of 2-8 tokens with ``group_size`` responses of 0-11 tokens each, GRPO fields set."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        return torch.randint(0, VOCAB, (int(torch.randint(low, high, (1,), generator=generator)),),
                             generator=generator).tolist()

    prompts, responses = [], []
    for _ in range(groups):
        prompt = tokens(2, 9)
        for _ in range(group_size):
            prompts.append(prompt)
            responses.append(tokens(0, 12))
    batch = sequences_to_batch(prompts, responses, pad_id=0)
    rows, width = batch["input_ids"].shape
    batch["advantages"] = torch.randn(rows, 1, generator=generator).expand(rows, width) * batch["loss_mask"]
    batch["rollout_logprobs"] = -torch.rand(rows, width, generator=generator) * 4 * batch["loss_mask"]
    batch["old_logprobs"] = batch["rollout_logprobs"].clone()
    return batch


def _packed_tokens(batch):
    """Tokens of the batch with one copy of each prompt."""
    lengths, prompts = batch["attention_mask"].sum(1), batch["prompt_lengths"]
    groups = prompt_groups(batch["input_ids"], prompts)
    return sum(int(prompts[g[0]]) + int((lengths[g] - prompts[g]).sum()) for g in groups)


def test_prompt_groups_match_equal_prompts_only():
    ids = torch.tensor([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 9], [1, 2, 3, 9], [1, 2, 3, 9]])
    # rows 0/1/3 share prompt [1, 2, 3]; row 2 differs in a token; row 4 has the same tokens but a longer prompt
    groups = prompt_groups(ids, torch.tensor([3, 3, 3, 3, 4]))
    assert groups == [[0, 1, 3], [2], [4]]


@pytest.mark.parametrize("budget", [1000, 40, 15, 1])
def test_packed_micro_batches_rebuild_every_row(budget):
    batch = _grouped_batch()
    micro_batches, padding = rank_shared_prefix_micro_batches(batch, budget, 0, 1)
    assert padding == 0.0
    seen, packed_total = [], 0
    for micro in micro_batches:
        ids, mask = micro["input_ids"], micro["attention_mask"].bool()
        packed = ids.reshape(-1)[micro["packed_source"]]
        rebuilt = packed[micro["packed_row_gather"]]
        assert torch.equal(rebuilt[mask], ids[mask])  # every real token of every row, from the packed sequence
        positions = micro["packed_positions"][micro["packed_row_gather"]]
        assert torch.equal(positions[mask], torch.arange(ids.shape[1]).expand_as(ids)[mask])
        # padding positions point at a token of their own row at or before its end (never another row's)
        lengths = mask.sum(1)
        assert (positions[~mask] <= (lengths[:, None] - 1).expand_as(ids)[~mask]).all()
        packed_total += len(micro["packed_source"])
        if budget >= 15:  # a unit fits: no micro-batch exceeds the budget
            assert len(micro["packed_source"]) <= budget
        seen += micro["row_index"].tolist()
    assert sorted(seen) == list(range(len(batch["input_ids"])))
    if budget == 1000:  # one micro-batch, each prompt once
        assert len(micro_batches) == 1 and packed_total == _packed_tokens(batch)
    if budget >= 15:  # rows of a prompt share a micro-batch: fewer tokens than the rows hold
        assert packed_total < int(batch["attention_mask"].sum())
    else:  # a budget below every unit: one row per unit, nothing shared
        assert packed_total == int(batch["attention_mask"].sum())


def test_groups_stay_whole_and_ranks_share_the_tokens():
    batch = _grouped_batch(groups=6)
    per_rank = [rank_shared_prefix_micro_batches(batch, 1000, rank, 2)[0] for rank in range(2)]
    owner = {}
    for rank, micro_batches in enumerate(per_rank):
        for micro in micro_batches:
            for row in micro["row_index"].tolist():
                owner[row] = rank
    assert sorted(owner) == list(range(24))
    for group in prompt_groups(batch["input_ids"], batch["prompt_lengths"]):
        assert len({owner[row] for row in group}) == 1
    loads = [sum(len(m["packed_source"]) for m in micro_batches) for micro_batches in per_rank]
    assert abs(loads[0] - loads[1]) <= max(_packed_tokens(batch) // 6, 1) * 2


def test_a_rank_without_rows_gets_a_padding_micro_batch():
    batch = _grouped_batch(groups=1)
    micro_batches, padding = rank_shared_prefix_micro_batches(batch, 1000, 1, 2)
    assert padding == 1.0 and len(micro_batches) == 1
    assert micro_batches[0]["loss_mask"].sum() == 0 and "packed_source" not in micro_batches[0]


def test_prompt_longer_than_row_is_an_error():
    batch = _grouped_batch(groups=1)
    batch["prompt_lengths"] = batch["prompt_lengths"] + 50
    with pytest.raises(ValueError, match="prompt"):
        rank_shared_prefix_micro_batches(batch, 1000, 0, 1)


# ----------------------------------------------------------------------------- through the engine
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
BUDGETS = [1000, 30]


def _run(share, budget, ref_dir):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    # adam_eps 1e-4: see tests/test_engine_megatron.py (reduction-order noise in near-zero gradient entries)
    engine = build_policy_engine(tiny_qwen2_config(tied=False), optim=OptimConfig(lr=1e-2, clip_grad=0.5, adam_eps=1e-4),
                                 total_steps=2, max_tokens_per_micro_batch=budget, share_prompt_prefix=share)
    assert engine.share_prompt_prefix is share
    engine.load_model_weights(ref_dir)
    batch = _grouped_batch()
    logprobs, entropy = engine.forward_logprobs(batch)
    settings = GRPOLossSettings(clip_high=0.28, kl_coef=0.0, loss_agg_mode="token-mean")
    metrics = engine.train_step(batch, grpo_loss_fn(settings))
    mask = batch["attention_mask"].bool()
    state = {k: v.detach().clone() for k, v in engine.stage.named_parameters()}
    return {"logprobs": logprobs[mask], "entropy": entropy[mask], "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"], "padding": engine.last_padding_fraction, "params": state,
            "layer_tokens": metrics["layer_tokens"]}


def _job(ref_dir):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(1, 1, seed=3, device="cpu")
    build_policy_engine(tiny_qwen2_config(tied=False), optim=OptimConfig(), total_steps=1,
                        max_tokens_per_micro_batch=1000).save_model_weights(ref_dir)
    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=3)
        for budget in BUDGETS:
            out[(name, budget)] = {share: _run(share, budget, ref_dir) for share in (False, True)}
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return run_distributed(_job, 2, str(tmp_path_factory.mktemp("shared_prefix") / "ref"))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("budget", BUDGETS)
def test_packed_engine_step_equals_row_step(layouts, layout, budget):
    for rank in layouts:
        rows, packed = rank[(layout, budget)][False], rank[(layout, budget)][True]
        assert packed["padding"] == 0.0
        torch.testing.assert_close(packed["logprobs"], rows["logprobs"], atol=2e-5, rtol=0)
        torch.testing.assert_close(packed["entropy"], rows["entropy"], atol=2e-5, rtol=0)
        assert packed["loss"] == pytest.approx(rows["loss"], abs=1e-6)
        assert packed["grad_norm"] == pytest.approx(rows["grad_norm"], rel=1e-5)
        assert rows["grad_norm"] > 1e-3
        # the step reports the token slots it put through the layers (over all data-parallel ranks)
        assert packed["layer_tokens"] < rows["layer_tokens"]
        if budget == 1000:  # no group split: each prompt once
            assert packed["layer_tokens"] == _packed_tokens(_grouped_batch())
        for key, value in rows["params"].items():
            torch.testing.assert_close(packed["params"][key], value, atol=1e-5, rtol=0, msg=key)
