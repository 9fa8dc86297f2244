"""Monte-Carlo step labels (Math-Shepherd) from a policy's rollout engine: ``grpo-mega prm label``.

A step is good when the policy can still reach the right answer from it. For a solution with steps
``s_1 .. s_K`` of a prompt, every prefix ``s_1 .. s_k`` (k = 1 .. K-1) gets ``n`` sampled continuations; each
full solution ``s_1 .. s_k + continuation`` is scored by the task's verifier (score > 0.5 counts as correct):

- hard label of step k: at least one of the n continuations is correct (Math-Shepherd's "hard estimation");
- soft label of step k: the fraction of the n continuations that are correct ("soft estimation");
- the last step (the finished solution) is labelled by the solution's own outcome, without sampling (soft 0/1).

Every prefix of every solution goes into one batched generation (``generate_across_ranks``: the ranks split the
prompts and all of them get every continuation) and one scoring call (``score_across_ranks``), so the labels are
the same on every rank and depend only on the seed and the number of ranks.

Prefix tokens: the prompt's ids as the dataset gives them (``load_prompt_dataset``) followed by
``tokenizer(prefix_text, add_special_tokens=False)``, the canonical tokenization of the prefix text. Caveat: it
can differ from the ids the policy sampled, (a) when a step boundary falls inside what BPE merges into one token,
so the prefix ends on a token the policy would not have stopped at, and (b) when the policy sampled a
non-canonical split of its own text. Both default step patterns cut where byte-level BPE with Qwen2 / Llama-3
pre-tokenization starts a new pre-token (before " Step k:" / " The answer is", after a blank line), so (a) does
not arise there; (b) is rare for a policy trained on canonical tokenizations, like the quickstart's SFT policy.

What the labels measure: whether *this policy* can finish the solution from the step, not whether the step is
right. A weak completer gives false negatives (a right step from which none of the n continuations reaches the
answer); a policy whose final answer does not follow its steps gives false positives (a wrong step followed by a
lucky answer). More continuations trade the first for the second.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from grpo_mega.data.step_split import default_step_pattern, split_steps
from prm.examples import StepExample

if TYPE_CHECKING:
    from grpo_mega.data.prompts import PromptRecord
    from grpo_mega.reward.types import RewardFunction
    from grpo_mega.rollout.base import SamplingConfig

# torch and the distributed helpers are imported where they are used: every `grpo-mega` command builds the parser
# with this module's flags (add_label_arguments), also the launcher process that only execs torchrun.

logger = logging.getLogger(__name__)

CORRECT_ABOVE = 0.5
"""A verifier score above this counts as a correct solution (0/1 verifiers: score 1)."""


@dataclass(frozen=True)
class LabelItem:
    """One solution to label: the prompt as the policy saw it, the solution's steps, and what the verifier needs."""

    prompt: str
    """The formatted prompt text (``PromptRecord.prompt``); the solution is written right after it."""
    prompt_ids: list[int]
    """The prompt's token ids as the policy was given them (``PromptRecord.prompt_ids``)."""
    steps: list[str]
    """The solution's steps; ``"".join(steps)`` is the solution text."""
    answer: str | None
    """The gold answer passed to the verifier."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The dataset row's other fields, passed to the verifier (e.g. the synthetic task's ``steps``)."""
    source: str = ""
    """Where the item came from, e.g. ``train.jsonl:12#1`` (row 12, policy sample 1)."""


class Prefix(NamedTuple):
    """The first ``num_steps`` steps of item ``item``: one prompt of the Monte-Carlo generation."""

    item: int
    num_steps: int


# ----------------------------------------------------------------------------- pure label arithmetic
def is_correct(score: float) -> bool:
    """Whether a verifier score counts as a correct solution."""
    return score > CORRECT_ABOVE


def plan_prefixes(step_counts: Sequence[int]) -> list[Prefix]:
    """The prefixes to continue: ``(item, k)`` for k = 1 .. K-1 of every item with K steps (the last step is
    labelled by the outcome). Ordered by the number of steps still to write, most first, so a generation chunk
    holds continuations of similar length (a chunk runs until its longest row ends)."""
    prefixes = [Prefix(item, k) for item, count in enumerate(step_counts) for k in range(1, count)]
    return sorted(prefixes, key=lambda p: step_counts[p.item] - p.num_steps, reverse=True)


