"""``grpo-mega prm train / score / eval`` end to end on the tiny synthetic task, and the PRM loss by hand.

Training data are held-out-style solutions with planted errors (ground-truth step labels), so these tests do not
depend on Monte-Carlo labelling (tests/test_prm_labeling.py covers ``prm label``).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from cli_runner import CONFIGS, PRM_CONFIG, run_grpo_mega
from grpo_mega.data.synthetic import read_jsonl
from grpo_mega.engine import LossScale
from prm.data import write_stepwise
from prm.examples import StepExample
from prm.rendering import RenderedExample
from prm.scoring import rendered_batch, scores_at_tags
from prm.synthetic import planted_error_examples
from prm.train import prm_loss, training_targets
from tiny_task import build_tiny_task


# ----------------------------------------------------------------------------- the loss and the batch, by hand
def test_prm_loss_is_the_cross_entropy_at_the_tags_over_the_global_step_count():
    good = torch.log(torch.tensor([[0.5, 0.8, 0.5, 0.3]]))
    outputs = {"good_logprob": good, "bad_logprob": torch.log1p(-good.exp())}
    micro = {"loss_mask": torch.tensor([[0, 1, 0, 1]]), "targets": torch.tensor([[0.0, 1.0, 0.0, 0.25]])}
    loss, metrics = prm_loss(outputs, micro, LossScale(global_tokens=4.0, global_seqs=1.0))
    # tags at 1 (p=0.8, y=1) and 3 (p=0.3, y=0.25); 4 steps in the global batch (2 on another rank)
    expected = -(math.log(0.8) + 0.25 * math.log(0.3) + 0.75 * math.log(0.7)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # step 1 right (0.8 > 0.5, y = 1), step 3 right (0.3 < 0.5, y = 0.25 < 0.5): 2 hits of 4 global steps
    assert metrics["prm/step_accuracy"].item() == pytest.approx(0.5)


def test_training_targets_soft_hard_and_processbench():
    steps = ["a", "b", "c"]
    mc = StepExample("p", steps, labels=[True, True, False], soft_labels=[1.0, 0.375, 0.0])
    assert training_targets(mc, "soft") == (steps, [1.0, 0.375, 0.0])
    assert training_targets(mc, "hard") == (steps, [1.0, 1.0, 0.0])
    # only the first error known: train on the steps up to it
    assert training_targets(StepExample("p", steps, first_error=1), "hard") == (["a", "b"], [1.0, 0.0])
    assert training_targets(StepExample("p", steps, first_error=-1), "soft") == (steps, [1.0, 1.0, 1.0])
    assert training_targets(StepExample("p", steps), "hard") is None
    # data.stop_at_first_bad_step: the steps after the first bad one (bad by inheritance) are not trained on
    late = StepExample("p", ["a", "b", "c", "d"], labels=[True, False, True, False], soft_labels=[1.0, 0.25, 0.5, 0.0])
    assert training_targets(late, "hard", stop_at_first_bad_step=True) == (["a", "b"], [1.0, 0.0])
    assert training_targets(late, "soft", stop_at_first_bad_step=True) == (["a", "b"], [1.0, 0.25])
    assert training_targets(mc, "hard", stop_at_first_bad_step=True) == (steps, [1.0, 1.0, 0.0])
    all_good = StepExample("p", steps, labels=[True, True, True])
    assert training_targets(all_good, "hard", stop_at_first_bad_step=True) == (steps, [1.0, 1.0, 1.0])


def test_rendered_batch_marks_the_tags_and_scores_are_read_there():
    rendered = [RenderedExample(input_ids=[5, 6, 7, 8], tag_positions=[1, 3]),
                RenderedExample(input_ids=[5, 9], tag_positions=[1])]
    batch = rendered_batch(rendered, pad_id=0, targets=[[1.0, 0.0], [0.5]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]]
    assert batch["targets"].tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0]]
    good = torch.log(torch.tensor([[0.1, 0.9, 0.1, 0.25], [0.1, 0.6, 0.1, 0.1]]))
    first, second = scores_at_tags(good, rendered)
    assert first == pytest.approx([0.9, 0.25]) and second == pytest.approx([0.6])
    with pytest.raises(ValueError, match="row 1: 2 targets for 1 steps"):
        rendered_batch(rendered, pad_id=0, targets=[[1.0, 0.0], [0.5, 0.5]])


# ----------------------------------------------------------------------------- the commands
@pytest.fixture(scope="module")
def prm_task(tmp_path_factory):
    """The tiny task, a tiny random policy saved in HF format, and planted-error train / held-out files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("prm_task")
    model_dir, train_file = build_tiny_task(root)
    policy_dir = root / "policy_hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(policy_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (policy_dir / name).write_bytes((model_dir / name).read_bytes())
    problems = read_jsonl(train_file)
    train = root / "prm_train.jsonl"
    write_stepwise(train, planted_error_examples(problems[:48], seed=1))
    heldout = root / "prm_heldout.jsonl"
    write_stepwise(heldout, planted_error_examples(problems[150:166], seed=2))
    return {"model": model_dir, "policy": policy_dir, "train": train, "heldout": heldout, "problems": train_file}


