"""What every Megatron engine shares: this rank's pipeline stage, micro-batching over data-parallel ranks, the
forward schedule, HF export and weight loading; and the forward-only engine built on it.

:class:`MegatronForwardEngine` serves models that never train in the job (the KL reference, a PRM at scoring
time): parameters without gradients, no DDP gradient buffers, no optimizer, eval mode; the same TP / PP / DP
sharding, micro-batching and forward results as the training engine (:class:`~grpo_mega.engine.MegatronEngine`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from grpo_mega.engine.batching import PADDING_ROW, aligned_rank_micro_batches, is_padding, rank_micro_batches
from grpo_mega.engine.routing_replay import RouterReplayer
from grpo_mega.engine.shared_prefix import is_packed, rank_shared_prefix_micro_batches
from grpo_mega.model.attention import PackedRows
from grpo_mega.model.heads import READ_POSITIONS
from grpo_mega.parallel import get_device

logger = logging.getLogger(__name__)

StageModelProvider = Callable[[bool, bool], torch.nn.Module]
"""``provider(pre_process, post_process)`` builds this rank's pipeline stage: a GPT backbone stage whose
``forward(input_ids, position_ids, attention_mask)`` returns hidden states [S, B, H]. On the last stage it carries
its head as the submodule ``head``, called as ``head(backbone, hidden, micro_batch) -> {name: [B, S]}``: a
submodule of the backbone, so head parameters (if any) are trained, reduced and checkpointed with the rest, and
megatron's schedules and gradient finalisation see a stock GPTModel."""


def layer_tokens(micro: dict[str, torch.Tensor]) -> int:
    """Token slots a micro-batch puts through the layers: its packed tokens, or rows x padded length."""
    if is_packed(micro):
        return len(micro["packed_source"])
    return micro["input_ids"].numel()


