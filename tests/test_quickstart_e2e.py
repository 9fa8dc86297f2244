"""End to end: the shortened quickstart runs data -> SFT -> PRM labels -> PRM training -> PRM evaluation -> GRPO with
outcome supervision and GRPO with process supervision by the learned PRM in two iterations with a PRM refresh between
them (all on 2 processes) -> eval, and writes its summary."""

import json
import math
from pathlib import Path

import pytest
from cli_runner import run_grpo_mega


@pytest.fixture(scope="module")
def fast_quickstart(tmp_path_factory):
    """One shortened quickstart run: (run dir, the command's result)."""
    run_dir = tmp_path_factory.mktemp("e2e") / "quickstart"
    result = run_grpo_mega("quickstart", "--fast", "--no-oracle", "--iterations", "2", "--run-dir", str(run_dir),
                           timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir, result


@pytest.mark.slow
def test_fast_quickstart_writes_summary_plot_and_checkpoints(fast_quickstart):
    run_dir, result = fast_quickstart
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[-1] == str(run_dir / "summary.json")
    summary = json.loads(Path(lines[-1]).read_text())
    for key in ("sft_accuracy", "os_accuracy", "ps_accuracy", "prm_f1", "steps", "wall_seconds"):
        assert key in summary, key
    for key in ("sft_accuracy", "os_accuracy", "ps_accuracy"):
        assert 0.0 <= summary[key] <= 1.0, key
    assert summary["steps"] == 3
    assert Path(summary["plot"]).stat().st_size > 1000
    # each arm's report: gain, zero-signal share, curve, cost; the process arm pays for its PRM's labels and training
    assert summary["regime"] == "dense" and set(summary["arms"]) == {"outcome", "process"}
    for arm in summary["arms"].values():
        assert 0.0 <= arm["zero_signal_group_fraction"] <= 1.0
        assert math.isclose(arm["gain"], arm["accuracy"] - arm["start_accuracy"])
        assert (arm["curve"][0][0], arm["curve"][-1][0]) == (0, 3)  # (step, seconds, accuracy) from step 0 to 3
        # full training: every parameter trained, Adam's fp32 moments (half of them a rank: the distributed
        # optimizer at DP=2) as large as the fp32 weights
        assert arm["trainable_parameters"] == arm["total_parameters"] > 0
        assert arm["optimizer_state_bytes"] >= 8 * arm["total_parameters"] // 2
    # the arms start from SFT step 35 of 40 (a weaker policy); the PRM from step 40, which it paid for
    sft_time = {row["step"]: row["time"] for row in map(json.loads, (run_dir / "sft" / "metrics.jsonl").open())}
    prm_seconds = (summary["stage_seconds"]["prm_label"] + summary["stage_seconds"]["prm_train"] + sft_time[40]
                   - sft_time[35])
    assert math.isclose(summary["arms"]["process"]["prm_seconds"], prm_seconds, abs_tol=0.2)
    policy = run_dir / "sft" / "checkpoints" / "step_000035"
    # the pass@1 selection measured it on 16 training prompts by `grpo-mega eval` (its report kept)
    selection = summary["policy_selection"]
    assert summary["policy_sft_step"] == selection["step"] == 35 and list(selection["pass_at_1"]) == ["35"]
    report = json.loads((run_dir / "policy_selection" / "step_000035.json").read_text())
    assert (report["prompts"], report["temperature"], report["eval_file"]) == (16, 1.0, str(run_dir / "data" / "train.jsonl"))
    assert report["accuracy_mean"] == selection["pass_at_1"]["35"]
    assert f"init_from: {policy}" in (run_dir / "grpo" / "config.yaml").read_text()
    assert f"init_from: {run_dir / 'sft'}\n" in (run_dir / "prm" / "config.yaml").read_text()
    labels = json.loads((run_dir / "prm_labels.jsonl.summary.json").read_text())
    assert (labels["completer"], labels["completer_temperature"]) == (str(run_dir / "sft"), 0.0)
    assert summary["arms"]["outcome"]["prm_seconds"] == 0.0
    assert summary["arms"]["process"]["curve"][0][1] >= prm_seconds
    assert math.isclose(summary["ps_minus_os"], summary["ps_accuracy"] - summary["os_accuracy"])
    assert "zero-signal" in result.stdout and "regime: dense" in result.stdout
    # every stage announced itself and showed a live line; training stages count their steps
    for header in ("[1/8] data", "[2/8] SFT", "[3/8] the arms' SFT checkpoint", "[4/8] PRM labels",
                   "[5/8] PRM training", "[6/8] PRM evaluation", "[7/8] GRPO, outcome supervision",
                   "[8/8] GRPO, process supervision by the learned PRM"):
        assert header in result.stdout, header
    assert "SFT: 100%" in result.stdout and "40/40" in result.stdout
    assert "GRPO (process, iteration 1): 100%" in result.stdout and "3/3" in result.stdout
    assert "GRPO (process, iteration 2): 100%" in result.stdout and "PRM refresh 1" in result.stdout
    # the GRPO stage logged verl-style metrics every step and left a complete checkpoint
    rows = [json.loads(line) for line in (run_dir / "grpo" / "metrics.jsonl").read_text().splitlines()]
    step_rows = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in step_rows] == [1, 2, 3]
    for name in ("critic/score/mean", "rollout/sampled_score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "timing_s/gen",
                 "timing_s/update", "timing_s/sync", "perf/throughput", "response_length/mean"):
        assert name in step_rows[-1], name
    assert list((run_dir / "grpo" / "checkpoints").glob("step_000003"))
    # the process-supervised arm started from the same SFT policy and was scored step by step by the trained PRM
    process_rows = [json.loads(line) for line in (run_dir / "grpo_process" / "metrics.jsonl").read_text().splitlines()]
    assert process_rows[0]["eval/accuracy"] == rows[0]["eval/accuracy"] == summary["sft_accuracy"]
    for name in ("prm/steps_per_completion", "prm/score_mean", "prm/last_step_score", "prm/min_step_score",
                 "timing_s/prm"):
        assert name in process_rows[-1], name
    assert list((run_dir / "prm" / "checkpoints").glob("step_*"))
    # iterative RL: iteration 2 started from iteration 1's policy with a PRM trained on from the first one, on fresh
    # labels of that policy plus a replay of the first labels; the arm's metrics count steps across iterations
    assert summary["iterations"] == 2
    process = run_dir / "grpo_process"
    assert [row["step"] for row in process_rows if row["step"] > 0] == [1, 2, 3]
    assert [row["iteration"] for row in process_rows if row["step"] > 0] == [1, 1, 2]
    assert list((process / "iter2" / "checkpoints").glob("step_000001"))
    assert list((process / "prm_iter1" / "checkpoints").glob("step_000003"))
    assert f"init_from: {process / 'iter1'}" in (process / "iter2" / "config.yaml").read_text()
    assert f"init_from: {run_dir / 'prm'}" in (process / "prm_iter1" / "config.yaml").read_text()
    fresh = (process / "prm_labels_iter1.jsonl").read_text().splitlines()
    first = (run_dir / "prm_labels.jsonl").read_text().splitlines()
    assert str(run_dir / "prm_labels.jsonl") in (process / "prm_iter1" / "config.yaml").read_text()
    assert (f"training set: {len(fresh)} rows of {process / 'prm_labels_iter1.jsonl'} plus {round(0.1 * len(first))}"
            f" replayed of the {len(first)} rows of data.replay_files") in (process / "prm_train_iter1.log").read_text()
    report = json.loads((run_dir / "prm_eval.json").read_text())
    for key in ("step_accuracy", "processbench_f1", "prm_at_n", "maj_at_n", "pass_at_n"):
        assert key in report, key


