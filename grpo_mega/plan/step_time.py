"""Seconds per phase of one GRPO step: a roofline model from FLOPs and bytes, a layout and a device profile.

Pure functions, each with its formula. Symbols: N the matmul parameters a token passes through (the LM head
included, the embedding lookup not; the active ones for a mixture of experts), W the rollout weights' bytes, l
layers, a the attention width (heads x head_dim), k the KV-cache bytes per token (K and V, every layer), P the mean
prompt tokens, L a response's tokens (mean Lm, tail Lt: the longest in the batch, E[L^2] = Lm^2 (1 + cv^2)), S
sequences per rollout replica, B the replica's concurrent sequences, F the device's peak FLOP/s, M its memory
bytes/s.

What a step really gets out of a device is seven named factors (``Efficiency``), fitted on measured steps
(``bench/step_time_published.py`` for GPUs, ``bench/step_time_cpu.py`` for this project's CPU) and the same for
every config on that kind of device. Besides the roofline's shares of peak (four factors), three are fixed costs
that no FLOP or byte count sees: per decode step of the engine, per layer of an eager pass (kernel launches and
Python), and per collective call (its latency): what bounds a small model's step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from grpo_mega.plan.devices import DeviceProfile


@dataclass(frozen=True)
class Efficiency:
    """The model's only free figures: shares of a device's peak that each kind of work reaches, and fixed costs.
    Defaults: the least-squares fit (in log seconds) on the published GPU rows together with this project's own GPU
    run's steps (``bench/step_time_gpu.py``, ``bench/results/step_time_gpu.json``: the H200 gpu_check steps within
    21 % per phase, the published rows as their own fit placed them)."""

    mfu_train: float = 0.660
    """Model FLOP utilisation of the update (forward + backward + optimizer, 6 N per token plus attention, recompute
    not counted as useful work)."""
    mfu_forward: float = 0.299
    """Model FLOP utilisation of forward-only passes: prefill, old / reference log-probs, PRM scoring."""
    decode_bandwidth: float = 0.680
    """Share of the memory bandwidth decoding reaches (weights + KV cache read per token step; kernel launches,
    sampling, scheduling and the shorter last waves included)."""
    comm: float = 0.404
    """Share of the link bandwidth collectives reach (TP all-reduces, DP gradient reduction, weight sync)."""
    decode_step_overhead: float = 0.00412
    """Seconds each decode token step costs beyond its roofline (the engine's scheduling, sampling and launch work
    per step): what keeps a tail-bound rollout from getting faster on more GPUs."""
    layer_overhead: float = 0.00118
    """Seconds each layer costs per eager pass of the training engine beyond its roofline (kernel launches, Python,
    small-kernel tails): every forward or backward of a micro-batch through a rank's layers. On a GPU the host's
    fixed costs overlap the device's work (``DeviceProfile.host_overlap``): a pass takes the longer of the two."""
    eager_decode_overhead: float = 0.00543
    """Seconds each layer costs per decode step (and once per prefill) of the hf engine's eager decode loop beyond
    its roofline: launches, Python, sampling (vLLM decodes through CUDA graphs: its per-step cost is
    decode_step_overhead's)."""
    optimizer_step_overhead: float = 1.03
    """Seconds each optimizer step costs beyond its gradient traffic: megatron's step outside the layers (gradient
    finalisation, the global norm and its host read, clipping, Adam over every parameter, the metrics' reads). The
    norm's host read ends the step's overlap, so it adds to the passes' time."""
    collective_latency: float = 0.0
    """Seconds each collective call costs beyond its bytes over the link (the latency of a TP all-reduce: 2 per
    layer per forward, backward or decode step at TP > 1)."""

    SECONDS = ("decode_step_overhead", "layer_overhead", "eager_decode_overhead", "optimizer_step_overhead",
               "collective_latency")
    """The factors that are seconds (the others are shares of a peak)."""

    def __post_init__(self) -> None:
        for name in ("mfu_train", "mfu_forward", "decode_bandwidth", "comm"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{name}={value}: expected a share in (0, 1]")
        for name in self.SECONDS:
            value = getattr(self, name)
            if not 0 <= value < 60:
                raise ValueError(f"Efficiency.{name}={value}: expected seconds in [0, 60)")


CPU_EFFICIENCY = Efficiency(mfu_train=0.639, mfu_forward=0.323, decode_bandwidth=0.0820, comm=0.0578,
                            decode_step_overhead=1.0e-5, layer_overhead=5.95e-4, eager_decode_overhead=5.95e-4,
                            optimizer_step_overhead=0.0, collective_latency=1.0e-6)
"""The factors fitted on this project's 2-core CPU (``bench/step_time_cpu.py``, ``bench/results/step_time_cpu.json``:
five configs fitted, five judged; 2 processes x 1 thread, the hf engine, fp32): its decode is bound by the eager
layers (0.6 ms per layer and pass, one factor for the training passes and the decode steps when it was fitted), not
by bytes; the per-step and per-call costs fit at their lower bounds."""


def fitted_efficiency(device: DeviceProfile) -> Efficiency:
    """The factors fitted for ``device``'s kind: this CPU's for the CPU profile, the published GPU runs' otherwise."""
    return CPU_EFFICIENCY if device.name == "CPU" else Efficiency()


@dataclass(frozen=True)
class ModelCost:
    """What a model costs per token (from ``grpo_mega.plan.activations.Shapes``)."""

    matmul_params: float
    """N: multiply-adds per token through the layers and the LM head (active experts only)."""
    weight_bytes: float
    """W: every weight in the serving dtype (bf16), all experts, the embedding included."""
    layers: int
    attention_width: int
    hidden: int
    kv_bytes_per_token: float
    """k: 2 x layers x kv_heads x head_dim x dtype bytes."""
    dtype_bytes: int = 2
    """Bytes of a weight (bf16 on GPUs, fp32 on the CPU)."""

    @property
    def parameters(self) -> float:
        return self.weight_bytes / self.dtype_bytes

    @classmethod
    def from_shapes(cls, s, dtype_bytes: int = 2) -> ModelCost:
        """N = l (h (q + 2 kv) + q h + mlp) + V h with mlp = 3 h f (dense) or topk 3 h f_e + h E (MoE);
        W = dtype_bytes (l (attention + all experts) + 2 V h)."""
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        attention = s.hidden * (q + 2 * kv) + q * s.hidden
        if s.experts:
            active_mlp = s.topk * 3 * s.hidden * s.expert_intermediate + s.hidden * s.experts
            all_mlp = s.experts * 3 * s.hidden * s.expert_intermediate + s.hidden * s.experts
        else:
            active_mlp = all_mlp = 3 * s.hidden * s.intermediate
        head = s.vocab * s.hidden
        return cls(matmul_params=s.layers * (attention + active_mlp) + head,
                   weight_bytes=dtype_bytes * (s.layers * (attention + all_mlp) + 2 * head),
                   layers=s.layers, attention_width=q, hidden=s.hidden,
                   kv_bytes_per_token=2 * s.layers * kv * dtype_bytes, dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class Lengths:
    """Token counts of a step's sequences. ``response_tail``: the longest response of the step (decoding's last
    wave runs until it ends); ``response_cv``: the responses' standard deviation over their mean."""

    prompt: float
    response_mean: float
    response_tail: float
    response_cv: float = 0.7

    def __post_init__(self) -> None:
        if not (self.prompt >= 0 and 0 < self.response_mean <= self.response_tail):
            raise ValueError(f"{self}: expected prompt >= 0 and 0 < response_mean <= response_tail")

    @property
    def response_square(self) -> float:
        """E[L^2] = Lm^2 (1 + cv^2)."""
        return self.response_mean**2 * (1 + self.response_cv**2)

    @property
    def sequence_square(self) -> float:
        """E[(P + L)^2] = P^2 + 2 P Lm + E[L^2]."""
        return self.prompt**2 + 2 * self.prompt * self.response_mean + self.response_square


def forward_flops(model: ModelCost, lengths: Lengths, sequences: float) -> float:
    """FLOPs of one forward pass over ``sequences`` whole rows: 2 N S (P + Lm) + 2 l a S E[(P + L)^2] (causal
    attention: Q K^T and A V each l a L^2 / 2 multiply-adds per row)."""
    tokens = sequences * (lengths.prompt + lengths.response_mean)
    return 2 * model.matmul_params * tokens + 2 * model.layers * model.attention_width * sequences * \
        lengths.sequence_square


def compute_seconds(flops: float, devices: int, device: DeviceProfile, mfu: float) -> float:
    """flops / (devices x F x mfu)."""
    return flops / (devices * device.peak_flops * mfu)


def pipeline_bubble(pipeline: int, micro_batches: int) -> float:
    """1F1B's idle share over the useful time: (PP - 1) / m, m micro-batches per mini-batch and DP rank; 0 at PP1."""
    if pipeline < 1 or micro_batches < 1:
        raise ValueError(f"pipeline={pipeline}, micro_batches={micro_batches}: expected >= 1")
    return (pipeline - 1) / micro_batches


def ring_seconds(bytes_: float, ranks: int, bandwidth: float, comm: float, *, all_reduce: bool = True) -> float:
    """A ring collective over ``ranks``: all-reduce moves 2 (r - 1) / r x bytes per rank, reduce-scatter or
    all-gather (r - 1) / r x bytes; over bandwidth x comm. 0 for one rank."""
    if ranks <= 1:
        return 0.0
    share = (2 if all_reduce else 1) * (ranks - 1) / ranks
    return share * bytes_ / (bandwidth * comm)


def tensor_parallel_seconds(model: ModelCost, tokens_per_rank: float, tp: int, bandwidth: float, eff: Efficiency,
                            passes: int, *, calls_per_layer: float = 1.0, layers: float | None = None) -> float:
    """Megatron's TP activations traffic: 2 all-reduces (or reduce-scatter + all-gather, the same bytes) of
    tokens x h x dtype bytes per layer and per pass (forward 1, backward 1 more), each call also paying
    collective_latency: 2 x layers x passes x calls_per_layer calls (calls_per_layer: the micro-batches or
    decode steps the tokens are sent in). ``layers``: a rank's layers (default all: PP splits them). 0 at TP1."""
    if tp <= 1:
        return 0.0
    layers = model.layers if layers is None else layers
    data = ring_seconds(tokens_per_rank * model.hidden * model.dtype_bytes, tp, bandwidth, eff.comm)
    return passes * 2 * layers * (data + calls_per_layer * eff.collective_latency)


def eager_layer_seconds(layers: float, passes: float, eff: Efficiency) -> float:
    """layers x passes x layer_overhead: the fixed cost of running ``layers`` eager layers ``passes`` times."""
    return layers * passes * eff.layer_overhead


def with_fixed_costs(device_seconds: float, fixed_seconds: float, device: DeviceProfile) -> float:
    """A pass's seconds from its device work and its host-side fixed costs: max of the two where the host queues
    work ahead of the device (``device.host_overlap``: GPUs), their sum where it does not (the CPU)."""
    if device.host_overlap:
        return max(device_seconds, fixed_seconds)
    return device_seconds + fixed_seconds


def decode_steps(sequences: float, concurrent: float, lengths: Lengths) -> float:
    """Token steps a replica decodes: Lt + Lm max(0, S / B - 1). All S fit at once: the longest response sets the
    pace (Lt steps). More than fit: continuous batching refills freed slots, S Lm / B steps of full batches, and the
    last wave still runs to the tail."""
    if concurrent <= 0:
        raise ValueError(f"concurrent sequences {concurrent}: the KV cache holds none")
    return lengths.response_tail + lengths.response_mean * max(0.0, sequences / concurrent - 1)


def concurrent_sequences(sequences: float, max_num_seqs: int, kv_cache_bytes: float, model: ModelCost, tp: int,
                         lengths: Lengths) -> float:
    """B = min(S, max_num_seqs, KV bytes / (k / tp x (P + Lm))): vLLM's batch limit, and the sequences of mean
    length the replica's KV cache (``kv_cache_bytes`` per rank, from the memory plan) holds."""
    held = kv_cache_bytes / (model.kv_bytes_per_token / tp * (lengths.prompt + lengths.response_mean))
    return max(1e-9, min(sequences, max_num_seqs, held))


def generation_seconds(model: ModelCost, lengths: Lengths, *, sequences: float, replicas: int, tp: int,
                       concurrent: float, device: DeviceProfile, eff: Efficiency,
                       eager: bool = False) -> dict[str, float]:
    """{"prefill", "decode"} seconds of one rollout (every replica in parallel), S = sequences / replicas.

    prefill = 2 N S P / (tp F mfu_forward).
    decode: T = ``decode_steps`` token steps, of which Tf = S Lm / B run a full batch and T - Tf are the tail
    (few sequences left: the weights are what is read).
    decode = max((Tf W + S k C) / (tp M decode_bandwidth), (2 N S Lm + 4 l a S C) / (tp F mfu_forward))
             + (T - Tf) W / (tp M decode_bandwidth) + T decode_step_overhead + TP traffic,
    C = P Lm + E[L^2] / 2 the context tokens a sequence's decode reads (every token reads its context's KV; every
    step reads the weights once); TP traffic: 2 all-reduces per layer of every decoded token's h x dtype bytes
    (S Lm tokens), each of the T x 2 l calls paying collective_latency. ``eager`` (the hf engine): every decode step
    and the prefill also pay l x layer_overhead (vLLM's CUDA graphs do not)."""
    per_replica = sequences / replicas
    prefill = compute_seconds(2 * model.matmul_params * per_replica * lengths.prompt, tp, device, eff.mfu_forward)
    steps = decode_steps(per_replica, concurrent, lengths)
    full = min(steps, per_replica * lengths.response_mean / concurrent)
    context_reads = per_replica * (lengths.prompt * lengths.response_mean + lengths.response_square / 2)
    bandwidth = tp * device.memory_bandwidth * eff.decode_bandwidth
    memory = (full * model.weight_bytes + model.kv_bytes_per_token * context_reads) / bandwidth
    flops = 2 * model.matmul_params * per_replica * lengths.response_mean + \
        4 * model.layers * model.attention_width * context_reads
    compute = compute_seconds(flops, tp, device, eff.mfu_forward)
    tail = (steps - full) * model.weight_bytes / bandwidth
    traffic = tensor_parallel_seconds(model, per_replica * lengths.response_mean, tp, device.intra_node_bandwidth,
                                      eff, 1, calls_per_layer=steps)
    eager_steps = model.layers * steps * eff.eager_decode_overhead if eager else 0.0
    eager_prefill = model.layers * eff.eager_decode_overhead if eager else 0.0
    return {"prefill": with_fixed_costs(prefill, eager_prefill, device),
            "decode": with_fixed_costs(max(memory, compute) + tail, eager_steps, device)
            + steps * eff.decode_step_overhead + traffic}


@dataclass(frozen=True)
class TrainLayout:
    """The training GPUs' layout: TP x PP x DP (x EP inside TP x DP), and the node size for the links."""

    tensor: int
    pipeline: int
    data: int
    gpus_per_node: int
    expert: int = 1

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    def data_bandwidth(self, device: DeviceProfile) -> float:
        """The DP ring's slowest link: NVLink when the whole job sits in one node, else the network."""
        return device.intra_node_bandwidth if self.gpus <= self.gpus_per_node else device.inter_node_bandwidth


def rank_imbalance(lengths: Lengths, sequences_per_rank: float, ranks: int) -> float:
    """The slowest of ``ranks`` data-parallel ranks over the mean: 1 + c / sqrt(n) x sqrt(2 ln r), c = cv Lm / (P + Lm)
    the rows' token spread, n rows per rank (the expected maximum of r normal sums; 1 for one rank). The step
    waits for the rank that drew the longest rows."""
    if ranks <= 1 or sequences_per_rank <= 0:
        return 1.0
    spread = lengths.response_cv * lengths.response_mean / (lengths.prompt + lengths.response_mean)
    return 1 + spread / math.sqrt(sequences_per_rank) * math.sqrt(2 * math.log(ranks))


def forward_pass_seconds(model: ModelCost, lengths: Lengths, sequences: float, layout: TrainLayout,
                         device: DeviceProfile, eff: Efficiency, *, micro_batches: int,
                         calls: int | None = None) -> float:
    """One forward pass over the step's rows on the training GPUs (log-probs, reference, PRM scoring):
    (forward_flops / (gpus F mfu_forward) x imbalance [+ or max, ``with_fixed_costs``] calls x l / PP x
    layer_overhead) x (1 + bubble) + TP
    traffic (one pass, ``calls`` micro-batches). ``micro_batches``: per mini-batch and DP rank (the bubble's m);
    ``calls``: the micro-batches a rank runs over all the rows (default ``micro_batches``)."""
    calls = micro_batches if calls is None else calls
    compute = compute_seconds(forward_flops(model, lengths, sequences), layout.gpus, device, eff.mfu_forward) * \
        rank_imbalance(lengths, sequences / layout.data, layout.data)
    stage_layers = model.layers / layout.pipeline
    fixed = eager_layer_seconds(stage_layers, calls, eff)
    tokens_per_rank = sequences * (lengths.prompt + lengths.response_mean) / layout.data  # every stage sees them all
    traffic = tensor_parallel_seconds(model, tokens_per_rank, layout.tensor, device.intra_node_bandwidth, eff, 1,
                                      calls_per_layer=calls, layers=stage_layers)
    return with_fixed_costs(compute, fixed, device) * (1 + pipeline_bubble(layout.pipeline, micro_batches)) + traffic


def update_seconds(model: ModelCost, lengths: Lengths, sequences: float, layout: TrainLayout,
                   device: DeviceProfile, eff: Efficiency, *, epochs: int, optimizer_steps: int,
                   micro_batches: int, distributed_optimizer: bool, recompute: bool = False) -> float:
    """epochs x ((3 forward_flops (4 with full recompute) / (gpus F mfu_train) x imbalance [+ or max,
    ``with_fixed_costs``] c x l / PP x 3 (4) x layer_overhead) x (1 + bubble) + TP traffic of forward and backward)
    + optimizer_steps x (DP gradient traffic + optimizer_step_overhead); the traffic: all-reduce of 4 bytes (fp32
    gradients) per parameter of a model-parallel rank, or with the distributed optimizer reduce-scatter of 4 bytes +
    all-gather of dtype bytes. c = micro_batches x
    optimizer_steps / epochs: the micro-batches a rank runs per epoch (a forward pass and a backward, which
    launches about twice the forward's kernels)."""
    passes = 4 if recompute else 3
    compute = compute_seconds(passes * forward_flops(model, lengths, sequences), layout.gpus, device,
                              eff.mfu_train) * rank_imbalance(lengths, sequences / layout.data, layout.data)
    calls = micro_batches * max(1, optimizer_steps // max(1, epochs))
    stage_layers = model.layers / layout.pipeline
    fixed = eager_layer_seconds(stage_layers, passes * calls, eff)
    tokens_per_rank = sequences * (lengths.prompt + lengths.response_mean) / layout.data  # every stage sees them all
    traffic = tensor_parallel_seconds(model, tokens_per_rank, layout.tensor, device.intra_node_bandwidth, eff,
                                      passes - 1, calls_per_layer=calls, layers=stage_layers)
    params_per_rank = model.parameters / (layout.tensor * layout.pipeline)
    bandwidth = layout.data_bandwidth(device)
    if distributed_optimizer:
        grads = ring_seconds(4 * params_per_rank, layout.data, bandwidth, eff.comm, all_reduce=False) + \
            ring_seconds(model.dtype_bytes * params_per_rank, layout.data, bandwidth, eff.comm, all_reduce=False)
    else:
        grads = ring_seconds(4 * params_per_rank, layout.data, bandwidth, eff.comm)
    bubble = pipeline_bubble(layout.pipeline, micro_batches)
    return epochs * (with_fixed_costs(compute, fixed, device) * (1 + bubble) + traffic) + \
        optimizer_steps * (grads + eff.optimizer_step_overhead)


def weight_sync_seconds(model: ModelCost, device: DeviceProfile, eff: Efficiency, *, across_nodes: bool,
                        model_parallel: int = 1) -> float:
    """The weights from the training layout into the rollout engine. Rollout GPUs of their own (``across_nodes``):
    W / (network x comm). Colocated: each rank gathers the full weights from its ``model_parallel`` (TP x PP) group
    over NVLink (an all-gather: (mp - 1) / mp x W, 0 at mp 1) and the engine copies them in at the memory
    bandwidth (W / M)."""
    if across_nodes:
        return model.weight_bytes / (device.inter_node_bandwidth * eff.comm)
    gather = ring_seconds(model.weight_bytes, model_parallel, device.intra_node_bandwidth, eff.comm, all_reduce=False)
    return gather + model.weight_bytes / device.memory_bandwidth


def save_seconds(model: ModelCost, device: DeviceProfile, *, nodes: int, save_every: int,
                 optimizer_bytes_per_param: int = 12) -> float:
    """A checkpoint (the weights + fp32 master + Adam's two moments: 2 + 12 bytes per parameter in bf16, all ranks'
    shards written in parallel by ``nodes`` nodes) amortised over ``save_every`` steps; 0 when never saved."""
    if save_every <= 0:
        return 0.0
    return model.parameters * (model.dtype_bytes + optimizer_bytes_per_param) / (nodes * device.storage_bandwidth) / save_every


@dataclass
class StepTime:
    """Seconds per phase of one step, and how they combine. ``rollout`` and ``train`` name the phases of each
    side; colocated, the step is their sum; async (GPUs of their own for the rollout), max(rollout, train) + the
    rest (weight sync, save)."""

    phases: dict[str, float]
    rollout: list[str]
    train: list[str]
    asynchronous: bool
    gpus: int
    notes: list[str] = field(default_factory=list)

    @property
    def rollout_seconds(self) -> float:
        return sum(self.phases[p] for p in self.rollout)

    @property
    def train_seconds(self) -> float:
        return sum(self.phases[p] for p in self.train)

    @property
    def seconds(self) -> float:
        """colocated: sum of every phase; async: max(rollout, train) + the phases of neither side."""
        rest = sum(v for k, v in self.phases.items() if k not in self.rollout and k not in self.train)
        if self.asynchronous:
            return max(self.rollout_seconds, self.train_seconds) + rest
        return self.rollout_seconds + self.train_seconds + rest

    def share(self, phase: str) -> float:
        """The phase's seconds over the step's (async: over the sum of phases, since they overlap)."""
        total = sum(self.phases.values()) if self.asynchronous else self.seconds
        return self.phases[phase] / total if total else 0.0

    def gpu_hours(self, steps: int) -> float:
        return self.seconds * steps * self.gpus / 3600


def combine(phases: dict[str, float], *, asynchronous: bool, gpus: int, notes: list[str] | None = None) -> StepTime:
    """A StepTime whose rollout side is generation and the PRM's scoring, the train side everything the training
    GPUs run (log-probs, reference, implicit PRM, update)."""
    rollout = [p for p in phases if p in ("generation", "prm_scoring")]
    train = [p for p in phases if p in ("old_logprobs", "reference", "implicit_prm_scoring", "implicit_prm_update",
                                        "update")]
    return StepTime(phases=phases, rollout=rollout, train=train, asynchronous=asynchronous, gpus=gpus,
                    notes=notes or [])
