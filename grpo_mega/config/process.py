"""The process-supervision sections of the GRPO config: where step rewards come from (process_reward), the
implicit PRM trained online (implicit_prm) and the tree sampler (tree_rollout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from grpo_mega.config.sections import OptimConfig

PROCESS_REWARD_SOURCES = ("function", "prm", "implicit", "tree", "tool")
STEP_KINDS = ("text", "turns")
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
    docs/training.md, "Tree credit"). ``tool`` (multi-turn rollouts, ``steps: turns``): the tools' own verdicts
    on each turn's calls (a tool's reward where it returns one, ``tool_error_reward`` for a failed call,
    ``tool_void_turn_reward`` for a void turn; docs/training.md, "Turn credit")."""
    steps: str = "text"
    """What a step is. ``text``: pieces of the response text (``step_pattern``). ``turns``: each assistant turn of a
    multi-turn rollout (``rollout.multi_turn.enable``), ending at its last model token; the tool's output and the
    template's tokens after it carry no credit, and the turn credit is ``algorithm.turn_credit`` (docs/training.md,
    "Turn credit"). Sources with turns: ``function`` (``reward.function`` returns ``TurnRewards``, e.g.
    ``tool_task_turns``, the tool task's oracle), ``tool``, ``prm`` (each turn scored with the earlier turns' tool
    outputs in the PRM's input, read at the turn's last model token), ``implicit``, ``tree`` (the tree branches at
    turn boundaries, each turn scored by its node's Monte-Carlo value; docs/training.md, "Tree credit by turns")."""
    tool_error_reward: float = -1.0
    """``source: tool``: the reward of a call that failed (an error of the tool, an invalid call, an unknown tool, a
    timeout; ``ToolCallRecord.error``). A turn's reward is the mean of its calls'."""
    tool_success_reward: float = 0.0
    """``source: tool``: the reward of a call that ran without error and whose tool returns no reward of its own (a
    tool's reward, verl's ``tool_reward_score``, is used as it is where it gives one)."""
    tool_void_turn_reward: float = -1.0
    """``source: tool``: the reward of a void turn (neither a call nor a final answer: SimpleTIR's void turns). The
    other turns without a call (the answer, a turn cut at its token limit or at ``max_turns``) get 0: the outcome
    reward judges them."""
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
    fixed token counts (SPO-tree's segments), or with ``process_reward.steps: turns`` at turn boundaries (after each
    tool turn), and the completions are the tree's leaves."""

    branching: list[int] = field(default_factory=lambda: [4, 2, 2])
    """Children of each node per level, root first: ``[4, 2, 2]`` samples 4 first segments from the prompt, 2
    continuations of each, then 2 of each of those to the end: 16 leaves. Their product must equal
    ``algorithm.num_return_sequences_in_group`` (the group's rows); ``[G]`` is a plain group of G chains."""
    segment_tokens: int = 16
    """Tokens per segment at every level but the last (whose segments run to the end or
    ``algorithm.response_length``): a branch point every ``segment_tokens`` tokens. A node that ends before (end of
    sequence, a stop string) is a leaf standing for its whole subtree's rows. Unused with ``process_reward.steps:
    turns`` (a segment is one assistant turn and its tool turn)."""
