"""The tool regime's sparse start (issue 76: "the SFT policy near 20 % sampled pass@1"): which checkpoint of the tool
"more" SFT the GRPO arms start from, and the text-only checkpoint they are compared with.

The tool policy's pass@1 jumps from 3 % to 82 % between 600 and 800 SFT steps (it learns to copy the calculator's
numbers), so no fixed step is reliably sparse. The "more" SFTs keep a checkpoint every ``save_every`` steps; the tool
checkpoints in ``ToolRegimePlan.selection_steps`` are measured in order through the real turn loop (``grpo-mega eval``
with ``rollout.multi_turn``, temperature 1) on prompts of the TRAINING file, as ``grpo_mega.quickstart.selection``
does for the sparse text regime (no held-out prompt takes part in the choice), until one is above the target, and the
one closest to it is taken (``pick_closest_to_ceiling``). The text-only checkpoint is the one after the same number
of SFT steps: the two policies have seen the same problems the same number of times.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from grpo_mega.quickstart.arms import TOOL_ROLLOUTS
from grpo_mega.run.layout import checkpoint_dir, step_dir_name

SELECTION_FILE = "sparse_selection.json"
"""Written in the regime's run folder: the chosen checkpoints and the measurements (read by the tool pipeline)."""


def tool_task_overrides(plan) -> list[str]:
    """configs/quickstart_grpo.yaml's overrides of the tool task's rollouts beyond its paths: the prompt and token
    budget (a three-call conversation is ~150 tokens with its tool turns) and sampled evaluation."""
    return [f"data.prompt_length={plan.prompt_length}", "trainer.eval_temperature=1.0"]


def binomial_standard_error(pass_at_1: float, prompts: int, samples: int) -> float:
    """sqrt(p (1 - p) / (prompts * samples)): the standard error of a sampled pass@1 over independent draws (the
    samples of one prompt are not independent, so with samples > 1 it is a lower bound)."""
    return math.sqrt(pass_at_1 * (1.0 - pass_at_1) / (prompts * samples))


def wait_for_checkpoint(sft_dir: Path, step: int, poll_s: float, timeout_s: float) -> Path:
    """``sft_dir``'s checkpoint of ``step`` once it is complete (an SFT still running publishes it later)."""
    path, waited = checkpoint_dir(sft_dir, step), 0.0
    while not (path / "complete.json").is_file():
        if waited >= timeout_s:
            raise FileNotFoundError(f"the SFT run kept no complete checkpoint of step {step}: {path}")
        time.sleep(poll_s)
        waited += poll_s
    return path


def select_sparse_start(run_dir: Path, plan, *, tool_sft: Path, text_sft: Path, task: list[str], train_file: Path,
                        nproc: int, wait_s: float = 0.0) -> dict:
    """Measure ``tool_sft``'s checkpoints in ``plan.selection_steps`` (every ``plan.save_every``) until one's sampled
    pass@1 on ``plan.selection_prompts`` training prompts exceeds ``plan.sparse_pass_at_1``; take the closest, and
    ``text_sft``'s checkpoint of the same step, whose pass@1 is measured the same way (no tool). Writes and returns
    ``run_dir/sparse_selection.json``'s content. ``wait_s``: how long to wait for a checkpoint an SFT still writes."""
    from grpo_mega.quickstart.selection import measure_pass_at_1, pick_closest_to_ceiling

    folder = run_dir / "sparse_selection"
    folder.mkdir(parents=True, exist_ok=True)
    common = [*task, *tool_task_overrides(plan)]
    seconds: dict[str, float] = {}

    def measure(sft_dir: Path, step: int, arm: str, overrides: tuple[str, ...]) -> float:
        checkpoint = wait_for_checkpoint(sft_dir, step, poll_s=10.0, timeout_s=wait_s)
        begin = time.perf_counter()
        value = measure_pass_at_1(
            checkpoint, task=[*common, *overrides], prompts_file=train_file, prompts=plan.selection_prompts,
            samples=plan.selection_samples, response_length=plan.tool_response_length,
            out=folder / f"{arm}_{step_dir_name(step)}.json", nproc=nproc)
        seconds[f"{arm}_{step}"] = round(time.perf_counter() - begin, 1)
        print(f"    {arm} SFT checkpoint of step {step} (+{plan.sft_steps} before): sampled pass@1 {value:.3f}",
              flush=True)
        return value

    first, last = plan.selection_steps
    candidates = list(range(first, last + 1, plan.save_every))
    step, measured = pick_closest_to_ceiling(candidates, lambda k: measure(tool_sft, k, "tool", TOOL_ROLLOUTS),
                                             plan.sparse_pass_at_1)
    text_pass = measure(text_sft, step, "text", ())
    prompts, samples = plan.selection_prompts, plan.selection_samples
    record = {
        "target_pass_at_1": plan.sparse_pass_at_1, "prompts": prompts, "samples": samples,
        "prompts_file": str(train_file), "response_length": plan.tool_response_length,
        "more_sft_step": step, "total_sft_steps": plan.sft_steps + step,
        "tool_checkpoint": str(checkpoint_dir(tool_sft, step)), "text_checkpoint": str(checkpoint_dir(text_sft, step)),
        "tool_pass_at_1": {str(k): {"pass_at_1": v, "standard_error": binomial_standard_error(v, prompts, samples),
                                    "total_sft_steps": plan.sft_steps + k} for k, v in measured.items()},
        "text_pass_at_1": {"pass_at_1": text_pass,
                           "standard_error": binomial_standard_error(text_pass, prompts, samples),
                           "total_sft_steps": plan.sft_steps + step},
        "seconds": seconds,
    }
    (run_dir / SELECTION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    print(f"    -> the tool arms start from step {step} ({plan.sft_steps + step} SFT steps in all, pass@1 "
          f"{measured[step]:.3f}); text-only GRPO from the text SFT of the same step (pass@1 {text_pass:.3f})",
          flush=True)
    return record