def group_rollouts(
    prefixes: Sequence[Prefix], correct: Sequence[bool], n: int, step_counts: Sequence[int]
) -> list[list[list[bool]]]:
    """Regroup the flat correctness of the continuations (``n`` per prefix, in ``prefixes`` order) by item and
    step: ``result[item][k - 1]`` holds the n outcomes of the continuations of prefix k."""
    if len(correct) != n * len(prefixes):
        raise ValueError(f"group_rollouts: {len(correct)} outcomes for {len(prefixes)} prefixes x n={n}")
    grouped: list[list[list[bool] | None]] = [[None] * max(count - 1, 0) for count in step_counts]
    for position, prefix in enumerate(prefixes):
        if not 1 <= prefix.num_steps < step_counts[prefix.item]:
            raise ValueError(f"group_rollouts: prefix {prefix} outside 1..{step_counts[prefix.item] - 1} steps")
        grouped[prefix.item][prefix.num_steps - 1] = list(correct[position * n : (position + 1) * n])
    for item, rows in enumerate(grouped):
        missing = [k + 1 for k, row in enumerate(rows) if row is None]
        if missing:
            raise ValueError(f"group_rollouts: item {item} has no continuations for prefixes {missing}")
    return grouped  # type: ignore[return-value]


def step_labels(rollouts: Sequence[Sequence[bool]], outcome: bool) -> tuple[list[bool], list[float]]:
    """(hard, soft) labels of a solution's steps from its prefixes' continuation outcomes.

    ``rollouts[k - 1]``: whether each continuation of the first k steps was correct, for k = 1 .. K-1.
    Hard label = any continuation correct, soft = fraction correct; the last step gets the solution's ``outcome``.
    """
    for k, outcomes in enumerate(rollouts, start=1):
        if not outcomes:
            raise ValueError(f"step_labels: prefix {k} has no continuations")
    hard = [any(outcomes) for outcomes in rollouts] + [bool(outcome)]
    soft = [sum(outcomes) / len(outcomes) for outcomes in rollouts] + [1.0 if outcome else 0.0]
    return hard, soft


# ----------------------------------------------------------------------------- generation and scoring
def prefix_token_ids(tokenizer, item: LabelItem, num_steps: int) -> list[int]:
    """The policy's input for a prefix: the prompt's ids + ``tokenizer(steps[:num_steps] joined)`` (no special
    tokens; see the module docstring for the BPE-boundary caveat)."""
    text = "".join(item.steps[:num_steps])
    return list(item.prompt_ids) + list(tokenizer(text, add_special_tokens=False)["input_ids"])


def monte_carlo_labels(
    engine,
    tokenizer,
    items: Sequence[LabelItem],
    *,
    n: int,
    sampling: SamplingConfig,
    reward_fn: RewardFunction,
    seed: int,
    on_error: str = "raise",
) -> list[StepExample]:
    """A :class:`StepExample` per item with Monte-Carlo hard and soft labels (see the module docstring).

    Collective when distributed (every rank passes the same items and gets the same examples). ``sampling``
    gives temperature, top-p/k, max_new_tokens and stop strings of the continuations; its ``n`` and ``seed``
    are replaced by ``n`` and ``seed``. ``on_error``: a verifier failure raises (``"raise"``, naming the sample)
    or counts as incorrect (``"zero"``, logged). ``extra["outcome"]`` of an example is its solution's verifier score.
    """
    from grpo_mega.reward.distributed import score_across_ranks
    from grpo_mega.rollout.distributed import generate_across_ranks

    if n < 1:
        raise ValueError(f"monte_carlo_labels: n must be >= 1, got {n}")
    for index, item in enumerate(items):
        if not item.steps:
            raise ValueError(f"monte_carlo_labels: item {index} ({item.source or 'no source'}) has no steps")
    step_counts = [len(item.steps) for item in items]
    prefixes = plan_prefixes(step_counts)
    continuation_texts: list[str] = []
    if prefixes:
        prompt_ids = [prefix_token_ids(tokenizer, items[p.item], p.num_steps) for p in prefixes]
        completions = generate_across_ranks(
            engine, prompt_ids, dataclasses.replace(sampling, n=n, seed=seed), call_seed=seed
        )
        continuation_texts = [completion.text for completion in completions]
    # One scoring call: every continued solution (prefix + continuation), then every finished solution.
    owners = [items[p.item] for p in prefixes for _ in range(n)]
    solutions = [
        "".join(items[p.item].steps[: p.num_steps]) + continuation_texts[position * n + j]
        for position, p in enumerate(prefixes)
        for j in range(n)
    ]
    owners += list(items)
    solutions += ["".join(item.steps) for item in items]
    results = score_across_ranks(
        reward_fn, [o.prompt for o in owners], solutions, [o.answer for o in owners], [o.extra for o in owners],
        on_error=on_error,
    )
    failures = [r for r in results if r.failed]
    if failures:
        logger.warning("%d of %d verifier calls failed and count as incorrect; first: %s", len(failures),
                       len(results), failures[0].error)
    rollout_correct = [is_correct(r.score) for r in results[: len(prefixes) * n]]
    outcomes = [r.score for r in results[len(prefixes) * n :]]
    grouped = group_rollouts(prefixes, rollout_correct, n, step_counts)
    examples = []
    for item, rollouts, outcome in zip(items, grouped, outcomes):
        hard, soft = step_labels(rollouts, is_correct(outcome))
        examples.append(StepExample(prompt=item.prompt, steps=list(item.steps), labels=hard, soft_labels=soft,
                                    answer=item.answer, source=item.source, extra={"outcome": outcome}))
    return examples


