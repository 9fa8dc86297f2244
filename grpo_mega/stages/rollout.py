"""The rollout stage: prompts -> G completions each -> rewards -> dynamic-sampling filter.

Every rank runs it on the same prompts (SPMD) and ends with the same :class:`RolloutBatch`: generation is split
over ranks and gathered (``generate_across_ranks``), rewards are scored once per completion and gathered
(``score_across_ranks``). Sampling seeds are derived from (seed, step, round) and then the rank (and, in vLLM,
the prompt), never from a call counter, so a resumed run samples exactly what an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from grpo_mega.algo import overlong_penalty
from grpo_mega.config import AlgorithmConfig, RewardConfig
from grpo_mega.data.prompts import PromptBatches, PromptRecord
from grpo_mega.data.step_split import default_step_pattern, split_steps
from grpo_mega.reward import RewardError, SampleReward, get_reward_function, score_across_ranks
from grpo_mega.reward.adapters import TRAJECTORY_MESSAGES, RewardRows
from grpo_mega.reward.compute import component_metrics
from grpo_mega.reward.registry import build_reward_function
from grpo_mega.reward.answer_span import final_answer_end
from grpo_mega.rollout.base import Completion, RolloutEngine, SamplingConfig, derive_seed
from grpo_mega.rollout.distributed import generate_across_ranks
from grpo_mega.rollout.turn_messages import trajectory_messages
from grpo_mega.rollout.turn_metrics import turn_metrics
from grpo_mega.run.failure import phase
from grpo_mega.stages.answer_guard import AnswerGuard
from grpo_mega.stages.step_tokens import one_step_per_token, step_end_tokens
from grpo_mega.stages.turn_steps import turn_step_ends, turn_views


@dataclass
class RolloutBatch:
    """Prompts and their G completions (grouped contiguously: prompt i's at rows i*G .. i*G+G-1) with one reward
    per completion and, when the reward function gives them, per-step rewards."""

    records: list[PromptRecord]
    completions: list[Completion]
    rewards: torch.Tensor
    """[N] final rewards (verifier + format + overlong terms)."""
    scores: torch.Tensor
    """[N] the verifier's score alone (``critic/score``)."""
    step_rewards: list[list[float]] | None = None
    """Per completion, the reward of each step (None when the reward function gives no steps)."""
    step_ends: list[list[int]] | None = None
    """Per completion, the index within the response of each step's last token, strictly increasing."""

    def __len__(self) -> int:
        return len(self.records)

    @property
    def group_size(self) -> int:
        return len(self.completions) // max(len(self.records), 1)

    def select_groups(self, groups: Sequence[int]) -> "RolloutBatch":
        """The batch made of the given groups (prompts), in that order."""
        G = self.group_size
        rows = [g * G + i for g in groups for i in range(G)]
        pick = (lambda values: [values[r] for r in rows]) if rows else (lambda values: [])
        return RolloutBatch(
            [self.records[g] for g in groups], pick(self.completions), self.rewards[rows], self.scores[rows],
            pick(self.step_rewards) if self.step_rewards is not None else None,
            pick(self.step_ends) if self.step_ends is not None else None,
        )

    def first_groups(self, count: int) -> "RolloutBatch":
        return self.select_groups(range(min(count, len(self))))

    @staticmethod
    def concat(first: "RolloutBatch | None", second: "RolloutBatch") -> "RolloutBatch":
        if first is None:
            return second
        if (first.step_rewards is None) != (second.step_rewards is None):
            raise ValueError("cannot join rollout batches with and without step rewards")
        steps = first.step_rewards is not None
        return RolloutBatch(
            first.records + second.records, first.completions + second.completions,
            torch.cat([first.rewards, second.rewards]), torch.cat([first.scores, second.scores]),
            first.step_rewards + second.step_rewards if steps else None,
            first.step_ends + second.step_ends if steps else None,
        )


def keep_informative_groups(batch: RolloutBatch, group_size: int, *, by_steps: bool = False) -> RolloutBatch:
    """Dynamic sampling (DAPO): drop the groups whose advantages are all 0: groups whose rewards are all equal,
    or with ``by_steps`` (process supervision) groups whose pooled step rewards are all equal."""
    if by_steps:
        pooled = [[r for row in batch.step_rewards[g * group_size:(g + 1) * group_size] for r in row]
                  for g in range(len(batch))]
        keep = [g for g, rewards in enumerate(pooled) if rewards and max(rewards) > min(rewards)]
        return batch.select_groups(keep)
    grouped = batch.rewards.reshape(-1, group_size)
    keep = (grouped.max(dim=1).values - grouped.min(dim=1).values) > 0
    return batch.select_groups(keep.nonzero().flatten().tolist())


class RolloutStage:
    """Samples, scores and filters the prompts of one GRPO step (collective: every rank calls ``run``)."""

    def __init__(
        self, engine: RolloutEngine, prompts: PromptBatches, sampling: SamplingConfig, reward: RewardConfig,
        algorithm: AlgorithmConfig, *, seed: int, decode, step_reward_source: Callable | None = None,
        answer_guard: AnswerGuard | None = None, step_pattern: str | None = None,
        batch_step_rewards: Callable[[RolloutBatch], tuple[RolloutBatch, dict[str, float]]] | None = None,
        row_layout: RewardRows = RewardRows(), turn_steps: bool = False,
    ):
        """``step_reward_source``: where process supervision's step rewards come from
        (``grpo_mega.stages.step_sources``; e.g. ``grpo_mega.stages.process_reward.PRMStepRewards``) called as
        ``(prompts, texts, outcome scores, rows' extra fields, completions=...) -> (step rewards, step ends in
        characters, metrics)``; None: the reward function's own. A source with a ``sampler`` (the tree) samples the
        groups in place of ``generate_across_ranks``.
        ``answer_guard``: applied here to the reward function's own step rewards (a step-reward source applies its
        own), and its answer locator counts the completions without an answer or with text after it.
        ``step_pattern``: the steps counted in ``rollout/pieces_per_completion`` (None: the default of the rows).
        ``batch_step_rewards``: step rewards made from each sampling round's whole scored batch, before dynamic
        sampling (the implicit PRM, ``implicit_prm.before_dynamic_sampling``): ``batch -> (batch with step rewards,
        metrics)``.
        ``row_layout``: what a TRL reward function needs to know of the rows (``rollout_setup.row_layout_of``).
        ``turn_steps``: each assistant turn of a multi-turn rollout is a step (``process_reward.steps: turns``): the
        reward function is given the turns (``turns=``, ``grpo_mega.stages.turn_steps.turn_views``) and returns
        ``TurnRewards``, or the step-reward source scores the turns; the steps end at the turns' last model
        tokens."""
        self.engine, self.prompts, self.sampling = engine, prompts, sampling
        self.reward, self.algorithm, self.seed, self.decode = reward, algorithm, seed, decode
        self.reward_fn = build_reward_function(reward.function, reward.functions, reward.weights, row_layout)
        self.format_fn = get_reward_function(reward.format_function, row_layout) if reward.format_weight else None
        self.step_reward_source = step_reward_source
        self.sampler = getattr(step_reward_source, "sampler", None)
        self.answer_guard = answer_guard
        self.step_pattern = step_pattern
        self.batch_step_rewards = batch_step_rewards
        self.turn_steps = turn_steps
        self._step_metrics: list[dict[str, float]] = []
        self._verifier_failures: list[str] = []  # this step's failed verifier calls, their messages

    def run(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Up to ``rollout_batch_size`` groups; with dynamic sampling only groups whose rewards differ, sampling
        more prompts for up to ``max_sampling_rounds`` rounds."""
        alg, G = self.algorithm, self.sampling.n
        kept, sampled_scores, sampled_lengths, failures, generated_tokens = None, [], [], 0, 0
        self._step_metrics, self._verifier_failures = [], []
        rounds = alg.max_sampling_rounds if alg.dynamic_sampling else 1
        for round_index in range(rounds):
            records = next(self.prompts)
            completions = self.generate(records, derive_seed(self.seed, step, round_index))
            generated_tokens += self.generated_tokens(completions)
            scored, round_failures = self.score(records, completions)
            failures += round_failures
            sampled_scores.append(scored.scores)
            sampled_lengths.extend(len(c.response_ids) for c in completions)
            if self.batch_step_rewards is not None:
                scored, batch_metrics = self.batch_step_rewards(scored)
                self._step_metrics.append(batch_metrics)
            if alg.dynamic_sampling:
                # bounded turn credit gives a group of equal outcomes no gradient, whatever its turns' rewards
                by_steps = (alg.supervision == "process" and scored.step_rewards is not None
                            and not (self.turn_steps and alg.turn_credit == "bounded"))
                scored = keep_informative_groups(scored, G, by_steps=by_steps)
            kept = RolloutBatch.concat(kept, scored)
            if len(kept) >= alg.rollout_batch_size:
                break
        kept = kept.first_groups(alg.rollout_batch_size)
        every_sample = torch.cat(sampled_scores)
        with phase("reward scoring"):
            stop_if_every_reward_failed(self._verifier_failures, len(every_sample), step)
        lengths = torch.tensor(sampled_lengths, dtype=torch.float32)
        metrics = {
            # critic/score/* and response_length/* describe the trained batch (after dynamic sampling, as in verl);
            # rollout/sampled_* describe every sample, so a step without an update still logs what it generated.
            "rollout/sampled_score/mean": float(every_sample.mean()),
            "rollout/sampled_response_length/mean": float(lengths.mean()),
            "rollout/sampled_response_length/max": float(lengths.max()),
            "rollout/sampled_response_length/clip_ratio": float((lengths >= alg.response_length).float().mean()),
            # groups of G equal outcome scores: no outcome-supervised gradient (what dynamic sampling filters out)
            "rollout/zero_signal_group_fraction": zero_signal_group_fraction(every_sample, G),
            "rollout/kept_group_fraction": len(kept) * G / len(every_sample),
            "rollout/sampling_rounds": float(round_index + 1),
            "reward/failures": float(failures),
            # the tokens the engine generated this step, every round's (a tree's shared prefixes once)
            "rollout/generated_tokens": float(generated_tokens),
            **_merge_rounds(self._step_metrics),
        }
        return kept, metrics

    def generate(self, records: Sequence[PromptRecord], call_seed: int) -> list[Completion]:
        """G completions of each prompt, from the step-reward source's sampler (the tree) or as G chains (with
        ``rollout.multi_turn``, G multi-turn rollouts: the engine is the turn loop, given each row's tool
        arguments; their metrics go into the step's)."""
        prompt_ids = [r.prompt_ids for r in records]
        multi_turn = hasattr(self.engine, "pop_tool_seconds")
        if self.sampler is not None:  # the tree by turns is given each row's tool arguments too
            extra = {"tool_kwargs": [row_tool_kwargs(r.extra) for r in records]} if multi_turn else {}
            completions = self.sampler.generate(self.engine, prompt_ids, self.sampling, call_seed=call_seed, **extra)
            self._step_metrics.append(self.sampler.metrics)
            return completions
        if not multi_turn:  # a single-turn engine
            return generate_across_ranks(self.engine, prompt_ids, self.sampling, call_seed=call_seed)
        completions = generate_across_ranks(self.engine, prompt_ids, self.sampling, call_seed=call_seed,
                                            tool_kwargs=[row_tool_kwargs(r.extra) for r in records])
        self._step_metrics.append({**turn_metrics(completions), "timing_s/tools": self.engine.pop_tool_seconds()})
        return completions

    def generated_tokens(self, completions: Sequence[Completion]) -> int:
        """The tokens the policy generated (a tree's shared prefixes once; a multi-turn rollout's tool turns not)."""
        if self.sampler is not None:
            return int(self.sampler.metrics["rollout/tree/generated_tokens"])
        return sum(sum(c.policy_mask) for c in completions)

    def score(self, records: Sequence[PromptRecord], completions: Sequence[Completion]) -> tuple[RolloutBatch, int]:
        """Reward every completion once (sharded over ranks); adds the weighted format reward and the DAPO overlong
        penalty when configured. Returns the batch and the number of failed reward calls."""
        G, alg, on_error = self.sampling.n, self.algorithm, self.reward.on_error
        extras = [r.extra for r in records for _ in range(G)]
        if any(c.turns is not None for c in completions):  # multi-turn: the trajectory as messages (TRL's form)
            extras = [{**extra, TRAJECTORY_MESSAGES: trajectory_messages(c, self.decode)}
                      for extra, c in zip(extras, completions)]
        columns = (
            [r.prompt for r in records for _ in range(G)],
            [c.text for c in completions],
            [r.answer for r in records for _ in range(G)],
            extras,
        )
        if self.turn_steps and self.step_reward_source is None:  # the reward function scores the turns
            columns = (*columns[:3], [{**extra, "turns": turn_views(c, self.decode)}
                                      for extra, c in zip(columns[3], completions)])
        with phase("reward scoring", bounded=True):
            results = score_across_ranks(self.reward_fn, *columns, on_error=on_error)
        self._step_metrics.append(component_metrics(results))  # reward/<func>/mean of reward.functions, as TRL's
        pattern = self.step_pattern or default_step_pattern(columns[3])
        self._step_metrics.append(answer_metrics(columns[1], self.answer_guard, pattern))
        if self.answer_guard is not None and self.step_reward_source is None and not self.turn_steps:
            results = [self.answer_guard.guard_reward(r, text) for r, text in zip(results, columns[1])]
        if self.step_reward_source is not None:
            with phase("prm scoring", bounded=True):
                step_rewards, step_ends, step_metrics = self.step_reward_source(
                    columns[0], columns[1], [r.score for r in results], columns[3], completions=completions)
            field = "turn_rewards" if self.turn_steps else "step_rewards"  # a turn source's ends are the turns'
            results = [dataclasses.replace(r, **{field: rewards}, step_ends=None if self.turn_steps else ends)
                       for r, rewards, ends in zip(results, step_rewards, step_ends)]
            self._step_metrics.append(step_metrics)
        self._verifier_failures += [r.error for r in results if r.failed]
        failures = sum(r.failed for r in results)
        scores = torch.tensor([r.score for r in results], dtype=torch.float32)
        rewards = scores.clone()
        if self.format_fn is not None:
            format_results = score_across_ranks(self.format_fn, *columns, on_error=on_error)
            failures += sum(r.failed for r in format_results)
            rewards += self.reward.format_weight * torch.tensor([r.score for r in format_results])
        if alg.overlong_buffer:
            lengths = torch.tensor([len(c.response_ids) for c in completions])
            rewards += overlong_penalty(lengths, alg.response_length, alg.overlong_buffer, alg.overlong_penalty)
        step_rewards, step_ends = (turn_step_rewards(results, completions) if self.turn_steps
                                   else self._steps(results, completions))
        return RolloutBatch(list(records), list(completions), rewards, scores, step_rewards, step_ends), failures

    def _steps(self, results: list[SampleReward], completions: Sequence[Completion]):
        """Per-step rewards with token ends, when the reward function gave steps for any completion (a failed or
        step-less sample then has no steps, so its process advantages are 0)."""
        if all(r.step_rewards is None for r in results):
            return None, None
        step_rewards, step_ends = [], []
        for result, completion in zip(results, completions):
            rewards, ends = [], []
            if result.step_rewards and completion.response_ids:
                token_ends = step_end_tokens(self.decode, completion.response_ids, result.step_ends)
                rewards, ends = one_step_per_token(result.step_rewards, token_ends)
            step_rewards.append(rewards)
            step_ends.append(ends)
        return step_rewards, step_ends


def turn_step_rewards(results: Sequence[SampleReward], completions: Sequence[Completion]):
    """Per completion, one reward per turn step (``SampleReward.turn_rewards``) ending at the turn's last model token
    (``turn_step_ends``). A failed sample's turns get 0 (its outcome score is 0 too); a reward function that gave
    no turn rewards, or a count other than the turns', is an error naming the completion."""
    step_rewards, step_ends = [], []
    for row, (result, completion) in enumerate(zip(results, completions)):
        ends = turn_step_ends(completion)
        rewards = result.turn_rewards
        if rewards is None and result.failed:
            rewards = [0.0] * len(ends)
        if rewards is None:
            raise RewardError(f"completion {row}: process_reward.steps=turns needs a reward per assistant turn, and "
                              "the reward function returned a score alone: return TurnRewards (e.g. "
                              "reward.function=tool_task_turns) or use process_reward.source=tool or prm")
        if len(rewards) != len(ends):
            raise RewardError(f"completion {row} has {len(ends)} assistant turns but {len(rewards)} turn rewards")
        step_rewards.append(list(rewards))
        step_ends.append(ends)
    return step_rewards, step_ends


def row_tool_kwargs(extra: dict) -> dict:
    """A row's per-tool keyword arguments: verl's ``extra_info.tools_kwargs`` (or a top-level ``tools_kwargs``
    column), ``{tool name: {argument: value}}``; verl's ``create_kwargs`` / ``execute_kwargs`` of a tool are merged
    into one mapping."""
    info = extra.get("extra_info")
    found = (info.get("tools_kwargs") if isinstance(info, dict) else None) or extra.get("tools_kwargs") or {}
    if not isinstance(found, dict):
        return {}
    merged = {}
    for name, value in found.items():
        if isinstance(value, dict) and ({"create_kwargs", "execute_kwargs"} & set(value)):
            value = {**(value.get("create_kwargs") or {}), **(value.get("execute_kwargs") or {})}
        merged[name] = dict(value) if isinstance(value, dict) else {}
    return merged


def stop_if_every_reward_failed(errors: Sequence[str], samples: int, step: int) -> None:
    """RewardError when the verifier failed on every one of a step's ``samples`` (``errors``: one per failed
    call): under ``reward.on_error=zero`` the step would train on rewards that are all 0, and so would every step
    after it (a wrong signature, a column the rows lack), ending "done" having learnt nothing."""
    if samples and len(errors) >= samples:
        raise RewardError(f"the reward function failed on all {samples} completions of step {step} (reward.on_error="
                          f"zero would train on rewards of 0 alone); the first: {errors[0]}")


def answer_metrics(texts: Sequence[str], guard: AnswerGuard | None, step_pattern: str) -> dict[str, float]:
    """The share of completions with no final answer, and of those with text (other than whitespace) after their
    first final answer (the answer guard's locator, else the default one), and the mean number of pieces
    (``step_pattern``'s steps, the text after the answer included) per completion: what padding would raise."""
    locate = guard.answer_end if guard is not None else final_answer_end
    ends = [locate(text) for text in texts]
    count = max(len(texts), 1)
    return {
        "rollout/pieces_per_completion": sum(len(split_steps(text, step_pattern)) for text in texts) / count,
        "rollout/no_answer_fraction": sum(end is None for end in ends) / count,
        "rollout/text_after_answer_fraction": sum(end is not None and bool(text[end:].strip())
                                                  for text, end in zip(texts, ends)) / count,
    }


def zero_signal_group_fraction(scores: torch.Tensor, group_size: int) -> float:
    """The share of groups (``group_size`` consecutive scores) whose scores are all equal."""
    groups = scores.view(-1, group_size)
    return float((groups == groups[:, :1]).all(dim=1).float().mean())


def _merge_rounds(per_round: list[dict[str, float]]) -> dict[str, float]:
    """Step-reward metrics of the sampling rounds of a step: times summed, the rest averaged over rounds."""
    merged: dict[str, float] = {}
    for key in {key for metrics in per_round for key in metrics}:
        values = [metrics[key] for metrics in per_round if key in metrics]
        merged[key] = sum(values) if key.startswith("timing_s/") else sum(values) / len(values)
    return merged


def sampling_from_config(cfg) -> SamplingConfig:
    """The rollout sampling settings of a GRPO config (G completions per prompt)."""
    alg = cfg.algorithm
    return SamplingConfig(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        max_new_tokens=alg.response_length, stop=list(cfg.rollout.stop), n=alg.num_return_sequences_in_group,
    )

