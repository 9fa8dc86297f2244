"""Memory of the KL reference model: built as a training engine (the old way) vs the forward-only engine.

Each variant runs in a fresh process (one rank, TP=1, CPU, fp32): import, ``init_distributed``, build the reference
on a 27.8M-parameter Qwen2-shaped random model (hidden 512, 8 layers, GQA 8/4, vocab 8192, tied embeddings), one
``forward_logprobs`` of a 32 x 64 batch. Reported: the tensors the engine holds (parameters and module buffers,
DDP gradient buffers, optimizer state and master copies; shared storage counted once), the peak RSS of the process
(VmHWM) and that peak minus the peak of a process that only imports and initialises (``base``).

    python bench/reference_memory.py

Measured on the project's 2-core CPU machine (torch 2.13 CPU, megatron-core 0.16.1), two runs agreeing to 5 MiB:

    variant          parameters  params+buffers  DDP grad buffers  optimizer state  engine tensors  peak RSS  over base
    base (no model)           -               -                 -                -               -   384 MiB         -
    training engine       27.8M       106.1 MiB         106.1 MiB          0.0 MiB       212.1 MiB   690 MiB  +305 MiB
    forward-only          27.8M       106.1 MiB           0.0 MiB          0.0 MiB       106.1 MiB   578 MiB  +192 MiB

The forward-only reference drops the DDP gradient buffer (one fp32 copy of the model, half of the engine's tensors)
and about 113 MiB of peak RSS, 37 % of what the reference adds to the process. The old reference never took an
optimizer step, so it held no Adam moments. By the same count (not measured here: no GPU), a bf16 model on a GPU
costs the training engine 10 bytes per parameter before its first step (bf16 weights, fp32 gradient buffer, fp32
master copies) and the forward-only engine 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192)
VARIANTS = ("base", "training engine", "forward-only")
MIB = 2**20


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("/proc/self/status has no VmHWM line (Linux only)")


def _tensor_bytes(engine) -> dict[str, float]:
    """Bytes of the tensors an engine holds, by kind; a storage reached twice is counted once."""
    import torch
    from megatron.core.distributed import DistributedDataParallel

    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    stage = engine.stage
    out = {"params_and_buffers": size([*stage.parameters(), *stage.buffers()])}
    model = engine.model  # megatron's DDP keeps its gradient buffers in a list named `buffers`
    ddp_buffers = [*model.buffers, *model.expert_parallel_buffers] if isinstance(model, DistributedDataParallel) else []
    grad_buffers = [tensor for buffer in ddp_buffers for tensor in (buffer.grad_data, buffer.param_data)]
    out["ddp_grad_buffers"] = size(grad_buffers)
    optimizer_tensors = []
    optimizer = getattr(engine, "optimizer", None)
    for sub in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        for state in sub.optimizer.state.values():
            optimizer_tensors += list(state.values())
        for group in getattr(sub, "fp32_from_float16_groups", []):
            optimizer_tensors += list(group)
    out["optimizer_state"] = size(optimizer_tensors)
    out["engine_tensors"] = sum(out.values())
    return {name: value / MIB for name, value in out.items()}


def _measure(variant: str, batch: int, seq: int) -> dict:
    import torch
    from transformers import Qwen2Config

    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine, build_reference_engine
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=0, device="cpu")
    row: dict = {"variant": variant}
    if variant != "base":
        hf = Qwen2Config(max_position_embeddings=seq, tie_word_embeddings=True, **MODEL)
        budget = batch * seq // 4
        if variant == "training engine":
            engine = build_policy_engine(hf, optim=OptimConfig(lr=1e-4), total_steps=1, max_tokens_per_micro_batch=budget)
        else:
            engine = build_reference_engine(hf, max_tokens_per_micro_batch=budget)
        input_ids = torch.randint(0, hf.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        engine.forward_logprobs(dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)))
        row["parameters"] = sum(p.numel() for p in engine.stage.parameters())
        row.update(_tensor_bytes(engine))
    row["peak_rss_mib"] = _vm_hwm_mib()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from dist_utils import run_distributed

    rows = []
    for variant in VARIANTS:
        rows.append(run_distributed(_measure, 1, variant, args.batch, args.seq, timeout=900)[0])
    base = rows[0]["peak_rss_mib"]
    for row in rows:
        row["over_base_mib"] = row["peak_rss_mib"] - base
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)}, results=rows), indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
