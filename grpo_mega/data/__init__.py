"""Data: prompt datasets from jsonl/parquet, the synthetic arithmetic task, and its tokenizer.

It may import the standard library, torch, transformers' tokenizers and the file readers (pyarrow), nothing of
grpo_mega; ``batch`` lays token sequences out as the engine's rows. Rewards, the PRM, the stages and the trainers
import it.
"""
