"""Ctrl-C by the clock (issue 79 item 2): a `--nproc 2` train command, SIGINT to its process group ``t`` seconds
after it starts, for each ``t`` of ``--at`` and ``--repeats`` times each; per end: the exit status, the lines it
printed that are not the run's log (one at most, and never a traceback, is the promise), and the processes of the
job still running 5 s after the command ended.

    PYTHONPATH=$PWD .venv/bin/python bench/ctrl_c_sweep.py [--at 1 2 3 4 5 6 8 10 15 20 30] [--repeats 2] \\
        [--work /tmp/ctrlc] [--out bench/results/ctrl_c_sweep.json]

tests/test_no_process_outlives.py puts each Ctrl-C at a named point of the start (deterministic); this sweep is the
user's view, where the moment is whatever the clock says: it catches a window between the named points. The
command is the tests' tiny task (tests/tiny_task.py) with configs/quickstart_grpo.yaml, 2 steps, started as a
terminal's foreground job is (SIGINT handled) and without the test suite's shared fork server (a user's command
starts its own). A Ctrl-C after the run ended by itself counts as a run's end (exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tiny_task import build_tiny_task, tiny_run_overrides  # noqa: E402

from grpo_mega.run.procfs import processes_left_after  # noqa: E402
from grpo_mega.run.shared_fork_server import without_offer  # noqa: E402

JOB_ENV = "GRPO_MEGA_SWEEP_JOB"
GONE_WITHIN_S = 5.0


def own_lines(stderr: str) -> list[str]:
    """stderr without the run's log lines (``... INFO ...``, ``... WARNING ...``) and the progress bar."""
    return [line for line in stderr.strip().splitlines()
            if line.strip() and " INFO " not in line and " WARNING " not in line and "step/s" not in line]


def one_end(task, work: Path, at_s: float) -> dict:
    """Start the command, Ctrl-C at ``at_s`` s (unless it ended first), and what its end looked like."""
    job = uuid.uuid4().hex[:12]
    environment = {**without_offer(os.environ), "PYTHONPATH": str(ROOT), JOB_ENV: job}
    command = [sys.executable, "-m", "grpo_mega.cli", "train", "--nproc", "2",
               "--config", str(ROOT / "configs" / "quickstart_grpo.yaml"),
               *tiny_run_overrides(task, work / f"run-{job}", "trainer.total_steps=2", "trainer.eval_every=0",
                                   "trainer.save_every=1")]
    started = time.monotonic()
    child = subprocess.Popen(command, env=environment, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    interrupted = False
    while time.monotonic() - started < at_s and child.poll() is None:
        time.sleep(0.02)
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGINT)
        interrupted = True
    try:
        stdout, stderr = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
    ended_s = time.monotonic() - started
    left = processes_left_after(JOB_ENV, job, GONE_WITHIN_S)
    lines = own_lines(stderr)
    expected_status = 130 if interrupted else 0
    ok = (child.returncode == expected_status and not left and "Traceback" not in stderr
          and (len(lines) <= 1 if interrupted else "done" in stdout + stderr))
    return {"at_s": at_s, "interrupted": interrupted, "exit": child.returncode, "ended_after_s": round(ended_s, 2),
            "lines": lines[-3:], "traceback": "Traceback" in stderr, "left_5s_after": list(left.values()), "ok": ok,
            **({} if ok else {"stdout_tail": stdout[-1500:], "stderr_tail": stderr[-3000:]})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", type=float, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ctrl_c_sweep"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ctrl_c_sweep.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    task = build_tiny_task(args.work / "task")
    load_before = os.getloadavg()
    ends = []
    for repeat in range(args.repeats):
        for at_s in args.at:
            end = one_end(task, args.work, at_s)
            ends.append({"repeat": repeat, **end})
            print(f"Ctrl-C at {at_s:>4.1f} s: exit {end['exit']}, {len(end['lines'])} line(s), "
                  f"{len(end['left_5s_after'])} left, {'ok' if end['ok'] else 'NOT OK'}: {end['lines'][-1:]}",
                  flush=True)
    record = {
        "command": "python bench/ctrl_c_sweep.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "load_average_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
        "summary": {"ends": len(ends), "ok": sum(end["ok"] for end in ends),
                    "interrupted": sum(end["interrupted"] for end in ends),
                    "left_processes": sum(len(end["left_5s_after"]) for end in ends),
                    "tracebacks": sum(end["traceback"] for end in ends)},
        "ends": ends,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"]))
    return 0 if record["summary"]["ok"] == len(ends) else 1


if __name__ == "__main__":
    sys.exit(main())
