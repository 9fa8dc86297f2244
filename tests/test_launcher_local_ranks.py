"""grpo_mega.launcher.spawn_local_ranks: on a CPU build of torch, ranks forked from a fork server that imported
torch, megatron-core and transformers once (spawned on a CUDA build), each still started as the caller is at that
moment (environment, working directory, threads)."""

import os
import sys

from grpo_mega.launcher import spawn_local_ranks


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
