"""grpo_mega.run.launcher.spawn_local_ranks: on a CPU build of torch, ranks forked from a fork server that imported
torch, megatron-core and transformers once (spawned on a CUDA build), each still started as the caller is at that
moment (environment, working directory, threads)."""

import os
import sys

from grpo_mega.run.launcher import spawn_local_ranks


def _describe(name: str) -> dict:
    preloaded = {m for m in ("torch", "megatron.core", "transformers") if m in sys.modules}  # before any import here
    import torch

    return {"preloaded": preloaded, "variable": os.environ.get(name), "cwd": os.getcwd(),
            "threads": torch.get_num_threads(), "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
            "pid": os.getpid()}


def test_ranks_start_with_the_libraries_loaded_and_the_callers_environment_and_folder(tmp_path, monkeypatch):
    import torch  # here, not at the top: a rank imports this module, which must not load torch for it

    first = spawn_local_ranks(_describe, 2, ("GRPO_MEGA_TEST_VARIABLE",), threads=1)
    # the fork server now runs; what the caller changes afterwards still reaches the next ranks
    monkeypatch.setenv("GRPO_MEGA_TEST_VARIABLE", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.chdir(tmp_path)
    second = spawn_local_ranks(_describe, 2, ("GRPO_MEGA_TEST_VARIABLE",))
    assert [r["rank"] for r in first + second] == ["0", "1", "0", "1"] and {r["world"] for r in second} == {"2"}
    preloaded = set() if torch.version.cuda else {"torch", "megatron.core", "transformers"}
    assert all(r["preloaded"] == preloaded for r in first + second)
    assert {r["variable"] for r in first} == {None} and [r["threads"] for r in first] == [1, 1]
    assert {r["variable"] for r in second} == {"set after the server started"}
    assert {r["cwd"] for r in second} == {str(tmp_path)} and [r["threads"] for r in second] == [2, 2]
    assert len({r["pid"] for r in first + second} | {os.getpid()}) == 5


def _one_rank_job(fail: bool) -> dict:
    """Joins a one-process gloo group through torchrun's variables, changes the thread count, fails when asked."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    torch.set_num_threads(1)
    if fail:
        raise RuntimeError("the job failed")
    return {"rank": os.environ["RANK"], "world": dist.get_world_size(), "sum": total.item(), "pid": os.getpid()}


def test_a_one_rank_job_runs_here_and_leaves_the_process_as_it_found_it(monkeypatch):
    import pytest
    import torch
    import torch.distributed as dist

    from grpo_mega.run.launcher import run_as_the_only_rank

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the count to restore, whatever this machine has
    assert run_as_the_only_rank(_one_rank_job, (False,)) == {"rank": "0", "world": 1, "sum": 1.0, "pid": os.getpid()}
    with pytest.raises(RuntimeError, match="the job failed"):
        run_as_the_only_rank(_one_rank_job, (True,))
    monkeypatch.undo()
    assert not dist.is_initialized() and "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    assert torch.get_num_threads() == 2
    torch.set_num_threads(threads)
