"""Exact resume with tools (issue 75's floor): a ``grpo-mega train`` run with ``rollout.multi_turn`` (the hf engine,
the python tool in the sandbox's pool and the inline calculator) SIGKILLed inside a tool call of step 2, resumed,
SIGKILLed again inside the update of step 3 (after its optimizer step, before any save), resumed again, ends as one
uninterrupted run of the same command does: the final checkpoint bit-equal (weights, optimizer, RNG states), every
metrics row equal (timings aside), every step's rollouts equal token for token with their turns, tool calls and tool
outputs; and no sandbox worker outlives the rank that started it.

The policy is test_turn_loop_train.py's scripted bigram with two calls, each as likely: the calculator's, and a
python call that prints a random number (the sandbox seeds ``random`` per call: its output is a function of the
input, so the resumed run sees the same tool output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_turn_loop_train import CALL_BODY, REWARD, build_bigram_policy
from tiny_task import build_tiny_task

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from chaos_checks import comparable_metrics, compare_checkpoints  # noqa: E402

CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
PYTHON_BODY = '{"name": "python", "arguments": {"code": "import random; print(random.randint(0, 10 ** 6))"}}'
STEPS = 3
SANDBOX_SEED = 700_000 + os.getpid() % 100_000
"""In the workers' command line: tells this test's sandbox workers from any other test's on the machine."""


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_resume")
    model_dir, train_file = build_tiny_task(root)
    (root / "answer42.py").write_text(REWARD)
    policy = build_bigram_policy(model_dir, root / "bigram", call_bodies=(CALL_BODY, PYTHON_BODY))
    return policy, train_file, root


def _command(task, run_dir: Path) -> list[str]:
    model_dir, train_file, _ = task
    overrides = [
        f"model.hf_config={model_dir}", f"model.init_from={model_dir}", f"data.train_file={train_file}",
        f"trainer.run_dir={run_dir}", "algorithm.rollout_batch_size=2", "algorithm.num_return_sequences_in_group=4",
        "algorithm.response_length=24", "algorithm.dynamic_sampling=false", f"trainer.total_steps={STEPS}",
        "trainer.save_every=1", "trainer.eval_every=0", "trainer.dump_rollouts=true", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "parallel.device=cpu", "parallel.tensor=1", "rollout.engine=hf",
        "reward.function=answer42.py:reward", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[calculator,python]", "rollout.multi_turn.max_turns=3",
        "rollout.multi_turn.sandbox.workers=2", f"rollout.multi_turn.sandbox.seed={SANDBOX_SEED}",
    ]
    # bench/fault_inject.py is grpo-mega with the fault of GRPO_FAULT planted (none: grpo-mega itself)
    return [sys.executable, str(REPO / "bench" / "fault_inject.py"), "train", "--config", str(CONFIG), *overrides]


def _run(task, run_dir: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("GRPO_FAULT", "GRPO_FAULT_FILE")}
    env.update(OMP_NUM_THREADS="1", **({"GRPO_FAULT": fault, "GRPO_FAULT_MARK": str(run_dir.parent / "fired")}
                                       if fault else {}))
    return subprocess.run(_command(task, run_dir), capture_output=True, text=True, timeout=600, cwd=task[2], env=env)


def _our_workers() -> list[int]:
    """Sandbox workers started by this test's runs, wherever they are on the machine."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(process.info["cmdline"] or [])
        except psutil.Error:
            continue
        if "grpo_mega.tools.worker" in line and f'"seed": {SANDBOX_SEED}' in line:
            found.append(process.pid)
    return found


def _no_worker_left(within_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := _our_workers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _rollouts(run_dir: Path, step: int) -> list[dict]:
    """A step's dumped rollouts without the tool calls' seconds (a clock)."""
    rows = [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    for row in rows:
        for turn in row["turns"]:
            for call in turn["calls"]:
                call.pop("seconds", None)
    return rows


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.mark.slow
def test_a_tool_run_killed_in_a_tool_call_and_in_the_update_resumes_bit_equal(task, tmp_path):
    whole, killed = tmp_path / "whole" / "run", tmp_path / "killed" / "run"
    done = _run(task, whole)
    assert done.returncode == 0, done.stderr[-3000:]

    first = _run(task, killed, "tool_kill:0:2")  # SIGKILL once step 2's first tool call has run in the sandbox
    assert first.returncode == -9 and (killed.parent / "fired").exists(), first.stderr[-3000:]
    assert _latest(killed) == "step_000001"
    assert not _no_worker_left(), "sandbox workers outlived their SIGKILLed rank"
    (killed.parent / "fired").unlink()
    second = _run(task, killed, "update_kill:0:3")  # resumed; SIGKILL after step 3's optimizer step
    assert second.returncode == -9 and (killed.parent / "fired").exists(), second.stderr[-3000:]
    assert "resumed from" in second.stderr and _latest(killed) == "step_000002", second.stderr[-3000:]
    third = _run(task, killed)
    assert third.returncode == 0 and "resumed from" in third.stderr, third.stderr[-3000:]
    assert not _no_worker_left()

    expected, got = comparable_metrics(whole), comparable_metrics(killed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == expected[step], step
        assert got[step]["tools/calls_per_rollout"] == 1 and got[step]["tools/error_fraction"] == 0
        assert _rollouts(killed, step) == _rollouts(whole, step), step
    assert all(row["actor/grad_norm"] > 0 for row in expected.values())  # every step moved the weights
    # both tools ran: the calculator's answer and the python tool's seeded number came back
    responses = [row["response"] for step in range(1, STEPS + 1) for row in _rollouts(whole, step)]
    assert any("<tool_response>42</tool_response>" in text for text in responses)
    python_outputs = {text.split("<tool_response>")[1].split("</tool_response>")[0] for text in responses
                      if "python" in text}
    assert len(python_outputs) == 1 and python_outputs.pop().strip().isdigit()
    final = compare_checkpoints(killed / "checkpoints" / f"step_{STEPS:06d}",
                                whole / "checkpoints" / f"step_{STEPS:06d}")
    assert final["bit_equal"] and final["tensors"] > 0, final
