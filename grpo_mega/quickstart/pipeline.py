"""``grpo-mega quickstart`` (``make demo``): the whole pipeline on 2 CPU cores, from nothing.

data + tokenizer -> tiny Qwen2-shaped policy -> SFT -> Monte-Carlo step labels from the SFT policy -> PRM training
-> PRM evaluation -> GRPO with outcome supervision and GRPO with process supervision (the learned PRM scores every
step) from the same SFT checkpoint and seed -> held-out accuracy before / after for each arm, a table, one PNG with
both arms' curves and ``summary.json``; the last line printed is the path of ``summary.json``. Each part is a
separate ``grpo-mega`` command on 2 gloo processes (data-parallel, DP=2) with a YAML config from configs/ and
its log in the run directory; the terminal shows one live line per command (``grpo_mega.run.commands``).

Half of the SFT targets state the answer without working the steps (``direct_answer_fraction``), as in SFT sets
that mix worked solutions with bare answers: the SFT policy then works the steps on some prompts and guesses on
others, and GRPO learns that working the steps is right more often.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from grpo_mega.quickstart.arm_runs import (NPROC, config_steps, grpo_arm, grpo_overrides, rft_arm,
                                          sft_checkpoint, training_command)
from grpo_mega.quickstart.arms import SHOWN, arm_settings
from grpo_mega.quickstart.plans import DENSE, FAST, POLICY_SHAPE, REGIMES, SPARSE, QuickstartPlan  # noqa: F401 (their home)
from grpo_mega.quickstart.plots import plot_arms
from grpo_mega.quickstart.report import (
    PRM_COST_STAGES,
    STEP_REWARD_ARM,
    arm_report,
    arm_title,
    flat_figures,
    learned_prm_arm,
    print_table,
)
from grpo_mega.run.layout import metrics_path, step_dir_name
from grpo_mega.run.metrics import read_metrics


def build_data_and_model(run_dir: Path, plan: QuickstartPlan, seed: int = 0) -> tuple[Path, Path, Path]:
    """Write the synthetic task, its tokenizer and the policy's HF config folder; returns (model, train, heldout)."""
    from transformers import Qwen2Config

    from grpo_mega.data.build import build_synthetic_task
    from grpo_mega.data.tokenizer import load_tokenizer

    files = build_synthetic_task(run_dir / "data", num_train=plan.num_train, num_heldout=plan.num_heldout, seed=seed,
                                 difficulty=plan.difficulty, direct_answer_fraction=plan.direct_answer_fraction)
    tokenizer = load_tokenizer(files.tokenizer)
    model_dir = run_dir / "model"
    config = Qwen2Config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **POLICY_SHAPE,
    )
    config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, files.train, files.heldout


def _iterative_process_arm(plan: QuickstartPlan, arm_dir: Path, grpo: list[str], policy_dir: Path, prm_summary: dict,
                           model_dir: Path, train_file: Path) -> dict[str, float]:
    """The process-supervised arm as ``plan.iterations`` GRPO runs (``arm_dir/iter<k>``), each from the previous
    run's policy, with a PRM refresh before each run after the first; writes every run's metrics rows, steps counted
    across iterations, to ``arm_dir/metrics.jsonl``. Returns seconds per command."""
    from prm.iterative import refresh_prm

    total = plan.grpo_steps or config_steps("quickstart_grpo.yaml")
    if total < plan.iterations:
        raise ValueError(f"QuickstartPlan: {total} GRPO steps cannot be split into {plan.iterations} iterations")
    arm_dir.mkdir(parents=True, exist_ok=True)
    prm_dir, history = Path(prm_summary["prm_checkpoint"]), [Path(prm_summary["labels"])]
    policy, offset, combined, seconds = policy_dir, 0, [], {}
    for index in range(plan.iterations):
        name = f"iter{index + 1}"
        if index:
            print(f"    PRM refresh {index}: labels from {policy}, training on from {prm_dir}", flush=True)
            prm_dir, labels, refresh_seconds = refresh_prm(
                model_dir=model_dir, policy_weights=policy, prompts_file=train_file, previous_prm=prm_dir,
                history=history, out_dir=arm_dir, iteration=index, plan=plan.prm, refresh=plan.refresh,
                seed=plan.seed)
            history.append(labels)
            seconds.update({f"prm_refresh{index}_{key}": value for key, value in refresh_seconds.items()})
        steps = total // plan.iterations + (1 if index < total % plan.iterations else 0)
        print(f"    iteration {index + 1}/{plan.iterations}: {steps} GRPO steps from {policy}, PRM {prm_dir}",
              flush=True)
        seconds[f"grpo_process_{name}"] = training_command(
            f"GRPO (process, iteration {index + 1})", ["train"], "quickstart_grpo.yaml", arm_dir / name, steps,
            SHOWN["process"], [*grpo, f"model.init_from={policy}", f"process_reward.prm={prm_dir}"],
            arm_dir / f"{name}.log")
        rows = read_metrics(metrics_path(arm_dir / name))
        # a later iteration's step-0 evaluation is the previous iteration's final policy again
        combined += [{**row, "step": row["step"] + offset, "iteration": index + 1} for row in rows
                     if not (index and row["step"] == 0)]
        policy, offset = arm_dir / name, offset + steps
    metrics_path(arm_dir).write_text("".join(json.dumps(row) + "\n" for row in combined))
    return seconds


