"""What the planner assumes about the job: the hardware, the engine's memory settings and the rollout layout.

Memory settings that the engine grows over time (``parallel.distributed_optimizer``, ``parallel.sequence_parallel``,
``parallel.recompute``, ``parallel.offload_during_rollout``) are read from the config when it has the key, with the
engine's own default where the key is absent, and can be set for a what-if with ``assume`` (``grpo-mega plan
--assume distributed_optimizer=true``): the plan of a setting the engine does not have yet is a forecast, and the
report says so.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from grpo_mega.config import ConfigError

GIB = 2**30
RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class Hardware:
    """The machines a plan is for: ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gib`` GiB each (the total
    memory the device reports, e.g. 79.6 GiB for an 80 GB H100)."""

    gpus_per_node: int
    gpu_memory_gib: float
    nodes: int = 1
    gpu_name: str = ""
    """The GPU's name as the device reports it (``grpo-mega plan --gpu-name``); only vLLM's default batch limits
    depend on it (an A100 gets the smaller ones). Empty: not an A100."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1 or not self.gpu_memory_gib > 0:
            raise ConfigError(f"hardware {self}: gpus_per_node and nodes must be >= 1 and gpu_memory_gib > 0")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)


_HARDWARE_LINE = re.compile(
    r"^#\s*hardware:\s*(\d+)\s*nodes?\s*x\s*(\d+)\s*GPUs?\s*x\s*([0-9.]+)\s*GiB", re.IGNORECASE | re.MULTILINE)


def documented_hardware(config_file: str | Path) -> Hardware | None:
    """The hardware a config's header documents on a line ``# hardware: 1 node x 8 GPUs x 79.6 GiB``, or None."""
    match = _HARDWARE_LINE.search(Path(config_file).read_text())
    if match is None:
        return None
    return Hardware(gpus_per_node=int(match.group(2)), gpu_memory_gib=float(match.group(3)), nodes=int(match.group(1)))


_HARDWARE_DEVICE = re.compile(
    r"^#\s*hardware:.*?GiB\s*\(?\s*(?:[0-9.]+\s*GB\s+)?(H100|H200|H20|A100|B200|CPU)\b", re.MULTILINE)


def documented_device(config_file: str | Path) -> str | None:
    """The device profile a config's ``# hardware:`` line names first after its memory (``... x 79.6 GiB  (80 GB
    H100 / A100 ...)`` -> ``H100``; ``... x 12 GiB  (CPU: ...)`` -> ``CPU``), which ``plan --steps`` prices on
    unless ``--device`` or ``--gpu-name`` says otherwise; None when it names none."""
    match = _HARDWARE_DEVICE.search(Path(config_file).read_text())
    return match.group(1) if match else None


_PLAN_SHAPE_LINES = {role: re.compile(rf"^#[ \t]*plan-{role}:[ \t]*(\S+)", re.MULTILINE)
                     for role in ("model", "prm")}  # the folder on the same line (not the next line's first word)


def documented_shape(config_file: str | Path, role: str) -> str | None:
    """The folder a config's header names on a line ``# plan-model: configs/models/smollm2-135m`` (``role``
    ``model``) or ``# plan-prm: configs/models/qwen2.5-math-prm-7b`` (``prm``): the shipped config.json of the policy
    or PRM it is written for, which the plan reads while ``model.hf_config`` is not set (a config whose model path
    the user or the quickstart fills in) or ``process_reward.prm`` names a folder that is not there yet (the PRM not
    downloaded); None without the line."""
    match = _PLAN_SHAPE_LINES[role].search(Path(config_file).read_text())
    return match.group(1) if match else None


UNREAD_BY_PLAN = "data.train_file"
"""A required key the plan never reads (it counts memory and time, not data): left unset, it is not asked for."""


def planning_overrides(config_file: str | Path, overrides: list[str]) -> tuple[list[str], list[str]]:
    """(The overrides ``grpo-mega plan`` loads ``config_file`` with, the notes that say what it filled in): the
    user's, then for a config that leaves them unset, ``data.train_file`` (not read by a plan) and
    ``model.hf_config`` from the header's ``# plan-model:`` line, ``process_reward.prm`` (a process-supervised config)
    from its ``# plan-prm:`` line. Any other required key stays required."""
    from omegaconf import OmegaConf

    from grpo_mega.config import GRPOConfig
    from grpo_mega.config.loading import merge_config

    merged = merge_config(GRPOConfig, config_file, overrides)
    missing = set(OmegaConf.missing_keys(merged))
    filled, notes = list(overrides), []
    if UNREAD_BY_PLAN in missing:
        filled.append(f"{UNREAD_BY_PLAN}=unread-by-plan")
    shape = documented_shape(config_file, "model")
    if "model.hf_config" in missing and shape:
        filled.append(f"model.hf_config={shape}")
        notes.append(f"policy: model.hf_config is not set; planned with the shape the config's header names ({shape})")
    prm_shape = documented_shape(config_file, "prm")
    if prm_shape and OmegaConf.select(merged, "process_reward.source") == "prm" and \
            not OmegaConf.select(merged, "process_reward.prm", throw_on_missing=False):
        filled.append(f"process_reward.prm={prm_shape}")  # the plan reads its shape (grpo_mega.plan.build)
        notes.append(f"PRM: process_reward.prm is not set; planned with the shape the config's header names "
                     f"({prm_shape})")
    return filled, notes


