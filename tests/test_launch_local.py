"""launch/local.sh: the process count comes from the command line or, when not given, from the config: its whole
world size, parallel.tensor x parallel.pipeline (after the key=value overrides) x data parallel, which is --dp N or
the config's "# world_size: N" line divided by tensor x pipeline; read from its --dry-run output."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LOCAL_SH = REPO / "launch" / "local.sh"


def _local(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(["bash", str(LOCAL_SH), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


def _dry_run(*args: str) -> list[str]:
    """The torchrun command line local.sh would run (without the OMP_NUM_THREADS= prefix)."""
    result = _local("--dry-run", *args)
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    assert words[0].startswith("OMP_NUM_THREADS=")
    return words[1:]


def _nproc(command: list[str]) -> int:
    [flag] = [word for word in command if word.startswith("--nproc-per-node=")]
    return int(flag.split("=", 1)[1])


def test_process_count_is_the_world_size_the_config_was_written_for(tmp_path):
    # the shipped real-model configs: TP4 x PP1 with "# world_size: 8" is 8 processes (DP2), not the 4 of TP x PP
    assert _nproc(_dry_run("train", "--config", "configs/qwen2.5-math-7b_grpo.yaml")) == 8
    assert _nproc(_dry_run("train", "--config", "configs/llama-3.1-8b_grpo.yaml", "parallel.tensor=4")) == 8
    config = tmp_path / "world.yaml"
    config.write_text("# world_size: 12\nparallel:\n  tensor: 2\n  pipeline: 3\n")
    assert _nproc(_dry_run("train", "--config", str(config))) == 12
    assert _nproc(_dry_run("train", "--config", str(config), "parallel.pipeline=1")) == 12  # DP 6 instead of 2
    # --dp N: tensor x pipeline x N, whatever the comment says
    assert _nproc(_dry_run("--dp", "3", "train", "--config", str(config))) == 18
    assert _nproc(_dry_run("--dp=2", "train", "--config", "configs/quickstart_grpo.yaml", "parallel.tensor=2")) == 4


def test_process_count_is_tensor_times_pipeline_of_the_config_and_its_overrides(tmp_path):
    config = tmp_path / "layout.yaml"
    config.write_text("parallel:\n  tensor: 2\n  pipeline: 3\ntrainer:\n  total_steps: 5\n")
    assert _nproc(_dry_run("train", "--config", str(config))) == 6
    assert _nproc(_dry_run("prm", "train", "--config", str(config), "parallel.pipeline=1")) == 2
    assert _nproc(_dry_run("sft", f"--config={config}", "parallel.tensor=4", "trainer.total_steps=9")) == 12
    # the quickstart configs are TP=1 with no pipeline key (default 1): one process unless --nproc (the quickstart
    # passes --nproc 2 and trains them data-parallel)
    assert _nproc(_dry_run("sft", "--config", "configs/quickstart_sft.yaml")) == 1
    assert _nproc(_dry_run("train", "--config", "configs/quickstart_grpo.yaml")) == 1


def test_async_rollout_ranks_come_on_top_of_the_training_ranks():
    """rollout.mode=async: rollout.async_ranks processes more than the training layout; a config's world size line
    counts them, so the training ranks are what is left."""
    async_ranks = ["rollout.mode=async", "rollout.async_ranks=2"]
    assert _nproc(_dry_run("--dp", "2", "train", "--config", "configs/quickstart_grpo.yaml", *async_ranks)) == 4
    assert _nproc(_dry_run("train", "--config", "configs/quickstart_grpo.yaml", *async_ranks)) == 3
    assert _nproc(_dry_run("train", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "rollout.mode=async",
                           "rollout.async_ranks=4")) == 8  # its world size line: 4 training ranks at TP=4, 4 rollout
    result = _local("--dry-run", "train", "--config", "configs/qwen2.5-math-7b_grpo.yaml", *async_ranks)
    assert result.returncode == 2 and "less rollout.async_ranks=2" in result.stderr  # 6 training ranks at TP=4


def test_an_explicit_process_count_wins_and_the_command_passes_through_after_a_double_dash():
    command = _dry_run("4", "prm", "label", "--n", "8", "--policy", "runs/sft")
    assert _nproc(command) == 4
    assert command[0] == sys.executable
    assert command[1:4] == ["-m", "grpo_mega.run.torchrun", "--standalone"]  # torchrun, failures in one line
    # torchrun's own options end at "--": the command's --n / --nproc are not taken for torchrun's flags
    assert command[-9:] == ["-m", "--", "grpo_mega.cli", "prm", "label", "--n", "8", "--policy", "runs/sft"]


def test_threads_are_the_cores_split_between_the_processes():
    cores = len(os.sched_getaffinity(0))  # what `nproc` counts
    result = _local("--dry-run", "1", "train", "--config", "configs/quickstart_grpo.yaml")
    assert result.stdout.startswith(f"OMP_NUM_THREADS={cores} ")
    result = _local("--dry-run", str(4 * cores), "train", "--config", "configs/quickstart_grpo.yaml")
    assert result.stdout.startswith("OMP_NUM_THREADS=1 ")


@pytest.mark.parametrize("args, message", [
    (["prm", "label", "--n", "8"], "no NPROC given and no --config"),
    (["train", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "parallel.tensor=3"],
     'parallel.tensor x parallel.pipeline = 3 x 1 does not divide the world size 8 of '
     'configs/qwen2.5-math-7b_grpo.yaml (its "# world_size: 8" line); give --dp N or NPROC'),
    (["--dp", "0", "train", "--config", "configs/quickstart_grpo.yaml"], "--dp must be an integer >= 1, got '0'"),
    (["--dp", "two", "train", "--config", "configs/quickstart_grpo.yaml"], "--dp must be an integer >= 1, got 'two'"),
    (["train", "--config", "missing.yaml"], "config file missing.yaml does not exist"),
    (["train", "--config", "configs/quickstart_grpo.yaml", "parallel.tensor=two"],
     "parallel.tensor must be an integer >= 1, got 'two'"),
    (["train", "--config", "configs/quickstart_grpo.yaml", "parallel.pipeline=0"],
     "parallel.pipeline must be an integer >= 1, got 0"),
    (["0", "train", "--config", "configs/quickstart_grpo.yaml"], "NPROC must be >= 1, got 0"),
    ([], "usage: launch/local.sh"),
])
def test_bad_input_fails_with_a_message_and_status_2(args, message):
    result = _local("--dry-run", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_it_runs_the_command_under_torchrun():
    # One process printing the command's help: torchrun accepts "--n" because it follows "--".
    result = _local("1", "prm", "label", "--n", "8", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Monte-Carlo continuations per step prefix" in result.stdout


def test_rendezvous_ports_come_from_outside_the_ephemeral_range_without_touching_the_seeded_rngs():
    """Spawned ranks bind the port seconds after it was picked; the OS hands out ephemeral ports (32768+) to every
    connection meanwhile, so one from there could be taken first (EADDRINUSE at the rendezvous)."""
    import random
    import socket

    from grpo_mega.run.launcher import RENDEZVOUS_PORTS, free_port

    low, _ = (int(value) for value in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert RENDEZVOUS_PORTS.stop <= low
    random.seed(5)
    state = random.getstate()
    ports = {free_port() for _ in range(20)}
    assert random.getstate() == state and all(port in RENDEZVOUS_PORTS for port in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))  # it was free