def _policy_checkpoint_settings(plan: QuickstartPlan, sft_steps: int) -> list[str]:
    """SFT settings that keep the checkpoint of ``plan.policy_sft_step`` (saved every that many steps, all kept)."""
    if plan.policy_sft_step is None:
        return []
    if not 1 <= plan.policy_sft_step < sft_steps:
        raise ValueError(f"QuickstartPlan.policy_sft_step must be in [1, {sft_steps}) (the SFT steps), got "
                         f"{plan.policy_sft_step}")
    return [f"trainer.save_every={plan.policy_sft_step}", f"trainer.keep_last={sft_steps // plan.policy_sft_step + 1}"]


def _select_policy_step(plan: QuickstartPlan, sft_dir: Path, sft_steps: int, task: list[str],
                        train_file: Path) -> tuple[int, dict]:
    """(the SFT step the GRPO arms start from, the record of the selection) by ``plan.policy_max_pass_at_1``."""
    from grpo_mega.quickstart.selection import measure_pass_at_1, pick_closest_to_ceiling

    folder = sft_dir.parent / "policy_selection"
    folder.mkdir(parents=True, exist_ok=True)

    def measure(step: int) -> float:
        return measure_pass_at_1(
            sft_checkpoint(sft_dir, step), task=task, prompts_file=train_file, prompts=plan.selection_prompts,
            samples=plan.selection_samples, response_length=plan.response_length,
            out=folder / f"{step_dir_name(step)}.json", nproc=NPROC)

    candidates = list(range(plan.policy_sft_step, sft_steps, plan.policy_sft_step))
    step, measured = pick_closest_to_ceiling(candidates, measure, plan.policy_max_pass_at_1)
    print(f"    sampled pass@1 on {plan.selection_prompts} training prompts: "
          f"{', '.join(f'step {k}: {v:.3f}' for k, v in measured.items())} -> the arms start from step {step}",
          flush=True)
    return step, {"ceiling": plan.policy_max_pass_at_1, "prompts": plan.selection_prompts,
                  "samples": plan.selection_samples, "pass_at_1": {str(k): v for k, v in measured.items()},
                  "step": step}


def _policy_and_prm_start(sft_dir: Path, policy_step: int | None) -> tuple[Path, Path | None, float]:
    """(the GRPO arms' starting checkpoint, the PRM's when it differs, the SFT seconds spent after the policy's
    checkpoint: what the PRM's head start cost)."""
    if policy_step is None:
        return sft_dir, None, 0.0
    policy_dir = sft_checkpoint(sft_dir, policy_step)
    times = {row["step"]: row["time"] for row in read_metrics(metrics_path(sft_dir))}
    return policy_dir, sft_dir, times[max(times)] - times[policy_step]


