"""The tool task's GRPO arms over a seed (``bench/pipeline_seeds.py --regime tools``; issue 75's floor, issue 76's
base): from a finished ``grpo-mega quickstart --regime tools`` run (its data, model and the sparse start chosen by
``grpo_mega.quickstart.tool_selection``), text-only GRPO from the text SFT checkpoint and tool GRPO (outcome
supervision through the turn loop with the calculator) from the tool SFT checkpoint of the same SFT step, on the same
prompts, seed, steps, batch and token budget (``ToolGRPOPlan``). The seed moves GRPO only (sampling, the data order):
the SFT policies are the regime's, one pair for every seed.

Each seed's folder holds one run per arm and ``summary.json``: per arm held-out sampled pass@1 at the start and end
(``grpo_mega.quickstart.report.arm_report``, which also keeps calls and turns per rollout, the tool-call rate, tool
errors, void turns and text after the answer at the first and last step), every arm's difference to tool GRPO
(``<key>_minus_os``: the reference of issue 76's turn-credit arms) and ``tool_minus_text`` (issue 75's floor).

Two arms need the seed's PRM stage first (``grpo_mega.quickstart.tool_prm``: turn labels from the tool policy's
own continuations, the PRM's training and its AUROC report), run once for both: ``tool_turn_prm`` (and
``tool_turn_prm_sum``), turn credit from the learned PRM, charged the labels' and the training's seconds; ``rft``,
the skeptic's baseline: the tool policy fine-tuned on its own verified multi-turn rollouts from those labels (tool
turns masked, ``ToolPRMPlan.rft_epochs`` passes), then tool GRPO (outcome) from there, charged the labels' and the
fine-tuning's seconds.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_mega.quickstart.arm_runs import optional, training_command
from grpo_mega.quickstart.arms import TOOL_ARMS, TOOL_BASELINE, tool_arm_settings, tool_shown
from grpo_mega.quickstart.plots import plot_arms
from grpo_mega.quickstart.report import arm_key, arm_report, arm_title, learned_prm_arm
from grpo_mega.quickstart.tool_prm import (FAST_TOOL_PRM, SUMMARY_FILE, ToolPRMPlan, arm_prm_figures, prm_cost,
                                          run_tool_prm_stage, stage_announcements)
from grpo_mega.quickstart.tool_selection import SELECTION_FILE
from grpo_mega.run.layout import metrics_path


@dataclass(frozen=True)
class ToolGRPOPlan:
    """Sizes of the tool task's GRPO arms (configs/quickstart_grpo.yaml's batch: 32 prompts x 8 completions)."""

    name: str = "tools"
    sft_run: str = "runs/tool_regime"
    """A finished ``grpo-mega quickstart --regime tools`` run with its ``sparse_selection.json``."""
    grpo_steps: int = 60
    response_length: int = 200
    """Every arm's token budget: a three-call tool conversation is ~150 tokens with its tool turns (at 120 the tool
    SFT policy's pass@1 fell from 89.7 % to 30 %); the text-only arm gets the same (its solutions are <= 67)."""
    prompt_length: int = 48
    eval_prompts: int = 300
    eval_every: int = 30
    """Held-out sampled pass@1 (temperature 1) at the start, every this many steps and at the end."""
    more_arms: tuple[str, ...] = ()
    """Arms after text-only and tool GRPO: ``TOOL_ARMS`` or any of ``ARMS`` run with the calculator."""
    seed: int = 1
    prm: ToolPRMPlan = ToolPRMPlan()
    """The PRM stage of the arms that need it (``tool_turn_prm``, ``rft``)."""


FAST_TOOL_GRPO = ToolGRPOPlan(grpo_steps=2, response_length=160, eval_prompts=8, eval_every=2, prm=FAST_TOOL_PRM)


def needs_prm_stage(arm: str) -> bool:
    """Whether ``arm`` runs after the seed's PRM stage: a learned-PRM arm, or RFT (it trains on its labels)."""
    return learned_prm_arm(arm) or arm == "rft"


def sparse_start(sft_run: Path) -> tuple[dict, dict]:
    """(the regime's summary, its sparse start) from ``sft_run``; FileNotFoundError naming what is missing."""
    for name in ("summary.json", SELECTION_FILE):
        if not (sft_run / name).is_file():
            raise FileNotFoundError(f"{sft_run / name}: missing; the tool arms need a finished `grpo-mega quickstart "
                                    f"--regime tools` run with its sparse start (bench/tool_sparse_start.py)")
    summary = json.loads((sft_run / "summary.json").read_text())
    if summary.get("regime") != "tools":
        raise ValueError(f"{sft_run / 'summary.json'}: a run of regime {summary.get('regime')!r}, not 'tools'")
    return summary, json.loads((sft_run / SELECTION_FILE).read_text())


