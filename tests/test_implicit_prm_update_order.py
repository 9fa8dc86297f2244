"""``implicit_prm.update: after`` (PRIME's other order) through the real megatron engine: the step rewards come from
the log-probs of the update's own forward (``MegatronEngine.train_step_with_outputs``), so they equal the rewards of a
separate forward of the PRM before the update (1e-6, fp32), at 1 process and at TP=2, DP=2 and PP=2 on 2 gloo
processes, with the prompt packed once per group and the accuracy filter leaving a group out of the update (its rows
scored by a forward of their own). The update itself is the one ``update: before`` makes; ``before`` scores with the
updated PRM."""

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

BETA = 0.5
G = 3
PROMPTS = [[5, 6, 7, 8], [9, 10]]
RESPONSES = ["ab\ncd\ne", "abc\n", "a\nbcdef", "xy\nz", "x\nyz\nw", "q"]
# group 0: 1 of 3 right (inside the accuracy filter's [0.2, 0.8]); group 1: all right (left out of the update)
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
WORLD2_LAYOUTS = [(2, 1), (1, 1), (1, 2)]  # TP=2, DP=2, PP=2


def _hf_config():
    return tiny_qwen2_config(tied=False)


def _decode(ids):  # one character per token
    return "".join(chr(i) for i in ids)


def _groups():
    from grpo_mega.data.prompts import PromptRecord
    from grpo_mega.rollout.base import Completion
    from grpo_mega.stages.rollout import RolloutBatch

    records = [PromptRecord(prompt=f"Q{i}", prompt_ids=ids, answer="1", raw_prompt=f"Q{i}", source="t", extra={})
               for i, ids in enumerate(PROMPTS)]
    completions = [Completion(prompt_index=row // G, prompt_ids=PROMPTS[row // G], response_ids=[ord(c) for c in text],
                              text=text, response_logprobs=[0.0] * len(text), finish_reason="eos")
                   for row, text in enumerate(RESPONSES)]
    scores = torch.tensor(SCORES)
    return RolloutBatch(records, completions, scores.clone(), scores)


def _implicit_prm(update: str, prm_dir: str, ref_dir: str):
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.config import GRPOConfig, OptimConfig
    from grpo_mega.engine import build_policy_engine, build_reference_engine
    from grpo_mega.stages.implicit_prm import ImplicitPRM

    cfg = GRPOConfig()
    cfg.algorithm.num_return_sequences_in_group = G
    cfg.process_reward.step_pattern = r"\n"
    settings = cfg.implicit_prm
    settings.update, settings.beta, settings.steps, settings.accuracy_filter = update, BETA, "tokens", True
    # a budget of a few rows per micro-batch: several micro-batches, packed by prompt
    shared = dict(max_tokens_per_micro_batch=24, share_prompt_prefix=True)
    engine = build_policy_engine(_hf_config(), optim=OptimConfig(lr=1e-2), total_steps=2, **shared)
    reference = build_reference_engine(_hf_config(), **shared)
    load_initial_weights(engine, prm_dir)
    load_initial_weights(reference, ref_dir)
    return ImplicitPRM(engine, reference, cfg, decode=_decode, pad_id=0, owns_reference=True, answer_guard=None)


def _orders(prm_dir, ref_dir):
    """Both orders from the same weights: their rewards and metrics, and the rewards of separate forwards of the PRM
    before and after the update, pushed through the same step shaping."""
    from grpo_mega.algo.implicit_reward import implicit_token_rewards

    results = {}
    for update in ("after", "before"):
        prm, groups = _implicit_prm(update, prm_dir, ref_dir), _groups()
        rows = prm._rows(groups.completions)
        ref_logprobs, _ = prm.reference.forward_logprobs(rows)

        def separate_forward():
            logprobs, _ = prm.engine.forward_logprobs(rows)
            token_rewards = implicit_token_rewards(logprobs, ref_logprobs, rows["loss_mask"], BETA)
            return prm._step_rewards(groups, token_rewards, rows["prompt_lengths"])[0]

        before_update = separate_forward()
        scored, metrics = prm.run(groups)
        results[update] = {"rewards": scored.step_rewards, "ends": scored.step_ends, "metrics": metrics,
                           "pre_update": before_update, "post_update": separate_forward()}
    return results


def _orders_at_layouts(prm_dir, ref_dir):
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(*WORLD2_LAYOUTS[0], seed=4, device="cpu")
    results = {}
    for tp, pp in WORLD2_LAYOUTS:
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=4)
        results[(tp, pp)] = _orders(prm_dir, ref_dir)
    return results


def _orders_on_one_process(prm_dir, ref_dir):
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=4, device="cpu")
    return {(1, 1): _orders(prm_dir, ref_dir)}


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
def by_layout(folders):
    """{(world size, tp, pp): the results of every rank}."""
    one = run_distributed(_orders_on_one_process, 1, *folders)
    two = run_distributed(_orders_at_layouts, 2, *folders)
    layouts = {(1, 1, 1): [one[0][(1, 1)]]}
    for tp, pp in WORLD2_LAYOUTS:
        layouts[(2, tp, pp)] = [rank[(tp, pp)] for rank in two]
    return layouts


def _assert_close(got, expected, tolerance):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=tolerance, rtol=0)


@pytest.mark.parametrize("world, tp, pp", [(1, 1, 1), (2, 2, 1), (2, 1, 1), (2, 1, 2)])
def test_after_scores_with_the_prm_before_its_update(by_layout, world, tp, pp):
    for result in by_layout[(world, tp, pp)]:  # every rank
        after, before = result["after"], result["before"]
        # the update ran on group 0 only, and moved the PRM: its rewards before and after differ
        assert after["metrics"]["implicit_prm/update_fraction"] == pytest.approx(1 / 2)
        moved = max(abs(a - b) for x, y in zip(after["pre_update"], after["post_update"]) for a, b in zip(x, y))
        assert moved > 1e-3
        # after: exactly the rewards of a separate forward of the PRM before the update, the left-out group's too
        _assert_close(after["rewards"], after["pre_update"], 1e-6)
        assert any(abs(r) > 0.05 for rewards in after["rewards"][G:] for r in rewards)
        # before (unchanged): the updated PRM's rewards, from the same update as after's
        _assert_close(before["rewards"], before["post_update"], 1e-6)
        for name in ("implicit_prm/loss", "implicit_prm/grad_norm", "implicit_prm/outcome_accuracy"):
            assert after["metrics"][name] == pytest.approx(before["metrics"][name], rel=1e-6, abs=1e-9), name
        assert after["ends"] == before["ends"]


def test_every_layout_gives_the_same_rewards(by_layout):
    expected = by_layout[(1, 1, 1)][0]["after"]["rewards"]
    for layout, results in by_layout.items():
        for result in results:
            _assert_close(result["after"]["rewards"], expected, 1e-5)
