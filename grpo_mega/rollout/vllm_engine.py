"""The ``vllm`` rollout engine (GPU clusters): ``vllm.LLM`` sampling n completions per prompt with their log-probs.

vLLM is optional (``pip install 'grpo-mega[gpu]'``); this module imports without it, and the pieces that do not
need a GPU (sampling parameters, turning vLLM outputs into :class:`Completion`, weight checks) are plain functions.
Written against vLLM 0.33:

- Log-probs: engine argument ``logprobs_mode="processed_logprobs"`` and ``SamplingParams(logprobs=0)`` return the
  sampled token's log-prob after temperature (and top-k/top-p, renormalised) -- the trainer's
  ``log_softmax(logits / T)`` when top_p == 1 and top_k == 0. The default ``raw_logprobs`` would ignore T.
- ``SamplingParams.max_tokens`` defaults to 16, so it is always set; greedy requests must have n == 1, so greedy
  samples are generated once and copied.
- Weight updates: a worker extension (``worker_extension_cls``) receives HF-named full tensors through
  ``LLM.collective_rpc`` and calls ``model.load_weights`` (vLLM fuses q/k/v and gate/up and shards for its TP
  itself). The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): with the default separate
  engine-core process, collective_rpc arguments go through msgpack, which does not carry torch tensors. With
  tensor_parallel_size > 1 the workers are processes and tensors are pickled to them from CPU memory.
- After an update ``reset_prefix_cache()`` drops KV blocks computed with the old weights (vllm #9744).
- Sleep mode (``enable_sleep_mode=True``, level 1): before an update wake only the weights, load, then wake the KV
  cache, so the cache is not allocated while weights are being written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from grpo_mega.rollout.base import (
    Completion,
    FinishReason,
    SamplingConfig,
    check_prompts,
    decode_response,
    derive_seed,
    has_weight_files,
    load_hf_tokenizer,
    resolve_dtype,
)
from grpo_mega.rollout.weight_tracking import WeightUpdateTracker

INSTALL_HINT = "pip install 'grpo-mega[gpu]'"
_VLLM_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def import_vllm():
    """The ``vllm`` module, or ImportError naming the install command."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"the 'vllm' rollout engine needs vLLM, which is not installed (GPU machines only): {INSTALL_HINT}; "
            "on CPU use rollout.engine=hf"
        ) from error
    return vllm


