"""The names of the linear layers LoRA adapts, without torch: megatron's (Megatron-Bridge's) and Hugging Face's
(peft's, verl's). The config's checks (``model.lora.target_modules``) read them before torch is imported; the
DeepSpeed engine's peft adapters (``grpo_mega.engine.deepspeed_lora``) target the Hugging Face names."""

from __future__ import annotations

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linear layers of a transformer layer that take an adapter, by megatron's (and Megatron-Bridge's) names:
the fused query/key/value projection, the attention output projection, the MLP's first (gate and up, fused) and
second (down) layers. Hugging Face's q/k/v_proj, o_proj, gate/up_proj, down_proj."""

HF_TARGET_NAMES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                   "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
"""Hugging Face's (peft's, verl's) target names -> megatron's: the message that refuses them, and the DeepSpeed
engine's peft targets."""