def _train(task, run_dir: Path, total_steps: int, *extra: str, nproc: int | None = None) -> subprocess.CompletedProcess:
    """``prm train`` of a classifier PRM at TP=2 on 2 processes unless ``nproc`` is given (the config itself is a
    likelihood PRM, trained data-parallel)."""
    return run_grpo_mega(
        "prm", "train", "--config", str(PRM_CONFIG), *(["--nproc", str(nproc)] if nproc else []),
        f"model.hf_config={task['model']}",
        f"model.init_from={task['policy']}", f"data.train_file={task['train']}", f"data.eval_file={task['heldout']}",
        f"trainer.run_dir={run_dir}", f"trainer.total_steps={total_steps}", "trainer.batch_size=8",
        "trainer.save_every=2", "trainer.progress_bar=false", "trainer.tensorboard=false", "parallel.device=cpu",
        "optim.warmup_steps=0", "optim.decay_style=constant", "parallel.tensor=2", "prm.layout=classifier",
        'prm.step_tag=" ки"', "optim.lr=1e-3", *extra,
    )


def _weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint (full, global shapes), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint), str(target))
    state = torch.load(target, weights_only=False)
    return {key: value for key, value in state.items() if torch.is_tensor(value) and not key.startswith("optimizer.")}


@pytest.fixture(scope="module")
def trained_prm(prm_task, tmp_path_factory):
    """A 4-step PRM run at TP=2 on 2 processes: (run dir, its metrics rows)."""
    run_dir = tmp_path_factory.mktemp("prm_runs") / "straight"
    straight = _train(prm_task, run_dir, 4)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert Path(straight.stdout.strip().splitlines()[-1]) == run_dir / "checkpoints" / "step_000004"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


