"""Which GPU vLLM's external_launcher takes inside the job (``grpo_mega.rollout.vllm_launch``): vLLM 0.32 computes
on ``cuda:LOCAL_RANK``, so the engine gives it the index of the GPU the trainer bound. A pure decision, tested
without a GPU or vLLM."""

import os

import pytest
import torch

from grpo_mega.parallel.distributed import resolve_device
from grpo_mega.rollout.vllm_launch import (
    external_launcher_environment,
    external_launcher_local_rank,
)


def test_srun_with_one_gpu_per_task_points_vllm_at_the_visible_gpu():
    # Task 3 of a node under `srun --gpus-per-task=1`: CUDA_VISIBLE_DEVICES holds one id, SLURM_LOCALID is 3.
    trained_on = resolve_device("cuda", cuda_available=True, device_count=1, local_rank=3)
    assert trained_on == torch.device("cuda", 0)
    # vLLM would take cuda:3 from LOCAL_RANK=3 and fail its `local rank < device count` assertion.
    assert external_launcher_local_rank(trained_on, visible_devices=1, launcher_local_rank=3) == "0"


@pytest.mark.parametrize("visible,local_rank", [(8, 0), (8, 5), (4, 3), (1, 0), (1, 7)])
def test_vllm_always_lands_on_the_trainers_gpu(visible, local_rank):
    trained_on = resolve_device("cuda", cuda_available=True, device_count=visible, local_rank=local_rank)
    given = external_launcher_local_rank(trained_on, visible_devices=visible, launcher_local_rank=local_rank)
    assert torch.device("cuda", int(given)) == trained_on  # vLLM's device is cuda:<LOCAL_RANK>


def test_cpu_keeps_the_launchers_local_rank():
    cpu = torch.device("cpu")
    assert external_launcher_local_rank(cpu, visible_devices=0, launcher_local_rank=1) == "1"
    assert external_launcher_local_rank(cpu, visible_devices=0, launcher_local_rank=None) == "0"


def test_a_gpu_the_process_does_not_see_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"trains on cuda:2 but sees 1 CUDA device.*--gpus-per-task=1.*torchrun"):
        external_launcher_local_rank(torch.device("cuda", 2), visible_devices=1, launcher_local_rank=2)


def test_the_environment_is_set_while_building_and_restored(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("RANK", raising=False)
    with external_launcher_environment(11, "0"):
        assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("11", "0")
    assert os.environ["LOCAL_RANK"] == "3" and "RANK" not in os.environ


def test_a_killed_jobs_cpu_shared_memory_is_removed_and_a_live_ones_kept(tmp_path):
    """vLLM's CPU backend names a TP group's segment after the group only (``-tp:0-[0-1]-cpushm_<rank>`` for every
    colocated job) and creates it exclusively: a killed job's segment made the restart fail with EEXIST."""
    from grpo_mega.rollout.vllm_launch import remove_stale_cpu_shm

    stale = tmp_path / "-tp:0-[0-1]-cpushm_1"
    in_use = tmp_path / "-tp:0-[2-3]-cpushm_1"      # another replica's, held open by a live process (this one)
    other_rank = tmp_path / "-tp:0-[0-1]-cpushm_0"  # rank 0's to remove, not rank 1's
    for path in (stale, in_use, other_rank):
        path.write_bytes(b"\0" * 64)
    with open(in_use, "rb"):
        assert remove_stale_cpu_shm(1, 2, folder=tmp_path) == [stale]
        assert remove_stale_cpu_shm(3, 2, folder=tmp_path) == []  # rank 3 of [2-3]: its segment is in use
    assert not stale.exists() and in_use.exists() and other_rank.exists()
    assert remove_stale_cpu_shm(0, 2, folder=tmp_path) == [other_rank]
