"""The Megatron engine: one GRPO optimizer step is the same at every TP / PP / DP layout and micro-batch size,
also for a batch with fewer rows than data-parallel ranks; every policy-loss form (``algorithm.policy_loss``) equals
its hand-computed value at TP1, TP2, PP2, DP2, packed and unpacked rows, and 1 and 4 micro-batches.

Every spawned process pays ~10 s of imports (torch, megatron, transformers) before any work, so the file's work runs
in two jobs (module fixtures): one process for the reference weights and everything at world size 1, then two
processes that switch layout in place (destroy_model_parallel / init_model_parallel, as a job that loads a
checkpoint at one layout and uses it at another does) for everything at world size 2. Each test asserts on its part
of the results."""

import pytest
import torch

from dist_utils import run_distributed

VOCAB = 301


def _hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )


def _batch():
    """Six rows of different lengths; the first 3 tokens are the prompt."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 9, 5, 12, 10])
    input_ids = torch.randint(0, VOCAB, (6, 12), generator=generator)
    attention_mask = (torch.arange(12) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    advantages = torch.randn(6, 1, generator=generator).expand(6, 12).contiguous()
    old_logprobs = -torch.rand(6, 12, generator=generator) * 6 - 2
    return dict(
        input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
        advantages=advantages, old_logprobs=old_logprobs,
    )


def _engine(budget, share_prompt_prefix=False):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    # Adam's first step is lr * g / (|g| + eps): with the default eps = 1e-8 a near-zero gradient entry turns
    # reduction-order noise (~1e-9) into 1e-4 of update. eps = 1e-4 keeps the comparison about the gradients.
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_eps=1e-4)
    return build_policy_engine(
        _hf_config(), optim=optim, total_steps=4,
        max_tokens_per_micro_batch=budget, share_prompt_prefix=share_prompt_prefix,
    )


def _grpo_step(engine, ref_dir, out_dir=None):
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    engine.load_model_weights(ref_dir)
    settings = GRPOLossSettings(clip_high=0.28, kl_coef=0.0, loss_agg_mode="seq-mean-token-mean")
    metrics = engine.train_step(_batch(), grpo_loss_fn(settings))
    if out_dir is not None:
        engine.save_model_weights(out_dir)
    return metrics


def _switch_layout(tp, pp):
    from grpo_mega.parallel import destroy_model_parallel, init_model_parallel

    destroy_model_parallel()
    init_model_parallel(tp, pp, seed=7)


# budget 24 tokens: micro-batches of 1-3 rows of different padded lengths
LAYOUT_BUDGET = 24
# 1000 tokens: one micro-batch; 12: one row per micro-batch; 30: mixed.
BUDGETS = [1000, 12, 30]
# (tp, pp) of the two-process layouts of test_one_step_equal_across_layouts; tp1 is the one-process run
TWO_RANK_LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def _one_row_step(ref_dir, row):
    """forward_logprobs and one GRPO step on a batch of one row, at DP = world size (layout TP=1, PP=1)."""
    engine = _engine(1000)
    engine.load_model_weights(ref_dir)
    batch = {name: value[row : row + 1] for name, value in _batch().items()}
    logprobs, entropy = engine.forward_logprobs(batch)
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    settings = GRPOLossSettings(clip_high=0.28, kl_coef=0.0, loss_agg_mode="seq-mean-token-mean")
    metrics = engine.train_step(batch, grpo_loss_fn(settings))
    params = {name: p.detach().clone() for name, p in engine.stage.named_parameters()}
    return {"logprobs": logprobs, "entropy": entropy, "metrics": metrics, "params": params}


def _loss_token_logprobs(ref_dir):
    """forward_logprobs of the whole rows and with ``loss_tokens_only`` (budget 24: several micro-batches)."""
    engine = _engine(LAYOUT_BUDGET)
    engine.load_model_weights(ref_dir)
    return {"every": engine.forward_logprobs(_batch()), "loss_tokens": engine.forward_logprobs(_batch(), True)}


def _max_and_sum_loss(outputs, micro, scale):
    """A loss whose metrics are a share (summed) and a maximum (``*_max``) over the micro-batch's real tokens."""
    mask = micro["loss_mask"].bool()
    tokens = micro["input_ids"].float()
    metrics = {
        "probe/token_share": mask.sum() / scale.global_tokens,
        "probe/token_id_max": tokens[mask].max() if mask.any() else torch.tensor(-1.0),
    }
    return (outputs["logprobs"] * mask).sum() / scale.global_tokens, metrics


