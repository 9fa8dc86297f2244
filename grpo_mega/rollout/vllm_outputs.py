"""vLLM requests and outputs in the rollout interface's terms (``grpo_mega.rollout.base``), as pure functions (no
vLLM import): the ``SamplingParams`` of a request, and ``LLM.generate``'s RequestOutputs as completions, with the
experts of every token when routing replay is on. Read against vLLM 0.32 (``vllm/outputs.py``)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from grpo_mega.rollout.base import Completion, FinishReason, SamplingConfig


def vllm_sampling_kwargs(sampling: SamplingConfig, seed: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt of ``sampling`` with request seed ``seed``."""
    return {
        "n": 1 if sampling.greedy else sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_tokens": sampling.max_new_tokens,
        "stop": list(sampling.stop) or None,
        "include_stop_str_in_output": True,
        "logprobs": 0,
        "seed": seed,
        "skip_special_tokens": True,
    }




def _finish_reason(finish_reason: str | None, stop_reason: int | str | None) -> FinishReason:
    """vLLM's (finish_reason, stop_reason) -> ours: "stop" with a string stop_reason is a stop string; with None
    (EOS) or an int (a generation_config EOS id) it is an end-of-sequence token."""
    if finish_reason == "length":
        return "length"
    if finish_reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise RuntimeError(f"vLLM ended a completion with finish_reason={finish_reason!r} (aborted or unfinished)")




def completions_from_vllm(
    request_outputs: Sequence[Any], prompt_ids: Sequence[Sequence[int]], n: int, decode: Callable[[list[int]], str],
    *, routed_experts: bool = False,
) -> list[Completion]:
    """Completions, n per prompt and grouped contiguously, from ``LLM.generate``'s RequestOutputs (in prompt order).

    A request with one sample where n > 1 (greedy) is copied n times. ``text`` is re-decoded from the token ids
    so that it matches them exactly, as in the hf engine. ``routed_experts``: take each sample's
    ``routed_experts`` (:func:`sample_routes`).
    """
    if len(request_outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(request_outputs)} outputs for {len(prompt_ids)} prompts")
    completions = []
    for index, request in enumerate(request_outputs):
        samples = sorted(request.outputs, key=lambda sample: sample.index)
        if len(samples) not in (1, n):
            raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {index}, expected {n}")
        for sample in samples * (n // len(samples)):
            token_ids = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) < len(token_ids):
                raise RuntimeError(f"vLLM returned no log-prob for some tokens of prompt {index} (logprobs=0 unset?)")
            completions.append(
                Completion(
                    prompt_index=index,
                    prompt_ids=list(prompt_ids[index]),
                    response_ids=token_ids,
                    response_logprobs=[float(sample.logprobs[t][tok].logprob) for t, tok in enumerate(token_ids)],
                    text=decode(token_ids),
                    finish_reason=_finish_reason(sample.finish_reason, sample.stop_reason),
                    routed_experts=sample_routes(sample, len(prompt_ids[index]), index) if routed_experts else None,
                )
            )
    return completions


def sample_routes(sample: Any, prompt_length: int, index: int) -> np.ndarray:
    """A finished sample's ``CompletionOutput.routed_experts`` (vLLM 0.32: [prompt + response - 1, layers, top-k],
    uint8 up to 256 experts; the last sampled token was never forwarded, so it has no row), checked."""
    routes = getattr(sample, "routed_experts", None)
    if routes is None:
        raise RuntimeError(f"vLLM returned no routed_experts for prompt {index} (rollout.routing_replay): the engine "
                           "needs enable_return_routed_experts=True, Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) and "
                           "a mixture-of-experts model")
    routes = np.asarray(routes)
    expected = prompt_length + len(sample.token_ids) - 1
    if routes.ndim != 3 or routes.shape[0] != expected:
        raise RuntimeError(f"vLLM returned routed_experts of shape {routes.shape} for prompt {index}, expected "
                           f"[{expected}, layers, top-k] (prompt + response - 1 tokens)")
    return routes
