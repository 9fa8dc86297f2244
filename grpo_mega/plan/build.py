"""``plan_config``: a config object + hardware -> :class:`~grpo_mega.plan.phases.Plan`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from grpo_mega.config import ConfigError
from grpo_mega.plan.activations import (
    Shapes, forward_activation_bytes, logprob_buffer_bytes, update_activation_bytes,
)
from grpo_mega.plan.counts import ModelRequest, count_stage_params
from grpo_mega.plan.phases import CUDA_CONTEXT_BYTES, NCCL_BYTES, Phase, Plan, SaveHost
from grpo_mega.checkpoint.hf_layouts import is_prm_classifier
from grpo_mega.plan.settings import (
    Hardware, data_parallel_size, memory_settings, rollout_ranks, rollout_tensor_parallel,
)
from grpo_mega.plan.static import checkpoint_save_bytes, forward_only_bytes, training_static_bytes
from grpo_mega.plan.vllm import plan_vllm, plan_vllm_prm
from grpo_mega.rollout.vllm_settings import resolve_batch_limits



def read_hf_config(folder: str | Path, key: str) -> dict:
    """The config.json of an HF folder as a dict; ConfigError naming ``key`` when there is none."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{key}={folder}: no config.json there")
    return json.loads(path.read_text())


def update_tokens(cfg) -> tuple[int, int, int]:
    """(tokens through the layers, tokens of the rows the head sees, packed tokens) of the largest update
    micro-batch: full-length rows (data.prompt_length + algorithm.response_length) filling
    parallel.max_tokens_per_micro_batch. The shared-prompt path (``parallel.share_prompt_prefix``, megatron engine)
    packs a group as its prompt once and its G responses (``grpo_mega.engine.shared_prefix``); the row path takes
    as many whole rows as fit (at least one)."""
    prompt, response = cfg.data.prompt_length, cfg.algorithm.response_length
    budget, group = cfg.parallel.max_tokens_per_micro_batch, cfg.algorithm.num_return_sequences_in_group
    row = prompt + response
    rows = max(1, budget // row)
    row_path = (rows * row, rows * row)
    if not (cfg.parallel.share_prompt_prefix and cfg.engine == "megatron"):
        return (*row_path, 0)
    packed_group = prompt + group * response
    if packed_group <= budget:
        groups = budget // packed_group
        return groups * packed_group, groups * group * row, groups * packed_group
    rows = max(1, (budget - prompt) // response)
    return prompt + rows * response, rows * row, prompt + rows * response


def _prm_hf_config(path: str) -> dict | None:
    """The PRM's HF config: ``path/config.json`` (an HF folder, as ``open_prm`` reads it), else that of the
    ``model.hf_config`` saved with a grpo-mega checkpoint or run directory there; None when neither exists."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        return json.loads(config_file.read_text())
    from grpo_mega.checkpoint.source import checkpoint_config

    try:
        hf_dir = (checkpoint_config(path).get("model") or {}).get("hf_config")
    except (OSError, ValueError):
        return None
    saved = Path(hf_dir or "") / "config.json"
    return json.loads(saved.read_text()) if hf_dir and saved.is_file() else None


def _prm_request(cfg, dtype: str, tp: int, pp: int,
                 prm_shape: str | None = None) -> tuple[ModelRequest | None, str | None, str | None]:
    """(The PRM's model request at the layout it runs at (``tp`` x ``pp``) or None, why it is unknown, a note).
    ``prm_shape``: the folder of the PRM's config.json the config's header names (``# plan-prm:``), read instead
    while ``process_reward.prm`` names no folder here."""
    if cfg.process_reward.source != "prm":
        return None, None, None
    configured = cfg.process_reward.prm or ""
    path, named, note = configured, f"process_reward.prm={configured}", None
    if prm_shape and not (configured and Path(configured).exists()):
        path, named = prm_shape, f"the config's '# plan-prm: {prm_shape}'"
        note = (f"PRM: process_reward.prm={configured} is not here; planned with the shape the config's header names "
                f"({prm_shape})")
    hf = _prm_hf_config(path)
    if hf is None:
        found = ("holds no config.json (nor a grpo-mega checkpoint's)" if path and Path(path).is_dir()
                 else "no such folder")
        return None, (f"PRM unknown: {named}: {found}; its weights and activations are not counted "
                      "(process_reward.prm)"), note
    classifier = is_prm_classifier(hf.get("architectures"))
    return ModelRequest(hf, tp, pp, dtype, lm_output=not classifier,
                        head="classifier" if classifier else "none"), None, note


def plan_config(cfg, *, gpus_per_node: int, gpu_memory_gib: float, nodes: int = 1, gpu_name: str = "",
                assume: Mapping[str, Any] | None = None, config_name: str = "", prm_shape: str | None = None) -> Plan:
    """The memory plan of ``cfg`` (a ``GRPOConfig``) on ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gib`` GiB.
    ``assume``: memory settings to plan with instead of the config's ({"distributed_optimizer": "true", ...},
    ``grpo_mega.plan.settings.MemorySettings``). Counts parameters from megatron's model built on the meta device
    (``grpo_mega.plan.counts``); a second or so, plus megatron's import the first time. ``gpu_name``: as the
    device reports it; vLLM's default batch limits differ on an A100. ``prm_shape``: the PRM's shape folder the
    config's header names (``grpo_mega.plan.settings.documented_shape``), planned with while
    ``process_reward.prm`` is not there (said in a note)."""
    if cfg.engine != "megatron":
        # a plan at engine=megatron is a guide only: ZeRO partitions otherwise, and peft's LoRA (one A per HF
        # linear) trains more parameters than megatron's (one A per fused linear, the plan's count)
        lora_note = (" (its LoRA adapters then count one A per fused linear, where peft's on DeepSpeed have one per "
                     "q, k, v, gate and up projection)") if cfg.model.lora.enabled else ""
        raise ConfigError(f"engine={cfg.engine!r}: grpo-mega plan models the megatron engine (DeepSpeed's ZeRO "
                          f"partitions differently); plan with engine=megatron{lora_note}")
    hardware = Hardware(gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib, nodes=nodes, gpu_name=gpu_name)
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    dp = data_parallel_size(cfg, hardware)
    settings = memory_settings(cfg, dp, assume)
    cpu = cfg.parallel.device == "cpu"
    dtype, dtype_bytes = ("float32", 4) if cpu else ("bfloat16", 2)
    policy_hf = read_hf_config(cfg.model.hf_config, "model.hf_config")
    # rollout.engine=auto takes vLLM on a GPU where it is installed (grpo_mega.rollout.engine_choice): plan for it
    vllm = cfg.rollout.engine == "vllm" or (cfg.rollout.engine == "auto" and not cpu)
    rollout_tp = rollout_tensor_parallel(cfg)
    lora = cfg.model.lora
    lora_fields = ({"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
                   if lora.enabled else None)
    requests = [ModelRequest(policy_hf, tp, pp, dtype, lora=lora_fields)]
    if vllm:
        requests.append(ModelRequest(policy_hf, rollout_tp, 1, "bfloat16"))
    generators = rollout_ranks(cfg)  # rollout.mode=async: GPUs of their own generate (and score with the PRM)
    # the rollout world builds the PRM at TP1 (grpo_mega.rollout_worker); colocated, it shares the policy's layout;
    # on vLLM (process_reward.scorer: vllm) it runs at its own TP, in vLLM's dtype
    vllm_prm = cfg.process_reward.scorer == "vllm"
    prm_tp, prm_pp = (1, 1) if generators else (tp, pp)
    if vllm_prm:
        prm_tp, prm_pp = cfg.process_reward.vllm_tensor_parallel, 1
    prm_request, prm_note, prm_shape_note = _prm_request(cfg, "bfloat16" if vllm_prm and not cpu else dtype, prm_tp,
                                                         prm_pp, prm_shape)
    if prm_request is not None:
        requests.append(prm_request)
    counted = count_stage_params(requests)
    policy_stages = counted[0]
    notes: list[str] = [prm_shape_note] if prm_shape_note else []
    if cfg.rollout.engine == "auto":
        notes.append(f"rollout.engine=auto: planned as {'vllm' if vllm else 'hf'} (what a "
                     f"{'CPU run' if cpu else 'GPU with vLLM installed'} takes)")

    from grpo_mega.model.config_map import padded_vocab_size

    shapes = Shapes.from_hf(policy_hf, padded_vocab_size(int(policy_hf["vocab_size"]), tp))
    layer_tokens, head_tokens, packed = update_tokens(cfg)
    if not cpu and packed:
        # Transformer Engine's layers cannot run packed rows: with TE installed the engine takes the row path.
        row = cfg.data.prompt_length + cfg.algorithm.response_length
        layer_tokens = max(layer_tokens, max(1, cfg.parallel.max_tokens_per_micro_batch // row) * row)
        notes.append("micro-batch tokens: the larger of the shared-prompt path (local layers) and the row path "
                     "(Transformer Engine)")
    activations = update_activation_bytes(
        shapes, tokens=layer_tokens, head_tokens=head_tokens, tp=tp, pp=pp, dtype_bytes=dtype_bytes,
        sequence_parallel=settings.sequence_parallel, recompute=settings.recompute)
    logprobs = logprob_buffer_bytes(shapes, chunk=cfg.model.logprob_chunk_size, head_tokens=head_tokens, tp=tp)
    # The most loaded stage: static bytes per stage (activations are the first stage's, a bound for all).
    statics = [training_static_bytes(stage, dp, settings.distributed_optimizer) for stage in policy_stages]
    worst = max(range(pp), key=lambda i: statics[i].total)
    policy = statics[worst]
    # LoRA: the KL reference is the policy with its adapters off (grpo_mega.lora.reference), no second model
    reference = forward_only_bytes(policy_stages[worst]) if cfg.algorithm.use_kl_loss and not lora.enabled else 0
    if lora.enabled:
        trainable = sum(p.numel for p in policy_stages[worst] if p.trainable)
        notes.append(f"model.lora: rank {lora.rank}, {trainable:,} trainable parameters on the most loaded stage "
                     "(gradients and optimizer state for those only); the KL reference is the base (no second model)")
    prm = prm_activations = 0
    prm_plan = None
    if prm_request is not None and vllm_prm:
        prm_hf = prm_request.hf_config
        prm_plan = plan_vllm_prm(
            shapes=Shapes.from_hf(prm_hf, int(prm_hf["vocab_size"])),
            weight_elements=sum(p.numel for p in counted[-1][0]), tensor_parallel=prm_tp,
            world_size=generators or hardware.world_size, gpu_bytes=hardware.gpu_bytes,
            gpu_memory_utilization=cfg.process_reward.vllm_gpu_memory_utilization, sleeps=not cpu,
            limits=resolve_batch_limits(None, None, gpu_bytes=hardware.gpu_bytes, gpu_name=hardware.gpu_name),
            sampler=cfg.process_reward.layout == "likelihood")
        notes.append(prm_plan.note)
        prm = 0 if prm_plan.sleeps else prm_plan.budget  # asleep: nothing on the GPU outside its scoring
    elif prm_request is not None:
        prm_stages = counted[-1]
        prm = max(forward_only_bytes(stage) for stage in prm_stages)
        prm_hf = prm_request.hf_config
        prm_shapes = Shapes.from_hf(prm_hf, padded_vocab_size(int(prm_hf["vocab_size"]), prm_tp))
        prm_activations = forward_activation_bytes(prm_shapes, tokens=cfg.parallel.max_tokens_per_micro_batch,
                                                   tp=prm_tp, dtype_bytes=dtype_bytes)
    elif prm_note:
        prm = None
    # process_reward.source: implicit: a second trained model of the policy's architecture and layout (its own
    # weights, gradients and optimizer state: the policy's figures), and its reference unless the KL one serves
    implicit = cfg.process_reward.source == "implicit"
    implicit_static = policy if implicit else None
    implicit_reference = forward_only_bytes(policy_stages[worst]) if (
        implicit and not cfg.implicit_prm_shares_kl_reference()) else 0

    device_base = {"CUDA context": 0 if cpu else CUDA_CONTEXT_BYTES, "NCCL": 0 if cpu else NCCL_BYTES}
    base = {**device_base, "parameters": policy.params}
    implicit_entries = {} if implicit_static is None else {
        "implicit PRM (weights, gradients, optimizer)": implicit_static.total,
        "implicit PRM reference": implicit_reference}
    # a sleeping vLLM PRM holds nothing outside prm_scoring; without sleep mode, its whole budget
    prm_entry = {} if vllm_prm and not prm else {"vLLM PRM (no sleep mode)" if vllm_prm else "PRM weights": prm or 0}
    resident_others = {"reference (KL)": reference, **prm_entry, **implicit_entries}
    if implicit_static is not None:
        notes.append("process_reward.source=implicit: the implicit PRM is a second policy-sized trained model, "
                     "resident in every phase; its update's activations are the policy update's (same model, same "
                     "rows); its reference is " + ("the KL reference (shared)" if not implicit_reference else
                                                    "a forward-only copy of its own"))
    if generators:  # the training ranks hold no PRM, no vLLM; the rollout ranks hold those and no policy
        full_weights = sum(p.numel for stage in policy_stages for p in stage) * tp * dtype_bytes  # norms: x tp, ~
        copies_gib = (cfg.rollout.max_staleness + 1) * full_weights / 2**30
        resident_others = {"reference (KL)": reference, **implicit_entries}  # the implicit PRM trains here
        rollout_base = {**device_base, **prm_entry}
        notes.append(
            f"rollout.mode=async: update and save are the {hardware.world_size - generators} training GPUs' (DP{dp}); "
            f"generation and prm_scoring the {generators} rollout GPUs' (the PRM at TP1). The weights cross in host "
            f"memory: training rank 0 holds up to rollout.max_staleness + 1 = {cfg.rollout.max_staleness + 1} "
            f"copies, about {copies_gib:.1f} GiB of host RAM")
    update = Phase("update", {**base, "gradients": policy.grads, "optimizer": policy.optimizer, **resident_others,
                              "activations": activations, "log-prob buffers": logprobs})
    phases = [update]
    vllm_plan = None
    vllm_resident: dict[str, int] = {}
    if vllm:
        limits = resolve_batch_limits(cfg.rollout.max_num_batched_tokens, cfg.rollout.max_num_seqs,
                                      gpu_bytes=hardware.gpu_bytes, gpu_name=hardware.gpu_name)
        vllm_plan = plan_vllm(
            limits=limits, enforce_eager=cfg.rollout.enforce_eager,
            shapes=Shapes.from_hf(policy_hf, int(policy_hf["vocab_size"])),
            weight_elements=sum(p.numel for p in counted[1][0]), tensor_parallel=rollout_tp,
            world_size=generators or hardware.world_size, gpu_bytes=hardware.gpu_bytes,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            sequence_tokens=cfg.data.prompt_length + cfg.algorithm.response_length,
            rollout_sequences=cfg.algorithm.rollout_batch_size * cfg.algorithm.num_return_sequences_in_group)
        offload = settings.offload_during_rollout
        vllm_resident = {"vLLM weights": vllm_plan.weights, "vLLM KV cache": max(0, vllm_plan.kv_cache),
                         "vLLM CUDA graphs": vllm_plan.cuda_graphs}
        if generators:
            generation = Phase("generation", {**rollout_base, **vllm_resident, "vLLM workspace": vllm_plan.workspace})
            vllm_resident = {}  # nothing of vLLM on the training GPUs
        else:
            # vLLM sleeps during the update, but its CUDA-graph pool does not go with it
            update.items["vLLM CUDA graphs"] = vllm_plan.cuda_graphs
            generating = dict(resident_others)
            if offload and implicit_static is not None and not cfg.implicit_prm.before_dynamic_sampling:
                # its gradients and optimizer state leave with the policy's (it trains after the rollout stage)
                generating["implicit PRM (weights, gradients, optimizer)"] = implicit_static.params
            generation = Phase("generation", {
                **base, "gradients": 0 if offload else policy.grads, "optimizer": 0 if offload else policy.optimizer,
                **generating, **vllm_resident, "vLLM workspace": vllm_plan.workspace})
        phases.append(generation)
        if 0 < vllm_plan.sequences_held < vllm_plan.sequences_asked:
            notes.append(f"vLLM holds {vllm_plan.sequences_held} of the {vllm_plan.sequences_asked} full-length "
                         f"sequences a step asks of a replica: the rest wait for room (fine for memory, slower)")
        if prm_request is not None:
            phases.append(Phase("prm_scoring", {**generation.items, **_scoring_items(prm_plan, prm_activations)}))
    elif prm_request is not None:
        holding = rollout_base if generators else {**base, "gradients": policy.grads, "optimizer": policy.optimizer,
                                                   **resident_others}
        phases.append(Phase("prm_scoring", {**holding, **_scoring_items(prm_plan, prm_activations)}))
    # The save comes after the step's weight sync, which woke vLLM (weights and KV cache); the optimizer state is
    # on the device for it (an offloaded one is taken back), and the distributed optimizer gathers its state.
    save_bytes = checkpoint_save_bytes(policy_stages[worst], dp, settings.distributed_optimizer)
    phases.append(Phase("save", {**base, "gradients": policy.grads, "optimizer": policy.optimizer,
                                 **resident_others, **vllm_resident, "checkpoint gather": save_bytes.device}))
    savers_per_node = min(hardware.gpus_per_node, hardware.world_size - generators)  # async: training ranks only
    # the implicit PRM is saved with each checkpoint after the policy, the same figures: the peak is one model's
    save_host = SaveHost(per_rank=save_bytes.host, per_node=save_bytes.host * savers_per_node)
    if settings.assumed:
        notes.append("assumed (not from the config): " + ", ".join(
            f"{name}={getattr(settings, name)}" for name in settings.assumed))
    parameters = sum(sum(p.numel for p in stage) for stage in policy_stages)
    return Plan(config=config_name, hardware=hardware, settings=settings, tensor=tp, pipeline=pp, data=dp,
                dtype=dtype, parameters=parameters, policy=policy, stages=statics, micro_batch_tokens=layer_tokens,
                head_tokens=head_tokens, activations=activations, logprob_buffers=logprobs, reference=reference,
                prm=prm, prm_activations=prm_activations, vllm=vllm_plan, phases=phases, notes=notes,
                save_host=save_host, unknown=[prm_note] if prm_note else [],
                prm_hf_config=prm_request.hf_config if prm_request is not None else None, vllm_prm=prm_plan)


def _scoring_items(prm_plan, prm_activations: int) -> dict[str, int]:
    """What the PRM adds while it scores: the engine's forward activations, or the vLLM PRM awake (its weights,
    workspace and KV cache; without sleep mode already counted in every phase, under one name)."""
    if prm_plan is None:
        return {"PRM activations": prm_activations}
    return prm_plan.resident if prm_plan.sleeps else {}
