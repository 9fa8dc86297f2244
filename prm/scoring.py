"""Step scores from a PRM on its forward-only engine: ``StepScorer.score_steps`` (the batched API that
process-supervised GRPO calls) and ``grpo-mega prm score``.

Every example is rendered with the one contract of ``prm.rendering`` (prompt + step_1 + tag + ...), all rows go
through the engine together (it packs them into micro-batches by token budget and shards them over data-parallel
ranks), and step j's score is P(good) at the last token of its tag: ``exp(good_logprob)`` of the head.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from prm.examples import StepExample
from prm.rendering import LIKELIHOOD_TOKENS, RenderedExample, RenderSettings, tokenize_rendered
from prm.turn_rendering import render_turn_split, render_turn_steps, tag_ids_of
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps

if TYPE_CHECKING:
    import torch

    from prm.spec import PRMChoices

# torch is imported where it is used: every `grpo-mega` command builds the parser with this module's flags
# (add_score_arguments), also the launcher process that only execs torchrun.

logger = logging.getLogger(__name__)

DEFAULT_ROWS_PER_CALL = 512
"""Rows per engine call: bounds the [rows, length] output tensors, not the compute (the engine micro-batches)."""


def rendered_batch(
    rendered: Sequence[RenderedExample], pad_id: int, targets: Sequence[Sequence[float]] | None = None, *,
    step_ids: bool = False, prompt_lengths: bool = False,
) -> dict[str, torch.Tensor]:
    """The engine batch of rendered examples: right-padded ``input_ids``, ``attention_mask``, ``loss_mask`` (1 at
    each step's tag position) and, with ``targets`` (one per step), ``targets`` [B, L] (the step's label there).
    ``step_ids`` (the ``likelihood`` layout): also ``step_ids`` [B, L], k + 1 on the tokens of step k (from its first
    token to its tag position), 0 elsewhere, and, for examples rendered with ``likelihood_tokens="result"``,
    ``step_counted`` [B, L]: 1 on the tokens a step's score is read from. ``prompt_lengths``: also
    ``prompt_lengths`` [B], the tokens before each example's first step (at least 1), so that a Megatron engine with
    ``share_prompt_prefix`` carries a prompt once for the rows that share it (``grpo_mega.engine.shared_prefix``
    groups rows by those tokens: rows whose prompt tokenized differently are simply not grouped)."""
    import torch

    if not rendered:
        raise ValueError("rendered_batch: no examples")
    width = max(len(r.input_ids) for r in rendered)
    rows = len(rendered)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.long)
    target_values = torch.zeros((rows, width), dtype=torch.float32)
    step_numbers = torch.zeros((rows, width), dtype=torch.long)
    counted = torch.zeros((rows, width), dtype=torch.bool)
    any_counted = False
    for row, example in enumerate(rendered):
        length = len(example.input_ids)
        input_ids[row, :length] = torch.tensor(example.input_ids, dtype=torch.long)
        attention_mask[row, :length] = 1
        if step_ids:
            if example.step_starts is None:
                raise ValueError(f"row {row}: the rendered example has no step_starts (render it with prm.rendering)")
            for step, (first, last) in enumerate(zip(example.step_starts, example.tag_positions)):
                step_numbers[row, first : last + 1] = step + 1
                if example.counted is None:
                    counted[row, first : last + 1] = True
                else:  # likelihood_tokens="result": only the tokens of the step's result
                    counted[row, torch.tensor(example.counted[step], dtype=torch.long)] = True
                    any_counted = True
        positions = torch.tensor(example.tag_positions, dtype=torch.long)
        loss_mask[row, positions] = 1
        if targets is not None:
            if len(targets[row]) != len(example.tag_positions):
                raise ValueError(f"row {row}: {len(targets[row])} targets for {len(example.tag_positions)} steps")
            target_values[row, positions] = torch.tensor([float(t) for t in targets[row]], dtype=torch.float32)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if targets is not None:
        batch["targets"] = target_values
    if prompt_lengths:
        if any(example.step_starts is None for example in rendered):
            raise ValueError("prompt_lengths needs the rendered examples' step_starts (render them with prm.rendering)")
        batch["prompt_lengths"] = torch.tensor([max(example.step_starts[0], 1) if example.step_starts else 1
                                                for example in rendered], dtype=torch.long)
    if step_ids:
        batch["step_ids"] = step_numbers
        if any_counted:
            batch["step_counted"] = counted.long()
    return batch


def scores_at_tags(good_logprob: torch.Tensor, rendered: Sequence[RenderedExample]) -> list[list[float]]:
    """P(good) = exp(good_logprob) at each example's tag positions."""
    import torch

    return [
        torch.exp(good_logprob[row, torch.tensor(example.tag_positions, dtype=torch.long)]).tolist()
        for row, example in enumerate(rendered)
    ]