def tool_grpo_overrides(plan: ToolGRPOPlan, regime: dict) -> list[str]:
    """Every tool-task arm's overrides of configs/quickstart_grpo.yaml: the task, its evaluation and sizes."""
    return [f"model.hf_config={regime['model']}", f"data.train_file={regime['train_file']}",
            f"parallel.seed={plan.seed}", f"data.eval_file={regime['heldout_file']}",
            f"data.max_eval_prompts={plan.eval_prompts}", *optional("trainer.eval_every", plan.eval_every),
            f"algorithm.response_length={plan.response_length}", f"data.prompt_length={plan.prompt_length}",
            "trainer.eval_temperature=1.0"]


RFT_BATCH_SIZE = 64
"""configs/quickstart_sft.yaml's batch."""
RFT_LR = 3.0e-4
"""configs/quickstart_sft.yaml's ``optim.min_lr``: where the SFT's schedule ends."""


def run_tool_rft(plan: ToolGRPOPlan, run_dir: Path, regime: dict, start: dict, labels: Path, announce) -> dict:
    """The RFT arm's fine-tuning (``grpo_mega.quickstart.rft``) in ``run_dir/rft``: the tool policy on its verified
    rollouts of ``labels`` with their tool turns (``data.segments_field``, the tool SFT's settings), for
    ``plan.prm.rft_epochs`` passes at the SFT config's final learning rate, constant (3e-4: a fine-tune of a
    trained policy, no warm-up); its figures and seconds."""
    from grpo_mega.data.tokenizer import load_tokenizer
    from grpo_mega.quickstart.rft import steps_for_epochs, write_rft_data
    from grpo_mega.quickstart.tool_regime import TOOLS, sft_overrides

    data = run_dir / "rft_train.jsonl"
    count = write_rft_data(labels, data, load_tokenizer(regime["model"]))
    steps = steps_for_epochs(count, plan.prm.rft_epochs, RFT_BATCH_SIZE)
    announce(f"RFT: {steps} SFT steps ({plan.prm.rft_epochs:g} passes) on the tool policy's {count} verified "
             f"rollouts, tool turns masked, log: {run_dir / 'rft.log'}")
    seconds = training_command(
        "RFT", ["sft"], "quickstart_sft.yaml", run_dir / "rft", steps, (("nll", "sft/nll"),),
        [f"model.hf_config={regime['model']}", f"data.train_file={data}", f"parallel.seed={plan.seed}",
         f"model.init_from={start['tool_checkpoint']}", *sft_overrides("tool", TOOLS),
         f"trainer.batch_size={RFT_BATCH_SIZE}", f"optim.lr={RFT_LR}", f"optim.min_lr={RFT_LR}",
         "optim.warmup_steps=0"], run_dir / "rft.log")
    return {"rft_solutions": count, "rft_steps": steps, "rft_epochs": plan.prm.rft_epochs,
            "rft_seconds": round(seconds, 1)}


def run_tool_arm(arm: str, plan: ToolGRPOPlan, run_dir: Path, regime: dict, start: dict, announce,
                 prm: dict | None = None) -> dict:
    """One arm's GRPO run in ``run_dir/<its folder>`` from its SFT checkpoint; its report. A learned-PRM arm scores
    with the seed's PRM (``prm``: its stage's summary) and carries its cost; RFT fine-tunes first and GRPO starts
    from there, its labels' and fine-tuning's seconds counted."""
    title, overrides, folder, policy = tool_arm_settings(arm)
    init, before, extra = start[f"{policy}_checkpoint"], 0.0, {}
    if needs_prm_stage(arm) and prm is None:
        raise ValueError(f"tool arm {arm}: needs the seed's PRM stage (grpo_mega.quickstart.tool_prm)")
    if learned_prm_arm(arm):
        overrides = (*overrides, f"process_reward.prm={prm['prm_checkpoint']}")
        before, extra = prm_cost(prm), arm_prm_figures(prm)
    if arm == "rft":
        extra = run_tool_rft(plan, run_dir, regime, start, Path(prm["labels"]), announce)
        init, before = run_dir / "rft", prm["seconds"]["label"] + extra["rft_seconds"]
    announce(f"{title} (DP=2 on 2 processes), log: {run_dir / f'{folder}.log'}")
    seconds = training_command(
        f"GRPO ({arm})", ["train"], "quickstart_grpo.yaml", run_dir / folder, plan.grpo_steps, tool_shown(arm),
        [*tool_grpo_overrides(plan, regime), f"model.init_from={init}", *overrides], run_dir / f"{folder}.log")
    return {**arm_report(metrics_path(run_dir / folder), seconds, before), **extra}


def tool_flat_figures(arms: dict[str, dict]) -> dict:
    """``<key>_accuracy`` / ``_gain`` / ``_zero_signal`` of every arm, ``<key>_minus_os`` against tool GRPO,
    ``tool_minus_text`` and the tool-call rate at the last step over the SFT policy's (tool GRPO's first step)."""
    figures = {}
    for arm, report in arms.items():
        key = arm_key(arm)
        figures.update({f"{key}_accuracy": report["accuracy"], f"{key}_gain": report["gain"],
                        f"{key}_zero_signal": report["zero_signal_group_fraction"]})
        if arm != TOOL_BASELINE and TOOL_BASELINE in arms:
            figures[f"{key}_minus_os"] = report["accuracy"] - arms[TOOL_BASELINE]["accuracy"]
        rate, sft_rate = report.get("tool_call_rate_end"), (arms.get(TOOL_BASELINE) or {}).get("tool_call_rate_start")
        if rate is not None and sft_rate:
            figures[f"{key}_call_rate_over_sft"] = rate / sft_rate
    if {"text_grpo", "tool_grpo"} <= set(arms):
        figures["tool_minus_text"] = arms["tool_grpo"]["accuracy"] - arms["text_grpo"]["accuracy"]
    return figures


