"""Faults injected into real 2-rank runs at random moments (issue 37): does the job end fast with the cause named,
is every checkpoint on disk readable, and does the restarted job continue exactly as an uninterrupted run?

    .venv/bin/python bench/faults.py [--trials 5] [--faults sigkill,sigstop,...] [--timeout 20] [--seed 0] \\
        [--out bench/results/faults.json]

Every trial runs ``grpo-mega`` under torchrun (2 gloo ranks, TP=2, the tiny synthetic task, a checkpoint every 2
steps) through bench/fault_inject.py, injects one fault, and records: seconds from the fault to the job's exit,
the cause ``run_dir/failure.json`` names (and its rank and phase), whether every complete checkpoint on disk passes
the completeness check, then restarts the same command and compares it with an uninterrupted run of the same
command: every step's metrics (timings and memory aside) and every step's prompts (``trainer.dump_rollouts``:
no prompt lost or trained twice across the interruption). The faults:

  sigkill        SIGKILL of a random rank at a random moment (as the OOM killer, a crashed driver)
  sigstop        SIGSTOP of a random rank (a hang: the process lives, holds its sockets, answers nothing)
  exception      an exception on one rank only, in the update of a random step
  disk_full      the run's file system (a 64 MiB tmpfs) filled to 2 MiB free at a random moment: the next save
  prm_exception  the PRM scorer raising on one rank, mid-step (process supervision with a trained PRM)
  vllm_wake      the vLLM engine's wake-up never returning on one rank (vLLM's CPU backend; see fault_inject.py)
  prm_sigkill    SIGKILL of a random rank of PRM training

torchrun gives a rank that ignores SIGTERM (a stopped one) TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds before SIGKILL
(30 by default); the bench sets 10 so that a hang ends within 2 x the 20 s timeout (timeout + grace).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fault_setup import FaultTask, build_fault_task  # noqa: E402
from grpo_mega.checkpoint.training_files import checkpoint_problem  # noqa: E402
from grpo_mega.run.failure import TRANSIENT_CAUSES  # noqa: E402
from grpo_mega.run.forked_ranks import rank_process_name  # noqa: E402
from grpo_mega.run.metrics import read_metrics  # noqa: E402
from grpo_mega.run.procfs import command_line, parent_of  # noqa: E402

GRACE_S = 10
NOT_COMPARED = ("timing_s/", "memory/", "perf/throughput", "time", "step_seconds")
EXPECTED = {  # the causes a right diagnosis names, and the phase where the fault is planted inside a rank
    "sigkill": (set(TRANSIENT_CAUSES), None), "prm_sigkill": (set(TRANSIENT_CAUSES), None),
    "sigstop": ({"collective_timeout", "phase_timeout"}, None), "exception": ({"error"}, "update"),
    "disk_full": ({"disk_full"}, "save"), "prm_exception": ({"error"}, "prm scoring"),
    "vllm_wake": ({"phase_timeout"}, "vllm wake (weights)"),
}
PLANTED = {"exception": "exception", "prm_exception": "prm_exception", "vllm_wake": "vllm_wake"}


def _command(task: FaultTask, fault: str, run_dir: Path, timeout: int) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                str(ROOT / "bench" / "fault_inject.py")]
    return [*torchrun, *task.arguments(fault, run_dir, timeout)]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}


def prompts_by_step(run_dir: Path) -> dict[int, list[str]]:
    """{step: the sources (file:line) of the prompts trained at that step}, from the rollout dumps."""
    folder = run_dir / "rollouts"
    steps = {}
    for path in sorted(folder.glob("step_*.jsonl")) if folder.is_dir() else []:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        steps[int(path.stem.split("_")[1])] = [row["source"] for row in rows]
    return steps


def _unreadable_checkpoints(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    bad = [f"{p.name}: {problem}" for p in sorted(folder.glob("step_*")) if (problem := checkpoint_problem(p))]
    latest = folder / "latest"
    if latest.is_file() and checkpoint_problem(folder / latest.read_text().strip()):
        bad.append(f"latest names {latest.read_text().strip()}, which is not complete")
    return bad


def _parent(pid: str) -> tuple[str, bytes]:
    """(parent pid, its command line); ("", b"") when either is gone."""
    parent = parent_of(pid)
    return ("", b"") if parent is None else (str(parent), command_line(parent))


def _forked_by_launcher(pid: str, program: bytes, run_dir: bytes) -> bool:
    """Whether ``pid`` was forked by the fork server of a launcher running ``program`` for ``run_dir`` (not a helper
    the rank forked: those keep its name)."""
    server, server_command = _parent(pid)
    _, launcher_command = _parent(server) if b"multiprocessing.forkserver" in server_command else ("", b"")
    return program in launcher_command and run_dir in launcher_command


def rank_pid(rank: int, run_dir: Path, program: bytes = b"fault_inject.py",
             shared_server: int | None = None) -> int | None:
    """The pid of the process of ``rank`` (not torchrun itself) running ``program`` for ``run_dir``: a rank torchrun
    started as an interpreter by its command line and environment, one forked from the launcher's preloaded server
    (``grpo_mega.run.forked_ranks``, CPU torch) by its name and its launcher's command line. ``shared_server``: the
    pid of the shared fork server (``grpo_mega.run.shared_fork_server``) whose offer the caller's job took, its one
    job at a time: a rank of that name forked by it is the job's (nothing of the job is in its command line)."""
    folder = str(run_dir).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if (program in cmdline and folder in cmdline
                and b"torch.distributed.run" not in cmdline and f"RANK={rank}".encode() in environ):
            return int(pid)
        if name == rank_process_name(str(rank)) and (
                _forked_by_launcher(pid, program, folder)
                or (shared_server is not None and _parent(pid)[0] == str(shared_server))):
            return int(pid)
    return None


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _run(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def reference(task: FaultTask, fault: str, work: Path, timeout: int, env: dict) -> dict:
    """The uninterrupted run of the trial's command: metrics, prompts, and seconds per step."""
    run_dir = work / f"reference-{task.kind(fault)}"
    if not (run_dir / "done").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        start = time.monotonic()
        job = _run(_command(task, fault, run_dir, timeout), env, work / f"reference-{task.kind(fault)}.log")
        if job.wait(timeout=1800) != 0:
            raise SystemExit(f"the reference run of {fault} failed: see {work}")
        (run_dir / "done").write_text(f"{time.monotonic() - start}\n")
    rows = read_metrics(run_dir / "metrics.jsonl")
    times = [row["time"] for row in rows]
    return {"metrics": {row["step"]: _comparable(row) for row in rows}, "prompts": prompts_by_step(run_dir),
            "seconds": float((run_dir / "done").read_text()), "run_dir": run_dir,
            "window_s": times[-2] - times[0]}  # from the first step's row to the second-to-last step's


def _inject_external(fault: str, job: subprocess.Popen, run_dir: Path, rng: random.Random, ref: dict,
                     disk: Path | None) -> float | None:
    """Wait for the first logged step, then a random moment before the last step's row (in the reference run's
    timing; the disk filled before the last save), then the fault; returns its time."""
    while _steps_logged(run_dir) < 1:
        if job.poll() is not None:
            return None
        time.sleep(0.05)
    time.sleep(rng.uniform(0, ref["window_s"]))
    if job.poll() is not None:
        return None
    if fault == "disk_full":
        free = shutil.disk_usage(disk).free
        with open(disk / "filler", "wb") as out:
            out.truncate(0)
            os.posix_fallocate(out.fileno(), 0, max(0, free - 2 * 2**20))
        return time.time()
    pid = rank_pid(rng.randrange(2), run_dir)
    if pid is None:
        return None
    os.kill(pid, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
    return time.time()


def trial(task: FaultTask, fault: str, number: int, work: Path, timeout: int, env: dict, rng: random.Random,
          ref: dict) -> dict:
    root = work / f"{fault}-{number}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    disk = root / "disk" if fault == "disk_full" else None
    if disk is not None:
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    run_dir = (disk or root) / "run"
    record: dict = {"trial": number}
    try:
        trial_env = dict(env, GRPO_FAULT_MARK=str(root / "fault_at"))
        if fault in PLANTED:
            step, rank = rng.randint(2, task.total_steps - 1), rng.randrange(2)
            trial_env["GRPO_FAULT"] = f"{PLANTED[fault]}:{rank}:{step}"
            record.update(planted_rank=rank, planted_step=step)
        job = _run(_command(task, fault, run_dir, timeout), trial_env, root / "fault.log")
        fault_at = None if fault in PLANTED else _inject_external(fault, job, run_dir, rng, ref, disk)
        limit = 2 * timeout + 60
        try:
            job.wait(timeout=(limit if fault_at else 1800))
        except subprocess.TimeoutExpired:
            record["hang"] = True
            job.kill()
            job.wait()
        exited = time.time()
        if fault in PLANTED and (root / "fault_at").exists():
            fault_at = float((root / "fault_at").read_text())
        for pid in filter(None, (rank_pid(r, run_dir) for r in range(2))):  # a stopped rank torchrun left
            os.kill(pid, signal.SIGKILL)
        if fault_at is None:
            return {**record, "missed": "the run ended before the fault"}
        failure_path = run_dir / "failure.json"
        failure = json.loads(failure_path.read_text()) if failure_path.exists() else {}
        causes, phase = EXPECTED[fault]
        record.update(
            exit_code=job.returncode, seconds_to_exit=round(exited - fault_at, 2), hang=record.get("hang", False),
            cause=failure.get("cause"), failure_rank=failure.get("rank"), failure_phase=failure.get("phase"),
            failure_step=failure.get("step"),
            cause_right=failure.get("cause") in causes and (phase is None or failure.get("phase") == phase)
            and ("planted_rank" not in record or failure.get("rank") == record["planted_rank"]),
            unreadable_checkpoints=_unreadable_checkpoints(run_dir))
        if disk is not None:
            (disk / "filler").unlink(missing_ok=True)
        record.update(_restart(task, fault, run_dir, root, timeout, env, ref))
    finally:
        if disk is not None:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    return record


def _restart(task: FaultTask, fault: str, run_dir: Path, root: Path, timeout: int, env: dict, ref: dict) -> dict:
    """The same command again, to the end: where it resumed, and its continuation against the reference."""
    log = root / "restart.log"
    code = _run(_command(task, fault, run_dir, timeout), env, log).wait(timeout=1800)
    text = log.read_text()
    resumed = re.search(r"resumed from \S*step_(\d+) at step (\d+)", text)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    metrics = {row["step"]: _comparable(row) for row in rows}
    differences = [abs(float(metrics[s][k]) - float(v)) for s, ref_row in ref["metrics"].items() if s in metrics
                   for k, v in ref_row.items() if isinstance(v, (int, float)) and k in metrics[s]]
    result = {"restart_exit_code": code, "resumed_from_step": int(resumed.group(1)) if resumed else None,
              "steps_logged": sorted(metrics), "continuation_equal": metrics == ref["metrics"],
              "max_metric_difference": max(differences, default=None)}
    if ref["prompts"]:
        prompts = prompts_by_step(run_dir)
        trained = [source for step in sorted(prompts) for source in prompts[step]]
        expected = [source for step in sorted(ref["prompts"]) for source in ref["prompts"][step]]
        result.update(prompts_equal=prompts == ref["prompts"],
                      prompts_lost=sum(max(0, expected.count(s) - trained.count(s)) for s in set(expected)),
                      prompts_repeated=sum(max(0, trained.count(s) - expected.count(s)) for s in set(trained)))
    return result


def summarise(trials: list[dict]) -> dict:
    done = [t for t in trials if "missed" not in t]
    seconds = [t["seconds_to_exit"] for t in done]
    return {"trials": len(done), "missed": len(trials) - len(done), "hangs": sum(t["hang"] for t in done),
            "seconds_to_exit_max": max(seconds, default=None),
            "seconds_to_exit_mean": round(sum(seconds) / len(seconds), 2) if seconds else None,
            "cause_named_right": sum(t["cause_right"] for t in done),
            "causes": sorted({str(t["cause"]) for t in done}),
            "unreadable_checkpoints": sum(len(t["unreadable_checkpoints"]) for t in done),
            "restarts_exact": sum(t["continuation_equal"] and t.get("prompts_equal", True) and t["restart_exit_code"] == 0
                                  for t in done),
            "prompts_lost": sum(t.get("prompts_lost", 0) for t in done),
            "prompts_repeated": sum(t.get("prompts_repeated", 0) for t in done)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--faults", default=",".join(EXPECTED))
    parser.add_argument("--timeout", type=int, default=20, help="trainer.collective_timeout_s of the runs")
    parser.add_argument("--seed", type=int, default=0, help="draws the moments, ranks and steps of the faults")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    args = parser.parse_args()
    faults = args.faults.split(",")
    unknown = set(faults) - set(EXPECTED)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(EXPECTED)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-faults-"))
    env = dict(os.environ, TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(GRACE_S), OMP_NUM_THREADS="1")
    task = build_fault_task(work / "task", needs_prm=bool({"prm_exception", "prm_sigkill"} & set(faults)), env=env)
    rng = random.Random(args.seed)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.setdefault("faults", {})
    for fault in faults:
        ref = reference(task, fault, work, args.timeout, env)
        trials = [trial(task, fault, n, work, args.timeout, env, rng, ref) for n in range(args.trials)]
        results["faults"][fault] = {"summary": summarise(trials), "trials": trials, "seed": args.seed,
                                    "command": "python bench/faults.py " + " ".join(sys.argv[1:]),
                                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        print(fault, json.dumps(results["faults"][fault]["summary"]), flush=True)
        results.update(machine=f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
                       timeout_s=args.timeout, torchrun_grace_s=GRACE_S)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
