"""Process groups, launcher environments, layout checks and the CPU compatibility layer.

The 2-process job (`training_job`) runs what the engine relies on, on gloo: init_distributed with
megatron's RNG tracker, then one training step through DistributedDataParallel,
get_megatron_optimizer with clipping by the global gradient norm and get_forward_backward_func
(1F1B) at PP=2 with tied embeddings, then at DP=2.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from dist_utils import build_model_for_layout, run_distributed, tiny_qwen2_config

import grpo_mega.parallel.cpu_compat as cpu_compat
from grpo_mega.parallel import (
    ParallelLayout,
    get_device,
    layout_for_world,
    read_launch_env,
    resolve_device,
    validate_layout,
)
from grpo_mega.parallel.launch_env import first_slurm_host

# ---------------------------------------------------------------------------------------------
# Layout checks


def test_valid_layout_gives_data_parallel_size():
    assert validate_layout(2, 2, 8, 4, 8, 2) == ParallelLayout(tp=2, pp=2, dp=2)
    assert layout_for_world(1, 1, 3).world_size == 3


@pytest.mark.parametrize(
    "tp, pp, world_size, layers, heads, groups, message",
    [
        (3, 1, 3, 4, 8, 8, "tensor_parallel=3 does not divide num_attention_heads=8"),
        (4, 1, 4, 4, 8, 2, "tensor_parallel=4 does not divide num_query_groups=2"),
        (1, 8, 8, 4, 8, 2, "pipeline_parallel=8 exceeds num_layers=4"),
        (1, 3, 3, 4, 8, 2, "pipeline_parallel=3 does not divide num_layers=4"),
        (2, 1, 3, 4, 8, 2, r"world_size 3 is not a multiple of tp\*pp=2"),
        (2, 2, 6, 4, 8, 2, r"world_size 6 is not a multiple of tp\*pp=4"),
        (0, 1, 2, 4, 8, 2, "tensor_parallel must be a positive integer"),
    ],
)
def test_invalid_layouts_name_the_setting(tp, pp, world_size, layers, heads, groups, message):
    with pytest.raises(ValueError, match=message):
        validate_layout(tp, pp, world_size, layers, heads, groups)


# ---------------------------------------------------------------------------------------------
# Launcher environments


def test_torchrun_environment():
    env = read_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "node7",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("node7", 29500, "torchrun")


def test_slurm_environment_derives_address_and_port_from_the_job():
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu-[003-004,010]",
        "SLURM_JOB_ID": "123456",
    }
    env = read_launch_env(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "slurm")
    assert env.master_addr == "gpu-003" and env.master_port == 15000 + 123456 % 15000
    given = read_launch_env({**slurm, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"})
    assert (given.master_addr, given.master_port) == ("10.0.0.1", 6000)


def test_no_launcher_means_one_local_process():
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "single")
    assert env.master_addr == "127.0.0.1" and 0 < env.master_port < 65536


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK='x'"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
            "rank 2 is outside world_size 2",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR or MASTER_PORT is not"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "1"},
            "SLURM_JOB_NODELIST",
        ),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_JOB_NODELIST": "n1",
            },
            "MASTER_PORT",
        ),
    ],
)
def test_bad_launcher_environments_name_the_variable(environ, message):
    with pytest.raises(ValueError, match=message):
        read_launch_env(environ)


def test_cuda_device_max_connections_is_set_for_tensor_parallelism_unless_the_user_set_it():
    from grpo_mega.run.library_warnings import KNOWN_HARMLESS_WARNINGS
    from grpo_mega.parallel.launch_env import megatron_cuda_environment

    assert megatron_cuda_environment(2, {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert megatron_cuda_environment(8, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {}  # kept; megatron then warns
    assert megatron_cuda_environment(1, {}) == {}  # no TP collectives to overlap
    assert not any("CUDA_DEVICE_MAX_CONNECTIONS" in message for message in KNOWN_HARMLESS_WARNINGS)


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node7", "node7"),
        ("a1,b2", "a1"),
        ("gpu-[003-010,012]", "gpu-003"),
        ("n[1,3]-ib,m2", "n1-ib"),
        ("x[7]", "x7"),
    ],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_device_is_the_cpu_without_cuda():
    assert get_device() == torch.device("cpu")
    assert get_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    "choice, cuda_available, device_count, local_rank, expected",
    [
        ("auto", False, 0, 3, "cpu"),
        ("auto", True, 4, 3, "cuda:3"),  # torchrun: every process sees every GPU of the node
        ("auto", True, 1, 3, "cuda:0"),  # srun --gpus-per-task=1: one visible GPU, whatever the local rank
        ("cpu", True, 8, 2, "cpu"),  # pinned to the CPU on a GPU node
        ("cuda", True, 2, 1, "cuda:1"),
        ("cuda", True, 1, 5, "cuda:0"),
    ],
)
def test_resolve_device(choice, cuda_available, device_count, local_rank, expected):
    device = resolve_device(
        choice, cuda_available=cuda_available, device_count=device_count, local_rank=local_rank
    )
    assert device == torch.device(expected)


@pytest.mark.parametrize(
    "choice, cuda_available, device_count, local_rank, message",
    [
        ("cuda", False, 0, 0, r"parallel.device='cuda' but this process sees no CUDA device"),
        ("auto", True, 2, 2, r"local rank 2 has no GPU: this process sees 2 CUDA devices"),
        ("cuda", True, 4, 7, r"local rank 7 has no GPU: this process sees 4 CUDA devices"),
        ("gpu", True, 1, 0, r"parallel.device must be one of auto, cpu, cuda, got 'gpu'"),
    ],
)
def test_resolve_device_errors_name_the_setting(choice, cuda_available, device_count, local_rank, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(
            choice, cuda_available=cuda_available, device_count=device_count, local_rank=local_rank
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_init_distributed_refuses_cuda_without_a_gpu():
    import torch.distributed as dist

    from grpo_mega.parallel import init_distributed

    with pytest.raises(ValueError, match="parallel.device='cuda'"):
        init_distributed(1, 1, seed=0, device="cuda")
    assert not dist.is_initialized()  # refused before creating any process group


# ---------------------------------------------------------------------------------------------
# CPU compatibility layer (tables checked in-process; patches applied only in spawned workers)


def test_cpu_compat_refuses_other_megatron_versions(monkeypatch):
    import megatron.core

    monkeypatch.setattr(cpu_compat, "_applied", False)
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match="megatron-core 0.17.0 is installed"):
        cpu_compat.apply_cpu_compat()


@pytest.mark.parametrize("checked", ["0.16.1", "0.19.2"])
def test_cpu_compat_accepts_the_checked_megatron_minors(monkeypatch, checked):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", checked)
    cpu_compat._check_megatron_version()  # the minors whose call sites were run on gloo (module docstring)


def test_cpu_view_of_the_current_stream_waits_without_cuda():
    # megatron-core 0.19's start_grad_sync calls torch.cuda.current_stream().wait_event(...) on every step;
    # the CPU view must answer with a stream whose waits run on a machine without a GPU (the CPU build of torch
    # raises "Torch not compiled with CUDA enabled" for the real torch.cuda.current_stream()).
    stream = cpu_compat._TorchOnCpu().cuda.current_stream()
    stream.wait_event(torch.cpu.Event())
    stream.wait_stream(torch.cpu.current_stream())
    assert stream is torch.cpu.current_stream()


def test_every_listed_call_site_still_names_cuda():
    # A table entry whose module no longer mentions CUDA is stale: the layer must only patch need.
    for module_name in cpu_compat._TORCH_VIEW_MODULES:
        assert "cuda" in inspect.getsource(importlib.import_module(module_name)), module_name
    for module_name, dotted in [
        *cpu_compat._CPU_RNG_STATE_FUNCTIONS,
        *cpu_compat._CPU_AS_CUDA_FUNCTIONS,
    ]:
        owner, name = cpu_compat._resolve(module_name, dotted)
        source = inspect.getsource(getattr(owner, name))
        assert "cuda" in source or "_lazy_call" in source, f"{module_name}.{dotted}"


# ---------------------------------------------------------------------------------------------
# The 2-process job


def _forward_step(data_iterator, model):
    ids = next(data_iterator)
    hidden = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    return hidden, lambda output: (output.float().pow(2).mean(), {})


CLIP_GRAD = 0.01


def _train_step(model) -> tuple[float, float]:
    """One megatron training step (DDP, 4 micro-batches, SGD with lr 1, clipping).

    Returns (grad norm before clipping, global norm of the parameter update). With lr 1 and no
    momentum or weight decay the update is minus the clipped gradient, so its global norm must be
    min(grad norm, CLIP_GRAD). Parameters marked `shared` (the last stage's copy of tied
    embeddings) are counted once, on the first stage, as megatron's grad norm does.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=CLIP_GRAD
        ),
        [ddp],
    )
    generator = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
    micro_batches = [torch.randint(0, 301, (2, 8), generator=generator) for _ in range(4)]
    before = [p.detach().clone() for p in model.parameters()]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(micro_batches),
        model=[ddp],
        num_microbatches=4,
        seq_length=8,
        micro_batch_size=2,
        forward_only=False,
    )
    finalize_model_grads([ddp])
    succeeded, grad_norm, _ = optimizer.step()
    assert succeeded
    squared = sum(
        (p.detach() - old).pow(2).sum()
        for p, old in zip(model.parameters(), before, strict=True)
        if not getattr(p, "shared", False)
    )
    # Sum over pipeline stages only: data-parallel replicas hold the same update.
    torch.distributed.all_reduce(squared, group=parallel_state.get_pipeline_model_parallel_group())
    return grad_norm, squared.sqrt().item()


