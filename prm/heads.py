"""The two published PRM head layouts, as heads of the Megatron backbone (``grpo_mega.model.heads``).

Both are called like every head, ``head(backbone, hidden [S, B, H], batch) -> {name: [B, S]}``, and return the
same fp32 outputs at every position t: ``good_logprob`` and ``bad_logprob``, the log-softmax over the two classes
(good, bad) computed from the final hidden state of token t itself (no next-token shift: a step is scored at the
last token of its step tag). The step score is ``exp(good_logprob)``.

- :class:`ClassifierHead` (``classifier``, Qwen2.5-Math-PRM): ``score`` = Linear(H, H) -> ReLU -> Linear(H, 2) on
  the hidden state; class 1 is "good". Its parameters are replicated over tensor-parallel ranks (every TP rank
  holds the same hidden states, so every rank computes the same head and the same head gradients) and live on
  the last pipeline stage as ``head.score.*``.
- :class:`LabelTokenHead` (``lm_tokens``, Math-Shepherd): the LM logits of two label tokens ("+" good, "-" bad),
  from the rows of the backbone's vocab-parallel output matrix; no parameters of its own.
- :class:`StepLikelihoodHead` (``likelihood``): the LM's own probability of the step as written, the smallest
  p(token | everything before it) over the step's tokens; it needs ``batch["step_ids"]`` (which step each token
  belongs to) and returns at every token its step's values, so the step is read at any of its tokens (the scorer
  reads its last). No parameters of its own.

Both compute in fp32 (hidden states and weights upcast), like the LM head's ``logits_in_fp32``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from grpo_mega.model.gpt import HiddenStatesGPTModel
from grpo_mega.model.logprobs import logprobs_and_entropy_at

OUTPUT_NAMES = ("good_logprob", "bad_logprob")
"""What both heads return, per token."""


def two_class_logprobs(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """[..., 2] logits (good, bad) -> {"good_logprob", "bad_logprob"} [...]: the 2-way log-softmax, in fp32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return {"good_logprob": log_probs[..., 0], "bad_logprob": log_probs[..., 1]}


