"""The ``hf`` rollout engine: a transformers causal LM, CPU or one GPU, prompts bucketed by length and left-padded
within a batch. Each prompt but its last token runs once and its KV cache is repeated for its G samples; the decode
loop (``grpo_mega.rollout.hf_decode``) drops rows from the batch as they end, over a KV cache allocated once per
call for prompt + new tokens (``grpo_mega.rollout.kv_cache``) instead of growing by concatenation at every token.
With ``decode_graphs`` (``rollout.decode_graphs``) the steps after the prefill run over a static KV cache instead,
eagerly or as CUDA graphs / compiled code (``grpo_mega.rollout.static_decode``, ``grpo_mega.rollout.decode_graphs``).

Sampling log-probs are recorded while generating, as ``log_softmax(logits / T)`` of the raw model logits over
the tokenizer's ids (no top-p / top-k renormalisation; see ``rollout.base`` for the definition), before the
temperature / top-k / top-p shape what is sampled (``grpo_mega.rollout.sampling``: transformers' warpers' distribution,
drawn without sorting the vocabulary).
Ids past the tokenizer (a checkpoint's padded embedding rows) are masked before it, so they are never sampled.

Multi-turn rollouts continue each row's KV cache (:meth:`HFRolloutEngine.generate_with_caches`): a call may keep the
cache of every row that ends at a stop string (a tool call) and the next call, over those rows' prefixes (their
turn plus the tool turn), starts from it and prefills only the tokens after it. The calls, their batches and their
random numbers are those of ``generate`` over the same prefixes: only the prefix's forward pass is saved.

Sampling is defined by :class:`SamplingConfig` alone: the engine replaces the model's ``generation_config``
(a checkpoint's ``generation_config.json`` often sets top_k / top_p / repetition_penalty, and transformers fills
unset values with top_k=50), keeping only its EOS ids, for any caller of the model's own ``generate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
)

from grpo_mega.rollout.base import (
    Completion,
    SamplingConfig,
    check_prompts,
    decode_response,
    derive_seed,
    has_weight_files,
    load_hf_tokenizer,
    resolve_dtype,
)
from grpo_mega.rollout.decode_graphs import static_decoder_for
from grpo_mega.rollout.hf_decode import decode
from grpo_mega.rollout.hf_routes import routed_experts
from grpo_mega.rollout.kv_cache import RowCache, continued_batch, full_attention_only, preallocated_cache
from grpo_mega.rollout.sampling import TokenSampler, method_for
from grpo_mega.rollout.stopping import cut_response
from grpo_mega.rollout.weight_tracking import WeightUpdateTracker, checkpoint_state_dict


class PastTokenizerMask(LogitsProcessor):
    """Sets the scores of ids >= ``limit`` (the tokenizer's size) to -inf: a checkpoint's padded embedding rows
    (Qwen2.5: 152,064 rows for 151,665 tokens) are never sampled, greedy included (verl masks them the same way)."""

    def __init__(self, limit: int):
        self.limit = limit

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.limit:] = float("-inf")
        return scores


def _token_sampler(sampling: SamplingConfig, device: torch.device) -> TokenSampler | None:
    """Temperature, top-k, top-p in transformers' order, sampled without a sort by the device's method
    (``grpo_mega.rollout.sampling``); None when greedy."""
    if sampling.greedy:
        return None
    return TokenSampler(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                        method=method_for(device))


def _eos_token_ids(tokenizer: Any, generation_config: GenerationConfig | None) -> set[int]:
    """The tokenizer's EOS plus the checkpoint's generation_config EOS ids (chat models end turns with those)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update(int(i) for i in ([configured] if isinstance(configured, int) else configured))
    if not ids:
        raise ValueError("hf rollout engine: neither the tokenizer nor the model config defines an EOS token")
    return ids


MIN_BUCKET_PROMPTS = 8
"""Prompts of one length get a generate call of their own once there are at least this many. A batch without
padding needs no attention mask, and without a mask transformers' SDPA attention runs grouped-query heads
natively instead of copying the whole KV cache out to every query head (``repeat_kv``) at every generated
token, a copy that grows with the sequence (profiled on CPU: a quarter of generation time, with the cache's
concatenation). Rarer lengths are batched with the next longer ones, left-padded, so prompt sets of many
lengths still get large batches."""


def length_batches(lengths: list[int], batch_size: int, min_bucket: int) -> list[list[int]]:
    """Prompt indices grouped into generate calls: shortest first, at most ``batch_size`` per call; a call ends
    where the length changes once it holds ``min_bucket`` prompts (so equal-length calls need no padding)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, current = [], []
    for position, index in enumerate(order):
        current.append(index)
        length_changes = position + 1 == len(order) or lengths[order[position + 1]] != lengths[index]
        if len(current) == batch_size or (length_changes and len(current) >= min_bucket):
            batches.append(current)
            current = []
    if current:
        batches.append(current)
    return batches


class HFRolloutEngine:
    """Rollout engine around a transformers causal LM; weights arrive from the trainer by weight sync."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        generation_batch_size: int = 64,
        weights_ready: bool = True,
        return_routed_experts: bool = False,
        decode_graphs: str = "off",
    ):
        """``model``: a transformers ``*ForCausalLM``; ``tokenizer``: a transformers tokenizer or its folder.

        ``generation_batch_size`` is the number of prompts per ``generate`` call (each call holds
        ``prompts x n`` rows of KV cache). ``weights_ready=False`` marks placeholder weights: ``generate`` refuses
        to run until a complete weight update has arrived. ``return_routed_experts``: each completion carries the
        experts of its tokens (``Completion.routed_experts``; a mixture-of-experts model;
        ``grpo_mega.rollout.hf_routes``). ``decode_graphs``: ``rollout.decode_graphs`` (``off``, ``static``,
        ``static_compile``, ``cuda_graphs``: ``grpo_mega.rollout.static_decode``); the last two need CUDA.
        """
        if generation_batch_size < 1:
            raise ValueError(f"generation_batch_size must be >= 1, got {generation_batch_size}")
        self.model = model.eval()
        self.tokenizer = load_hf_tokenizer(tokenizer)
        self.generation_batch_size = generation_batch_size
        self.return_routed_experts = return_routed_experts
        self.device = next(model.parameters()).device
        self.eos_token_ids = _eos_token_ids(self.tokenizer, getattr(model, "generation_config", None))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids)
        self.model.generation_config = GenerationConfig(
            eos_token_id=sorted(self.eos_token_ids), pad_token_id=self.pad_token_id
        )
        # keep_vars=True: the Parameter objects themselves, so copying into them updates the model in place.
        rows = model.get_input_embeddings().num_embeddings
        self._masks = [PastTokenizerMask(len(self.tokenizer))] if len(self.tokenizer) < rows else []
        self._weights = WeightUpdateTracker(checkpoint_state_dict(model.state_dict(keep_vars=True)))
        self._weights_ready = weights_ready
        self.weight_version = 0
        """Complete weight updates received so far."""
        self.static_decoder = static_decoder_for(model, decode_graphs, self.device)
        """The static KV cache (and its graphs) the decode loop runs on; None for ``decode_graphs: off``."""
        self.continues_kv = full_attention_only(preallocated_cache(model.config, 1))
        """Whether ``generate_with_caches`` can keep and continue rows' caches (every layer full attention)."""
        self.forward_tokens = {"prefill": 0, "decode": 0}
        """Positions put through the model since construction, padding included: ``prefill`` in forward passes of
        several positions per row (shared prompt prefixes, each call's first step), ``decode`` one per row."""
        self.on_progress: Callable[[int, int], None] | None = None
        """Called after each generated batch of a ``generate`` call with (prompts done, prompts in the call): the
        progress lines of the commands that generate for minutes (``grpo-mega eval``, ``prm label``)."""

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        tokenizer: Any,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device | None = None,
        generation_batch_size: int = 64,
        return_routed_experts: bool = False,
        decode_graphs: str = "off",
    ) -> "HFRolloutEngine":
        """Engine for the HF folder ``model_path``: its weights if it has any, else placeholder weights from its
        config.json that must be replaced by a weight update before generating. ``device`` defaults to the
        current CUDA device when CUDA is present, else the CPU."""
        torch_dtype = resolve_dtype(dtype)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        if has_weight_files(model_path):
            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype)
            weights_ready = True
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)), dtype=torch_dtype)
            weights_ready = False
        return cls(
            model.to(device),
            tokenizer,
            generation_batch_size=generation_batch_size,
            weights_ready=weights_ready,
            return_routed_experts=return_routed_experts,
            decode_graphs=decode_graphs,
        )

    # ----------------------------------------------------------------------------------------------- generation

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped contiguously: completions[p*n:(p+1)*n] answer prompt p.

        Reproducible: the call samples with a seed derived from ``sampling.seed`` alone (no hidden call counter), so
        the same weights, prompts and settings give the same completions, also after a restart; callers pass a new
        ``sampling.seed`` for fresh samples (the trainer derives it from seed, step, round and rank). The caller's RNG state is
        left as it was. With temperature 0 (greedy) the n completions of a prompt are identical.
        """
        return self.generate_with_caches(prompt_ids, sampling)[0]

    def generate_with_caches(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                             caches: list[RowCache | None] | None = None, *, keep: bool = False
                             ) -> tuple[list[Completion], list[RowCache | None]]:
        """``generate``, continuing and keeping rows' KV caches (the multi-turn loop's next turn).

        ``caches[p]``: a cache of prompt p's first tokens (from an earlier call; None: none), which the call starts
        from, prefilling only the tokens after it (``sampling.n`` must be 1). ``keep``: return the cache of every
        completion that ended at a stop string (None for the others), aligned with the completions. The completions
        are ``generate``'s: the same calls, batches and random numbers; only the cached positions' keys and values
        come from the earlier call instead of a recomputation (equal up to float rounding: a different batch
        layout). A kept cache holds the row's real tokens only; the caller holds it until the next call. The
        ``caches`` list is consumed: each entry is set to None once its batch starts (its memory then freed).
        """
        if caches is not None and (len(caches) != len(prompt_ids) or sampling.n != 1):
            raise ValueError(f"generate_with_caches: {len(caches)} caches for {len(prompt_ids)} prompts, "
                             f"n={sampling.n} (continuing a cache needs one cache or None per prompt and n=1)")
        if (caches is not None and any(c is not None for c in caches)) or keep:
            if not self.continues_kv:
                raise ValueError("generate_with_caches: the model has layers that are not full attention; its "
                                 "rows' caches cannot be kept")
        if not self._weights_ready:
            raise RuntimeError(
                "hf rollout engine has placeholder weights (model folder without weights, or an incomplete "
                "weight update): run a full weight sync before generate"
            )
        check_prompts(prompt_ids, self.model.get_input_embeddings().num_embeddings)
        self._check_length(prompt_ids, sampling.max_new_tokens)
        seed = derive_seed(sampling.seed)
        cuda_devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices), torch.inference_mode():
            # Seed only the generator of the model's device, inside fork_rng, so the trainer's RNG is untouched.
            if cuda_devices:
                torch.cuda.default_generators[self.device.index].manual_seed(seed)
            else:
                torch.random.default_generator.manual_seed(seed)
            by_prompt: list[list[Completion]] = [[] for _ in prompt_ids]
            kept: list[list[RowCache | None]] = [[] for _ in prompt_ids]
            lengths = [len(p) for p in prompt_ids]
            done = 0
            for batch in length_batches(lengths, self.generation_batch_size, MIN_BUCKET_PROMPTS):
                chunk_caches = None if caches is None else [caches[i] for i in batch]
                if caches is not None:  # consumed: the chunk's batch cache holds them from here on
                    for i in batch:
                        caches[i] = None
                groups, group_caches = self._generate_chunk([prompt_ids[i] for i in batch], batch, sampling,
                                                            chunk_caches, keep)
                for index, group, group_cache in zip(batch, groups, group_caches):
                    by_prompt[index], kept[index] = group, group_cache
                done += len(batch)
                if self.on_progress is not None:
                    self.on_progress(done, len(prompt_ids))
        return ([completion for group in by_prompt for completion in group],
                [cache for group in kept for cache in group])

    @property
    def context_length(self) -> int | None:
        """The model's ``max_position_embeddings``: ``generate`` refuses a call whose longest prompt plus
        ``max_new_tokens`` passes it (the multi-turn loop splits a turn's rows by it)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def _check_length(self, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
        limit = self.context_length
        longest = max(len(p) for p in prompt_ids)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"generate: longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's max_position_embeddings ({limit})"
            )

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[P, L] input ids padded on the left (generation appends on the right) and the attention mask; None when
        every prompt has the same length (decided on the host: a mask on the device would be checked by
        transformers at every decode step, a host round trip each)."""
        length = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, length - len(prompt) :] = 1
        if all(len(prompt) == length for prompt in prompts):
            return input_ids.to(self.device), None
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _generate_chunk(
        self, prompts: list[list[int]], indices: list[int], sampling: SamplingConfig,
        caches: list[RowCache | None] | None = None, keep: bool = False,
    ) -> tuple[list[list[Completion]], list[list[RowCache | None]]]:
        """The n completions of each of ``prompts`` (whose indices in the call are ``indices``), one generate, and
        with ``keep`` the cache of each that ended at a stop string; ``caches``: see ``generate_with_caches``."""
        # Greedy rows of one prompt are identical: generate once, copy n times.
        samples = 1 if sampling.greedy else sampling.n
        # The static cache takes the prefill's keys and values: the prefill's cache needs no room for the decode.
        decode_room = sampling.max_new_tokens if self.static_decoder is None else 0
        if caches is None or all(c is None for c in caches):
            input_ids, attention_mask = self._left_pad(prompts)
            width = input_ids.shape[1]
            cache = self._shared_prompt_cache(input_ids, attention_mask, samples,
                                              capacity=width + decode_room)
            real_columns = [list(range(width - len(p), width)) for p in prompts]
        else:
            input_ids, attention_mask, cache, real_columns = continued_batch(
                prompts, caches, pad_token_id=self.pad_token_id, model_config=self.model.config,
                max_new_tokens=decode_room)
            input_ids = input_ids.to(self.device)
            attention_mask = None if attention_mask is None else attention_mask.to(self.device)
        stop = sampling.stop
        keep_columns = None
        if keep and stop:  # one copy to the device, split per prompt (its samples share it)
            flat = torch.tensor([c for columns in real_columns for c in columns], dtype=torch.long, device=self.device)
            per_prompt = flat.split([len(columns) for columns in real_columns])
            keep_columns = [per_prompt[row // samples] for row in range(len(prompts) * samples)]
        decoded = decode(
            self.model, input_ids.repeat_interleave(samples, dim=0),
            None if attention_mask is None else attention_mask.repeat_interleave(samples, dim=0),
            cache, max_new_tokens=sampling.max_new_tokens, eos_token_ids=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id, masks=self._masks, sampler=_token_sampler(sampling, self.device),
            greedy=sampling.greedy, logprob_temperature=sampling.logprob_temperature,
            stopped=(lambda ids: any(s in self._decode(ids) for s in stop)) if stop else None,
            keep_columns=keep_columns, static=self.static_decoder,
        )
        rows = len(prompts) * samples
        self.forward_tokens["prefill"] += decoded.prefill_tokens
        self.forward_tokens["decode"] += decoded.row_steps - rows
        generated, logprobs = decoded.tokens.tolist(), decoded.logprobs
        completions: list[list[Completion]] = [[] for _ in prompts]
        kept: list[list[RowCache | None]] = [[] for _ in prompts]
        cuts = [cut_response(token_ids, eos_token_ids=self.eos_token_ids, stop=sampling.stop, decode=self._decode,
                             max_new_tokens=sampling.max_new_tokens) for token_ids in generated]
        routes = [None] * len(generated)
        if self.return_routed_experts:
            routes = routed_experts(
                self.model, [list(prompts[row // samples]) + token_ids[:cut.length]
                             for row, (token_ids, cut) in enumerate(zip(generated, cuts))],
                pad_token_id=self.pad_token_id, batch_size=max(self.generation_batch_size, 1))
        for row, (token_ids, cut) in enumerate(zip(generated, cuts)):
            prompt_in_chunk = row // samples
            response = token_ids[: cut.length]
            completion = Completion(
                prompt_index=indices[prompt_in_chunk],
                prompt_ids=list(prompts[prompt_in_chunk]),
                response_ids=response,
                response_logprobs=logprobs[row, : cut.length].tolist(),
                text=self._decode(response),
                finish_reason=cut.finish_reason,
                routed_experts=routes[row],
            )
            completions[prompt_in_chunk].extend(
                [completion] if samples == sampling.n else self._copies(completion, sampling.n))
            row_cache = None
            if cut.finish_reason == "stop" and row in decoded.kept:
                row_cache = RowCache(tuple(prompts[prompt_in_chunk]) + tuple(response[:-1]), decoded.kept[row])
                if row_cache.layers[0][0].shape[-2] != len(row_cache.token_ids):
                    raise RuntimeError(f"hf engine: a kept cache of {row_cache.layers[0][0].shape[-2]} positions "
                                       f"for {len(row_cache.token_ids)} tokens (the decode loop's stop and the "
                                       "response cut disagree)")
            kept[prompt_in_chunk].extend([row_cache] * (sampling.n // samples))
        return completions, kept

    @torch.no_grad()
    def _shared_prompt_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, samples: int, *,
                             capacity: int):
        """The KV cache generate starts from: each prompt but its last token run once and its cache repeated for
        its ``samples`` rows (what ``num_return_sequences`` would compute ``samples`` times); an empty cache when
        there is nothing to share. generate then feeds only the last prompt token, whose logits give the first
        sampled token."""
        cache = preallocated_cache(self.model.config, capacity)
        if samples == 1 or input_ids.shape[1] < 2:
            return cache
        # The positions generate gives left-padded rows: 0 at the first real token.
        if attention_mask is None:  # no padding
            position_ids, prefix_mask = torch.arange(input_ids.shape[1], device=input_ids.device)[None], None
        else:
            position_ids, prefix_mask = (attention_mask.cumsum(-1) - 1).clamp(min=0), attention_mask[:, :-1]
        self.model(input_ids=input_ids[:, :-1], attention_mask=prefix_mask,
                   position_ids=position_ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.forward_tokens["prefill"] += input_ids.shape[0] * (input_ids.shape[1] - 1)
        cache.batch_repeat_interleave(samples)
        return cache

    @staticmethod
    def _copies(completion: Completion, n: int) -> list[Completion]:
        return [
            Completion(
                prompt_index=completion.prompt_index,
                prompt_ids=list(completion.prompt_ids),
                response_ids=list(completion.response_ids),
                response_logprobs=list(completion.response_logprobs),
                text=completion.text,
                finish_reason=completion.finish_reason,
                routed_experts=completion.routed_experts,  # read-only from here on: shared by the copies
            )
            for _ in range(n)
        ]

    def _decode(self, token_ids: list[int]) -> str:
        return decode_response(self.tokenizer, token_ids)

    # ---------------------------------------------------------------------------------------------- weight sync

    def begin_weight_update(self) -> None:
        """Start a weight update; generate is refused until finish_weight_update succeeds."""
        self._weights_ready = False
        self._weights.begin()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the model in place (a subset per call is fine).

        Raises ValueError for an unknown name or a wrong shape, RuntimeError outside begin/finish.
        """
        with torch.no_grad():
            for name, tensor in named_tensors:
                self._weights.accept(name, tensor).copy_(tensor)  # casts to the model's dtype and device

    def finish_weight_update(self) -> None:
        """Check that every parameter arrived since begin_weight_update (ValueError listing the missing ones)."""
        self._weights.finish()
        self._weights_ready = True
        self.weight_version += 1
