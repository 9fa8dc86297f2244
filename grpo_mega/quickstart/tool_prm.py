"""A seed's PRM stage on the tool task (issue 76: the learned-PRM turn arm ``tool_turn_prm`` and the skeptic's RFT
arm, ``bench/pipeline_seeds.py --regime tools --add-arms tool_turn_prm rft``), in the seed's folder, before either
arm and once for both:

1. ``grpo-mega prm label --steps turns --tools calculator``: the tool SFT policy's multi-turn rollouts of the first
   ``label_prompts`` training prompts, each assistant turn labelled by ``rollouts_per_step`` Monte-Carlo
   continuations through the turn loop (``prm_labels.jsonl``);
2. ``grpo-mega prm train`` (configs/quickstart_prm.yaml: the policy's own likelihood of each turn, fine-tuned) from
   the policy on those labels (``prm/``);
3. the PRM's report, not charged to any arm: the same labelling of ``heldout_prompts`` held-out prompts
   (``prm_heldout_labels.jsonl``) and ``grpo-mega prm eval`` of the trained PRM and of the untrained policy's own
   likelihood on them (``prm_eval.json``, ``prm_eval_untrained.json``): AUROC against the held-out Monte-Carlo
   labels (``step_auroc``) and against the tool task's per-turn oracle (``true_step_auroc``; the oracle,
   ``reward.function: tool_task_turns``, is stored beside the labels by ``--turn-truth`` and read by nothing that
   trains).

The completer is the policy itself: the continuations that label a turn are the tool SFT policy's own, what a user
of a policy has. A completer trained further on the demonstrations labelled better in bench/results/
prm_turns_tool_task.json (AUROC 0.959 against 0.409 with a 3.5 % policy), but the arms start from a policy near
20 % sampled pass@1, whose own continuations succeed six times as often; and a completer that is a stronger policy
is a second policy the PRM arm would have to pay for. The labels' and the training's seconds are the turn-PRM arm's
one-off cost (``PRM_COST_STAGES``, as the text regimes charge theirs); the labels' seconds and the fine-tuning's are
the RFT arm's (``grpo_mega.quickstart.rft``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo_mega.quickstart.arm_runs import NPROC
from grpo_mega.quickstart.report import PRM_COST_STAGES
from grpo_mega.run.commands import CommandProgress, run_command

TURN_LABEL_FLAGS = ("--steps", "turns", "--tools", "calculator", "--tool-format", "hermes")
"""``prm label``'s turn loop: the GRPO arms' (``TOOL_ROLLOUTS``: the calculator in hermes calls, the default 4
turns and tool output limit)."""
TURN_TRUTH = "tool_task_turns"
"""The tool task's per-turn oracle, stored beside the labels for the report only (``--turn-truth``)."""
SUMMARY_FILE = "tool_prm_summary.json"


@dataclass(frozen=True)
class ToolPRMPlan:
    """Sizes of the tool task's PRM stage (the defaults: bench/results/prm_turns_tool_task.json's recorded ones)."""

    label_prompts: int = 200
    """Training prompts whose rollouts (one each) get Monte-Carlo turn labels."""
    heldout_prompts: int = 100
    """Held-out prompts labelled the same way for the PRM's AUROC (0: no report)."""
    rollouts_per_step: int = 4
    """Monte-Carlo continuations of each turn prefix (``prm label --n``)."""
    train_steps: int = 50
    batch_size: int = 32
    max_length: int = 256
    """``prm train``'s ``data.max_length``: a prompt and a 200-token tool rollout."""
    warmup_steps: int = 5
    eval_untrained: bool = True
    """Also score the held-out turns by the policy's own likelihood, untrained (what the training changed)."""
    rft_epochs: float = 2.0
    """The RFT arm's budget: this many passes over the verified rollouts (``grpo_mega.quickstart.rft``)."""


FAST_TOOL_PRM = ToolPRMPlan(label_prompts=16, heldout_prompts=8, rollouts_per_step=2, train_steps=2, batch_size=4,
                            warmup_steps=1, eval_untrained=False)
"""``--fast``: a few commands' worth (16 rollouts: at the sparse start's 20 % some are verified, for RFT)."""


def prm_cost(summary: dict) -> float:
    """The turn-PRM arm's one-off seconds: its labels and its training."""
    return sum(summary["seconds"][stage] for stage in PRM_COST_STAGES)


def _label_plan(prm_plan: ToolPRMPlan, response_length: int):
    from prm.pipeline import PRMPlan

    return PRMPlan(label_prompts=prm_plan.label_prompts, samples_per_prompt=1,
                   rollouts_per_step=prm_plan.rollouts_per_step, max_new_tokens=response_length, nproc=NPROC)


def _eval(prm: str, data: Path, out: Path, log: Path, more: tuple[str, ...] = ()) -> float:
    return run_command(["prm", "eval", "--prm", prm, "--data", str(data), "--out", str(out), "--nproc", str(NPROC),
                        *more], log, CommandProgress("PRM evaluation"))


def stage_announcements(prm_plan: ToolPRMPlan) -> int:
    """How many commands ``run_tool_prm_stage`` announces when it runs."""
    return 2 + (2 + prm_plan.eval_untrained if prm_plan.heldout_prompts else 0)