@dataclass(frozen=True)
class MemorySettings:
    """The engine settings that change how much memory a rank holds."""

    distributed_optimizer: bool = False
    """fp32 master copies and Adam moments sharded over data-parallel ranks (megatron's DistributedOptimizer)."""
    sequence_parallel: bool = False
    """Norm / residual activations split over TP ranks (megatron's sequence parallelism)."""
    recompute: str = "none"
    """``none``, ``selective`` (core attention re-run) or ``full`` (each layer re-run from its input)."""
    offload_during_rollout: bool = False
    """Gradient buffers released and optimizer state in host memory from the end of an update to the next."""
    assumed: tuple[str, ...] = ()
    """Settings given by ``assume`` rather than read from the config (shown in the report)."""


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"--assume {key}={value!r}: expected true or false")


def memory_settings(cfg, data_parallel: int, assume: Mapping[str, Any] | None = None) -> MemorySettings:
    """The memory settings of ``cfg`` (a ``GRPOConfig``): the ``parallel.*`` key where the config has it (null =
    the engine's automatic choice: the distributed optimizer when DP > 1, sequence parallelism when TP > 1), else
    the engine as it is without the key (all off); then ``assume`` ({name: value}) overrides."""
    parallel = cfg.parallel
    values: dict[str, Any] = {}
    for name, automatic in (("distributed_optimizer", data_parallel > 1),
                            ("sequence_parallel", parallel.tensor > 1)):
        if hasattr(parallel, name):
            value = getattr(parallel, name)
            values[name] = automatic if value is None else bool(value)
    for name in ("recompute", "offload_during_rollout"):
        if hasattr(parallel, name):
            values[name] = getattr(parallel, name)
    known = {f.name for f in dataclasses.fields(MemorySettings)} - {"assumed"}
    assumed = []
    for name, value in (assume or {}).items():
        if name not in known:
            raise ConfigError(f"--assume {name}: unknown setting; expected one of {sorted(known)}")
        values[name] = str(value).strip().lower() if name == "recompute" else _as_bool(name, value)
        assumed.append(name)
    if values.get("recompute", "none") not in RECOMPUTE_CHOICES:
        raise ConfigError(f"recompute={values['recompute']!r}: expected one of {RECOMPUTE_CHOICES}")
    if values.get("sequence_parallel") and parallel.tensor < 2:
        raise ConfigError("sequence_parallel=true needs parallel.tensor > 1")
    return MemorySettings(**values, assumed=tuple(assumed))


def parse_assume(items: list[str] | None) -> dict[str, str]:
    """``["distributed_optimizer=true", ...]`` -> {name: value}; ConfigError for an item without ``=``."""
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--assume {item!r}: expected name=value, e.g. distributed_optimizer=true")
        out[name.strip()] = value.strip()
    return out


def rollout_tensor_parallel(cfg) -> int:
    """vLLM ranks per replica: ``rollout.tensor_parallel``, or the policy's ``parallel.tensor`` where that is unset
    (null / 0)."""
    value = getattr(cfg.rollout, "tensor_parallel", None)
    return int(value) if value else int(cfg.parallel.tensor)


def rollout_ranks(cfg) -> int:
    """GPUs that only generate: ``rollout.async_ranks`` with ``rollout.mode: async``, else 0."""
    return int(cfg.rollout.async_ranks) if getattr(cfg.rollout, "mode", "colocated") == "async" else 0


def data_parallel_size(cfg, hardware: Hardware) -> int:
    """training GPUs / (TP x PP) (the training GPUs: the world less the rollout ranks of ``rollout.mode: async``);
    ConfigError when the layout does not divide them."""
    model_parallel = cfg.parallel.tensor * cfg.parallel.pipeline
    training = hardware.world_size - rollout_ranks(cfg)
    if training < 1 or training % model_parallel:
        less = f" less rollout.async_ranks={rollout_ranks(cfg)}" if rollout_ranks(cfg) else ""
        raise ConfigError(f"parallel.tensor x parallel.pipeline = {model_parallel} does not divide the "
                          f"{hardware.world_size} GPUs ({hardware.nodes} node(s) x {hardware.gpus_per_node}){less}")
    return training // model_parallel