class SampledSolutions(NamedTuple):
    """The policy's solutions split into steps, and how many samples were dropped for having no text."""

    items: list[LabelItem]
    dropped_empty: int


def sample_solutions(
    engine,
    records: Sequence[PromptRecord],
    *,
    samples_per_prompt: int,
    sampling: SamplingConfig,
    step_pattern: str,
    seed: int,
) -> SampledSolutions:
    """``samples_per_prompt`` policy solutions per record (collective: the same on every rank), each split into
    steps with ``split_steps(text, step_pattern)``; a solution with no text is dropped and counted. ``sampling``
    gives temperature, top-p/k, max_new_tokens and stop strings; its ``n`` and ``seed`` are replaced."""
    from grpo_mega.rollout.distributed import generate_across_ranks

    if samples_per_prompt < 1:
        raise ValueError(f"sample_solutions: samples_per_prompt must be >= 1, got {samples_per_prompt}")
    per_call = dataclasses.replace(sampling, n=samples_per_prompt, seed=seed)
    completions = generate_across_ranks(engine, [r.prompt_ids for r in records], per_call, call_seed=seed)
    items, dropped = [], 0
    for position, completion in enumerate(completions):
        record = records[position // samples_per_prompt]
        steps = split_steps(completion.text, step_pattern) if completion.text.strip() else []
        if not steps:
            dropped += 1
            continue
        items.append(LabelItem(prompt=record.prompt, prompt_ids=list(record.prompt_ids), steps=steps,
                               answer=record.answer, extra=dict(record.extra),
                               source=f"{record.source}#{position % samples_per_prompt}"))
    return SampledSolutions(items, dropped)


# ----------------------------------------------------------------------------- the policy
@dataclass
class PolicyRollout:
    """A rollout engine holding a policy's weights, its tokenizer, and where they came from."""

    engine: Any
    tokenizer: Any
    hf_config: Path
    """The HF config folder of the policy's architecture."""
    weights_format: str
    """``hf``, ``mcore_model``, ``training_checkpoint`` or ``training_run`` (``weights_format``)."""
    sync_seconds: float = 0.0


def policy_folders(policy: str | Path) -> tuple[str, Path, Path]:
    """(weights format, HF config folder, tokenizer folder) of a policy given as an HF folder with weights, a
    converted megatron folder (its ``hf/`` side files), a grpo-mega training checkpoint or run directory (its saved
    config's ``model.hf_config`` and ``model.tokenizer``); collective for checkpoints (rank 0 locates them)."""
    from grpo_mega.checkpoint.mcore_checkpoint import HF_FILES_DIR
    from grpo_mega.checkpoint.source import checkpoint_config
    from grpo_mega.checkpoint.training_files import weights_format

    policy = Path(policy)
    try:
        kind = weights_format(policy)
    except ValueError as error:
        raise ValueError(f"--policy {policy}: {error}") from None
    if kind == "hf":
        return kind, policy, policy
    if kind == "mcore_model":
        return kind, policy / HF_FILES_DIR, policy / HF_FILES_DIR
    model = checkpoint_config(policy).get("model") or {}
    if not model.get("hf_config"):
        raise ValueError(f"--policy {policy}: its saved config has no model.hf_config")
    hf_config = Path(model["hf_config"])
    tokenizer = Path(model.get("tokenizer") or hf_config)
    for name, folder in (("model.hf_config", hf_config), ("model.tokenizer", tokenizer)):
        if not folder.is_dir():
            raise ValueError(f"--policy {policy}: its saved config's {name} {folder} is not a folder (moved? a "
                             "relative path is read from the current directory)")
    return kind, hf_config, tokenizer


def load_policy_rollout(policy: str | Path, *, generation_batch_size: int) -> PolicyRollout:
    """The hf rollout engine with ``policy``'s weights (see :func:`policy_folders`) on this rank's device, built
    as the trainer builds it; collective. An HF folder is loaded directly; other formats are loaded into a
    forward-only Megatron policy engine (at the job's TP) and synced into the rollout engine, as the trainer syncs."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.data.tokenizer import load_tokenizer
    from grpo_mega.engine import build_reference_engine
    from grpo_mega.parallel import get_device
    from grpo_mega.rollout import build_rollout_engine, sync_weights

    kind, hf_config, tokenizer_folder = policy_folders(policy)
    tokenizer = load_tokenizer(tokenizer_folder)
    device = get_device()
    engine = build_rollout_engine("hf", model_path=hf_config, tokenizer=tokenizer,
                                  dtype="bfloat16" if device.type == "cuda" else "float32",
                                  generation_batch_size=generation_batch_size, device=device)
    result = PolicyRollout(engine, tokenizer, hf_config, kind)
    if kind != "hf":
        forward = build_reference_engine(AutoConfig.from_pretrained(hf_config), max_tokens_per_micro_batch=4096)
        load_initial_weights(forward, policy)
        result.sync_seconds = sync_weights(forward.export_hf_weights(), engine, bucket_bytes=256 * 2**20).seconds
        del forward
        gc.collect()
    return result


# ----------------------------------------------------------------------------- grpo-mega prm label
def add_label_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``grpo-mega prm label``."""
    parser.add_argument("--policy", required=True, help="the policy: an HF folder with weights, a converted megatron "
                        "folder, a grpo-mega training checkpoint or run directory")
    parser.add_argument("--data", required=True, help="prompt dataset (.jsonl/.parquet) with prompt and answer fields")
    parser.add_argument("--out", required=True, help="stepwise jsonl to write (and <out>.summary.json)")
    parser.add_argument("--prompt-field", default="prompt")
    parser.add_argument("--answer-field", default="answer")
    parser.add_argument("--chat-template", action="store_true", help="format prompts with the tokenizer's chat template")
    parser.add_argument("--prompt-length", type=int, default=512, help="longest prompt in tokens (longer rows skipped)")
    parser.add_argument("--max-prompts", type=int, default=None, help="label only the first N usable prompts")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="policy solutions labelled per prompt (M)")
    parser.add_argument("--n", type=int, default=8, help="Monte-Carlo continuations per step prefix")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of solutions and "
                        "continuations (0 = greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--reward", default="synthetic", help="verifier: a registered reward (synthetic, math_verify) "
                        "or package.module:function; a score > 0.5 is a correct solution")
    parser.add_argument("--on-reward-error", choices=("raise", "zero"), default="raise",
                        help="a verifier call that fails: stop (raise) or count it as incorrect (zero)")
    parser.add_argument("--step-pattern", default=None, help="regex ending each step (default: the synthetic "
                        "task's steps for its rows, else a blank line)")
    parser.add_argument("--perturb-fraction", type=float, default=0.0, help="error injection (prm/perturb.py): "
                        "share of the sampled solutions that also get a copy with one number changed in one step, "
                        "finished by the policy and labelled like the others (default 0: none)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--generation-batch-size", type=int, default=64, help="prompts per generate call")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the engine that loads a checkpoint")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