class StepScorer:
    """Scores the steps of many solutions at once on a PRM engine (forward-only or training; collective: every
    rank of the job calls with the same arguments and gets the same scores)."""

    def __init__(
        self,
        engine,
        tokenizer,
        settings: RenderSettings,
        *,
        max_length: int | None = None,
        rows_per_call: int = DEFAULT_ROWS_PER_CALL,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_length = max_length
        self.rows_per_call = rows_per_call
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else int(tokenizer.eos_token_id)
        self.last_seconds = 0.0
        """Wall time of the last ``score_steps`` call."""

    def render(self, prompt: str, steps: Sequence[str]) -> RenderedExample:
        """Token ids and tag positions of one example (``prm.rendering.tokenize_rendered``)."""
        return tokenize_rendered(self.tokenizer, prompt, list(steps), self.settings, max_length=self.max_length)

    def score_rendered(self, rendered: Sequence[RenderedExample]) -> list[list[float]]:
        """Step scores of already rendered examples, in order."""
        scores: list[list[float]] = []
        for start in range(0, len(rendered), self.rows_per_call):
            chunk = list(rendered[start : start + self.rows_per_call])
            batch = rendered_batch(chunk, self.pad_id, step_ids=not self.settings.step_tag,
                                   prompt_lengths=getattr(self.engine, "share_prompt_prefix", False))
            outputs = self.engine.forward(batch)
            scores.extend(scores_at_tags(outputs["good_logprob"], chunk))
        return scores

    def score_steps(self, prompts: Sequence[str], steps: Sequence[Sequence[str]]) -> list[list[float]]:
        """``scores[i][j]`` in [0, 1]: the PRM's probability that step j of solution i is good. A solution without
        steps gets ``[]``."""
        if len(prompts) != len(steps):
            raise ValueError(f"score_steps: {len(prompts)} prompts but {len(steps)} step lists")
        start = time.perf_counter()
        with_steps = [i for i, s in enumerate(steps) if len(s) > 0]
        rendered = [self.render(prompts[i], steps[i]) for i in with_steps]
        scores: list[list[float]] = [[] for _ in prompts]
        for index, row_scores in zip(with_steps, self.score_rendered(rendered)):
            scores[index] = row_scores
        self.last_seconds = time.perf_counter() - start
        return scores

    def score_examples(self, examples: Sequence[StepExample]) -> list[list[float]]:
        """``score_steps`` of examples' prompts and steps; a turn-split row read from its tokens
        (``prm.turn_rendering``)."""
        if not any(TURN_STEPS_FIELD in e.extra for e in examples):
            return self.score_steps([e.prompt for e in examples], [e.steps for e in examples])
        with_steps, rendered = render_turn_split(self.tokenizer, examples, self.settings, max_length=self.max_length)
        scores: list[list[float]] = [[] for _ in examples]
        for index, row_scores in zip(with_steps, self.score_rendered(rendered)):
            scores[index] = row_scores
        return scores

    def score_turn_steps(self, rows: Sequence[TurnSteps]) -> list[list[float]]:
        """``scores[i][k]`` in [0, 1]: the PRM's probability that turn step k of rollout i is good (``TurnSteps.of``
        a completion: what process supervision on turns scores), read from the rollouts' tokens
        (``prm.turn_rendering``)."""
        start = time.perf_counter()
        tag_ids = tag_ids_of(self.tokenizer, self.settings)
        rendered = [render_turn_steps(row, tag_ids, max_length=self.max_length, vocab_size=len(self.tokenizer),
                                      where=f"rollout {i}") for i, row in enumerate(rows)]
        scores = self.score_rendered(rendered) if rendered else []
        self.last_seconds = time.perf_counter() - start
        return scores


# ----------------------------------------------------------------------------- grpo-mega prm score
def add_prm_arguments(parser) -> None:
    """The flags that choose and describe a PRM, shared by ``score`` and ``eval``."""
    parser.add_argument("--prm", required=True, help="grpo-mega PRM checkpoint / run dir, or an HF PRM folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (processes = tp x pp x dp)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--layout", default=None, choices=("classifier", "lm_tokens", "likelihood"),
                        help="overrides the PRM's layout (default: its own: a grpo-mega PRM's, or a classifier PRM's "
                             "from its config). A plain causal LM needs it: lm_tokens (a Math-Shepherd-style PRM "
                             "trained on label tokens) or likelihood (the LM's own probability of each step)")
    parser.add_argument("--likelihood-tokens", default=None, choices=LIKELIHOOD_TOKENS,
                        help="--layout likelihood: a step's score is its least likely token among all its tokens "
                             "(all) or among its result's, the numbers after its last '=' (result; for "
                             "natural-language steps). Default: as the PRM was trained, else all")
    parser.add_argument("--step-tag", default=None, help="overrides the PRM's tag (default: its own)")
    parser.add_argument("--good-token", default=None, help="lm_tokens: the good label token")
    parser.add_argument("--bad-token", default=None, help="lm_tokens: the bad label token")
    parser.add_argument("--chat-template", action="store_true", default=None,
                        help="wrap the text with the tokenizer's chat template")
    parser.add_argument("--system-prompt", default=None, help="system message with --chat-template")
    parser.add_argument("--max-length", type=int, default=None, help="longest rendered example in tokens")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--engine", default="megatron", choices=("megatron", "deepspeed"),
                        help="forward engine of the PRM (deepspeed: --tp 1 --pp 1, processes = --nproc)")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3),
                        help="--engine deepspeed: ZeRO stage (3 keeps the PRM's parameters partitioned)")
    parser.add_argument("--scorer", default="engine", choices=("engine", "vllm"),
                        help="what runs the PRM: engine (a forward-only copy on --engine, at --tp / --pp) or vllm "
                             "(vLLM's pooling runner; a grpo-mega checkpoint is exported for it once, into the checkpoint's "
                             "hf_export/; docs/prm.md)")
    parser.add_argument("--vllm-tensor-parallel", type=int, default=1,
                        help="--scorer vllm: ranks per vLLM replica (processes = --nproc, replicas split the rows)")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.2,
                        help="--scorer vllm: share of each GPU for the PRM's weights and KV cache")


