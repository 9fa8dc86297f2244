"""The end checks of bench/chaos.py: the run that met every fault against one uninterrupted run of the same command.

- the final checkpoint's tensors (policy weights, optimizer state, RNG states, and those of every companion model
  saved in its subfolders: the implicit PRM) bit-equal (``torch.equal``, same dtype and shape), and its non-tensor
  objects equal; whether its files are byte-identical is reported beside (their recorded CRC-32s);
- every step's metrics row equal (timings and memory aside);
- every step's prompts (``trainer.dump_rollouts``) equal: none lost, none trained twice.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from grpo_mega.run.layout import COMPLETE_FILE, step_dir_name
from grpo_mega.run.metrics import read_metrics
from faults import prompts_by_step  # bench/faults.py: the same rollout dumps

NOT_COMPARED = ("timing_s/", "memory/", "startup_s/", "perf/throughput", "perf/prm_fraction", "perf/tool_fraction",
                "tools/call_seconds", "time", "step_seconds")
"""Timings and memory: seconds, their ratios, and the start-up's seconds on the first step of every attempt (with
tools: the calls' own seconds and the tools' share of the step)."""
ASYNC_TIMINGS = ("_s", "_per_s")
"""``async/*`` keys that are seconds or rates (generation_s, rollout_wait_s, ..., generation_tokens_per_s); the
others (weights_version, staleness_*, weights_versions_in_flight) are the schedule, and are compared."""


def _compared(key: str) -> bool:
    return not key.startswith(NOT_COMPARED) and not (key.startswith("async/") and key.endswith(ASYNC_TIMINGS))


def comparable_metrics(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    return {row["step"]: {k: v for k, v in row.items() if _compared(k)} for row in rows}


def _load_distcp(folder: Path) -> dict:
    """Every item of the torch.distributed.checkpoint folder ``folder``, loaded in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "state.pt"
        dcp_to_torch_save(str(folder), str(out))
        return torch.load(out, map_location="cpu", weights_only=False)


def checkpoint_items(checkpoint: Path) -> dict[str, object]:
    """{file / key path: value} of everything a checkpoint folder holds in torch files: each torch.distributed
    checkpoint folder in it (the policy's, a companion's) and each ``*.pt`` file."""
    import torch

    items: dict[str, object] = {}

    def flatten(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}/{key}", inner)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in value):
            for index, inner in enumerate(value):
                flatten(f"{prefix}[{index}]", inner)
        else:
            items[prefix] = value

    for metadata in sorted(checkpoint.rglob(".metadata")):
        flatten(str(metadata.parent.relative_to(checkpoint)), _load_distcp(metadata.parent))
    for file in sorted(checkpoint.rglob("*.pt")):
        flatten(str(file.relative_to(checkpoint)), torch.load(file, map_location="cpu", weights_only=False))
    return items


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # objects without a plain equality (arrays): compare their bytes
        return repr(a) == repr(b)


def compare_checkpoints(ours: Path, reference: Path) -> dict:
    """Bit-equality of two final checkpoints: counts of tensors, the items that differ (first 10), and whether
    their files are byte-identical by the checksums their complete.json record."""
    import torch

    a, b = checkpoint_items(ours), checkpoint_items(reference)
    different = sorted(key for key in a.keys() & b.keys() if not _equal(a[key], b[key]))
    missing = sorted(a.keys() ^ b.keys())
    sums = [json.loads((path / COMPLETE_FILE).read_text()).get("checksums") for path in (ours, reference)]
    return {"checkpoint": ours.name, "items": len(a), "tensors": sum(isinstance(v, torch.Tensor) for v in a.values()),
            "tensor_elements": sum(v.numel() for v in a.values() if isinstance(v, torch.Tensor)),
            "companions": sorted(str(m.parent.relative_to(ours)) for m in ours.rglob(".metadata") if m.parent != ours),
            "bit_equal": not different and not missing, "different": different[:10], "only_in_one": missing[:10],
            "files_identical": sums[0] is not None and sums[0] == sums[1]}


def compare_runs(run_dir: Path, reference_dir: Path, final_step: int) -> dict:
    """The end checks of a chaos run against its reference; see the module docstring."""
    ours, theirs = comparable_metrics(run_dir), comparable_metrics(reference_dir)
    rows_different = sorted(step for step in theirs if ours.get(step) != theirs[step])
    prompts, expected = prompts_by_step(run_dir), prompts_by_step(reference_dir)
    trained = [source for step in sorted(prompts) for source in prompts[step]]
    wanted = [source for step in sorted(expected) for source in expected[step]]
    name = step_dir_name(final_step)
    final, final_reference = run_dir / "checkpoints" / name, reference_dir / "checkpoints" / name
    weights = (compare_checkpoints(final, final_reference) if final.is_dir() and final_reference.is_dir()
               else {"bit_equal": False, "missing": f"{name} in {run_dir if not final.is_dir() else reference_dir}"})
    return {"weights": weights, "metrics_rows": len(ours), "metrics_rows_reference": len(theirs),
            "metrics_equal": ours == theirs, "metrics_rows_different": rows_different[:10],
            "prompts_equal": prompts == expected and bool(expected),
            "prompts_lost": sum(max(0, wanted.count(s) - trained.count(s)) for s in set(wanted)),
            "prompts_repeated": sum(max(0, trained.count(s) - wanted.count(s)) for s in set(trained)),
            "prompts_reference": len(wanted)}
