"""Issue 51, the first hour: every config mistake is caught in the command's own process before torchrun or srun
starts anything, as one line on stderr naming the key (and the fix where there is one), exit status 2. Each case
is the exact command a user types, run as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_runner import run_grpo_mega
from grpo_mega.run.shared_fork_server import SHARED_FORK_SERVER_ENV

REPO = Path(__file__).resolve().parent.parent
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")
SFT = str(REPO / "configs" / "quickstart_sft.yaml")
PRM = str(REPO / "configs" / "quickstart_prm.yaml")


def assert_one_line_error(result: subprocess.CompletedProcess, *named: str) -> str:
    """Exit status 2, stderr at most 3 lines (here: one), naming every string of ``named``, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert 1 <= len(lines) <= 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for text in named:
        assert text in result.stderr, (text, result.stderr)
    return result.stderr


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, str]:
    """A model folder (its config.json) and a prompt file: what the checks before the launch read."""
    root = tmp_path_factory.mktemp("task")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 512}))
    (root / "train.jsonl").write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    return {"model": str(root / "model"), "train": str(root / "train.jsonl"), "root": str(root)}


def paths(task, run_dir: Path) -> list[str]:
    return [f"model.hf_config={task['model']}", f"data.train_file={task['train']}", f"trainer.run_dir={run_dir}"]


def test_a_misspelt_key_with_nproc_2_is_refused_before_torchrun_starts_with_the_key_meant(task, tmp_path, monkeypatch):
    # as a user runs it: the suite's shared fork server would have the command's work wait for its imports to end
    monkeypatch.delenv(SHARED_FORK_SERVER_ENV, raising=False)
    start = time.perf_counter()
    result = run_grpo_mega("train", "--config", GRPO, "--nproc", "2", *paths(task, tmp_path / "run"), "trainer.totl_steps=3")
    seconds = time.perf_counter() - start
    assert_one_line_error(result, "trainer.totl_steps", "did you mean trainer.total_steps?")
    assert "torch.distributed" not in result.stderr and "[rank" not in result.stderr
    assert seconds < 10, seconds  # no rank started (before: ~40 lines of torchrun after both ranks loaded)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, named, not_named", [
    (["parallel.tensor=3"], ["parallel.tensor=3", "2 processes", "--nproc 3"], []),
    (["trainer.keep_last=0"], ["trainer.keep_last=0"], []),
    (["algorithm.response_length=0"], ["algorithm.response_length=0"], ["overlong_buffer"]),
    (["model.tokenizer"], ["'model.tokenizer' is not key=value", "model.tokenizer=null"], []),
    (["algorithm.supervision=process", "reward.function=math_verify"],
     ["reward.function='math_verify' returns one score per completion", "reward.function=synthetic_steps"], []),
    (["reward.function=math_verfy"], ["reward.function='math_verfy'"], []),
])
def test_config_mistakes_are_one_line_before_any_rank(task, tmp_path, overrides, named, not_named):
    result = run_grpo_mega("train", "--config", GRPO, "--nproc", "2", *paths(task, tmp_path / "run"), *overrides)
    stderr = assert_one_line_error(result, *named)
    assert not any(text in stderr for text in not_named), stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("layout, named", [
    ({"config.json": "{}"}, "is none of: a grpo-mega checkpoint"),  # an HF folder without its weights
    ({"checkpoints/.tmp-step_000001/x": ""}, "holds no complete checkpoint"),  # a run that never saved
])
def test_model_init_from_that_holds_no_weights_is_refused_before_any_rank(task, tmp_path, layout, named):
    folder = tmp_path / "weights"
    for name, text in layout.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    result = run_grpo_mega("train", "--config", GRPO, "--nproc", "2", *paths(task, tmp_path / "run"),
                       f"model.init_from={folder}")
    assert_one_line_error(result, f"model.init_from={folder}", named)  # before: cause=error from a rank at start-up
    assert not (tmp_path / "run").exists()


def test_a_missing_hf_config_folder_is_named_as_that_key(task, tmp_path):
    result = run_grpo_mega("train", "--config", GRPO, f"model.hf_config={tmp_path / 'nowhere'}",
                       f"data.train_file={task['train']}", f"trainer.run_dir={tmp_path / 'run'}")
    stderr = assert_one_line_error(result, f"model.hf_config={tmp_path / 'nowhere'}: no such folder")
    assert "tokenizer" not in stderr


@pytest.mark.parametrize("count", ["0", "-3"])
def test_a_process_count_below_1_is_refused(count):
    assert_one_line_error(run_grpo_mega("train", "--config", GRPO, "--nproc", count), f"--nproc {count} must be >= 1")