def add_data_arguments(parser, *, required: bool = True) -> None:
    """The flags of a step-labelled data file."""
    parser.add_argument("--data", required=required, help="jsonl of solutions split into steps")
    parser.add_argument("--format", default="auto",
                        help="auto, stepwise, math_shepherd, prm800k, processbench or synthetic")
    parser.add_argument("--on-bad-row", default="skip", choices=("skip", "error"))
    parser.add_argument("--neutral-is-good", action=argparse.BooleanOptionalAction, default=True,
                        help="PRM800K: count a rating of 0 as good (default yes; --no-neutral-is-good: only +1)")


def open_scorer(args):
    """Initialise the process group, then ``open_step_scorer`` from the command-line flags."""
    from grpo_mega.parallel import init_distributed

    from grpo_mega.config import DeepSpeedConfig
    from prm.spec import PRMChoices, check_layout_is_known

    if args.scorer == "vllm" and (args.tp, args.pp, args.engine) != (1, 1, "megatron"):
        raise ValueError("--scorer vllm takes its layout from --vllm-tensor-parallel and --nproc: leave --tp, --pp "
                         f"and --engine at their defaults (got --tp {args.tp} --pp {args.pp} --engine {args.engine})")
    if args.engine == "deepspeed" and (args.tp, args.pp) != (1, 1):
        raise ValueError(f"--engine deepspeed runs data parallel only: use --tp 1 --pp 1 (got {args.tp}, {args.pp})")
    if args.layout is None:
        check_layout_is_known(args.prm, "--layout")
    init_distributed(args.tp, args.pp, seed=args.seed)
    return open_step_scorer(
        args.prm, PRMChoices.of(args), max_length=args.max_length,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, engine_kind=args.engine,
        deepspeed=DeepSpeedConfig(zero_stage=args.zero_stage),
    )


