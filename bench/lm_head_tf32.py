"""The LM head's fp32 logits (``model.logits_in_fp32``) of a bf16 model with and without TF32 for its logit
products (``grpo_mega.model.tf32``): equality and speed, meant for a GPU.

``compare_tf32_head`` runs ``grpo_mega.model.vocab_parallel_logprobs_and_entropy`` on random bf16 hidden states and
output matrix (Qwen2.5-Math-7B's hidden size and padded vocabulary by default) twice: as shipped (TF32 for the
products of upcast bf16 operands) and with that scope turned off (every product IEEE fp32, the head before TF32).
It reports, for the forward (old-policy / reference passes) and forward + backward (the update), the best time of
``repeats`` calls each, and how far the two heads' log-probs, entropies and gradients are apart, next to their
distance from an fp64 computation on the first ``reference_tokens`` tokens. Equal products summed in fp32 in
another order: the differences should be at the fp32 rounding level (~1e-6 relative), far below the bf16 head's.
On the CPU the flag changes nothing (the figures are equal) and the sizes should be small (``--device cpu``).

    python bench/lm_head_tf32.py                   # CUDA, 4096 tokens, hidden 3584, vocab 152064
    python bench/lm_head_tf32.py --device cpu --tokens 64 --hidden 32 --vocab 300
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@contextlib.contextmanager
def _without_tf32_scope():
    """The head with every product in IEEE fp32 (its behaviour before the TF32 scope)."""
    import grpo_mega.model.logprobs as logprobs

    real = logprobs.tf32_if_exact
    logprobs.tf32_if_exact = lambda *dtypes: contextlib.nullcontext()
    try:
        yield
    finally:
        logprobs.tf32_if_exact = real


def _max_rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _share_differing(a, b) -> float:
    return float((a != b).float().mean()) if a.numel() else 0.0


def relative_error(value, reference) -> float:
    """||value - reference|| / ||reference||, in fp64."""
    reference = reference.double()
    return float((value.double() - reference).norm() / reference.norm().clamp_min(1e-300))


FP32_REL_LIMIT = 1e-4
"""Largest difference between the two heads' fp32 log-probs and entropies, relative to the largest magnitude."""

GRADIENT_ERROR_RATIO = 1.02
"""Most the shipped head's gradient error against fp64 may exceed the IEEE head's (``heads_agree``)."""


def heads_agree(report: dict) -> str | None:
    """None when ``compare_tf32_head``'s shipped (TF32) head is as accurate as the IEEE one; else what is not.

    The log-probs and entropies are fp32: the heads may differ only by the order of fp32 sums, so they stay within
    ``FP32_REL_LIMIT`` of each other. The gradients come back in bf16, where a sum-order difference before the cast
    moves an element by one bf16 unit whenever it lies near a rounding boundary: the two heads' gradients differ
    element by element (the first H200 run: up to 3.5e-3 of the largest element, 1.07 % of grad_weight's elements)
    and that says nothing about which is right. So each head's gradients are judged against fp64 gradients of the
    same operands (``grad_error_vs_fp64``, dominated by the bf16 cast, ~1e-3): the shipped head's error may exceed
    the IEEE head's by ``GRADIENT_ERROR_RATIO`` at most. Simulated at 64 tokens x 64 x 4,096 (tests/test_model_tf32.py):
    sum order alone leaves the error unchanged (ratio 1.0000) while 0.02 % of grad_weight's elements differ; dL/dz
    rounded to bf16 before its products raises it by 4.7 % (grad_hidden) and 7.1 % (grad_weight). A TF32 rounding of
    dL/dz, which the IEEE backward products avoid, adds about 2 %, at the limit: the placement of TF32 is checked
    where it happens, by tests/test_model_tf32.py's record of every product.
    """
    problems = [f"{field} max relative difference {report['max_rel_diff'][field]:.2e} >= {FP32_REL_LIMIT:.0e}"
                for field in ("logprobs", "entropy") if not report["max_rel_diff"][field] < FP32_REL_LIMIT]
    errors = report["grad_error_vs_fp64"]
    problems += [f"{field} error against fp64 {errors['tf32'][field]:.3e} > {GRADIENT_ERROR_RATIO} x the IEEE "
                 f"head's {errors['ieee'][field]:.3e}" for field in ("grad_hidden", "grad_weight")
                 if not errors["tf32"][field] <= GRADIENT_ERROR_RATIO * errors["ieee"][field] + 1e-12]
    return "; ".join(problems) or None