def _gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, tensor.contiguous())
    return out


def _training_job() -> dict:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from grpo_mega.parallel import (
        apply_cpu_compat,
        destroy_model_parallel,
        init_distributed,
        init_model_parallel,
    )

    import os

    result = {"layout": init_distributed(2, 1, seed=5, device="cpu"), "device": str(get_device())}
    result["cuda_device_max_connections"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    result["backend"] = torch.distributed.get_backend()
    # Megatron's tracker: the model-parallel stream differs across TP ranks, the default does not.
    with tensor_parallel.get_cuda_rng_tracker().fork():
        result["tp_region_draw"] = torch.rand(3)
    result["default_draw"] = torch.rand(3)
    wrapped = LanguageModule.setup_embeddings_and_output_layer
    apply_cpu_compat()  # idempotent: a second call must not wrap twice
    result["compat_idempotent"] = LanguageModule.setup_embeddings_and_output_layer is wrapped
    try:
        init_distributed(2, 1, seed=5, device="cpu")
    except ValueError as error:
        result["second_init_error"] = str(error)

    destroy_model_parallel()
    init_model_parallel(1, 2, seed=5)  # PP=2, tied embeddings across the two stages
    model = build_model_for_layout(tiny_qwen2_config(tied=True))
    lm_weight_before = model.shared_embedding_or_output_weight().detach().clone()
    result["pp_grad_norm"], result["pp_update_norm"] = _train_step(model)
    lm_weight = model.shared_embedding_or_output_weight().detach()
    result["pp_lm_weight_moved"] = (lm_weight - lm_weight_before).abs().max().item()
    # Stage 0's embedding and stage 1's output-layer copy must stay identical after the update.
    first, last = _gather(lm_weight)
    result["pp_tied_copies_diff"] = (first - last).abs().max().item()
    result["pp_stage"] = parallel_state.get_pipeline_model_parallel_rank()

    destroy_model_parallel()
    init_model_parallel(1, 1, seed=5)  # DP=2: different data per rank, one shared update
    model = build_model_for_layout(tiny_qwen2_config(tied=False))
    result["dp_grad_norm"], result["dp_update_norm"] = _train_step(model)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    replica0, replica1 = _gather(params)
    result["dp_replicas_diff"] = (replica0 - replica1).abs().max().item()
    return result


@pytest.fixture(scope="module")
def training_job():
    return run_distributed(_training_job, 2)


def test_init_distributed_on_cpu(training_job):
    for rank_result in training_job:
        assert rank_result["layout"] == ParallelLayout(tp=2, pp=1, dp=1)
        assert rank_result["device"] == "cpu" and rank_result["backend"] == "gloo"
        assert rank_result["compat_idempotent"]
        assert "already called" in rank_result["second_init_error"]
        # TP=2: megatron's layers overlap their backward collectives only with one CUDA connection
        assert rank_result["cuda_device_max_connections"] == "1"
    rank0, rank1 = training_job
    assert torch.equal(rank0["default_draw"], rank1["default_draw"])
    assert not torch.equal(rank0["tp_region_draw"], rank1["tp_region_draw"])


def test_pipeline_training_step_keeps_tied_embeddings_in_sync(training_job):
    assert sorted(r["pp_stage"] for r in training_job) == [0, 1]
    for rank_result in training_job:
        # Clipping by the global norm over both stages: the update has exactly the clip norm.
        assert CLIP_GRAD < rank_result["pp_grad_norm"] < float("inf")
        assert rank_result["pp_update_norm"] == pytest.approx(CLIP_GRAD, rel=1e-4)
        assert rank_result["pp_lm_weight_moved"] > 0  # the tied weight was updated ...
        assert rank_result["pp_tied_copies_diff"] == 0.0  # ... identically on both stages
    assert training_job[0]["pp_grad_norm"] == training_job[1]["pp_grad_norm"]


def test_data_parallel_training_step_keeps_replicas_identical(training_job):
    for rank_result in training_job:
        assert CLIP_GRAD < rank_result["dp_grad_norm"] < float("inf")
        assert rank_result["dp_update_norm"] == pytest.approx(CLIP_GRAD, rel=1e-4)
        assert rank_result["dp_replicas_diff"] == 0.0
