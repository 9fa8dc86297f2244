"""The quickstart's GRPO arms: what each is called, the overrides of configs/quickstart_grpo.yaml it runs with, the
folder of its run, and what its live line shows."""

from __future__ import annotations

from grpo_mega.quickstart.plots import TRAIN_REWARD_KEY
from grpo_mega.quickstart.report import STEP_REWARD_ARM

# The GRPO arms: (name, what the terminal calls it, overrides of configs/quickstart_grpo.yaml). All start from the
# same SFT checkpoint with the same seed; "process" adds the learned PRM's checkpoint, and its step rewards are a
# quarter of the PRM's scores plus the outcome reward on the last step (``process_reward.step_score_weight``,
# ``outcome_on_last_step``): the PRM shapes the credit within a solution, the verifier keeps the policy anchored to
# right answers (a policy left alone with a small learned PRM learns to please it: 8.6 % held-out in an earlier
# run; weight 1 gave 0.770 vs 0.828 with 0.25, seed 1234). The oracle's step rewards are the truth, the answer
# sentence's included, so it needs no anchor.
ARMS = {
    "outcome": ("GRPO, outcome supervision", ()),
    "process": ("GRPO, process supervision by the learned PRM", (
        "algorithm.supervision=process", "process_reward.source=prm", "process_reward.outcome_on_last_step=true",
        "process_reward.step_score_weight=0.25")),
    "oracle": ("GRPO, process supervision by the task's step checker (oracle PRM)", (
        "algorithm.supervision=process", "process_reward.source=function", "reward.function=synthetic_steps")),
    # PRIME's settings: step sums of beta 0.05 token rewards plus the outcome, the implicit PRM's learning rate 1e-6
    # (the paper's, and implicit_prm.optim.lr's default). At twice the policy's rate, as in the paper (1e-6 vs 5e-7;
    # here 1e-4 vs the quickstart policy's 5e-5), the policy collapsed on the sparse regime: seed 1, held-out 0.208 ->
    # 0.028 after 60 steps (docs/results.md, "The implicit PRM")
    # The update before the scoring (verl's order), as the recorded implicit arms ran before implicit_prm.update's
    # default became after: "implicit_after" is the default's arm
    "implicit": ("GRPO, process supervision by an implicit PRM trained online (PRIME)", (
        "algorithm.supervision=process", "process_reward.source=implicit",
        "process_reward.outcome_on_last_step=true", "implicit_prm.update=before")),
}
# Variants of the implicit PRM's arm: inside the rollout stage (it learns from and scores every sampled group, and
# dynamic sampling keeps the groups its step rewards split, as a learned PRM's do, not only those of mixed
# outcomes); every token its own step (PRIME's token-level credit) instead of the text's steps; scored with the
# update's own forward (the PRM before the update: PRIME's other order, no third pass) instead of the updated PRM's
IMPLICIT_VARIANTS = {"implicit_all_groups": ("before dynamic sampling", "implicit_prm.before_dynamic_sampling=true"),
                     "implicit_token_steps": ("one-token steps", "implicit_prm.steps=tokens"),
                     "implicit_after": ("scored before its update", "implicit_prm.update=after")}
for _arm, (_what, _override) in IMPLICIT_VARIANTS.items():
    ARMS[_arm] = (f"{ARMS['implicit'][0]}, {_what}", (*ARMS["implicit"][1], _override))
# Tree credit (issue 57): each group sampled as a tree and a segment's score its node's Monte-Carlo value, no reward
# model; PAV's progress with the completion baseline makes a token's advantage (o_i - V(its segment's parent)) / std(o)
# (VinePPO's). The plans: [2, 2, 2] (8 leaves, the outcome arm's G, about two thirds of its tokens: branch points at 24
# and 48 tokens of a five-step solution's ~80); [4, 2] (8 leaves, one branch point at 32 tokens); [2, 2, 2, 2] (16
# leaves for about the outcome arm's tokens: branch points every 20 tokens); [8, 2] (16 leaves from 8 roots).
TREE = ("algorithm.supervision=process", "process_reward.source=tree", "process_reward.step_reward=progress",
        "algorithm.step_baseline=completion")