class VLLMWeightReceiver:
    """vLLM worker extension: mixed into each vLLM worker, called through ``LLM.collective_rpc``.

    The method name carries a prefix because vLLM refuses extension attributes that its Worker already has
    (0.33's Worker has ``update_weights``).
    """

    def grpo_load_hf_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full tensors into this worker's model shard; returns how many were given."""
        from vllm.config import set_current_vllm_config

        on_device = ((name, tensor.to(self.device)) for name, tensor in named_tensors)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.model.load_weights(on_device)
        return len(named_tensors)


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
    request_outputs: Sequence[Any], prompt_ids: Sequence[Sequence[int]], n: int, decode: Callable[[list[int]], str]
) -> list[Completion]:
    """Completions, n per prompt and grouped contiguously, from ``LLM.generate``'s RequestOutputs (in prompt order).

    A request with one sample where n > 1 (greedy) is copied n times. ``text`` is re-decoded from the token ids
    so that it matches them exactly, as in the hf engine.
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
                )
            )
    return completions


def _reference_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Names and shapes of the HF model in ``model_path``, from a transformers model on the meta device
    (no memory), to check incoming tensors before they reach vLLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)))
    return model.state_dict(keep_vars=True)


class VLLMRolloutEngine:
    """Rollout engine on ``vllm.LLM`` in this process; see the module docstring for the vLLM specifics."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: Any,
        *,
        dtype: str | torch.dtype = "bfloat16",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        enforce_eager: bool = False,
        seed: int = 0,
        **llm_kwargs: Any,
    ):
        """``model_path``: HF folder; without weight files vLLM starts from dummy weights and ``generate`` waits
        for a full weight update. ``tokenizer``: its folder, or a loaded tokenizer whose ``name_or_path`` is one.
        ``llm_kwargs`` go to ``vllm.LLM`` (e.g. ``distributed_executor_backend="external_launcher"`` for an engine
        per torchrun rank)."""
        vllm = import_vllm()
        self.tokenizer = load_hf_tokenizer(tokenizer)
        tokenizer_path = str(tokenizer if isinstance(tokenizer, (str, Path)) else self.tokenizer.name_or_path)
        if not tokenizer_path or not Path(tokenizer_path).is_dir():  # vLLM loads its own copy from the folder
            raise ValueError(f"vllm rollout engine: tokenizer must come from a folder, got {tokenizer_path!r}")
        self.dtype = resolve_dtype(dtype)
        self.tensor_parallel_size = tensor_parallel_size
        self._weights_ready = has_weight_files(model_path)
        self._weights = WeightUpdateTracker(_reference_state_dict(model_path))
        # The engine core must share this process so collective_rpc can hand tensors to the workers.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = vllm.LLM(
            model=str(model_path),
            tokenizer=tokenizer_path,
            dtype=_VLLM_DTYPE_NAMES[self.dtype],
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            seed=seed,
            load_format="auto" if self._weights_ready else "dummy",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.{VLLMWeightReceiver.__name__}",
            **llm_kwargs,
        )
        self._sampling_params = vllm.SamplingParams
        self._tokens_prompt = vllm.TokensPrompt
        self._enable_sleep_mode = enable_sleep_mode
        self._asleep = False
        self.weight_version = 0
        """Complete weight updates received so far."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped contiguously: completions[p*n:(p+1)*n] answer prompt p.

        Prompt p samples with the request seed derived from (sampling.seed, p), no hidden call counter, so a
        restarted run samples the same; vLLM gives the request's i-th sample seed + i.
        """
        if not self._weights_ready:
            raise RuntimeError("vllm rollout engine has dummy weights: run a full weight sync before generate")
        check_prompts(prompt_ids)
        if self._asleep:
            self.wake_up()
        params = [
            self._sampling_params(**vllm_sampling_kwargs(sampling, derive_seed(sampling.seed, index)))
            for index in range(len(prompt_ids))
        ]
        prompts = [self._tokens_prompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return completions_from_vllm(outputs, prompt_ids, sampling.n, self._decode)

    def _decode(self, token_ids: list[int]) -> str:
        return decode_response(self.tokenizer, token_ids)

    def sleep(self) -> None:
        """Free GPU memory for training (level 1: weights to CPU, KV cache dropped); generate wakes it up."""
        if not self._enable_sleep_mode:
            raise RuntimeError("vllm rollout engine: sleep() needs enable_sleep_mode=True")
        self.llm.sleep(level=1)
        self._asleep = True

    def wake_up(self) -> None:
        """Reallocate weights and KV cache after sleep()."""
        self.llm.wake_up()
        self._asleep = False

    def begin_weight_update(self) -> None:
        """Start an update; when asleep, bring back only the weights (the KV cache stays freed until finish)."""
        self._weights_ready = False
        self._weights.begin()
        if self._asleep:
            self.llm.wake_up(tags=["weights"])

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check names and shapes, cast to the engine dtype, and load the tensors on every vLLM worker."""
        batch = []
        for name, tensor in named_tensors:
            self._weights.accept(name, tensor)
            tensor = tensor.detach().to(self.dtype)
            # Worker processes (TP > 1) receive pickled tensors, which must be in CPU memory.
            batch.append((name, tensor.cpu() if self.tensor_parallel_size > 1 else tensor))
        if batch:
            self.llm.collective_rpc("grpo_load_hf_weights", args=(batch,))

    def finish_weight_update(self) -> None:
        """Check every tensor arrived, wake the KV cache if asleep, and drop prefix-cache blocks of old weights."""
        self._weights.finish()
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
        self._weights_ready = True
        self.weight_version += 1
