"""The synthetic task's tokenizer: HF-format save/load (alone and next to a Qwen2 config), lossless round trip,
per-digit tokens."""

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from grpo_mega.data.synthetic import Difficulty, make_splits, task_texts
from grpo_mega.data.tokenizer import (
    TokenizerRoundTripError,
    check_round_trip,
    load_tokenizer,
    train_tokenizer,
)

DIFFICULTY = Difficulty(min_steps=1, max_steps=3, max_value=99)


@pytest.fixture(scope="module")
def splits():
    return make_splits(400, 100, seed=0, difficulty=DIFFICULTY)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, splits):
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(task_texts(splits[0]), folder)
    return folder


def test_saved_folder_loads_with_auto_tokenizer_and_round_trips(folder, splits):
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    unseen = task_texts(splits[1]) + ["  Step 12:  907 - 8 = 899.", " -1 * 0 = 0 ", "=+*-", "line\nnext\ttab é 漢"]
    check_round_trip(tokenizer, unseen, where="test")
    for text in unseen:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_special_tokens_and_no_bos(folder):
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2, 3)
    ids = tokenizer.encode("Q: Start with 7. A:")
    # Qwen2 tokenizers add no BOS; this one must not either, on any loading path.
    assert tokenizer.bos_token_id not in ids and tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids) == "Q: Start with 7. A:"
    assert tokenizer.padding_side == "left"


def test_every_digit_is_its_own_token(folder):
    tokenizer = load_tokenizer(folder)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" Step 1: 12 * 3 = 36.", add_special_tokens=False))
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digit_pieces == ["1", "1", "2", "3", "3", "6"]


def test_small_vocabulary_with_whole_word_pieces(folder):
    tokenizer = load_tokenizer(folder)
    assert 260 < len(tokenizer) <= 320
    assert {"\u0120Step", "\u0120answer", "\u0120Multiply"} <= set(tokenizer.get_vocab())  # \u0120 is a space


def test_loads_identically_next_to_a_qwen2_model_config(folder, splits, tmp_path):
    # transformers 5 loads any tokenizer next to a Qwen2 config.json as Qwen2Tokenizer; ours must survive that,
    # including a re-save from the loaded copy (what checkpoint export does).
    from transformers import Qwen2Config

    alone = load_tokenizer(folder)
    checkpoint = tmp_path / "checkpoint"
    Qwen2Config(vocab_size=len(alone)).save_pretrained(str(checkpoint))
    alone.save_pretrained(str(checkpoint))
    beside_model = load_tokenizer(checkpoint)
    assert type(beside_model).__name__ == "Qwen2Tokenizer"
    for text in task_texts(splits[1][:50]):
        assert beside_model.encode(text) == alone.encode(text)


def test_lossy_tokenizer_is_caught():
    # A word-level tokenizer drops repeated spaces: the round trip must fail loudly.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    lossy = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    check_round_trip(lossy, ["a b"], where="test")
    with pytest.raises(TokenizerRoundTripError, match="lossy"):
        check_round_trip(lossy, ["a  b"], where="test")


def test_empty_vocabulary_tokenizer_is_rejected(tmp_path):
    # The transformers 5 trap: a tokenizer that silently encodes everything to [].
    from tokenizers import Tokenizer, models

    empty = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="</s>")
    assert empty.encode("Step 1", add_special_tokens=False) == []
    with pytest.raises(TokenizerRoundTripError, match="no tokens"):
        check_round_trip(empty, ["Step 1"], where="test")
    empty.save_pretrained(str(tmp_path))
    with pytest.raises(TokenizerRoundTripError, match=str(tmp_path)):
        load_tokenizer(tmp_path)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_tokenizer(["Step 1: 1 + 1 = 2."], tmp_path / "small", vocab_size=200)
