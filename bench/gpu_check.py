"""The GPU check: the product's GPU path end to end on one device, with one JSON report.

    python bench/gpu_check.py                          # a GPU machine: Qwen2.5-0.5B-shaped policy, bf16, NCCL
    python bench/gpu_check.py --device cpu --size tiny # the same stages on the CPU in about a minute (CI runs it)

What runs, in order (each stage is recorded as ok / failed with its figures, and a failed stage does not hide the
ones after it unless they need its output):

1. ``environment``: torch / CUDA / megatron-core / transformers versions, the device, its measured bf16 (fp32 on the
   CPU) matmul peak.
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
   run's config beside the measured update peak (``memory_against_plan``).
5. ``conversion``: the SFT checkpoint exported to Hugging Face (``tools/convert_mcore_to_hf.py``) and compared with
   the megatron model on the same tokens (``tools/compare_with_hf.py``).

It needs no network: the tokenizer and data are the synthetic task's, the weights random. On a bare GPU machine
bring megatron-core (and omegaconf, math-verify) as wheels; the device README says how. The report goes to
``--out`` (default ``<work>/gpu_check.json``); the exit status is 1 when any stage failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from workload import count_parameters, train_flops  # noqa: E402

# Policy shapes. qwen2.5-0.5b is Qwen2.5-0.5B's published config (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP
# 4864, vocabulary 151,936 rows, tied embeddings) with random weights: its vocabulary is far larger than the
# synthetic task's tokenizer, as a real model's padded embedding is larger than its tokenizer.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-6),
}

# Mean |sampler - trainer| log-prob per token above which the weight sync or a kernel is wrong, not just rounding.
MAX_LOGPROB_DIFF_MEAN = 0.1

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
    figures["matmul_peak_tflops"] = round(matmul_peak_tflops(device), 2)
    figures["datasheet_bf16_tflops"] = next(
        (peak for name, peak in DATASHEET_BF16_TFLOPS.items() if name in figures.get("gpu", "")), None)
    return figures


# ----------------------------------------------------------------------------- 2. distributed + log-probs
def stage_distributed(device: str, shape: dict) -> dict:
    """World size 1 through the trainer's own set-up, an all-reduce, and the LM head's log-probs on the device."""
    import torch
    import torch.distributed as dist

    from lm_head_tf32 import compare_tf32_head

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
        seconds = _timed(device, lambda: logprobs()[0].sum().backward())
        error = float((logp.detach().double() - exact).abs().max())
        # The products of bf16 values are exact in fp32 and only the fp32 accumulation over the hidden size and the
        # vocabulary rounds: 1e-3 is ~100x what that costs at these sizes, and far below a wrong result (~1).
        if not error < 1e-3:
            raise AssertionError(f"vocab-parallel log-probs differ from fp64 log_softmax by {error:.3e} (>= 1e-3)")
        head = compare_tf32_head(device) if device == "cuda" else compare_tf32_head(
            device, tokens=64, hidden_size=32, vocab_size=300, repeats=1)
        # TF32 runs only the products of bf16 operands, which it holds exactly: the two heads differ by the order
        # of fp32 sums (~1e-6 relative); 1e-4 is far below what a rounded operand would cost (~1e-3).
        if not max(head["max_rel_diff"].values()) < 1e-4:
            raise AssertionError(f"the LM head with TF32 products differs from IEEE fp32: {head['max_rel_diff']}")
        return {"lm_head_tf32": head, "backend": backend, "world_size": dist.get_world_size(),
                "logprob_tokens": tokens, "logprob_max_abs_error_vs_fp64": error,
                "logprob_fwd_bwd_seconds": round(seconds, 4),
                "logprob_tflops": round(3 * 2 * tokens * hidden_size * vocab / seconds / 1e12, 2)}
    finally:
        destroy_distributed()


def _timed(device: str, function, repeats: int = 3) -> float:
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


# ----------------------------------------------------------------------------- 3. SFT
def _grpo_mega(args: list[str], log: Path, timeout: float) -> None:
    """``python -m grpo_mega.cli ...`` in a new process (world size 1), its output in ``log``; raises on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench"),
                                                      os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "grpo_mega.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO, timeout=timeout).returncode
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"grpo-mega {args[0]} exited with {code}; last output:\n{tail}")


