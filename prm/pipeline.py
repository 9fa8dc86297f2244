"""The PRM part of the synthetic pipeline, from a policy run to an evaluated PRM: Monte-Carlo labels on the
policy's own solutions -> PRM training -> evaluation on held-out solutions with planted errors and on reranking
the policy's samples. Each is a ``grpo-mega prm`` command on 2 processes with its log in the output folder and
a live line on the terminal (``grpo_mega.run.commands``); ``grpo-mega quickstart`` runs it between SFT and GRPO,
``bench/prm_synthetic.py`` over seeds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from grpo_mega.run.commands import CONFIG_DIR, CommandProgress, run_command
from grpo_mega.run.layout import metrics_path


@dataclass(frozen=True)
class PRMPlan:
    """Sizes of the PRM commands (the defaults are the quickstart's)."""

    label_prompts: int = 800
    """Training prompts whose policy solutions get Monte-Carlo labels."""
    samples_per_prompt: int = 2
    """Policy solutions labelled per prompt."""
    rollouts_per_step: int = 8
    """Monte-Carlo continuations from each step prefix (``--n``)."""
    label_temperature: float = 1.0
    completer_temperature: float | None = None
    """Temperature of the Monte-Carlo continuations (None: ``label_temperature``; 0 with one rollout per step:
    the completer's greedy continuation)."""
    train_steps: int | None = None
    """None: configs/quickstart_prm.yaml decides."""
    planted_problems: int = 300
    """Held-out problems turned into solutions with planted errors (half of them with one error)."""
    best_of_n_prompts: int = 200
    best_of_n: int = 8
    """Samples per held-out prompt for prm@N / maj@N / pass@N (also the policy's own solutions of its F1)."""
    max_new_tokens: int = 64
    """Longest solution or continuation (a three-step solution is up to 52 tokens with its end token)."""
    nproc: int = 2


@dataclass(frozen=True)
class PolicyRun:
    """What the PRM commands need from the policy's side: its config folder, weights, and the task's files."""

    model_dir: Path
    """The policy's HF config folder (with its tokenizer)."""
    weights: Path
    """The policy checkpoint (e.g. the SFT run directory)."""
    train_file: Path
    heldout_file: Path
    prm_base: Path | None = None
    """The checkpoint the PRM starts from and whose continuations give the Monte-Carlo labels (the completer);
    None: the policy's ``weights``. A checkpoint trained further than the policy gives a PRM that knows more than
    the policy it supervises."""

    @property
    def prm_start(self) -> Path:
        return self.prm_base or self.weights


def write_planted_file(heldout_file: Path, out: Path, *, problems: int, seed: int) -> Path:
    """Held-out solutions with planted errors (ProcessBench rows with ground-truth labels) as stepwise jsonl."""
    from grpo_mega.data.synthetic import read_jsonl
    from prm.data import write_stepwise
    from prm.synthetic import planted_error_examples

    examples = planted_error_examples(read_jsonl(heldout_file)[:problems], seed=seed)
    write_stepwise(out, examples)
    return out


def _training_steps(plan: PRMPlan) -> int:
    import yaml

    if plan.train_steps is not None:
        return plan.train_steps
    return int(yaml.safe_load((CONFIG_DIR / "quickstart_prm.yaml").read_text())["trainer"]["total_steps"])


def run_label_command(policy_weights: Path, prompts_file: Path, out: Path, plan: PRMPlan, *, seed: int, log: Path,
                      show: bool = True, completer_weights: Path | None = None, prompts: int | None = None,
                      more_flags: Sequence[str] = ()) -> float:
    """``grpo-mega prm label``: Monte-Carlo labels of ``policy_weights``' solutions to the first ``prompts``
    (default ``plan.label_prompts``) prompts of ``prompts_file`` (continued by ``completer_weights``, default the
    policy), with ``more_flags`` last (e.g. ``--steps turns --tools calculator``), its output in ``log``; returns
    wall seconds."""
    completer = [] if completer_weights is None else ["--completer", str(completer_weights)]
    if plan.completer_temperature is not None:
        completer += ["--completer-temperature", str(plan.completer_temperature)]
    return run_command(
        ["prm", "label", "--policy", str(policy_weights), *completer, "--data", str(prompts_file), "--out", str(out),
         "--n", str(plan.rollouts_per_step), "--samples-per-prompt", str(plan.samples_per_prompt),
         "--max-prompts", str(prompts or plan.label_prompts), "--temperature", str(plan.label_temperature),
         "--max-new-tokens", str(plan.max_new_tokens), "--seed", str(seed), "--nproc", str(plan.nproc), *more_flags],
        log, CommandProgress("PRM labels"), show=show,
    )


LAYOUT_TITLES = {
    "classifier": "classifier head on the policy's backbone",
    "lm_tokens": "the policy's odds of the label tokens",
    "likelihood": "the policy's own likelihood of each step, fine-tuned",
}


def _config_layout() -> str:
    import yaml

    return str(yaml.safe_load((CONFIG_DIR / "quickstart_prm.yaml").read_text())["prm"]["layout"])


def run_train_command(model_dir: Path, init_from: Path, labels: Path, prm_dir: Path, plan: PRMPlan, *, seed: int,
                      steps: int, log: Path, show: bool = True, overrides: Sequence[str] = ()) -> float:
    """``grpo-mega prm train`` (configs/quickstart_prm.yaml) for ``steps`` steps from ``init_from`` (a policy, or a
    PRM run to train on) on ``labels``, with more ``key=value``
    ``overrides`` last (e.g. ``data.replay_files=[...]``); returns wall seconds."""
    settings = [f"model.hf_config={model_dir}", f"model.init_from={init_from}", f"data.train_file={labels}",
                f"trainer.run_dir={prm_dir}", "trainer.progress_bar=false", f"parallel.seed={seed}",
                f"trainer.total_steps={steps}", *overrides]
    return run_command(
        ["prm", "train", "--config", str(CONFIG_DIR / "quickstart_prm.yaml"), "--nproc", str(plan.nproc), *settings],
        log,
        CommandProgress("PRM training", metrics_path=metrics_path(prm_dir), total_steps=steps,
                        metrics=(("loss", "prm/loss"), ("step acc", "eval/step_accuracy"))),
        show=show,
    )


def run_prm_pipeline(policy: PolicyRun, out_dir: Path, plan: PRMPlan = PRMPlan(), *, seed: int = 1234,
                     announce=print, show: bool = True) -> dict:
    """Label, train and evaluate a PRM for ``policy`` under ``out_dir``; returns (and writes ``prm_summary.json``)
    the figures: label agreement with the truth, step accuracy / F1, ProcessBench F1 on planted errors and on the
    policy's own solutions, prm@N / maj@N / pass@N, and seconds per command. ``announce(text)`` announces each
    command; ``show``: a live line per command."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    nproc = ["--nproc", str(plan.nproc)]
    seconds: dict[str, float] = {}
    labels, prm_dir = out_dir / "prm_labels.jsonl", out_dir / "prm"

    announce(f"PRM labels: {plan.label_prompts} prompts x {plan.samples_per_prompt} solutions of the policy, "
             f"{plan.rollouts_per_step} Monte-Carlo rollouts per step, log: {out_dir / 'prm_label.log'}")
    seconds["label"] = run_label_command(policy.weights, policy.train_file, labels, plan, seed=seed,
                                         log=out_dir / "prm_label.log", show=show, completer_weights=policy.prm_base)
    announce(f"PRM training ({LAYOUT_TITLES[_config_layout()]}), log: {out_dir / 'prm_train.log'}")
    seconds["train"] = run_train_command(policy.model_dir, policy.prm_start, labels, prm_dir, plan, seed=seed,
                                         steps=_training_steps(plan), log=out_dir / "prm_train.log", show=show)

    announce(f"PRM evaluation: planted errors and the policy's own held-out solutions, log: {out_dir / 'prm_eval.log'}")
    planted = write_planted_file(policy.heldout_file, out_dir / "planted_errors.jsonl",
                                 problems=plan.planted_problems, seed=seed)
    report_path = out_dir / "prm_eval.json"
    seconds["eval"] = run_command(
        ["prm", "eval", "--prm", str(prm_dir), "--data", str(planted), "--policy", str(policy.weights),
         "--prompts", str(policy.heldout_file), "--n", str(plan.best_of_n), "--max-prompts",
         str(plan.best_of_n_prompts), "--max-new-tokens", str(plan.max_new_tokens), "--seed", str(seed),
         "--samples-out", str(out_dir / "prm_best_of_n_samples.jsonl"), "--out", str(report_path), *nproc],
        out_dir / "prm_eval.log", CommandProgress("PRM evaluation"), show=show,
    )
    label_summary = json.loads(Path(f"{labels}.summary.json").read_text())
    report = json.loads(report_path.read_text())
    summary = {
        "label_agreement": label_summary.get("label_agreement"),
        "soft_label_agreement": label_summary.get("soft_label_agreement"),
        "value_label_agreement": label_summary.get("value_label_agreement"),
        "labelled_steps": label_summary.get("steps"),
        **{key: report.get(key) for key in (
            "step_accuracy", "step_f1", "processbench_f1", "processbench_threshold",
            "policy_processbench_f1", "policy_processbench_threshold", "prm_at_n", "prm_at_n_last",
            "prm_at_n_product", "maj_at_n", "pass_at_n", "best_of_n_sample_accuracy")},
        "prm_checkpoint": str(prm_dir),
        "labels": str(labels),
        "seconds": {key: round(value, 1) for key, value in seconds.items()},
        "label_train_eval_seconds": round(sum(seconds.values()), 1),
        "plan": asdict(plan),
        "seed": seed,
    }
    (out_dir / "prm_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
