"""The tool regime's sparse start (issue 76) on a finished ``grpo-mega quickstart --regime tools`` run whose "more"
SFTs were rerun with a checkpoint every 25 steps (ToolRegimePlan.save_every; a new quickstart run does it itself):

    PYTHONPATH=$PWD python bench/tool_sparse_start.py --run-dir /tmp/tr/full \
        --tool-sft /tmp/tr/full/sft_tool_fine --text-sft /tmp/tr/full/sft_text_fine \
        [--recorded-tool-sft /tmp/tr/full/sft_tool_more] [--wait-s 3600] --out bench/results/tool_regime_sparse.json

runs ``grpo_mega.quickstart.tool_selection.select_sparse_start`` (the quickstart's own selection: the tool checkpoints
of 600-800 SFT steps measured in order through the turn loop on training prompts until one's sampled pass@1 exceeds
20 %, the closest taken; the text checkpoint of the same step), then measures the chosen pair on the held-out prompts
too, and writes the table (step -> pass@1 with its standard error) with the command. ``--recorded-tool-sft``: the run
the regime recorded with a checkpoint every 200 steps; the rerun must repeat it (same seed and config: its loss at
every step and the shared checkpoints' bytes are compared and the answer recorded).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo_mega.quickstart.arms import TOOL_ROLLOUTS  # noqa: E402
from grpo_mega.quickstart.selection import measure_pass_at_1  # noqa: E402
from grpo_mega.quickstart.tool_regime import TOOLS  # noqa: E402
from grpo_mega.quickstart.tool_selection import (  # noqa: E402
    binomial_standard_error,
    select_sparse_start,
    tool_task_overrides,
)
from grpo_mega.run.layout import checkpoint_dir, metrics_path  # noqa: E402
from grpo_mega.run.metrics import read_metrics  # noqa: E402


def same_run(recorded: Path, rerun: Path) -> dict:
    """Whether ``rerun`` repeats ``recorded`` bit for bit: the loss of every step both logged, and the bytes of every
    checkpoint file both kept."""
    losses = [{row["step"]: row["loss"] for row in read_metrics(metrics_path(run)) if "loss" in row}
              for run in (recorded, rerun)]
    steps = sorted(set(losses[0]) & set(losses[1]))
    differing = [step for step in steps if losses[0][step] != losses[1][step]]
    checkpoints = {}
    for folder in sorted((recorded / "checkpoints").glob("step_*")):
        other = rerun / "checkpoints" / folder.name
        if not other.is_dir():
            continue
        files = sorted(p.name for p in folder.glob("*.distcp"))
        digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
        checkpoints[folder.name] = all(digest(folder / name) == digest(other / name) for name in files) and bool(files)
    return {"steps_compared": len(steps), "steps_with_a_different_loss": differing[:20],
            "identical_losses": not differing and bool(steps), "identical_checkpoint_weights": checkpoints}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a finished `quickstart --regime tools` run")
    parser.add_argument("--tool-sft", type=Path, required=True, help="the tool 'more' SFT with saves every 25 steps")
    parser.add_argument("--text-sft", type=Path, required=True, help="the text 'more' SFT with saves every 25 steps")
    parser.add_argument("--recorded-tool-sft", type=Path, default=None)
    parser.add_argument("--wait-s", type=float, default=0.0, help="wait this long for a checkpoint an SFT still writes")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tool_regime_sparse.json")
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("regime") != "tools":
        raise SystemExit(f"{run_dir / 'summary.json'}: not a run of the tools regime")
    task = [f"model.hf_config={summary['model']}", f"data.train_file={summary['train_file']}",
            f"parallel.seed={TOOLS.seed}"]
    record = select_sparse_start(run_dir, TOOLS, tool_sft=args.tool_sft.resolve(), text_sft=args.text_sft.resolve(),
                                 task=task, train_file=Path(summary["train_file"]), nproc=2, wait_s=args.wait_s)
    heldout = {}
    for arm, overrides in (("tool", TOOL_ROLLOUTS), ("text", ())):
        checkpoint = Path(record[f"{arm}_checkpoint"])
        value = measure_pass_at_1(
            checkpoint, task=[*task, *tool_task_overrides(TOOLS), *overrides],
            prompts_file=Path(summary["heldout_file"]),
            prompts=TOOLS.eval_prompts, samples=1, response_length=TOOLS.tool_response_length,
            out=run_dir / "sparse_selection" / f"{arm}_heldout.json", nproc=2)
        heldout[arm] = {"pass_at_1": value, "standard_error": binomial_standard_error(value, TOOLS.eval_prompts, 1)}
        print(f"    held-out sampled pass@1 of the {arm} checkpoint: {value:.3f}", flush=True)
    result = {
        "what": "the tool regime's sparse start (issue 76): the tool SFT checkpoints between 600 and 800 SFT steps, "
                "sampled pass@1 (temperature 1) through the real turn loop (calculator, hermes calls, "
                f"{TOOLS.tool_response_length} tokens) on the first {TOOLS.selection_prompts} TRAINING prompts, "
                "measured in order until one exceeds the target, the closest taken "
                "(grpo_mega.quickstart.tool_selection); the text-only checkpoint of the same step; both then on "
                f"{TOOLS.eval_prompts} held-out prompts. Standard errors binomial.",
        "command": "PYTHONPATH=$PWD python " + " ".join(shlex.quote(a) for a in sys.argv),
        "sft_commands": "grpo-mega sft --config configs/quickstart_sft.yaml --nproc 2 trainer.total_steps=600 "
                        "model.init_from=/tmp/tr/full/sft_<arm> trainer.save_every=25 trainer.keep_last=24 "
                        "data.max_length=256 [data.segments_field=tool_segments] parallel.seed=1234 (the regime's "
                        "'more' SFT, stopped after step 400; /work/runs_toolbench/sft_<arm>_fine.sh)",
        "machine": "vm: 2 CPUs shared with other jobs, torch threads 1",
        "selection": record,
        "heldout_pass_at_1": heldout,
    }
    if args.recorded_tool_sft is not None:
        result["rerun_repeats_the_recorded_sft"] = same_run(args.recorded_tool_sft.resolve(), args.tool_sft.resolve())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
