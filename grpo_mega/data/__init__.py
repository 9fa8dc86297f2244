"""Data: prompt datasets (``sources``: jsonl / parquet files, folders of shards, save_to_disk folders; ``formats``:
plain, chat, verl and TRL layouts detected per file; ``fields``: dotted field paths; ``prompt_rows``: row checks;
``prompts``: records and batches), the synthetic arithmetic task, and its tokenizer.

It may import the standard library, torch, transformers' tokenizers and the file readers (pyarrow), nothing of
grpo_mega; ``batch`` lays token sequences out as the engine's rows. Rewards, the PRM, the stages and the trainers
import it.
"""
