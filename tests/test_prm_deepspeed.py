"""The PRM on the DeepSpeed engine (``engine: deepspeed``), both layouts, 2 gloo processes; the PRM and SFT configs
take the engine.

Training: three steps of ``prm.train.prm_loss`` under ZeRO-2 give the Megatron PRM's (TP=1, DP=2) losses, gradient
norms, step accuracies, step scores and weights from the same start (fp32, within 1e-4), and a run resumed from a
DeepSpeed checkpoint repeats the uninterrupted step exactly. Scoring: ``open_prm`` on a ZeRO-3 forward engine gives
the step scores transformers computes, from an HF PRM folder and from the DeepSpeed checkpoint (which the Megatron
engine opens too). A classifier PRM starts from a policy's backbone (HF folder, Megatron run, converted megatron
folder), its head untouched.

Both tests' work runs in one spawn of 2 processes (module fixture ``two_ranks``): each process pays its start-up
(torch, megatron, deepspeed, transformers) once.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from test_prm_model import (
    LENGTHS,
    SPECIAL,
    TAG_POSITIONS,
    VOCAB,
    _max_diff,
    batch,
    hf_prms,  # noqa: F401  (pytest fixture: the same two HF PRMs as test_prm_model's tests)
    reference_scores,
    tag_scores,
    write_causal_lm,
)

pytest.importorskip("deepspeed")

STEPS = 3
TOLERANCE = 1e-4


def _training_batch(tag_id: int, seed: int) -> dict[str, torch.Tensor]:
    """Six right-padded rows (the lengths and tag positions of ``test_prm_model.batch``, twice) with random tokens
    and random hard step labels as ``targets``, as ``prm.scoring.rendered_batch`` builds them."""
    generator = torch.Generator().manual_seed(seed)
    lengths, positions = LENGTHS * 2, TAG_POSITIONS * 2
    width = max(lengths)
    input_ids = torch.randint(len(SPECIAL), VOCAB, (len(lengths), width), generator=generator)
    attention_mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    loss_mask = torch.zeros_like(attention_mask)
    targets = torch.zeros(len(lengths), width)
    for row, row_positions in enumerate(positions):
        for position in row_positions:
            input_ids[row, position] = tag_id
            loss_mask[row, position] = 1
            targets[row, position] = float(torch.randint(0, 2, (), generator=generator))
    input_ids[attention_mask == 0] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, targets=targets)


def _optim():
    from grpo_mega.config import OptimConfig

    # Adam's eps well above reduction-order noise: the weights after a step compare the gradients, not the noise.
    return OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, adam_eps=1e-4, decay_style="cosine")


def _prm_engine(folder: str, layout: str, engine_kind: str, zero_stage: int = 2):
    from transformers import AutoConfig, AutoTokenizer

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.config import DeepSpeedConfig
    from prm.engines import build_prm_engine
    from prm.spec import default_spec

    engine = build_prm_engine(AutoConfig.from_pretrained(folder), default_spec(layout),
                              AutoTokenizer.from_pretrained(folder), optim=_optim(), total_steps=STEPS,
                              max_tokens_per_micro_batch=24, engine_kind=engine_kind,
                              deepspeed=DeepSpeedConfig(zero_stage=zero_stage))
    engine.load_hf_weights(HFWeights(folder))
    return engine


def _weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.export_hf_weights()}


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[name] - b[name]).abs().max().item() for name in a)


# ----------------------------------------------------------------------------- training: ZeRO-2 == Megatron, resume
def _train_and_resume(folders: dict[str, str], root: str) -> dict:
    import torch.distributed as dist

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import DeepSpeedConfig
    from prm.model import open_prm
    from prm.spec import default_spec
    from prm.train import prm_loss

    results = {}
    for layout, folder in folders.items():
        spec = default_spec(layout)
        tag = SPECIAL.index(spec.step_tag.strip())
        batches = [_training_batch(tag, seed) for seed in range(STEPS)]
        engines = {kind: _prm_engine(folder, layout, kind) for kind in ("megatron", "deepspeed")}
        start = _weights(engines["deepspeed"])
        checkpoints = CheckpointManager(f"{root}/{layout}", keep_last=1)
        config = {"engine": "deepspeed", "model": {"hf_config": folder, "tokenizer": folder}, "prm": spec.to_dict()}
        metrics: dict[str, list] = {kind: [] for kind in engines}
        for index, rows in enumerate(batches):
            if index == STEPS - 1:
                saved = checkpoints.save(engines["deepspeed"], index, config=config)
            for kind, engine in engines.items():
                metrics[kind].append(engine.train_step(rows, prm_loss))
                engine.lr_schedule_step()
        scored = batch(tag)
        result = {
            "metrics": metrics,
            "scores": {kind: tag_scores(e.forward(scored)["good_logprob"]) for kind, e in engines.items()},
            "weight_diff": _max_weight_diff(_weights(engines["megatron"]), _weights(engines["deepspeed"])),
            "moved": _max_weight_diff(_weights(engines["deepspeed"]), start),
        }
        resumed = _prm_engine(folder, layout, "deepspeed")
        loaded = checkpoints.load(resumed, saved, seed=0)
        result["resumed_at"] = (loaded.step, resumed.steps_done, resumed.current_lr)
        result["resumed_metrics"] = resumed.train_step(batches[-1], prm_loss)
        resumed.lr_schedule_step()
        result["resume_weight_diff"] = _max_weight_diff(_weights(resumed), _weights(engines["deepspeed"]))
        checkpoints.save(resumed, STEPS, config=config)
        # The DeepSpeed checkpoint opened for scoring by both engines (ZeRO-3: partitioned, forward only).
        opened = {kind: open_prm(f"{root}/{layout}", engine_kind=kind, deepspeed=DeepSpeedConfig(zero_stage=3),
                                 max_tokens_per_micro_batch=20) for kind in ("megatron", "deepspeed")}
        result["opened_scores"] = {kind: tag_scores(p.engine.forward(scored)["good_logprob"])
                                   for kind, p in opened.items()}
        results[layout] = result
    return results if dist.get_rank() == 0 else {}


def _both(folders: dict[str, str], policy: str, prm_config: str, root: str) -> dict:
    """Training and resume, then (megatron's groups rebuilt and reseeded) scoring and init from a policy."""
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    init_distributed(1, 1, seed=0, device="cpu")
    trained = _train_and_resume(folders, f"{root}/train")
    destroy_model_parallel()
    init_model_parallel(1, 1, seed=0)
    return {"train": trained, "score": _score_and_init(folders, policy, prm_config, f"{root}/score")}


@pytest.fixture(scope="module")
def two_ranks(hf_prms, tmp_path_factory):  # noqa: F811  (hf_prms: the fixture imported above)
    """Rank 0's results of both parts (the policy: a tied causal LM, and the PRM config made from it)."""
    from prm.spec import prm_hf_config_from_policy

    root = tmp_path_factory.mktemp("two_ranks")
    policy = write_causal_lm(root / "policy", seed=3, tied=True)
    prm_config = prm_hf_config_from_policy(policy, root / "prm_config", "classifier")
    return run_distributed(_both, 2, {k: str(v) for k, v in hf_prms.items()}, str(policy), str(prm_config),
                           str(root))[0]


def test_zero2_training_equals_megatron_and_resumes_exactly(two_ranks):
    results = two_ranks["train"]
    for layout, result in results.items():
        megatron, deepspeed = result["metrics"]["megatron"], result["metrics"]["deepspeed"]
        for step, (expected, got) in enumerate(zip(megatron, deepspeed)):
            where = f"{layout} step {step + 1}"
            for name in ("loss", "prm/loss", "prm/step_accuracy", "lr"):
                assert got[name] == pytest.approx(expected[name], abs=TOLERANCE), (where, name)
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=TOLERANCE), where
        assert megatron[0]["loss"] > 0.1 and megatron[-1]["loss"] != megatron[0]["loss"], layout
        assert result["moved"] > 1e-3, layout  # the steps really trained
        assert result["weight_diff"] < TOLERANCE, layout
        assert _max_diff(result["scores"]["deepspeed"], result["scores"]["megatron"]) < TOLERANCE, layout
        # resume: the checkpoint of step 2 repeats step 3 exactly
        assert result["resumed_at"] == (STEPS - 1, STEPS - 1, deepspeed[-1]["lr"])
        for name in ("loss", "grad_norm", "prm/step_accuracy"):
            assert result["resumed_metrics"][name] == deepspeed[-1][name], (layout, name)
        assert result["resume_weight_diff"] == 0.0, layout
        for kind, scores in result["opened_scores"].items():
            assert _max_diff(scores, result["scores"]["deepspeed"]) < 1e-5, (layout, kind)


