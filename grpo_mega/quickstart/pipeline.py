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
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from grpo_mega.data.synthetic import Difficulty
from grpo_mega.quickstart.arms import SHOWN, arm_settings
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
from grpo_mega.run.commands import CONFIG_DIR, CommandProgress, run_command
from grpo_mega.run.layout import checkpoint_dir, metrics_path, step_dir_name
from grpo_mega.run.metrics import read_metrics
from prm.iterative import RefreshPlan
from prm.pipeline import PRMPlan

NPROC = 2


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


def _config_steps(config: str, section: str = "trainer", key: str = "total_steps") -> int:
    import yaml

    return int(yaml.safe_load((CONFIG_DIR / config).read_text())[section][key])


def _optional(key: str, value) -> list[str]:
    return [] if value is None else [f"{key}={value}"]


def _training_command(title: str, command: list[str], config: str, run_dir: Path, steps: int | None,
                      metrics: tuple[tuple[str, str], ...], overrides: list[str], log_path: Path) -> float:
    """One training command on 2 processes, its live line following ``run_dir/metrics.jsonl``."""
    progress = CommandProgress(title=title, metrics_path=metrics_path(run_dir),
                               total_steps=steps or _config_steps(config), metrics=metrics)
    argv = [*command, "--config", str(CONFIG_DIR / config), "--nproc", str(NPROC), f"trainer.run_dir={run_dir}",
            "trainer.progress_bar=false", *_optional("trainer.total_steps", steps), *overrides]
    return run_command(argv, log_path, progress)


def _iterative_process_arm(plan: QuickstartPlan, arm_dir: Path, grpo: list[str], policy_dir: Path, prm_summary: dict,
                           model_dir: Path, train_file: Path) -> dict[str, float]:
    """The process-supervised arm as ``plan.iterations`` GRPO runs (``arm_dir/iter<k>``), each from the previous
    run's policy, with a PRM refresh before each run after the first; writes every run's metrics rows, steps counted
    across iterations, to ``arm_dir/metrics.jsonl``. Returns seconds per command."""
    from prm.iterative import refresh_prm

    total = plan.grpo_steps or _config_steps("quickstart_grpo.yaml")
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
        seconds[f"grpo_process_{name}"] = _training_command(
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


def _sft_checkpoint(sft_dir: Path, step: int) -> Path:
    checkpoint = checkpoint_dir(sft_dir, step)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"the SFT run kept no checkpoint of step {step}: {checkpoint}")
    return checkpoint


