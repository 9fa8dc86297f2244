"""Data: prompt datasets from jsonl/parquet, the synthetic arithmetic task, and its tokenizer."""
