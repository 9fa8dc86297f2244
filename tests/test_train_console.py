"""What a user sees from ``grpo-mega train --nproc 2`` with ``trainer.progress_bar=false`` (data-parallel, the
quickstart's layout): one line per step on stdout (rank 0 only), the held-out accuracy on the steps that evaluate,
one summary line at the end, and none of the libraries' internal warnings that every rank printed at DP > 1."""

import re
from pathlib import Path

from cli_runner import run_grpo_mega
from tiny_task import build_tiny_task, tiny_run_overrides

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"


def test_a_two_rank_run_prints_a_line_per_step_a_summary_and_no_library_warnings(tmp_path):
    model_dir, train_file = build_tiny_task(tmp_path / "task")
    run_dir = tmp_path / "run"
    overrides = tiny_run_overrides((model_dir, train_file), run_dir, "parallel.tensor=1", "trainer.total_steps=2",
                                   "trainer.eval_every=2", f"data.eval_file={train_file.parent / 'heldout.jsonl'}",
                                   "data.max_eval_prompts=4")
    done = run_grpo_mega("train", "--config", str(CONFIG), "--nproc", "2", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]

    figures = r"  score \d\.\d{3}  reward -?\d\.\d{3}"
    start, *lines = done.stdout.splitlines()  # the line of the start: what the command builds before step 1
    assert re.fullmatch(r"grpo-mega train: starting on 2 processes: importing torch, then building the policy, .*; "
                        r"a line per step follows", start), done.stdout
    assert len(lines) == 4, done.stdout
    assert re.fullmatch(r"step 0/2 \(before training\)  accuracy \d\.\d{3}  \d+\.\d s", lines[0])
    assert re.fullmatch(rf"step 1/2{figures}  \d+\.\d s", lines[1])
    assert re.fullmatch(rf"step 2/2{figures}  accuracy \d\.\d{{3}}  \d+\.\d s", lines[2])
    assert re.fullmatch(r"grpo-mega train: done, 2/2 steps: score \d\.\d{3}, reward -?\d\.\d{3}, accuracy \d\.\d{3}; "
                        rf"\d+ s; last checkpoint {re.escape(str(run_dir))}/checkpoints/step_000002", lines[3])

    # Python's warning lines ("<file>:<line>: FutureWarning: ..."), from any rank: megatron's gradient buffers call
    # torch's deprecated collective names, and its optimizer reads .grad of non-leaf tensors, at DP > 1
    warned = [line for line in done.stderr.splitlines() if re.search(r"\b\w*Warning: ", line)]
    assert warned == [], "\n".join(warned)