def test_srun_s_task_count_is_the_world_size_a_rank_checks(task, tmp_path):
    """Under srun (SLURM_PROCID, SLURM_NTASKS; no torchrun variables) a rank checks the layout against the job's
    tasks: its failure line names the key, with cause=config (the SLURM scripts do not requeue it)."""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    result = run_grpo_mega("train", "--config", GRPO, *paths(task, tmp_path / "run"), "parallel.tensor=3", env=slurm)
    assert_one_line_error(result, "failed (cause=config)", "parallel.tensor=3", "job's 2 processes")


def test_a_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_steps: 3\n   bad: [1\n")
    for command in (["train"], ["plan"], ["prm", "train"]):
        result = run_grpo_mega(*command, "--config", str(bad))
        assert_one_line_error(result, f"{bad}:3:7: YAML syntax error")


@pytest.mark.parametrize("command, config", [(["sft"], SFT), (["eval", "--policy", "x"], GRPO)])
def test_sft_and_eval_check_before_the_launch_too(task, tmp_path, command, config):
    result = run_grpo_mega(*command, "--config", config, "--nproc", "2", *paths(task, tmp_path / "run"),
                       "trainer.totl_steps=3")
    assert_one_line_error(result, "trainer.totl_steps", "did you mean trainer.total_steps?")


def test_prm_train_checks_its_layout_against_the_process_count(task, tmp_path):
    result = run_grpo_mega("prm", "train", "--config", PRM, "--nproc", "2", *paths(task, tmp_path / "run"),
                       "parallel.tensor=3")
    assert_one_line_error(result, "parallel.tensor=3", "2 processes")


@pytest.mark.parametrize("command, config", [(["train"], GRPO), (["sft"], SFT), (["prm", "train"], PRM)])
def test_print_config_marks_the_required_keys_not_set_instead_of_refusing(tmp_path, command, config):
    import yaml

    result = run_grpo_mega(*command, "--config", config, "--print-config", f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "  hf_config: ???  # required, not set\n" in result.stdout
    assert "  train_file: ???  # required, not set\n" in result.stdout
    assert result.stdout.count("# required, not set") == 2
    printed = yaml.safe_load(result.stdout)  # still the YAML of the config
    assert printed["model"]["hf_config"] == "???" and printed["trainer"]["run_dir"] == str(tmp_path / "run")
    assert result.stderr.strip().splitlines() == [
        f"grpo-mega {' '.join(command)}: required keys not set (marked in the config above): data.train_file, "
        "model.hf_config"]
    assert not (tmp_path / "run").exists()
    # the other mistakes are still refused
    assert_one_line_error(run_grpo_mega(*command, "--config", config, "--print-config", "trainer.totl_steps=3"),
                          "did you mean trainer.total_steps?")


@pytest.mark.parametrize("flag", ["--gpus-per-node", "--gpu-memory-gib", "--nodes"])
def test_plan_refuses_a_zero_count_instead_of_the_header_s(flag):
    config = str(REPO / "configs" / "qwen2.5-math-7b_grpo.yaml")
    assert_one_line_error(run_grpo_mega("plan", "--config", config, flag, "0"), f"{flag} 0 must be")


def test_quickstart_refuses_zero_iterations_in_one_line(tmp_path):
    result = run_grpo_mega("quickstart", "--iterations", "0", "--run-dir", str(tmp_path / "qs"))
    assert_one_line_error(result, "--iterations 0 must be >= 1")
    assert not (tmp_path / "qs").exists()


def test_ctrl_c_on_quickstart_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C reaches the terminal's whole process group: the quickstart and the command it runs. The signal is put
    in its window deterministically: the SFT command's launcher waits at its start (``pause_point("launcher")``,
    before it imports torch) until the test sends it. The quickstart starts with SIGINT ignored, as a background job
    of a non-interactive shell (a CI runner's) does: inherited so, it once made the quickstart run on to its end
    (exit 0) after the SIGINT. tests/test_ctrl_c_windows.py puts it in the other windows."""
    from grpo_mega.run.interrupts import PAUSE_AT_ENV, PAUSE_DIR_ENV

    ignoring_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                       "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    pauses = tmp_path / "pauses"
    child = subprocess.Popen([sys.executable, "-c", ignoring_sigint, "-m", "grpo_mega.cli", "quickstart", "--fast",
                              "--run-dir", str(tmp_path / "qs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(REPO), PAUSE_AT_ENV: "launcher",
                                  PAUSE_DIR_ENV: str(pauses)})
    deadline = time.monotonic() + 240  # the data and tokenizer first: seconds, more on a loaded machine
    while not list(pauses.glob("launcher.*")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(pauses.glob("launcher.*")), f"the SFT command's launcher never started (exit {child.poll()})"
    os.killpg(child.pid, signal.SIGINT)
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines() == [f"grpo-mega quickstart: interrupted; {tmp_path / 'qs'} keeps what "
                                           "finished (the same command continues)"], stderr[-3000:]
    assert (tmp_path / "qs" / "sft.log").read_text().strip().splitlines()[-1] == (
        "grpo-mega launcher (torchrun): interrupted before the ranks started; run the same command again")
