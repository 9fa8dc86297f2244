"""The rollout interface the GRPO trainer calls: sampling settings, completions, the engine protocol (the engines
implement it; ``grpo_mega.rollout.factory`` builds them).

Every engine returns the same thing for the same request: ``n`` completions per prompt, grouped contiguously
(``completions[p*n:(p+1)*n]`` answer prompt ``p``), each with the sampling log-prob of every response token.

Log-prob definition: for response token ``y_t``, ``logp_t = log_softmax(logits_t / T)[y_t]`` over the tokenizer's
ids, ``T`` the sampling temperature (``T = 1`` for greedy decoding, ``temperature == 0``). Ids past the tokenizer
(``len(tokenizer)`` and up: the padded embedding rows of checkpoints such as Qwen2.5's, 152,064 rows for 151,665
tokens) are never sampled, in both engines, and the log-probs are normalised over the ids that can be sampled:
the distribution the tokens really come from, which is what an importance weight (``algorithm.rollout_is``) needs.
The hf engine returns exactly this, also when top-p / top-k are on (no renormalisation over the kept tokens). The
vllm engine uses vLLM's ``processed_logprobs``, which is the same when ``top_p == 1`` and ``top_k == 0`` and
renormalised over the kept tokens otherwise.

The trainer (``grpo_mega.model.logprobs``) does not mask those ids: it normalises over the model's whole
vocabulary (``hf_config.vocab_size`` rows). Deliberately: the policy being trained is the model itself, and for a
trained checkpoint the padded rows, never a target, carry a probability of ~1e-9, so the two definitions differ by
``-log(1 - P(ids past the tokenizer))`` ~ 1e-9 per token. Where a model does give them mass (random or damaged
weights) the difference shows in ``rollout/logprob_diff_*``.

``text`` is always ``decode(response_ids, skip_special_tokens=True)``, so a reward reads exactly the tokens the
trainer trains on. A multi-turn rollout (``grpo_mega.rollout.turn_loop``) keeps its tool turns in ``response_ids``
(and so in ``text``: verl's ``solution_str``); ``response_mask`` says which tokens the policy sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

FinishReason = Literal["stop", "length", "eos"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class SamplingConfig:
    """How completions are sampled; the same settings mean the same distribution in every engine."""

    temperature: float = 1.0
    """Softmax temperature T (logits / T). 0 means greedy decoding (log-probs are then taken at T = 1)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 keeps all."""
    max_new_tokens: int = 64
    """Most tokens generated per completion (finish_reason "length" when reached)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings. The completion ends right after the token that completes the first stop string, and keeps
    the stop string in its tokens and text (like vLLM's include_stop_str_in_output=True)."""
    seed: int = 0
    """Seed of the call: the same seed, weights and prompts give the same completions (no hidden call counter)."""
    n: int = 1
    """Completions sampled per prompt (G of GRPO)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be >= 1, got {self.n}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingConfig.stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax token (temperature 0)."""
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The T of ``log_softmax(logits / T)`` for the returned log-probs: the temperature, or 1 when greedy."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class ToolCallRecord:
    """One tool call of a multi-turn rollout and what it gave back (``grpo_mega.rollout.turn_loop``)."""

    name: str
    """The tool the policy named ("" when its call could not be parsed)."""
    arguments: dict[str, Any]
    """The parsed arguments ({} when the call could not be parsed)."""
    error: str | None = None
    """None, or the error kind (``grpo_mega.tools.TOOL_ERROR_KINDS``; "invalid_call" from the turn loop's parser)."""
    seconds: float = 0.0
    """Wall-clock seconds of the call in the sandbox."""
    reward: float | None = None
    """The tool's own reward for this turn (verl's ``tool_reward_score``); None = the tool gave none."""
    content: str = ""
    """What the policy was shown: the tool's output (or the error message) as cut to ``max_tool_response_tokens``;
    the ``tool`` message of the trajectory a TRL reward function reads (``grpo_mega.rollout.turn_messages``)."""


@dataclass
class TurnRecord:
    """One assistant turn of a multi-turn rollout: where its tokens lie in the response, why it ended, the calls it
    made, and where the tool turn that answered it lies. The next issue (turn credit) makes each turn a step."""

    start: int
    """Response index of the turn's first (policy) token."""
    end: int
    """Response index one past the turn's last policy token."""
    ended: str
    """"tool_call" (ended in a call, valid or not), "answer" (end of sequence with a final answer), "void" (end of
    sequence with neither a call nor an answer), "length" (its token limit or the response budget), "max_turns"
    (a call made at the last allowed turn: not run)."""
    calls: list[ToolCallRecord] = field(default_factory=list)
    """The calls of the turn, run in this order (empty unless ``ended`` is "tool_call")."""
    tool_end: int | None = None
    """Response index one past the tool turn appended after it (its tokens start at ``end``; mask 0); None when no
    tool turn followed."""

    def __post_init__(self) -> None:  # a record rebuilt from builtins (``dataclasses.asdict``, a checkpoint)
        self.calls = [c if isinstance(c, ToolCallRecord) else ToolCallRecord(**c) for c in self.calls]


@dataclass
class Completion:
    """One sampled response to one prompt."""

    prompt_index: int
    """Index of the prompt in the generate call's ``prompt_ids``."""
    prompt_ids: list[int]
    """The prompt's token ids, as given."""
    response_ids: list[int]
    """Generated token ids; ends with the EOS token when finish_reason is "eos"."""
    response_logprobs: list[float]
    """``log_softmax(logits / T)[token]`` of each response token (see the module docstring); same length as
    response_ids."""
    text: str
    """``decode(response_ids, skip_special_tokens=True)``."""
    finish_reason: FinishReason
    """"eos" (an end-of-sequence token), "stop" (a stop string) or "length" (max_new_tokens reached)."""
    routed_experts: Any = None
    """Only with routing replay (``rollout.routing_replay``): the experts each token was routed to, an integer array
    [len(prompt_ids) + len(response_ids) - 1, MoE layers, top-k] (numpy or torch; row t: the token at position t of
    ``prompt_ids + response_ids``; the last token was never put through the model, so it has no row). None
    otherwise."""
    tree_path: list[int] | None = None
    """Only from a tree sampler (``process_reward.source: tree``, ``grpo_mega.stages.tree_rollout``): the ids of the
    tree's nodes this completion passes through, root side first (unique within its group). None otherwise."""
    segment_ends: list[int] | None = None
    """With ``tree_path``: the response index of the last token of each segment before the completion's last one
    (where the tree branched). None otherwise."""
    response_mask: list[int] | None = None
    """Only from a multi-turn rollout: per response token, 1 where the policy sampled it, 0 for a tool's output and
    the chat template's boundary tokens around it (their ``response_logprobs`` are 0; the trainer's ``loss_mask``
    is 0 there). None: every token is the policy's (a single-turn completion)."""
    turns: list[TurnRecord] | None = None
    """Only from a multi-turn rollout: its assistant turns in order (``TurnRecord``). None otherwise."""

    def __post_init__(self) -> None:  # turns rebuilt from builtins (``dataclasses.asdict``, a checkpoint)
        if self.turns is not None:
            self.turns = [t if isinstance(t, TurnRecord) else TurnRecord(**t) for t in self.turns]

    @property
    def policy_mask(self) -> list[int]:
        """``response_mask``, or all 1 for a single-turn completion."""
        return self.response_mask if self.response_mask is not None else [1] * len(self.response_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine: sampling, and receiving the policy's weights."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped contiguously: completions[p*n:(p+1)*n] answer prompt p."""
        ...

    def begin_weight_update(self) -> None:
        """Start a weight update; every parameter must then arrive before finish_weight_update."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (full, unsharded), possibly a subset per call (bucketed streaming)."""
        ...

    def finish_weight_update(self) -> None:
        """End a weight update: check completeness, drop state computed with the old weights."""
        ...


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.dtype`` from a dtype or its name ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown rollout dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def derive_seed(*keys: int) -> int:
    """A 31-bit seed from integer keys (e.g. base seed, step, round, rank, prompt index), via numpy's SeedSequence,
    so nearby keys give unrelated streams."""
    if any(k < 0 for k in keys):
        raise ValueError(f"seed keys must be >= 0, got {keys}")
    return int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint32)[0] >> 1)


