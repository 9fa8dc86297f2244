"""``grpo-mega`` with one fault planted inside one rank, for bench/faults.py (torchrun runs this file in place of
``-m grpo_mega.cli``; the arguments are the command's). ``GRPO_FAULT=KIND:RANK:STEP`` plants:

  exception      a RuntimeError raised in the update of step STEP on rank RANK
  prm_exception  a RuntimeError raised by the PRM scorer in step STEP on rank RANK (process supervision)
  vllm_wake      the vLLM engine's wake-up in the weight sync after step STEP never returns on rank RANK (as a
                 colocated wake-up that hangs on a GPU; vLLM has no sleep mode on CPU, so the hang is planted
                 where ``VLLMRolloutEngine.begin_weight_update`` wakes the weights, inside the same bounded phase)
  prm_train_exception  a RuntimeError raised in PRM training step STEP on rank RANK
  save_kill      rank RANK SIGKILLs itself in the first checkpoint save at step >= STEP, once its files are
                 written and before the checkpoint is published (bench/chaos.py: a fault during a save)
  resume_kill    rank RANK SIGKILLs itself as it starts loading the checkpoint it resumes from (STEP unused;
                 bench/chaos.py: a fault during a resume)
  tool_kill      rank RANK SIGKILLs itself inside the first tool call of step STEP (``rollout.multi_turn``): the
                 call has run in the sandbox, its result not yet read by the turn loop
  update_kill    rank RANK SIGKILLs itself in the update of step STEP, after its first optimizer step (the
                 weights changed in memory, not saved)

``GRPO_FAULT_AFTER=PATH``: a due fault first waits (up to 300 s) for PATH to exist, for faults that must land after
another rank's act that the schedule alone does not order before them (async rollouts: the rollout world generates
step n + 2 while the trainer saves step n; the tests name that checkpoint's ``latest``).

When the fault fires it writes the time to ``$GRPO_FAULT_MARK`` (the bench's fault-to-exit clock). Without
``GRPO_FAULT`` this is ``grpo-mega`` itself.

``GRPO_FAULT_FILE=PATH`` in place of both (bench/chaos.py under SLURM, whose requeued job restarts with the
environment it was submitted with): the file holds ``{"fault": "KIND:RANK:STEP", "mark": MARK}``, read as each rank
starts; a fault whose mark exists has fired already and is not planted again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _wait_for_precondition() -> None:
    """Block until ``$GRPO_FAULT_AFTER`` exists (at most 300 s; then the fault fires anyway and the caller's
    checks say what was missing)."""
    path = os.environ.get("GRPO_FAULT_AFTER")
    deadline = time.monotonic() + 300
    while path and not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _mark() -> None:
    mark = os.environ.get("GRPO_FAULT_MARK")
    if mark:
        Path(mark).write_text(f"{time.time()}\n")


def _wrap(owner: type, name: str, due, fault) -> None:
    """Replace ``owner.name`` by a method that runs ``fault(self)`` when ``due()`` and the original otherwise."""
    original = getattr(owner, name)

    def method(self, *args, **kwargs):
        if due():
            _mark()
            fault(self)
        return original(self, *args, **kwargs)

    setattr(owner, name, method)


def _raise(what: str):
    def fault(_self):
        raise RuntimeError(f"fault injected by bench/faults.py: {what}")
    return fault


def _hang_in_wake(_self) -> None:
    from grpo_mega.run.failure import phase

    with phase("vllm wake (weights)", bounded=True, alone=True):
        while True:
            time.sleep(1)


def _kill_self(_self) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_in_checksums(step: int, due_from) -> None:
    """SIGKILL this rank inside the save of the first checkpoint at step >= ``step``: ``checksums_of`` runs once
    the rank's files are in the staging folder, before any rank publishes."""
    from grpo_mega.checkpoint import training

    original = training.checksums_of

    def checksums_of(folder, names):
        if due_from():
            _mark()
            _kill_self(None)
        return original(folder, names)

    training.checksums_of = checksums_of


