"""docs/real-models.md's "A real model from your disk" (the README's until the docs site) runs as written (issue 30, item 3 and the floors), shortened with
overrides, on a random-weight model of SmolLM2-135M's widths (Llama, hidden 576, 9 heads / 3 KV heads, tied
embeddings, 49,152-row vocabulary, ChatML template with a default system prompt; 2 layers instead of 30 for time):
chat-format SFT -> Monte-Carlo labels -> PRM (likelihood of each step's result) -> ``prm score`` with each layout ->
process-supervised GRPO from the SFT output with the chat template at PP=2 -> HF export.

The commands are read from that page itself, so an edit there that breaks them fails here. Each runs as a user
would run it (a ``grpo-mega`` / ``python tools/...`` process); its stderr must not carry the filtered megatron /
Apex warnings (item 7)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from small_model import SYSTEM_PROMPT, VOCAB_SIZE, build_small_chat_model

REPO = Path(__file__).resolve().parents[1]
SECTION = "## A real model from your disk"
# Shortening per command (appended: the last value of a flag or key wins), keyed by the command's first words.
SHORTER = {
    "grpo-mega sft": ["trainer.total_steps=2", "trainer.batch_size=4", "optim.warmup_steps=0", "trainer.save_every=0",
                      "trainer.progress_bar=false", "parallel.device=cpu"],
    "grpo-mega prm label": ["--max-prompts", "2", "--n", "2", "--max-new-tokens", "10", "--device", "cpu"],
    "grpo-mega prm train": ["trainer.total_steps=2", "trainer.batch_size=2", "optim.warmup_steps=0",
                            "trainer.progress_bar=false", "parallel.device=cpu"],
    "grpo-mega prm score": [],
    # PP=2 on the test's 2 processes: GRPO from the SFT output, with the chat template, on a pipeline of 2 stages
    "grpo-mega train": ["parallel.pipeline=2", "trainer.total_steps=2", "algorithm.rollout_batch_size=2",
                        "algorithm.num_return_sequences_in_group=2", "algorithm.response_length=10",
                        "algorithm.max_sampling_rounds=1", "trainer.save_every=0", "trainer.progress_bar=false",
                        "parallel.device=cpu"],
    "python tools/convert_mcore_to_hf.py": [],
}
NPROC = {"grpo-mega train": 2}


def readme_commands() -> list[str]:
    """The commands of the section's bash block, in order."""
    text = (REPO / "docs" / "real-models.md").read_text()
    block = text[text.index(SECTION):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith(("grpo-mega ", "python tools/"))]


def _kind(argv: list[str]) -> str:
    for kind in sorted(SHORTER, key=len, reverse=True):
        if " ".join(argv).startswith(kind):
            return kind
    raise AssertionError(f"a docs/real-models.md command the test does not know: {argv}")


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run one command as a user would, from ``cwd`` (where runs/small lands)."""
    if argv[0] == "grpo-mega":
        argv = [sys.executable, "-m", "grpo_mega.cli", *argv[1:]]
    else:
        argv = [sys.executable, str(REPO / argv[1]), *argv[2:]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "Apex" not in done.stderr and "Transformer Engine" not in done.stderr, done.stderr[-3000:]
    return done


def _command(line: str, paths: dict[str, str]) -> list[str]:
    for name, value in paths.items():
        line = line.replace(f"${name}", value)
    argv = shlex.split(line)
    kind = _kind(argv)
    if kind in NPROC:
        argv[len(kind.split()):len(kind.split())] = ["--nproc", str(NPROC[kind])]
    return [*argv, *SHORTER[kind]]


def test_readme_small_model_section_runs_as_written(tmp_path):
    model = build_small_chat_model(tmp_path / "SmolLM2-135M-Instruct", layers=2, data_rows=48)
    paths = {"MODEL": str(model), "DATA": str(tmp_path / "gsm8k.jsonl")}
    commands = readme_commands()
    assert [_kind(shlex.split(c)) for c in commands] == list(SHORTER)  # the section's whole flow, in order
    runs = tmp_path / "runs" / "small"
    for line in commands:
        argv = _command(line, paths)
        _run(argv, tmp_path)
        if _kind(argv) == "grpo-mega prm score":
            _score_with_the_other_layouts(tmp_path, runs)

    # SFT trained in the chat format GRPO prompts in; GRPO ran its steps on a pipeline of 2 from the SFT output
    assert yaml.safe_load((runs / "sft" / "config.yaml").read_text())["data"]["chat_template"]
    grpo_rows = [json.loads(line) for line in (runs / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in grpo_rows if row["step"] > 0] == [1, 2]
    grpo_config = yaml.safe_load((runs / "grpo" / "config.yaml").read_text())
    assert grpo_config["parallel"]["pipeline"] == 2 and grpo_config["model"]["init_from"] == "runs/small/sft"
    assert grpo_config["data"]["chat_template"] and grpo_config["algorithm"]["supervision"] == "process"
    # the exported policy is the same model, ready for transformers, with its chat template
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    exported = runs / "grpo-hf"
    config = AutoConfig.from_pretrained(exported)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, VOCAB_SIZE)
    assert config.tie_word_embeddings
    policy = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert torch.isfinite(policy(torch.tensor([[1, 5, 9]])).logits).all()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                           add_generation_prompt=True)
    assert SYSTEM_PROMPT in prompt


def _score_with_the_other_layouts(cwd: Path, runs: Path) -> None:
    """``prm score`` with the other layout a causal LM reads as, on the same labels: the README's PRM is the
    likelihood of each step's result (already run); here the HF model read as ``lm_tokens`` (Math-Shepherd's
    layout), chosen explicitly. (The ``classifier`` layout is Qwen2ForProcessRewardModel, on Qwen2 backbones only:
    grpo-mega refuses it on this Llama model; test_prm_commands covers it on Qwen2.)"""
    labels = str(runs / "prm_labels.jsonl")
    scored = {"likelihood/result": runs / "prm_scores.jsonl"}
    for name, prm, extra in (("lm_tokens", runs.parents[1] / "SmolLM2-135M-Instruct", ["--layout", "lm_tokens"]),):
        scored[name] = runs / f"prm_scores_{name.replace('/', '_')}.jsonl"
        _run(["grpo-mega", "prm", "score", "--prm", str(prm), "--data", labels, "--out", str(scored[name]), *extra],
             cwd)
    examples = [json.loads(line) for line in Path(labels).read_text().splitlines()]
    assert examples
    for name, path in scored.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [len(row["step_scores"]) for row in rows] == [len(e["completions"]) for e in examples], name
        assert all(0.0 <= s <= 1.0 for row in rows for s in row["step_scores"]), name


@pytest.fixture(autouse=True)
def _configs_in_cwd(tmp_path):
    """The README's commands name ``configs/...`` relative to the repository; runs land in ``tmp_path``."""
    (tmp_path / "configs").symlink_to(REPO / "configs")


def test_readme_commands_keep_the_configs_settings():
    """What each command is given on top of its config is paths only (the shortening is this test's)."""
    for line in readme_commands():
        overrides = [word for word in shlex.split(line) if re.match(r"^[a-z_]+\.[a-z_.]+=", word)]
        keys = {word.split("=", 1)[0] for word in overrides}
        assert keys <= {"model.hf_config", "model.init_from", "data.train_file", "process_reward.prm"}, line
