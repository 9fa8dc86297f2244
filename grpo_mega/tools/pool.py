"""The pool of sandbox workers, on the caller's side: starts them, hands each call to an idle one, and replaces a
worker that died or stopped answering, so that the caller (a rollout rank) never dies of a call.

A worker enforces its call's wall clock itself; the pool's own deadline (the timeout plus ``GRACE_S``) only
catches a worker that is gone or stuck, which is then killed with its process group and replaced in the
background while the call is answered "crashed".
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from grpo_mega.tools.base import SandboxConfig
from grpo_mega.tools.protocol import receive, send

logger = logging.getLogger(__name__)
GRACE_S = 0.8
START_TIMEOUT_S = 120.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


# The variables a worker keeps of the trainer's environment: a call's code could read any of them (even from its
# own /proc/self/environ), and the trainer's hold tokens and keys. GRPO_MEGA_TOOL_ENV names more, comma-separated,
# for user tools that need them (an API key of a search tool).
KEPT_VARIABLES = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONPATH", "VIRTUAL_ENV", "TZ")
EXTRA_VARIABLES_ENV = "GRPO_MEGA_TOOL_ENV"


def worker_environment() -> dict[str, str]:
    """The environment workers start with: ``KEPT_VARIABLES`` and those ``GRPO_MEGA_TOOL_ENV`` names."""
    names = set(KEPT_VARIABLES) | {n.strip() for n in os.environ.get(EXTRA_VARIABLES_ENV, "").split(",") if n.strip()}
    return {name: os.environ[name] for name in names if name in os.environ}


class WorkerStartError(RuntimeError):
    """A sandbox worker did not start (a user tool that imports in the trainer but not in a worker, say)."""


class Worker:
    """One worker process and its two pipes."""

    def __init__(self, config: SandboxConfig, user_tools: dict[str, str]):
        env = dict(worker_environment(), PYTHONHASHSEED=str(config.seed % 2 ** 32), OMP_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        setup = json.dumps({"config": asdict(config), "user_tools": user_tools})
        self.process = subprocess.Popen([sys.executable, "-m", "grpo_mega.tools.worker", setup],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        start_new_session=True)
        self.info: dict = {}

    def wait_ready(self) -> dict:
        message = self._receive(START_TIMEOUT_S)
        if not message or not message.get("ready"):
            self.kill()
            raise WorkerStartError("a sandbox worker did not start: " +
                                   (message or {}).get("error", "it exited (see its stderr above)"))
        self.info = message
        return message

    def _receive(self, timeout: float):
        fd = self.process.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(timeout, 0))
        return receive(fd) if ready else False

    def call(self, request: dict, timeout: float) -> dict | None:
        """The worker's answer, or None when it died or did not answer within ``timeout``."""
        try:
            send(self.process.stdin.fileno(), request)
            answer = self._receive(timeout)
        except (OSError, ValueError):
            return None
        return answer or None

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and its call chain: the rest of the chain dies with it)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def stop(self, wait_s: float = 2.0) -> None:
        """Close its stdin (the worker ends after its call) and kill what is left after ``wait_s``."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=wait_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class WorkerPool:
    """``config.workers`` pre-started workers; ``call`` blocks until a worker is free, then runs the request."""

    def __init__(self, config: SandboxConfig, user_tools: dict[str, str]):
        self.config, self.user_tools = config, user_tools
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: set[Worker] = set()
        self._starting = 0
        started = [self._new_worker() for _ in range(config.workers)]
        try:
            self.info = [worker.wait_ready() for worker in started][0]
        except BaseException:
            self.close()
            raise
        for worker in started:
            self._idle.put(worker)
        if not config.network and str(self.info.get("network", "")).startswith("none"):
            logger.warning("tool sandbox: no network namespace on this machine, calls can reach the network: %s",
                           self.info["network"])
        if self.info.get("uid") is None:
            logger.warning("tool sandbox: not running as root, calls keep your user id: they can write your files "
                           "and max_processes counts all your processes (docs/clusters.md, The tool sandbox)")

    def _new_worker(self) -> Worker:
        worker = Worker(self.config, self.user_tools)
        with self._lock:
            self._workers.add(worker)
        return worker

    def _replace(self, worker: Worker) -> None:
        """Kill ``worker`` and start another in the background (its start is not the next call's time)."""
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            if self._closed:
                return
            self._starting += 1

        def start():
            fresh = None
            try:
                fresh = self._new_worker()
                fresh.wait_ready()
            except (WorkerStartError, OSError):
                with self._lock:
                    self._workers.discard(fresh)
                fresh = None  # the pool shrinks by one; calls still run on the others
            finally:
                with self._lock:
                    self._starting -= 1
            if fresh is not None and self._closed:
                fresh.stop()
            elif fresh is not None:
                self._idle.put(fresh)

        threading.Thread(target=start, name="sandbox-worker-start", daemon=True).start()

    def call(self, request: dict) -> dict:
        """Runs ``request`` on a free worker: the worker's answer, or a "crashed" one when the worker died.
        Raises TypeError / ValueError, before taking a worker, when the request is not JSON."""
        json.dumps(request)
        while True:
            try:
                worker = self._idle.get(timeout=0.5)
                break
            except queue.Empty:
                with self._lock:
                    if self._closed or not (self._workers or self._starting):  # all died, none restarts
                        return {"error": "crashed", "content": "the tool sandbox has no worker left"}
        if self._closed:
            self._idle.put(worker)
            return {"error": "crashed", "content": "the tool sandbox is closed"}
        answer = worker.call(request, self.config.timeout_s + GRACE_S)
        if answer is None:
            self._replace(worker)
            return {"error": "crashed", "content": "the sandbox worker died or stopped answering; it was replaced"}
        self._idle.put(worker)
        return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        for worker in workers:
            worker.stop()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not self._idle.empty():
            self._idle.get_nowait()
