"""Tests that need a CUDA GPU (``pytest -m gpu``); skipped, with the reason, on machines without one (CI).

They run what only a GPU can show: NCCL, bf16 numerics on tensor cores, and the whole GPU path through
bench/gpu_check.py. The CPU suite runs the same check with ``--device cpu`` (tests/test_gpu_check.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_nccl_at_world_size_one_and_bf16_logprobs_match_fp64():
    figures = gpu_check.stage_distributed("cuda", gpu_check.SHAPES["qwen2.5-0.5b"])
    assert figures["backend"] == "nccl" and figures["world_size"] == 1
    assert figures["logprob_max_abs_error_vs_fp64"] < 1e-3


def test_gpu_check_end_to_end(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench/gpu_check.py"), "--device", "cuda", "--sft-steps", "20",
                           "--work", str(tmp_path / "runs"), "--out", str(tmp_path / "report.json")],
                          capture_output=True, text=True, timeout=1800)
    report = json.loads((tmp_path / "report.json").read_text())
    failed = {name: stage.get("error") for name, stage in report["stages"].items() if not stage.get("ok")}
    assert failed == {} and done.returncode == 0