# ----------------------------------------------------------------------------- scoring and init from a policy
def _score_and_init(folders: dict[str, str], policy: str, prm_config: str, root: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights, save_mcore_checkpoint
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import DeepSpeedConfig
    from grpo_mega.engine import build_policy_engine
    from prm.engines import build_prm_engine
    from prm.model import load_prm_init_weights, open_prm
    from prm.spec import default_spec

    zero3 = DeepSpeedConfig(zero_stage=3, gather_bucket_mb=1)
    results: dict = {"scores": {}}
    for layout, folder in folders.items():
        loaded = open_prm(folder, engine_kind="deepspeed", deepspeed=zero3, max_tokens_per_micro_batch=20)
        tag = SPECIAL.index(loaded.spec.step_tag.strip())
        outputs = loaded.engine.forward(batch(tag))
        total = outputs["good_logprob"].exp() + outputs["bad_logprob"].exp()
        results["scores"][layout] = {"engine": type(loaded.engine).__name__, "spec": loaded.spec,
                                     "scores": tag_scores(outputs["good_logprob"]),
                                     "sum_to_one": float((total - 1)[batch(tag)["attention_mask"] == 1].abs().max())}

    # A classifier PRM (ZeRO-2) from a tied policy's HF folder, Megatron training run and converted megatron folder.
    policy_engine = build_policy_engine(AutoConfig.from_pretrained(policy), optim=_optim(), total_steps=1,
                                        max_tokens_per_micro_batch=64)
    policy_engine.load_hf_weights(HFWeights(policy))
    CheckpointManager(f"{root}/policy_run").save(policy_engine, 0, config={"model": {"hf_config": policy}})
    save_mcore_checkpoint(policy_engine.stage, f"{root}/policy_mcore", policy)
    expected = dict(HFWeights(policy))
    results["init"] = {}
    for source in (policy, f"{root}/policy_run", f"{root}/policy_mcore"):
        engine = build_prm_engine(AutoConfig.from_pretrained(prm_config), default_spec("classifier"), None,
                                  optim=_optim(), total_steps=1, max_tokens_per_micro_batch=64,
                                  engine_kind="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=2))
        head_before = {name: t for name, t in _weights(engine).items() if name.startswith("score.")}
        kind = load_prm_init_weights(engine, source)
        exported = _weights(engine)
        backbone = {name: t for name, t in exported.items() if not name.startswith("score.")}
        results["init"][kind] = {
            "backbone_names_match": set(backbone) == set(expected) - {"lm_head.weight"},
            "backbone_diff": max((t - expected[name]).abs().max().item() for name, t in backbone.items()),
            "head_kept": all(torch.equal(exported[name], t) for name, t in head_before.items()),
            "head_names": sorted(head_before),
        }
    return results if dist.get_rank() == 0 else {}


def test_deepspeed_scores_match_transformers_and_init_from_policy(hf_prms, two_ranks):  # noqa: F811
    from prm.spec import default_spec

    results = two_ranks["score"]
    for layout, folder in hf_prms.items():
        result = results["scores"][layout]
        expected = reference_scores(folder, layout, batch(SPECIAL.index(default_spec(layout).step_tag.strip()))
                                    ["input_ids"])
        flat = [s for row in expected for s in row]
        assert max(flat) - min(flat) > 0.2, layout  # spread out: a wrong position or class would show
        assert result["engine"] == "DeepSpeedForwardEngine" and result["spec"] == default_spec(layout)
        assert _max_diff(result["scores"], expected) <= TOLERANCE, layout
        assert result["sum_to_one"] < 1e-5
    assert set(results["init"]) == {"hf", "training_run", "mcore_model"}
    for kind, result in results["init"].items():
        assert result["backbone_names_match"] and result["backbone_diff"] == 0.0, kind
        assert result["head_kept"] and len(result["head_names"]) == 4, kind


def test_prm_config_takes_the_deepspeed_engine():
    from grpo_mega.config import ConfigError, load_config
    from prm.config import PRMConfig, validate_prm

    required = ["model.hf_config=x", "data.train_file=y"]
    cfg = load_config(PRMConfig, None, [*required, "engine=deepspeed", "deepspeed.zero_stage=3"], validate_prm)
    assert (cfg.engine, cfg.deepspeed.zero_stage) == ("deepspeed", 3)
    assert load_config(PRMConfig, None, required, validate_prm).engine == "megatron"
    with pytest.raises(ConfigError, match="engine=deepspeed .* parallel.tensor=1 and parallel.pipeline=1"):
        load_config(PRMConfig, None, [*required, "engine=deepspeed", "parallel.pipeline=2"], validate_prm)
    with pytest.raises(ConfigError, match=r"engine='fsdp': expected one of"):
        load_config(PRMConfig, None, [*required, "engine=fsdp"], validate_prm)


def test_sft_config_takes_the_deepspeed_engine():
    from grpo_mega.config import ConfigError, SFTConfig, load_config, validate_sft

    required = ["model.hf_config=x", "data.train_file=y"]
    cfg = load_config(SFTConfig, None, [*required, "engine=deepspeed", "deepspeed.offload_optimizer=true"],
                      validate_sft)
    assert (cfg.engine, cfg.deepspeed.zero_stage, cfg.deepspeed.offload_optimizer) == ("deepspeed", 2, True)
    with pytest.raises(ConfigError, match="engine=deepspeed .* parallel.tensor=1 and parallel.pipeline=1"):
        load_config(SFTConfig, None, [*required, "engine=deepspeed", "parallel.tensor=2"], validate_sft)
