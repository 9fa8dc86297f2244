"""The fixed GRPO benchmark workload shared by our trainer and TRL's: model folder, prompts, reward, FLOP count.

A Qwen2-shaped policy with seeded random weights saved as a Hugging Face folder (config, safetensors, the
synthetic task's tokenizer), so both trainers start from the very same weights; prompts from the synthetic task
(``train.jsonl``); a cheap deterministic reward with spread inside a group (:func:`digit_reward`), so no group
is degenerate and both trainers do the full update. Sizes:

- ``1m``: hidden 128, 4 layers, GQA 4/2, MLP 352 (~0.8M parameters; bench/step_time_cpu.py's smallest size)
- ``3m``: hidden 256, 4 layers, GQA 4/2, MLP 704 (~3.2M parameters, FINDINGS.md's shape)
- ``25m``: hidden 512, 8 layers, GQA 8/4, MLP 1536 (~25M parameters)

The vocabulary is the tokenizer's (~320 pieces), so the LM head is a small part of either model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SIZES = {
    "1m": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2),
    "3m": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2),
    "25m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
}


@dataclass(frozen=True)
class Workload:
    """One built workload: ``model_dir`` (HF folder with weights and tokenizer) and ``train_file`` (jsonl)."""

    size: str
    model_dir: Path
    train_file: Path
    parameters: int
    """All parameters (tied embeddings counted once)."""
    matmul_parameters: int
    """Parameters that take part in a matmul per token: every linear layer plus the LM head (the tied
    embedding counts as the head; the embedding lookup itself is no matmul)."""


def digit_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """Share of the completion's characters that are digits, in [0, 1]: cheap, deterministic, and different
    between the samples of a group even for a random policy."""
    text = completion or ""
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def build_workload(folder: Path, size: str, *, num_prompts: int = 640, seed: int = 0) -> Workload:
    """Write the synthetic task's prompts and tokenizer and a seeded random policy of ``size`` under ``folder``
    (reused when already there)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_mega.data.build import build_synthetic_task
    from grpo_mega.data.tokenizer import load_tokenizer

    if size not in SIZES:
        raise ValueError(f"unknown workload size {size!r}: use one of {sorted(SIZES)}")
    folder = Path(folder)
    data = folder / "data"
    if not (data / "train.jsonl").exists():
        build_synthetic_task(data, num_train=num_prompts, num_heldout=8, seed=seed)
    model_dir = folder / f"model_{size}"
    tokenizer = load_tokenizer(data / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256, tie_word_embeddings=True,
        rope_theta=10000.0, **SIZES[size],
    )
    if not (model_dir / "model.safetensors").exists():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    parameters, matmul = count_parameters(config)
    return Workload(size, model_dir, data / "train.jsonl", parameters, matmul)


def count_parameters(config) -> tuple[int, int]:
    """(all parameters, matmul parameters) of a tied-embedding Qwen2 config."""
    h, f, layers, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    head_dim = h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o weights
    attention_bias = h + 2 * kv  # Qwen2: bias on q, k, v
    mlp = 3 * h * f
    per_layer = attention + attention_bias + mlp + 2 * h  # two RMSNorms
    embedding = v * h
    total = embedding + layers * per_layer + h  # final norm
    matmul = layers * (attention + mlp) + embedding  # the tied LM head multiplies every token
    return total, matmul


def train_flops(matmul_parameters: int, config: dict, tokens: int, sequences: list[int]) -> float:
    """FLOPs of one forward + backward over ``tokens`` tokens: 6 x matmul parameters per token plus attention's
    score and value matmuls (4 x hidden x context per token forward, x3 with the backward), causal (half the
    square) per sequence of the given lengths."""
    attention = sum(3 * 4 * config["hidden_size"] * n * n / 2 for n in sequences) * config["num_hidden_layers"]
    return 6.0 * matmul_parameters * tokens + attention


def load_prompts(train_file: Path, count: int) -> list[str]:
    """The first ``count`` prompts of the task file."""
    prompts = []
    with Path(train_file).open(encoding="utf-8") as rows:
        for line in rows:
            prompts.append(json.loads(line)["prompt"])
            if len(prompts) == count:
                break
    return prompts
