"""Ctrl-C stops every command in every window of its life with one line and exit 130 (issue 61, part 3).

Each test puts the SIGINT in its window deterministically: the process under test waits at a named pause point
(``grpo_mega.run.interrupts.pause_point``, env ``GRPO_MEGA_PAUSE_AT``) after writing a marker file, and the test
sends the signal once the marker exists. Every process starts with SIGINT *ignored*, as a background job of a
non-interactive shell (a CI runner's) does: the cause of the fresh-clone failures of
``test_ctrl_c_on_quickstart_is_one_line_and_exit_130``, where the quickstart inherited the ignored SIGINT and ran on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_mega.run.interrupts import PAUSE_AT_ENV, PAUSE_DIR_ENV
from grpo_mega.run.layout import CHECKPOINTS_DIR, TMP_PREFIX, checkpoint_dir
from grpo_mega.run.shared_fork_server import without_offer
from tiny_task import build_tiny_task, tiny_run_overrides

REPO = Path(__file__).resolve().parents[1]
GRPO_CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
IGNORING_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
"""Runs the rest of its command line with SIGINT ignored (exec keeps an ignored signal ignored)."""


def start(module_args: list[str], pause: str, tmp_path: Path) -> subprocess.Popen:
    """``python -m <module_args>`` in a new process group, SIGINT ignored, waiting at pause point ``pause``."""
    env = {**os.environ, "PYTHONPATH": str(REPO), PAUSE_AT_ENV: pause, PAUSE_DIR_ENV: str(tmp_path / "pauses")}
    return subprocess.Popen([sys.executable, "-c", IGNORING_SIGINT, "-m", *module_args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)


def paused(tmp_path: Path, pause: str, child: subprocess.Popen, timeout: float = 240.0) -> list[int]:
    """The pids paused at ``pause`` once one is (the test fails if ``child`` ends or ``timeout`` passes first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        markers = list((tmp_path / "pauses").glob(f"{pause}.*"))
        if markers:
            return [int(marker.suffix[1:]) for marker in markers]
        if child.poll() is not None:
            pytest.fail(f"ended (exit {child.returncode}) before pause point {pause}: {child.stderr.read()[-3000:]}")
        time.sleep(0.1)
    child.kill()
    pytest.fail(f"no process reached pause point {pause} within {timeout:.0f} s")


def interrupted(child: subprocess.Popen, *, group: bool = True, timeout: float = 300.0) -> list[str]:
    """Send SIGINT (to the process group, as a terminal's Ctrl-C does, or to the process alone); the stderr lines
    once it ended with exit status 130."""
    (os.killpg if group else os.kill)(child.pid, signal.SIGINT)
    try:
        _, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        pytest.fail("the SIGINT did not stop it")
    assert child.returncode == 130, stderr[-3000:]
    return stderr.strip().splitlines()


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


COMMANDS = {
    "train": ["train", "--config", "missing.yaml"],
    "sft": ["sft", "--config", "missing.yaml"],
    "eval": ["eval", "--config", "missing.yaml", "--policy", "missing"],
    "prm label": ["prm", "label", "--policy", "missing", "--data", "missing.jsonl", "--out", "labels.jsonl"],
    "prm score": ["prm", "score", "--prm", "missing", "--data", "missing.jsonl", "--out", "scores.jsonl"],
    "prm eval": ["prm", "eval", "--prm", "missing", "--out", "eval.json"],
    "prm train": ["prm", "train", "--config", "missing.yaml"],
    "quickstart": ["quickstart", "--fast", "--run-dir", "qs"],
}
RESUMES = "the same command resumes from the run's last checkpoint (or starts it, if it has none)"
HOW = {"train": RESUMES, "sft": RESUMES, "prm train": RESUMES,
       "quickstart": "qs keeps what finished (the same command continues)"}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_ctrl_c_while_a_command_starts_is_one_line_and_exit_130(tmp_path, name):
    """The window of a command's start and imports, before anything of its own catches the signal."""
    pause = "cli." + name.replace(" ", ".")
    child = start(["grpo_mega.cli", *COMMANDS[name]], pause, tmp_path)
    paused(tmp_path, pause, child)
    how = HOW.get(name, "nothing was written: run the same command again")
    assert interrupted(child) == [f"grpo-mega {name}: interrupted; {how}"]


@pytest.mark.parametrize("name, pause", [("train", "cli.import"), ("train", "cli.parse"), ("prm score", "cli.parse")])
def test_ctrl_c_while_the_cli_imports_or_parses_is_one_line_and_exit_130(tmp_path, name, pause):
    """The CLI module's imports (SIGINT held blocked from its first line until main's ``try``) and the parse of the
    command line (its parser imports prm.cli and the config schemas): the clock put a Ctrl-C there, before main's
    ``try`` (issue 79: a KeyboardInterrupt traceback and exit -2)."""
    child = start(["grpo_mega.cli", *COMMANDS[name]], pause, tmp_path)
    paused(tmp_path, pause, child)
    assert interrupted(child) == [f"grpo-mega {name}: interrupted; nothing was written: run the same command again"]


def test_ctrl_c_in_the_exec_to_the_launcher_is_the_launchers_line(task, tmp_path):
    """``train --nproc 2`` execs torchrun: a Ctrl-C just before the exec (here: held at ``launcher.exec`` until it
    is pending) reaches the launcher's first call, not the void between two programs (issue 79: lost there, the run
    trained to its end with exit 0; or a traceback from the new interpreter's imports, exit 1)."""
    env = {**without_offer(os.environ), "PYTHONPATH": str(REPO), PAUSE_AT_ENV: "launcher.exec",
           PAUSE_DIR_ENV: str(tmp_path / "pauses")}  # a user's command: no shared server, so the exec
    child = subprocess.Popen([sys.executable, "-c", IGNORING_SIGINT, "-m", "grpo_mega.cli", "train", "--nproc", "2",
                              "--config", str(GRPO_CONFIG), *tiny_run_overrides(task, tmp_path / "run")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                             start_new_session=True)
    paused(tmp_path, "launcher.exec", child)
    lines = [line for line in interrupted(child) if " INFO " not in line and " WARNING " not in line]
    assert lines == ["grpo-mega launcher (torchrun): interrupted before the ranks started; run the same command "
                     "again"]


HELD_IMPORT = """
import sys
from grpo_mega.run.interrupts import catch_ctrl_c, import_torch_holding_ctrl_c
catch_ctrl_c()
try:
    import_torch_holding_ctrl_c()
except KeyboardInterrupt:
    torch = sys.modules.get("torch")
    print("raised after the import:", torch is not None and hasattr(torch, "nn") and hasattr(torch, "Tensor"))
    sys.exit(130)
print("lost")
"""


def test_ctrl_c_while_torch_imports_is_raised_once_the_import_ended(tmp_path):
    """torch's C extension swallows what its numpy import raises: a KeyboardInterrupt there was lost (the run went
    on to its end) or left numpy half-imported (issue 79). Held, it is raised after the import, torch whole."""
    env = {**os.environ, "PYTHONPATH": str(REPO), PAUSE_AT_ENV: "import.torch", PAUSE_DIR_ENV: str(tmp_path / "pauses")}
    child = subprocess.Popen([sys.executable, "-c", HELD_IMPORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=tmp_path, start_new_session=True)
    paused(tmp_path, "import.torch", child)
    os.killpg(child.pid, signal.SIGINT)
    stdout, stderr = child.communicate(timeout=300)
    assert (child.returncode, stdout.strip()) == (130, "raised after the import: True"), stderr[-3000:]


def test_ctrl_c_while_a_prm_command_imports_torch_is_one_line_and_exit_130(tmp_path):
    """``prm eval`` in its own process (no shared server: a user's command), its checks passed: torch's import is
    held as train's and eval's is (a Ctrl-C there was lost in torch's numpy import, issue 79)."""
    prm = tmp_path / "prm"  # what the checks read: a classifier's config.json and a weights file
    prm.mkdir()
    (prm / "config.json").write_text('{"architectures": ["Qwen2ForProcessRewardModel"], "model_type": "qwen2"}')
    (prm / "model.safetensors").write_bytes(b"")
    env = {**without_offer(os.environ), "PYTHONPATH": str(REPO), PAUSE_AT_ENV: "import.torch",
           PAUSE_DIR_ENV: str(tmp_path / "pauses")}
    command = ["prm", "eval", "--prm", str(prm), "--data", "steps.jsonl", "--out", "eval.json"]
    child = subprocess.Popen([sys.executable, "-c", IGNORING_SIGINT, "-m", "grpo_mega.cli", *command],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                             start_new_session=True)
    paused(tmp_path, "import.torch", child)
    assert interrupted(child) == ["grpo-mega prm eval: interrupted; nothing was written: run the same command again"]
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.parametrize("pause", ["launcher", "import.torch"])
def test_ctrl_c_while_the_launcher_starts_is_one_line_and_exit_130(tmp_path, pause):
    child = start(["grpo_mega.run.torchrun", "--standalone", "--nproc-per-node=2", "-m", "--", "grpo_mega.cli",
                   "train", "--config", "missing.yaml"], pause, tmp_path)
    paused(tmp_path, pause, child)
    assert interrupted(child) == ["grpo-mega launcher (torchrun): interrupted before the ranks started; run the "
                                  "same command again"]


QUICKSTART_LINE = "grpo-mega quickstart: interrupted; {} keeps what finished (the same command continues)"


def test_ctrl_c_between_two_quickstart_commands_starts_no_further_command(tmp_path):
    """The pipeline's own work between commands (here: just before it starts the SFT command)."""
    child = start(["grpo_mega.cli", "quickstart", "--fast", "--run-dir", "qs"], "command.sft", tmp_path)
    paused(tmp_path, "command.sft", child)
    assert interrupted(child) == [QUICKSTART_LINE.format("qs")]
    assert not (tmp_path / "qs" / "sft.log").exists()


@pytest.mark.parametrize("group", [True, False], ids=["to_the_group", "to_the_pipeline_alone"])
def test_ctrl_c_while_the_quickstart_waits_on_its_command_stops_both(tmp_path, group):
    """The pipeline waiting on its SFT command while the command starts (imports). Sent to the pipeline alone
    (``kill -INT``), the pipeline forwards it: the command ends too, with its own line in its log."""
    child = start(["grpo_mega.cli", "quickstart", "--fast", "--run-dir", "qs"], "cli.sft", tmp_path)
    command_pid, = paused(tmp_path, "cli.sft", child)
    assert interrupted(child, group=group) == [QUICKSTART_LINE.format("qs")]
    assert gone(command_pid)
    assert (tmp_path / "qs" / "sft.log").read_text().strip().splitlines()[-1] == f"grpo-mega sft: interrupted; {RESUMES}"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


@pytest.mark.parametrize("pause, published", [("checkpoint.publish", False), ("checkpoint.publishing", True)],
                         ids=["before_publishing", "while_publishing"])
def test_ctrl_c_during_a_save_of_train_nproc_2_keeps_it_whole_or_not_at_all(task, tmp_path, pause, published):
    """``grpo-mega train --nproc 2`` (torchrun and two ranks) stopped during the save of step 1: once every rank's
    files are written but before rank 0 publishes them, the save is discarded (no ``step_1``, so a resume never sees
    it); while rank 0 publishes, the publication finishes and the run stops after it. One line names the checkpoint
    the same command resumes from."""
    run_dir = tmp_path / "run"
    child = start(["grpo_mega.cli", "train", "--config", str(GRPO_CONFIG), "--nproc", "2",
                   *tiny_run_overrides(task, run_dir, "trainer.total_steps=3", "trainer.save_every=1",
                                       "trainer.eval_every=0")], pause, tmp_path)
    paused(tmp_path, pause, child)
    stderr = interrupted(child)
    lines = [line for line in stderr if " WARNING " not in line and " INFO " not in line]  # the run's own log lines
    assert len(lines) == 1 and "failed (cause=interrupted) at step 1 (save): Ctrl-C (SIGINT); the same command " \
        "resumes from " in lines[0], stderr
    step_1 = checkpoint_dir(run_dir, 1)
    if published:
        from grpo_mega.run.checkpoints import checkpoint_problem

        assert checkpoint_problem(step_1) is None
        assert f"the checkpoint {step_1};" in lines[0]
    else:
        assert not step_1.exists()
        assert "the start (no checkpoint was saved yet)" in lines[0]
        assert [path.name for path in (run_dir / CHECKPOINTS_DIR).iterdir()] == [f"{TMP_PREFIX}{step_1.name}"]


def test_a_command_that_said_its_ctrl_c_line_ends_with_130_after_its_exit_functions(tmp_path):
    """``end_interrupted``: the exit functions run (the fork server's end is one), the streams are flushed, exit 130
    without the interpreter's finalization (after an interrupted import it could still end the process by SIGINT,
    -2, just after the line: issue 79); a Ctrl-C during the exit functions changes nothing."""
    program = ("import atexit, os, signal, sys\n"
               "from grpo_mega.run.interrupts import end_interrupted\n"
               "atexit.register(lambda: print('exit functions ran'))\n"
               "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))  # runs first (last registered)\n"
               "print('buffered', end=' ')\n"
               "end_interrupted()\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "buffered exit functions ran\n", "")
