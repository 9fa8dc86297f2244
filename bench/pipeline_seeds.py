"""The quickstart pipeline over seeds, with all three GRPO arms: outcome supervision, process supervision by the
learned PRM, and process supervision by the task's ground-truth step checker (the oracle PRM).

    .venv/bin/python bench/pipeline_seeds.py [--seeds 1 2 3] [--regime dense|sparse] [--out runs/pipeline_seeds] \
        [--step-rewards progress delta clip]

Each seed runs the whole pipeline of ``grpo-mega quickstart`` (same data; the seed moves SFT, the PRM's labels and
training, and GRPO) plus the oracle arm, in ``OUT/seed<N>``. Prints one row per seed with the mean, the standard
deviation and the range, each arm's gain over SFT and its share of zero-signal groups, the Monte-Carlo labels'
agreement with the step checker's truth and with the truth by value, then for every arm the seed-by-seed difference
arm - outcome at equal steps, at equal seconds (``bench.seed_curves``: a learned PRM's labels and training counted,
and set aside: a PRM serves many runs), and at equal data (the groups the updates trained on) with its mean,
standard deviation and standard error; each arm's cost split (PRM scoring share of its steps, groups trained) and
behaviour (pieces per completion, length-cap share, text after the answer, at its first and last step); plots every
arm's mean curve by step and by seconds (next to the result: bench/results/pipeline_seeds_<regime>.png; ``--plot``
to put it elsewhere, e.g. docs/img/) and writes bench/results/pipeline_seeds_<regime>.json (path printed last).
``--step-rewards`` adds a learned-PRM arm per ``process_reward.step_reward`` option named (the process arm's
settings with that option, the same PRM, SFT checkpoint, seed and steps); ``--implicit`` the implicit PRM's arm.
``--arms ARM ...`` adds arms of ``grpo_mega.quickstart.arms.ARMS`` to each new seed's pipeline, right after
outcome supervision (issue 57's verdict: ``--no-oracle --arms tree_222 tree_2222 tree_42 process_completion
process_delta_completion oracle_completion rft``), and every arm is also compared at equal generated tokens
(``rollout/generated_tokens``: a tree generates each shared segment once).
``--no-learned-prm`` runs a new seed without the learned PRM (its labels, training and arms), for arms that need none
(issue 59's ``--no-oracle --no-learned-prm --implicit --arms implicit_after``: both orders of the implicit PRM's
update from one SFT checkpoint; on the machine type of a recorded run, ``--recorded DIR`` in place of ``--implicit``).
``--add-arms ARM ...`` runs only the arms named in seeds already run in OUT (e.g. the implicit PRM's arms beside the
recorded ones: ``--out runs/pipeline_seeds --add-arms implicit implicit_all_groups``); its report goes to
OUT/pipeline_seeds_<regime>.json unless ``--result`` names a file (the recorded one is rewritten by ``--reuse``).
``--regime tools`` runs the tool task's arms (``grpo_mega.quickstart.tool_pipeline``) from a finished ``grpo-mega
quickstart --regime tools`` run (``--sft-run DIR``, with its sparse start: bench/tool_sparse_start.py): text-only GRPO
and tool GRPO (outcome) from the SFT pair of the same step, every arm set against tool GRPO, and issue 75's floor:
tool - text held-out accuracy and the tool-call rate at the last step over the SFT policy's, per seed (``--arms`` /
``--add-arms`` take the tool arms and any arm of ARMS, run with the calculator). Issue 76's ``tool_turn_prm`` and
``rft`` run the seed's PRM stage first, once for both (``grpo_mega.quickstart.tool_prm``: turn labels from the tool
policy's own continuations, the PRM's training, its AUROC on held-out turns in ``tool_prm`` of the seed's summary and
beside the arm): ``--out OUT --add-arms tool_turn_prm rft``. ``tool_turn_tree`` (the tree by turns, no reward
model) needs no stage: its tree's extra rollouts are in its own run's generated tokens and seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.seed_curves import equal_groups, equal_seconds, plot_seed_curves  # noqa: E402
from bench.seed_table import report_seeds  # noqa: E402
from grpo_mega.algo import STEP_REWARDS  # noqa: E402
from grpo_mega.quickstart.arms import ARMS, TOOL_ARMS, arm_settings, tool_arm_settings  # noqa: E402
from grpo_mega.quickstart.arm_runs import add_arms  # noqa: E402
from grpo_mega.quickstart.pipeline import FAST, REGIMES, run_pipeline  # noqa: E402
from grpo_mega.quickstart.report import arm_key, arm_report, arm_title, flat_figures, learned_prm_arm  # noqa: E402
from grpo_mega.quickstart.tool_pipeline import (  # noqa: E402
    FAST_TOOL_GRPO,
    ToolGRPOPlan,
    run_tool_seed,
    sparse_start,
    tool_flat_figures,
)
from grpo_mega.run.layout import metrics_path  # noqa: E402

COLUMNS = ("sft_accuracy", "os_accuracy", "ps_accuracy", "oracle_accuracy", "os_gain", "ps_gain", "oracle_gain",
           "os_zero_signal", "ps_zero_signal", "ps_minus_os", "ps_minus_os_equal_seconds", "oracle_minus_os",
           "prm_f1", "prm_label_agreement", "prm_value_label_agreement")
TOOL_COLUMNS = ("text_sft_accuracy", "sft_accuracy", "text_accuracy", "tool_accuracy", "text_gain", "tool_gain",
                "tool_minus_text", "text_zero_signal", "tool_zero_signal", "tool_call_rate_over_sft")
"""The tool regime's table: ``sft_accuracy`` is the tool SFT policy's, ``tool_call_rate_over_sft`` the floor's."""
ALL_ARMS = sorted({*ARMS, *TOOL_ARMS})


