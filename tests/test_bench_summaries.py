"""The pure parts of the benchmarks behind ``make bench``: the scaling grid, the sync-bytes prediction against a real
Hugging Face model, per-step summaries, PRM throughput rows, the log-prob baseline and its savings table, and the
text table. (The benchmarks themselves take minutes and run under ``make bench``.)"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from grpo_scaling import BASE, expected_sync_bytes, grid, summarise, unique_points  # noqa: E402
from grpo_step import summarise as summarise_steps  # noqa: E402
from logprob_memory import full_logprobs_and_entropy, logits_mib, savings  # noqa: E402
from prm_scoring import throughput  # noqa: E402
from report import text_table  # noqa: E402
from workload import count_parameters  # noqa: E402


# ------------------------------------------------------------------------------------------ scaling grid
def test_grid_varies_one_field_of_the_base_point_per_axis():
    axes = grid()
    assert list(axes) == ["layout", "group", "response length", "model size"]
    fields = {"layout": "layout", "group": "group", "response length": "max_new", "model size": "size"}
    for axis, points in axes.items():
        assert BASE in points  # the base point sits on every axis
        for point in points:
            differing = {k for k, v in asdict(point).items() if v != asdict(BASE)[k]}
            assert differing <= {fields[axis]}
    assert [p.layout for p in axes["layout"]] == ["dp2", "tp2", "pp2"]
    assert [p.group for p in axes["group"]] == [4, 8, 16]
    assert [p.max_new for p in axes["response length"]] == [32, 64, 128]
    # 3 + 3 + 3 + 2 points, the base point counted once: 8 runs
    assert len(unique_points(axes)) == 8 and unique_points(axes)[0] == BASE


def test_grid_restricted_to_sizes_and_axes():
    quick = grid(("3m",))
    assert [p.size for p in quick["model size"]] == ["3m"]
    assert len(unique_points(quick)) == 7
    only_layouts = grid(axes_wanted=("layout",))
    assert list(only_layouts) == ["layout"] and len(unique_points(only_layouts)) == 3


# ------------------------------------------------------------------------------------------ sync bytes
@pytest.mark.parametrize("tied", [True, False])
def test_expected_sync_bytes_is_the_hf_model_fp32_parameter_bytes(tied):
    """count_parameters + expected_sync_bytes predict what a weight sync sends: every HF parameter once, fp32
    (a tied LM head shares the embedding's storage and is not exported twice)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=301, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    actual = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once
    parameters = count_parameters(config)[0]
    if not tied:  # count_parameters is for the workload's tied models: add the separate head
        parameters += config.vocab_size * config.hidden_size
    assert expected_sync_bytes(parameters) == actual


# ------------------------------------------------------------------------------------------ step summaries
def _row(step, gen, update, sync, tokens=1000.0, response=600.0):
    return {"step": step, "timing_s/gen": gen, "timing_s/update": update, "timing_s/sync": sync,
            "timing_s/step": gen + update + sync, "perf/num_tokens": tokens, "perf/num_response_tokens": response,
            "perf/sync_bytes": 4096.0}


def test_summarise_drops_the_warmup_and_averages_the_rest():
    rows = [_row(1, 100.0, 100.0, 1.0), _row(2, 2.0, 4.0, 0.5), _row(3, 4.0, 6.0, 0.5, tokens=2000.0)]
    summary = summarise(rows)
    assert summary["steps_measured"] == 2
    assert summary["gen_seconds"] == pytest.approx(3.0) and summary["update_seconds"] == pytest.approx(5.0)
    assert summary["step_seconds"] == pytest.approx(8.5) and summary["sync_seconds"] == pytest.approx(0.5)
    assert summary["sync_bytes"] == 4096.0 and summary["logprob_seconds"] == 0.0  # no old-log-prob pass logged
    assert summary["trained_tokens_per_s"] == pytest.approx(1500.0 / 5.0)
    assert summary["generated_tokens_per_s"] == pytest.approx(600.0 / 3.0)


def test_summarise_refuses_a_run_with_only_warmup():
    with pytest.raises(ValueError, match="1 step\\(s\\) logged, 1 of them warm-up"):
        summarise([_row(1, 1.0, 1.0, 0.1)])


def test_the_step_bench_names_a_run_where_no_step_trained_instead_of_a_type_error():
    # dynamic sampling dropped every group: the steps log generation only (was: TypeError on a None mean)
    with pytest.raises(ValueError, match="no measured step trained"):
        summarise_steps([{"step": 2, "timing_s/gen": 1.0, "timing_s/step": 1.0}])
    trained = summarise_steps([{"step": 2, "timing_s/gen": 2.0, "timing_s/update": 4.0, "perf/num_tokens": 800.0,
                                "perf/num_response_tokens": 400.0, "perf/throughput": 100.0}])
    assert trained["tokens_per_s"] == {"gen": 200.0, "update": 200.0}


# ------------------------------------------------------------------------------------------ PRM throughput
def test_prm_throughput_takes_the_slowest_rank_of_each_pass_and_the_median_pass():
    ranks = [{"seconds": [1.0, 3.0, 2.0], "startup_seconds": 4.0, "scored_steps": 120, "tokens": 6000,
              "peak_rss_mb": 500.0},
             {"seconds": [1.5, 2.5, 2.5], "startup_seconds": 5.0, "scored_steps": 120, "tokens": 6000,
              "peak_rss_mb": 520.0}]
    row = throughput("likelihood", "dp2", ranks, solutions=30)
    assert row["pass_seconds"] == [1.5, 3.0, 2.5] and row["seconds"] == 2.5
    assert row["steps_per_s"] == pytest.approx(48.0) and row["solutions_per_s"] == pytest.approx(12.0)
    assert row["tokens_per_s"] == pytest.approx(2400.0)
    assert (row["prm"], row["processes"], row["tensor"], row["threads_per_process"]) == ("likelihood", 2, 1, 1)
    assert row["startup_seconds"] == 5.0 and row["peak_rss_mb"] == 520.0


# ------------------------------------------------------------------------------------------ log-prob memory
def test_full_logprobs_and_entropy_match_the_categorical_distribution():
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(7, 16, generator=generator), torch.randn(50, 16, generator=generator)
    labels = torch.randint(0, 50, (7,), generator=generator)
    logprobs, entropy = full_logprobs_and_entropy(hidden, weight, labels)
    reference = torch.distributions.Categorical(logits=hidden @ weight.t())
    torch.testing.assert_close(logprobs, reference.log_prob(labels))
    torch.testing.assert_close(entropy, reference.entropy())


def test_full_logprobs_backward_reaches_the_inputs_through_the_logprobs_only():
    hidden = torch.randn(5, 8).requires_grad_()
    weight = torch.randn(20, 8).requires_grad_()
    logprobs, entropy = full_logprobs_and_entropy(hidden, weight, torch.arange(5))
    assert logprobs.requires_grad and not entropy.requires_grad  # the loss uses no entropy by default
    logprobs.sum().backward()
    assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0


def _measured(vocab, mode, implementation, peak, seconds=1.0, logprob_sum=-100.0):
    return {"vocab": vocab, "mode": mode, "implementation": implementation, "logits_mib": logits_mib(1024, vocab),
            "peak_mib": peak, "seconds": seconds, "logprob_sum": logprob_sum, "entropy_sum": 50.0}


def test_savings_pair_the_implementations_per_vocab_and_mode():
    rows = [_measured(8192, "train", "full", 300.0), _measured(8192, "train", "chunked", 100.0),
            _measured(8192, "logprobs", "full", 96.0), _measured(8192, "logprobs", "chunked", 32.0, logprob_sum=-90.0),
            {"vocab": 151936, "mode": "train", "implementation": "full", "logits_mib": logits_mib(1024, 151936),
             "skipped": "needs about 2374 MiB, 1000 MiB available"},
            _measured(151936, "train", "chunked", 700.0)]
    lines = savings(rows)
    assert [(line["vocab"], line["mode"]) for line in lines] == [(8192, "train"), (8192, "logprobs"),
                                                                  (151936, "train")]
    train = lines[0]
    assert train["saved_mib"] == 200.0 and train["ratio"] == 3.0 and train["outputs_agree"] is True
    assert lines[1]["outputs_agree"] is False  # different log-prob sums: the two paths disagree
    assert "full_mib" not in lines[2] and lines[2]["chunked_mib"] == 700.0  # the naive point was skipped
    assert logits_mib(1024, 8192) == 32.0


def test_text_table_aligns_columns_and_marks_missing_values():
    text = text_table([("vocab", "vocab", "d"), ("full MiB", "full_mib", ".0f")],
                      [{"vocab": 8192, "full_mib": 95.6}, {"vocab": 151936}])
    assert text.splitlines() == [" vocab full MiB", "  8192       96", "151936        -"]
