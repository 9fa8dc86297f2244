"""Running the quickstart's GRPO arms: one training command with its live line, a GRPO arm from a checkpoint, the RFT
arm (``grpo_mega.quickstart.rft``), and more arms added to a finished run (``add_arms``:
``bench/pipeline_seeds.py --add-arms``). ``grpo_mega.quickstart.pipeline`` runs the whole pipeline with them."""

from __future__ import annotations

import json
from pathlib import Path
from grpo_mega.quickstart.arms import SHOWN, arm_settings
from grpo_mega.quickstart.plans import QuickstartPlan
from grpo_mega.quickstart.plots import plot_arms
from grpo_mega.quickstart.report import arm_report, arm_title, flat_figures, learned_prm_arm
from grpo_mega.run.commands import CONFIG_DIR, CommandProgress, run_command
from grpo_mega.run.layout import checkpoint_dir, metrics_path

NPROC = 2
"""Processes of every command (DP=2 on 2 CPU cores)."""


def config_steps(config: str, section: str = "trainer", key: str = "total_steps") -> int:
    import yaml

    return int(yaml.safe_load((CONFIG_DIR / config).read_text())[section][key])


def optional(key: str, value) -> list[str]:
    return [] if value is None else [f"{key}={value}"]


def training_command(title: str, command: list[str], config: str, run_dir: Path, steps: int | None,
                      metrics: tuple[tuple[str, str], ...], overrides: list[str], log_path: Path) -> float:
    """One training command on 2 processes, its live line following ``run_dir/metrics.jsonl``."""
    progress = CommandProgress(title=title, metrics_path=metrics_path(run_dir),
                               total_steps=steps or config_steps(config), metrics=metrics)
    argv = [*command, "--config", str(CONFIG_DIR / config), "--nproc", str(NPROC), f"trainer.run_dir={run_dir}",
            "trainer.progress_bar=false", *optional("trainer.total_steps", steps), *overrides]
    return run_command(argv, log_path, progress)


def sft_checkpoint(sft_dir: Path, step: int) -> Path:
    checkpoint = checkpoint_dir(sft_dir, step)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"the SFT run kept no checkpoint of step {step}: {checkpoint}")
    return checkpoint


def grpo_overrides(plan: QuickstartPlan, task: list[str], heldout_file: Path) -> list[str]:
    """Every GRPO arm's overrides of configs/quickstart_grpo.yaml: the task, its evaluation and sizes."""
    return [*task, f"data.eval_file={heldout_file}", *optional("data.max_eval_prompts", plan.eval_prompts),
            *optional("trainer.eval_every", plan.eval_every),
            *optional("algorithm.response_length", plan.response_length)]


def grpo_arm(arm: str, plan: QuickstartPlan, run_dir: Path, grpo: list[str], policy_dir: Path,
              prm_checkpoint: str | None, announce) -> float:
    """One GRPO arm's run from ``policy_dir`` in ``run_dir/<its folder>``; its wall seconds."""
    title, overrides, folder = arm_settings(arm)
    if learned_prm_arm(arm):
        overrides = (*overrides, f"process_reward.prm={prm_checkpoint}")
    announce(f"{title} (DP=2 on 2 processes), log: {run_dir / f'{folder}.log'}")
    return training_command(
        f"GRPO ({arm})", ["train"], "quickstart_grpo.yaml", run_dir / folder, plan.grpo_steps,
        SHOWN.get("process" if learned_prm_arm(arm) else arm, SHOWN["outcome"]),
        [*grpo, f"model.init_from={policy_dir}", *overrides], run_dir / f"{folder}.log")


