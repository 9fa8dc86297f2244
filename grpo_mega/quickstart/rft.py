"""The skeptic's baseline for a learned PRM's arm (issue 57): rejection-sampling fine-tuning (RFT, expert iteration)
before outcome supervision. The policy's own solutions that the PRM's Monte-Carlo labelling already generated and
verified (``prm_labels.jsonl``: each solution's steps and its verifier outcome) are the SFT data: the correct ones,
as they were written. The policy's SFT checkpoint is fine-tuned on them for the seconds the PRM's training took, then
outcome-supervised GRPO runs from there for the arms' steps; the labels' and the fine-tuning's seconds are the arm's
one-off cost, as the PRM's labels and training are the learned-PRM arm's. If that arm keeps up with the learned PRM,
the PRM's worth was its training on the policy's correct samples, not its step credit.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_mega.run.metrics import read_metrics

CORRECT_ABOVE = 0.5
"""A verifier outcome above this is a correct solution (``prm.labeling.CORRECT_ABOVE``)."""


def write_rft_data(labels: Path, out: Path) -> int:
    """Write the correct solutions of a labels file (stepwise rows with ``prompt``, ``completions`` (the steps) and
    ``outcome``) as SFT rows ``{"prompt", "solution"}`` to ``out``; returns how many. A labels file without a
    correct solution is an error naming it (there is nothing to fine-tune on)."""
    rows = []
    for number, line in enumerate(Path(labels).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "outcome" not in row:
            raise ValueError(f"{labels}:{number}: no 'outcome' field (a Monte-Carlo labels file of grpo-mega prm "
                             "label has one per solution)")
        if float(row["outcome"]) > CORRECT_ABOVE:
            rows.append({"prompt": row["prompt"], "solution": "".join(row["completions"])})
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
