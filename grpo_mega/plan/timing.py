"""A config's step time: reads a ``GRPOConfig`` and its memory :class:`~grpo_mega.plan.phases.Plan` into the
formulas of ``grpo_mega.plan.step_time``.

What a config does not say is an assumption, passed in (``grpo-mega plan --mean-prompt / --mean-response``) and
printed with the result: the mean prompt and response lengths (defaults: a quarter of ``data.prompt_length`` and
half of ``algorithm.response_length``), the longest response (``algorithm.response_length``: in a batch of
hundreds some responses reach the limit), and the mean number of sampling rounds dynamic sampling takes (1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_mega.plan.activations import Shapes
from grpo_mega.plan.devices import DeviceProfile
from grpo_mega.plan.phases import Plan
from grpo_mega.plan.step_time import (
    Efficiency, Lengths, ModelCost, StepTime, TrainLayout, combine, concurrent_sequences, forward_pass_seconds,
    generation_seconds, save_seconds, update_seconds, weight_sync_seconds,
)


@dataclass(frozen=True)
class Assumptions:
    """What the step time assumes beyond the config (each printed beside the result)."""

    mean_prompt: float | None = None
    """Mean prompt tokens; None: data.prompt_length / 4."""
    mean_response: float | None = None
    """Mean response tokens; None: algorithm.response_length / 2."""
    sampling_rounds: float = 1.0
    """Mean generation rounds per step (dynamic sampling regenerates when too few groups are kept)."""
    label_problems: int = 7500
    """Process supervision's one-off cost: problems the policy solves for Monte-Carlo labels (MATH's train set)."""
    label_solutions: int = 4
    """Solutions per problem that get step labels."""
    label_steps: int = 8
    """Mean steps per solution (one labelled prefix each)."""
    label_rollouts: int = 8
    """Monte-Carlo completions per step prefix (Math-Shepherd's K)."""


def _lengths(cfg, a: Assumptions) -> Lengths:
    prompt = a.mean_prompt if a.mean_prompt is not None else cfg.data.prompt_length / 4
    tail = cfg.algorithm.response_length
    mean = a.mean_response if a.mean_response is not None else tail / 2
    if not 0 < mean <= tail:
        raise ValueError(f"--mean-response {mean}: expected > 0 and <= algorithm.response_length={tail}")
    if not 0 <= prompt <= cfg.data.prompt_length:
        raise ValueError(f"--mean-prompt {prompt}: expected >= 0 and <= data.prompt_length={cfg.data.prompt_length}")
    return Lengths(prompt=prompt, response_mean=mean, response_tail=tail)


GPU_MEASUREMENT = "a 0.5B policy on one H200, bench/results/gpu_check_h200.json"
"""This project's GPU run whose steps the shipped factors are fitted on (bench/step_time_gpu.py; docs/performance.md,
"The first GPU run")."""

SMALL_MODEL_PARAMS = 1e9
"""Below this many matmul parameters a GPU step is bound by fixed costs (launches, Python, the optimizer step), which
the model prices from that one run."""


def _model(hf: dict, dtype_bytes: int) -> ModelCost:
    from grpo_mega.model.config_map import padded_vocab_size

    return ModelCost.from_shapes(Shapes.from_hf(hf, padded_vocab_size(int(hf["vocab_size"]), 1)), dtype_bytes)


def _micro_batches(cfg, rows_per_rank: float, lengths: Lengths) -> int:
    """Micro-batches per mini-batch and DP rank: the rows' mean tokens (with ``parallel.share_prompt_prefix`` on the
    Megatron engine one prompt per group) over ``parallel.max_tokens_per_micro_batch``. The engine packs them into
    that few: first fit, largest first (bench/results/update_fixed_costs.json: 2 micro-batches, the fewest possible,
    for the gpu_check step that full-length rows counted as 4)."""
    shared = cfg.parallel.share_prompt_prefix and cfg.engine == "megatron"
    prompt = lengths.prompt / cfg.algorithm.num_return_sequences_in_group if shared else lengths.prompt
    tokens = rows_per_rank * (prompt + lengths.response_mean)
    return max(1, math.ceil(tokens / cfg.parallel.max_tokens_per_micro_batch))


def config_step_time(cfg, plan: Plan, device: DeviceProfile, eff: Efficiency | None = None,
                     assumptions: Assumptions | None = None) -> tuple[StepTime, dict[str, float]]:
    """(The step's phases, the one-off phases of process supervision with a learned PRM ({} otherwise)).

    Phases: generation (prefill + decode on vLLM's replicas, batch limits and KV cache from the plan), prm_scoring
    (a learned PRM: one forward over the rows), old_logprobs (unless the update is on-policy: one epoch, one
    mini-batch), reference (KL on), implicit_prm_scoring (its forward unless ``implicit_prm.update: after`` scores
    with its update's own, and its reference's unless the KL's serves)
    and implicit_prm_update (one epoch over the rows), update, weight_sync, save (amortised over
    trainer.save_every). One-off: prm_labels (the policy's solutions and K completions per step prefix) and
    prm_training (one epoch over the labelled solutions)."""
    eff = eff or Efficiency()
    a = assumptions or Assumptions()
    from grpo_mega.plan.build import read_hf_config

    dtype_bytes = 4 if cfg.parallel.device == "cpu" or device.name == "CPU" else 2  # fp32 on the CPU, bf16 on GPUs
    policy = _model(read_hf_config(cfg.model.hf_config, "model.hf_config"), dtype_bytes)
    lengths = _lengths(cfg, a)
    alg = cfg.algorithm
    groups, group = alg.rollout_batch_size, alg.num_return_sequences_in_group
    rows = groups * group
    hw = plan.hardware
    asynchronous = getattr(cfg.rollout, "mode", "colocated") == "async"
    generators = int(cfg.rollout.async_ranks) if asynchronous else 0
    train_gpus = hw.world_size - generators
    layout = TrainLayout(plan.tensor, plan.pipeline, plan.data, hw.gpus_per_node)
    rollout_gpus = generators or hw.world_size
    notes = [f"assumed: mean prompt {lengths.prompt:.0f} tokens, mean response {lengths.response_mean:.0f}, longest "
             f"{lengths.response_tail:.0f} (response cv {lengths.response_cv}), {a.sampling_rounds:g} sampling "
             f"round(s) per step"]
    generated = rows * a.sampling_rounds
    eager = plan.vllm is None  # the hf engine decodes eagerly; vLLM through CUDA graphs
    if plan.vllm is not None:
        v = plan.vllm
        replicas, rtp = v.replicas, v.tensor_parallel
        per_replica = generated / replicas
        concurrent = concurrent_sequences(per_replica, v.limits.max_num_seqs, max(0, v.kv_cache), policy, rtp, lengths)
    else:  # the hf engine: every model-parallel group generates its DP share of the rows at once
        replicas, rtp = max(1, rollout_gpus // (plan.tensor * plan.pipeline)), plan.tensor
        concurrent = generated / replicas
        if device.name != "CPU":
            notes.append("rollout.engine=hf on a GPU: generation priced by the eager decode loop's per-layer cost "
                         f"fitted on {GPU_MEASUREMENT} (a host read and a vocabulary sort every step then; issue 77 "
                         "removed both: expect it faster): use rollout.engine=vllm on GPUs")
    if device.name != "CPU" and policy.matmul_params < SMALL_MODEL_PARAMS:
        notes.append(f"a policy under {SMALL_MODEL_PARAMS / 1e9:g}B matmul parameters on a GPU: its step is fixed "
                     f"costs (per layer pass, per optimizer step), priced from one run ({GPU_MEASUREMENT})")
    if cfg.process_reward.source == "tree":
        notes.append("process_reward.source=tree: sampled as G independent chains (the tree's shared prefixes and "
                     "its extra generation passes, one per level, are not modelled)")
    gen = generation_seconds(policy, lengths, sequences=generated, replicas=replicas, tp=rtp, concurrent=concurrent,
                             device=device, eff=eff, eager=eager)
    phases = {"generation": gen["prefill"] + gen["decode"]}
    mini = alg.mini_batch_size or groups
    optimizer_steps = alg.ppo_epochs * math.ceil(groups / mini)
    micro = _micro_batches(cfg, mini * group / plan.data, lengths)
    calls = _micro_batches(cfg, rows / plan.data, lengths)  # a forward pass over every row of the step
    if cfg.process_reward.source == "prm" and plan.prm_hf_config is not None:
        prm = _model(plan.prm_hf_config, dtype_bytes)
        if cfg.process_reward.scorer == "vllm":  # replicas of vllm_tensor_parallel ranks split the rows
            ptp = int(cfg.process_reward.vllm_tensor_parallel)
            prm_layout = TrainLayout(ptp, 1, max(1, (generators or hw.world_size) // ptp), hw.gpus_per_node)
            notes.append("process_reward.scorer=vllm: scoring priced as a forward on its replicas (the same FLOPs as "
                         "the engine's); its sleep / wake between steps is not priced")
        else:
            prm_layout = TrainLayout(1, 1, generators, hw.gpus_per_node) if generators else layout
        phases["prm_scoring"] = forward_pass_seconds(prm, lengths, rows, prm_layout, device, eff, micro_batches=micro,
                                                     calls=_micro_batches(cfg, rows / prm_layout.data, lengths))
    elif cfg.process_reward.source == "prm":
        notes.append("PRM unknown (no readable config.json): its scoring is not counted")
    forward = forward_pass_seconds(policy, lengths, rows, layout, device, eff, micro_batches=micro, calls=calls)
    if optimizer_steps > 1:
        phases["old_logprobs"] = forward
    if alg.use_kl_loss:
        phases["reference"] = forward
    if cfg.process_reward.source == "implicit":
        # its reference's forward unless the KL's serves; its scoring forward unless it scores with its update's own
        # (implicit_prm.update: after)
        passes = (1 if cfg.implicit_prm.update == "before" else 0) + (0 if cfg.implicit_prm_shares_kl_reference() else 1)
        phases["implicit_prm_scoring"] = passes * forward
        phases["implicit_prm_update"] = update_seconds(
            policy, lengths, rows, layout, device, eff, epochs=1, optimizer_steps=math.ceil(groups / mini),
            micro_batches=micro, distributed_optimizer=plan.settings.distributed_optimizer,
            recompute=plan.settings.recompute == "full")
    phases["update"] = update_seconds(
        policy, lengths, rows, layout, device, eff, epochs=alg.ppo_epochs, optimizer_steps=optimizer_steps,
        micro_batches=micro, distributed_optimizer=plan.settings.distributed_optimizer,
        recompute=plan.settings.recompute == "full")
    phases["weight_sync"] = weight_sync_seconds(policy, device, eff, across_nodes=bool(generators),
                                                model_parallel=plan.tensor * plan.pipeline)
    phases["save"] = save_seconds(policy, device, nodes=max(1, math.ceil(train_gpus / hw.gpus_per_node)),
                                  save_every=cfg.trainer.save_every)
    step = combine(phases, asynchronous=asynchronous, gpus=hw.world_size, notes=notes)
    one_off: dict[str, float] = {}
    if cfg.process_reward.source == "prm" and plan.prm_hf_config is not None:
        one_off = process_one_off(policy, _model(plan.prm_hf_config, dtype_bytes), lengths, a, layout, replicas, rtp,
                                  concurrent, device, eff, micro, eager=eager)
        notes.append(f"one-off (a PRM trained here): {a.label_problems} problems x {a.label_solutions} solutions, "
                     f"{a.label_steps} steps each, {a.label_rollouts} Monte-Carlo completions per step")
    return step, one_off


def process_one_off(policy: ModelCost, prm: ModelCost, lengths: Lengths, a: Assumptions, layout: TrainLayout,
                    replicas: int, rtp: int, concurrent: float, device: DeviceProfile, eff: Efficiency,
                    micro_batches: int, *, eager: bool = False) -> dict[str, float]:
    """The one-off phases of a PRM trained by this project's pipeline: prm_labels = generation of the solutions
    (problems x solutions) and of K completions from every step prefix (the prefix is prompt + on average half
    the solution, each completion on average half a response), prm_training = one epoch of updates of the PRM
    over the labelled solutions (every rank, the policy's layout)."""
    solutions = a.label_problems * a.label_solutions
    sample = generation_seconds(policy, lengths, sequences=solutions, replicas=replicas, tp=rtp,
                                concurrent=concurrent, device=device, eff=eff, eager=eager)
    half = Lengths(prompt=lengths.prompt + lengths.response_mean / 2, response_mean=lengths.response_mean / 2,
                   response_tail=lengths.response_tail, response_cv=lengths.response_cv)
    completions = solutions * a.label_steps * a.label_rollouts
    rollouts = generation_seconds(policy, half, sequences=completions, replicas=replicas, tp=rtp,
                                  concurrent=concurrent, device=device, eff=eff, eager=eager)
    training = update_seconds(prm, lengths, solutions, layout, device, eff, epochs=1, optimizer_steps=1,
                              micro_batches=micro_batches, distributed_optimizer=True)
    return {"prm_labels": sum(sample.values()) + sum(rollouts.values()), "prm_training": training}
