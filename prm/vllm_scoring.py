"""Step scores from a PRM served by vLLM (``scorer: vllm``): the same ``score_steps`` contract as
``prm.scoring.StepScorer``, the same rendering (``prm.rendering``), the same positions, on vLLM's engine.

How each layout runs on vLLM 0.32 (read from its source; ``docs/prm.md`` says what a GPU run adds):

- ``classifier`` (Qwen2.5-Math-PRM, ``Qwen2ForProcessRewardModel``, vLLM's own class): the pooling runner,
  ``pooling_task="token_classify"``, raw logits (``use_activation=False``) of (bad, good) per token.
- ``lm_tokens`` (Math-Shepherd): the causal LM converted to a token classifier whose two rows are the LM output
  rows of the label tokens (``convert="classify"``, ``hf_overrides={"classifier_from_token": [good, bad],
  "method": "no_post_processing"}``): logits (good, bad) per token. (The documented ``returned_token_ids`` recipe
  on the causal LM indexes hidden-state dimensions in 0.32, FINDINGS.)
- ``likelihood``: the generate runner's prompt log-probs (``SamplingParams(prompt_logprobs=0, max_tokens=1)``):
  log p(token t | tokens before) of every rendered token, reduced to a step's minimum by the same function as the
  Megatron head (``prm.heads.step_likelihood_outputs``). These requests pay their whole prompt: vLLM skips the
  prefix cache for prompt log-probs by default, and reading it returns fewer entries.

Pooling: ``ALL`` token pooling, not ``STEP``. vLLM turns prefix caching off for every STEP-pooled model
(``ModelConfig.is_prefix_caching_supported``), so the G completions of a prompt would each pay the prompt, and STEP
selects positions by one token id, which a multi-token tag (" ки" in a byte-level BPE) is not. With ALL pooling and
``PoolingParams(skip_reading_prefix_cache=False)`` (vLLM's default for token pooling is to skip it) a group's
completions read the prompt's cached blocks, and vLLM returns the outputs of the tokens it computed, the last ones
of the row: a tag at position p is output row ``p - (len(ids) - len(output))``. A row whose tag fell inside a
cached block (a completion that repeats another's steps) is scored again without reading the cache. Identical
rendered rows are scored once.

Memory: vLLM takes ``gpu_memory_utilization`` of the GPU for the PRM's weights, workspace and KV cache when it is
built. Where its platform has sleep mode (CUDA, ROCm, XPU; not the CPU backend) the scorer sleeps at level 1 right
after and after every ``score_steps`` (weights to pinned host memory, KV cache freed) and wakes before the next:
a PRM's weights never change, so level 2's discard would only add a reload. No CUDA graphs (``enforce_eager``):
pooling requests are prefill only, and vLLM keeps the graph pool on the GPU through a sleep. ``grpo-mega plan``
counts this (``grpo_mega.plan.vllm.VllmPRMPlan``).

Ranks: inside a job every rank builds its engine with vLLM's ``external_launcher`` as the rollout engine does
(``grpo_mega.rollout.vllm_engine``); the world splits into replicas of ``tensor_parallel_size`` ranks, replica r
scores rows r, r + replicas, ..., and the scores are all-gathered, so every rank gets every row's scores.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from prm.examples import StepExample
from prm.rendering import RenderedExample, RenderSettings, tokenize_rendered
from prm.turn_rendering import render_turn_split, render_turn_steps, tag_ids_of
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps

logger = logging.getLogger(__name__)

VLLM_LAYOUTS = ("classifier", "lm_tokens", "likelihood")


def vllm_arguments(layout: str, label_tokens: Sequence[str] | None = None) -> dict[str, Any]:
    """What ``vllm.LLM`` needs to serve a ``layout`` PRM (no vLLM import; ``label_tokens``: the good and bad label
    tokens as vocabulary entries, ``lm_tokens`` only)."""
    if layout == "classifier":
        return {"runner": "pooling", "pooler_config": {"task": "token_classify", "tok_pooling_type": "ALL"}}
    if layout == "lm_tokens":
        if not label_tokens or len(label_tokens) != 2:
            raise ValueError(f"an lm_tokens PRM on vLLM needs its good and bad label tokens, got {label_tokens!r}")
        return {"runner": "pooling", "convert": "classify",
                "pooler_config": {"task": "token_classify", "tok_pooling_type": "ALL"},
                "hf_overrides": {"classifier_from_token": list(label_tokens), "method": "no_post_processing"}}
    if layout == "likelihood":
        return {"runner": "generate"}
    raise ValueError(f"scorer=vllm: PRM layout must be one of {VLLM_LAYOUTS}, got {layout!r}")


def good_logprobs_from_logits(logits: torch.Tensor, layout: str) -> torch.Tensor:
    """[N, 2] raw logits of vLLM's token classifier -> [N] log P(good), in fp32 as the Megatron heads: classifier
    logits are (bad, good) (Qwen2.5-Math-PRM's class 1), lm_tokens ones (good, bad)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs[:, 1] if layout == "classifier" else log_probs[:, 0]


def tag_rows(example: RenderedExample, computed: int) -> list[int] | None:
    """Output rows of the example's tags when vLLM computed (and returned) only the last ``computed`` tokens of
    its ``input_ids``; None when a tag lies in the part read from the prefix cache."""
    skipped = len(example.input_ids) - computed
    if any(position < skipped for position in example.tag_positions):
        return None
    return [position - skipped for position in example.tag_positions]


def likelihood_step_scores(example: RenderedExample, token_logprobs: Sequence[float]) -> list[float]:
    """Step scores of the likelihood layout from log p(token t | before) of every token (t = 0 has none: 0), by
    the Megatron head's own reduction (``prm.heads.step_likelihood_outputs``)."""
    from prm.heads import step_likelihood_outputs

    if example.step_starts is None:
        raise ValueError("the likelihood layout needs the rendered example's step_starts (render it with prm.rendering)")
    step_ids = torch.zeros((1, len(example.input_ids)), dtype=torch.long)
    counted = torch.zeros_like(step_ids)
    for step, (first, last) in enumerate(zip(example.step_starts, example.tag_positions)):
        step_ids[0, first : last + 1] = step + 1  # as prm.scoring.rendered_batch numbers them
        if example.counted is not None:
            counted[0, torch.tensor(example.counted[step], dtype=torch.long)] = 1
    values = torch.tensor([list(token_logprobs)], dtype=torch.float32)
    good = step_likelihood_outputs(values, step_ids, counted if example.counted is not None else None)["good_logprob"]
    return torch.exp(good[0, torch.tensor(example.tag_positions, dtype=torch.long)]).tolist()


def group_leaders(examples: Sequence[RenderedExample]) -> tuple[list[int], list[int]]:
    """(indices of each prompt's first row, the other rows): rows share a prompt when their tokens before the
    first step are equal."""
    seen: set[tuple[int, ...]] = set()
    leaders, followers = [], []
    for index, example in enumerate(examples):
        prompt = tuple(example.input_ids[: example.step_starts[0]] if example.step_starts else example.input_ids)
        (followers if prompt in seen else leaders).append(index)
        seen.add(prompt)
    return leaders, followers


def _replicas(tensor_parallel_size: int) -> tuple[int, int, bool]:
    """(index, count, leader) of this rank's vLLM replica (``grpo_mega.rollout.vllm_engine.replica_layout``)."""
    from grpo_mega.rollout.vllm_engine import replica_layout

    replica = replica_layout(tensor_parallel_size)
    return replica.index, replica.count, replica.leader


class VLLMStepScorer:
    """A PRM on ``vllm.LLM`` in this process (module docstring); ``score_steps`` as ``prm.scoring.StepScorer``'s
    (collective inside a job: every rank calls with the same arguments and gets the same scores)."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer,
        settings: RenderSettings,
        layout: str,
        *,
        label_tokens: Sequence[str] | None = None,
        max_length: int | None = None,
        dtype: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.3,
        prefix_cache: bool = True,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        sleep: bool | None = None,
        seed: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        """``model_path``: an HF folder with weights; ``settings``: the PRM's rendering; ``label_tokens``: the
        ``lm_tokens`` layout's (good, bad) as vocabulary entries; ``dtype`` None: float32 on the CPU backend,
        bfloat16 on a GPU; ``prefix_cache``: a row reads the blocks its group's earlier rows cached (module
        docstring); ``enforce_eager``: no CUDA graphs (module docstring, "Memory"); ``sleep``: sleep between
        calls (None: where vLLM's platform has sleep mode, a GPU); ``llm_kwargs`` go to ``vllm.LLM`` (e.g.
        ``block_size``)."""
        from grpo_mega.rollout.vllm_engine import _joining_the_job, _process_state_kept, cpu_kv_cache_bytes, import_vllm
        from grpo_mega.rollout.vllm_settings import colocated_arguments

        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.tokenizer = tokenizer
        self.settings = settings
        self.layout = layout
        self.max_length = max_length
        self.prefix_cache = prefix_cache
        self.replica = _replicas(tensor_parallel_size)
        arguments = vllm_arguments(layout, label_tokens)
        if "pooler_config" in arguments:
            from vllm.config import PoolerConfig

            arguments["pooler_config"] = PoolerConfig(**arguments["pooler_config"])
        cpu = current_platform.is_cpu()
        available = current_platform.is_sleep_mode_available()
        if sleep and not available:
            raise ValueError(f"scorer=vllm: sleep mode is not supported on vLLM's {current_platform.device_type} "
                             "backend (sleep=False)")
        self.sleeps = available if sleep is None else sleep
        self.dtype = dtype or ("float32" if cpu else "bfloat16")
        if cpu:  # vLLM's CPU backend otherwise takes a share of the host's RAM for its KV cache
            arguments["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_path, max_model_len,
                                                                    getattr(torch, self.dtype))
        joins = dist.is_initialized()
        joining = _joining_the_job() if joins else contextlib.nullcontext()
        if cpu and joins and tensor_parallel_size > 1:  # what a killed job left (grpo_mega.rollout.vllm_launch)
            from grpo_mega.rollout.vllm_launch import remove_stale_cpu_shm

            remove_stale_cpu_shm(dist.get_rank(), tensor_parallel_size)
        with _process_state_kept(), joining:
            self.llm = vllm.LLM(
                model=str(model_path), tokenizer=str(model_path), dtype=self.dtype,
                tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len, enforce_eager=enforce_eager, enable_sleep_mode=self.sleeps,
                enable_prefix_caching=prefix_cache, seed=seed, **colocated_arguments(joins_job=joins), **arguments,
                **llm_kwargs,
            )
        self._vllm = vllm
        self.asleep = False
        """Whether the PRM's weights are on the host and its KV cache freed (between calls, with ``sleeps``)."""
        self.release_memory()
        self.last_seconds = 0.0
        """Wall time of the last ``score_steps`` call."""
        self.last_rescored = 0
        """Rows of the last call scored again because a tag fell in a cached block."""

    # --------------------------------------------------------------------------------------------- the contract
    def render(self, prompt: str, steps: Sequence[str]) -> RenderedExample:
        """Token ids and tag positions of one example (``prm.rendering.tokenize_rendered``)."""
        return tokenize_rendered(self.tokenizer, prompt, list(steps), self.settings, max_length=self.max_length)

    def score_rendered(self, rendered: Sequence[RenderedExample]) -> list[list[float]]:
        """Step scores of already rendered examples, in order (this replica's share, then gathered)."""
        index, count, leader = self.replica
        unique: dict[tuple[int, ...], int] = {}
        for example in rendered:
            unique.setdefault(tuple(example.input_ids), len(unique))
        mine = list(range(index, len(unique), count))
        first = {}
        for example in rendered:
            first.setdefault(unique[tuple(example.input_ids)], example)
        local = dict(zip(mine, self._score_unique([first[i] for i in mine]))) if mine else {}
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local if leader else {})
            local = {k: v for part in gathered for k, v in part.items()}
        return [local[unique[tuple(example.input_ids)]] for example in rendered]

    def score_steps(self, prompts: Sequence[str], steps: Sequence[Sequence[str]]) -> list[list[float]]:
        """``scores[i][j]`` in [0, 1]: the PRM's probability that step j of solution i is good; ``[]`` for a
        solution without steps."""
        if len(prompts) != len(steps):
            raise ValueError(f"score_steps: {len(prompts)} prompts but {len(steps)} step lists")
        start = time.perf_counter()
        with_steps = [i for i, s in enumerate(steps) if len(s) > 0]
        scores: list[list[float]] = [[] for _ in prompts]
        if with_steps:
            rendered = [self.render(prompts[i], steps[i]) for i in with_steps]
            with self.awake():
                for i, row_scores in zip(with_steps, self.score_rendered(rendered)):
                    scores[i] = row_scores
        self.last_seconds = time.perf_counter() - start
        return scores

    def score_examples(self, examples: Sequence[StepExample]) -> list[list[float]]:
        """``score_steps`` of examples' prompts and steps; a turn-split row read from its tokens
        (``prm.turn_rendering``)."""
        if not any(TURN_STEPS_FIELD in e.extra for e in examples):
            return self.score_steps([e.prompt for e in examples], [e.steps for e in examples])
        with_steps, rendered = render_turn_split(self.tokenizer, examples, self.settings, max_length=self.max_length)
        scores: list[list[float]] = [[] for _ in examples]
        if rendered:
            with self.awake():
                for index, row_scores in zip(with_steps, self.score_rendered(rendered)):
                    scores[index] = row_scores
        return scores

    def score_turn_steps(self, rows: Sequence[TurnSteps]) -> list[list[float]]:
        """``prm.scoring.StepScorer.score_turn_steps``: turn steps read from the rollouts' tokens."""
        start = time.perf_counter()
        tag_ids = tag_ids_of(self.tokenizer, self.settings)
        rendered = [render_turn_steps(row, tag_ids, max_length=self.max_length, vocab_size=len(self.tokenizer),
                                      where=f"rollout {i}") for i, row in enumerate(rows)]
        scores: list[list[float]] = []
        if rendered:
            with self.awake():
                scores = self.score_rendered(rendered)
        self.last_seconds = time.perf_counter() - start
        return scores

    @contextlib.contextmanager
    def awake(self):
        """The PRM on the device for the calls inside (its weights back from the host, its KV cache allocated),
        asleep again after them (:meth:`release_memory`)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        try:
            yield
        finally:
            self.release_memory()

    def release_memory(self) -> None:
        """Sleep at level 1 (weights copied to pinned host memory, KV cache freed; vLLM also drops its prefix
        cache) when ``sleeps``: a PRM's weights never change, so level 2's discard-and-reload would only add a
        load. Nothing on the CPU backend, which has no sleep mode."""
        if self.sleeps and not self.asleep and self.llm is not None:
            self.llm.sleep(level=1)
            self.asleep = True

    def close(self) -> None:
        """Shut vLLM down (its worker and KV cache); inside a job, vLLM's shutdown also ends the default process
        group, so close it last."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    # --------------------------------------------------------------------------------------------- vLLM calls
    def _prompts(self, examples: Sequence[RenderedExample]) -> list:
        return [self._vllm.TokensPrompt(prompt_token_ids=list(e.input_ids)) for e in examples]

    def _score_unique(self, examples: list[RenderedExample]) -> list[list[float]]:
        if self.layout == "likelihood":
            return self._likelihood(examples)
        if not self.prefix_cache:
            scores = self._pooled(examples, read_cache=False)
        else:  # vLLM schedules one call's rows together: a group's first row caches the prompt for a second call
            leaders, followers = group_leaders(examples)
            scores = [None] * len(examples)
            for part in (leaders, followers):
                for i, row in zip(part, self._pooled([examples[i] for i in part], read_cache=True) if part else []):
                    scores[i] = row
        missing = [i for i, row in enumerate(scores) if row is None]
        self.last_rescored = len(missing)
        if missing:  # a tag inside a cached block: score those rows from their first token
            for i, row in zip(missing, self._pooled([examples[i] for i in missing], read_cache=False)):
                scores[i] = row
        return scores

    def _pooled(self, examples: list[RenderedExample], *, read_cache: bool) -> list[list[float] | None]:
        params = self._vllm.PoolingParams(use_activation=False, skip_reading_prefix_cache=not read_cache)
        outputs = self.llm.encode(self._prompts(examples), pooling_params=params, pooling_task="token_classify",
                                  use_tqdm=False)
        scores: list[list[float] | None] = []
        for example, output in zip(examples, outputs):
            logits = output.outputs.data  # [computed tokens, 2]
            rows = tag_rows(example, logits.shape[0])
            if rows is None:
                scores.append(None)
                continue
            good = good_logprobs_from_logits(logits[torch.tensor(rows, dtype=torch.long)], self.layout)
            scores.append(torch.exp(good).tolist())
        return scores

    def _likelihood(self, examples: list[RenderedExample]) -> list[list[float]]:
        """Prompt log-probs of every token; these requests do not read the prefix cache (vLLM's default for
        prompt log-probs: with cached blocks it returns fewer entries, in an order not worked out here)."""
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        outputs = self.llm.generate(self._prompts(examples), params, use_tqdm=False)
        scores = []
        for example, output in zip(examples, outputs):
            token_logprobs = [0.0]  # the first token has no prediction; it is never a step's (prm.heads)
            for token, entry in zip(example.input_ids[1:], output.prompt_logprobs[1:]):
                value = entry[token].logprob
                token_logprobs.append(value if math.isfinite(value) else -1e30)
            scores.append(likelihood_step_scores(example, token_logprobs))
        return scores