def value_label_agreement(summary: dict) -> float | None:
    """The Monte-Carlo labels' agreement with the truth by value: from the summary, or (a run from before the
    summary carried it) from the labels' own summary file in the run directory."""
    value = (summary.get("prm") or {}).get("value_label_agreement")
    labels_summary = Path(summary["run_dir"]) / "prm_labels.jsonl.summary.json"
    if value is None and labels_summary.is_file():
        value = json.loads(labels_summary.read_text()).get("value_label_agreement")
    return value


def difference_report(differences: list[float]) -> dict:
    """Mean, sample standard deviation and standard error of the seed-by-seed differences, and whether the mean
    is more than twice its standard error."""
    mean = statistics.mean(differences)
    sd = statistics.stdev(differences) if len(differences) > 1 else 0.0
    standard_error = sd / len(differences) ** 0.5
    return {"per_seed": differences, "mean": mean, "sd": sd, "standard_error": standard_error,
            "mean_over_two_standard_errors": mean > 2 * standard_error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--regime", choices=sorted({*REGIMES, "tools"}), default="dense")
    parser.add_argument("--sft-run", type=Path, default=ROOT / "runs" / "tool_regime",
                        help="--regime tools: the finished `grpo-mega quickstart --regime tools` run (with its "
                        "sparse_selection.json) whose data, model and SFT checkpoints every seed starts from")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "pipeline_seeds")
    parser.add_argument("--result", type=Path, default=None,
                        help="default: bench/results/pipeline_seeds_<regime>.json (with --add-arms: "
                        "OUT/pipeline_seeds_<regime>.json, the recorded file left as it is)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="every arm's mean curve by step and by seconds; default: the result's path with .png")
    parser.add_argument("--fast", action="store_true", help="the shortened plan of the end-to-end test")
    parser.add_argument("--step-rewards", nargs="*", default=[], choices=[k for k in STEP_REWARDS if k != "score"],
                        help="more learned-PRM arms, one per process_reward.step_reward option")
    parser.add_argument("--implicit", action="store_true",
                        help="also the implicit-PRM arm (process_reward.source: implicit, PRIME: trained online)")
    parser.add_argument("--arms", nargs="+", default=[], metavar="ARM", choices=ALL_ARMS,
                        help="more arms in each new seed's pipeline, after the default ones (e.g. tree_222 tree_42 "
                        "process_completion)")
    parser.add_argument("--no-oracle", action="store_true", help="leave the oracle arm (with the pooled baseline) out")
    parser.add_argument("--no-learned-prm", action="store_true",
                        help="a new seed's pipeline without the learned PRM (no labels, PRM training or process arm): "
                        "for arms that need none, e.g. --no-oracle --implicit --arms implicit_after")
    parser.add_argument("--recorded", type=Path, default=None, metavar="DIR",
                        help="add to each seed the arms it lacks from DIR/seed<N>/summary.json (a recorded run, e.g. "
                        "bench/results/pipeline_seeds_sparse_runs), when both started from the same SFT checkpoint "
                        "step and held-out accuracy (this machine type reproduces a seed bit for bit)")
    parser.add_argument("--add-arms", nargs="+", default=[], metavar="ARM", choices=ALL_ARMS,
                        help="run only these arms in each seed's finished OUT/seed<N> (its data, SFT checkpoint and "
                        "PRM) and add them to its summary.json, then report every arm it has")
    parser.add_argument("--reuse", action="store_true", help="take a seed's OUT/seed<N>/summary.json when one of "
                        "the same regime exists (e.g. a finished `grpo-mega quickstart` run linked there) instead of "
                        "running it again")
    args = parser.parse_args()
    if args.no_learned_prm:
        needing = [arm for arm in args.arms if learned_prm_arm(arm) or arm == "rft"]  # RFT trains on its labels
        if needing or args.step_rewards:
            parser.error(f"--no-learned-prm: {needing or ['--step-rewards']} need the learned PRM")
    if args.regime == "tools":
        refused = [flag for flag, used in (("--step-rewards", args.step_rewards), ("--implicit", args.implicit),
                                           ("--recorded", args.recorded), ("--no-learned-prm", args.no_learned_prm))
                   if used]
        if refused:
            parser.error(f"--regime tools: {refused} are options of the text regimes' PRM arms")
        base = replace(FAST_TOOL_GRPO if args.fast else ToolGRPOPlan(), sft_run=str(args.sft_run.resolve()),
                       more_arms=tuple(args.arms))
        try:
            sparse_start(args.sft_run.resolve())
        except (OSError, ValueError) as error:
            parser.error(f"--sft-run: {error}")
    else:
        unknown = [arm for arm in (*args.arms, *args.add_arms) if arm not in ARMS]
        if unknown:
            parser.error(f"{unknown}: arms of --regime tools only")
        base = FAST if args.fast else REGIMES[args.regime]
    result = default_result(args)
    if args.result is None and not args.add_arms:
        keep_a_larger_record(result, args.seeds)
    results = []
    for seed in args.seeds:
        print(f"== seed {seed}", flush=True)
        done = args.out / f"seed{seed}" / "summary.json"
        if args.regime == "tools" and not (args.reuse and done.is_file() and not args.add_arms):
            summary = run_tool_seed(args.out / f"seed{seed}", replace(base, seed=seed), args.add_arms or None)
        elif args.add_arms:
            summary = add_arms(args.out / f"seed{seed}", replace(base, seed=seed), args.add_arms)
        elif args.reuse and done.is_file() and json.loads(done.read_text()).get("regime") == base.name:
            print(f"   reusing {done}", flush=True)
            summary = refreshed(json.loads(done.read_text()))
        else:
            summary = run_pipeline(args.out / f"seed{seed}", replace(base, seed=seed, oracle_arm=not args.no_oracle,
                                                                     step_reward_arms=tuple(args.step_rewards),
                                                                     implicit_arm=args.implicit,
                                                                     more_arms=tuple(args.arms),
                                                                     process_supervision=not args.no_learned_prm))
        if args.recorded is not None:
            try:
                summary = with_recorded_arms(summary, args.recorded / f"seed{seed}" / "summary.json")
            except ValueError as refused:  # another machine's run (its BLAS): this seed's own arms are reported
                print(f"   seed {seed}: the recorded arms are left out: {refused}", flush=True)
        results.append(with_comparisons(summary))
    extra, columns = {}, list(TOOL_COLUMNS if args.regime == "tools" else COLUMNS)
    arms, baseline = common_arms(results), results[0].get("baseline_arm", "outcome")
    if len(arms) < len(results[0]["arms"]):
        print(f"arms not in every seed, left out of the comparison: "
              f"{sorted(set().union(*(r['arms'] for r in results)) - set(arms))}")
    for key in [arm_key(arm) for arm in arms if arm != baseline]:
        for suffix, when in (("", "equal steps"), ("_equal_seconds", "equal seconds"),
                             ("_equal_seconds_set_aside", "equal seconds, the PRM's one-off cost set aside"),
                             ("_equal_groups", "equal data (groups trained)"),
                             ("_equal_tokens", "equal generated tokens")):
            if any(f"{key}_minus_os{suffix}" not in r for r in results):
                continue
            differences = extra[f"{key}_minus_os{suffix}"] = difference_report(
                [r[f"{key}_minus_os{suffix}"] for r in results])
            print(f"{key} - {'outcome' if baseline == 'outcome' else arm_key(baseline)}, held-out accuracy at {when}, "
                  "per seed: "
                  f"{', '.join(f'{d:+.3f}' for d in differences['per_seed'])}; mean {differences['mean']:+.3f}, "
                  f"sd {differences['sd']:.3f}, standard error {differences['standard_error']:.3f}")
        if key not in ("ps", "oracle", "text"):  # the step-reward arms, the implicit PRM's, tool arms
            columns += [f"{key}_accuracy", f"{key}_gain", f"{key}_zero_signal", f"{key}_minus_os",
                        f"{key}_minus_os_equal_seconds"]
    if args.regime == "tools":
        extra.update(tool_floor(results))
    else:
        columns.append("oracle_minus_os_equal_seconds")
    extra["arm_figures"] = arm_figures(results, arms)
    plot = args.plot or result.with_suffix(".png")
    extra["plot"] = str(plot_seed_curves(results, {arm: arm_title(arm) for arm in arms}, plot,
                                         f"{base.name} regime, {len(results)} seeds: GRPO from the same SFT "
                                         + ("step (the text and the tool policy)" if args.regime == "tools"
                                            else "checkpoint")))
    report_seeds(args.seeds, results, columns, result, width=24 if args.regime == "tools" else 14, extra=extra)
    return 0


def tool_floor(results: list[dict]) -> dict:
    """Issue 75's floor over the seeds: tool GRPO - text-only GRPO in held-out accuracy (mean > 2 SE and >= 10
    points), and every seed's tool-call rate at the last step >= 80 % of the SFT policy's (tool GRPO's first
    step); printed and returned for the record."""
    if not all("tool_minus_text" in r for r in results):
        return {}
    lead = difference_report([r["tool_minus_text"] for r in results])
    rates = [r.get("tool_call_rate_over_sft") for r in results]
    floor = {"tool_minus_text": lead, "tool_call_rate_over_sft": rates,
             "floor_met": lead["mean"] >= 0.10 and lead["mean_over_two_standard_errors"]
             and all(rate is not None and rate >= 0.8 for rate in rates)}
    print(f"tool - text GRPO, held-out accuracy at equal steps, per seed: "
          f"{', '.join(f'{d:+.3f}' for d in lead['per_seed'])}; mean {lead['mean']:+.3f}, sd {lead['sd']:.3f}, "
          f"standard error {lead['standard_error']:.3f}; tool-call rate at the last step over the SFT policy's: "
          f"{', '.join('n/a' if r is None else f'{r:.2f}' for r in rates)}; issue 75's floor (>= +0.10, > 2 SE, "
          f"rate >= 0.80): {'met' if floor['floor_met'] else 'not met'}")
    return floor


def default_result(args) -> Path:
    """Where the report goes: ``--result``; else, for ``--add-arms`` (which reruns a few arms of seeds already run),
    OUT/pipeline_seeds_<regime>.json beside them, never over the recorded bench/results file (its verdict is rewritten
    only by a run that names it, or by ``--reuse`` over every recorded seed); else bench/results/."""
    if args.result is not None:
        return args.result
    if args.add_arms:
        return args.out / f"pipeline_seeds_{args.regime}.json"
    return ROOT / "bench" / "results" / f"pipeline_seeds_{args.regime}.json"


def keep_a_larger_record(result: Path, seeds: list[int]) -> None:
    """Refuse to write the default ``result`` over a record of seeds this run does not cover (``--add-arms`` on one
    seed would otherwise replace the recorded 5-seed verdict with a 1-seed one): such a run names its own
    ``--result``."""
    try:
        recorded = json.loads(result.read_text()).get("seeds") or []
    except FileNotFoundError:
        return
    except (OSError, ValueError) as error:
        raise SystemExit(f"{result}: unreadable ({error}); pass --result to write elsewhere") from None
    missing = sorted(set(recorded) - set(seeds))
    if missing:
        raise SystemExit(f"{result} records seeds {recorded}; this run has {sorted(seeds)}, so writing it there would "
                         f"drop seeds {missing}: pass --result FILE (or every recorded seed, with --reuse)")


def with_recorded_arms(summary: dict, recorded_path: Path) -> dict:
    """``summary`` with the arms of the recorded run ``recorded_path`` that it lacks (their reports as recorded, marked
    ``recorded_from``), and their flat figures; refused unless both runs start from the same SFT checkpoint step
    and held-out accuracy, and any arm both ran without a learned PRM ended at the same accuracy (the same seed on
    the same kind of machine repeats a run bit for bit; another machine's BLAS does not). An arm scored by the
    learned PRM may end elsewhere: since issue 59 the PRM's forward carries a group's prompt once, which rounds the
    scores differently in the last bits and, over 60 steps, can change a sample; both accuracies are kept in
    ``recorded_differences`` and printed."""
    recorded = json.loads(recorded_path.read_text())
    for key in ("regime", "seed", "policy_sft_step", "sft_accuracy"):
        if recorded.get(key) != summary.get(key):
            raise ValueError(f"{recorded_path}: {key}={recorded.get(key)!r} but this run has {summary.get(key)!r}: "
                             "not the same start, its arms cannot be compared with this run's")
    differences = {}
    for arm in sorted(set(recorded["arms"]) & set(summary["arms"])):
        was, now = recorded["arms"][arm]["accuracy"], summary["arms"][arm]["accuracy"]
        if was == now:
            continue
        if not learned_prm_arm(arm):
            raise ValueError(f"{recorded_path}: arm {arm} ended at {was} but at {now} here: the runs differ, the "
                             "recorded arms do not stand for this machine's")
        differences[arm] = {"recorded": was, "here": now}
        print(f"   {arm}: {now} here, {was} in {recorded_path} (the learned PRM's scores round differently since "
              "issue 59's prompt-once forward); this run's kept", flush=True)
    added = {arm: {**report, "recorded_from": str(recorded_path)} for arm, report in recorded["arms"].items()
             if arm not in summary["arms"]}
    summary = {**summary, "arms": {**summary["arms"], **added}}
    if differences:
        summary["recorded_differences"] = differences
    summary.update(flat_figures(summary["arms"]))
    return summary


def with_comparisons(summary: dict) -> dict:
    """A seed's summary with the oracle's difference to outcome supervision at equal steps (the summary has the
    learned-PRM arms' ``<key>_minus_os``), every arm's at equal seconds (``<key>_minus_os_equal_seconds``,
    ``bench.seed_curves.equal_seconds``), and the label agreements. A seed without its baseline arm (outcome
    supervision; the tool regime's tool GRPO) gets no comparisons."""
    row = {**summary, "prm_label_agreement": (summary.get("prm") or {}).get("label_agreement"),
           "prm_value_label_agreement": value_label_agreement(summary)}
    arms, baseline = summary["arms"], summary.get("baseline_arm", "outcome")  # the tool regime's: tool GRPO
    if baseline not in arms:  # e.g. a tools seed run with --add-arms alone: nothing to compare against
        return row
    if "oracle" in arms:
        row["oracle_minus_os"] = arms["oracle"]["accuracy"] - arms[baseline]["accuracy"]
    for arm, report in arms.items():
        if arm != baseline:
            key, reference = arm_key(arm), arms[baseline]
            row[f"{key}_equal_seconds"] = compared = equal_seconds(report, reference)
            row[f"{key}_minus_os_equal_seconds"] = compared["minus_os"]
            if report.get("prm_seconds"):
                aside = equal_seconds(report, reference, set_aside=report["prm_seconds"])
                row[f"{key}_minus_os_equal_seconds_set_aside"] = aside["minus_os"]
            if "groups_curve" in report and "groups_curve" in reference:
                row[f"{key}_minus_os_equal_groups"] = equal_groups(report, reference)["minus_os"]
            if report.get("tokens_curve") and reference.get("tokens_curve"):
                row[f"{key}_minus_os_equal_tokens"] = equal_groups(report, reference,
                                                                   curve="tokens_curve")["minus_os"]
    return row


FIGURES = ("prm_scoring_share", "implicit_prm_share", "trained_groups", "generated_tokens",
           "response_length_start", "response_length_end", "pieces_per_completion_start", "pieces_per_completion_end",
           "clip_ratio_end", "text_after_answer_fraction_start", "text_after_answer_fraction_end",
           "no_answer_fraction_end", "tree_sampling_seconds",
           "implicit_f1_first", "implicit_f1_end", "implicit_step_f1_first", "implicit_step_f1_end",
           "turns_per_rollout_start", "turns_per_rollout_end", "tool_calls_per_rollout_start",
           "tool_calls_per_rollout_end", "tool_call_rate_start", "tool_call_rate_end", "tool_error_fraction_start",
           "tool_error_fraction_end", "void_turn_fraction_start", "void_turn_fraction_end", "max_turns_fraction_end",
           "prm_true_step_auroc", "prm_step_auroc", "prm_untrained_true_step_auroc", "rft_solutions", "rft_steps",
           "trainable_parameters", "total_parameters", "optimizer_state_bytes")


def refreshed(summary: dict) -> dict:
    """A reused seed's summary with each arm's report made again from its ``metrics.jsonl`` where the run folder
    still has it (figures added to ``arm_report`` since the seed ran), its seconds kept."""
    run_dir, tools = Path(summary["run_dir"]), summary.get("regime") == "tools"
    for arm, report in summary["arms"].items():
        metrics = metrics_path(run_dir / (tool_arm_settings(arm) if tools else arm_settings(arm))[2])
        if metrics.is_file():
            prm_seconds = report.get("prm_seconds", 0.0)  # figures of the arm's own stages (its PRM's AUROC) kept
            summary["arms"][arm] = {**report, **arm_report(metrics, report["seconds"] - prm_seconds, prm_seconds)}
    if tools:
        summary.update(tool_flat_figures(summary["arms"]))
    return summary


def common_arms(results: list[dict]) -> list[str]:
    """The arms every seed ran, in the first seed's order (``--add-arms`` may have added some to a few seeds)."""
    return [arm for arm in results[0]["arms"] if all(arm in r["arms"] for r in results)]


def arm_figures(results: list[dict], arms: list[str]) -> dict:
    """Per arm, each of ``FIGURES`` over the seeds (a summary from before issue 47 lacks them: None), printed as a
    table; and how many runs amortise a learned PRM's one-off cost (its seconds over the outcome arm's)."""
    figures = {}
    for arm in arms:
        reports = [run["arms"][arm] for run in results]
        figures[arm] = {name: [report.get(name) for report in reports] for name in FIGURES}
        if reports[0].get("prm_seconds"):  # against the baseline arm (the tool regime's: tool GRPO)
            figures[arm]["prm_cost_in_outcome_runs"] = [
                report["prm_seconds"] / run["arms"][run.get("baseline_arm", "outcome")]["seconds"]
                for report, run in zip(reports, results)]
    print(f"{'arm':34}" + "".join(f"{name[:13]:>14}" for name in FIGURES))
    for arm, values in figures.items():
        means = [[v for v in values[name] if v is not None] for name in FIGURES]
        print(f"{arm_title(arm)[:33]:34}" + "".join(f"{statistics.fmean(v):>14.3f}" if v else f"{'n/a':>14}"
                                                    for v in means))
    return figures


if __name__ == "__main__":
    sys.exit(main())
