"""The GRPO update's fixed costs (issue 77, part 2), measured on this CPU where they can be:

1. ``micro_batches``: how many micro-batches the gpu_check GRPO step (bench/gpu_check.py on a GPU: 32 synthetic-task
   prompts x 8, ``parallel.max_tokens_per_micro_batch`` 8192, ``share_prompt_prefix`` on) runs, against the fewest
   any packing could (``ceil(packed tokens / budget)``), for the packed micro-batches and the row ones, at three
   budgets. The responses are the task's reference solutions (what the SFT policy of the H200 run wrote: 35.3
   response tokens per row measured there, 36 here).
2. ``optimizer``: one AdamW step over real parameter sets with torch's foreach kernels (what megatron-core builds
   without Transformer Engine / apex) and with the fused kernel (``grpo_mega.engine.fused_adam``), median seconds.
   ``engine_update``: whole ``train_step`` seconds of the quickstart policy's shape (``workload`` size 1m) on a
   GRPO batch of the quickstart's size (32 x 8 rows, 16 + 48 tokens), foreach and fused, their steps interleaved,
   median wall and CPU seconds of ``--steps`` / 2.
3. ``logprob_pass``: whether the log-prob pass is fused with the loss (a statement read from the code, no figure).

    python bench/update_fixed_costs.py            # ~1 min; writes bench/results/update_fixed_costs.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BUDGETS = (4096, 8192, 16384)
H200_MEASURED = {"perf/layer_tokens": [9601, 9593, 9626], "perf/num_tokens": [13598, 13569, 13567],
                 "perf/num_response_tokens": [9030, 9025, 9063], "perf/padding_fraction": 0.0,
                 "timing_s/update": [1.331, 0.987, 1.305]}
"""bench/results/gpu_check_h200.json's three GRPO steps (32 x 8 rows, budget 8192, share_prompt_prefix on)."""


def gpu_check_batch(prompts: int = 32, group: int = 8):
    """A batch shaped like the gpu_check GRPO step: the synthetic task's first ``prompts`` prompts (the gpu_check
    task: 2,000 training rows, seed 0), ``group`` rows each, responses the task's reference solution + EOS."""
    from grpo_mega.data.batch import sequences_to_batch
    from grpo_mega.data.build import build_synthetic_task
    from grpo_mega.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        files = build_synthetic_task(Path(folder), num_train=2000, num_heldout=16, seed=0)
        tokenizer = load_tokenizer(files.tokenizer)
        rows = [json.loads(line) for line in files.train.read_text().splitlines()[:prompts]]
    prompt_ids, response_ids = [], []
    for row in rows:
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        response = tokenizer.encode(row["solution"], add_special_tokens=False) + [tokenizer.eos_token_id]
        for _ in range(group):
            prompt_ids.append(prompt)
            response_ids.append(response)
    return sequences_to_batch(prompt_ids, response_ids, pad_id=tokenizer.pad_token_id)


def micro_batch_counts(batch) -> dict:
    """Micro-batches of one rank (DP 1) with and without shared prompts, beside the fewest possible."""
    from grpo_mega.engine.batching import rank_micro_batches
    from grpo_mega.engine.shared_prefix import rank_shared_prefix_micro_batches

    lengths = batch["attention_mask"].sum(1)
    figures = {"rows": len(lengths), "tokens": int(lengths.sum()),
               "response_tokens": int(batch["response_lengths"].sum()), "budgets": {}}
    for budget in BUDGETS:
        packed, _ = rank_shared_prefix_micro_batches(batch, budget, 0, 1)
        packed_tokens = sum(len(m["packed_source"]) for m in packed)
        rows, padding = rank_micro_batches(batch, budget, 0, 1)
        figures["budgets"][budget] = {
            "packed": {"micro_batches": len(packed), "fewest_possible": math.ceil(packed_tokens / budget),
                       "layer_tokens": packed_tokens},
            "rows": {"micro_batches": len(rows), "fewest_possible": math.ceil(int(lengths.sum()) / budget),
                     "padding_fraction": round(padding, 4),
                     "layer_tokens": sum(m["input_ids"].numel() for m in rows)}}
    return figures


def _parameter_sets() -> dict:
    """name -> list of fp32 parameter shapes: the quickstart policy (all of it) and two layers of the
    Qwen2.5-0.5B shape (no embedding: 151,936 x 896 rows would dominate and do not fit the CPU's time)."""
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    quickstart = Qwen2ForCausalLM(AutoConfig.from_pretrained(ROOT / "configs/models/quickstart-policy"))
    layers = Qwen2ForCausalLM(Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                                          num_attention_heads=14, num_key_value_heads=2, vocab_size=16))
    return {"quickstart_policy": [p.shape for p in quickstart.parameters()],
            "qwen2.5-0.5b_two_layers": [p.shape for n, p in layers.named_parameters() if "embed" not in n]}


