"""What the quickstart reports about its GRPO arms: each arm's held-out accuracy before and after, its gain, how
many of its groups carried no outcome signal, its accuracy curve and what it cost in wall-clock seconds (the
process arm's PRM labelling and training included), and the table ``grpo-mega quickstart`` prints."""

from __future__ import annotations

from pathlib import Path

from grpo_mega.run.metrics import read_metrics

ARM_KEYS = {"outcome": "os", "process": "ps", "oracle": "oracle", "implicit": "implicit",
            "implicit_all_groups": "implicit_all_groups", "implicit_token_steps": "implicit_token_steps",
            "tree_222": "tree_222", "tree_42": "tree_42", "tree_2222": "tree_2222",
            "tree_222_pooled": "tree_222_pooled", "tree_82": "tree_82",
            "process_completion": "ps_completion", "process_delta_completion": "ps_delta_completion",
            "oracle_completion": "oracle_completion", "rft": "rft", "ppo_mb4": "ppo_mb4",
            "gspo_token_mb4": "gspo_token_mb4", "cispo_mb4": "cispo_mb4", "lora_r16": "lora_r16", "text_grpo": "text",
            "tool_grpo": "tool"}
"""The short name of each arm in ``summary.json`` (``os_accuracy``, ``ps_gain``, ...)."""
ARM_TITLES = {"outcome": "outcome supervision", "process": "process supervision (learned PRM)",
              "oracle": "process supervision (oracle)", "implicit": "process supervision (implicit PRM)",
              "implicit_all_groups": "process supervision (implicit PRM, before dynamic sampling)",
              "implicit_token_steps": "process supervision (implicit PRM, one-token steps)",
              "tree_222": "tree credit [2, 2, 2]", "tree_42": "tree credit [4, 2]",
              "tree_2222": "tree credit [2, 2, 2, 2]", "tree_222_pooled": "tree credit [2, 2, 2], pooled baseline",
              "tree_82": "tree credit [8, 2]",
              "process_completion": "process supervision (learned PRM, completion baseline)",
              "process_delta_completion": "process supervision (learned PRM, delta, completion baseline)",
              "oracle_completion": "process supervision (oracle, completion baseline)",
              "rft": "outcome supervision after RFT", "ppo_mb4": "outcome supervision, 4 mini-batches, PPO clip",
              "gspo_token_mb4": "outcome supervision, 4 mini-batches, GSPO-token",
              "cispo_mb4": "outcome supervision, 4 mini-batches, CISPO",
              "lora_r16": "outcome supervision, LoRA rank 16",
              "text_grpo": "text-only GRPO (no tool)", "tool_grpo": "tool GRPO (calculator), outcome supervision",
              "tool_turn_oracle": "tool GRPO, bounded turn credit (oracle)",
              "tool_turn_prm": "tool GRPO, bounded turn credit (learned turn PRM)",
              "tool_turn_tool": "tool GRPO, bounded turn credit (the tools' verdicts)",
              "tool_turn_tree": "tool GRPO, bounded turn credit (the tree by turns)"}
STEP_REWARD_ARM = "process_"
"""Prefix of the learned-PRM arms that run another ``process_reward.step_reward`` (``process_delta``, ...)."""


TURN_PRM_ARM = "tool_turn_prm"
"""The tool task's learned-PRM turn-credit arms (``tool_turn_prm``, ``tool_turn_prm_sum``): the seed's turn PRM."""


def learned_prm_arm(arm: str) -> bool:
    """Whether ``arm`` trains on the learned PRM (its labelling and training count against it)."""
    return arm == "process" or arm.startswith(STEP_REWARD_ARM) or arm.startswith(TURN_PRM_ARM)


def arm_key(arm: str) -> str:
    """``os``, ``ps``, ``oracle``; ``ps_delta`` for the arm ``process_delta``."""
    return ARM_KEYS.get(arm) or f"ps_{arm.removeprefix(STEP_REWARD_ARM)}"


