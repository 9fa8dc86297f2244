"""Parameter counts of one rank's share of a model, from megatron-core's own GPTModel built on the meta device.

How: a *fake* process group (torch's ``fake`` backend: collectives do nothing) of TP x PP ranks gives megatron's
``parallel_state`` the real layout, and ``grpo_mega.model.build_gpt_model`` builds the pipeline stage of the rank
at TP rank 0 of every stage on the meta device (no memory, no initialisation): the same modules, shapes, dtypes,
vocabulary padding and tied-embedding copies as the engine builds. TP ranks of a stage hold equal shards, and DP
ranks replicas, so one build per stage covers every rank. Megatron's local layer spec is used (the planner runs
without a GPU); Transformer Engine's layers have the same parameters, except that their norm weights take the
model's dtype where the local spec's stay fp32 (a few hundred KiB).

The build runs in this process when it has no process group and no GPU (the ``grpo-mega plan`` command, the
tests), else in a fresh subprocess (``python -m grpo_mega.plan.counts``), so a caller's own process group or GPU
is never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a stage, in ``named_parameters`` order."""

    name: str
    numel: int
    dtype: str
    """``float32`` or ``bfloat16``."""
    shared_embedding: bool = False
    """megatron's flag for the last stage's copy of tied embeddings (a bucket of its own with the distributed
    optimizer)."""
    trainable: bool = True
    """Requires a gradient: in DDP's buffers and the optimizer. False for the frozen base of a LoRA policy."""

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def param_infos(model: torch.nn.Module) -> list[ParamInfo]:
    """The planner's view of ``model``'s parameters, in ``named_parameters`` order."""
    return [ParamInfo(name, p.numel(), str(p.dtype).removeprefix("torch."), bool(getattr(p, "shared_embedding", False)),
                      p.requires_grad)
            for name, p in model.named_parameters()]


@dataclass(frozen=True)
class ModelRequest:
    """A model to count: an HF config (config.json contents) at a TP / PP layout and dtype, with its head."""

    hf_config: dict
    tp: int
    pp: int
    dtype: str = "bfloat16"
    lm_output: bool = True
    """False: no LM output layer (a classifier PRM)."""
    head: str = "none"
    """Parameters of the head on the last stage: ``none`` (LM head, likelihood / label-token PRM) or
    ``classifier`` (Qwen2.5-Math-PRM's score head, ``prm.heads.ClassifierHead``)."""
    lora: dict | None = None
    """``model.lora``'s fields (rank, alpha, dropout, target_modules) of a policy trained with LoRA: the stage is
    counted with its adapters, the base frozen (``grpo_mega.lora``); None: every weight trained."""

    @property
    def ep(self) -> int:
        """Expert-parallel size the stage is built at: a mixture-of-experts model's experts over its TP ranks (vLLM
        shards them over its TP ranks too), a dense model has none. A policy at ``parallel.expert`` > ``tensor`` holds
        fewer experts a rank with the same optimizer state per rank (its experts' state is sharded over fewer
        data-parallel ranks), so planning it at EP = TP is an upper bound."""
        from grpo_mega.config.checks import num_experts

        return self.tp if num_experts(self.hf_config) else 1


class _MetaStaysMeta(TorchFunctionMode):
    """``Tensor.cuda()`` of a meta tensor returns it: megatron moves the last stage's copy of tied embeddings to the
    GPU for their first all-reduce (``LanguageModule.setup_embeddings_and_output_layer``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda and args and args[0].device.type == "meta":
            return args[0]
        return func(*args, **(kwargs or {}))


def _build_stage_params(request: ModelRequest, pp_rank: int) -> list[ParamInfo]:
    """Build (meta device) the stage of TP rank 0 / pipeline rank ``pp_rank`` under a fake process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from grpo_mega.model import build_gpt_model, gpt_config_from_hf
    from grpo_mega.parallel.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # only ever in a process without CUDA (count_stage_params): megatron's PP set-up names CUDA
    dtype = getattr(torch, request.dtype)
    # megatron's default rank order puts TP innermost and PP outermost: rank = pp_rank * tp (DP = 1 here).
    dist.init_process_group("fake", store=FakeStore(), rank=pp_rank * request.tp, world_size=request.tp * request.pp)
    try:
        parallel_state.initialize_model_parallel(request.tp, request.pp, create_gloo_process_groups=False,
                                                 expert_model_parallel_size=request.ep, expert_tensor_parallel_size=1)
        gpt_config = gpt_config_from_hf(
            request.hf_config, tp=request.tp, pp=request.pp, dtype=dtype, ep=request.ep,
            overrides={"perform_initialization": False, "use_cpu_initialization": True})
        with torch.device("meta"), _MetaStaysMeta():
            model = build_gpt_model(gpt_config, lm_output=request.lm_output)
            if request.head == "classifier" and model.post_process:
                from prm.heads import ClassifierHead

                model.head = ClassifierHead(int(request.hf_config["hidden_size"]))
            if request.lora:
                from grpo_mega.config.lora import LoRAConfig
                from grpo_mega.lora import attach_lora

                attach_lora(model, LoRAConfig(**request.lora), seed=0)
        return param_infos(model)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def count_in_process(requests: list[ModelRequest]) -> list[list[list[ParamInfo]]]:
    """For each request, the parameters of each pipeline stage (index = pipeline rank), built here."""
    return [[_build_stage_params(request, pp_rank) for pp_rank in range(request.pp)] for request in requests]


def _can_build_here() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() and not torch.cuda.is_available()


def count_stage_params(requests: list[ModelRequest]) -> list[list[list[ParamInfo]]]:
    """:func:`count_in_process`, in this process when it can (no process group, no GPU), else in a subprocess."""
    if _can_build_here():
        return count_in_process(requests)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "grpo_mega.plan.counts"], capture_output=True, text=True, env=env,
                          input=json.dumps([asdict(r) for r in requests]), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"counting parameters in a subprocess failed:\n{done.stderr[-3000:]}")
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return [[[ParamInfo(**p) for p in stage] for stage in model] for model in raw]


def _main() -> None:
    requests = [ModelRequest(**r) for r in json.loads(sys.stdin.read())]
    result: Any = [[[asdict(p) for p in stage] for stage in model] for model in count_in_process(requests)]
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
