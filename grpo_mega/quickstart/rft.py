"""The skeptic's baseline for a learned PRM's arm (issue 57): rejection-sampling fine-tuning (RFT, expert iteration)
before outcome supervision. The policy's own solutions that the PRM's Monte-Carlo labelling already generated and
verified (``prm_labels.jsonl``: each solution's steps and its verifier outcome) are the SFT data: the correct ones,
as they were written. The policy's SFT checkpoint is fine-tuned on them for the seconds the PRM's training took, then
outcome-supervised GRPO runs from there for the arms' steps; the labels' and the fine-tuning's seconds are the arm's
one-off cost, as the PRM's labels and training are the learned-PRM arm's. If that arm keeps up with the learned PRM,
the PRM's worth was its training on the policy's correct samples, not its step credit.

On the tool task (``--regime tools``, issue 76) the labels are turn-split multi-turn rollouts (``prm label --steps
turns``): a correct one is kept with its tool turns, as segments (``turn_segments``: the policy's turns and the
tool's outputs, each decoded from the rollout's own tokens) that ``grpo-mega sft`` trains with
``data.segments_field``, the tool turns context only (mask 0), as the tool SFT trained on the demonstrations. Its
budget is a number of passes over those rollouts (``steps_for_epochs``), not the PRM training's seconds: at the
seconds, the text regimes' RFT ran 98 epochs over its samples and made the policy worse (docs/results.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from grpo_mega.run.metrics import read_metrics

CORRECT_ABOVE = 0.5
"""A verifier outcome above this is a correct solution (``prm.labeling.CORRECT_ABOVE``)."""


def turn_segments(turn_steps: dict, tokenizer) -> list[dict] | None:
    """The SFT segments (``{"text", "tool"}``, ``grpo_mega.data.tool_task``) of a stored turn-split rollout
    (``prm.turn_steps.TurnSteps.to_row``): each step's model tokens a policy segment, the tokens between two steps
    (the tool turn that answered the first) a tool segment, each decoded as a completion's text is; segments that
    decode to nothing (a turn of only the end token) are dropped and neighbours of one kind merged. None when the
    rollout does not end with a policy turn (it stopped on a tool turn: no trajectory the policy finished)."""
    from grpo_mega.rollout.base import decode_response
    from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps

    steps = TurnSteps.from_row(turn_steps, len(turn_steps.get("step_ends") or []))
    if len(steps.response_ids) > steps.step_ends[-1] + 1:  # tokens after the last turn: a tool turn it ended on
        return None
    pieces, previous_end = [], -1
    for start, end in zip(steps.step_starts, steps.step_ends):
        pieces.append((steps.response_ids[previous_end + 1:start], True))
        pieces.append((steps.response_ids[start:end + 1], False))
        previous_end = end
    segments: list[dict] = []
    for ids, tool in pieces:
        text = decode_response(tokenizer, ids)
        if not text:
            continue
        if segments and segments[-1]["tool"] == tool:
            segments[-1]["text"] += text
        else:
            segments.append({"text": text, "tool": tool})
    if not segments or segments[0]["tool"] or segments[-1]["tool"]:
        raise ValueError(f"{TURN_STEPS_FIELD}: a rollout whose first and last decoded segments are not the policy's")
    return segments


def write_rft_data(labels: Path, out: Path, tokenizer=None) -> int:
    """Write the correct solutions of a labels file (stepwise rows with ``prompt``, ``completions`` (the steps) and
    ``outcome``) as SFT rows to ``out``: ``{"prompt", "solution"}``, or for a turn-split rollout (a row with
    ``turn_steps``; ``tokenizer`` is the policy's) ``{"prompt", "tool_segments"}`` (``turn_segments``; a rollout
    that stopped on a tool turn is left out); returns how many. A labels file without a correct solution is an
    error naming it (there is nothing to fine-tune on)."""
    from grpo_mega.data.tool_task import SEGMENTS_FIELD
    from prm.turn_steps import TURN_STEPS_FIELD

    rows = []
    for number, line in enumerate(Path(labels).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "outcome" not in row:
            raise ValueError(f"{labels}:{number}: no 'outcome' field (a Monte-Carlo labels file of grpo-mega prm "
                             "label has one per solution)")
        if float(row["outcome"]) <= CORRECT_ABOVE:
            continue
        if TURN_STEPS_FIELD not in row:
            rows.append({"prompt": row["prompt"], "solution": "".join(row["completions"])})
            continue
        if tokenizer is None:
            raise ValueError(f"{labels}:{number}: a turn-split rollout ({TURN_STEPS_FIELD!r}); its segments are "
                             "decoded with the policy's tokenizer, which the caller did not give")
        try:
            segments = turn_segments(row[TURN_STEPS_FIELD], tokenizer)
        except ValueError as error:
            raise ValueError(f"{labels}:{number}: {error}") from None
        if segments is not None:
            rows.append({"prompt": row["prompt"], SEGMENTS_FIELD: segments})
    if not rows:
        raise ValueError(f"{labels}: no correct solution to fine-tune on")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return len(rows)


def steps_for_seconds(seconds: float, sft_metrics: Path) -> int:
    """The SFT steps that take about ``seconds`` at the pace of the run whose ``metrics.jsonl`` is given (its last
    row's step over its time): RFT gets the PRM training's seconds, at least one step."""
    rows = [row for row in read_metrics(sft_metrics) if row.get("step", 0) > 0 and "time" in row]
    if not rows:
        raise ValueError(f"{sft_metrics}: no timed training steps to take the SFT pace from")
    pace = rows[-1]["step"] / rows[-1]["time"]
    return max(1, round(seconds * pace))


def steps_for_epochs(examples: int, epochs: float, batch_size: int) -> int:
    """SFT steps of ``batch_size`` rows that see ``examples`` rows ``epochs`` times (rounded up, at least one)."""
    if examples < 1 or epochs <= 0 or batch_size < 1:
        raise ValueError(f"steps_for_epochs: examples {examples}, epochs {epochs}, batch size {batch_size}: each must "
                         "be positive")
    return max(1, math.ceil(examples * epochs / batch_size))