def open_step_scorer(
    path: str,
    choices: PRMChoices | None = None,
    *,
    max_length: int | None = None,
    max_tokens_per_micro_batch: int = 8192,
    engine_kind: str = "megatron",
    deepspeed=None,
    share_prompt_prefix: bool = True,
):
    """Open the PRM at ``path`` on a forward-only engine (``prm.model.open_prm``; after ``init_distributed``; the
    ``engine_kind`` ``megatron`` or ``deepspeed`` with ``deepspeed`` settings) and its ``StepScorer``; returns
    (loaded PRM, scorer). ``choices`` (``prm.spec.PRMChoices``, default none) override how the PRM reads solutions;
    a None keeps the PRM's own setting: its tag and label tokens, and for a grpo-mega PRM the chat-template settings
    it was trained with (off for an HF PRM folder). The PRM's source is read once, by ``open_prm``.

    ``choices.scorer="vllm"``: the PRM on vLLM's pooling runner instead (``prm.vllm_scoring.open_vllm_step_scorer``;
    the loaded PRM's ``engine`` is then None), the same ``score_steps``. ``share_prompt_prefix`` (Megatron): the
    rows of a group carry their prompt through the layers once (``prm.model.open_prm``)."""
    from prm.model import open_prm
    from prm.spec import PRMChoices

    choices = choices or PRMChoices()
    if choices.scorer == "vllm":
        from prm.vllm_scoring import open_vllm_step_scorer

        return open_vllm_step_scorer(path, choices, max_length=max_length)
    if choices.scorer not in (None, "engine"):
        raise ValueError(f"scorer must be 'engine' or 'vllm', got {choices.scorer!r}")
    loaded = open_prm(path, spec_overrides=choices.spec_overrides(),
                      max_tokens_per_micro_batch=max_tokens_per_micro_batch, engine_kind=engine_kind,
                      deepspeed=deepspeed, share_prompt_prefix=share_prompt_prefix)
    settings = choices.render_settings(loaded.spec, loaded.source)
    return loaded, StepScorer(loaded.engine, loaded.tokenizer, settings, max_length=max_length)


def read_data(args, path: str | None = None) -> list[StepExample]:
    """The examples of ``path`` (default ``--data``) in file order, read per ``--format`` and its options."""
    from prm.data import read_examples

    options = {"neutral_is_good": args.neutral_is_good} if args.format in ("prm800k", "auto") else {}
    return read_examples(path or args.data, args.format, on_bad_row=args.on_bad_row, **options)


def add_score_arguments(parser) -> None:
    add_prm_arguments(parser)
    add_data_arguments(parser)
    parser.add_argument("--out", required=True, help="output jsonl: one line per example, with step_scores")


def close_scorer(scorer) -> None:
    """Shut a scorer that holds process groups (vLLM's) down while the job's groups are up, megatron's first, as
    ``grpo_mega.stages.rollout_setup.close_rollout_engine`` does: left to the interpreter's exit, vLLM's shutdown ran
    after ``destroy_distributed`` and ended each rank with a traceback (``Invalid process group specified``)."""
    close = getattr(scorer, "close", None)
    if close is not None:
        from grpo_mega.parallel import destroy_model_parallel

        destroy_model_parallel()
        close()


def run_score(args) -> Path:
    """``grpo-mega prm score``: one output line per usable input row, in order, with its ``step_scores``."""
    import torch.distributed as dist

    from grpo_mega.parallel import destroy_distributed

    _, scorer = open_scorer(args)
    examples = read_data(args)
    scores = scorer.score_examples(examples)
    out = Path(args.out)
    if dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as handle:
            for example, step_scores in zip(examples, scores):
                handle.write(json.dumps({"source": example.source, "prompt": example.prompt, "steps": example.steps,
                                         "step_scores": step_scores}) + "\n")
        logger.info("scored %d examples (%d steps) in %.1f s", len(examples), sum(map(len, scores)),
                    scorer.last_seconds)
    close_scorer(scorer)  # vLLM's groups before the job's
    destroy_distributed()
    return out