def fp64_head(hidden, weight, labels, chunk_size: int):
    """(log p(label), dL/dh, dL/dW) in fp64, with L = sum log p(label) + 0.1 sum entropy, the loss
    ``compare_tf32_head`` trains on, ``chunk_size`` tokens at a time."""
    import torch

    weight64 = weight.detach().double().requires_grad_(True)
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float64, device=hidden.device)
    logprobs = torch.empty(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    for begin in range(0, hidden.shape[0], chunk_size):
        chunk = hidden[begin:begin + chunk_size].detach().double().requires_grad_(True)
        log_p = torch.log_softmax(chunk @ weight64.t(), dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        picked = log_p.gather(-1, labels[begin:begin + chunk_size, None])
        (picked.sum() + 0.1 * entropy.sum()).backward()
        grad_hidden[begin:begin + chunk_size] = chunk.grad
        logprobs[begin:begin + chunk_size] = picked.detach()[:, 0]
        del log_p, entropy, picked
    return logprobs, grad_hidden, weight64.grad


def compare_tf32_head(device: str = "cuda", *, tokens: int = 4096, hidden_size: int = 3584,
                      vocab_size: int = 152064, chunk_size: int = 1024, repeats: int = 5,
                      reference_tokens: int = 256, tp_group=None, seed: int = 0) -> dict:
    """Equality and speed of the bf16 LM head with and without TF32 for its logit products (module docstring).

    Needs torch.distributed initialised (``tp_group`` None: megatron's tensor-parallel group; one process at
    TP=1 is what the figures mean). Returns a JSON-ready dict: ``seconds`` {"forward", "train"} x {"tf32",
    "ieee"} (best of ``repeats``), ``speedup`` (ieee / tf32), ``max_rel_diff`` between the two heads (logprobs,
    entropy, grad_hidden, grad_weight, relative to the largest magnitude), ``share_differing`` (the share of elements
    that are not equal), ``grad_error_vs_fp64`` (each head's gradients against fp64 ones, norm-relative;
    ``heads_agree`` judges these and the fp32 outputs), ``max_abs_err_vs_fp64`` of each head's
    log-probs on the first ``reference_tokens`` tokens, and ``fp32_precision_after`` (torch's setting after the
    calls: the scope restores it).
    """
    import torch

    from grpo_mega.model.logprobs import vocab_parallel_logprobs_and_entropy

    dev = torch.device(device)
    generator = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device=dev, generator=generator).bfloat16()
    # Logits with a trained model's spread (std ~ 3), not a near-uniform softmax that would hide errors.
    weight = (torch.randn(vocab_size, hidden_size, device=dev, generator=generator) * 3 / hidden_size**0.5).bfloat16()
    labels = torch.randint(0, vocab_size, (tokens,), device=dev, generator=generator)

    def call(train: bool):
        h = hidden.detach().requires_grad_(train)
        w = weight.detach().requires_grad_(train)
        with torch.set_grad_enabled(train):
            logp, entropy = vocab_parallel_logprobs_and_entropy(h, w, labels, vocab_size=vocab_size,
                                                                chunk_size=chunk_size, tp_group=tp_group)
            if train:
                (logp.sum() + 0.1 * entropy.sum()).backward()
        return logp.detach(), entropy.detach(), h.grad, w.grad

    def best_time(train: bool) -> float:
        call(train)  # warm-up
        times = []
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            call(train)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
        return min(times)

    seconds: dict = {"forward": {}, "train": {}}
    outputs = {}
    for name, scope in (("tf32", contextlib.nullcontext), ("ieee", _without_tf32_scope)):
        with scope():
            for mode in ("forward", "train"):
                seconds[mode][name] = round(best_time(mode == "train"), 5)
            outputs[name] = call(True)
    n = min(reference_tokens, tokens)
    exact_logprobs, *exact_grads = fp64_head(hidden, weight, labels, chunk_size)
    reference = exact_logprobs[:n]
    fields = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"tokens": tokens, "hidden": hidden_size, "vocab": vocab_size, "chunk": chunk_size},
        "seconds": seconds,
        "speedup": {mode: round(seconds[mode]["ieee"] / seconds[mode]["tf32"], 3) for mode in seconds},
        "max_rel_diff": {field: _max_rel(a, b) for field, a, b in zip(fields, outputs["tf32"], outputs["ieee"])},
        "share_differing": {field: _share_differing(a, b)
                            for field, a, b in zip(fields, outputs["tf32"], outputs["ieee"])},
        "grad_error_vs_fp64": {name: {field: relative_error(out[index], exact)
                                      for index, field, exact in ((2, "grad_hidden", exact_grads[0]),
                                                                  (3, "grad_weight", exact_grads[1]))}
                               for name, out in outputs.items()},
        "max_abs_err_vs_fp64": {name: float((out[0][:n].double() - reference).abs().max())
                                for name, out in outputs.items()},
        "fp32_precision_after": str(torch.backends.cuda.matmul.fp32_precision),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=0, device=args.device)
    print(json.dumps(compare_tf32_head(args.device, tokens=args.tokens, hidden_size=args.hidden,
                                       vocab_size=args.vocab, chunk_size=args.chunk, repeats=args.repeats),
                     indent=2))


if __name__ == "__main__":
    main()