def _arm_seconds(seconds: dict[str, float], arm: str) -> float:
    """Wall seconds of an arm's GRPO command(s), with the PRM refreshes of an iterative process arm."""
    folder = arm_settings(arm)[2]
    return sum(value for key, value in seconds.items()
               if key == folder or key.startswith(f"{folder}_iter") or (arm == "process" and key.startswith(
                   "prm_refresh")))


def run_pipeline(run_dir: str | Path, plan: QuickstartPlan) -> dict:
    """Run every part of ``plan`` under ``run_dir``; writes the plot and ``summary.json``, returns the summary."""
    if plan.iterations < 1:
        raise ValueError(f"QuickstartPlan.iterations must be >= 1, got {plan.iterations}")
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    arms = ["outcome", *plan.more_arms, *(["process"] if plan.process_supervision else []),
            *([f"{STEP_REWARD_ARM}{kind}" for kind in plan.step_reward_arms] if plan.process_supervision else []),
            *(["oracle"] if plan.oracle_arm else []), *(["implicit"] if plan.implicit_arm else [])]
    selects = plan.policy_max_pass_at_1 is not None
    # announcements: data, SFT, the selection, the PRM's three commands, each arm (the RFT arm's fine-tuning too)
    total = 2 + selects + (3 if plan.process_supervision else 0) + len(arms) + arms.count("rft")
    header = iter(range(1, total + 1))

    def announce(text: str) -> None:
        print(f"[{next(header)}/{total}] {text}", flush=True)

    announce(f"data, tokenizer and model config -> {run_dir}")
    begin = time.perf_counter()
    model_dir, train_file, heldout_file = build_data_and_model(run_dir, plan)
    seconds["data"] = time.perf_counter() - begin
    task = [f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"parallel.seed={plan.seed}"]

    announce(f"SFT (DP=2 on 2 processes), log: {run_dir / 'sft.log'}")
    sft_dir, sft_steps = run_dir / "sft", plan.sft_steps or config_steps("quickstart_sft.yaml")
    seconds["sft"] = training_command("SFT", ["sft"], "quickstart_sft.yaml", sft_dir, sft_steps,
                                       (("nll", "sft/nll"),), [*task, *_policy_checkpoint_settings(plan, sft_steps)],
                                       run_dir / "sft.log")
    policy_step, selection = plan.policy_sft_step, {}
    if selects:
        announce(f"the arms' SFT checkpoint: sampled pass@1 on training prompts closest to "
                 f"{plan.policy_max_pass_at_1:g}, logs: {run_dir / 'policy_selection'}/")
        begin = time.perf_counter()
        policy_step, selection = _select_policy_step(plan, sft_dir, sft_steps, task, train_file)
        seconds["policy_selection"] = time.perf_counter() - begin
    policy_dir, prm_base, prm_head_start_seconds = _policy_and_prm_start(sft_dir, policy_step)

    prm_summary = None
    if plan.process_supervision:
        from prm.pipeline import PolicyRun, run_prm_pipeline

        prm_summary = run_prm_pipeline(
            PolicyRun(model_dir=model_dir, weights=policy_dir, train_file=train_file, heldout_file=heldout_file,
                      prm_base=prm_base),
            run_dir, plan.prm, seed=plan.seed, announce=announce,
        )
        seconds.update({f"prm_{key}": value for key, value in prm_summary["seconds"].items()})

    grpo = grpo_overrides(plan, task, heldout_file)
    arm_dirs: dict[str, Path] = {}
    for arm in arms:
        title, overrides, folder = arm_settings(arm)
        arm_dirs[arm] = run_dir / folder
        if arm == "process" and plan.iterations > 1:
            announce(f"{title}, {plan.iterations} iterations with PRM refreshes (DP=2 on 2 processes), logs: "
                     f"{arm_dirs[arm]}/")
            seconds.update(_iterative_process_arm(plan, arm_dirs[arm], [*grpo, *overrides], policy_dir, prm_summary,
                                                  model_dir, train_file))
            continue
        if arm == "rft":
            seconds["rft"], seconds[folder] = rft_arm(plan, run_dir, task, grpo, policy_dir,
                                                       prm_summary["seconds"]["train"], announce)
            continue
        seconds[folder] = grpo_arm(arm, plan, run_dir, grpo, policy_dir,
                                    prm_summary["prm_checkpoint"] if prm_summary else None, announce)

    prm_cost = (prm_head_start_seconds + sum(prm_summary["seconds"][stage] for stage in PRM_COST_STAGES)
                if prm_summary else 0.0)
    arm_seconds = {arm: _arm_seconds(seconds, arm) for arm in arms}
    before = {arm: prm_cost if learned_prm_arm(arm) else 0.0 for arm in arms}
    if "rft" in arms:  # its labels (the PRM's) and its fine-tuning
        before["rft"] = prm_summary["seconds"]["label"] + seconds["rft"]
    reports = {arm: arm_report(metrics_path(arm_dirs[arm]), arm_seconds[arm], before[arm]) for arm in arms}
    summary = {
        "regime": plan.name,
        "sft_accuracy": reports["outcome"]["start_accuracy"],
        **flat_figures(reports),
        "prm_f1": prm_summary["policy_processbench_f1"] if prm_summary else None,
        "prm_f1_planted": prm_summary["processbench_f1"] if prm_summary else None,
        "steps": reports["outcome"]["steps"],
        "wall_seconds": round(time.perf_counter() - started, 1),
        "stage_seconds": {key: round(value, 1) for key, value in seconds.items()},
        "eval_prompts": int(read_metrics(metrics_path(arm_dirs["outcome"]))[-1].get("eval/num_prompts", 0)),
        "seed": plan.seed,
        "iterations": plan.iterations,
        "policy_sft_step": policy_step,
        **({"policy_selection": selection} if selection else {}),
        "arms": reports,
        "run_dir": str(run_dir),
    }
    summary.setdefault("ps_accuracy", None)
    if prm_summary:
        summary["prm"] = {key: prm_summary.get(key) for key in (
            "label_agreement", "value_label_agreement", "step_accuracy", "processbench_f1", "policy_processbench_f1",
            "prm_at_n", "maj_at_n", "pass_at_n")}
    summary["plot"] = str(plot_arms(
        {arm_title(arm): metrics_path(path) for arm, path in arm_dirs.items()}, run_dir / "reward_accuracy.png",
        title=f"quickstart ({plan.name} regime): GRPO from the same SFT policy, seed {plan.seed}",
        seconds_before={arm_title(arm): cost for arm, cost in before.items() if cost}))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def run_quickstart(run_dir: str | Path = "runs/quickstart", *, regime: str = "dense", fast: bool = False,
                   outcome_only: bool = False, oracle: bool = True, iterations: int = 1,
                   implicit: bool = False) -> int:
    """``grpo-mega quickstart``: run the pipeline, print the table and, last, the path of summary.json. The
    ``tools`` regime is its own pipeline (``grpo_mega.quickstart.tool_regime``: data and the two SFT policies)."""
    if regime == "tools":
        if outcome_only or implicit or iterations != 1:
            print("grpo-mega quickstart: --regime tools runs the tool task's data and its two SFT policies; "
                  "--outcome-only, --implicit and --iterations are options of the GRPO arms of the dense and sparse "
                  "regimes", file=sys.stderr)
            return 2
        from grpo_mega.quickstart.tool_regime import FAST_TOOLS, TOOLS, print_tool_summary, run_tool_regime

        summary = run_tool_regime(run_dir, FAST_TOOLS if fast else TOOLS)
        print_tool_summary(summary)
        print(Path(summary["run_dir"]) / "summary.json")
        return 0
    if regime not in REGIMES:
        raise ValueError(f"quickstart: unknown regime {regime!r}; known: {sorted(REGIMES)}")
    plan = replace(FAST if fast else REGIMES[regime], iterations=iterations, oracle_arm=oracle and not outcome_only,
                   implicit_arm=implicit)
    if outcome_only:
        plan = replace(plan, process_supervision=False)
    summary = run_pipeline(run_dir, plan)
    print_table(summary)
    print(Path(summary["run_dir"]) / "summary.json")
    return 0
