"""grpo-mega: GRPO for large language models on megatron-core (TP / PP / DP).

Outcome-supervised GRPO and process-supervised GRPO (PRM step rewards, suffix-sum advantages).
The pure math lives in :mod:`grpo_mega.algo`.
"""

__version__ = "0.1.0"
