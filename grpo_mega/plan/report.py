"""The plan as a table a person reads in ten seconds, and as JSON for tools."""

from __future__ import annotations

from dataclasses import asdict

from grpo_mega.plan.phases import REQUIRED_HEADROOM, Plan

GIB = 2**30


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / GIB:.1f}"


def to_dict(plan: Plan) -> dict:
    """JSON-ready plan: bytes everywhere, plus each phase's total and headroom."""
    return {
        "config": plan.config,
        "hardware": asdict(plan.hardware) | {"world_size": plan.hardware.world_size, "gpu_bytes": plan.gpu_bytes},
        "layout": {"tensor": plan.tensor, "pipeline": plan.pipeline, "data": plan.data, "dtype": plan.dtype},
        "settings": asdict(plan.settings),
        "parameters": plan.parameters,
        "policy": asdict(plan.policy),
        "micro_batch_tokens": plan.micro_batch_tokens,
        "head_tokens": plan.head_tokens,
        "activations": plan.activations,
        "logprob_buffers": plan.logprob_buffers,
        "reference": plan.reference,
        "prm": plan.prm,
        "prm_activations": plan.prm_activations,
        "vllm": asdict(plan.vllm) if plan.vllm else None,
        "vllm_prm": asdict(plan.vllm_prm) if plan.vllm_prm else None,
        "phases": {p.name: {"items": p.items, "total": p.total, "headroom": plan.headroom(p)} for p in plan.phases},
        "fits": plan.fits,
        "problems": plan.problems,
        "notes": plan.notes,
        "unknown": plan.unknown,
        "save_host": asdict(plan.save_host) if plan.save_host else None,
    }


def format_table(plan: Plan, *, accept_unknown: bool = False) -> str:
    """Header (layout, settings, vLLM's settings), one row per byte item and one column per phase (GiB per rank),
    totals with headroom, the save's host RAM, and the verdict: FITS only when every phase fits and nothing was left
    uncounted, or ``accept_unknown``."""
    hw = plan.hardware
    s = plan.settings
    lines = [
        f"{plan.config or 'config'}: {hw.nodes} node(s) x {hw.gpus_per_node} GPUs x {hw.gpu_memory_gib:g} GiB = "
        f"{hw.world_size} ranks; policy TP{plan.tensor} x PP{plan.pipeline} x DP{plan.data} ({plan.dtype}, "
        f"{plan.parameters / 1e9:.2f}B parameters per model-parallel rank)",
        f"settings: distributed_optimizer={s.distributed_optimizer} sequence_parallel={s.sequence_parallel} "
        f"recompute={s.recompute} offload_during_rollout={s.offload_during_rollout}; largest micro-batch "
        f"{plan.micro_batch_tokens} tokens ({plan.head_tokens} in the head's rows)",
    ]
    if plan.vllm:
        v = plan.vllm
        lines.append(f"vLLM: {v.replicas} replicas x TP{v.tensor_parallel}; KV cache holds {v.sequences_held} "
                     f"full-length sequences ({v.sequence_tokens} tokens) per replica, a step asks {v.sequences_asked}")
        lines.append(f"vLLM settings assumed (passed to vLLM as such): max_num_seqs={v.limits.max_num_seqs} "
                     f"max_num_batched_tokens={v.limits.max_num_batched_tokens} enforce_eager={v.enforce_eager} "
                     f"(CUDA graphs {_gib(v.cuda_graphs)} GiB, kept through the update); "
                     f"gpu_memory_utilization={v.budget / plan.gpu_bytes:.2f}")
    names = [p.name for p in plan.phases]
    items = list(dict.fromkeys(key for p in plan.phases for key in p.items))
    width = max(len(k) for k in items + ["total (headroom)"]) + 2
    lines.append("GiB per rank".ljust(width) + "".join(n.rjust(16) for n in names))
    for key in items:
        unknown_prm = key == "PRM weights" and plan.prm is None
        if not unknown_prm and not any(p.items.get(key) for p in plan.phases):
            continue  # nothing of it anywhere (no reference without KL, no CUDA context on a CPU plan)
        cells = []
        for p in plan.phases:
            value = p.items.get(key)
            cells.append(("unknown" if unknown_prm else "-" if not value else _gib(value)).rjust(16))
        lines.append(key.ljust(width) + "".join(cells))
    lines.append("total (headroom)".ljust(width) + "".join(
        f"{_gib(p.total)} ({plan.headroom(p):.0%})".rjust(16) for p in plan.phases))
    if plan.save_host is not None:
        lines.append(f"save: host RAM {_gib(plan.save_host.per_rank)} GiB per rank, {_gib(plan.save_host.per_node)} "
                     f"GiB per node of {plan.save_host.per_node // max(plan.save_host.per_rank, 1)} ranks"
                     + (" (the distributed optimizer's state gathered on every rank)" if s.distributed_optimizer else ""))
    for note in plan.notes:
        lines.append(f"note: {note}")
    for part in plan.unknown:
        lines.append(f"NOT COUNTED: {part}")
    if plan.fits and not plan.verdict_fits(accept_unknown=accept_unknown):
        lines.append("UNKNOWN: the counted parts fit, but the plan is incomplete (NOT COUNTED above); make the part "
                     "readable, or pass --accept-unknown to accept the plan without it")
    elif plan.fits:
        worst = min(plan.phases, key=plan.headroom)
        lines.append(f"FITS: every phase leaves >= {REQUIRED_HEADROOM:.0%} of {hw.gpu_memory_gib:g} GiB free "
                     f"(least: {worst.name}, {plan.headroom(worst):.0%})")
    else:
        lines.append("DOES NOT FIT:")
        lines.extend(f"  {problem}" for problem in plan.problems)
    return "\n".join(lines)