def check_prompts(prompt_ids: Sequence[Sequence[int]], vocab_size: int | None = None) -> None:
    """Raise ValueError for an empty batch, an empty prompt, or a token id outside ``[0, vocab_size)``."""
    if len(prompt_ids) == 0:
        raise ValueError("generate: prompt_ids is empty")
    for index, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"generate: prompt {index} has no tokens")
        low, high = min(ids), max(ids)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            raise ValueError(
                f"generate: prompt {index} has token ids in [{low}, {high}], outside the model's vocabulary "
                f"[0, {vocab_size})"
            )


def load_hf_tokenizer(tokenizer: Any):
    """A transformers tokenizer: ``tokenizer`` itself, or ``AutoTokenizer.from_pretrained`` of a folder."""
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        if not Path(tokenizer).is_dir():
            raise FileNotFoundError(f"rollout: tokenizer folder {tokenizer} does not exist")
        return AutoTokenizer.from_pretrained(str(tokenizer))
    if not hasattr(tokenizer, "decode") or not hasattr(tokenizer, "eos_token_id"):
        raise TypeError(f"rollout: tokenizer must be a folder or a transformers tokenizer, got {type(tokenizer)}")
    return tokenizer


def decode_response(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The completion text of ``token_ids``: special tokens skipped, no tokenization-space clean-up (which would
    change the text, e.g. " ." -> ".")."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def has_weight_files(model_path: str | Path) -> bool:
    """True when an HF model folder holds weights (safetensors or PyTorch bin, single file or sharded)."""
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"rollout: {folder} has no config.json (expected a Hugging Face model folder)")
    patterns = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")
    return any(any(folder.glob(p)) for p in patterns)
