"""The policy model: mcore GPTModel from an HF config, pluggable heads, vocab-parallel log-probs.

It may import ``parallel`` (process groups) and megatron-core; checkpoints, engines, the PRM and the planner import
it.
"""

from grpo_mega.model.config_map import GPTConfig, gpt_config_from_hf, load_model_hf_config, padded_vocab_size
from grpo_mega.model.gpt import HiddenStatesGPTModel, build_gpt_model, transformer_layer_spec
from grpo_mega.model.heads import LMHead, TokenHead, next_token_labels
from grpo_mega.model.logprobs import vocab_parallel_logprobs_and_entropy

__all__ = [
    "GPTConfig",
    "HiddenStatesGPTModel",
    "LMHead",
    "TokenHead",
    "build_gpt_model",
    "gpt_config_from_hf",
    "load_model_hf_config",
    "next_token_labels",
    "padded_vocab_size",
    "transformer_layer_spec",
    "vocab_parallel_logprobs_and_entropy",
]