def open_vllm_step_scorer(path: str | Path, choices, *, max_length: int | None = None, **llm_kwargs: Any):
    """The PRM at ``path`` on vLLM (after ``init_distributed`` inside a job; collective): (``prm.model.LoadedPRM``
    with ``engine=None``, :class:`VLLMStepScorer`). The spec and rendering are read as ``prm.model.open_prm`` reads
    them (``choices``: ``prm.spec.PRMChoices``). ``path``: whatever the engine scorer loads; vLLM reads a Hugging
    Face folder as it is and a grpo-mega checkpoint, run directory or converted folder from its export, made once
    (``prm.export.hf_folder_for_vllm``). ``llm_kwargs``: :class:`VLLMStepScorer`'s."""
    from grpo_mega.checkpoint.source import resolve_model_source
    from prm.export import hf_folder_for_vllm
    from prm.model import LoadedPRM, load_prm_tokenizer
    from prm.spec import layout_and_label_ids, spec_with_overrides, trained_spec

    try:
        source = resolve_model_source(path)
    except ValueError as error:
        raise ValueError(f"PRM {path}: {str(error).removeprefix('init_from: ')}") from None
    if source.hf_config is None:
        hf_dir = source.model_settings.get("hf_config")
        raise ValueError(f"{path}: the checkpoint's config model.hf_config ({hf_dir!r}) has no config.json")
    overrides = choices.spec_overrides()
    spec = spec_with_overrides(trained_spec(source, overrides.get("layout")), overrides)
    tokenizer = load_prm_tokenizer(source.tokenizer_folder, str(path))
    layout, label_ids = layout_and_label_ids(source.hf_config, spec, tokenizer)
    label_tokens = tokenizer.convert_ids_to_tokens(list(label_ids)) if label_ids else None
    folder = hf_folder_for_vllm(source, tokenizer)
    if _is_rank0():  # vLLM's start-up says nothing for a minute or more on its own
        logger.info("scorer=vllm: starting vLLM for the PRM %s (%s layout; its start-up takes a minute or more)",
                    folder, layout)
    scorer = VLLMStepScorer(
        folder, tokenizer, choices.render_settings(spec, source), layout, label_tokens=label_tokens,
        max_length=max_length, tensor_parallel_size=choices.vllm_tensor_parallel or 1,
        gpu_memory_utilization=choices.vllm_gpu_memory_utilization or 0.2, **llm_kwargs,
    )
    return LoadedPRM(engine=None, spec=spec, tokenizer=tokenizer, hf_config=source.hf_config, source=source), scorer


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
