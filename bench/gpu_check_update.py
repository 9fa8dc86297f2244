"""The GPU check's ``update`` stage (``bench/gpu_check.py``, also in ``--quick``): one GRPO update of the Megatron
engine on the check's policy shape, timed and profiled in this process (issue 77, parts 2 and 3).

The batch is the GRPO stage's size and shape (``rollout_batch`` synthetic-task prompts x ``group`` rows, each
response the task's reference solution and EOS: what the SFT policy writes, ~36 tokens), packed as the trainer
packs it (``share_prompt_prefix``, ``parallel.max_tokens_per_micro_batch`` = the check's ``micro_tokens``). Figures:
seconds per ``train_step`` (median of ``REPEATS`` after a warm-up), its model FLOP utilisation over the measured
peak, the micro-batches beside the fewest the budget allows, the optimizer kernel (torch's fused AdamW where
Transformer Engine and apex are absent: ``grpo_mega.engine.fused_adam``), the step-time model's update seconds for
the same work (``Efficiency()`` on a GPU, the CPU's factors on the CPU) beside the measured; one step profiled with
torch.profiler (the top ops by self device time, CPU time on the CPU) and its host reads counted
(``grpo_mega.perf.host_syncs``: where the update waits for the device).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

REPEATS = 2


def grpo_batch(task: dict, rows: int, group: int):
    """``rows`` prompts of the task's training file x ``group``, responses the reference solutions + EOS, with the
    GRPO fields the loss reads (advantages of both signs, sampler log-probs)."""
    import torch

    from grpo_mega.data.batch import sequences_to_batch
    from grpo_mega.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(task["model_dir"])
    lines = Path(task["train_file"]).read_text().splitlines()[:rows]
    prompts, responses = [], []
    for line in lines:
        row = json.loads(line)
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        response = tokenizer.encode(row["solution"], add_special_tokens=False) + [tokenizer.eos_token_id]
        prompts += [prompt] * group
        responses += [response] * group
    batch = sequences_to_batch(prompts, responses, pad_id=tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(0)
    count, width = batch["input_ids"].shape
    mask = batch["loss_mask"].float()
    batch["advantages"] = torch.randn(count, 1, generator=generator).expand(count, width) * mask
    batch["rollout_logprobs"] = -torch.rand(count, width, generator=generator) * 4 * mask
    return batch


def _profile_step(step, device: str, top: int = 15) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as profiler:
        step()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    ranked = sorted(profiler.key_averages(), key=lambda event: getattr(event, key, 0), reverse=True)[:top]
    return [{"op": event.key, "calls": event.count, "self_ms": round(getattr(event, key, 0) / 1000, 3),
             "cpu_ms": round(event.self_cpu_time_total / 1000, 3)} for event in ranked]


def _model_update_seconds(task: dict, device: str, rows: int, group: int, batch, micro_batches: int) -> float:
    """The step-time model's update seconds for this work: one optimizer step over the batch's mean lengths."""
    from grpo_mega.plan.devices import PROFILES, device_profile
    from grpo_mega.plan.step_time import CPU_EFFICIENCY, Efficiency, Lengths, TrainLayout, update_seconds
    from grpo_mega.plan.timing import _model

    profile = PROFILES["CPU"]
    if device == "cuda":
        import torch

        profile = device_profile(torch.cuda.get_device_properties(0).name)
    prompt = float(batch["prompt_lengths"].float().mean())
    response = float(batch["response_lengths"].float().mean())
    lengths = Lengths(prompt=prompt, response_mean=response, response_tail=max(response, 1.0))
    model = _model(task["config"], 2 if device == "cuda" else 4)
    eff = Efficiency() if device == "cuda" else CPU_EFFICIENCY
    return update_seconds(model, lengths, rows * group, TrainLayout(1, 1, 1, 1), profile, eff, epochs=1,
                          optimizer_steps=1, micro_batches=micro_batches, distributed_optimizer=False)


def stage_update(task: dict, device: str, settings: dict, peak_tflops: dict) -> dict:
    import torch
    from transformers import AutoConfig

    from grpo_mega.config import AlgorithmConfig, OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.engine.fused_adam import torch_adam_optimizers
    from grpo_mega.engine.shared_prefix import rank_shared_prefix_micro_batches
    from grpo_mega.parallel import destroy_distributed, init_distributed
    from grpo_mega.perf.host_syncs import HostSyncCounter
    from grpo_mega.stages.update import grpo_loss_fn, loss_settings
    from workload import train_flops

    rows, group = settings["rollout_batch"], settings["group"]
    init_distributed(1, 1, seed=0, device=device)
    try:
        engine = build_policy_engine(
            AutoConfig.from_pretrained(task["model_dir"]), optim=OptimConfig(lr=settings["grpo_lr"]), total_steps=100,
            max_tokens_per_micro_batch=settings["micro_tokens"], share_prompt_prefix=True,
            dtype=torch.bfloat16 if device == "cuda" else None)
        batch = grpo_batch(task, rows, group)
        loss_fn = grpo_loss_fn(loss_settings(AlgorithmConfig(), on_policy=True))

        def step():
            engine.train_step(batch, loss_fn)
            if device == "cuda":
                torch.cuda.synchronize()

        step()  # warm-up: the optimizer's state, the allocator, the kernels' first launches
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        packed, _ = rank_shared_prefix_micro_batches(batch, settings["micro_tokens"], 0, 1)
        layer_tokens = sum(len(micro["packed_source"]) for micro in packed)
        lengths = batch["attention_mask"].sum(1).tolist()
        flops = train_flops(task["matmul_parameters"], task["config"], layer_tokens, lengths)
        figures = {
            "rows": rows * group, "tokens": int(sum(lengths)), "layer_tokens": layer_tokens,
            "micro_batches": len(packed), "fewest_micro_batches": math.ceil(layer_tokens / settings["micro_tokens"]),
            "optimizer_fused": all(group.get("fused") is True for o in torch_adam_optimizers(engine.optimizer)
                                   for group in o.param_groups),
            "train_step_seconds": round(seconds, 4), "tokens_per_s": round(layer_tokens / seconds, 1),
            "model_update_seconds": round(_model_update_seconds(task, device, rows, group, batch, len(packed)), 4)}
        figures["model_over_measured"] = round(figures["model_update_seconds"] / seconds, 3)
        for name, peak in peak_tflops.items():
            if peak:
                figures[f"mfu_vs_{name}"] = round(flops / seconds / (peak * 1e12), 4)
        figures["profile_top_ops"] = _profile_step(step, device)
        with HostSyncCounter() as counter:
            engine.train_step(batch, loss_fn)
        figures["host_syncs"] = {"syncs": counter.syncs, "by_op": dict(counter.by_op)}
        if device == "cuda":
            figures["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
        return figures
    finally:
        destroy_distributed()
