"""A random-weight stand-in for a real small chat model (SmolLM2-135M-Instruct's shape) and GSM8K-format data.

The shape is the one a user brings from disk: Llama architecture, hidden 576, 9 attention heads and 3 KV heads
(head_dim 64), MLP 1536, tied embeddings, a 49,152-row vocabulary, 30 layers (``layers`` cuts the depth for the
multi-process runs; the widths stay), and a ChatML chat template that writes a default system prompt.

The tokenizer is a real byte-level BPE (the kind SmolLM2 ships) trained here on the data's own text, ~700 tokens,
while the model's embedding has 49,152 rows: training a 49k BPE needs a corpus many times the size of anything a
test should write, and what the vocabulary size changes (embedding / output shards over TP, vocab padding, the
width of the logits, sampling over rows no tokenizer piece maps to) depends on the model's ``vocab_size``, not on
the tokenizer's. Real models are like that too (Qwen2.5: 151,936 rows, 151,665 tokens).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-Instruct's template: ChatML, with a default system turn when the conversation has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 49152
FULL_LAYERS = 30
WEIGHT_STD = {"model.embed_tokens.weight": 0.15}
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
ITEMS = ["clips", "apples", "books", "pages", "cookies", "marbles", "stickers", "pencils"]


def llama_config(layers: int = FULL_LAYERS):
    """The HF config of the stand-in (SmolLM2-135M's numbers)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=2, architectures=["LlamaForCausalLM"],
    )


def gsm8k_rows(count: int, seed: int = 0) -> list[dict]:
    """GSM8K-format rows: ``question`` and an ``answer`` of worked lines ending ``#### N`` (the real schema)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 30)
        first, total = a * b, a * b + c
        question = (f"{name} has {b} boxes of {item} with {a} {item} in each box. {name} buys {c} more {item}. "
                    f"How many {item} does {name} have now?")
        answer = (f"{name} has {b} * {a} = <<{b}*{a}={first}>>{first} {item} in boxes.\n"
                  f"Adding the new ones gives {first} + {c} = <<{first}+{c}={total}>>{total} {item}.\n#### {total}")
        rows.append({"question": question, "answer": answer})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build_tokenizer(texts: list[str], folder: Path):
    """A byte-level BPE with SmolLM2's special tokens and chat template, trained on ``texts``; saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    sample = texts[0]
    assert tokenizer.decode(tokenizer(sample).input_ids) == sample  # FINDINGS: always check the round trip
    return tokenizer


def tokenizer_texts(rows: list[dict]) -> list[str]:
    return [row["question"] + "\n" + row["answer"] for row in rows] + [SYSTEM_PROMPT, "user assistant system"]


def build_small_chat_model(folder: Path, *, layers: int = FULL_LAYERS, seed: int = 0, data_rows: int = 64,
                           data_file: Path | None = None) -> Path:
    """Write a random-weight HF model of the stand-in's shape (``layers`` deep) and its tokenizer in ``folder``, and
    ``data_rows`` GSM8K-format rows in ``data_file`` (default ``folder/../gsm8k.jsonl``); returns ``folder``.

    Weights are normal, std 0.05 (the embedding 0.15; 0.001 on the rows past the tokenizer's), norms 1 + N(0, 0.1^2):
    logits reach ~20 as a trained model's do (HF's init, std 0.02, gives ~2, where fp32 rounding is 100x smaller than in a real model), and a
    norm swapped or dropped in a conversion changes them."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    rows = gsm8k_rows(data_rows, seed)
    write_jsonl(rows, data_file or folder.parent / "gsm8k.jsonl")
    tokenizer = build_tokenizer(tokenizer_texts(rows), folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(layers)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, WEIGHT_STD.get(name, 0.05))
        # rows no token maps to are never trained in a real model: near zero, they are rarely sampled
        model.get_input_embeddings().weight[len(tokenizer):].normal_(0.0, 0.001)
    model.save_pretrained(folder)
    return folder
