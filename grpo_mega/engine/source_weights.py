"""Loading a model source's weights (``grpo_mega.checkpoint.source.ModelSource``) into an engine, by its kind.

Every engine's ``load_model_source`` comes here, so each kind of folder is read one way whichever engine takes it,
each through the engine's own loaders (``grpo_mega.engine.base.ForwardEngine``):

- an HF folder: its safetensors / .bin tensors, ``load_hf_weights``;
- a converted megatron folder: ``load_mcore_model``;
- a training checkpoint of the DeepSpeed engine: its ZeRO partitions merged to HF-named fp32 tensors
  (``engine.deepspeed_checkpoint``), ``load_hf_weights``;
- a training checkpoint of the Megatron engine: the model keys of ``model_sharded_state_dict`` read with
  dist_checkpointing at this job's layout, ``load_model_state_dict``, then ``reload_after_weight_load``; a LoRA
  run's checkpoint (adapters only): its base, then the adapters merged in (``grpo_mega.lora.checkpoint``).
"""

from __future__ import annotations


def source_hf_weights(source):
    """The HF-named tensors of an HF folder or of a DeepSpeed-engine checkpoint (a lazy mapping for a folder)."""
    if source.kind == "hf":
        from grpo_mega.checkpoint.hf_io import HFWeights

        return HFWeights(source.folder)
    from grpo_mega.engine.deepspeed_checkpoint import deepspeed_checkpoint_weights

    return deepspeed_checkpoint_weights(source.folder)


def holds_hf_weights(source) -> bool:
    """Whether the source's weights are HF-named tensors (an HF folder, a DeepSpeed-engine checkpoint)."""
    return source.kind == "hf" or source.saved_by == "deepspeed"


def load_source_weights(engine, source) -> None:
    """Load the whole model of ``source`` into ``engine`` (or anything with its weight loaders); collective."""
    if holds_hf_weights(source):
        engine.load_hf_weights(source_hf_weights(source))
    elif source.kind == "mcore_model":
        engine.load_mcore_model(str(source.folder))
    else:
        from grpo_mega.checkpoint.weights_only import read_checkpoint_model
        from grpo_mega.lora.checkpoint import load_merged_lora_checkpoint, lora_settings

        lora = lora_settings(source.folder)
        if lora is not None:  # a LoRA run's checkpoint: its base with the adapters merged in (Megatron engines)
            if not hasattr(engine, "stage"):
                raise ValueError(f"{source.folder} holds LoRA adapters only: load it with engine=megatron, or "
                                 "export merged weights first (tools/convert_mcore_to_hf.py)")
            load_merged_lora_checkpoint(engine.stage, source.folder, lora)
        else:
            engine.load_model_state_dict(read_checkpoint_model(engine.model_sharded_state_dict(), source.folder))
        engine.reload_after_weight_load()  # fp32 master copies (bf16) follow the loaded weights
