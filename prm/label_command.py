"""``grpo-mega prm label``: sample solutions from a policy, label their steps by Monte-Carlo rollouts
(``prm.labeling``), optionally add perturbed copies (``prm.perturb``), write the stepwise jsonl and a summary."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Sequence

from grpo_mega.data.step_split import default_step_pattern
from prm.examples import StepExample
from prm.labeling import is_correct, monte_carlo_labels, sample_solutions
from prm.policy import load_policy_rollout
from prm.turn_labeling import monte_carlo_turn_labels, sample_turn_solutions
from prm.turn_setup import (add_turn_arguments, build_toolset_of, build_turn_loop, multi_turn_settings,
                            step_kind_of)

# torch and the distributed helpers are imported where they are used: every `grpo-mega` command builds the parser
# with this module's flags (add_label_arguments), also the launcher process that only execs torchrun.

logger = logging.getLogger(__name__)


def add_label_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``grpo-mega prm label``."""
    parser.add_argument("--policy", required=True, help="the policy: an HF folder with weights, a converted megatron "
                        "folder, a grpo-mega training checkpoint or run directory")
    parser.add_argument("--completer", default=None, help="the model that finishes each step prefix for its "
                        "Monte-Carlo label (Math-Shepherd's completer), in any --policy format, with the policy's "
                        "tokenizer; default: the policy itself")
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
    parser.add_argument("--completer-temperature", type=float, default=None, help="temperature of the Monte-Carlo "
                        "continuations (default: --temperature); 0 with --n 1: the completer's greedy continuation "
                        "of each prefix")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens of a solution or continuation; "
                        "with --steps turns the whole response, tool turns included (algorithm.response_length)")
    parser.add_argument("--reward", default="synthetic", help="verifier: a registered reward (synthetic, math_verify, "
                        "verl_default), package.module:function or path/to/file.py:function (grpo-mega's, verl's or "
                        "TRL's signature, as reward.function); a score > 0.5 is a correct solution")
    parser.add_argument("--turn-truth", default=None, help="--steps turns: a per-turn checker (a reward function "
                        "that returns turn rewards, as reward.function with process_reward.steps: turns; e.g. "
                        "tool_task_turns, the tool task's oracle) whose verdicts (turn reward 1 = right) are stored as "
                        "each row's true_labels: the labels' agreement with it in the summary, and prm eval's "
                        "label_agreement and true_step_auroc on the rows; default: none")
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
    add_turn_arguments(parser)


def summary_path(out: str | Path) -> Path:
    """Where ``run_label`` writes the summary of ``out``: ``<out>.summary.json``."""
    return Path(f"{out}.summary.json")


def true_labels_of(record_extra: dict, steps: list[str], source: str) -> dict[str, list[bool]] | None:
    """Ground-truth labels of a synthetic-task solution's steps (its row's ``steps`` record), None for other rows:
    ``true_labels`` by the step checker (``prm.synthetic.true_step_labels``) and ``value_labels`` by the value each
    step carries on (``value_step_labels``)."""
    from grpo_mega.data.synthetic import Problem
    from prm.synthetic import true_step_labels, value_step_labels

    if "steps" not in record_extra:
        return None
    try:
        problem = Problem.from_record({"steps": record_extra["steps"]})
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return {"true_labels": true_step_labels(problem, steps), "value_labels": value_step_labels(problem, steps)}


def _agreements(known: Sequence[StepExample], truth_key: str, prefix: str) -> dict[str, float]:
    """Agreement of the hard and soft (>= 0.5) Monte-Carlo labels with ``extra[truth_key]``, over all steps and over
    the sampled steps only (all but each solution's last, which is labelled by its outcome)."""
    from prm.metrics import label_agreement

    truth = [e.extra[truth_key] for e in known]
    summary = {
        f"{prefix}label_agreement": label_agreement([e.labels for e in known], truth),
        f"{prefix}soft_label_agreement": label_agreement([[s >= 0.5 for s in e.soft_labels] for e in known], truth),
        f"{prefix}truth_good_fraction": sum(map(sum, truth)) / sum(map(len, truth)),
    }
    sampled = [e for e in known if len(e.steps) > 1]
    if sampled:
        sampled_truth = [e.extra[truth_key][:-1] for e in sampled]
        summary[f"{prefix}label_agreement_sampled_steps"] = label_agreement([e.labels[:-1] for e in sampled],
                                                                            sampled_truth)
        summary[f"{prefix}soft_label_agreement_sampled_steps"] = label_agreement(
            [[s >= 0.5 for s in e.soft_labels[:-1]] for e in sampled], sampled_truth)
    return summary