def _hf_nll(model_dir: Path, rows: list[dict]) -> float:
    """Token-mean NLL of the reference solutions under the HF model in ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_mega.data.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt = tokenizer(row["prompt"]).input_ids
            response = tokenizer(row["solution"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(response), reduction="sum").item()
            count += len(response)
    return total / count


@pytest.mark.slow
def test_trained_policy_exports_to_hugging_face(fast_quickstart, tmp_path, monkeypatch):
    """A training checkpoint (the quickstart's SFT run) converts to an HF folder whose loss matches the trainer's,
    and scores steps as a likelihood PRM as transformers computes them from that folder."""
    run_dir, _ = fast_quickstart
    sft_dir, train_file = run_dir / "sft", run_dir / "data" / "train.jsonl"
    hf_out = tmp_path / "hf"
    # tools/convert_mcore_to_hf.py in this process, as test_prm_conversion runs it (its one-rank job runs here):
    # no interpreter start importing torch, transformers and megatron-core again
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    import convert_mcore_to_hf

    convert_mcore_to_hf.main(["--ckpt", str(sft_dir), "--out", str(hf_out)])
    rows = [json.loads(line) for line in train_file.read_text().splitlines()[:64]]
    final_nll = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()][-1]["sft/nll"]
    hf_nll = _hf_nll(hf_out, rows)
    assert hf_nll < 3.0  # uniform over the vocabulary would be ~5.7
    assert abs(hf_nll - final_nll) < 0.35, (hf_nll, final_nll)

    # The same checkpoint as a likelihood PRM: a step's score is its smallest token probability
    planted = run_dir / "planted_errors.jsonl"
    scores_out = tmp_path / "scores.jsonl"
    score = run_grpo_mega("prm", "score", "--prm", str(sft_dir), "--layout", "likelihood", "--data", str(planted),
                          "--out", str(scores_out))
    assert score.returncode == 0, score.stdout[-2000:] + score.stderr[-3000:]
    scored = [json.loads(line) for line in scores_out.read_text().splitlines()]
    assert len(scored) == len(planted.read_text().splitlines())
    expected = _hf_step_likelihoods(hf_out, scored[:12])
    for row, reference in zip(scored, expected):
        assert len(row["step_scores"]) == len(reference)
        for got, want in zip(row["step_scores"], reference):
            assert math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-6), (row["source"], got, want)


def _hf_step_likelihoods(model_dir: Path, rows: list[dict]) -> list[list[float]]:
    """Per step, min over its tokens of p(token | text before) under the HF model, the steps tokenized one by one."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_mega.data.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    scores = []
    with torch.no_grad():
        for row in rows:
            ids, spans = tokenizer(row["prompt"]).input_ids, []
            for step in row["steps"]:
                start = len(ids)
                ids += tokenizer(step, add_special_tokens=False).input_ids
                spans.append((start, len(ids)))
            assert ids == tokenizer(row["prompt"] + "".join(row["steps"])).input_ids
            probs = torch.softmax(model(torch.tensor([ids])).logits[0], dim=-1)
            token_probs = [1.0] + [float(probs[t - 1, ids[t]]) for t in range(1, len(ids))]
            scores.append([min(token_probs[a:b]) for a, b in spans])
    return scores


@pytest.mark.slow
def test_the_lora_arm_adds_to_a_finished_run_with_its_parameter_figures(fast_quickstart, tmp_path):
    """``bench/pipeline_seeds.py --add-arms lora_r16`` on a finished run (a copy of it): rank-16 adapters over the
    arms' SFT checkpoint, reported against outcome supervision with what it trains and its optimizer state."""
    import shutil

    from grpo_mega.quickstart.arm_runs import add_arms
    from grpo_mega.quickstart.plans import FAST

    run_dir = tmp_path / "quickstart"
    shutil.copytree(fast_quickstart[0], run_dir)
    summary = add_arms(run_dir, FAST, ["lora_r16"])
    lora, outcome = summary["arms"]["lora_r16"], summary["arms"]["outcome"]
    assert summary["lora_r16_minus_os"] == pytest.approx(lora["accuracy"] - outcome["accuracy"])
    assert lora["start_accuracy"] == outcome["start_accuracy"]  # the same SFT checkpoint, unchanged at step 0
    assert f"init_from: {run_dir / 'sft' / 'checkpoints' / 'step_000035'}" in (
        run_dir / "grpo_lora_r16" / "config.yaml").read_text()
    # r (in + out) per linear: hidden 128, q 128 + k, v 2 x 32, MLP 512 (fc1 gate and up), 4 layers
    assert lora["trainable_parameters"] == 16 * 4 * ((128 + 256) + (128 + 128) + (128 + 1024) + (512 + 128))
    assert lora["total_parameters"] == outcome["total_parameters"] + lora["trainable_parameters"]
    assert 0 < lora["optimizer_state_bytes"] < outcome["optimizer_state_bytes"] / 4
    assert json.loads((run_dir / "summary.json").read_text())["arms"]["lora_r16"] == lora
