"""The tiny synthetic GRPO task the end-to-end tests train on (quickstart data and model, random weights), and
the overrides that make a run of it take a second or two per step on 2 gloo processes."""

from __future__ import annotations

from pathlib import Path

from grpo_mega.data.synthetic import Difficulty
from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model

SMALL_RUN = ["algorithm.rollout_batch_size=4", "algorithm.num_return_sequences_in_group=2",
             "algorithm.response_length=12", "algorithm.dynamic_sampling=false", "trainer.progress_bar=false",
             "trainer.tensorboard=false", "parallel.device=cpu",
             # TP=2 on the tests' 2 processes (the quickstart's GRPO config runs DP=2): the trainer-level tests keep
             # exercising tensor-parallel checkpoints, resumes and signals
             "parallel.tensor=2"]


def build_tiny_task(root: Path) -> tuple[Path, Path]:
    """(model folder, train file) of a 200-problem synthetic task (two operations, short prompts) under ``root``."""
    plan = QuickstartPlan(num_train=200, num_heldout=8, difficulty=Difficulty(min_steps=2, max_steps=2, max_value=30))
    model_dir, train_file, _ = build_data_and_model(root, plan)
    return model_dir, train_file


def tiny_run_overrides(task: tuple[Path, Path], run_dir: Path, *extra: str) -> list[str]:
    """``key=value`` overrides of configs/quickstart_grpo.yaml for a small run of ``task`` in ``run_dir``."""
    model_dir, train_file = task
    return [f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"trainer.run_dir={run_dir}",
            *SMALL_RUN, *extra]


def build_padded_model(root: Path, extra_rows: int, *, seed: int = 0, initializer_range: float = 0.2):
    """(folder, model, tokenizer) under ``root``: the tiny task's tokenizer with a random model whose embedding has
    ``extra_rows`` rows more than the tokenizer has ids (as checkpoints pad theirs: Qwen2.5's 152,064 rows)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    task_dir, _ = build_tiny_task(root / "task")
    tokenizer = AutoTokenizer.from_pretrained(task_dir)
    config = AutoConfig.from_pretrained(task_dir)
    config.vocab_size = len(tokenizer) + extra_rows
    config.initializer_range = initializer_range
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    folder = root / "padded"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer



def build_tiny_qwen3_task(root: Path, *, moe: bool = False) -> tuple[Path, Path]:
    """The tiny task with a Qwen3 policy of the quickstart's widths: q/k norms, head_dim 48 (not hidden / heads);
    ``moe``: a Qwen3-MoE one (8 experts of width 64, top-2, renormalised)."""
    import shutil

    from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

    model_dir, train_file = build_tiny_task(root)
    qwen2 = AutoConfig.from_pretrained(model_dir).to_dict()
    shape = {key: qwen2[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                         "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")}
    qwen3_dir = root / ("qwen3_moe_model" if moe else "qwen3_model")
    shutil.copytree(model_dir, qwen3_dir)
    (qwen3_dir / "config.json").unlink()
    if moe:
        config = Qwen3MoeConfig(**shape, head_dim=48, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=64, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    else:
        config = Qwen3Config(**shape, head_dim=48, rope_theta=10000.0, architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(qwen3_dir)
    return qwen3_dir, train_file
