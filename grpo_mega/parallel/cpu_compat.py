"""Run megatron-core 0.16 / 0.19 on the CPU (gloo): the listed device substitutions, nothing else.

megatron-core has no CPU support, but its model, schedules, DDP, optimizer and dist_checkpointing
code is device-agnostic except for a few places that name CUDA outright. `apply_cpu_compat()`
redirects exactly those places to the CPU, so the CPU path runs the same Megatron code as the GPU
path. Three kinds of substitution, each listed in a table below with the reason it is needed:

1. `_TORCH_VIEW_MODULES`: in these megatron modules the global name `torch` is replaced by a view
   of torch in which `torch.cuda.current_device()` is the CPU device, `torch.cuda.synchronize()`
   waits for nothing, `torch.cuda`'s RNG calls use the CPU generator, and tensor factories called
   with a CUDA `device=` allocate on the CPU. Everything else is the real torch.
2. `_CPU_RNG_STATE_FUNCTIONS`: megatron's RNG tracker reads and writes CUDA generator states through
   two helpers; on the CPU they read and write the CPU generator's state.
3. `_CPU_AS_CUDA_FUNCTIONS`: functions that call tensor methods (`t.cuda()`, `t.type()`) run inside
   a torch function mode in which `t.cuda()` keeps a CPU tensor where it is and `t.type()` answers
   with the CUDA spelling, so megatron's fp32 checks still reject non-fp32 tensors.

`init_distributed` applies the layer when the process computes on the CPU: without CUDA, and with
`parallel.device: cpu` also when CUDA is present (inside the patched modules `torch.cuda.is_available()`
then answers False, as on a machine without a GPU). The tables were checked against megatron-core 0.16.1 (and
0.19.2, which needs Python >= 3.12: the same call sites, plus torch.cuda.current_stream() in the grad sync) by
running TP=2 (with and without sequence parallelism), PP=2 (1F1B) and DP=2 training steps with
DistributedDataParallel, get_megatron_optimizer (also its DistributedOptimizer), gradient clipping and
dist_checkpointing save/load on gloo; another minor version raises instead of guessing. gloo has the collectives
sequence parallelism and the DistributedOptimizer use (all_gather_into_tensor, reduce_scatter_tensor, also
asynchronous and inside torch's _coalescing_manager; in gloo since torch 2.2 / 2.3, below our torch>=2.5), so no
collective is substituted (checked with torch 2.13 by tests/test_sequence_parallel.py and
tests/test_distributed_optimizer.py).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# The minor releases whose call sites were checked (see the module docstring); 0.17 and 0.18 were not run.
SUPPORTED_MEGATRON_CORE = ("0.16.", "0.19.")

_CPU = torch.device("cpu")

# Module -> where it names CUDA on a path we use.
_TORCH_VIEW_MODULES: dict[str, str] = {
    "megatron.core.tensor_parallel.random": (
        "RNG tracker: torch.cuda.get_rng_state raises without CUDA, and torch.cuda.manual_seed "
        "would silently leave the tracker's streams unseeded"
    ),
    "megatron.core.tensor_parallel.mappings": (
        "sequence parallelism: all-gather / reduce-scatter output buffers on current_device()"
    ),
    "megatron.core.tensor_parallel.layers": (
        "sequence parallelism: the reduce-scatter buffer of the input gradient on current_device()"
    ),
    "megatron.core.pipeline_parallel.p2p_communication": (
        "tensor-shape buffers on current_device(), torch.cuda.synchronize() after batch_isend_irecv"
    ),
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens = zeros(..., device='cuda')",
    "megatron.core.distributed.param_and_grad_buffer": (
        "param/grad buffers on current_device(); from 0.19 start_grad_sync takes torch.cuda.current_stream()"
    ),
    "megatron.core.optimizer.optimizer": "found_inf / scale tensors with device='cuda'",
    "megatron.core.optimizer.clip_grads": "grad-norm and overflow buffers with device='cuda'",
    "megatron.core.optimizer.distrib_optimizer": (
        "distributed optimizer: load_state_dict allocates the optimizer-state shards on current_device()"
    ),
    "megatron.core.utils": (
        "GlobalMemoryBuffer on current_device(), local_multi_tensor_l2_norm with device='cuda'"
    ),
    "megatron.core.transformer.utils": "attention masks built with device='cuda'",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": (
        "inv_freq moved to current_device() at the first forward"
    ),
    "megatron.core.dist_checkpointing.strategies.filesystem_async": (
        "torch.cuda.synchronize() after copying tensors to host for writing"
    ),
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": (
        "write-failure and plan-reuse flags all-reduced from current_device() / 'cuda'"
    ),
    "megatron.core.transformer.moe.router": (
        "MoE router: its weight moved to current_device() at each forward, the aux-loss buffers on it"
    ),
    "megatron.core.transformer.moe.moe_utils": (
        "MoE aux-loss tracker: per-layer loss values allocated with device='cuda'"
    ),
}

# (module, dotted attribute) -> which tensor method it calls on a CPU tensor.
_CPU_AS_CUDA_FUNCTIONS: dict[tuple[str, str], str] = {
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
    ): "tied embeddings across pipeline stages: weight.data.cuda() before the all-reduce",
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"): (
        "asserts grad.type() == 'torch.cuda.FloatTensor'"
    ),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"): (
        "bf16 with the plain optimizer: sorts parameters by param.type() in the CUDA spellings (16-bit ones get "
        "fp32 main copies) and raises TypeError for any other (CPU) type"
    ),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"): (
        "marks 16-bit parameters for fp32 main copies by param.type() == 'torch.cuda.BFloat16Tensor'"
    ),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"): (
        "sorts parameters by param.type() in the CUDA spellings and raises TypeError for any other (CPU) type"
    ),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"): (
        "checkpointing (fully_reshardable): send_tensor.cuda() before gathering the state shards over DP"
    ),
}

_FACTORY_FUNCTIONS = frozenset(
    ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "ones_like")
)

_applied = False


def _is_cuda(device: Any) -> bool:
    """True for megatron's spellings of the GPU: 'cuda[:i]', cuda devices, device indices."""
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def allocate(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return allocate


class _CudaOnCpu:
    """`torch.cuda` as a patched module sees it: the CPU plays the current device."""

    @staticmethod
    def current_device() -> torch.device:
        """The CPU: buffers megatron puts 'on the current device' go to host memory."""
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU kernels run synchronously: nothing to wait for."""

    @staticmethod
    def current_stream(device: Any = None) -> torch.cpu.Stream:
        """torch's CPU stream, whose waits are no-ops: CPU kernels run in order (megatron-core 0.19's
        bucket-group grad sync asks for the current stream on every step, to wait on CUDA-graph events)."""
        return torch.cpu.current_stream()

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        """State of the CPU generator, the device generator on the CPU."""
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed: int) -> None:
        """Seed the CPU generator, the device generator on the CPU."""
        torch.manual_seed(seed)

    @staticmethod
    def is_available() -> bool:
        """No GPU for the patched modules, even on a machine with one: they take their CPU-only paths."""
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """The `torch` module as a patched megatron module sees it (see the module docstring)."""

    def __init__(self) -> None:
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORY_FUNCTIONS:
            value = _on_cpu(value)
        setattr(self, name, value)  # later look-ups skip __getattr__
        return value


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """CPU replacement of megatron's `_get_cuda_rng_state`: the CPU generator's state (a copy)."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    """CPU replacement of megatron's `_set_cuda_rng_state`: set the CPU generator's state."""
    torch.set_rng_state(new_state)


# (module, function) -> (CPU replacement, why the device generator is the CPU generator there).
_CPU_RNG_STATE_FUNCTIONS: dict[tuple[str, str], tuple[Callable, str]] = {
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): (
        _get_cpu_rng_state,
        "RNG tracker add()/fork() save the device generator state",
    ),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): (
        _set_cpu_rng_state,
        "RNG tracker add()/fork() restore the device generator state",
    ),
}


class _CpuAsCuda(TorchFunctionMode):
    """Tensor methods that assume CUDA: `.cuda()` is a no-op, `.type()` answers 'torch.cuda.*'."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda and args[0].device.type == "cpu":
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # already the CUDA spelling when an enclosing call runs in this mode too
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _run_as_cuda(function: Callable) -> Callable:
    @functools.wraps(function)
    def run(*args, **kwargs):
        with _CpuAsCuda():
            return function(*args, **kwargs)

    return run