def _kill_in_resume(first_call) -> None:
    """SIGKILL this rank as it starts loading a checkpoint of its own run (not a PRM or an initial policy that the
    same loader reads)."""
    from grpo_mega.checkpoint.training import CheckpointManager

    original = CheckpointManager.load

    def load(self, engine, path, **kwargs):
        if Path(path).resolve().parent == Path(self.checkpoints_dir).resolve() and first_call():
            _mark()
            _kill_self(None)
        return original(self, engine, path, **kwargs)

    CheckpointManager.load = load


def _kill_after_first_train_step(due) -> None:
    """SIGKILL this rank once the first optimizer step of the update of the due step has been applied."""
    from grpo_mega.stages.update import UpdateRunner

    original = UpdateRunner.run

    def run(self, *args, **kwargs):
        if not due():
            return original(self, *args, **kwargs)
        train_step = self.policy.train_step

        def train_step_then_die(*step_args, **step_kwargs):
            train_step(*step_args, **step_kwargs)
            _mark()
            _kill_self(None)

        self.policy.train_step = train_step_then_die
        return original(self, *args, **kwargs)

    UpdateRunner.run = run


def _kill_in_tool_call(due) -> None:
    """SIGKILL this rank once the first call of the due step has run on the tool set (in the sandbox's pool when
    the tool is not the inline calculator), before the turn loop reads its result."""
    from grpo_mega.tools.toolset import ToolSet

    original = ToolSet._run_one

    def run_one(self, call, row_kwargs):
        result = original(self, call, row_kwargs)
        if due():
            _mark()
            _kill_self(None)
        return result

    ToolSet._run_one = run_one


def plant(kind: str, rank: int, step: int) -> None:
    from grpo_mega.run.failure import POSITION

    if int(os.environ.get("RANK", "0")) != rank:
        return
    fired = []

    def fire_once(ready: bool) -> bool:
        """True the first time ``ready`` holds, once ``$GRPO_FAULT_AFTER`` exists: every kind waits here, at the
        point where it has decided to fire."""
        if not ready or fired:
            return False
        fired.append(True)
        _wait_for_precondition()
        return True

    def due() -> bool:  # once, at the step
        return fire_once(POSITION["step"] == step)

    def due_from() -> bool:  # once, at the step or the first after it that reaches the planted code
        return fire_once(POSITION["step"] is not None and POSITION["step"] >= step)

    def first_call() -> bool:
        return fire_once(True)

    where = f"rank {rank}, step {step}"
    if kind == "exception":
        from grpo_mega.stages.update import UpdateRunner
        _wrap(UpdateRunner, "run", due, _raise(f"update, {where}"))
    elif kind == "prm_exception":
        from grpo_mega.stages.process_reward import PRMStepRewards
        _wrap(PRMStepRewards, "__call__", due, _raise(f"PRM scorer, {where}"))
    elif kind == "vllm_wake":
        from grpo_mega.rollout.vllm_engine import VLLMRolloutEngine
        _wrap(VLLMRolloutEngine, "begin_weight_update", due, _hang_in_wake)
    elif kind == "prm_train_exception":
        from grpo_mega.harness.lifecycle import RunHarness
        _wrap(RunHarness, "end_step", due, _raise(f"PRM training, {where}"))
    elif kind == "save_kill":
        _kill_in_checksums(step, due_from)
    elif kind == "resume_kill":
        _kill_in_resume(first_call)
    elif kind == "tool_kill":
        _kill_in_tool_call(due)
    elif kind == "update_kill":
        _kill_after_first_train_step(due)
    else:
        raise SystemExit(f"GRPO_FAULT: unknown kind {kind!r}")


def _fault_spec() -> str | None:
    """``KIND:RANK:STEP`` of the fault to plant in this rank: ``GRPO_FAULT``, or the one ``GRPO_FAULT_FILE`` names
    unless its mark says it fired already (that file also sets ``GRPO_FAULT_MARK``)."""
    path = os.environ.get("GRPO_FAULT_FILE")
    if not path:
        return os.environ.get("GRPO_FAULT")
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    if spec.get("mark"):
        os.environ["GRPO_FAULT_MARK"] = spec["mark"]
        if Path(spec["mark"]).exists():
            return None
    return spec.get("fault") or None


def main() -> int:
    fault = _fault_spec()
    if fault:
        kind, rank, step = fault.split(":")
        plant(kind, int(rank), int(step))
    from grpo_mega.cli import main as grpo_mega

    return grpo_mega(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
