"""``compare_with_hf`` on a model of a real small chat model's shape (issue 30, item 5): a right conversion at
TP=3 (9 heads, 3 KV heads, 30 layers, 49k vocabulary, tied embeddings) passes at the default tolerance, and the
same compare fails when one TP rank's shard of one tensor is wrong (two query heads swapped in one layer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from small_model import FULL_LAYERS, build_small_chat_model

TOOLS = Path(__file__).resolve().parents[1] / "tools"
TP = 3
HEAD_DIM = 64


def _compare_right_and_wrong_shard(hf_dir: str) -> tuple[dict, dict] | None:
    """Convert the HF weights into a TP=3 megatron model, compare with transformers; then swap query heads 0 and 1
    of TP rank 1's QKV shard in the middle layer (its rows: [q0, q1, q2, k, v] of its KV group) and compare
    again. Rank 0 returns both judged results."""
    sys.path.insert(0, str(TOOLS))
    from compare_with_hf import DEFAULT_ATOL, DEFAULT_RTOL, hf_logits, judged
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights, load_hf_weights, mcore_logits
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf
    from grpo_mega.parallel import init_distributed

    init_distributed(TP, 1, seed=0, device="cpu")
    config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(gpt_config_from_hf(config, tp=TP, pp=1, overrides={"perform_initialization": False}))
    load_hf_weights(model, HFWeights(hf_dir), config)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    right = mcore_logits(model, ids)
    if parallel_state.get_tensor_model_parallel_rank() == 1:
        qkv = model.decoder.layers[FULL_LAYERS // 2].self_attention.linear_qkv.weight
        with torch.no_grad():
            q0 = qkv[:HEAD_DIM].clone()
            qkv[:HEAD_DIM] = qkv[HEAD_DIM : 2 * HEAD_DIM]
            qkv[HEAD_DIM : 2 * HEAD_DIM] = q0
    wrong = mcore_logits(model, ids)
    if torch.distributed.get_rank() != 0:
        return None
    expected = hf_logits(Path(hf_dir), ids)
    return judged(expected, right, DEFAULT_ATOL, DEFAULT_RTOL), judged(expected, wrong, DEFAULT_ATOL, DEFAULT_RTOL)


def test_compare_passes_a_right_tp3_conversion_and_fails_a_wrong_shard(tmp_path, monkeypatch):
    hf_dir = build_small_chat_model(tmp_path / "smol", layers=FULL_LAYERS, data_rows=8)
    right, wrong = run_distributed(_compare_right_and_wrong_shard, TP, str(hf_dir), timeout=600)[0]
    assert right["logit_scale"] > 10  # logits of a trained model's size, where fp32 rounding is ~1e-4
    assert right["passed"], right
    assert right["max_abs_diff"] > 1e-6  # not a trivially exact path: the tolerance is doing work
    assert not wrong["passed"], wrong
    assert wrong["max_abs_diff"] > 10 * wrong["tolerance"]
    monkeypatch.syspath_prepend(str(TOOLS))
    from compare_with_hf import report

    assert report(right)[0][-1] == "PASS" and report(wrong)[0][-2].startswith("FAIL: max |logit diff|")
