"""Checks of the sections every run config shares (``grpo_mega.config.sections``), used by the GRPO, SFT and PRM
validators: values a typed field cannot restrict (choices, ranges) and settings that must agree with each other
inside one section."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from grpo_mega.config.loading import ConfigError
from grpo_mega.config.lora import HF_TARGET_NAMES, LORA_TARGETS
from grpo_mega.config.sections import DEVICE_CHOICES, ENGINES, RECOMPUTE_CHOICES, ModelConfig, OptimConfig, ParallelConfig

LOGGERS = ("jsonl", "tensorboard", "wandb")


def check_choice(value: str, allowed, key: str) -> None:
    """``key``'s ``value`` must be one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: expected one of {tuple(allowed)}")


DECAY_STYLES = ("cosine", "linear", "constant")


def validate_optim(optim: OptimConfig, section: str = "optim") -> None:
    """The optimizer and schedule settings of any config (``section``: its key, e.g. ``implicit_prm.optim``),
    checked before megatron's scheduler asserts on them."""
    check_choice(optim.decay_style, DECAY_STYLES, "optim.decay_style")
    if not optim.lr > 0:
        raise ConfigError(f"{section}.lr={optim.lr} must be > 0")
    if not 0 <= optim.min_lr <= optim.lr:
        raise ConfigError(
            f"{section}.min_lr={optim.min_lr} must be between 0 and {section}.lr={optim.lr}: the schedule decays "
            f"from {section}.lr down to {section}.min_lr; lower {section}.min_lr too (e.g. "
            f"{section}.min_lr={optim.lr / 10:g}, or 0)")
    # (a warm-up as long as the run is cut to total_steps - 1 by the schedule: shortened runs keep their config)
    if optim.warmup_steps < 0:
        raise ConfigError(f"{section}.warmup_steps={optim.warmup_steps} must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(optim, key) < 1:
            raise ConfigError(f"{section}.{key}={getattr(optim, key)} must be in [0, 1)")
    for key in ("adam_eps", "weight_decay", "clip_grad"):
        if getattr(optim, key) < 0:
            raise ConfigError(f"{section}.{key}={getattr(optim, key)} must be >= 0")


def validate_trainer_common(trainer) -> None:
    """The run settings every trainer section shares (``RunConfig``): step counts, the stop settings and loggers."""
    for key in ("total_steps",):
        if getattr(trainer, key) < 1:
            raise ConfigError(f"trainer.{key}={getattr(trainer, key)} must be >= 1")
    if trainer.save_every < 0:
        raise ConfigError(f"trainer.save_every={trainer.save_every} must be >= 0")
    if trainer.keep_last < 1:
        raise ConfigError(f"trainer.keep_last={trainer.keep_last} must be >= 1: a run keeps at least the checkpoint "
                          "it resumes from (trainer.save_every=0 saves only at the end)")
    for key in ("save_before_seconds", "time_limit_seconds", "stop_grace_s"):
        if getattr(trainer, key) < 0:
            raise ConfigError(f"trainer.{key} must be >= 0")
    if not trainer.collective_timeout_s > 0:
        raise ConfigError(f"trainer.collective_timeout_s={trainer.collective_timeout_s} must be > 0 (seconds)")
    for name in trainer.loggers:
        check_choice(name, LOGGERS, "trainer.loggers")
    if "jsonl" not in trainer.loggers:
        raise ConfigError(f"trainer.loggers={list(trainer.loggers)} must include jsonl: run_dir/metrics.jsonl is what "
                          "resume, plots and summaries read (add tensorboard / wandb beside it)")
    check_choice(trainer.wandb_mode, ("auto", "online", "offline"), "trainer.wandb_mode")
    if "wandb" in trainer.loggers:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("trainer.loggers lists wandb, which is not installed: pip install 'grpo-mega[wandb]' "
                              "(or remove wandb from trainer.loggers)")


def validate_parallel(parallel: ParallelConfig) -> None:
    """Layout sizes and the device."""
    check_choice(parallel.device, DEVICE_CHOICES, "parallel.device")
    for key in ("tensor", "pipeline", "expert", "max_tokens_per_micro_batch"):
        if getattr(parallel, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(parallel, key)} must be >= 1")


def launched_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The job's process count as its launcher tells it, read as ``grpo_mega.parallel.read_launch_env`` does
    (torchrun's ``WORLD_SIZE``, else srun's ``SLURM_NTASKS`` under ``SLURM_PROCID``) without importing torch; 0
    outside a launcher (not known yet)."""
    environ = os.environ if environ is None else environ
    name = "WORLD_SIZE" if "RANK" in environ or "WORLD_SIZE" in environ else (
        "SLURM_NTASKS" if "SLURM_PROCID" in environ else None)
    raw = environ.get(name, "") if name else ""
    return int(raw) if raw.isdigit() else 0


def validate_world_size(parallel: ParallelConfig, world_size: int) -> None:
    """The job's ``world_size`` processes (0: not known yet) hold whole model replicas: parallel.tensor x
    parallel.pipeline divides it."""
    replica = parallel.tensor * parallel.pipeline
    if world_size and world_size % replica == 0 and (world_size // parallel.pipeline) % parallel.expert:
        raise ConfigError(
            f"parallel.expert={parallel.expert} does not divide the {world_size // parallel.pipeline} processes of a "
            f"pipeline stage (the job's {world_size} / parallel.pipeline={parallel.pipeline}): the experts are split "
            f"over a stage's ranks")
    if not world_size or world_size % replica == 0:
        return
    raise ConfigError(
        f"parallel.tensor={parallel.tensor} x parallel.pipeline={parallel.pipeline} = {replica} processes per model "
        f"replica does not divide the job's {world_size} processes: start a multiple of {replica} (--nproc "
        f"{replica}) or set parallel.tensor x parallel.pipeline to a divisor of {world_size}")


def validate_lora(cfg) -> None:
    """``model.lora`` of a GRPO, SFT or PRM config: its ranges and target names, and what LoRA runs with so far
    (GRPO training on either engine, PRM training on the Megatron engine; from a base in ``model.init_from``,
    without the implicit PRM)."""
    lora = cfg.model.lora
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank={lora.rank} must be >= 0 (0: LoRA off)")
    if not lora.enabled:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha={lora.alpha} must be > 0 (the adapters' scale is alpha / rank)")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={lora.dropout} must be in [0, 1)")
    if not lora.target_modules:
        raise ConfigError(f"model.lora.target_modules is empty: name some of {list(LORA_TARGETS)}")
    for target in lora.target_modules:
        if target in HF_TARGET_NAMES or target == "all-linear":
            meant = HF_TARGET_NAMES.get(target, "all four (the default)")
            raise ConfigError(f"model.lora.target_modules: {target!r} is Hugging Face's name; megatron's is "
                              f"{meant} (choose from {list(LORA_TARGETS)})")
        check_choice(target, LORA_TARGETS, "model.lora.target_modules")
    if not hasattr(cfg, "algorithm") and not hasattr(cfg, "prm"):  # SFT
        raise ConfigError("model.lora is for grpo-mega train (GRPO) and grpo-mega prm train; SFT trains every "
                          "weight: set model.lora.rank=0")
    if cfg.engine == "deepspeed" and hasattr(cfg, "prm"):
        raise ConfigError("model.lora with engine=deepspeed trains the GRPO policy only; prm train with LoRA needs "
                          "engine=megatron")
    if not cfg.model.init_from:
        raise ConfigError("model.lora.rank > 0 needs model.init_from: the base the adapters train on (kept frozen; "
                          "checkpoints hold the adapters and point to it)")
    _, hf = model_config_json(cfg.model)
    mlp_targets = sorted({"linear_fc1", "linear_fc2"} & set(lora.target_modules))
    if hf is not None and num_experts(hf) and mlp_targets:
        raise ConfigError(f"model.lora.target_modules: {mlp_targets} are not adapted in a mixture-of-experts model "
                          f"({cfg.model.hf_config}: its MLPs are experts): set [linear_qkv, linear_proj]")
    if hasattr(cfg, "process_reward") and cfg.process_reward.source == "implicit":
        raise ConfigError("model.lora with process_reward.source=implicit is not supported yet (the implicit PRM "
                          "is a full model trained beside the policy): set model.lora.rank=0")


def validate_engine(cfg) -> None:
    """``engine`` and ``deepspeed.*`` of a GRPO, SFT or PRM config: a known engine, a layout it runs, and deepspeed
    installed when chosen; and ``model.lora`` (``validate_lora``)."""
    check_choice(cfg.engine, ENGINES, "engine")
    validate_memory_settings(cfg)
    validate_lora(cfg)
    if cfg.engine != "deepspeed":
        return
    check_choice(cfg.deepspeed.zero_stage, (1, 2, 3), "deepspeed.zero_stage")
    if cfg.deepspeed.gather_bucket_mb < 1:
        raise ConfigError(f"deepspeed.gather_bucket_mb={cfg.deepspeed.gather_bucket_mb} must be >= 1")
    if (cfg.parallel.tensor, cfg.parallel.pipeline) != (1, 1):
        raise ConfigError(
            f"engine=deepspeed shards with ZeRO over data parallel only: set parallel.tensor=1 and "
            f"parallel.pipeline=1 (got {cfg.parallel.tensor} and {cfg.parallel.pipeline})"
        )
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("engine=deepspeed needs the deepspeed package, which is not installed: "
                          "pip install 'grpo-mega[deepspeed]'")
    if cfg.model.lora.enabled and importlib.util.find_spec("peft") is None:
        raise ConfigError("model.lora with engine=deepspeed needs the peft package, which is not installed: "
                          "pip install 'grpo-mega[deepspeed]'")


def check_lora_imports(cfg) -> None:
    """In a rank, after torch's import: ``model.lora`` with ``engine=deepspeed`` takes its adapters from peft, which
    must import. :func:`validate_engine` only finds it before launch (importing it there would import torch); a
    broken install or a folder named ``peft`` ahead on the path fails here, naming the key, before any engine is
    built, instead of as a bare ImportError from inside the engine."""
    if not (cfg.model.lora.enabled and cfg.engine == "deepspeed"):
        return
    try:
        import peft  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"model.lora with engine=deepspeed needs the peft package, which does not import "
                          f"({error}): pip install 'grpo-mega[deepspeed]', or engine=megatron (its own adapters)"
                          ) from None


def validate_decode_graphs(cfg) -> None:
    """``rollout.decode_graphs``: a mode of the hf engine's decode loop; the CUDA graph / compile modes need CUDA."""
    mode = cfg.rollout.decode_graphs
    check_choice(mode, ("off", "static", "static_compile", "cuda_graphs"), "rollout.decode_graphs")
    if mode != "off" and cfg.rollout.engine == "vllm":
        raise ConfigError(f"rollout.decode_graphs={mode} applies to the hf engine; vLLM captures its own CUDA graphs "
                          "(rollout.enforce_eager=false)")
    if mode in ("static_compile", "cuda_graphs") and cfg.parallel.device == "cpu":
        raise ConfigError(f"rollout.decode_graphs={mode} needs CUDA (parallel.device=cpu); 'static' runs the static "
                          "cache eagerly on the CPU")


def validate_memory_settings(cfg) -> None:
    """``parallel.sequence_parallel`` and ``parallel.recompute`` of a GRPO, SFT or PRM config."""
    parallel = cfg.parallel
    check_choice(parallel.recompute, RECOMPUTE_CHOICES, "parallel.recompute")
    if parallel.sequence_parallel and parallel.tensor < 2:
        raise ConfigError(f"parallel.sequence_parallel=true splits the sequence over tensor-parallel ranks but "
                          f"parallel.tensor={parallel.tensor}: set parallel.sequence_parallel=null (on whenever "
                          f"tensor > 1) or false, or parallel.tensor > 1")
    if cfg.engine == "deepspeed" and parallel.recompute != "none":
        raise ConfigError(f"parallel.recompute={parallel.recompute!r} is a megatron-core feature; engine=deepspeed "
                          f"does not recompute activations: set parallel.recompute=none or engine=megatron")


def model_config_json(model: ModelConfig) -> tuple[Path, dict | None]:
    """(path, contents) of the model's config.json; contents None when the folder has no readable one (a missing
    folder is reported later by the loader)."""
    config_file = Path(model.hf_config) / "config.json"
    try:
        return config_file, (json.loads(config_file.read_text()) if config_file.is_file() else None)
    except (OSError, ValueError):
        return config_file, None


def num_experts(hf: Mapping) -> int:
    """Experts of each MoE layer of an HF config.json's contents (transformers writes Qwen3-MoE's ``num_experts``
    as ``num_local_experts``); 0 for a dense model."""
    if hf.get("model_type") != "qwen3_moe":
        return 0
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def validate_experts(model: ModelConfig, parallel: ParallelConfig) -> None:
    """``parallel.expert`` and ``model.moe_aux_loss_coeff`` against the model's config.json (when the folder is
    there): a mixture-of-experts model, whose number of experts ``parallel.expert`` divides."""
    config_file, hf = model_config_json(model)
    if model.moe_aux_loss_coeff is not None and model.moe_aux_loss_coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff={model.moe_aux_loss_coeff} must be >= 0 (null: the HF config's)")
    if hf is None:
        return
    experts = num_experts(hf)
    if not experts:
        for key, value, default in (("parallel.expert", parallel.expert, 1),
                                    ("model.moe_aux_loss_coeff", model.moe_aux_loss_coeff, None)):
            if value != default:
                raise ConfigError(f"{key}={value} is for mixture-of-experts models, and {config_file} is a "
                                  f"{hf.get('model_type')!r} model without experts: remove it")
        return
    if parallel.expert % parallel.tensor:
        raise ConfigError(f"parallel.expert={parallel.expert} with parallel.tensor={parallel.tensor}: a "
                          f"mixture-of-experts model's experts are split over whole tensor-parallel groups, so "
                          f"parallel.expert must be a multiple of parallel.tensor ({parallel.tensor}, "
                          f"{2 * parallel.tensor}, ...)")
    if parallel.tensor > 1 and parallel.sequence_parallel is False:
        raise ConfigError(f"parallel.sequence_parallel=false with parallel.tensor={parallel.tensor}: megatron trains a "
                          f"mixture-of-experts model with tensor parallelism only with sequence parallelism; set it to "
                          f"null (on whenever tensor > 1) or true")
    if experts % parallel.expert:
        raise ConfigError(f"parallel.expert={parallel.expert} does not divide the model's num_experts={experts} "
                          f"({config_file})")


def check_context_length(model: ModelConfig, length: int, what: str) -> None:
    """The longest sequence a run builds must fit the model's ``max_position_embeddings`` (read from the
    HF config when the folder is there; a missing folder is reported later by the loader)."""
    config_file, hf = model_config_json(model)
    limit = hf.get("max_position_embeddings") if hf is not None else None
    if isinstance(limit, int) and length > limit:
        raise ConfigError(f"{what} = {length} tokens is more than the model's max_position_embeddings={limit} "
                          f"({config_file}); lower them")
