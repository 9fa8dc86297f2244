"""The quickstart's plans: the sizes of each part of the pipeline (``QuickstartPlan``), and the regimes
``grpo-mega quickstart`` runs (``DENSE``, ``SPARSE``) with ``FAST``, the sparse one shrunk for the end-to-end test."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from grpo_mega.data.synthetic import Difficulty
from prm.iterative import RefreshPlan
from prm.pipeline import PRMPlan


@dataclass(frozen=True)
class QuickstartPlan:
    """Sizes of the quickstart (the defaults: the dense regime); ``REGIMES`` names the two the command runs,
    ``FAST`` shrinks the sparse one for the end-to-end test."""

    name: str = "dense"
    """What the regime is called in the table, the plot and summary.json."""
    num_train: int = 4000
    """Training problems (of about 27,000 distinct questions of ``difficulty``)."""
    num_heldout: int = 500
    direct_answer_fraction: float = 0.5
    """Share of SFT targets that state the answer without the steps (see build_synthetic_task)."""
    difficulty: Difficulty = field(default_factory=lambda: Difficulty(min_steps=3, max_steps=3, max_value=20))
    """Three operations, values within 0..20: every step is a fact the tiny policy learns (and its PRM can check),
    while the answer of a three-step chain is hard to guess without working it (see docs/quickstart.md
    for the measurements behind this choice)."""
    sft_steps: int | None = None  # None: configs/quickstart_sft.yaml decides
    policy_sft_step: int | None = None
    """The GRPO arms start from the SFT checkpoint of this step (a weaker policy), while the PRM starts from the
    end of SFT and the Monte-Carlo labels come from that checkpoint's continuations (a completer and a PRM that know
    more than the policy); the SFT seconds after this step count against the process arm. None: policy and PRM
    both start from the end of SFT. With ``policy_max_pass_at_1`` it is the interval of the candidate checkpoints."""
    policy_max_pass_at_1: float | None = None
    """Pick the arms' SFT checkpoint by measured pass@1 instead of by step: of the checkpoints every
    ``policy_sft_step`` steps, measured in order until one's sampled pass@1 on ``selection_prompts`` training
    prompts exceeds this, the one closest to it (``grpo_mega.quickstart.selection``). None: the checkpoint of
    ``policy_sft_step``."""
    selection_prompts: int = 200
    selection_samples: int = 2
    """Evaluations at temperature 1 (seeds ``seed + k``) whose mean is a candidate's sampled pass@1."""
    grpo_steps: int | None = None  # None: configs/quickstart_grpo.yaml decides
    response_length: int | None = None
    """Most tokens of a GRPO completion; None: configs/quickstart_grpo.yaml decides (64, for three-step solutions)."""
    eval_prompts: int | None = None
    eval_every: int | None = None
    prm: PRMPlan = field(default_factory=PRMPlan)
    process_supervision: bool = True
    """False: data -> SFT -> outcome-supervised GRPO only (``--outcome-only``)."""
    oracle_arm: bool = False
    """Also GRPO with process supervision by the task's ground-truth step checker (the upper bound of a PRM)."""
    implicit_arm: bool = False
    """Also GRPO with process supervision by an implicit PRM trained online from the verifier's outcomes (PRIME,
    ``process_reward.source: implicit``): no step labels and no PRM training before its first step."""
    step_reward_arms: tuple[str, ...] = ()
    """More learned-PRM arms, one per ``process_reward.step_reward`` option named here (``progress``, ``delta``,
    ``clip``): the process arm's settings with that option, the same PRM, SFT checkpoint, seed and steps."""
    more_arms: tuple[str, ...] = ()
    """Arms of ``grpo_mega.quickstart.arms.ARMS`` run right after outcome supervision's, from the same SFT checkpoint
    and seed (the tree's, the completion baseline's: ``bench/pipeline_seeds.py --arms``)."""
    iterations: int = 1
    """Iterative RL for the process-supervised arm (DeepSeekMath, Algorithm 1): its GRPO steps are split into this
    many runs, each starting from (and taking as its reference) the previous run's policy, and in between the PRM
    is retrained on fresh Monte-Carlo labels of the current policy plus a replay of earlier labels
    (``prm.iterative``)."""
    refresh: RefreshPlan = field(default_factory=RefreshPlan)
    """Sizes of each PRM refresh between iterations."""
    seed: int = 1234


DENSE = QuickstartPlan(eval_every=5)
"""Three-step chains, half the SFT targets bare answers, policy and PRM from the end of an 800-step SFT: every arm
climbs from 15-66 % to 84-93 % held-out, and process supervision ties outcome supervision (the verifier's answer
already says which solutions work the steps). docs/results.md."""

SPARSE = QuickstartPlan(
    name="sparse",
    difficulty=Difficulty(min_steps=5, max_steps=5, max_value=20),
    direct_answer_fraction=0.0,
    policy_sft_step=50,
    policy_max_pass_at_1=0.20,
    grpo_steps=60,
    eval_every=10,
    eval_prompts=500,
    response_length=96,  # a five-step solution is up to 82 tokens with its end token
    prm=PRMPlan(label_prompts=800, rollouts_per_step=1, completer_temperature=0.0, best_of_n_prompts=100,
                max_new_tokens=96),
)
"""Five-step chains (one wrong step spoils the answer) from a briefly trained policy: the GRPO arms start from the
SFT checkpoint picked by sampled pass@1 on training prompts (the closest to 20 %, of one every 50 steps, measured
until one exceeds it: ``grpo_mega.quickstart.selection``), the PRM from the end of the 800-step SFT (it knows the arithmetic better than
the policy, as a PRM built on a stronger model does) with Monte-Carlo labels by that checkpoint's greedy continuation
of each prefix; the SFT steps after the arms' checkpoint count against the learned-PRM arms' seconds. Measured over
3 seeds (docs/results.md): per step the learned PRM's arms are ahead of outcome supervision in the mean (score +4.2,
delta +5.5 points after 60 steps) but by less than twice the standard error, and behind per second."""

REGIMES = {"sparse": SPARSE, "dense": DENSE}

FAST = replace(
    DENSE, num_train=600, num_heldout=32, sft_steps=40, policy_sft_step=35, policy_max_pass_at_1=1.0,
    selection_prompts=16, selection_samples=1, grpo_steps=3, eval_prompts=16, eval_every=0,
    prm=PRMPlan(label_prompts=12, samples_per_prompt=1, rollouts_per_step=1, completer_temperature=0.0, train_steps=4,
                planted_problems=16, best_of_n_prompts=8, best_of_n=2),
    refresh=RefreshPlan(train_steps=3),
)
"""The end-to-end test's run: the dense task, shortened; the arms start from SFT step 35 of 40 (the only candidate
of the pass@1 selection, which measures it) and the PRM from step 40 with greedy Monte-Carlo labels, so the sparse
regime's paths run too."""

# The policy: Qwen2-shaped, tied embeddings, ~0.9M parameters (vocabulary from the trained tokenizer).
POLICY_SHAPE = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, tie_word_embeddings=True, rope_theta=10000.0,
)