def optimizer_seconds(shapes, fused: bool, steps: int) -> float:
    """Median seconds of one AdamW step (lr 1e-5, weight decay 0.01) over fp32 parameters of ``shapes``."""
    import torch

    from grpo_mega.engine.fused_adam import use_fused_adam

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01)
    if fused:
        use_fused_adam(optimizer)
    optimizer.step()  # state allocated
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _engine(fused: bool):
    """The quickstart policy's shape (``workload`` size 1m) on the Megatron engine, with megatron-core's foreach
    AdamW (``fused=False``) or the engine's fused switch."""
    from transformers import Qwen2Config

    import grpo_mega.engine.megatron_engine as megatron_engine
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from workload import SIZES

    switch = megatron_engine.fused_adam_for_device
    if not fused:
        megatron_engine.fused_adam_for_device = lambda optimizer, device: None
    try:
        hf = Qwen2Config(vocab_size=320, max_position_embeddings=256, tie_word_embeddings=True, **SIZES["1m"])
        return build_policy_engine(hf, optim=OptimConfig(lr=1e-5), total_steps=100, max_tokens_per_micro_batch=4096)
    finally:
        megatron_engine.fused_adam_for_device = switch


def engine_update_seconds(steps: int, rows: int = 256, prompt: int = 16, response: int = 48) -> dict:
    """One GRPO ``train_step`` of the Megatron engine (world size 1, the CPU), foreach and fused AdamW, the two
    engines' steps interleaved so that the machine's load falls on both alike: median wall and CPU seconds (this
    process's CPU time: what another tenant's load moves least)."""
    import torch

    from grpo_mega.config import AlgorithmConfig
    from grpo_mega.stages.update import grpo_loss_fn, loss_settings

    engines = {"foreach": _engine(False), "fused": _engine(True)}
    length = prompt + response
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 320, (rows, length), generator=generator)
    loss_mask = torch.zeros(rows, length, dtype=torch.long)
    loss_mask[:, prompt:] = 1
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask,
                 advantages=torch.randn(rows, length, generator=generator) * loss_mask,
                 rollout_logprobs=torch.full((rows, length), -5.0) * loss_mask,
                 response_lengths=torch.full((rows,), response))
    loss_fn = grpo_loss_fn(loss_settings(AlgorithmConfig(), on_policy=True))
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        engine.train_step(batch, loss_fn)  # warm-up
    for _ in range(steps):
        for name, engine in engines.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.train_step(batch, loss_fn)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
    return {f"{name}_{kind}_s": round(statistics.median(values[name]), 4)
            for kind, values in (("wall", wall), ("cpu", cpu)) for name in engines}


LOGPROB_PASS = (
    "already fused: the training forward's last stage computes the log-probs (and entropies) of the loss_mask "
    "tokens only, chunk by chunk without materialising the logits (grpo_mega.model.logprobs: the backward "
    "recomputes each chunk), and the loss reads them in the same micro-batch (MegatronEngine.train_step's "
    "loss_func_for); with one epoch and one mini-batch (the gpu_check config) no separate old-log-prob pass runs "
    "(the loss takes the current log-probs, detached, as the old ones: timing_s/old_logprob absent from the H200 "
    "rows). A separate pass runs only when the policy moves within a step (ppo_epochs > 1 or mini-batches), "
    "where it must: the old log-probs are those of the weights before the first optimizer step.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps timed per set and kernel")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/update_fixed_costs.json")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = {"what": "the GRPO update's fixed costs on this CPU (issue 77, part 2)",
              "command": "python bench/update_fixed_costs.py" + (f" --threads {args.threads}" if args.threads != 1
                                                                 else ""),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average": round(os.getloadavg()[0], 2), "torch": torch.__version__}
    result["micro_batches"] = micro_batch_counts(gpu_check_batch())
    result["micro_batches"]["h200_measured"] = H200_MEASURED
    optimizer = {}
    for name, shapes in _parameter_sets().items():
        foreach = optimizer_seconds(shapes, fused=False, steps=args.steps)
        fused = optimizer_seconds(shapes, fused=True, steps=args.steps)
        optimizer[name] = {"parameters": sum(math.prod(s) for s in shapes), "tensors": len(shapes),
                           "foreach_s": round(foreach, 6), "fused_s": round(fused, 6),
                           "fused_over_foreach": round(fused / foreach, 3)}
    result["optimizer"] = optimizer
    from grpo_mega.parallel import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0, device="cpu")
    try:
        engine_steps = max(3, args.steps // 2)
        result["engine_update"] = {"shape": "workload 1m (the quickstart policy's size), 256 rows x 64 tokens",
                                   "steps": engine_steps, **engine_update_seconds(engine_steps)}
    finally:
        destroy_distributed()
    result["logprob_pass"] = LOGPROB_PASS
    result["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
