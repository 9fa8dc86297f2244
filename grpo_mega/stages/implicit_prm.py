"""The implicit PRM of process supervision (``process_reward.source: implicit``; PRIME, Cui et al. 2502.01456): a
language model of the policy's architecture, trained online on the verifier's outcomes, whose token rewards
``beta * (log pi_phi - log pi_ref)`` become the step rewards (``grpo_mega.algo.implicit_reward``).

Each step, after the rollout stage and before the advantages (:meth:`ImplicitPRM.run`; with
``implicit_prm.before_dynamic_sampling`` inside the rollout stage, on every sampled group before dynamic sampling,
:meth:`ImplicitPRM.run_timed`):

1. one optimizer step of the implicit PRM on the batch: PRIME's cross-entropy of ``sigmoid(sum_t r_t)`` against the
   verifier's score in [0, 1] (with ``implicit_prm.accuracy_filter`` only on the prompts whose group accuracy lies
   in the bounds);
2. the PRM's token rewards on every completion, at temperature 1 (with the update's own log-probs, or a forward of
   the updated PRM; the reference's log-probs are computed once for both);
3. step scores over the same steps the learned PRM scores (or every token of them: ``implicit_prm.steps:
   tokens``): the text through the first final answer split by
   ``process_reward.step_pattern`` (and ``max_counted_steps``), a missing answer's step scored
   ``missing_answer_score`` (the answer guard), each step's score the sum of its tokens' rewards (or the sigmoid of the
   implicit Q-value at its end: ``implicit_prm.step_value``); then ``process_reward.step_reward``, the weight and
   ``outcome_on_last_step`` exactly as for a learned PRM (``shape_step_rewards``).

By default (``implicit_prm.update: after``, PRIME's order without a third pass) step 2 scores with the log-probs
the update's own forward computed (``MegatronEngine.train_step_with_outputs``): the PRM before this batch's update,
so the first step's rewards are all 0 (a PRM equal to its reference gives r_t = 0 everywhere). ``update: before``
is verl's PRIME recipe (the "double forward"): the rewards then come from a PRM that has seen this batch's
outcomes, at a third pass's cost. Collective: every rank calls with the same batch. Every evaluation also scores
the held-out completions (:meth:`ImplicitPRM.evaluation_metrics`, ``grpo_mega.stages.implicit_prm_eval``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from grpo_mega.algo import cut_at_answer
from grpo_mega.algo.implicit_reward import (
    groups_within_accuracy,
    implicit_outcome_loss,
    implicit_step_scores,
    implicit_token_rewards,
    outcome_prediction_accuracy,
)
from grpo_mega.checkpoint.initial_weights import load_initial_weights
from grpo_mega.config import GRPOConfig
from grpo_mega.data.batch import mask_response_tokens, sequences_to_batch
from grpo_mega.data.step_split import default_step_pattern, step_char_ends
from grpo_mega.engine import build_policy_engine, build_reference_engine
from grpo_mega.engine.batching import slice_rows
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.rollout.base import Completion
from grpo_mega.stages.answer_guard import AnswerGuard, answer_guard_of
from grpo_mega.stages.implicit_prm_eval import (
    outcome_figures,
    piece_scores,
    scored_pieces,
    step_detection,
    synthetic_truth,
)
from grpo_mega.stages.process_reward import segment_completion, shape_step_rewards, step_reward_starts
from grpo_mega.stages.rollout import RolloutBatch
from grpo_mega.stages.step_tokens import one_step_per_token, step_end_tokens
from grpo_mega.stages.turn_steps import turn_step_ends

COMPANION_NAME = "implicit_prm"
"""The implicit PRM's subfolder in each policy checkpoint (``grpo_mega.checkpoint.companions``)."""

_MISSING = -1.0
"""Marks the answer guard's missing-answer step among the step indices (which are >= 0)."""


def implicit_prm_loss_fn(beta: float):
    """The engine's ``LossFn`` of the implicit PRM: its share of ``implicit_outcome_loss`` over the batch's rows
    with response tokens (``scale.global_seqs``), and the share of them whose outcome it predicts right."""

    def loss_fn(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor], scale):
        logprobs = outputs["logprobs"]
        mask = micro["loss_mask"]
        rewards = implicit_token_rewards(logprobs, micro["ref_logprobs"].to(logprobs.dtype), mask, beta)
        rows = mask.sum(dim=1) > 0
        labels = micro["outcome_labels"].to(logprobs.dtype)
        loss = implicit_outcome_loss(rewards[rows], labels[rows], num_completions=scale.global_seqs)
        predicted = rewards.detach().sum(dim=1)[rows] > 0
        correct = (predicted == (labels[rows] >= 0.5)).float().sum()
        return loss, {"outcome_accuracy": correct / scale.global_seqs}

    return loss_fn