def agreement_summary(examples: Sequence[StepExample]) -> dict[str, float]:
    """Agreement of the Monte-Carlo labels with the step checker's truth (``extra["true_labels"]``: ``label_agreement``
    and friends) and with the truth by value (``extra["value_labels"]``, set with it by ``true_labels_of``:
    ``value_label_agreement`` and friends); a
    Monte-Carlo label cannot see a wrong expression that carries the right value on, so the second is the one a
    better completer or a harder-to-guess answer can raise."""
    known = [e for e in examples if e.extra.get("true_labels") is not None]
    if not known:
        return {}
    by_value = [e for e in known if e.extra.get("value_labels") is not None]  # turn truths have no value labels
    return {**_agreements(known, "true_labels", ""), **(_agreements(by_value, "value_labels", "value_")
                                                        if by_value else {})}


def true_turn_labels(checker, item, completion, tokenizer) -> list[bool]:
    """``--turn-truth``: the checker's verdict on each turn step of a rollout (its turn reward is 1), given the
    trajectory as the trainer gives a per-turn reward function (``grpo_mega.stages.turn_steps.turn_views``)."""
    from grpo_mega.reward.types import TurnRewards
    from grpo_mega.rollout.base import decode_response
    from grpo_mega.stages.turn_steps import turn_views

    views = turn_views(completion, lambda ids: decode_response(tokenizer, ids))
    verdict = checker(item.prompt, completion.text, item.answer, **{**item.extra, "turns": views})
    if not isinstance(verdict, TurnRewards) or len(verdict.turn_rewards) != len(item.steps):
        raise ValueError(f"--turn-truth: {item.source}: the checker gave {verdict!r:.80}, not one turn reward per "
                         f"turn step ({len(item.steps)})")
    return [reward == 1.0 for reward in verdict.turn_rewards]


def load_completer(completer: str, policy, args: argparse.Namespace):
    """The completer's rollout engine (``--completer``); it continues the policy's token prefixes, so its
    tokenizer must be the policy's."""
    loaded = load_policy_rollout(completer, generation_batch_size=args.generation_batch_size)
    if loaded.tokenizer.get_vocab() != policy.tokenizer.get_vocab():
        raise ValueError(f"--completer {completer}: its tokenizer differs from the policy's ({args.policy}); the "
                         "completer continues the policy's token prefixes, so both need the same tokenizer")
    return loaded


