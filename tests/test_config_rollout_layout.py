"""rollout.tensor_parallel: unset it takes parallel.tensor (a vLLM replica per training TP group, not a whole copy of
the model on every GPU); it must divide the job's processes, with an error naming the keys; and the shipped configs'
comments state the replica arithmetic the code does (replicas = world_size / rollout TP)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REQUIRED = ["model.hf_config=m", "data.train_file=t.jsonl"]


def _load(*overrides: str, path: Path | None = None) -> GRPOConfig:
    return load_config(GRPOConfig, path, [*REQUIRED, *overrides], validate)


def test_unset_rollout_tensor_parallel_is_the_policy_tensor_parallel(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert GRPOConfig().rollout.tensor_parallel is None
    assert _load("parallel.tensor=4", "rollout.engine=vllm").rollout.tensor_parallel == 4
    assert _load("rollout.engine=vllm").rollout.tensor_parallel == 1
    assert _load("parallel.tensor=4", "rollout.engine=vllm", "rollout.tensor_parallel=1").rollout.tensor_parallel == 1


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor=4"], r"rollout.tensor_parallel \(unset, so parallel.tensor=4\) does not divide the job's 6 "
                            r"processes.*Set rollout.tensor_parallel to a divisor of 6"),
    (["rollout.tensor_parallel=4"], r"rollout.tensor_parallel=4 does not divide the job's 6 processes.*divisor of 6"),
    (["rollout.tensor_parallel=0"], r"rollout.tensor_parallel=0 must be >= 1"),
])
def test_a_rollout_layout_that_does_not_divide_the_world_is_refused(monkeypatch, overrides, message):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=message):
        _load("rollout.engine=vllm", *overrides)


def test_the_hf_engine_has_no_rollout_tensor_parallel_to_check(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert _load("rollout.engine=hf", "rollout.tensor_parallel=4").rollout.tensor_parallel == 4
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert _load("rollout.engine=vllm", "rollout.tensor_parallel=4").rollout.tensor_parallel == 4


VLLM_CONFIGS = sorted(p.name for p in CONFIGS.glob("*.yaml") if "engine: vllm" in p.read_text())


def test_there_are_vllm_configs_to_check():
    assert len(VLLM_CONFIGS) >= 6, VLLM_CONFIGS


@pytest.mark.parametrize("name", VLLM_CONFIGS)
def test_config_comments_state_the_replicas_the_code_makes(monkeypatch, name):
    text = (CONFIGS / name).read_text()
    [world] = [int(n) for n in re.findall(r"^# world_size: (\d+)\s*$", text, flags=re.MULTILINE)]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = _load(path=CONFIGS / name)
    generating = cfg.rollout.async_ranks if cfg.rollout.mode == "async" else world  # async: the rollout GPUs only
    replicas = generating // cfg.rollout.tensor_parallel
    completions = cfg.algorithm.rollout_batch_size * cfg.algorithm.num_return_sequences_in_group

    [tp_line] = re.findall(r"^  tensor_parallel: .*$", text, flags=re.MULTILINE)
    stated = re.search(r"(\d+) / (\d+) = (\d+) replicas?\b", tp_line)
    assert stated, f"{name}: the rollout.tensor_parallel line should state world / TP = replicas: {tp_line!r}"
    assert tuple(map(int, stated.groups())) == (generating, cfg.rollout.tensor_parallel, replicas), tp_line

    [batch_line] = re.findall(r"^  rollout_batch_size: .*$", text, flags=re.MULTILINE)
    assert f"x G = {completions} completions" in batch_line, batch_line
    per_replica = re.search(r"(\d+) per replica \((\d+) replicas\)", batch_line)
    if replicas == 1:
        assert "all on the 1 replica" in batch_line, batch_line
    else:
        assert per_replica, f"{name}: say the completions per replica: {batch_line!r}"
        assert tuple(map(int, per_replica.groups())) == (completions // replicas, replicas), batch_line
    assert "per rank" not in batch_line and "at DP" not in batch_line, batch_line


def test_decode_graphs_reaches_the_hf_engine():
    """The key is passed to the engine the trainer builds (it was checked and then dropped)."""
    import torch

    from grpo_mega.stages.rollout_setup import rollout_engine_settings

    settings = rollout_engine_settings(_load("rollout.engine=hf", "rollout.decode_graphs=static"), torch.device("cpu"))
    assert settings["decode_graphs"] == "static"
    assert "decode_graphs" not in rollout_engine_settings(_load("rollout.engine=vllm"), torch.device("cpu"))


def test_decode_graphs_modes_and_refusals():
    assert _load().rollout.decode_graphs == "off"
    assert _load("rollout.engine=hf", "rollout.decode_graphs=static").rollout.decode_graphs == "static"
    assert _load("rollout.engine=hf", "parallel.device=cuda",
                 "rollout.decode_graphs=cuda_graphs").rollout.decode_graphs == "cuda_graphs"
    with pytest.raises(ConfigError, match="rollout.decode_graphs"):
        _load("rollout.decode_graphs=graphs")
    with pytest.raises(ConfigError, match=r"rollout.decode_graphs=cuda_graphs applies to the hf engine"):
        _load("rollout.engine=vllm", "rollout.decode_graphs=cuda_graphs")
    with pytest.raises(ConfigError, match=r"rollout.decode_graphs=static_compile needs CUDA \(parallel.device=cpu\)"):
        _load("rollout.engine=hf", "parallel.device=cpu", "rollout.decode_graphs=static_compile")