def _wrap_as_cuda(owner: Any, attribute: str) -> None:
    """Replace ``owner.attribute`` by a version that runs in :class:`_CpuAsCuda`; a classmethod stays one."""
    raw = vars(owner).get(attribute) if isinstance(owner, type) else None
    if isinstance(raw, classmethod):
        setattr(owner, attribute, classmethod(_run_as_cuda(raw.__func__)))
    else:
        setattr(owner, attribute, _run_as_cuda(getattr(owner, attribute)))


def _resolve(module_name: str, dotted: str) -> tuple[Any, str]:
    """Return (owner object, attribute name) for 'Class.method' or 'function' in a module."""
    owner = importlib.import_module(module_name)
    *path, name = dotted.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise RuntimeError(f"cpu_compat: {module_name}.{dotted} no longer exists")
    return owner, name


def _check_megatron_version() -> None:
    import megatron.core

    version = megatron.core.__version__
    if not version.startswith(SUPPORTED_MEGATRON_CORE):
        raise RuntimeError(
            f"grpo_mega's CPU compatibility layer was checked against megatron-core "
            f"{' and '.join(minor + 'x' for minor in SUPPORTED_MEGATRON_CORE)}, but megatron-core {version} is "
            "installed; its CUDA-only call sites may have moved (see grpo_mega/parallel/cpu_compat.py)"
        )


def apply_cpu_compat() -> None:
    """Redirect megatron-core's CUDA-only call sites to the CPU; idempotent.

    Call it only in a process that computes on the CPU (``init_distributed`` decides): the patched
    modules then allocate on the CPU even when CUDA is present. Raises RuntimeError, naming the installed version, unless
    megatron-core is 0.16.x or 0.19.x, and when a listed call site is missing from the installed megatron.
    """
    global _applied
    if _applied:
        return
    _check_megatron_version()
    # Resolve every call site before patching any, so a moved one leaves megatron untouched.
    modules = [importlib.import_module(name) for name in _TORCH_VIEW_MODULES]
    for module in modules:
        if getattr(module, "torch", None) is not torch:
            raise RuntimeError(f"cpu_compat: {module.__name__} does not use `torch` as expected")
    rng_sites = {_resolve(*site): new for site, (new, _) in _CPU_RNG_STATE_FUNCTIONS.items()}
    cuda_method_sites = [_resolve(*site) for site in _CPU_AS_CUDA_FUNCTIONS]

    torch_on_cpu = _TorchOnCpu()
    for module in modules:
        module.torch = torch_on_cpu
    for (owner, attribute), replacement in rng_sites.items():
        setattr(owner, attribute, replacement)
    for owner, attribute in cuda_method_sites:
        _wrap_as_cuda(owner, attribute)
    _applied = True
