"""The sections every run config shares (GRPO, SFT, PRM training): the model, the parallel layout, the optimizer,
the DeepSpeed engine's settings, and the run settings of the trainer section that the run harness
(``grpo_mega.harness.lifecycle``) acts on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from grpo_mega.config.lora import LoRAConfig

DEVICE_CHOICES = ("auto", "cpu", "cuda")
RECOMPUTE_CHOICES = ("none", "selective", "full")
"""``parallel.recompute``; their megatron settings: ``grpo_mega.model.config_map.RECOMPUTE_SETTINGS``."""


@dataclass
class ModelConfig:
    hf_config: str = "???"
    """Folder holding the Hugging Face config.json of the architecture (model_type qwen2, llama, qwen3 or
    qwen3_moe)."""
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
    moe_aux_loss_coeff: Optional[float] = None
    """Mixture-of-experts models (Qwen3-MoE): the weight of megatron's load-balancing loss (``aux_loss``, per MoE
    layer) in the trained models' loss; null takes the HF config's ``router_aux_loss_coef`` (0.001 for
    Qwen3-30B-A3B), 0 turns it off. Set on a dense model it is an error."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters on the policy's linear layers (``model.lora.rank`` > 0): the base weights frozen, only
    the adapters trained and saved (docs/training.md, "LoRA")."""


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size."""
    pipeline: int = 1
    """Pipeline-parallel size; data parallel is world_size / (tensor * pipeline)."""
    expert: int = 1
    """Expert-parallel size of a mixture-of-experts model (Qwen3-MoE): each MoE layer's experts are split over
    this many ranks of a pipeline stage, each expert whole on its rank (megatron's ``expert_model_parallel_size``
    with ``expert_tensor_parallel_size`` 1). A multiple of ``tensor`` (the experts follow whole tensor-parallel
    groups; ``expert`` = ``tensor`` keeps them inside one) that divides the number of experts and world_size /
    pipeline; above ``tensor`` it spans data-parallel replicas, which then run micro-batches of one shape in lockstep
    (row micro-batches, no shared-prompt packing). 1 for a dense model. Used by the GRPO, SFT and PRM trainers and
    ``grpo-mega eval``."""
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
    that room on the GPU (``grpo_mega.engine.offload``). Exact; costs two host copies of the optimizer state a step.
    The implicit PRM's (``process_reward.source: implicit``) leave with the policy's and come back for its update."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (not applied to biases and norm weights, as megatron groups them)."""
    adam_beta1: float = 0.9
    """Adam's decay of the first moment."""
    adam_beta2: float = 0.999
    """Adam's decay of the second moment."""
    adam_eps: float = 1e-8
    """Adam's epsilon, added to the square root of the second moment."""
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
class RunConfig:
    """The ``trainer`` settings of every run (GRPO, SFT, PRM training): where it writes, how long it runs, when it
    saves and stops, and where its metrics go. Each trainer's own section adds its settings to these."""

    run_dir: str = "runs/run"
    """Folder of the run: ``config.yaml``, ``metrics.jsonl``, ``checkpoints/`` (each trainer has its own default)."""
    total_steps: int = 100
    """Steps of the run (optimizer steps for SFT and PRM training, GRPO steps for GRPO); the learning-rate schedule spans them, and a resumed run continues to this count."""
    save_every: int = 0
    """Save a checkpoint every N steps; 0 = only at the end."""
    keep_last: int = 2
    """Checkpoints kept in ``run_dir/checkpoints`` (older ones are deleted after a newer one is complete)."""
    resume: str = "auto"
    """``auto`` (newest complete checkpoint in run_dir, if any; a run already at ``total_steps`` says so and exits
    0), ``none`` (a new run: refused when run_dir holds an earlier one, see ``overwrite``), or a checkpoint
    folder."""
    overwrite: bool = False
    """With ``resume: none``: move an earlier run in run_dir (its config, metrics, checkpoints) aside to
    ``<run_dir>.old-<time>`` and start afresh; nothing is deleted. False refuses to start in a folder that holds
    another run."""
    resume_with_changes: bool = False
    """Resume a run whose settings that change what is trained or what a step is differ from its checkpoint's (the
    model, the data, ``reward``, ``process_reward``, ``algorithm.supervision`` / ``step_credit``, KL, the group size,
    the rollout batch, the updates per step, SFT's batch size); False refuses, naming the keys. The learning rate,
    ``total_steps``, the layout and the other settings may change either way. ``allow_config_change`` allows some."""
    allow_config_change: list[str] = field(default_factory=list)
    """Dotted keys (or sections, e.g. ``reward``) of the settings that ``resume_with_changes`` guards which this
    resume may change, e.g. ``[algorithm.num_return_sequences_in_group]``; any other such change is refused. Every
    change, allowed or free, is logged in one block on resume, and each config the run used is kept as
    ``run_dir/configs/config.step-<N>.yaml`` (N: the step it took over after)."""
    progress_bar: bool = True
    """Show a progress bar with the latest metrics on rank 0; false (logs, CI): one line per step instead (the step,
    its figures, e.g. GRPO's score, reward and held-out accuracy when evaluated, and its seconds). Either way the
    run ends with one summary line."""
    tensorboard: bool = True
    """False leaves TensorBoard out even when ``loggers`` lists it (the older spelling, kept working)."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where metrics go, as verl's ``trainer.logger``: ``jsonl`` (``run_dir/metrics.jsonl``, which resume, plots and
    summaries read: always on), ``tensorboard`` (``run_dir/tensorboard``), ``wandb`` (Weights & Biases, run
    ``run_dir``'s name in ``wandb_project``, the run config logged; needs ``pip install 'grpo-mega[wandb]'``)."""
    wandb_project: str = "grpo-mega"
    """Weights & Biases project of the run (``loggers`` with ``wandb``)."""
    wandb_mode: str = "auto"
    """``online``, ``offline`` (files under ``run_dir/wandb``; upload later with ``wandb sync``) or ``auto``:
    ``WANDB_MODE`` when set, else online when ``WANDB_API_KEY`` is set, else offline (clusters without network)."""
    save_before_seconds: float = 0.0
    """Save a checkpoint and stop (exit status 3) once less than this many seconds are left before the time limit;
    0 disables. Also on SIGTERM / SIGUSR1 / SIGUSR2 the run saves and stops at the end of the step in flight."""
    stop_grace_s: float = 0.0
    """Seconds the step in flight may take to end after a stop signal (SIGTERM / SIGUSR1 / SIGUSR2) before the run
    ends at once, without saving it, from its last checkpoint (exit status 128 + the signal, 143 for SIGTERM; one line
    says so); 0 = no limit. A second stop signal (5 s or more after the first) ends it at once either way. Set it
    below what the scheduler waits before SIGKILL, less the save's time."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective (all-reduce, broadcast, barrier, ... over NCCL or gloo) waits for its peers before this
    rank raises and the job ends with the cause in ``run_dir/failure.json``: a hung, stopped or dead rank then ends
    the job instead of holding the allocation. It must cover the longest honest wait of one rank for another: the
    rendezvous of a large job, a peer's checkpoint save or PRM scoring, the slowest rank's generation (30 minutes by
    default, torch's own default for gloo; tests use seconds). The same deadline bounds the phases no collective
    does, on each rank alone: the checkpoint save, the weight sync to the rollout engine, the vLLM wake-up / sleep,
    reward and PRM scoring (a rank that overruns one ends with cause ``phase_timeout`` and every thread's stack)."""
    time_limit_seconds: float = 0.0
    """The run's time limit, counted from its start, for ``save_before_seconds``; 0 = the SLURM job's end
    (``SLURM_JOB_END_TIME``) when running under SLURM, else no limit."""