def summary_path(out: str | Path) -> Path:
    """Where ``run_label`` writes the summary of ``out``: ``<out>.summary.json``."""
    return Path(f"{out}.summary.json")


def true_labels_of(record_extra: dict, steps: list[str], source: str) -> list[bool] | None:
    """Ground-truth labels of a synthetic-task solution's steps (its row's ``steps`` record), None for other rows."""
    from grpo_mega.data.synthetic import Problem
    from prm.synthetic import true_step_labels

    if "steps" not in record_extra:
        return None
    try:
        problem = Problem.from_record({"steps": record_extra["steps"]})
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return true_step_labels(problem, steps)


def agreement_summary(examples: Sequence[StepExample]) -> dict[str, float]:
    """Agreement of the Monte-Carlo labels with ``extra["true_labels"]`` over all steps (hard labels; soft >= 0.5),
    and over the sampled steps only (all but each solution's last, which is labelled by its outcome)."""
    from prm.metrics import label_agreement

    known = [e for e in examples if e.extra.get("true_labels") is not None]
    if not known:
        return {}
    truth = [e.extra["true_labels"] for e in known]
    summary = {
        "label_agreement": label_agreement([e.labels for e in known], truth),
        "soft_label_agreement": label_agreement([[s >= 0.5 for s in e.soft_labels] for e in known], truth),
        "truth_good_fraction": sum(map(sum, truth)) / sum(map(len, truth)),
    }
    sampled = [e for e in known if len(e.steps) > 1]
    if sampled:
        sampled_truth = [e.extra["true_labels"][:-1] for e in sampled]
        summary["label_agreement_sampled_steps"] = label_agreement([e.labels[:-1] for e in sampled], sampled_truth)
        summary["soft_label_agreement_sampled_steps"] = label_agreement(
            [[s >= 0.5 for s in e.soft_labels[:-1]] for e in sampled], sampled_truth)
    return summary


