"""First stage of the embedded default: write the synthetic task's train/held-out jsonl files and its tokenizer."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from grpo_mega.data.synthetic import Difficulty, make_splits, task_texts, write_jsonl
from grpo_mega.data.tokenizer import check_round_trip, train_tokenizer


@dataclass(frozen=True)
class SyntheticTaskFiles:
    """Where ``build_synthetic_task`` wrote its outputs."""

    train: Path
    """jsonl rows with prompt, answer, steps, solution (the SFT target) and solution_style."""
    heldout: Path
    """jsonl rows of problems whose questions never occur in ``train``."""
    tokenizer: Path
    """HF-format tokenizer folder, loadable with ``AutoTokenizer.from_pretrained``."""


def build_synthetic_task(
    out_dir: str | Path,
    *,
    num_train: int,
    num_heldout: int,
    seed: int,
    difficulty: Difficulty = Difficulty(),
    vocab_size: int = 320,
    direct_answer_fraction: float = 0.0,
) -> SyntheticTaskFiles:
    """Write ``train.jsonl``, ``heldout.jsonl`` and ``tokenizer/`` under ``out_dir``; deterministic in ``seed``.

    ``direct_answer_fraction`` of the training rows (drawn at random, exactly ``round(fraction * num_train)``)
    get a direct SFT target, ``" The answer is N."``, instead of the worked steps, the way real SFT sets mix
    worked solutions with bare answers; held-out rows are always worked. The tokenizer is trained on the
    training texts only (prompt + worked solution), and its round trip is checked on the held-out texts too, so
    evaluation never meets an unknown piece.
    """
    if not 0.0 <= direct_answer_fraction <= 1.0:
        raise ValueError(f"direct_answer_fraction must be in [0, 1], got {direct_answer_fraction}")
    out_dir = Path(out_dir)
    train, heldout = make_splits(num_train, num_heldout, seed=seed, difficulty=difficulty)
    direct = set(random.Random(seed + 1).sample(range(len(train)), round(direct_answer_fraction * len(train))))
    styles = ["direct" if i in direct else "worked" for i in range(len(train))]
    files = SyntheticTaskFiles(
        train=write_jsonl(train, out_dir / "train.jsonl", styles),
        heldout=write_jsonl(heldout, out_dir / "heldout.jsonl"),
        tokenizer=out_dir / "tokenizer",
    )
    tokenizer = train_tokenizer(task_texts(train), files.tokenizer, vocab_size=vocab_size)
    check_round_trip(tokenizer, task_texts(heldout), where=f"tokenizer {files.tokenizer} on held-out texts")
    return files