def _probe_step(ref_dir):
    engine = _engine(LAYOUT_BUDGET)  # several micro-batches per rank
    engine.load_model_weights(ref_dir)
    return engine.train_step(_batch(), _max_and_sum_loss)


def _params_of(directories):
    """Every parameter of each checkpoint in ``directories``, loaded at the current layout (TP=1, PP=1)."""
    engine = _engine(1000)
    out = []
    for directory in directories:
        engine.load_model_weights(directory)
        out.append({name: p.detach().clone() for name, p in engine.stage.named_parameters()})
    return out


# ----------------------------------------------------------------------------- policy-loss forms
FORMS = {  # form -> (loss_agg_mode, its clip range, the scale of logp - old_logp: some tokens / sequences clipped)
    "gspo": ("seq-mean-token-mean", dict(clip_low=3e-4, clip_high=4e-4), 4e-4),
    "gspo_token": ("seq-mean-token-mean", dict(clip_low=3e-4, clip_high=4e-4), 4e-4),
    "gmpo": ("seq-mean-token-mean", dict(clip_low=0.4, clip_high=0.4), 0.4),
    "cispo": ("token-mean", dict(clip_low=None, clip_high=0.2), 0.4),
}
FORM_BUDGETS = (1000, 20)  # 1 and 4 micro-batches of _forms_batch's rows


def _forms_batch(old_logprobs=None):
    """_batch with two prompts of three rows each (packed rows share them) and ``old_logprobs`` near the policy's."""
    batch = _batch()
    batch["input_ids"][1:3, :3] = batch["input_ids"][0, :3]
    batch["input_ids"][4:6, :3] = batch["input_ids"][3, :3]
    batch["prompt_lengths"] = torch.full((6,), 3)
    if old_logprobs is not None:
        batch["old_logprobs"] = old_logprobs
    return batch


def _form_old_logprobs(ref_dir):
    """The reference weights' log-probs and, per form, old log-probs that differ from them by the form's scale."""
    engine = _engine(1000)
    engine.load_model_weights(ref_dir)
    logp, _ = engine.forward_logprobs(_forms_batch())
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    return logp, {form: logp - scale * noise for form, (_, _, scale) in FORMS.items()}


def _form_steps(ref_dir, olds, budget, share_prompt_prefix=False):
    """One step of each form from the reference weights: {form: its loss, grad norm and clip fraction}."""
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    engine = _engine(budget, share_prompt_prefix)
    assert engine.share_prompt_prefix is share_prompt_prefix
    out = {}
    for form, (agg, clip, _) in FORMS.items():
        engine.load_model_weights(ref_dir)
        settings = GRPOLossSettings(policy_loss=form, loss_agg_mode=agg, **clip)
        metrics = engine.train_step(_forms_batch(olds[form]), grpo_loss_fn(settings))
        out[form] = {name: metrics[name] for name in ("loss", "grad_norm", "actor/pg_clipfrac")}
    return out


def _one_rank_job(ref_dir, tp1_dir):
    """World size 1: save the reference weights (seeded model at TP=1 / PP=1), then from them the TP=1 step of
    each test."""
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=7, device="cpu")
    _engine(1000).save_model_weights(ref_dir)
    return {
        "layout_step": _grpo_step(_engine(LAYOUT_BUDGET), ref_dir, tp1_dir),
        "budgets": [_grpo_step(_engine(budget), ref_dir) for budget in BUDGETS],
        "one_row": _one_row_step(ref_dir, 2),
        "loss_tokens": _loss_token_logprobs(ref_dir),
        "forms": _one_rank_forms(ref_dir),
    }


def _one_rank_forms(ref_dir):
    logp, olds = _form_old_logprobs(ref_dir)
    steps = {budget: _form_steps(ref_dir, olds, budget) for budget in FORM_BUDGETS}
    return {"logp": logp, "olds": olds, "steps": steps}