def step_time_dict(step, one_off: dict[str, float], steps: int, device, eff) -> dict:
    """The step-time model's result as JSON: seconds and share per phase, the step, GPU-hours for ``steps``, the
    one-off phases, the device profile and the efficiency factors it used."""
    return {
        "device": asdict(device), "efficiency": asdict(eff), "asynchronous": step.asynchronous, "gpus": step.gpus,
        "phases": {name: {"seconds": seconds, "share": step.share(name)} for name, seconds in step.phases.items()},
        "rollout_seconds": step.rollout_seconds, "train_seconds": step.train_seconds,
        "step_seconds": step.seconds, "steps": steps, "gpu_hours": step.gpu_hours(steps),
        "one_off": {name: {"seconds": s, "gpu_hours": s * step.gpus / 3600} for name, s in one_off.items()},
        "notes": step.notes,
    }


def format_step_time(step, one_off: dict[str, float], steps: int, device, eff) -> str:
    """Per phase seconds per step and share, the step's seconds and GPU-hours for ``steps``, the one-off phases."""
    mode = ("async: step = max(rollout, train) + weight sync + save" if step.asynchronous
            else "colocated: step = sum of phases")
    ranks = f"{step.gpus} CPU processes" if device.name == "CPU" else f"{step.gpus} x {device.name}"
    lines = [f"step time on {ranks} ({mode}); factors: mfu_train={eff.mfu_train:.3g} "
             f"mfu_forward={eff.mfu_forward:.3g} decode_bandwidth={eff.decode_bandwidth:.3g} comm={eff.comm:.3g} "
             f"decode_step_overhead={eff.decode_step_overhead * 1000:.2g} ms "
             f"layer_overhead={eff.layer_overhead * 1e6:.3g} us collective_latency={eff.collective_latency * 1e6:.3g} us",
             f"{'phase':<22}{'s/step':>10}{'share':>8}"]
    for name, seconds in step.phases.items():
        lines.append(f"{name:<22}{_figure(seconds):>10}{step.share(name):>8.0%}")
    if step.asynchronous:
        lines.append(f"{'(rollout side)':<22}{_figure(step.rollout_seconds):>10}")
        lines.append(f"{'(train side)':<22}{_figure(step.train_seconds):>10}")
    lines.append(f"{'step':<22}{_figure(step.seconds):>10}")
    unit = "CPU-hours" if device.name == "CPU" else "GPU-hours"  # a CPU run's ranks are processes, not GPUs
    lines.append(f"{steps} steps: {_figure(step.seconds * steps / 3600)} h, {_figure(step.gpu_hours(steps))} {unit}")
    for name, seconds in one_off.items():
        lines.append(f"one-off {name}: {_figure(seconds / 3600)} h, {_figure(seconds * step.gpus / 3600)} {unit} "
                     f"(= {seconds / step.seconds:.1f} steps)")
    lines.extend(f"note: {note}" for note in step.notes)
    lines.append("a model, not a measurement: docs/performance.md 'Step time' gives its validation")
    return "\n".join(lines)


def _figure(value: float) -> str:
    """A figure for the table: one decimal from 10 up (223.1, 11.3), three significant digits under it (0.0417)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"