def run_label(args: argparse.Namespace) -> Path:
    """``grpo-mega prm label``: sample solutions from the policy, label their steps by Monte-Carlo rollouts, write
    the stepwise jsonl and ``<out>.summary.json`` (rank 0); returns the output path. Runs on every rank of the
    current job (``init_distributed(tp, 1)``; the ranks split generation and scoring)."""
    import torch.distributed as dist

    from grpo_mega.data.prompts import load_prompt_dataset
    from grpo_mega.parallel import destroy_distributed, init_distributed
    from grpo_mega.reward import get_reward_function
    from grpo_mega.rollout.base import SamplingConfig, derive_seed
    from grpo_mega.run.progress import PhaseProgress
    from grpo_mega.stages.rollout import row_tool_kwargs
    from prm.data import write_stepwise
    from prm.perturb import check_fraction

    for name in ("n", "samples_per_prompt", "max_new_tokens", "generation_batch_size", "tp", "prompt_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise ValueError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    reward_fn = get_reward_function(args.reward)
    turn_truth = get_reward_function(args.turn_truth) if args.turn_truth else None
    check_fraction(args.perturb_fraction)
    toolset = None
    out = Path(args.out)
    started = time.perf_counter()
    init_distributed(args.tp, 1, seed=args.seed, device=args.device)
    progress = PhaseProgress("grpo-mega prm label", speaks=dist.get_rank() == 0)
    try:
        progress.start(f"loading the policy {args.policy}")
        policy = load_policy_rollout(args.policy, generation_batch_size=args.generation_batch_size)
        policy.engine.on_progress = progress
        step_kind = step_kind_of(args, policy.run_config)
        if step_kind == "turns" and args.perturb_fraction:
            raise ValueError("--perturb-fraction changes a number in a text step; it does not apply to --steps turns")
        if step_kind != "turns" and turn_truth is not None:
            raise ValueError("--turn-truth judges the turns of --steps turns; text steps get the synthetic task's "
                             "step checker's truth by themselves")
        turns = multi_turn_settings(args, policy.run_config) if step_kind == "turns" else None
        toolset = build_toolset_of(turns) if turns is not None else None
        schemas = toolset.schemas() if turns is not None and turns.format == "hermes" else None
        records = load_prompt_dataset(
            args.data, policy.tokenizer, prompt_length=args.prompt_length, prompt_field=args.prompt_field,
            answer_field=args.answer_field, use_chat_template=args.chat_template, tools=schemas,
        ).records[: args.max_prompts]
        step_pattern = args.step_pattern or default_step_pattern(r.extra for r in records)
        sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        loaded = time.perf_counter()
        progress.finish(f"loaded, {len(records)} prompts")
        continuation = sampling if args.completer_temperature is None else dataclasses.replace(
            sampling, temperature=args.completer_temperature)
        completer = policy if args.completer is None else load_completer(args.completer, policy, args)
        progress.start("sampling solutions", len(records) * args.samples_per_prompt, "solutions")
        if turns is None:
            items, dropped, plans = _text_solutions(policy, records, sampling, step_pattern, args)
        else:
            loop = build_turn_loop(policy.engine, policy.tokenizer, turns, toolset,
                                   max_response_tokens=args.max_new_tokens, use_chat_template=args.chat_template)
            turn_items, dropped = sample_turn_solutions(
                loop, policy.tokenizer, records, samples_per_prompt=args.samples_per_prompt, sampling=sampling,
                seed=derive_seed(args.seed, 0), tool_kwargs=[row_tool_kwargs(r.extra) for r in records])
            items, plans = [t.item for t in turn_items], []
        sampled = time.perf_counter()
        progress.finish(f"{len(items)} solutions ({len(plans)} of them perturbed copies)")
        completer.engine.on_progress = progress
        prefixes = sum(len(item.steps) - 1 for item in items)
        progress.start(f"labelling: {args.n} continuations of each step prefix", prefixes, "prefixes")
        if turns is None:
            examples = monte_carlo_labels(completer.engine, completer.tokenizer, items, n=args.n,
                                          sampling=continuation, reward_fn=reward_fn, seed=derive_seed(args.seed, 1),
                                          on_error=args.on_reward_error)
        else:
            completer_loop = loop if completer is policy else build_turn_loop(
                completer.engine, completer.tokenizer, turns, toolset, max_response_tokens=args.max_new_tokens,
                use_chat_template=args.chat_template)
            examples = monte_carlo_turn_labels(completer_loop, turn_items, n=args.n, sampling=continuation,
                                               reward_fn=reward_fn, seed=derive_seed(args.seed, 1),
                                               on_error=args.on_reward_error)
        labelled = time.perf_counter()
        progress.finish(f"{sum(len(e.steps) for e in examples)} steps labelled")
        if turns is None:  # the synthetic task's step checker reads text steps
            for item, example in zip(items, examples):
                truths = true_labels_of(item.extra, item.steps, item.source)
                if truths is not None:
                    example.extra.update(truths)
        elif turn_truth is not None:
            for turn_item, example in zip(turn_items, examples):
                example.extra["true_labels"] = true_turn_labels(turn_truth, turn_item.item, turn_item.completion,
                                                                policy.tokenizer)
        steps = sum(len(e.steps) for e in examples)
        summary = {
            "prompts": len(records),
            "solutions": len(examples),
            "dropped_empty_solutions": dropped,
            "steps": steps,
            "perturbed_solutions": len(plans),
            "generations": len(records) * args.samples_per_prompt + len(plans) + (steps - len(examples)) * args.n,
            # the policy's own solutions only (the perturbed copies follow them)
            "solution_accuracy": sum(is_correct(e.extra["outcome"]) for e in examples[: len(items) - len(plans)])
            / max(len(items) - len(plans), 1),
            "good_label_fraction": sum(map(sum, (e.labels for e in examples))) / max(steps, 1),
            "n": args.n, "samples_per_prompt": args.samples_per_prompt, "temperature": args.temperature,
            "completer_temperature": continuation.temperature,
            "perturb_fraction": args.perturb_fraction,
            "step_kind": step_kind, "step_pattern": step_pattern if turns is None else None,
            **({} if turns is None else {"multi_turn": dataclasses.asdict(turns),
                                         "turns_per_solution": steps / max(len(examples), 1)}),
            "reward": args.reward, "turn_truth": args.turn_truth, "policy": str(args.policy),
            "completer": str(args.completer or args.policy),
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
        if toolset is not None:
            toolset.close()
        destroy_distributed()
    return out


def _text_solutions(policy, records, sampling, step_pattern: str, args: argparse.Namespace):
    """(items, empty solutions dropped, perturbation plans): the policy's solutions split into text steps, and the
    perturbed copies of ``--perturb-fraction`` of them (``prm.perturb``) after them."""
    from grpo_mega.rollout.base import derive_seed
    from prm.perturb import perturbed_solutions, plan_perturbations

    solutions = sample_solutions(policy.engine, records, samples_per_prompt=args.samples_per_prompt,
                                 sampling=sampling, step_pattern=step_pattern, seed=derive_seed(args.seed, 0))
    plans = plan_perturbations([item.steps for item in solutions.items], args.perturb_fraction,
                               derive_seed(args.seed, 2))
    items = solutions.items + perturbed_solutions(
        policy.engine, policy.tokenizer, solutions.items, plans, sampling=sampling, step_pattern=step_pattern,
        seed=derive_seed(args.seed, 3))
    return items, solutions.dropped_empty, plans
