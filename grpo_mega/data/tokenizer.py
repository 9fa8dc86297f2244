"""A small byte-level BPE tokenizer for the synthetic task, saved in Hugging Face format as a Qwen2 tokenizer.

The tokenizer is trained offline with the ``tokenizers`` library using exactly Qwen2's pipeline: NFC, Qwen2's
pre-tokenization regex (which makes every digit its own pre-token, so numbers are always per-digit) and byte-level
BPE over all 256 bytes (so any text round-trips). Only the vocabulary and merges are learned from the task texts.

Why this and not sentencepiece: transformers 5 rebuilds a tokenizer's pipeline from its class. A folder that also
holds a Qwen2 ``config.json`` (every checkpoint of the policy) is loaded by ``AutoTokenizer`` as
``Qwen2Tokenizer`` whatever ``tokenizer_config.json`` says, and that class hard-codes the byte-level pipeline; a
sentencepiece (Metaspace) tokenizer then silently loses every space. A tokenizer that *is* a Qwen2 tokenizer loads
identically from its own folder, next to a model, and in vLLM. Qwen2 tokenizers add no BOS, and neither does this
one on any loading path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2, 3
_TOKENIZER_CLASS = "Qwen2Tokenizer"
# A probe in the task's alphabet plus what the task never writes (newline, tab, non-ASCII): all must survive.
ROUND_TRIP_PROBE = " Q: Start with 7. Add 15. A: Step 1: 7 + 15 = 22.  Step 2: 22 * 3 = 66 - 0.\n\tThe answer is 66. é"


class TokenizerRoundTripError(ValueError):
    """A tokenizer does not decode its own encoding back to the original text."""


def check_round_trip(tokenizer, texts: Sequence[str], where: str) -> None:
    """Raise TokenizerRoundTripError unless ``decode(encode(t)) == t`` for every text (special tokens excluded).

    Guards against tokenizers that silently lose text: the transformers 5 trap of an empty vocabulary where every
    text encodes to ``[]``, and a tokenizer loaded with another class's pipeline (see the module docstring).
    """
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if text and not ids:
            raise TokenizerRoundTripError(f"{where}: tokenizer encodes {text!r} to no tokens (empty vocabulary?)")
        decoded = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if decoded != text:
            raise TokenizerRoundTripError(
                f"{where}: tokenizer round trip is lossy: {text!r} -> {tokenizer.convert_ids_to_tokens(ids)} "
                f"-> {decoded!r}"
            )


def _train_byte_level_bpe(texts: Sequence[str], vocab_size: int):
    """A ``tokenizers.Tokenizer`` with Qwen2's normalizer, pre-tokenizer and decoder, BPE merges learned on texts."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: nothing is ever unknown
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return backend


def train_tokenizer(texts: Sequence[str], folder: str | Path, vocab_size: int = 320):
    """Train a byte-level BPE tokenizer on ``texts``, save it to ``folder`` (HF format) and return it reloaded.

    The vocabulary is the 256 byte symbols, the special tokens ``<unk>``=0, ``<s>``=1, ``</s>``=2 (EOS),
    ``<pad>``=3, and up to ``vocab_size - 260`` merges (fewer when the texts support fewer). The round trip is
    checked on a probe and on up to 200 of ``texts`` before saving and again after loading.
    """
    from transformers import PreTrainedTokenizerFast

    if not texts:
        raise ValueError("train_tokenizer: no texts to train on")
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"train_tokenizer: vocab_size must be >= {minimum} (256 bytes + special tokens), got {vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_byte_level_bpe(texts, vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        padding_side="left",  # prompts are left-padded for batched generation
    )
    probes = [ROUND_TRIP_PROBE, *texts[:200]]
    check_round_trip(tokenizer, probes, where="train_tokenizer (before save)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    # Declare the class every loader will use anyway (see the module docstring), so all paths agree.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = _TOKENIZER_CLASS
    config_path.write_text(json.dumps(config, indent=2))
    return load_tokenizer(folder, probes=probes)


def has_chat_template(folder: str | Path) -> bool:
    """Whether the tokenizer saved in ``folder`` has a chat template (``chat_template.jinja``, ``chat_template.json``
    or ``tokenizer_config.json``'s ``chat_template``), read from its files without loading it."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            if json.loads((folder / name).read_text()).get("chat_template"):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def load_tokenizer(folder: str | Path, probes: Sequence[str] = (ROUND_TRIP_PROBE,)):
    """``AutoTokenizer.from_pretrained(folder)``, checked to round-trip ``probes`` and to have EOS and PAD tokens.

    A tokenizer without a pad token gets EOS as pad (usual for released LLM tokenizers). Pass task-specific
    ``probes`` for tokenizers that are not byte-level (the default probe has a newline, a tab and an "é").
    """
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"load_tokenizer: tokenizer folder {folder} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"load_tokenizer: tokenizer in {folder} has no eos_token; generation could not stop")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_round_trip(tokenizer, probes, where=f"load_tokenizer({folder})")
    return tokenizer