TREE_PLANS = {"tree_222": ("[2, 2, 2], 24-token segments", ("tree_rollout.branching=[2,2,2]",
                                                             "tree_rollout.segment_tokens=24")),
              "tree_42": ("[4, 2], 32-token segments", ("tree_rollout.branching=[4,2]",
                                                         "tree_rollout.segment_tokens=32")),
              "tree_2222": ("[2, 2, 2, 2], 20-token segments", (
                  "tree_rollout.branching=[2,2,2,2]", "tree_rollout.segment_tokens=20",
                  "algorithm.num_return_sequences_in_group=16")),
              # as many independent first segments as outcome supervision's chains, each continued twice from its
              # midpoint (VinePPO's extra rollouts for the value, not fewer roots): 16 leaves
              "tree_82": ("[8, 2], 40-token segments", (
                  "tree_rollout.branching=[8,2]", "tree_rollout.segment_tokens=40",
                  "algorithm.num_return_sequences_in_group=16"))}
for _arm, (_what, _overrides) in TREE_PLANS.items():
    ARMS[_arm] = (f"GRPO, tree credit (no reward model), {_what}", (*TREE, *_overrides))
# [2, 2, 2] with DeepSeekMath's pooled per-step normalisation instead of the completion baseline: the value
# differences' own spread scales the credit (larger than the outcomes' std: more gradient per step)
ARMS["tree_222_pooled"] = (f"{ARMS['tree_222'][0]}, pooled per-step baseline",
                           (*ARMS["tree_222"][1], "algorithm.step_baseline=pooled_steps"))
# The step baseline (issue 57): the learned PRM's and the oracle's arms with the group's mean return subtracted once per
# completion instead of from every step (algorithm.step_baseline: completion)
COMPLETION_BASELINE = "algorithm.step_baseline=completion"
ARMS["process_completion"] = (f"{ARMS['process'][0]}, completion baseline", (*ARMS["process"][1], COMPLETION_BASELINE))
ARMS["process_delta_completion"] = (f"{ARMS['process'][0]}, step_reward=delta, completion baseline", (
    *ARMS["process"][1], "process_reward.step_reward=delta", COMPLETION_BASELINE))
ARMS["oracle_completion"] = (f"{ARMS['oracle'][0]}, completion baseline", (*ARMS["oracle"][1], COMPLETION_BASELINE))
# The skeptic's baseline (grpo_mega.quickstart.rft): the policy fine-tuned on its own verified solutions from the PRM's
# labelling for the PRM training's seconds, then outcome supervision
ARMS["rft"] = ("GRPO, outcome supervision after RFT on the policy's verified solutions", ())
# The policy losses (issue 78): outcome supervision with 4 optimizer steps per GRPO step (mini-batches of 8 of the 32
# prompts, the GSPO paper's split of a rollout batch), under PPO's clip, GSPO-token (its paper's clip range) and CISPO.
# With one update per batch every form has PPO's gradient (every ratio is 1: docs/training.md, "Policy losses"), so
# the forms differ only where the policy moves within a step; ppo_mb4 is their baseline with the same split.
POLICY_LOSS_ARMS = {"ppo_mb4": ("PPO clip", ()),
                    "gspo_token_mb4": ("GSPO-token", ("algorithm.policy_loss=gspo_token",
                                                      "algorithm.loss_agg_mode=seq-mean-token-mean")),
                    "cispo_mb4": ("CISPO", ("algorithm.policy_loss=cispo",))}
for _arm, (_what, _overrides) in POLICY_LOSS_ARMS.items():
    ARMS[_arm] = (f"GRPO, outcome supervision, 4 mini-batches per step, {_what}",
                  ("algorithm.mini_batch_size=8", *_overrides))