def _two_rank_job(ref_dir, layout_dirs, tp1_dir, form_olds):
    """World size 2, one layout after another from the reference weights; last, every layout's saved weights
    (and the reference) read back at TP=1 / PP=1."""
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=7, device="cpu")
    out = {"layout_steps": {}, "probe": {}, "forms": {}}
    for name, (tp, pp) in TWO_RANK_LAYOUTS.items():
        _switch_layout(tp, pp)
        out["layout_steps"][name] = _grpo_step(_engine(LAYOUT_BUDGET), ref_dir, layout_dirs[name])
        out["forms"][name] = {share: _form_steps(ref_dir, form_olds, LAYOUT_BUDGET, share) for share in (False, True)}
        if name == "tp2":
            out["loss_tokens"] = _loss_token_logprobs(ref_dir)
    _switch_layout(1, 2)
    out["budgets"] = [_grpo_step(_engine(budget), ref_dir) for budget in BUDGETS]
    for tp, pp in ((1, 1), (1, 2)):
        _switch_layout(tp, pp)
        out["probe"][(tp, pp)] = _probe_step(ref_dir)
    _switch_layout(1, 1)
    out["one_row"] = _one_row_step(ref_dir, 2)
    params = _params_of([ref_dir, tp1_dir, *(layout_dirs[name] for name in TWO_RANK_LAYOUTS)])
    out["start"], out["params"] = params[0], dict(zip(["tp1", *TWO_RANK_LAYOUTS], params[1:]))
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """(reference weights dir, the world-size-1 job's results, the TP=1 step's saved weights dir)."""
    root = tmp_path_factory.mktemp("one_rank")
    ref_dir, tp1_dir = str(root / "ref"), str(root / "tp1")
    return ref_dir, run_distributed(_one_rank_job, 1, ref_dir, tp1_dir)[0], tp1_dir


@pytest.fixture(scope="module")
def two_ranks(one_rank, tmp_path_factory):
    """The world-size-2 job's results, by rank."""
    ref_dir, _, tp1_dir = one_rank
    root = tmp_path_factory.mktemp("two_ranks")
    layout_dirs = {name: str(root / name) for name in TWO_RANK_LAYOUTS}
    return run_distributed(_two_rank_job, 2, ref_dir, layout_dirs, tp1_dir, one_rank[1]["forms"]["olds"])