def _rows(metrics_file: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def stage_sft(work: Path, task: dict, device: str, settings: dict) -> dict:
    run_dir = work / "sft"
    _grpo_mega(["sft", "--config", str(REPO / "configs/quickstart_sft.yaml"), f"model.hf_config={task['model_dir']}",
                f"data.train_file={task['train_file']}", f"trainer.run_dir={run_dir}", f"parallel.device={device}",
                f"trainer.total_steps={settings['sft_steps']}", f"trainer.batch_size={settings['sft_batch']}",
                f"optim.lr={settings['sft_lr']}", f"optim.min_lr={settings['sft_lr'] / 10}",
                f"optim.warmup_steps={max(1, settings['sft_steps'] // 10)}",
                f"parallel.max_tokens_per_micro_batch={settings['micro_tokens']}",
                "trainer.progress_bar=false", "trainer.tensorboard=false"], run_dir.with_suffix(".log"), timeout=1800)
    rows = _rows(run_dir / "metrics.jsonl")
    steps = [row["step"] for row in rows]
    if steps != list(range(1, settings["sft_steps"] + 1)):
        raise AssertionError(f"SFT logged steps {steps}")
    warm = rows[len(rows) // 3:]
    seconds_per_step = (warm[-1]["time"] - warm[0]["time"]) / max(1, len(warm) - 1)
    nll = [row.get("sft/nll") for row in rows]
    tokens = [row.get("perf/num_tokens") for row in rows if row.get("perf/num_tokens")]
    figures = {"steps": len(rows), "nll_first": nll[0], "nll_last": nll[-1], "seconds_per_step": seconds_per_step,
               "checkpoint": str(run_dir)}
    if tokens:
        figures["tokens_per_second"] = sum(tokens[len(rows) // 3:]) / len(warm) / seconds_per_step
    if not (nll[-1] is not None and nll[-1] < nll[0]):
        raise AssertionError(f"SFT did not lower the NLL: {nll[0]} -> {nll[-1]}")
    return figures


# ----------------------------------------------------------------------------- 4. GRPO, interrupted and resumed
def stage_grpo(work: Path, task: dict, device: str, settings: dict, grpo_steps: int, peak_tflops: dict) -> dict:
    run_dir = work / "grpo"
    common = ["--config", str(REPO / "configs/quickstart_grpo.yaml"), f"model.hf_config={task['model_dir']}",
              f"model.init_from={work / 'sft'}", f"data.train_file={task['train_file']}",
              f"data.eval_file={task['heldout_file']}", "data.max_eval_prompts=16", f"trainer.run_dir={run_dir}",
              f"parallel.device={device}", f"algorithm.rollout_batch_size={settings['rollout_batch']}",
              f"algorithm.num_return_sequences_in_group={settings['group']}",
              f"algorithm.response_length={settings['response_length']}", "algorithm.dynamic_sampling=false",
              # bench/workload.py's digit reward: deterministic, with spread inside every group even for a barely
              # trained policy, so every step does a full update with non-zero advantages
              "reward.function=workload:digit_reward",
              f"optim.lr={settings['grpo_lr']}", f"parallel.max_tokens_per_micro_batch={settings['micro_tokens']}",
              "trainer.eval_every=0", "trainer.keep_last=2", "trainer.progress_bar=false", "trainer.tensorboard=false"]
    # The first run stops after grpo_steps - 1 steps (its end saves a checkpoint); the second resumes from it.
    first = grpo_steps - 1
    _grpo_mega(["train", *common, f"trainer.total_steps={first}"], work / "grpo_first.log", timeout=1800)
    _grpo_mega(["train", *common, f"trainer.total_steps={grpo_steps}"], work / "grpo_resumed.log", timeout=1800)
    resumed_log = (work / "grpo_resumed.log").read_text()
    if f"at step {first}" not in resumed_log:
        raise AssertionError(f"the second run did not resume from step {first}:\n{resumed_log[-2000:]}")
    rows = [row for row in _rows(run_dir / "metrics.jsonl") if row["step"] > 0]
    steps = [row["step"] for row in rows]
    if steps != list(range(1, grpo_steps + 1)):
        raise AssertionError(f"GRPO logged steps {steps}, expected 1..{grpo_steps} once each")
    trained_rows = settings["rollout_batch"] * settings["group"]  # dynamic sampling is off: every row is trained
    check_logprob_agreement(rows)
    steps = [_step_figures(row, task, trained_rows, peak_tflops) for row in rows]
    return {"steps": steps, "memory_vs_plan": memory_against_plan(run_dir, device, task, steps[-1])}


def memory_against_plan(run_dir: Path, device: str, task: dict, last_step: dict) -> dict:
    """``grpo-mega plan``'s update phase for the run's own config (one rank, this device's memory) beside the update
    phase the trainer measured (``memory/update/peak_gib``). On a GPU the measured figure is torch's peak allocated
    bytes, which hold what the plan counts less the CUDA context and NCCL (outside torch's allocator), plus the hf
    rollout engine's bf16 copy of the weights (on the GPU all run long; the plan models vLLM, which sleeps); on the
    CPU it is the process's resident memory, which holds the Python and library runtime too, so only the GPU figure
    is a check of the plan."""
    import torch

    from grpo_mega.config import GRPOConfig, load_config
    from grpo_mega.plan import plan_config

    cfg = load_config(GRPOConfig, run_dir / "config.yaml")
    if device == "cuda":
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        import psutil

        memory_gib = psutil.virtual_memory().total / 2**30
    plan = plan_config(cfg, gpus_per_node=1, gpu_memory_gib=memory_gib)
    update = dict(plan.phase("update").items)
    outside_torch = update.pop("CUDA context", 0) + update.pop("NCCL", 0)
    rollout_weights = task["parameters"] * (2 if device == "cuda" else 4)
    planned = (sum(update.values()) + rollout_weights) / 2**30
    figures = {"planned_update_items_gib": {name: value / 2**30 for name, value in update.items()},
               "planned_outside_torch_gib": outside_torch / 2**30, "hf_rollout_weights_gib": rollout_weights / 2**30,
               "planned_update_in_torch_gib": planned, "measured_update_peak_gib": last_step.get("memory/update/peak_gib")}
    if figures["measured_update_peak_gib"]:
        figures["measured_over_planned"] = figures["measured_update_peak_gib"] / planned
    return figures


def check_logprob_agreement(rows: list[dict]) -> None:
    """The sampler's log-probs against the trainer's on the same weights: bf16 kernels differ by ~1e-2 per token on
    average; a stale or wrong weight sync by ~1 (another model). AssertionError naming the step past the bound."""
    for row in rows:
        if not row.get("rollout/logprob_diff_mean", float("inf")) < MAX_LOGPROB_DIFF_MEAN:
            raise AssertionError(f"step {row['step']}: sampler / trainer log-prob difference "
                                 f"{row.get('rollout/logprob_diff_mean')} >= {MAX_LOGPROB_DIFF_MEAN}")


def _step_figures(row: dict, task: dict, trained_rows: int, peak_tflops: dict) -> dict:
    """One GRPO step's figures from its metrics row: throughputs, model FLOP utilisation, memory, timings."""
    figures = {key: value for key, value in row.items()
               if key.startswith(("timing_s/", "memory/", "rollout/logprob_diff", "rollout/probs_diff", "perf/"))}
    figures.update(step=row["step"], loss=row.get("actor/loss"), grad_norm=row.get("actor/grad_norm"))
    response_tokens, generation = row.get("perf/num_response_tokens"), row.get("timing_s/gen")
    if response_tokens and generation:
        figures["generation_tokens_per_second"] = response_tokens / generation
    layer_tokens, update = row.get("perf/layer_tokens"), row.get("timing_s/update")
    if layer_tokens and update:
        figures["update_tokens_per_second"] = layer_tokens / update
        # The update's forward + backward: 6 x matmul parameters per token put through the layers, and causal
        # attention over the average row (prompt + response) length.
        length = int(row.get("perf/num_tokens", layer_tokens) / trained_rows)
        flops = train_flops(task["matmul_parameters"], task["config"], int(layer_tokens), [length] * trained_rows)
        for name, peak in peak_tflops.items():
            if peak:
                figures[f"update_mfu_vs_{name}"] = flops / update / (peak * 1e12)
    return figures


# ----------------------------------------------------------------------------- 5. conversion vs HF logits
def stage_conversion(work: Path, device: str) -> dict:
    """The SFT checkpoint -> HF folder -> megatron checkpoint again, then megatron vs transformers logits."""
    hf_dir, mcore_dir = work / "sft_hf", work / "sft_mcore"
    _tool("convert_mcore_to_hf.py", "--ckpt", str(work / "sft"), "--out", str(hf_dir), "--dtype", "float32")
    _tool("convert_hf_to_mcore.py", "--hf", str(hf_dir), "--out", str(mcore_dir))
    output = _tool("compare_with_hf.py", "--hf", str(hf_dir), "--ckpt", str(mcore_dir), "--seq-len", "64",
                   "--atol", "1e-3")
    return {"compare_output": [line.strip() for line in output.splitlines()
                               if line.startswith(("max |logit", "cosine", "next-token", "PASS"))]}


def _tool(script: str, *args: str) -> str:
    """Run ``tools/<script>``; its output, or RuntimeError with the output's end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / "tools" / script), *args], capture_output=True, text=True,
                          env=env, timeout=1200)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited with {done.returncode}:\n{output[-3000:]}")
    return output


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=sorted(SHAPES), default=None,
                        help="policy shape (default: qwen2.5-0.5b on cuda, tiny on the CPU)")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu_check"), help="folder for the runs (emptied)")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: <work>/gpu_check.json)")
    parser.add_argument("--grpo-steps", type=int, default=3, help="GRPO steps; the last one after a resume (>= 2)")
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT steps (default: 60 on cuda, 6 on the CPU)")
    args = parser.parse_args(argv)
    if args.grpo_steps < 2:
        parser.error("--grpo-steps must be >= 2 (one run, then a resumed one)")
    import shutil

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    shape_name = args.size or ("qwen2.5-0.5b" if args.device == "cuda" else "tiny")
    settings = _settings(args.device)
    if args.sft_steps is not None:
        settings["sft_steps"] = args.sft_steps
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    report = Report(args.out or args.work / "gpu_check.json",
                    {"argv": sys.argv[1:], "shape": shape_name, "settings": settings, "started": time.time()})

    environment = report.run("environment", stage_environment, args.device) or {}
    peaks = {"measured_matmul_peak": environment.get("matmul_peak_tflops"),
             "datasheet_peak": environment.get("datasheet_bf16_tflops")}
    report.run("distributed", stage_distributed, args.device, SHAPES[shape_name])
    task = report.run("task", build_task, args.work, shape_name, settings["max_position"])
    if task is None:
        report.skip("sft", "no task")
    else:
        report.data["meta"].update(parameters=task["parameters"], matmul_parameters=task["matmul_parameters"])
        sft = report.run("sft", stage_sft, args.work, task, args.device, settings)
        if sft is None:
            report.skip("grpo", "no SFT checkpoint")
            report.skip("conversion", "no SFT checkpoint")
        else:
            report.run("grpo", stage_grpo, args.work, task, args.device, settings, args.grpo_steps, peaks)
            report.run("conversion", stage_conversion, args.work, args.device)
    report.data["meta"]["finished"] = time.time()
    report.write()
    print(f"[gpu_check] {'all stages ok' if report.ok else 'FAILED'}; report: {report.path}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