@pytest.mark.slow
def test_prm_train_resumes_exactly_and_its_checkpoint_scores_at_another_layout(prm_task, trained_prm, tmp_path):
    straight_dir, rows = trained_prm
    final = straight_dir / "checkpoints" / "step_000004"
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["prm/loss"]) for r in rows) and "eval/step_accuracy" in rows[-1]

    # the same run stopped after step 2 and resumed: the same steps 3, 4 and the same weights, bit for bit
    assert _train(prm_task, tmp_path / "resumed", 2).returncode == 0
    resumed = _train(prm_task, tmp_path / "resumed", 4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    resumed_rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["prm/loss"] for r in resumed_rows] == [r["prm/loss"] for r in rows]
    a, b = _weights(final, tmp_path), _weights(tmp_path / "resumed" / "checkpoints" / "step_000004", tmp_path)
    assert a.keys() == b.keys() and any("head.score" in key for key in a)
    assert all(torch.equal(a[key], b[key]) for key in a)

    # prm score on 1 process (TP=1) reads the TP=2 checkpoint: one line per row, in order, scores in [0, 1],
    # and they classify the held-out steps exactly as the training run's last evaluation did
    out = tmp_path / "scores.jsonl"
    scored = run_grpo_mega("prm", "score", "--prm", str(straight_dir), "--data", str(prm_task["heldout"]),
                        "--out", str(out))
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert scored.stdout.strip().splitlines()[-1] == str(out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    source_rows = [json.loads(line) for line in prm_task["heldout"].read_text().splitlines()]
    assert [line["steps"] for line in lines] == [row["completions"] for row in source_rows]
    assert [line["source"] for line in lines] == [f"{prm_task['heldout']}:{i}" for i in range(1, len(lines) + 1)]
    hits = total = 0
    for line, row in zip(lines, source_rows):
        assert len(line["step_scores"]) == len(row["completions"])
        assert all(0.0 <= s <= 1.0 for s in line["step_scores"])
        hits += sum((s > 0.5) == good for s, good in zip(line["step_scores"], row["labels"]))
        total += len(row["labels"])
    assert hits / total == pytest.approx(rows[-1]["eval/step_accuracy"], abs=1e-9)


@pytest.mark.slow
def test_prm_eval_reports_every_figure_and_best_of_n_is_consistent(prm_task, trained_prm, tmp_path):
    report_path, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    result = run_grpo_mega(
        "prm", "eval", "--prm", str(trained_prm[0]), "--data", str(prm_task["heldout"]), "--policy",
        str(prm_task["policy"]), "--prompts", str(prm_task["problems"]), "--n", "3", "--max-prompts", "4",
        "--max-new-tokens", "16", "--samples-out", str(samples), "--out", str(report_path), "--nproc", "2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(report_path)
    report = json.loads(report_path.read_text())
    for key in ("step_accuracy", "step_f1", "processbench_f1", "prm_at_n", "maj_at_n", "pass_at_n"):
        assert report[key] is None or 0.0 <= report[key] <= 1.0, key
    assert report["label_agreement"] is None  # planted errors carry the truth only: nothing to agree with
    assert report["processbench_rows"] + report["processbench_dev_rows"] == 16
    assert 0.0 < report["processbench_threshold"] < 1.0
    assert report["n"] == 3 and report["best_of_n_prompts"] == 4
    # reranking picks one of the samples: never better than "some sample is right"
    assert report["prm_at_n"] <= report["pass_at_n"] and report["maj_at_n"] <= report["pass_at_n"]
    scored = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(scored) == 12 and all(len(s["step_scores"]) == len(s["steps"]) for s in scored)
    assert report["pass_at_n"] == pytest.approx(
        sum(any(s["correct"] for s in scored[p * 3:(p + 1) * 3]) for p in range(4)) / 4)


def test_prm_train_with_unlabelled_rows_fails_naming_the_file_and_line(prm_task, tmp_path):
    data = tmp_path / "unlabelled.jsonl"
    data.write_text(json.dumps({"prompt": "Q: Start with 2. Add 3. A:", "completions": [" Step 1: 2 + 3 = 5."]}) + "\n")
    result = run_grpo_mega(
        "prm", "train", "--config", str(PRM_CONFIG), "--nproc", "1", "parallel.tensor=1", f"model.hf_config={prm_task['model']}",
        f"data.train_file={data}", f"trainer.run_dir={tmp_path / 'run'}", "data.on_bad_row=error",
        "parallel.device=cpu",
    )
    assert result.returncode == 2
    assert f"{data}:1" in result.stderr and "no step labels" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_process_supervised_grpo_with_the_learned_prm_scores_every_step(prm_task, trained_prm, tmp_path):
    from tiny_task import tiny_run_overrides

    run_dir = tmp_path / "grpo_ps"
    result = run_grpo_mega(
        "train", "--config", str(CONFIGS / "quickstart_grpo.yaml"), "--nproc", "2",
        *tiny_run_overrides((prm_task["model"], prm_task["problems"]), run_dir),
        f"model.init_from={prm_task['policy']}", "trainer.total_steps=2", "algorithm.supervision=process",
        "process_reward.source=prm", f"process_reward.prm={trained_prm[0]}", "process_reward.max_counted_steps=4",
        "trainer.dump_rollouts=true",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in trained] == [1, 2]
    for row in trained:
        assert 0.0 <= row["prm/score_mean"] <= 1.0 and row["timing_s/prm"] > 0
        assert 1.0 <= row["prm/steps_per_completion"] <= 4.0  # at least one step each, the cap holds
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    for line in dumped:  # every completion's steps were scored: rewards are PRM probabilities at strictly later tokens
        assert len(line["step_rewards"]) == len(line["step_ends"]) >= 1
        assert all(0.0 <= r <= 1.0 for r in line["step_rewards"])
        assert line["step_ends"] == sorted(set(line["step_ends"])) and line["step_ends"][-1] < len(line["response_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_process_supervised_grpo_in_async_mode_scores_on_the_rollout_rank(prm_task, trained_prm, tmp_path, engine):
    """rollout.mode=async, 1 training rank and 1 rollout rank (the hf engine, or vLLM's CPU backend): the PRM
    scores every step on the rollout rank, one step ahead of the update (staleness 1 after the first step), and
    its step rewards reach the trainer."""
    from tiny_task import tiny_run_overrides

    run_dir = tmp_path / "grpo_ps_async"
    result = run_grpo_mega(
        "train", "--config", str(CONFIGS / "quickstart_grpo.yaml"), "--nproc", "2",
        *tiny_run_overrides((prm_task["model"], prm_task["problems"]), run_dir), "parallel.tensor=1",
        f"model.init_from={prm_task['policy']}", "trainer.total_steps=3", "algorithm.supervision=process",
        "process_reward.source=prm", f"process_reward.prm={trained_prm[0]}", "process_reward.max_counted_steps=4",
        "rollout.mode=async", "rollout.max_staleness=1", "algorithm.rollout_is=tis", f"rollout.engine={engine}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    for row in rows:
        assert 0.0 <= row["prm/score_mean"] <= 1.0 and row["timing_s/prm"] > 0
        assert 1.0 <= row["prm/steps_per_completion"] <= 4.0 and "reward/step_reward_mean" in row


def test_prm_train_saves_and_stops_before_its_time_limit(prm_task, tmp_path):
    # less than save_before_seconds is left from the start: the run saves after step 1 and exits 3 (resumable)
    run_dir = tmp_path / "limited"
    result = _train(prm_task, run_dir, 4, "parallel.tensor=1", "trainer.time_limit_seconds=60",
                    "trainer.save_before_seconds=3600", nproc=1)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "stopped after step 1" in result.stderr
    assert (run_dir / "checkpoints" / "step_000001").is_dir()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