def arm_title(arm: str) -> str:
    return ARM_TITLES.get(arm) or f"process supervision (learned PRM, {arm.removeprefix(STEP_REWARD_ARM)})"
PRM_COST_STAGES = ("label", "train")
"""The PRM commands whose seconds count against the process arm (its evaluation is a report, not training)."""


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def arm_report(metrics_path: Path, grpo_seconds: float, seconds_before: float = 0.0) -> dict:
    """One GRPO arm from its ``metrics.jsonl``: held-out accuracy at the first and last evaluation and the gain,
    the mean share of groups whose G outcome scores were all equal (``rollout/zero_signal_group_fraction``: no
    outcome-supervised gradient) and of groups kept for the update, the evaluation curve (step, seconds,
    accuracy), and the arm's cost: ``seconds_before`` (e.g. its PRM's labelling and training) plus its GRPO
    command's ``grpo_seconds``."""
    rows = read_metrics(metrics_path)
    evals = [row for row in rows if "eval/accuracy" in row]
    if not evals:
        raise ValueError(f"{metrics_path}: no eval/accuracy rows (the arm never evaluated)")
    steps = [row for row in rows if "rollout/zero_signal_group_fraction" in row]
    return {
        "start_accuracy": evals[0]["eval/accuracy"],
        "accuracy": evals[-1]["eval/accuracy"],
        "gain": evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"],
        "steps": rows[-1]["step"],
        "zero_signal_group_fraction": _mean([row["rollout/zero_signal_group_fraction"] for row in steps]),
        "kept_group_fraction": _mean([row["rollout/kept_group_fraction"] for row in steps
                                      if "rollout/kept_group_fraction" in row]),
        "curve": [[row["step"], round(row["time"] + seconds_before, 1), row["eval/accuracy"]] for row in evals],
        "groups_curve": groups_curve(rows),
        "tokens_curve": groups_curve(rows, "rollout/generated_tokens"),
        "seconds": round(seconds_before + grpo_seconds, 1),
        "prm_seconds": round(seconds_before, 1),
        **cost_split(rows),
        **behaviour(rows),
        **implicit_prm_figures(rows),
        **parameter_report(rows),
    }


PARAMETER_FIGURES = {"trainable_parameters": "model/trainable_parameters", "total_parameters": "model/total_parameters",
                     "optimizer_state_bytes": "memory/optimizer_state_bytes", "gradient_bytes": "memory/gradient_bytes",
                     "parameter_bytes": "memory/parameter_bytes"}
"""What an arm trains and holds (``grpo_mega.perf.parameters``, logged with its first update): a LoRA arm's
adapters and their optimizer state against full training's (issue 78)."""


def parameter_report(rows: list[dict]) -> dict:
    """Each of ``PARAMETER_FIGURES`` from the first row that logs them, as ints; None for a run from before the
    trainer logged them (or one that never updated)."""
    logged = next((row for row in rows if PARAMETER_FIGURES["total_parameters"] in row), {})
    return {name: None if key not in logged else int(logged[key]) for name, key in PARAMETER_FIGURES.items()}


def groups_curve(rows: list[dict], key: str = "train/groups") -> list[list[float]]:
    """``[[step, groups trained so far, held-out accuracy], ...]`` at every evaluation (``train/groups``; with
    ``key="rollout/generated_tokens"`` the tokens generated so far)."""
    curve, trained = [], 0.0
    for row in rows:
        trained += row.get(key, 0.0)
        if "eval/accuracy" in row:
            curve.append([row["step"], trained, row["eval/accuracy"]])
    return curve


def _total(rows: list[dict], *keys: str) -> float:
    return float(sum(row.get(key, 0.0) for row in rows for key in keys))