def rft_arm(plan: QuickstartPlan, run_dir: Path, task: list[str], grpo: list[str], policy_dir: Path,
            prm_train_seconds: float, announce) -> tuple[float, float]:
    """The RFT arm (``grpo_mega.quickstart.rft``): the policy fine-tuned in ``run_dir/rft`` on its verified
    solutions from ``run_dir/prm_labels.jsonl`` for ``prm_train_seconds``, then outcome GRPO from it; (RFT seconds,
    GRPO seconds)."""
    from grpo_mega.quickstart.rft import steps_for_seconds, write_rft_data

    data = run_dir / "data" / "rft_train.jsonl"
    count = write_rft_data(run_dir / "prm_labels.jsonl", data)
    steps = steps_for_seconds(prm_train_seconds, metrics_path(run_dir / "sft"))
    announce(f"RFT: {steps} SFT steps (the PRM training's {prm_train_seconds:.0f} s) on the policy's {count} verified "
             f"solutions, log: {run_dir / 'rft.log'}")
    rft_seconds = training_command("RFT", ["sft"], "quickstart_sft.yaml", run_dir / "rft", steps,
                                   (("nll", "sft/nll"),), [*task, f"data.train_file={data}",
                                                           f"model.init_from={policy_dir}"], run_dir / "rft.log")
    return rft_seconds, grpo_arm("rft", plan, run_dir, grpo, run_dir / "rft", None, announce)


def add_arms(run_dir: str | Path, plan: QuickstartPlan, arms: list[str]) -> dict:
    """Run more GRPO arms in a finished pipeline run of ``plan`` (its data, the arms' SFT checkpoint and, for a
    learned-PRM arm, its PRM), each beside the arms it has, and add them to its ``summary.json`` (rewritten with its
    plot); returns the summary. An arm it already has runs again and replaces its report."""
    run_dir = Path(run_dir).resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    if (summary.get("regime"), summary.get("seed")) != (plan.name, plan.seed):
        raise ValueError(f"{run_dir / 'summary.json'} is a run of regime {summary.get('regime')!r} seed "
                         f"{summary.get('seed')}, not of {plan.name!r} seed {plan.seed}")
    task = [f"model.hf_config={run_dir / 'model'}", f"data.train_file={run_dir / 'data' / 'train.jsonl'}",
            f"parallel.seed={plan.seed}"]
    grpo = grpo_overrides(plan, task, run_dir / "data" / "heldout.jsonl")
    sft_dir, step = run_dir / "sft", summary.get("policy_sft_step")
    policy_dir = sft_dir if step is None else sft_checkpoint(sft_dir, step)
    prm_cost = max((report.get("prm_seconds", 0.0) for arm, report in summary["arms"].items() if learned_prm_arm(arm)),
                   default=0.0)
    announcements = len(arms) + arms.count("rft")  # the RFT arm announces its fine-tuning and its GRPO run
    header = iter(range(1, announcements + 1))
    for arm in arms:
        folder = arm_settings(arm)[2]
        announce = lambda text: print(f"[{next(header)}/{announcements}] {text}", flush=True)  # noqa: E731
        before = prm_cost if learned_prm_arm(arm) else 0.0
        if arm == "rft":
            rft_seconds, seconds = rft_arm(plan, run_dir, task, grpo, policy_dir,
                                           summary["stage_seconds"]["prm_train"], announce)
            summary["stage_seconds"]["rft"] = round(rft_seconds, 1)
            before = summary["stage_seconds"]["prm_label"] + rft_seconds
        else:
            seconds = grpo_arm(arm, plan, run_dir, grpo, policy_dir, str(run_dir / "prm"), announce)
        summary["stage_seconds"][folder] = round(seconds, 1)
        summary["arms"][arm] = arm_report(metrics_path(run_dir / folder), seconds, before)
    summary.update(flat_figures(summary["arms"]))
    summary["plot"] = str(plot_arms(
        {arm_title(arm): metrics_path(run_dir / arm_settings(arm)[2]) for arm in summary["arms"]},
        run_dir / "reward_accuracy.png",
        title=f"quickstart ({plan.name} regime): GRPO from the same SFT policy, seed {plan.seed}",
        seconds_before={arm_title(arm): report["prm_seconds"] for arm, report in summary["arms"].items()
                        if report.get("prm_seconds")}))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