def run_label(args: argparse.Namespace) -> Path:
    """``grpo-mega prm label``: sample solutions from the policy, label their steps by Monte-Carlo rollouts, write
    the stepwise jsonl and ``<out>.summary.json`` (rank 0); returns the output path. Runs on every rank of the
    current job (``init_distributed(tp, 1)``; the ranks split generation and scoring)."""
    import torch.distributed as dist

    from grpo_mega.data.prompts import load_prompt_dataset
    from grpo_mega.parallel import destroy_distributed, init_distributed
    from grpo_mega.reward import get_reward_function
    from grpo_mega.rollout.base import SamplingConfig, derive_seed
    from prm.data import write_stepwise
    from prm.perturb import check_fraction, perturbed_solutions, plan_perturbations

    for name in ("n", "samples_per_prompt", "max_new_tokens", "generation_batch_size", "tp", "prompt_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise ValueError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    reward_fn = get_reward_function(args.reward)
    check_fraction(args.perturb_fraction)
    out = Path(args.out)
    started = time.perf_counter()
    init_distributed(args.tp, 1, seed=args.seed, device=args.device)
    try:
        policy = load_policy_rollout(args.policy, generation_batch_size=args.generation_batch_size)
        records = load_prompt_dataset(
            args.data, policy.tokenizer, prompt_length=args.prompt_length, prompt_field=args.prompt_field,
            answer_field=args.answer_field, use_chat_template=args.chat_template,
        ).records[: args.max_prompts]
        step_pattern = args.step_pattern or default_step_pattern(r.extra for r in records)
        sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        loaded = time.perf_counter()
        solutions = sample_solutions(policy.engine, records, samples_per_prompt=args.samples_per_prompt,
                                     sampling=sampling, step_pattern=step_pattern, seed=derive_seed(args.seed, 0))
        plans = plan_perturbations([item.steps for item in solutions.items], args.perturb_fraction,
                                   derive_seed(args.seed, 2))
        items = solutions.items + perturbed_solutions(
            policy.engine, policy.tokenizer, solutions.items, plans, sampling=sampling, step_pattern=step_pattern,
            seed=derive_seed(args.seed, 3))
        sampled = time.perf_counter()
        examples = monte_carlo_labels(policy.engine, policy.tokenizer, items, n=args.n, sampling=sampling,
                                      reward_fn=reward_fn, seed=derive_seed(args.seed, 1),
                                      on_error=args.on_reward_error)
        labelled = time.perf_counter()
        for item, example in zip(items, examples):
            truth = true_labels_of(item.extra, item.steps, item.source)
            if truth is not None:
                example.extra["true_labels"] = truth
        steps = sum(len(e.steps) for e in examples)
        summary = {
            "prompts": len(records),
            "solutions": len(examples),
            "dropped_empty_solutions": solutions.dropped_empty,
            "steps": steps,
            "perturbed_solutions": len(plans),
            "generations": len(records) * args.samples_per_prompt + len(plans) + (steps - len(examples)) * args.n,
            # the policy's own solutions only (the perturbed copies follow them)
            "solution_accuracy": sum(is_correct(e.extra["outcome"]) for e in examples[: len(solutions.items)])
            / max(len(solutions.items), 1),
            "good_label_fraction": sum(map(sum, (e.labels for e in examples))) / max(steps, 1),
            "n": args.n, "samples_per_prompt": args.samples_per_prompt, "temperature": args.temperature,
            "perturb_fraction": args.perturb_fraction,
            "step_pattern": step_pattern, "reward": args.reward, "policy": str(args.policy),
            "policy_format": policy.weights_format,
            "world_size": dist.get_world_size(),
            "seconds": round(labelled - started, 2),
            "stage_seconds": {"load": round(loaded - started, 2), "sample": round(sampled - loaded, 2),
                              "label": round(labelled - sampled, 2)},
            **agreement_summary(examples),
        }
        if dist.get_rank() == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_stepwise(out, examples)
            summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")
            logger.info("labelled %d steps of %d solutions in %.1f s -> %s", steps, len(examples),
                        summary["seconds"], out)
        dist.barrier()  # the files exist before any rank returns their path
    finally:
        destroy_distributed()
    return out
