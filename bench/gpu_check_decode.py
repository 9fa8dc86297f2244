"""The GPU check's ``decode`` stage (``bench/gpu_check.py``): the hf engine's decode loop on the check's policy shape,
timed and profiled in this process.

A generate call of the GRPO stage's size (``rollout_batch`` prompts of the synthetic task x ``group``, up to
``response_length`` tokens; random weights never emit EOS, so every row runs every step) is timed three ways: as the
engine runs it (a host read every ``SYNC_EVERY_CUDA`` steps on CUDA), with a host read every step (what the loop did
before issue 77: the cost of the syncs), and with top-p 0.95 (the sort-free nucleus's cost). Figures: milliseconds per
decode step (the call's seconds over its steps, prefill included) and generated tokens/s, median of ``REPEATS`` after
a warm-up; one call profiled with torch.profiler (the top ops by device time, CPU time on the CPU); the host syncs of
one call counted (``grpo_mega.perf.host_syncs``); the issue-77 floor (<= 15 ms per step eager, GPU only) beside the
measured figure. A figure past its floor is recorded, not raised: the stage fails only when the loop does.
"""

from __future__ import annotations

import functools
import statistics
import time

REPEATS = 2
FLOOR_MS_PER_STEP_EAGER = 15.0
"""Issue 77's floor for the gpu_check GRPO config's decode on one H100 / H200 (eager, no CUDA graphs)."""


def _prompt_ids(task: dict, count: int) -> list[list[int]]:
    import json
    from pathlib import Path

    from grpo_mega.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(task["model_dir"])
    lines = Path(task["train_file"]).read_text().splitlines()[:count]
    return [tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=False) for line in lines]


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def stage_decode(task: dict, device: str, settings: dict) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.perf.host_syncs import HostSyncCounter
    from grpo_mega.rollout import SamplingConfig, hf_engine
    from grpo_mega.rollout.hf_decode import decode
    from grpo_mega.rollout.hf_engine import HFRolloutEngine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(task["model_dir"]), dtype=dtype).to(device)
    prompts = _prompt_ids(task, settings["rollout_batch"])
    engine = HFRolloutEngine(model, task["model_dir"], generation_batch_size=len(prompts))
    new_tokens, rows = settings["response_length"], len(prompts) * settings["group"]

    def call(sync_every: int | None = None, top_p: float = 1.0, max_new_tokens: int = new_tokens):
        """Seconds of one generate call; generated tokens."""
        sampling = SamplingConfig(temperature=1.0, top_p=top_p, n=settings["group"], max_new_tokens=max_new_tokens,
                                  seed=1)
        original = hf_engine.decode
        if sync_every is not None:
            hf_engine.decode = functools.partial(decode, sync_every=sync_every)
        try:
            _synchronize(device)
            start = time.perf_counter()
            completions = engine.generate(prompts, sampling)
            _synchronize(device)
            return time.perf_counter() - start, sum(len(c.response_ids) for c in completions)
        finally:
            hf_engine.decode = original

    variants = {"engine": {}, "host_read_every_step": {"sync_every": 1}, "top_p_0.95": {"top_p": 0.95}}
    figures: dict = {"rows": rows, "max_new_tokens": new_tokens, "dtype": str(dtype).removeprefix("torch."),
                     "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts)}
    for name, options in variants.items():
        call(**options)  # warm-up: allocator, kernels' first launches
        runs = [call(**options) for _ in range(REPEATS)]
        seconds = statistics.median(s for s, _ in runs)
        generated = statistics.median(t for _, t in runs)
        steps = generated / rows  # every row runs to the limit (no EOS from random weights) or the same mean
        figures[name] = {"seconds": round(seconds, 4), "ms_per_step": round(1000 * seconds / max(steps, 1), 3),
                         "generated_tokens": generated, "tokens_per_s": round(generated / seconds, 1)}
    figures["sync_cost_ms_per_step"] = round(
        figures["host_read_every_step"]["ms_per_step"] - figures["engine"]["ms_per_step"], 3)
    figures["profile_top_ops"] = _profile(call, device)
    figures["host_syncs"] = _count_syncs(call, HostSyncCounter, max_new_tokens=min(32, new_tokens))
    if device == "cuda":
        figures["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        measured = figures["engine"]["ms_per_step"]
        figures["floor"] = {"ms_per_step_eager": FLOOR_MS_PER_STEP_EAGER, "measured": measured,
                            "met": measured <= FLOOR_MS_PER_STEP_EAGER}
    del engine, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return figures


def _profile(call, device: str, top: int = 15) -> list[dict]:
    """The ``top`` ops of one generate call by self device time (self CPU time on the CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as profiler:
        call()
    events = profiler.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    ranked = sorted(events, key=lambda event: getattr(event, key, 0), reverse=True)[:top]
    return [{"op": event.key, "calls": event.count, "self_ms": round(getattr(event, key, 0) / 1000, 3),
             "cpu_ms": round(event.self_cpu_time_total / 1000, 3)} for event in ranked]


def _count_syncs(call, counter_class, max_new_tokens: int) -> dict:
    """Host reads of one generate call as the engine runs it (``inference_mode`` replaced by ``no_grad``, under
    which dispatch modes see ``item`` and copies to the host)."""
    import torch

    inference_mode = torch.inference_mode
    torch.inference_mode = torch.no_grad
    try:
        with counter_class() as counter:
            call(max_new_tokens=max_new_tokens)
    finally:
        torch.inference_mode = inference_mode
    return {"decode_steps": max_new_tokens, "syncs": counter.syncs, "by_op": dict(counter.by_op),
            "vocabulary_sorts": [list(entry) for entry in counter.sorts]}