def _two_class_outputs(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """[S, B, 2] logits (good, bad) -> {"good_logprob", "bad_logprob"} [B, S]."""
    return two_class_logprobs(logits.transpose(0, 1))


class ClassifierHead(torch.nn.Module):
    """Qwen2.5-Math-PRM's step classifier: ``score`` = Sequential(Linear(H, H), ReLU, Linear(H, 2)), with biases.

    Parameter names are ``score.0.weight``, ``score.0.bias``, ``score.2.weight``, ``score.2.bias`` (``head.score.*``
    in the model), as in the HF checkpoint. Class 1 of the output is "good", class 0 "bad". Parameters are kept in
    fp32 whatever the backbone's dtype, and the head runs in fp32.

    Megatron treats these plain parameters as replicated: in checkpoints over TP and DP (megatron's default sharded
    state dict of a submodule: one copy saved, replica ids (0, tp rank, dp rank)), in the gradient norm (counted
    on TP rank 0 only), and their gradients are identical on every TP rank because the hidden states are.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        self.score = torch.nn.Sequential(
            torch.nn.Linear(hidden_size, hidden_size, bias=True, dtype=torch.float32),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden_size, 2, bias=True, dtype=torch.float32),
        )

    def forward(
        self,
        backbone: HiddenStatesGPTModel,
        hidden_states: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """{"good_logprob", "bad_logprob"} [B, S] at every position (see the module docstring)."""
        logits = self.score(hidden_states.float())  # [S, B, 2]: (bad, good)
        return _two_class_outputs(logits.flip(-1))


class LabelTokenHead(torch.nn.Module):
    """Math-Shepherd's step score from the LM: logits of the tokens ``good_id`` and ``bad_id``, log-softmaxed.

    ``good_logprob = log P(good) - log(P(good) + P(bad))``, P being the next-token distribution of the LM at the
    tag's last token. Each label's row of the vocab-parallel output matrix lives on one TP rank: every rank
    computes its own rows' logits (zero for rows it does not hold) and a sum over the TP group
    (``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward) gives both logits to
    every rank. The hidden states enter through ``copy_to_tensor_model_parallel_region``, whose backward sums the
    per-rank hidden-state gradients (each covers only the rows that rank holds).
    """

    def __init__(self, good_id: int, bad_id: int) -> None:
        super().__init__()
        if good_id == bad_id:
            raise ValueError(f"the good and bad label tokens must differ, both are id {good_id}")
        if min(good_id, bad_id) < 0:
            raise ValueError(f"label token ids must be non-negative, got good={good_id}, bad={bad_id}")
        self.good_id, self.bad_id = int(good_id), int(bad_id)

    def forward(
        self,
        backbone: HiddenStatesGPTModel,
        hidden_states: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """{"good_logprob", "bad_logprob"} [B, S] at every position (see the class docstring)."""
        vocab = backbone.unpadded_vocab_size
        if max(self.good_id, self.bad_id) >= vocab:
            raise ValueError(
                f"label token ids good={self.good_id}, bad={self.bad_id} are outside the vocabulary of {vocab}"
            )
        group = parallel_state.get_tensor_model_parallel_group()
        weight = backbone.lm_output_weight()  # [V_padded / tp, H], this rank's rows
        start = dist.get_rank(group) * weight.shape[0] if dist.get_world_size(group) > 1 else 0
        ids = torch.tensor([self.good_id, self.bad_id], device=weight.device) - start
        held = (ids >= 0) & (ids < weight.shape[0])
        rows = weight[ids.clamp(0, weight.shape[0] - 1)].float() * held.unsqueeze(-1)  # [2, H], zero if not held
        hidden = copy_to_tensor_model_parallel_region(hidden_states, group=group)
        local_logits = hidden.float() @ rows.t()  # [S, B, 2]
        return _two_class_outputs(reduce_from_tensor_model_parallel_region(local_logits, group=group))


def segment_min(values: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S]: at every position, the minimum of ``values`` over the positions of the same row with the
    same segment id (ids >= 0; rows are independent). Differentiable: the gradient goes to the minimum (shared
    equally between ties)."""
    if values.shape != segment_ids.shape:
        raise ValueError(f"values {tuple(values.shape)} and segment ids {tuple(segment_ids.shape)} differ in shape")
    rows, width = values.shape
    segments = int(segment_ids.max()) + 1 if segment_ids.numel() else 1
    flat = (segment_ids.long() + segments * torch.arange(rows, device=values.device).unsqueeze(1)).reshape(-1)
    start = torch.full((rows * segments,), float("inf"), dtype=values.dtype, device=values.device)
    minima = start.scatter_reduce(0, flat, values.reshape(-1), reduce="amin", include_self=True)
    return minima[flat].reshape(rows, width)


class StepLikelihoodHead(torch.nn.Module):
    """A step's score is the LM's own probability of it: ``min over the step's tokens of p(token | tokens before)``
    (logits at temperature 1 from the backbone's vocab-parallel output matrix, in fp32).

    ``batch["step_ids"]`` [B, S] numbers the tokens of each row: 0 for tokens of no step (prompt, padding), k + 1 for
    the tokens of step k; with ``batch["step_counted"]`` only the tokens marked there enter a step's minimum (its
    result, ``prm.rendering.result_spans``). Returns ``good_logprob`` = log of the step's score and ``bad_logprob`` = log(1 - score) at
    every token of a step (0 / -inf-safe values elsewhere), so the two-class loss and the scorer work unchanged at
    the step's last token. A step that is wrong somewhere has a token the model finds unlikely there: the
    minimum, not the mean, keeps one wrong digit from being averaged away. Training this layout (binary
    cross-entropy on the score) raises the least likely token of a good step and lowers that of a bad one.
    """

    def __init__(self, chunk_size: int = 1024) -> None:
        super().__init__()
        self.chunk_size = chunk_size

    def forward(
        self,
        backbone: HiddenStatesGPTModel,
        hidden_states: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """{"good_logprob", "bad_logprob"} [B, S] (see the class docstring)."""
        if "step_ids" not in batch:
            raise ValueError("the likelihood PRM head needs batch['step_ids'] (render the steps without a tag)")
        input_ids, step_ids = batch["input_ids"], batch["step_ids"]
        step_counted = batch.get("step_counted")
        counted = step_ids > 0 if step_counted is None else (step_ids > 0) & (step_counted > 0)
        # token t's log-probability is predicted at position t - 1 (the first token has none: it is never a step's).
        # Only the positions whose next token is counted go through the output matrix: prompt, padding and, in a
        # packed micro-batch, the G row copies of the prompt would otherwise cost most of the head's products.
        predicts_counted = torch.nn.functional.pad(counted[:, 1:], (0, 1), value=False)  # [B, S]
        next_tokens = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=0)
        next_logprobs, _ = logprobs_and_entropy_at(
            hidden_states, backbone.lm_output_weight(), next_tokens, predicts_counted,
            vocab_size=backbone.unpadded_vocab_size, chunk_size=self.chunk_size, logits_in_fp32=True,
        )
        token_logprobs = torch.nn.functional.pad(next_logprobs[:, :-1], (1, 0), value=0.0)
        return step_likelihood_outputs(token_logprobs, step_ids, step_counted)


def step_likelihood_outputs(token_logprobs: torch.Tensor, step_ids: torch.Tensor,
                            step_counted: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The likelihood layout's reduction: [B, S] log p(token t | before) -> ``good_logprob`` = the minimum over the
    counted tokens of t's step (all of the step's tokens without ``step_counted``), ``bad_logprob`` = log(1 - p),
    at every token of a step. Uncounted tokens enter as log 1 = 0, which never lowers a minimum."""
    in_step = step_ids > 0
    counted = in_step if step_counted is None else in_step & (step_counted > 0)
    step_logprob = segment_min(torch.where(counted, token_logprobs, torch.zeros_like(token_logprobs)), step_ids)
    good = torch.where(in_step, step_logprob, torch.zeros_like(step_logprob)).clamp(max=-1e-6)
    bad = torch.log(-torch.expm1(good))  # log(1 - p), finite while p < 1
    return {"good_logprob": good, "bad_logprob": bad}