def write_tool_summary(run_dir: Path, plan: ToolGRPOPlan, regime: dict, start: dict, arms: dict[str, dict],
                       seconds: dict[str, float], wall: float, prm: dict | None = None) -> dict:
    """``run_dir/summary.json`` of one seed (and its plot; ``prm``: its PRM stage's summary, when it ran);
    returns it."""
    first = arms.get(TOOL_BASELINE) or next(iter(arms.values()))
    summary = {
        "regime": plan.name, "seed": plan.seed, "baseline_arm": TOOL_BASELINE,
        "sft_accuracy": first["start_accuracy"],
        "text_sft_accuracy": arms["text_grpo"]["start_accuracy"] if "text_grpo" in arms else None,
        "policy_sft_step": start["total_sft_steps"], "sft_run": plan.sft_run, "sparse_start": start,
        **tool_flat_figures(arms),
        "steps": first["steps"], "eval_prompts": plan.eval_prompts, "response_length": plan.response_length,
        "wall_seconds": round(wall, 1), "stage_seconds": {key: round(value, 1) for key, value in seconds.items()},
        "arms": arms, "run_dir": str(run_dir),
    }
    if prm is not None:
        summary["tool_prm"] = prm
    summary["plot"] = str(plot_arms(
        {arm_title(arm): metrics_path(run_dir / tool_arm_settings(arm)[2]) for arm in arms},
        run_dir / "reward_accuracy.png", title=f"tool task: text-only and tool GRPO, seed {plan.seed}",
        seconds_before={arm_title(arm): report["prm_seconds"] for arm, report in arms.items()
                        if report.get("prm_seconds")}))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def run_tool_seed(run_dir: str | Path, plan: ToolGRPOPlan, arms: tuple[str, ...] | None = None) -> dict:
    """Every arm of ``plan`` (text-only GRPO, tool GRPO, then ``plan.more_arms``) in ``run_dir``; with ``arms``,
    only those, added to the seed's summary.json beside the arms it has (``--add-arms``; an arm it has runs again
    and replaces its report). Writes and returns the summary."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    sft_run = Path(plan.sft_run).resolve()
    regime, start = sparse_start(sft_run)
    reports, seconds, wall, prm = {}, {}, 0.0, None
    done = run_dir / "summary.json"
    if arms is not None and done.is_file():
        previous = json.loads(done.read_text())
        if (previous.get("regime"), previous.get("seed")) != (plan.name, plan.seed):
            raise ValueError(f"{done} is a run of regime {previous.get('regime')!r} seed {previous.get('seed')}, not "
                             f"of {plan.name!r} seed {plan.seed}")
        if previous["sparse_start"]["tool_checkpoint"] != start["tool_checkpoint"]:
            raise ValueError(f"{done} started from {previous['sparse_start']['tool_checkpoint']}, {sft_run} now "
                             f"names {start['tool_checkpoint']}: its arms cannot be compared")
        reports, seconds, wall = previous["arms"], previous["stage_seconds"], previous["wall_seconds"]
        prm = previous.get("tool_prm")
    todo = list(arms) if arms is not None else list(dict.fromkeys(("text_grpo", "tool_grpo", *plan.more_arms)))
    for arm in todo:
        tool_arm_settings(arm)  # an unknown arm is refused before any run
    staged = any(map(needs_prm_stage, todo))
    total = (len(todo) + todo.count("rft")  # the RFT arm announces its fine-tuning and its GRPO run
             + (stage_announcements(plan.prm) if staged and not (run_dir / SUMMARY_FILE).is_file() else 0))
    header = itertools.count(1)
    announce = lambda text: print(f"[{next(header)}/{total}] {text}", flush=True)  # noqa: E731
    if staged:
        begin = time.perf_counter()
        prm = run_tool_prm_stage(run_dir, regime, start, seed=plan.seed, response_length=plan.response_length,
                                 prm_plan=plan.prm, announce=announce)
        seconds.update({f"prm_{key}": value for key, value in prm["seconds"].items()})
        wall += time.perf_counter() - begin
    for arm in todo:
        begin = time.perf_counter()
        reports[arm] = run_tool_arm(arm, plan, run_dir, regime, start, announce, prm)
        if arm == "rft":
            seconds["rft"] = reports[arm]["rft_seconds"]
        seconds[tool_arm_settings(arm)[2]] = time.perf_counter() - begin - reports[arm].get("rft_seconds", 0.0)
        wall += time.perf_counter() - begin
    ordered = {arm: reports[arm] for arm in (*TOOL_ARMS, *reports) if arm in reports}
    return write_tool_summary(run_dir, plan, regime, start, ordered, seconds, wall, prm)