def _reused(run_dir: Path, policy: str, seed: int, prm_plan: ToolPRMPlan, response_length: int) -> dict | None:
    """The seed's finished PRM stage, when it ran for ``policy``, ``seed`` and these sizes and its PRM is there;
    ValueError naming the file when it ran for others."""
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    ran = (summary.get("policy"), summary.get("seed"), summary.get("plan"), summary.get("response_length"))
    if ran != (policy, seed, asdict(prm_plan), response_length):
        raise ValueError(f"{path}: a PRM stage of policy {ran[0]} seed {ran[1]}, sizes {ran[2]}, response length "
                         f"{ran[3]}; this run asks for {policy} seed {seed}, {asdict(prm_plan)}, {response_length}: "
                         "move it away to run the stage again")
    return summary if Path(summary["prm_checkpoint"]).is_dir() else None


def run_tool_prm_stage(run_dir: Path, regime: dict, start: dict, *, seed: int, response_length: int,
                       prm_plan: ToolPRMPlan, announce) -> dict:
    """The PRM stage (module docstring) in ``run_dir``, or the one it already ran for this policy and seed;
    writes and returns ``tool_prm_summary.json``'s content: the labels' figures, the PRM's AUROCs, each command's
    seconds and the arm's charged ``prm_seconds``."""
    from prm.pipeline import run_label_command, run_train_command

    policy = start["tool_checkpoint"]
    done = _reused(run_dir, policy, seed, prm_plan, response_length)
    if done is not None:
        print(f"    the seed's PRM stage is done: {run_dir / SUMMARY_FILE}", flush=True)
        return done
    plan = _label_plan(prm_plan, response_length)
    labels, heldout, prm_dir = run_dir / "prm_labels.jsonl", run_dir / "prm_heldout_labels.jsonl", run_dir / "prm"
    flags = (*TURN_LABEL_FLAGS, "--turn-truth", TURN_TRUTH)
    seconds = {}
    announce(f"PRM labels: the tool policy's rollouts of {prm_plan.label_prompts} training prompts, each turn "
             f"labelled by {prm_plan.rollouts_per_step} of its own continuations, log: {run_dir / 'prm_label.log'}")
    seconds["label"] = run_label_command(Path(policy), Path(regime["train_file"]), labels, plan, seed=seed,
                                         log=run_dir / "prm_label.log", more_flags=flags)
    announce(f"PRM training ({prm_plan.train_steps} steps from the policy), log: {run_dir / 'prm_train.log'}")
    seconds["train"] = run_train_command(
        Path(regime["model"]), Path(policy), labels, prm_dir, plan, seed=seed, steps=prm_plan.train_steps,
        log=run_dir / "prm_train.log",
        overrides=[f"data.max_length={prm_plan.max_length}", f"trainer.batch_size={prm_plan.batch_size}",
                   "trainer.eval_every=0", f"optim.warmup_steps={prm_plan.warmup_steps}"])
    report = {}
    if prm_plan.heldout_prompts:
        announce(f"PRM report: {prm_plan.heldout_prompts} held-out prompts labelled the same way, log: "
                 f"{run_dir / 'prm_heldout_label.log'}")
        seconds["heldout_label"] = run_label_command(
            Path(policy), Path(regime["heldout_file"]), heldout, plan, seed=seed, log=run_dir / "prm_heldout_label.log",
            prompts=prm_plan.heldout_prompts, more_flags=flags)
        announce(f"PRM report: the trained PRM on the held-out turns, log: {run_dir / 'prm_eval.log'}")
        seconds["eval"] = _eval(str(prm_dir), heldout, run_dir / "prm_eval.json", run_dir / "prm_eval.log")
        report["trained"] = json.loads((run_dir / "prm_eval.json").read_text())
        if prm_plan.eval_untrained:
            announce(f"PRM report: the untrained policy's own likelihood on them, log: "
                     f"{run_dir / 'prm_eval_untrained.log'}")
            seconds["eval_untrained"] = _eval(policy, heldout, run_dir / "prm_eval_untrained.json",
                                              run_dir / "prm_eval_untrained.log", ("--layout", "likelihood"))
            report["untrained"] = json.loads((run_dir / "prm_eval_untrained.json").read_text())
    label_figures = ("solutions", "steps", "turns_per_solution", "solution_accuracy", "good_label_fraction",
                     "label_agreement", "soft_label_agreement", "truth_good_fraction")
    summary = {
        "policy": policy, "completer": "the policy", "seed": seed, "plan": asdict(prm_plan),
        "response_length": response_length,
        "labels": str(labels), "prm_checkpoint": str(prm_dir),
        "train_labels": _figures(f"{labels}.summary.json", label_figures),
        "heldout_labels": _figures(f"{heldout}.summary.json", label_figures) if prm_plan.heldout_prompts else None,
        "eval": {name: {key: figures.get(key) for key in ("true_step_auroc", "step_auroc", "step_accuracy",
                                                          "label_agreement", "labelled_steps")}
                 for name, figures in report.items()},
        "seconds": {key: round(value, 1) for key, value in seconds.items()},
    }
    summary["prm_seconds"] = round(prm_cost(summary), 1)
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _figures(path: str, keys: tuple[str, ...]) -> dict:
    figures = json.loads(Path(path).read_text())
    return {key: figures.get(key) for key in keys}


def arm_prm_figures(summary: dict) -> dict:
    """What a PRM-stage arm's report carries of the stage: the trained and untrained PRM's AUROC against the oracle
    and the held-out Monte-Carlo labels (None without the report), and the completer."""
    evals = summary.get("eval") or {}
    return {"prm_true_step_auroc": (evals.get("trained") or {}).get("true_step_auroc"),
            "prm_step_auroc": (evals.get("trained") or {}).get("step_auroc"),
            "prm_untrained_true_step_auroc": (evals.get("untrained") or {}).get("true_step_auroc"),
            "prm_completer": summary["completer"]}
