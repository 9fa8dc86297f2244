"""A stop signal reaching the rollout world's rank 0 (``rollout.mode: async``): with its trainer gone it names the
cause (``peer_lost``) in failure.json and one line, at once; with its trainer alive it goes on, and the trainer's
``stop`` still arrives in order (``grpo_mega.rollout.link.RolloutLink.check_trainer``).

Two processes joined by a gloo group, as the bridge joins the worlds' rank 0s: the trainer SIGKILLs itself (its node
lost) or sends ``stop`` when told; the rollout side "generates" (a Python loop in the generation phase) until then.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from grpo_mega.run.failure import DEFER_AFTER_SIGNAL_S, DEFER_S, note_signal, record_failure

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import os, sys, time
from pathlib import Path
import torch.distributed as dist
from grpo_mega.rollout.bridge import Bridge

role, port, mode, run_dir = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
rank = 0 if role == "trainer" else 1
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
bridge = Bridge(dist.group.WORLD, is_trainer=rank == 0)
if role == "trainer":
    dist.barrier()
    if mode == "dies":
        os.kill(os.getpid(), 9)  # the trainer's node lost: no word from it
    while not (run_dir / "go").exists():
        time.sleep(0.05)
    bridge.send("stop")
    bridge.settle()
    assert bridge.receive() == ("bye", None)
    print("trainer: got bye", flush=True)
    sys.exit(0)

from grpo_mega.rollout.link import RolloutLink
from grpo_mega.run.control import StopRequests
from grpo_mega.run.failure import exit_status, phase, report_failure, set_step

stop_requests = StopRequests().install()
link = RolloutLink(bridge, engine=None)
link.check_trainer_on_stop_signals()
dist.barrier()
print("ready", flush=True)
try:
    set_step(5)
    with phase("generation"):
        deadline = time.monotonic() + 60
        while stop_requests.signal_name is None and time.monotonic() < deadline:
            sum(range(1000))
    assert bridge.receive() == ("stop", None)  # link.receive() relays in the rollout world: here the whole group
    link.send("bye")
    link.settle()
    print(f"rollout: stopped by the trainer after {stop_requests.signal_name}", flush=True)
except BaseException as error:
    sys.exit(exit_status(report_failure("grpo-mega train", run_dir, error)))
'''


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    script = tmp_path / "bridge_ends.py"
    script.write_text(SCRIPT)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               GRPO_MEGA_GLOBAL_RANK="1")
    ends = [subprocess.Popen([sys.executable, str(script), role, port, mode, str(tmp_path)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for role in ("trainer", "rollout")]
    assert ends[1].stdout.readline().strip() == "ready", ends[1].communicate(timeout=60)
    return ends[0], ends[1]


def test_sigterm_with_the_trainer_gone_names_peer_lost_at_once(tmp_path):
    trainer, rollout = _start(tmp_path, "dies")
    try:
        assert trainer.wait(timeout=60) == -signal.SIGKILL
        signalled = time.time()
        rollout.send_signal(signal.SIGTERM)  # the launcher tearing the step down
        _, err = rollout.communicate(timeout=60)
    finally:
        for end in (trainer, rollout):
            end.kill()
    assert rollout.returncode == 1, err
    lines = [line for line in err.splitlines() if "failed (cause=" in line]
    assert len(lines) == 1 and "rank 1" in lines[0] and "failed (cause=peer_lost) at step 5 (generation)" in lines[0] \
        and "the trainer (job rank 0) is gone: SIGTERM reached this rollout rank" in lines[0], err
    failure_json = tmp_path / "failure.json"
    record = json.loads(failure_json.read_text())
    assert (record["cause"], record["phase"], record["step"], record["signal_before"]) == \
        ("peer_lost", "generation", 5, "SIGTERM")
    assert "TrainerLost" in record["exception"] and "Connection closed by peer" in record["exception"]
    # the short wait of a rank being torn down, not the 3 s one: a launcher kills it within seconds
    assert failure_json.stat().st_mtime - signalled < DEFER_S


def test_sigterm_with_the_trainer_alive_waits_for_its_stop(tmp_path):
    trainer, rollout = _start(tmp_path, "lives")
    try:
        # a preemption (the trainer saves, then says stop), delivered three times as SLURM and torchrun both signal:
        # three probes, dropped unanswered (RolloutLink.check_trainer), and the bridge's traffic after them unchanged
        for _ in range(3):
            rollout.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        time.sleep(0.4)
        assert rollout.poll() is None  # recorded, not acted on: the trainer is there to decide
        (tmp_path / "go").touch()
        out, err = rollout.communicate(timeout=60)
        trainer_out, _ = trainer.communicate(timeout=60)
    finally:
        for end in (trainer, rollout):
            end.kill()
    assert rollout.returncode == 0 and "rollout: stopped by the trainer after SIGTERM" in out, err
    assert trainer.returncode == 0 and "trainer: got bye" in trainer_out
    assert not (tmp_path / "failure.json").exists()


def test_a_stop_signal_during_the_wait_for_the_root_cause_shortens_it(tmp_path):
    """A rank that lost its peer waits DEFER_S for the root cause to be named, DEFER_AFTER_SIGNAL_S once the launcher's
    SIGTERM arrives (it would be killed before the end of the long wait)."""
    torn_down = threading.Timer(0.2, note_signal, ("SIGTERM",))
    began = time.monotonic()
    torn_down.start()
    try:
        record, path = record_failure(tmp_path, ConnectionResetError("the trainer's socket closed"))
    finally:
        torn_down.join()
        note_signal(None)
    waited = time.monotonic() - began
    assert record["cause"] == "peer_lost" and path == tmp_path / "failure.json" and path.exists()
    assert DEFER_AFTER_SIGNAL_S - 0.05 < waited < DEFER_S - 0.5  # the wait, 0.5 s in all once signalled
