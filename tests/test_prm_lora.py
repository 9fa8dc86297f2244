"""``grpo-mega prm train`` with ``model.lora`` (a classifier PRM on a tiny random policy, 1 process): the adapters
and the classifier head train, nothing else; the checkpoint holds those alone and names the base; ``prm score`` and
``prm eval`` open it merged (the base + s B A, the trained head) and classify the held-out steps exactly as the
training run's own evaluation did; ``tools/convert_mcore_to_hf.py`` exports it merged, with the base's untouched
weights bit for bit; a run resumed from its step-2 checkpoint (the base reloaded from model.init_from) repeats
step 3 bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_runner import PRM_CONFIG, run_grpo_mega
from grpo_mega.data.synthetic import read_jsonl
from prm.data import write_stepwise
from prm.synthetic import planted_error_examples
from tiny_task import build_tiny_task

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(scope="module")
def lora_prm(tmp_path_factory):
    """The tiny task's policy (random weights: the base), planted-error train / held-out files, and a 3-step LoRA
    PRM run on them: (task, run dir, its metrics rows, its process's stderr)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("prm_lora")
    model_dir, train_file = build_tiny_task(root)
    policy = root / "policy_hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(policy)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (policy / name).write_bytes((model_dir / name).read_bytes())
    problems = read_jsonl(train_file)
    train, heldout = root / "train.jsonl", root / "heldout.jsonl"
    write_stepwise(train, planted_error_examples(problems[:48], seed=1))
    write_stepwise(heldout, planted_error_examples(problems[150:166], seed=2))
    task = {"policy": policy, "heldout": heldout, "model": model_dir, "train": train}
    run_dir = root / "run"
    result = _prm_train(task, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return task, run_dir, _rows(run_dir), result.stderr


def _prm_train(task, run_dir: Path, *extra: str):
    """3 steps of a classifier PRM with LoRA rank 4 on 1 process, checkpoints after steps 2 and 3."""
    return run_grpo_mega(
        "prm", "train", "--config", str(PRM_CONFIG), "--nproc", "1", f"model.hf_config={task['model']}",
        f"model.init_from={task['policy']}", f"data.train_file={task['train']}", f"data.eval_file={task['heldout']}",
        f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "trainer.batch_size=8", "trainer.eval_every=3",
        "trainer.save_every=2", "trainer.keep_last=2", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "parallel.device=cpu", "optim.warmup_steps=0", "optim.decay_style=constant", "parallel.tensor=1",
        "prm.layout=classifier", 'prm.step_tag=" ки"', "optim.lr=1e-2", "model.lora.rank=4", "model.lora.alpha=8",
        *extra,
    )


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoint_tensors(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(target))
    state = torch.load(target, weights_only=False)
    return {key: value for key, value in state.items() if torch.is_tensor(value) and not key.startswith("optimizer.")}


@pytest.mark.slow
def test_a_lora_prm_trains_adapters_and_head_and_scores_merged(lora_prm, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    task, run_dir, rows, stderr = lora_prm
    assert "LoRA rank 4 (alpha 8) on linear_qkv, linear_proj, linear_fc1, linear_fc2:" in stderr
    checkpoint = run_dir / "checkpoints" / "step_000003"
    info = json.loads((checkpoint / "grpo_mega_checkpoint.json").read_text())
    assert info["lora"]["trained_modules"] == ["head"] and info["lora"]["base"] == str(task["policy"])
    saved = _checkpoint_tensors(checkpoint, tmp_path)
    assert {key.split(".")[0] for key in saved} == {"lora", "head"}  # adapters and the head, no base weight
    assert any(saved[key].abs().max() > 0 for key in saved if key.endswith(".B"))  # B left zero: trained

    # prm score and prm eval open the checkpoint merged: the same step classification as the run's evaluation
    out = tmp_path / "scores.jsonl"
    scored = run_grpo_mega("prm", "score", "--prm", str(run_dir), "--data", str(task["heldout"]), "--out", str(out))
    assert scored.returncode == 0, scored.stderr[-3000:]
    labels = [json.loads(line)["labels"] for line in task["heldout"].read_text().splitlines()]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    hits = sum((s > 0.5) == good for line, row in zip(lines, labels) for s, good in zip(line["step_scores"], row))
    assert hits / sum(map(len, labels)) == pytest.approx(rows[-1]["eval/step_accuracy"], abs=1e-9)
    report_path = tmp_path / "eval.json"
    evaluated = run_grpo_mega("prm", "eval", "--prm", str(checkpoint), "--data", str(task["heldout"]),
                              "--out", str(report_path))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(report_path.read_text())["step_accuracy"] == pytest.approx(rows[-1]["eval/step_accuracy"],
                                                                                   abs=1e-9)

    # the merged export: the base's weights that take no adapter unchanged, the adapted ones moved, the head trained
    monkeypatch.syspath_prepend(str(TOOLS))
    import convert_mcore_to_hf

    convert_mcore_to_hf.main(["--ckpt", str(checkpoint), "--out", str(tmp_path / "merged")])
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(task["policy"] / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(merged[name], base[name]), name
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(merged["score.0.weight"], saved["head.score.0.weight"])
    assert "lm_head.weight" not in merged


@pytest.mark.slow
def test_a_lora_prm_resumes_from_its_adapters_and_head_bit_equal(lora_prm, tmp_path):
    task, run_dir, rows, _ = lora_prm
    resumed_dir = tmp_path / "resumed"
    resumed = _prm_train(task, resumed_dir, f"trainer.resume={run_dir / 'checkpoints' / 'step_000002'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _rows(resumed_dir)
    assert [row["step"] for row in again] == [3]
    deterministic = [key for key in rows[-1] if key.startswith(("prm/", "eval/")) or key == "grad_norm"]
    assert "prm/loss" in deterministic and "eval/step_accuracy" in deterministic
    assert {key: again[0][key] for key in deterministic} == {key: rows[-1][key] for key in deterministic}
    straight = _checkpoint_tensors(run_dir / "checkpoints" / "step_000003", tmp_path)
    restarted = _checkpoint_tensors(resumed_dir / "checkpoints" / "step_000003", tmp_path)
    assert straight.keys() == restarted.keys()
    assert all(torch.equal(straight[key], restarted[key]) for key in straight)