# LoRA (issue 78): outcome supervision with rank-16 adapters on all four linears of every layer (model.lora's default
# targets) over the frozen SFT checkpoint the outcome arm starts from (model.init_from, which grpo_arm passes every
# arm, is the base); its comparison is the outcome arm, same steps and seed. alpha 32: docs/training.md's default,
# peft's and "LoRA Without Regret"'s (Thinking Machines, 2025: alpha fixed at 32, the best LoRA learning rate then
# ~10x full fine-tuning's at any rank). The learning rate is that rule applied to configs/quickstart_grpo.yaml's
# 5e-5, not tuned on the benchmark's seeds (constant schedule, clip_grad 1.0 as the outcome arm).
LORA_ARMS = {"lora_r16": ("LoRA rank 16, alpha 32, all linears, 10x the learning rate",
                          ("model.lora.rank=16", "model.lora.alpha=32", "optim.lr=5e-4"))}
for _arm, (_what, _overrides) in LORA_ARMS.items():
    ARMS[_arm] = (f"GRPO, outcome supervision, {_what}", _overrides)
# What each GRPO arm's live line shows besides its step.
SHOWN = {"outcome": (("held-out acc", "eval/accuracy"), ("reward", TRAIN_REWARD_KEY))}
SHOWN["process"] = (*SHOWN["outcome"], ("PRM score", "prm/score_mean"))
ARM_FOLDERS = {"outcome": "grpo", "process": "grpo_process", "oracle": "grpo_oracle"}
for _arm in ("implicit", *IMPLICIT_VARIANTS):
    SHOWN[_arm] = (*SHOWN["outcome"], ("PRM outcome acc", "implicit_prm/outcome_accuracy"))
    ARM_FOLDERS[_arm] = f"grpo_{_arm}"
for _arm in (*TREE_PLANS, "tree_222_pooled"):
    SHOWN[_arm] = (*SHOWN["outcome"], ("tokens", "rollout/generated_tokens"))
for _arm in POLICY_LOSS_ARMS:
    SHOWN[_arm] = (*SHOWN["outcome"], ("clipped", "actor/pg_clipfrac"))
for _arm in (*TREE_PLANS, "tree_222_pooled", "process_completion", "process_delta_completion", "oracle_completion",
             "rft", *POLICY_LOSS_ARMS, *LORA_ARMS):
    ARM_FOLDERS[_arm] = f"grpo_{_arm}"
# The tool task (``--regime tools``, grpo_mega.quickstart.tool_pipeline): text-only GRPO from the text SFT checkpoint
# and tool GRPO (outcome supervision, the turn loop with the calculator in hermes calls) from the tool SFT checkpoint,
# on the same prompts, seed, steps, batch and token budget. Any arm of ARMS run there (``--add-arms``) is a tool arm:
# its overrides on top of TOOL_ROLLOUTS, from the tool SFT checkpoint.
TOOL_ROLLOUTS = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]",
                 "rollout.multi_turn.format=hermes")
TOOL_ARMS = {"text_grpo": ("GRPO, text only (no tool), outcome supervision", (), "text"),
             "tool_grpo": ("GRPO with the calculator (multi-turn rollouts), outcome supervision", TOOL_ROLLOUTS,
                           "tool")}
"""name -> (title, overrides, the SFT policy it starts from: ``text`` or ``tool``)."""
TOOL_BASELINE = "tool_grpo"
"""The tool regime's reference arm: every other arm's ``<key>_minus_os`` is against it (issue 76 sets turn credit
against tool GRPO with outcome supervision; issue 75's floor is ``tool_minus_text``)."""
TOOL_SHOWN = (*SHOWN["outcome"], ("calls", "tools/calls_per_rollout"), ("turns", "num_turns/mean"))
ARM_FOLDERS.update(text_grpo="grpo_text", tool_grpo="grpo_tool")