def cost_split(rows: list[dict]) -> dict:
    """Where a GRPO arm's seconds went, summed over its steps: the PRM's scoring (``timing_s/prm``), the update
    (old and reference log-probs, the optimizer steps), the whole steps; and what it trained on: the groups and
    response tokens of its updates (process supervision keeps every group, outcome supervision's dynamic sampling
    drops the zero-signal ones, so equal steps are not equal data)."""
    steps = [row for row in rows if "timing_s/step" in row]
    step_seconds = _total(steps, "timing_s/step")
    prm_seconds = _total(steps, "timing_s/prm")
    implicit_seconds = _total(steps, "timing_s/implicit_prm")
    return {
        "implicit_prm_share": round(implicit_seconds / step_seconds, 4) if implicit_seconds and step_seconds else None,
        "prm_scoring_seconds": round(prm_seconds, 1),
        "update_seconds": round(_total(steps, "timing_s/old_logprob", "timing_s/ref", "timing_s/update"), 1),
        "step_seconds": round(step_seconds, 1),
        "prm_scoring_share": round(prm_seconds / step_seconds, 4) if step_seconds else None,
        "trained_groups": int(_total(steps, "train/groups")),
        "trained_response_tokens": int(_total(steps, "perf/num_response_tokens")),
        "generated_tokens": int(_total(steps, "rollout/generated_tokens")),
        "tree_sampling_seconds": round(_total(steps, "timing_s/tree_sampling"), 1),
    }


BEHAVIOUR = {"response_length": "response_length/mean", "pieces_per_completion": "rollout/pieces_per_completion",
             "clip_ratio": "rollout/sampled_response_length/clip_ratio",
             "text_after_answer_fraction": "rollout/text_after_answer_fraction",
             "no_answer_fraction": "rollout/no_answer_fraction",
             # multi-turn rollouts (grpo_mega.rollout.turn_metrics): a policy that stops calling its tool, or takes
             # turns that neither call nor answer, shows here (issues 75 and 76)
             "turns_per_rollout": "num_turns/mean", "tool_calls_per_rollout": "tools/calls_per_rollout",
             "tool_call_rate": "tools/call_rate", "tool_error_fraction": "tools/error_fraction",
             "void_turn_fraction": "tools/void_turn_fraction", "max_turns_fraction": "tools/max_turns_fraction",
             "tool_output_token_fraction": "tools/output_token_fraction"}
"""What a gamed credit form changes in the completions (issue 47), and a tool policy's calls and turns, each at an
arm's first and last step (None where the arm never logs it: a single-turn arm has no turns)."""


def behaviour(rows: list[dict]) -> dict:
    """``<figure>_start`` / ``<figure>_end`` of each of ``BEHAVIOUR``, from the first and last steps that log it."""
    figures = {}
    for name, key in BEHAVIOUR.items():
        logged = [row[key] for row in rows if key in row and row["step"] > 0]
        figures[f"{name}_start"] = logged[0] if logged else None
        figures[f"{name}_end"] = logged[-1] if logged else None
    return figures


IMPLICIT_F1 = {"implicit_f1": "eval/implicit_prm/tuned_processbench_f1", "implicit_step_f1": "eval/implicit_prm/step_f1"}
"""The implicit PRM's step detection on the held-out completions (``grpo_mega.stages.implicit_prm_eval``)."""


def implicit_prm_figures(rows: list[dict]) -> dict:
    """``<figure>_first`` / ``<figure>_end`` of each of ``IMPLICIT_F1`` at the first evaluation after step 0 (at step
    0 the implicit PRM is its reference: every reward 0, F1 0 by construction) and the last; {} for other arms."""
    evals = [row for row in rows if row["step"] > 0 and IMPLICIT_F1["implicit_step_f1"] in row]
    if not evals:
        return {}
    return {f"{name}_{when}": row.get(key) for name, key in IMPLICIT_F1.items()
            for when, row in (("first", evals[0]), ("end", evals[-1]))}


def flat_figures(arms: dict[str, dict]) -> dict:
    """``os_accuracy``, ``os_gain``, ``ps_accuracy``, ... of the arms (the keys the seed bench tabulates), with
    ``ps_minus_os`` when both ran."""
    figures = {}
    for arm, report in arms.items():
        figures[f"{arm_key(arm)}_accuracy"] = report["accuracy"]
        figures[f"{arm_key(arm)}_gain"] = report["gain"]
        figures[f"{arm_key(arm)}_zero_signal"] = report["zero_signal_group_fraction"]
        if arm != "outcome" and "outcome" in arms:  # ps_minus_os, implicit_minus_os, tree_222_minus_os, ...
            figures[f"{arm_key(arm)}_minus_os"] = report["accuracy"] - arms["outcome"]["accuracy"]
    return figures