def test_one_step_equal_across_layouts(one_rank, two_ranks):
    # tp1: world 1; tp2 (TP=2), pp2 (PP=2), dp2 (DP=2): world 2
    metrics = {"tp1": [one_rank[1]["layout_step"]]}
    metrics.update({name: [rank["layout_steps"][name] for rank in two_ranks] for name in TWO_RANK_LAYOUTS})
    base = metrics["tp1"][0]
    for name, per_rank in metrics.items():
        for rank_metrics in per_rank:  # every rank reports the same global metrics
            assert rank_metrics["loss"] == pytest.approx(base["loss"], abs=1e-6), name
            assert rank_metrics["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5), name
    params, start = two_ranks[0]["params"], two_ranks[0]["start"]
    moved = max((params["tp1"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # the step really changed the weights
    for name, layout_params in params.items():
        for key, value in layout_params.items():
            torch.testing.assert_close(value, params["tp1"][key], atol=1e-5, rtol=0, msg=f"{name}: {key}")


@pytest.mark.parametrize("tp, pp, world", [(1, 1, 1), (1, 2, 2)])
def test_micro_batch_size_does_not_change_loss_or_gradient(one_rank, two_ranks, tp, pp, world):
    # BUDGETS: 1000 tokens, one micro-batch; 12, one row per micro-batch; 30, mixed (rank 0's results)
    results = {(1, 1, 1): one_rank[1]["budgets"], (1, 2, 2): two_ranks[0]["budgets"]}[(tp, pp, world)]
    whole, *split = results
    for metrics in split:
        assert metrics["loss"] == pytest.approx(whole["loss"], abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
        assert metrics["actor/pg_clipfrac"] == pytest.approx(whole["actor/pg_clipfrac"], abs=1e-6)


def test_batch_with_fewer_rows_than_data_parallel_ranks(one_rank, two_ranks):
    """Dynamic sampling can leave 1 row for 2 DP ranks: the rank without rows computes a padding row that adds
    nothing, so the step equals a single-process step on that row."""
    single = one_rank[1]["one_row"]
    dp2 = [rank["one_row"] for rank in two_ranks]
    assert single["metrics"]["loss"] != 0.0 and single["metrics"]["grad_norm"] > 0
    for rank in dp2:
        torch.testing.assert_close(rank["logprobs"], single["logprobs"], atol=1e-6, rtol=0)
        torch.testing.assert_close(rank["entropy"], single["entropy"], atol=1e-6, rtol=0)
        assert rank["metrics"].keys() == single["metrics"].keys()
        for name in ("loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/entropy", "actor/ppo_kl"):
            assert rank["metrics"][name] == pytest.approx(single["metrics"][name], abs=1e-6), name
        assert rank["metrics"]["grad_norm"] == pytest.approx(single["metrics"]["grad_norm"], rel=1e-6)
        for name, value in single["params"].items():
            torch.testing.assert_close(rank["params"][name], value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("tp, pp, world", [(1, 1, 2), (1, 2, 2)])
def test_metrics_named_max_are_maxima_over_micro_batches_and_ranks(two_ranks, tp, pp, world):
    batch = _batch()
    expected_max = float(batch["input_ids"][batch["loss_mask"].bool()].max())
    for metrics in (rank["probe"][(tp, pp)] for rank in two_ranks[:world]):
        assert metrics["probe/token_id_max"] == expected_max
        assert metrics["probe/token_share"] == pytest.approx(1.0)


def test_loss_tokens_only_computes_the_loss_masks_tokens_alone(one_rank, two_ranks):
    """What GRPO keeps of the old / reference log-probs: at loss_mask's tokens the same values as the whole rows'
    forward, 0 at the prompt and the padding (the output matrix never ran there); at TP=1 and TP=2."""
    mask = _batch()["loss_mask"].bool()
    for found in (one_rank[1]["loss_tokens"], *(rank["loss_tokens"] for rank in two_ranks)):
        (every_logprobs, every_entropy), (logprobs, entropy) = found["every"], found["loss_tokens"]
        torch.testing.assert_close(logprobs[mask], every_logprobs[mask], atol=1e-6, rtol=0)
        torch.testing.assert_close(entropy[mask], every_entropy[mask], atol=1e-6, rtol=0)
        assert (every_logprobs[~mask & (_batch()["attention_mask"] > 0)] != 0).any()  # the whole rows' are not 0
        assert not logprobs[~mask].any() and not entropy[~mask].any()


def _hand_loss(form, logp, old, batch):
    """The step's loss by hand, float64, one row (sequence) at a time: the formulas of docs/training.md."""
    agg, clip, _ = FORMS[form]
    low, high = clip["clip_low"], clip["clip_high"]
    mask = batch["loss_mask"].bool()
    tokens, seqs = int(mask.sum()), int(mask.any(dim=1).sum())
    total = 0.0
    for i in range(mask.shape[0]):
        at = mask[i]
        d = (logp[i][at] - old[i][at]).double()
        a = batch["advantages"][i][at].double()
        if form in ("gspo", "gspo_token"):  # one ratio s_i = exp(mean_t d); a mean over sequences
            s = torch.exp(d.mean())
            total += torch.maximum(-a * s, -a * s.clamp(1 - low, 1 + high)).mean().item() / seqs
        elif form == "gmpo":  # geometric mean of the pessimistic (log-space clipped) token ratios
            bounded = d.clamp(-low, high)
            kept = torch.minimum(d, bounded) if a[0] >= 0 else torch.maximum(d, bounded)
            total += (-a[0] * torch.exp(kept.mean())).item() / seqs
        else:  # cispo: -sg(min(r, 1 + high)) A log pi, a mean over tokens
            total += (-torch.exp(d).clamp(max=1 + high) * a * logp[i][at].double()).sum().item() / tokens
    return total


@pytest.mark.parametrize("form", sorted(FORMS))
def test_policy_loss_forms_equal_their_hand_value_at_every_layout(one_rank, two_ranks, form):
    """TP1 at 1 and 4 micro-batches, then TP2, PP2 and DP2 with rows and with packed rows (two sequences of a
    prompt in one packed row): the loss is the hand-computed one (1e-6) and the gradient norm the same (1e-5)."""
    forms = one_rank[1]["forms"]
    batch = _forms_batch()
    expected = _hand_loss(form, forms["logp"], forms["olds"][form], batch)
    runs = {f"tp1 {budget}": [forms["steps"][budget][form]] for budget in FORM_BUDGETS}
    for layout in TWO_RANK_LAYOUTS:
        for share in (False, True):
            name = f"{layout} {'packed' if share else 'rows'}"
            runs[name] = [rank["forms"][layout][share][form] for rank in two_ranks]
    base = forms["steps"][FORM_BUDGETS[0]][form]
    assert base["grad_norm"] > 1e-3
    assert 0 < base["actor/pg_clipfrac"] < 1  # the clip is exercised, and not everywhere
    for name, per_rank in runs.items():
        for metrics in per_rank:
            assert metrics["loss"] == pytest.approx(expected, abs=1e-6), name
            assert metrics["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5), name
            assert metrics["actor/pg_clipfrac"] == pytest.approx(base["actor/pg_clipfrac"], abs=1e-6), name
