"""The synthetic task that needs its tool: multi-digit arithmetic chains (``grpo_mega.data.synthetic``'s problems at
a difficulty a ~1M-parameter policy cannot compute in its head), in two surface forms of the same problem:

- text-only, the worked solution of the other regimes: ``" Step 1: 47 * 86 = 4042. Step 2: ... The answer is N."``;
- a tool demonstration, where each step first calls the ``calculator`` tool and then writes the step with the
  tool's result (hermes format, fallback tool turn, ``grpo_mega.data.tool_format``):

      policy: ' <tool_call>{"name": "calculator", "arguments": {"expression": "47 * 86"}}</tool_call>'
      tool:   '<tool_response>4042</tool_response>'
      policy: ' Step 1: 47 * 86 = 4042. <tool_call>{... "4042 + 55" ...}</tool_call>'
      tool:   '<tool_response>4097</tool_response>'
      policy: ' Step 2: 4042 + 55 = 4097. The answer is 4097.'

A demonstration is a list of segments ``{"text": str, "tool": bool}`` (the jsonl field ``tool_segments``). It is
encoded segment by segment (``encode_segments``), exactly as the multi-turn rollout encodes a trajectory: BPE
merges never cross a turn boundary, so SFT teaches the token sequences the policy produces at rollout time; tool
segments carry loss mask 0. The outcome reward is the synthetic one (``grpo_mega.reward.synthetic``): the first
"The answer is N" of the whole trajectory, tool turns included (a calculator's output is a number, never that
sentence).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from grpo_mega.data.synthetic import Difficulty, Problem, make_splits
from grpo_mega.data.tool_format import fallback_tool_turn_text, hermes_call_text

CALCULATOR = "calculator"
"""The tool the demonstrations call (``grpo_mega.tools``' calculator: argument ``expression``)."""
SEGMENTS_FIELD = "tool_segments"
"""The jsonl field holding a row's tool demonstration."""

TOOL_DIFFICULTY = Difficulty(min_steps=2, max_steps=3, start_range=(10, 99), operand_range=(10, 99),
                             max_value=9999)
"""Two or three operations on two-digit operands with values up to 9999: products of two two-digit numbers and
sums / differences of four-digit ones, which the tiny policy gets wrong in its head but only has to copy with the
calculator (after 1,000 SFT steps: 1.0 % text-only, 88.0 % with the calculator in the turn loop;
bench/results/tool_regime_sft.json)."""


@dataclass(frozen=True)
class Segment:
    """One turn of a trajectory's response: the policy's text (loss) or a tool turn (``tool``: no loss)."""

    text: str
    tool: bool = False

    def to_record(self) -> dict:
        return {"text": self.text, "tool": self.tool}


def calculator_expression(lhs: int, op: str, rhs: int) -> str:
    """The ``expression`` argument of a step's call, e.g. ``"47 * 86"`` (the step's own left-hand side)."""
    return f"{lhs} {op} {rhs}"


def tool_segments(problem: Problem) -> list[Segment]:
    """The tool demonstration of ``problem`` (see the module docstring); its policy segments start with a space so
    that ``prompt + text`` reads naturally, and the tool's output is the exact integer result."""
    segments, before = [], " "
    for number, step in enumerate(problem.steps, start=1):
        call = hermes_call_text(CALCULATOR, {"expression": calculator_expression(step.lhs, step.op, step.rhs)})
        segments.append(Segment(before + call))
        segments.append(Segment(fallback_tool_turn_text(str(step.result)), tool=True))
        before = f" Step {number}: {step.text()}. "
    segments.append(Segment(before + f"The answer is {problem.answer}."))
    return segments


def segments_text(segments: Sequence[Segment | dict]) -> str:
    """The trajectory's response text: the segments' texts concatenated (what a reward function reads)."""
    return "".join(s.text if isinstance(s, Segment) else s["text"] for s in segments)


def check_segments(segments, where: str) -> list[Segment]:
    """``segments`` (a row's field: a list of ``{"text": str, "tool": bool}``) as Segments; ValueError naming
    ``where`` and the bad item otherwise. The first and last segments must be the policy's, texts non-empty."""
    if not isinstance(segments, list) or not segments:
        raise ValueError(f"{where}: expected a non-empty list of {{\"text\", \"tool\"}} segments, got {segments!r:.80}")
    out = []
    for index, item in enumerate(segments):
        if (not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"]
                or not isinstance(item.get("tool", False), bool) or set(item) - {"text", "tool"}):
            raise ValueError(f"{where}: segment {index} must be {{\"text\": non-empty string, \"tool\": bool}}, "
                             f"got {item!r:.80}")
        out.append(Segment(item["text"], item.get("tool", False)))
    if out[0].tool or out[-1].tool:
        raise ValueError(f"{where}: the first and last segments must be the policy's (\"tool\": false)")
    return out


def encode_segments(tokenizer, segments: Sequence[Segment], eos_id: int | None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a response: each segment encoded on its own (``add_special_tokens=False``), ids
    concatenated; mask 1 on the policy's tokens and 0 on tool turns; ``eos_id`` (when not None) appended with mask
    1, the token the policy ends its trajectory with."""
    ids, mask = [], []
    for segment in segments:
        piece = list(tokenizer.encode(segment.text, add_special_tokens=False))
        ids += piece
        mask += [0 if segment.tool else 1] * len(piece)
    if eos_id is not None:
        ids.append(eos_id)
        mask.append(1)
    return ids, mask


def tool_record(problem: Problem) -> dict:
    """The jsonl row of the tool regime: ``Problem.to_record("worked")`` (prompt, answer, steps, ``solution``: the
    text-only SFT target) plus ``tool_segments`` (the tool SFT target)."""
    return {**problem.to_record("worked"), SEGMENTS_FIELD: [s.to_record() for s in tool_segments(problem)]}


def tool_task_texts(problems: Sequence[Problem]) -> list[str]:
    """The tokenizer's corpus: each problem's prompt with its text-only and its tool solution."""
    texts = []
    for problem in problems:
        texts.append(problem.prompt + problem.solution)
        texts.append(problem.prompt + segments_text(tool_segments(problem)))
    return texts


@dataclass(frozen=True)
class ToolTaskFiles:
    """Where ``build_tool_task`` wrote its outputs."""

    train: Path
    heldout: Path
    tokenizer: Path


def build_tool_task(out_dir: str | Path, *, num_train: int, num_heldout: int, seed: int,
                    difficulty: Difficulty = TOOL_DIFFICULTY, vocab_size: int = 400) -> ToolTaskFiles:
    """Write ``train.jsonl`` and ``heldout.jsonl`` (``tool_record`` rows) and ``tokenizer/`` under ``out_dir``;
    deterministic in ``seed``. The tokenizer is trained on both surface forms of the training problems and its
    round trip is checked on both forms of the held-out ones and on every segment alone (each is encoded on its
    own at rollout time)."""
    from grpo_mega.data.tokenizer import check_round_trip, train_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, heldout = make_splits(num_train, num_heldout, seed=seed, difficulty=difficulty)
    files = ToolTaskFiles(train=out_dir / "train.jsonl", heldout=out_dir / "heldout.jsonl",
                          tokenizer=out_dir / "tokenizer")
    for path, problems in ((files.train, train), (files.heldout, heldout)):
        path.write_text("".join(json.dumps(tool_record(problem)) + "\n" for problem in problems), encoding="utf-8")
    tokenizer = train_tokenizer(tool_task_texts(train), files.tokenizer, vocab_size=vocab_size)
    segments = [s.text for problem in heldout[:50] for s in tool_segments(problem)]
    check_round_trip(tokenizer, tool_task_texts(heldout) + segments,
                     where=f"tokenizer {files.tokenizer} on held-out texts of both forms")
    return files