def tool_arm_settings(arm: str) -> tuple[str, tuple[str, ...], str, str]:
    """(title, overrides, folder, start: ``text`` | ``tool``) of ``arm`` in the tool regime: one of ``TOOL_ARMS``,
    or an arm of ``ARMS`` with the turn loop and the calculator (from the tool SFT checkpoint)."""
    if arm in TOOL_ARMS:
        title, overrides, start = TOOL_ARMS[arm]
        return title, overrides, ARM_FOLDERS[arm], start
    if arm not in ARMS:
        raise ValueError(f"tool regime: unknown arm {arm!r}; known: {sorted({*TOOL_ARMS, *ARMS})}")
    title, overrides, folder = arm_settings(arm)
    return f"{title}, with the calculator", (*TOOL_ROLLOUTS, *overrides), folder, "tool"


def arm_settings(arm: str) -> tuple[str, tuple[str, ...], str]:
    """(title, overrides, folder) of ``arm``: one of ``ARMS``, or ``process_<step_reward>``."""
    if arm in ARMS:
        return (*ARMS[arm], ARM_FOLDERS[arm])
    step_reward = arm.removeprefix(STEP_REWARD_ARM)
    return (f"{ARMS['process'][0]}, step_reward={step_reward}",
            (*ARMS["process"][1], f"process_reward.step_reward={step_reward}"), f"grpo_{arm}")


# Turn credit on the tool task (issue 76), arms of the tools regime (`bench/pipeline_seeds.py --regime tools`, which
# adds the turn loop with the calculator, TOOL_ROLLOUTS, and starts them from the tool SFT checkpoint): each assistant
# turn a step (process_reward.steps=turns), credited by the bounded form (the default) or by suffix sums (`_sum`). The
# oracle is the task's per-turn checker; `tool` the calculator's own verdicts (a failed call or a void turn -1, a call
# that ran 0); `prm` a learned PRM, whose checkpoint the caller adds as process_reward.prm=PATH (one labelled and
# trained on turn-split rows: `grpo-mega prm label/train` on turns).
TURN_STEPS = ("algorithm.supervision=process", "process_reward.steps=turns")
TURN_CREDIT_ARMS = {
    "tool_turn_oracle": ("the task's per-turn checker (oracle)",
                         ("process_reward.source=function", "reward.function=tool_task_turns")),
    "tool_turn_tool": ("the tools' own verdicts", ("process_reward.source=tool",)),
    "tool_turn_prm": ("the learned PRM", ("process_reward.source=prm",)),
    # the tree by turns: 4 first turns per prompt, each continued twice from its first tool turn (8 leaves, the
    # batch's G; [G/2, 2] as the best text plan, tree_82, and the first call is where the tool task's chains part);
    # a turn's step reward the value it added (progress), its extra rollouts' tokens and seconds in the arm's own
    "tool_turn_tree": ("the tree by turns (Monte-Carlo values of turn prefixes)",
                       ("process_reward.source=tree", "process_reward.step_reward=progress",
                        "tree_rollout.branching=[4,2]")),
}
for _arm, (_what, _overrides) in list(TURN_CREDIT_ARMS.items()):
    ARMS[_arm] = (f"GRPO, bounded turn credit from {_what}", (*TURN_STEPS, *_overrides))
    ARMS[f"{_arm}_sum"] = (f"GRPO, summed turn credit from {_what}",
                           (*TURN_STEPS, *_overrides, "algorithm.turn_credit=sum"))
    for _name in (_arm, f"{_arm}_sum"):
        SHOWN[_name] = (*SHOWN["outcome"], ("turn reward", "turn_credit/turn_reward_mean"))
        ARM_FOLDERS[_name] = f"grpo_{_name}"
for _name in ("tool_turn_tree", "tool_turn_tree_sum"):
    SHOWN[_name] = (*SHOWN[_name], ("tokens", "rollout/generated_tokens"))


def tool_shown(arm: str) -> tuple[tuple[str, str], ...]:
    """What ``arm``'s live line shows in the tool regime: ``TOOL_SHOWN`` and the arm's own figures of ``SHOWN``
    (a turn-credit arm's ``turn_credit/turn_reward_mean``)."""
    return (*TOOL_SHOWN, *(item for item in SHOWN.get(arm, ()) if item not in TOOL_SHOWN))