def outcome_labels(scores: torch.Tensor) -> torch.Tensor:
    """The verifier's scores as the implicit PRM's labels; ValueError unless every one is in [0, 1]."""
    if scores.numel() and not bool(((scores >= 0) & (scores <= 1)).all()):
        raise ValueError(f"process_reward.source=implicit trains on the verifier's score as a label in [0, 1], but "
                         f"reward.function gave scores in [{float(scores.min())}, {float(scores.max())}]")
    return scores.float()


class ImplicitPRM:
    """The implicit PRM's engine and reference, and its step of GRPO (:meth:`run`)."""

    def __init__(self, engine, reference, cfg: GRPOConfig, *, decode, pad_id: int, owns_reference: bool,
                 answer_guard: AnswerGuard | None = None):
        self.engine, self.reference, self.decode, self.pad_id = engine, reference, decode, pad_id
        self.settings, self.process = cfg.implicit_prm, cfg.process_reward
        self.group_size = cfg.algorithm.num_return_sequences_in_group
        self.owns_reference = owns_reference
        self.answer_guard = answer_guard
        self.loss_fn = implicit_prm_loss_fn(self.settings.beta)
        self.seed = cfg.parallel.seed
        self.before_sampling = cfg.implicit_prm.before_dynamic_sampling
        """Whether it runs inside the rollout stage, before dynamic sampling (:meth:`run_timed`), or after it."""

    def companions(self) -> dict:
        """What the harness saves and resumes beside the policy: the trained engine (the reference is fixed)."""
        return {COMPANION_NAME: self.engine}

    def load_initial_weights(self, source) -> None:
        """The implicit PRM's initial weights (a run that resumes restores them from the checkpoint instead)."""
        load_initial_weights(self.engine, source)

    def load_reference(self, source) -> None:
        """The reference's weights, unless it is the policy's KL reference (loaded by the trainer): ``source``'s,
        or with none the implicit PRM's own random initialisation (call before a resume loads its trained weights:
        the initialisation is the same in every run of the seed)."""
        if not self.owns_reference:
            return
        if source is None:
            self.reference.load_hf_weights(dict(self.engine.export_hf_weights()))
        else:
            load_initial_weights(self.reference, source)

    def lr_schedule_step(self) -> None:
        """Advance the implicit PRM's learning-rate schedule by one trainer step (as the policy's)."""
        self.engine.lr_schedule_step()

    def run(self, groups: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """Update the implicit PRM on ``groups``' outcomes, then give every completion its step rewards and step
        ends (response token indices), replacing any the reward function gave. Returns the batch and the
        ``implicit_prm/*`` metrics, with the seconds of its parts (``timing_s/implicit_prm_reference``, ``_update``,
        ``_scoring``: the scoring forward, or under ``update: after`` the left-out rows' forward; ``_steps``)."""
        begin = time.perf_counter()
        rows = self._rows(groups.completions)
        labels = outcome_labels(groups.scores)
        rows["ref_logprobs"], _ = self.reference.forward_logprobs(rows, loss_tokens_only=True)
        seconds = {"reference": time.perf_counter() - begin}
        if self.settings.update == "after":  # scored with the update's own forward: the PRM before this update
            metrics, prm_logprobs = self._update_after_scoring(rows, labels)
            token_rewards = implicit_token_rewards(prm_logprobs, rows["ref_logprobs"].float(), rows["loss_mask"],
                                                   self.settings.beta)
        else:
            metrics, _ = self._update(rows, labels)
            begin = time.perf_counter()
            token_rewards = self._token_rewards(rows, rows["ref_logprobs"])
            seconds["scoring"] = time.perf_counter() - begin
        begin = time.perf_counter()
        step_rewards, step_ends = self._step_rewards(groups, token_rewards, rows["prompt_lengths"])
        seconds["steps"] = time.perf_counter() - begin
        metrics.update({f"timing_s/implicit_prm_{part}": value for part, value in seconds.items()})
        mask = rows["loss_mask"].bool()
        metrics["implicit_prm/token_reward_mean"] = float(token_rewards[mask].mean()) if mask.any() else 0.0
        metrics["implicit_prm/scored_outcome_accuracy"] = outcome_prediction_accuracy(token_rewards, labels)
        return dataclasses.replace(groups, step_rewards=step_rewards, step_ends=step_ends), metrics

    def _rows(self, completions: Sequence[Completion]) -> dict[str, torch.Tensor]:
        """``prompt + response`` rows; a multi-turn rollout's tool tokens out of ``loss_mask`` (the PRM neither
        learns from nor rewards what the tools wrote)."""
        rows = sequences_to_batch([c.prompt_ids for c in completions], [c.response_ids for c in completions],
                                  self.pad_id)
        mask_response_tokens(rows, [c.response_mask for c in completions])
        return rows

    def _token_rewards(self, rows: dict[str, torch.Tensor], ref_logprobs: torch.Tensor) -> torch.Tensor:
        """The implicit PRM's token rewards on ``rows`` (a forward pass) against the reference's log-probs."""
        prm_logprobs, _ = self.engine.forward_logprobs(rows, loss_tokens_only=True)
        return implicit_token_rewards(prm_logprobs.float(), ref_logprobs.float(), rows["loss_mask"],
                                      self.settings.beta)

    def run_timed(self, groups: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """:meth:`run` inside the rollout stage (``implicit_prm.before_dynamic_sampling``), its seconds as
        ``timing_s/implicit_prm`` (part of the step's generation seconds, as the learned PRM's scoring is)."""
        begin = time.perf_counter()
        groups, metrics = self.run(groups)
        return groups, {**metrics, "timing_s/implicit_prm": time.perf_counter() - begin}

    def evaluation_metrics(self, records: Sequence[PromptRecord], completions: Sequence[Completion],
                           outcomes: Sequence[float]) -> dict[str, float]:
        """``eval/implicit_prm/*`` of the held-out evaluation's completions (``grpo_mega.stages.implicit_prm_eval``):
        the outcome prediction, and on the synthetic task the step detection against the step checker
        (collective: every rank calls with the same completions)."""
        rows = self._rows(completions)
        ref_logprobs, _ = self.reference.forward_logprobs(rows, loss_tokens_only=True)
        token_rewards = self._token_rewards(rows, ref_logprobs)
        metrics = outcome_figures(token_rewards, outcomes)
        if not records or not all("steps" in record.extra for record in records):
            return metrics
        pattern = self.process.step_pattern or default_step_pattern([record.extra for record in records])
        scores, truths = [], []
        for row, (record, completion) in enumerate(zip(records, completions)):
            answer_end = self.answer_guard.answer_end(completion.text) if self.answer_guard is not None else None
            pieces = scored_pieces(completion.text, answer_end, pattern, self.process.max_counted_steps)
            begin = int(rows["prompt_lengths"][row])
            response = token_rewards[row, begin : begin + len(completion.response_ids)]
            scores.append(piece_scores(response, pieces, completion.response_ids, self.decode,
                                       self.settings.step_value) if pieces and completion.response_ids else [])
            truths.append(synthetic_truth(record.extra, pieces) if scores[-1] else [])
        return {**metrics, **step_detection(scores, truths, self.settings.step_value, seed=self.seed)}

    def _kept_rows(self, labels: torch.Tensor) -> torch.Tensor:
        """The rows the update trains on: those of the groups the accuracy filter keeps (all without it)."""
        settings = self.settings
        if settings.accuracy_filter:
            keep = groups_within_accuracy(labels, self.group_size, settings.accuracy_low, settings.accuracy_high)
        else:
            keep = torch.ones_like(labels, dtype=torch.bool)
        return keep.nonzero().flatten()

    def _update(self, rows: dict[str, torch.Tensor], labels: torch.Tensor, *,
                keep_logprobs: bool = False) -> tuple[dict[str, float], torch.Tensor | None]:
        """One optimizer step on the rows the accuracy filter keeps; its metrics. ``keep_logprobs``: also the
        log-probs its forward computed, [kept rows, L] (None when no row is kept)."""
        kept = self._kept_rows(labels)
        metrics = {"implicit_prm/update_fraction": float(len(kept)) / max(len(labels), 1)}
        if len(kept) == 0:
            return metrics, None
        batch = slice_rows({**rows, "outcome_labels": labels}, kept, rows["input_ids"].shape[1])
        begin = time.perf_counter()
        self.engine.reload_from_host()  # parallel.offload_during_rollout moved its state off the device
        result, outputs = self.engine.train_step_with_outputs(batch, self.loss_fn,
                                                              ("logprobs",) if keep_logprobs else ())
        metrics["timing_s/implicit_prm_update"] = time.perf_counter() - begin
        metrics.update({"implicit_prm/loss": result["loss"], "implicit_prm/grad_norm": result["grad_norm"],
                        "implicit_prm/lr": result["lr"],
                        "implicit_prm/outcome_accuracy": result.get("outcome_accuracy", 0.0)})
        return metrics, outputs.get("logprobs")

    def _update_after_scoring(self, rows: dict[str, torch.Tensor],
                              labels: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """``implicit_prm.update: after``: the update's metrics, and every row's log-probs under the PRM before the
        update, [B, L] fp32: the update's forward gives the rows it trains on; the rows the accuracy filter leaves
        out get a forward of their own, first (before the weights move). A forward of only those rows costs less
        than carrying them through the update at zero loss weight, whose backward would still run over them."""
        kept = self._kept_rows(labels)
        left_out = torch.ones(len(labels), dtype=torch.bool)
        left_out[kept] = False
        length = rows["input_ids"].shape[1]
        logprobs = torch.zeros(rows["input_ids"].shape, dtype=torch.float32)
        begin = time.perf_counter()
        if left_out.any():
            others = left_out.nonzero().flatten()
            left_out_rows = slice_rows(rows, others, length)
            logprobs[others] = self.engine.forward_logprobs(left_out_rows, loss_tokens_only=True)[0].float()
        scoring = time.perf_counter() - begin
        metrics, trained = self._update(rows, labels, keep_logprobs=True)
        metrics["timing_s/implicit_prm_scoring"] = scoring
        if trained is not None:
            logprobs[kept] = trained
        return metrics, logprobs

    def _step_rewards(self, groups: RolloutBatch, token_rewards: torch.Tensor, prompt_lengths: torch.Tensor):
        """Per completion, its step rewards and the response index of each step's last token."""
        G, process = groups.group_size, self.process
        extras = [record.extra for record in groups.records for _ in range(G)]
        pattern = process.step_pattern or default_step_pattern(extras)
        outcomes = [float(score) for score in groups.scores]
        starts = step_reward_starts(process, [record.prompt for record in groups.records for _ in range(G)], outcomes)
        all_rewards, all_ends = [], []
        for row, completion in enumerate(groups.completions):
            if process.steps == "turns":  # each assistant turn a step: its model tokens' rewards summed (tool: 0)
                ends, missing = turn_step_ends(completion), False
            else:
                ends, missing = self._token_step_ends(completion.text, completion.response_ids, pattern)
            if not ends:
                all_rewards.append([])
                all_ends.append([])
                continue
            if self.settings.steps == "tokens":  # every token through the scored text; then the missing answer's
                ends = list(range(ends[-1] + (0 if missing else 1))) + ([ends[-1]] if missing else [])
            begin = int(prompt_lengths[row])
            response = token_rewards[row, begin : begin + len(completion.response_ids)]
            scores = implicit_step_scores(response[None], torch.tensor([ends]), self.settings.step_value)[0].tolist()
            if missing:
                scores[-1] = process.missing_answer_score
            all_rewards.append(shape_step_rewards(scores, outcomes[row], process, start=starts[row]))
            all_ends.append(ends)
        return all_rewards, all_ends

    def _token_step_ends(self, text: str, response_ids, pattern: str) -> tuple[list[int], bool]:
        """The response index of each step's last token (one step per token, as the rollout stage keeps them),
        and whether the last step is the answer guard's missing-answer step."""
        if not response_ids:
            return [], False
        guard = self.answer_guard
        answer_end = guard.answer_end(text) if guard is not None else None
        scored = text if answer_end is None else text[:answer_end]
        char_ends = step_char_ends(segment_completion(scored, pattern, self.process.max_counted_steps))
        marks = [float(index) for index in range(len(char_ends))]
        if guard is not None:
            marks, char_ends = cut_at_answer(marks, char_ends, answer_end, missing_value=_MISSING,
                                             missing_end=len(text) + 1)
        if not char_ends:
            return [], False
        marks, ends = one_step_per_token(marks, step_end_tokens(self.decode, response_ids, char_ends))
        return ends, marks[-1] == _MISSING


def build_implicit_prm(cfg: GRPOConfig, hf_config, *, kl_reference, decode, pad_id: int) -> ImplicitPRM:
    """The implicit PRM at the policy's layout and engine settings (log-probs at temperature 1, its own optimizer:
    ``implicit_prm.optim``), and its reference: the policy's KL reference ``kl_reference`` when that has the same
    weights and temperature (one copy), else a forward-only engine of its own. Weights still to load."""
    shared = dict(max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
                  logprob_chunk_size=cfg.model.logprob_chunk_size, temperature=1.0,
                  logits_in_fp32=cfg.model.logits_in_fp32, share_prompt_prefix=cfg.parallel.share_prompt_prefix,
                  sequence_parallel=cfg.parallel.sequence_parallel)
    engine = build_policy_engine(hf_config, optim=cfg.implicit_prm.optim, total_steps=cfg.trainer.total_steps,
                                 recompute=cfg.parallel.recompute,
                                 distributed_optimizer=cfg.parallel.distributed_optimizer, **shared)
    share = kl_reference is not None and cfg.implicit_prm_shares_kl_reference()
    reference = kl_reference if share else build_reference_engine(hf_config, **shared)
    return ImplicitPRM(engine, reference, cfg, decode=decode, pad_id=pad_id, owns_reference=not share,
                       answer_guard=answer_guard_of(cfg))


def implicit_prm_source(cfg: GRPOConfig):
    """The folder the implicit PRM and its reference start from: ``implicit_prm.init_from``, else
    ``model.init_from``."""
    return cfg.implicit_prm.init_from or cfg.model.init_from