def _select_policy_step(plan: QuickstartPlan, sft_dir: Path, sft_steps: int, task: list[str],
                        train_file: Path) -> tuple[int, dict]:
    """(the SFT step the GRPO arms start from, the record of the selection) by ``plan.policy_max_pass_at_1``."""
    from grpo_mega.quickstart.selection import measure_pass_at_1, pick_closest_to_ceiling

    folder = sft_dir.parent / "policy_selection"
    folder.mkdir(parents=True, exist_ok=True)

    def measure(step: int) -> float:
        return measure_pass_at_1(
            _sft_checkpoint(sft_dir, step), task=task, prompts_file=train_file, prompts=plan.selection_prompts,
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
    policy_dir = _sft_checkpoint(sft_dir, policy_step)
    times = {row["step"]: row["time"] for row in read_metrics(metrics_path(sft_dir))}
    return policy_dir, sft_dir, times[max(times)] - times[policy_step]


def _arm_seconds(seconds: dict[str, float], arm: str) -> float:
    """Wall seconds of an arm's GRPO command(s), with the PRM refreshes of an iterative process arm."""
    folder = arm_settings(arm)[2]
    return sum(value for key, value in seconds.items()
               if key == folder or key.startswith(f"{folder}_iter") or (arm == "process" and key.startswith(
                   "prm_refresh")))


def _grpo_overrides(plan: QuickstartPlan, task: list[str], heldout_file: Path) -> list[str]:
    """Every GRPO arm's overrides of configs/quickstart_grpo.yaml: the task, its evaluation and sizes."""
    return [*task, f"data.eval_file={heldout_file}", *_optional("data.max_eval_prompts", plan.eval_prompts),
            *_optional("trainer.eval_every", plan.eval_every),
            *_optional("algorithm.response_length", plan.response_length)]


def _grpo_arm(arm: str, plan: QuickstartPlan, run_dir: Path, grpo: list[str], policy_dir: Path,
              prm_checkpoint: str | None, announce) -> float:
    """One GRPO arm's run from ``policy_dir`` in ``run_dir/<its folder>``; its wall seconds."""
    title, overrides, folder = arm_settings(arm)
    if learned_prm_arm(arm):
        overrides = (*overrides, f"process_reward.prm={prm_checkpoint}")
    announce(f"{title} (DP=2 on 2 processes), log: {run_dir / f'{folder}.log'}")
    return _training_command(
        f"GRPO ({arm})", ["train"], "quickstart_grpo.yaml", run_dir / folder, plan.grpo_steps,
        SHOWN.get("process" if learned_prm_arm(arm) else arm, SHOWN["outcome"]),
        [*grpo, f"model.init_from={policy_dir}", *overrides], run_dir / f"{folder}.log")


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
    grpo = _grpo_overrides(plan, task, run_dir / "data" / "heldout.jsonl")
    sft_dir, step = run_dir / "sft", summary.get("policy_sft_step")
    policy_dir = sft_dir if step is None else _sft_checkpoint(sft_dir, step)
    prm_cost = max((report.get("prm_seconds", 0.0) for report in summary["arms"].values()), default=0.0)
    header = iter(range(1, len(arms) + 1))
    for arm in arms:
        folder = arm_settings(arm)[2]
        seconds = _grpo_arm(arm, plan, run_dir, grpo, policy_dir, str(run_dir / "prm"),
                            lambda text: print(f"[{next(header)}/{len(arms)}] {text}", flush=True))
        summary["stage_seconds"][folder] = round(seconds, 1)
        summary["arms"][arm] = arm_report(metrics_path(run_dir / folder), seconds,
                                          prm_cost if learned_prm_arm(arm) else 0.0)
    summary.update(flat_figures(summary["arms"]))
    summary["plot"] = str(plot_arms(
        {arm_title(arm): metrics_path(run_dir / arm_settings(arm)[2]) for arm in summary["arms"]},
        run_dir / "reward_accuracy.png",
        title=f"quickstart ({plan.name} regime): GRPO from the same SFT policy, seed {plan.seed}",
        seconds_before={arm_title(arm): prm_cost for arm in summary["arms"] if learned_prm_arm(arm)}))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


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
    total = 2 + selects + (3 if plan.process_supervision else 0) + len(arms)
    header = iter(range(1, total + 1))

    def announce(text: str) -> None:
        print(f"[{next(header)}/{total}] {text}", flush=True)

    announce(f"data, tokenizer and model config -> {run_dir}")
    begin = time.perf_counter()
    model_dir, train_file, heldout_file = build_data_and_model(run_dir, plan)
    seconds["data"] = time.perf_counter() - begin
    task = [f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"parallel.seed={plan.seed}"]

    announce(f"SFT (DP=2 on 2 processes), log: {run_dir / 'sft.log'}")
    sft_dir, sft_steps = run_dir / "sft", plan.sft_steps or _config_steps("quickstart_sft.yaml")
    seconds["sft"] = _training_command("SFT", ["sft"], "quickstart_sft.yaml", sft_dir, sft_steps,
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

    grpo = _grpo_overrides(plan, task, heldout_file)
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
        seconds[folder] = _grpo_arm(arm, plan, run_dir, grpo, policy_dir,
                                    prm_summary["prm_checkpoint"] if prm_summary else None, announce)

    prm_cost = (prm_head_start_seconds + sum(prm_summary["seconds"][stage] for stage in PRM_COST_STAGES)
                if prm_summary else 0.0)
    arm_seconds = {arm: _arm_seconds(seconds, arm) for arm in arms}
    reports = {arm: arm_report(metrics_path(arm_dirs[arm]), arm_seconds[arm],
                               prm_cost if learned_prm_arm(arm) else 0.0) for arm in arms}
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
        seconds_before={arm_title(arm): prm_cost for arm in arms if learned_prm_arm(arm)}))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def run_quickstart(run_dir: str | Path = "runs/quickstart", *, regime: str = "dense", fast: bool = False,
                   outcome_only: bool = False, oracle: bool = True, iterations: int = 1,
                   implicit: bool = False) -> int:
    """``grpo-mega quickstart``: run the pipeline, print the table and, last, the path of summary.json."""
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