def row_buffers(names, batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Zeroed fp32 [B, L] buffers, one per head output in ``names``, for :func:`keep_rows`."""
    rows, length = batch["input_ids"].shape
    return {name: torch.zeros(rows, length, dtype=torch.float32, device=device) for name in names}


def keep_rows(buffers: dict[str, torch.Tensor], head_out: dict[str, torch.Tensor], micro: dict[str, torch.Tensor]):
    """Copy a micro-batch's head outputs (detached, fp32) into the batch's rows of ``buffers`` (``row_index``; the
    padding rows of aligned micro-batches are left out)."""
    real = micro["row_index"] != PADDING_ROW
    for name, buffer in buffers.items():
        value = head_out[name].detach().float()
        buffer[micro["row_index"][real], : value.shape[1]] = value[real]


def assembled_rows(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole batch's outputs on every rank, on the CPU (collective). Each row was computed on one DP rank's last
    pipeline stage and is zero elsewhere, so sums over the DP group, then the pipeline group, assemble the batch."""
    for value in buffers.values():
        dist.all_reduce(value, group=mpu.get_data_parallel_group())
        dist.all_reduce(value, group=mpu.get_pipeline_model_parallel_group())
    return {name: value.cpu() for name, value in buffers.items()}


def align_to_tokens(next_token_values: torch.Tensor) -> torch.Tensor:
    """Shift [B, S] values about the *next* token (position t predicts t + 1) right by one, so out[:, t] is
    about token t (the engine's convention); out[:, 0] = 0 (the first token has no prediction)."""
    return torch.nn.functional.pad(next_token_values[:, :-1], (1, 0), value=0.0)


class MegatronStageEngine:
    """The part of a Megatron engine that does not train; subclasses set ``self.model`` (the stage, or the
    stage wrapped in DDP) after ``_build_stage``."""

    model: torch.nn.Module
    lora = None
    """``grpo_mega.lora.StageAdapters`` of a policy trained with LoRA (``model.lora``), else None."""

    def _build_stage(
        self,
        stage_model_provider: StageModelProvider,
        *,
        max_tokens_per_micro_batch: int,
        output_names: tuple[str, ...],
        next_token_head: bool,
        hf_config,
        share_prompt_prefix: bool = False,
    ) -> torch.nn.Module:
        self.device = get_device()
        self.pre_process = mpu.is_pipeline_first_stage()
        self.post_process = mpu.is_pipeline_last_stage()
        self.output_names = tuple(output_names)
        self.next_token_head = next_token_head
        self.hf_config = hf_config
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.last_padding_fraction = 0.0
        module = stage_model_provider(self.pre_process, self.post_process).to(self.device)
        # Rows that share a prompt go through the layers with one copy of it (grpo_mega.engine.shared_prefix);
        # needs megatron's local layers (grpo_mega.model.attention), not Transformer Engine's.
        self.share_prompt_prefix = share_prompt_prefix and module.supports_packed_rows()
        if share_prompt_prefix and not self.share_prompt_prefix:
            logger.info("share_prompt_prefix: off (these layers attend row by row: Transformer Engine, dropout, ...)")
        # experts spread over data-parallel replicas: those replicas run micro-batches of one shape in lockstep
        # (grpo_mega.engine.batching.aligned_rank_micro_batches), row by row (packed sequences differ in length)
        self.aligned_micro_batches = bool(module.config.num_moe_experts) and (
            mpu.get_expert_model_parallel_world_size() > mpu.get_tensor_model_parallel_world_size())
        if self.aligned_micro_batches and self.share_prompt_prefix:
            self.share_prompt_prefix = False
            logger.info("share_prompt_prefix: off (experts spread over data-parallel ranks: aligned row micro-batches)")
        self.config = module.config
        # rollout.routing_replay: the rollout's experts replayed in every forward (grpo_mega.engine.routing_replay)
        replay = module.config.moe_enable_routing_replay
        self.router_replayer = RouterReplayer(module, module.config) if replay else None
        # Rows of a micro-batch vary in length: pipeline stages exchange tensor shapes before tensors.
        self.config.variable_seq_lengths = True
        return module

    # ----------------------------------------------------------------- micro-batches of this rank
    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        split = aligned_rank_micro_batches if self.aligned_micro_batches else rank_micro_batches
        if self.share_prompt_prefix and "prompt_lengths" in batch:
            split = rank_shared_prefix_micro_batches
        micro_batches, self.last_padding_fraction = split(
            batch, self.max_tokens_per_micro_batch, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        )
        return [{k: v.to(self.device) for k, v in micro.items()} for micro in micro_batches]

    def _run_schedule(self, micro_batches, loss_func_for, forward_only: bool) -> list[dict]:
        """Run megatron's schedule (1F1B with PP) and return the loss-function records of the last stage."""
        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            with self._replayed_routes(micro):
                if is_packed(micro):
                    # one sequence [1, T] in which rows share their prompt; the last stage returns the rows
                    tokens = micro["input_ids"].reshape(-1).index_select(0, micro["packed_source"])[None]
                    rows = PackedRows(micro["packed_row_gather"], micro["packed_source"], micro["packed_positions"])
                    hidden = model(tokens, micro["packed_positions"][None], attention_mask=None, packed_rows=rows)
                    return hidden, loss_func_for(micro)
                tokens = micro["input_ids"]
                positions = torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
                # Rows are right-padded: the causal mask alone keeps padding out of every real token's attention.
                hidden = model(tokens, positions, attention_mask=None)
                return hidden, loss_func_for(micro)

        if self.router_replayer is not None:
            self.router_replayer.check(micro_batches)

        def shape(micro):  # (sequence, batch) of what flows between pipeline stages
            if is_packed(micro):
                return len(micro["packed_source"]), 1
            return micro["input_ids"].shape[1], micro["input_ids"].shape[0]

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(shape(m)[0] for m in micro_batches),
            micro_batch_size=max(shape(m)[1] for m in micro_batches),
            forward_only=forward_only,
        )

    def _replayed_routes(self, micro: dict[str, torch.Tensor]):
        """The context of one micro-batch's forward: with routing replay its routers take the rollout's experts."""
        if self.router_replayer is None:
            return contextlib.nullcontext()
        length = len(micro["packed_source"]) if is_packed(micro) else micro["input_ids"].shape[1]
        return self.router_replayer.replaying(micro, self.stage.sequence_padding(length))

    def _head(self, hidden: torch.Tensor, micro: dict[str, torch.Tensor],
              loss_tokens_only: bool = False) -> dict[str, torch.Tensor]:
        stage = self.stage
        if loss_tokens_only and self.next_token_head and "loss_mask" in micro:
            # the head's output matrix only where a loss_mask token is predicted (position t - 1 predicts token t):
            # the prompt's and the padding's logits are never read by a loss or by the log-probs GRPO keeps
            read = torch.nn.functional.pad(micro["loss_mask"][:, 1:] > 0, (0, 1), value=False)
            micro = {**micro, READ_POSITIONS: read}
        outputs = stage.head(stage, hidden, micro)
        if self.next_token_head:
            outputs = {name: align_to_tokens(value) for name, value in outputs.items()}
        return outputs

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, batch: dict[str, torch.Tensor], loss_tokens_only: bool = False) -> dict[str, torch.Tensor]:
        """Head outputs {name: [B, L]} of the whole batch, the same on every rank (no gradient). With
        ``loss_tokens_only`` a next-token head's outputs are computed at ``loss_mask``'s tokens only (0 elsewhere)."""
        self.model.eval()
        micro_batches = self._micro_batches(batch)
        outputs = row_buffers(self.output_names, batch, self.device)

        def loss_func_for(micro):
            def collect(hidden):
                if not is_padding(micro):
                    keep_rows(outputs, self._head(hidden, micro, loss_tokens_only), micro)
                return torch.zeros((), device=self.device), {}

            return collect

        self._run_schedule(micro_batches, loss_func_for, forward_only=True)
        return assembled_rows(outputs)

    def forward_logprobs(self, batch: dict[str, torch.Tensor],
                         loss_tokens_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [B, L] of ``input_ids`` (needs a head with those outputs); with
        ``loss_tokens_only`` at ``loss_mask``'s tokens only (0 elsewhere)."""
        outputs = self.forward(batch, loss_tokens_only)
        return outputs["logprobs"], outputs["entropy"]

    def export_hf_weights(self):
        """(HF name, full tensor) one at a time, gathered over TP / PP; collective (every rank iterates)."""
        from grpo_mega.checkpoint.hf_convert import export_hf_weights

        # LoRA: the base weights with the adapters merged in, W + (alpha / rank) B A, one tensor at a time
        return export_hf_weights(self.stage, self.hf_config,
                                 shard_transform=self.lora.merged if self.lora is not None else None)

    # ----------------------------------------------------------------- weights (sharded, any layout)
    @property
    def stage(self) -> torch.nn.Module:
        """This rank's pipeline stage (the backbone with its head), unwrapped from DDP. For tools and tests:
        trainers and checkpoint code go through the methods below."""
        model = self.model
        return model.module if isinstance(model, DistributedDataParallel) else model

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of the model parameters."""
        return next(self.stage.parameters()).dtype

    def model_sharded_state_dict(self) -> dict:
        """The trained model's megatron ShardedStateDict (global shapes: loadable at any TP / PP): the whole model,
        or with LoRA the adapters alone (what a LoRA run's checkpoints hold)."""
        if self.lora is not None:
            return self.lora.sharded_state_dict()
        return self.stage.sharded_state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        """Copy a loaded ``model_sharded_state_dict()`` into the model (see ``reload_after_weight_load``)."""
        if self.lora is not None:
            self.lora.load_state_dict(state)
            return
        self.stage.load_state_dict(state)

    @contextlib.contextmanager
    def _whole_model(self):
        """Inside: the model's state is the whole model's, also with LoRA (a source's weights are the base's)."""
        lora, self.lora = self.lora, None
        try:
            yield
        finally:
            self.lora = lora

    def load_hf_weights(self, hf_weights) -> None:
        """Copy HF-named full tensors (a mapping, e.g. ``HFWeights(folder)``) into this rank's shards; collective."""
        from grpo_mega.checkpoint.hf_convert import load_hf_weights

        load_hf_weights(self.stage, hf_weights, self.hf_config)
        self.reload_after_weight_load()

    def load_mcore_model(self, directory: str) -> None:
        """Load the backbone of a ``save_mcore_checkpoint`` folder at this job's TP / PP; collective."""
        from grpo_mega.checkpoint.mcore_checkpoint import load_mcore_checkpoint

        load_mcore_checkpoint(self.stage, directory)
        self.reload_after_weight_load()

    def load_model_source(self, source, *, backbone_only: bool = False) -> None:
        """Load the weights of ``source`` (a ``grpo_mega.checkpoint.source.ModelSource``: HF folder, converted
        folder, training checkpoint of either engine) at this job's TP / PP; collective.

        ``backbone_only``: the source's LM output layer is not read and this model's head keeps its values (a
        classifier PRM started from a causal LM); raises ValueError naming the folder when backbone tensors lack.
        With LoRA the source's weights are the frozen base's.
        """
        with self._whole_model():
            self._load_model_source(source, backbone_only=backbone_only)

    def _load_model_source(self, source, *, backbone_only: bool) -> None:
        from grpo_mega.engine.source_weights import holds_hf_weights, load_source_weights, source_hf_weights

        if not backbone_only:
            load_source_weights(self, source)
            return
        if holds_hf_weights(source):
            from grpo_mega.checkpoint.hf_convert import load_hf_weights

            load_hf_weights(self.stage, source_hf_weights(source), source.hf_config, skip_lm_output=True)
        elif source.kind == "mcore_model":
            from grpo_mega.checkpoint.mcore_checkpoint import load_mcore_checkpoint

            load_mcore_checkpoint(self.stage, source.folder)  # reads the tensors its table covers: no head
        else:
            from grpo_mega.checkpoint.weights_only import read_checkpoint_model

            wanted = {name: value for name, value in self.model_sharded_state_dict().items()
                      if not name.startswith("head.")}
            missing, unexpected = self.stage.load_state_dict(read_checkpoint_model(wanted, source.folder),
                                                             strict=False)
            missing = [name for name in missing if not name.startswith("head.")]
            if missing or unexpected:
                raise ValueError(f"{source.folder}: model tensors missing {missing[:8]}, unexpected {unexpected[:8]}")
        self.reload_after_weight_load()

    def reload_after_weight_load(self) -> None:
        """Nothing derives from the weights here; the training engine refreshes its fp32 master copies."""

    def save_model_weights(self, directory: str) -> None:
        """Write the model with megatron dist_checkpointing (collective); loadable at any TP / PP."""
        from pathlib import Path

        from megatron.core import dist_checkpointing

        Path(directory).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self.model_sharded_state_dict(), directory)

    def load_model_weights(self, directory: str) -> None:
        """Load weights written by :meth:`save_model_weights` at any TP / PP (collective)."""
        from megatron.core import dist_checkpointing

        self.load_model_state_dict(dist_checkpointing.load(self.model_sharded_state_dict(), directory))
        self.reload_after_weight_load()


class MegatronForwardEngine(MegatronStageEngine):
    """Forward-only Megatron engine (:class:`~grpo_mega.engine.base.ForwardEngine`): the KL reference, a PRM
    at scoring time. Parameters have ``requires_grad`` False and the model stays in eval mode; there are no
    DDP gradient buffers and no optimizer, so it holds the weights and nothing else.

    Args: as :class:`~grpo_mega.engine.MegatronEngine`, without the optimizer settings.
    """

    def __init__(
        self,
        stage_model_provider: StageModelProvider,
        *,
        max_tokens_per_micro_batch: int,
        output_names: tuple[str, ...],
        next_token_head: bool,
        hf_config=None,
        share_prompt_prefix: bool = False,
    ):
        module = self._build_stage(
            stage_model_provider,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            output_names=output_names,
            next_token_head=next_token_head,
            hf_config=hf_config,
            share_prompt_prefix=share_prompt_prefix,
        )
        module.requires_grad_(False)
        self.model = module.eval()