def _figure(value) -> str:
    """A figure for the table; None (e.g. an F1 without both correct and wrong solutions to score) as "n/a"."""
    return "n/a" if value is None else f"{value:.3f}"


DENSE_REGIME_NOTE = (
    "where a PRM pays: not here (this dense regime lets outcome supervision alone solve most groups); where outcome "
    "rewards are sparse, `grpo-mega quickstart --regime sparse` (about 45 minutes on 2 cores), over 5 seeds: the "
    "learned PRM's step credit led outcome supervision by +6.0 (score) to +6.9 (delta) points per step, SE 2.6-2.8; "
    "per second it trailed by 6.0 with the PRM's labels and training charged to one run, and led by +4.0 to +5.5 with "
    "them set aside (bench/results/pipeline_seeds_sparse.json; the README's \"Does a PRM pay?\", docs/results.md)\n"
    "process credit without a trained PRM did not pay there: tree credit from the policy's own rollouts (best plan "
    "[8, 2]) -0.4 points per step and -2.2 per second, the implicit PRM +0.1 per step, RFT -9.1 "
    "(bench/results/pipeline_seeds_sparse_tree.json; the implicit PRM's: pipeline_seeds_sparse.json)")
"""The demo's last lines (``make demo`` runs the dense regime): where the comparison of its arms says nothing, and
the measured sparse verdicts: where each form of process credit paid (tests/test_quickstart_arms.py checks their
figures against the result files)."""


def print_table(summary: dict) -> None:
    """Held-out accuracy before / after each arm with its gain, its zero-signal groups and its cost; the PRM's
    figures; where the time went."""
    print()
    print(f"regime: {summary.get('regime', '?')}   GRPO steps: {summary['steps']}   seed: {summary['seed']}")
    print(f"{'held-out accuracy':40}{'after SFT':>10}{'after GRPO':>11}{'gain':>8}{'zero-signal':>13}{'seconds':>9}")
    for arm, report in summary["arms"].items():
        zero = report["zero_signal_group_fraction"]
        print(f"{'GRPO, ' + arm_title(arm):40}{report['start_accuracy']:>10.3f}{report['accuracy']:>11.3f}"
              f"{100 * report['gain']:>+7.1f}p{'n/a' if zero is None else f'{zero:.2f}':>13}{report['seconds']:>9.0f}")
    print("zero-signal: mean share of groups whose G outcome rewards were all equal (no outcome gradient); seconds: "
          "the arm's GRPO run, plus PRM labelling and training for the learned-PRM arm")
    for arm, report in summary["arms"].items():  # a LoRA arm: what it trains and its optimizer's share
        trainable, total = report.get("trainable_parameters"), report.get("total_parameters")
        if trainable is not None and trainable < total:
            print(f"{arm_title(arm)}: {trainable:,} of {total:,} parameters trained, optimizer state "
                  f"{report['optimizer_state_bytes'] / 2**20:.2f} MiB a rank")
    if summary.get("prm"):
        prm = summary["prm"]
        print(f"PRM: ProcessBench F1 on the SFT policy's held-out solutions {_figure(prm['policy_processbench_f1'])} "
              f"(planted errors {_figure(prm['processbench_f1'])}), Monte-Carlo label agreement "
              f"{_figure(prm['label_agreement'])}")
    timings = ", ".join(f"{name} {value:.0f} s" for name, value in summary["stage_seconds"].items())
    print(f"wall time: {summary['wall_seconds']:.0f} s ({timings})")
    print(f"plot: {summary['plot']}")
    if summary.get("regime") == "dense":
        print(DENSE_REGIME_NOTE)
