"""The step-time model's fixed costs (grpo_mega.plan.step_time: layer_overhead, collective_latency, the colocated
weight sync) on hand-computed cases, and `grpo-mega plan --steps` on every shipped GRPO config, the quickstart's
and the small model's included (their headers name the policy's shape)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_mega.plan.step_time import (
    Efficiency, Lengths, ModelCost, TrainLayout, forward_pass_seconds, generation_seconds, update_seconds,
    weight_sync_seconds,
)
from grpo_mega.plan.devices import DeviceProfile

DEVICE = DeviceProfile("test", peak_flops=1e12, memory_bandwidth=1e11, intra_node_bandwidth=1e10,
                       inter_node_bandwidth=1e9, memory_gib=80, storage_bandwidth=1e9)
MODEL = ModelCost(matmul_params=1e9, weight_bytes=2e9, layers=10, attention_width=1000, hidden=1000,
                  kv_bytes_per_token=4e4)
PERFECT = Efficiency(mfu_train=1.0, mfu_forward=1.0, decode_bandwidth=1.0, comm=1.0, decode_step_overhead=0.0,
                     layer_overhead=0.0, eager_decode_overhead=0.0, optimizer_step_overhead=0.0,
                     collective_latency=0.0)
LENGTHS = Lengths(prompt=10, response_mean=100, response_tail=100, response_cv=0.0)
ROOT = Path(__file__).resolve().parents[1]


def test_every_eager_layer_pass_of_the_update_pays_the_layer_overhead_per_micro_batch():
    one = TrainLayout(1, 1, 1, 8)
    kw = dict(epochs=1, optimizer_steps=2, micro_batches=4, distributed_optimizer=False)
    base = update_seconds(MODEL, LENGTHS, 64, one, DEVICE, PERFECT, **kw)
    fixed = update_seconds(MODEL, LENGTHS, 64, one, DEVICE, replace(PERFECT, layer_overhead=1e-3), **kw)
    # 10 layers x 3 passes (forward + a backward of twice its kernels) x 4 micro-batches x 2 mini-batches
    assert fixed - base == pytest.approx(10 * 3 * 8 * 1e-3)
    recompute = update_seconds(MODEL, LENGTHS, 64, one, DEVICE, replace(PERFECT, layer_overhead=1e-3), **kw,
                               recompute=True) - update_seconds(MODEL, LENGTHS, 64, one, DEVICE, PERFECT, **kw,
                                                                recompute=True)
    assert recompute == pytest.approx(10 * 4 * 8 * 1e-3)
    # PP2: each rank runs half the layers, the bubble stretches it: (PP - 1) / m = 1 / 4
    pp2 = TrainLayout(1, 2, 1, 8)
    staged = update_seconds(MODEL, LENGTHS, 64, pp2, DEVICE, replace(PERFECT, layer_overhead=1e-3), **kw) - \
        update_seconds(MODEL, LENGTHS, 64, pp2, DEVICE, PERFECT, **kw)
    assert staged == pytest.approx(5 * 3 * 8 * 1e-3 * 1.25)


def test_a_forward_pass_pays_the_layer_overhead_per_micro_batch_it_runs():
    one = TrainLayout(1, 1, 1, 8)
    eff = replace(PERFECT, layer_overhead=1e-3)
    extra = forward_pass_seconds(MODEL, LENGTHS, 64, one, DEVICE, eff, micro_batches=2, calls=6) - \
        forward_pass_seconds(MODEL, LENGTHS, 64, one, DEVICE, PERFECT, micro_batches=2, calls=6)
    assert extra == pytest.approx(10 * 6 * 1e-3)


def test_collective_latency_is_paid_per_tp_call_and_never_at_tp1():
    eff = replace(PERFECT, collective_latency=1e-4)
    for tp, calls in ((1, 0), (2, 2 * 10 * 5)):  # 2 all-reduces per layer, one pass, 5 micro-batches
        layout = TrainLayout(tp, 1, 1, 8)
        extra = forward_pass_seconds(MODEL, LENGTHS, 64, layout, DEVICE, eff, micro_batches=5) - \
            forward_pass_seconds(MODEL, LENGTHS, 64, layout, DEVICE, PERFECT, micro_batches=5)
        assert extra == pytest.approx(calls * 1e-4)
    # decoding at TP2: 2 calls per layer and token step (100 steps)
    decode = generation_seconds(MODEL, LENGTHS, sequences=4, replicas=1, tp=2, concurrent=4, device=DEVICE,
                                eff=eff)["decode"] - \
        generation_seconds(MODEL, LENGTHS, sequences=4, replicas=1, tp=2, concurrent=4, device=DEVICE,
                           eff=PERFECT)["decode"]
    assert decode == pytest.approx(2 * 10 * 100 * 1e-4)


def test_only_the_eager_hf_engine_pays_the_layer_overhead_per_decode_step():
    eff = replace(PERFECT, eager_decode_overhead=1e-3)
    kw = dict(sequences=4, replicas=1, tp=1, concurrent=4, device=DEVICE)
    graphs = generation_seconds(MODEL, LENGTHS, eff=eff, **kw)
    assert graphs == generation_seconds(MODEL, LENGTHS, eff=PERFECT, **kw)  # vLLM: CUDA graphs
    eager = generation_seconds(MODEL, LENGTHS, eff=eff, eager=True, **kw)
    assert eager["decode"] - graphs["decode"] == pytest.approx(100 * 10 * 1e-3)  # 100 steps x 10 layers
    assert eager["prefill"] - graphs["prefill"] == pytest.approx(10 * 1e-3)


def test_a_colocated_weight_sync_is_a_gather_over_the_model_parallel_group_and_a_copy():
    # TP1: nothing to gather, the engine copies W at the memory bandwidth
    assert weight_sync_seconds(MODEL, DEVICE, PERFECT, across_nodes=False) == pytest.approx(2e9 / 1e11)
    # TP4: an all-gather of 3/4 W over NVLink, then the copy
    assert weight_sync_seconds(MODEL, DEVICE, PERFECT, across_nodes=False, model_parallel=4) == \
        pytest.approx(0.75 * 2e9 / 1e10 + 2e9 / 1e11)
    # rollout GPUs of their own: W over the network
    assert weight_sync_seconds(MODEL, DEVICE, PERFECT, across_nodes=True, model_parallel=4) == pytest.approx(2.0)


def test_the_seconds_factors_refuse_negative_values():
    for name in ("layer_overhead", "eager_decode_overhead", "optimizer_step_overhead", "collective_latency"):
        with pytest.raises(ValueError, match=f"Efficiency.{name}"):
            Efficiency(**{name: -1e-3})


def _grpo_configs() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").glob("*.yaml")
                  if not p.name.endswith(("_sft.yaml", "_prm.yaml")))


def test_every_shipped_grpo_config_is_priced_by_plan_steps(capsys, monkeypatch):
    """`grpo-mega plan --steps N` on every shipped GRPO config, as the README runs it from the repository: seconds
    per step and GPU-hours for each; the quickstart's and the small model's configs leave model.hf_config and
    data.train_file to the user and are planned with the policy shape their header names (said in a note)."""
    from grpo_mega.cli import main

    monkeypatch.chdir(ROOT)
    configs = _grpo_configs()
    assert {"quickstart_grpo.yaml", "small-model_grpo.yaml", "qwen2.5-math-7b_grpo.yaml"} <= {p.name for p in configs}
    for path in configs:
        # the quickstart's is priced on the CPU its hardware line names
        assert main(["plan", "--config", str(path.relative_to(ROOT)), "--steps", "100", "--json"]) in (0, 1), \
            path.name
        out = json.loads(capsys.readouterr().out)
        report = out["step_time"]
        assert report["step_seconds"] > 0 and report["gpu_hours"] > 0, path.name
        if path.name in ("quickstart_grpo.yaml", "small-model_grpo.yaml"):
            assert any("planned with the shape the config's header names" in note for note in out["notes"])


def test_an_unset_model_without_a_plan_model_line_is_still_asked_for(tmp_path, capsys):
    from grpo_mega.cli import main

    config = tmp_path / "grpo.yaml"
    config.write_text("# hardware: 1 node x 2 GPUs x 12 GiB\nalgorithm:\n  rollout_batch_size: 4\n")
    assert main(["plan", "--config", str(config), "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "model.hf_config" in err and "data.train_file" not in err


def test_the_quickstart_policy_shape_shipped_for_the_plan_is_the_one_the_quickstart_builds(tmp_path):
    from grpo_mega.quickstart.pipeline import build_data_and_model
    from grpo_mega.quickstart.plans import SPARSE

    model_dir, _, _ = build_data_and_model(tmp_path, SPARSE)
    built = json.loads((model_dir / "config.json").read_text())
    shipped = json.loads((ROOT / "configs/models/quickstart-policy/config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "max_position_embeddings", "model_type")
    assert {k: shipped[k] for k in keys} == {k: built[k] for k in keys}


def test_a_prm_on_vllm_is_priced_as_a_forward_on_its_replicas(capsys, monkeypatch):
    """scorer=vllm: the PRM's forward on world / vllm_tensor_parallel replicas (TP1 replicas: 8 at once, faster than
    the policy's TP4 layout with its all-reduces), its sleep / wake said not to be priced."""
    from grpo_mega.cli import main

    monkeypatch.chdir(ROOT)
    base = ["plan", "--config", "configs/qwen2.5-math-7b_grpo_prm.yaml", "--steps", "10", "--json"]
    assert main(base) in (0, 1)
    engine = json.loads(capsys.readouterr().out)["step_time"]
    assert main([*base, "process_reward.scorer=vllm", "process_reward.vllm_gpu_memory_utilization=0.25"]) in (0, 1)
    vllm = json.loads(capsys.readouterr().out)["step_time"]
    assert 0 < vllm["phases"]["prm_scoring"]["seconds"] < engine["phases"]["prm_scoring"]["seconds"]
    assert any(note.startswith("process_reward.scorer=vllm") for note in vllm["notes"])
    assert not any(note.startswith("process_reward.scorer=vllm") for note in engine["notes"])


def test_the_implicit_prm_scoring_with_its_updates_forward_drops_one_forward(capsys, monkeypatch):
    """implicit_prm.update: after scores with the log-probs its update's forward computed: one policy-sized forward
    less in implicit_prm_scoring than update: before, the update itself unchanged."""
    from grpo_mega.cli import main

    monkeypatch.chdir(ROOT)
    base = ["plan", "--config", "configs/qwen2.5-math-7b_grpo_implicit.yaml", "--steps", "10", "--json"]
    phases = {}
    for order in ("before", "after"):
        assert main([*base, f"implicit_prm.update={order}"]) in (0, 1)
        phases[order] = json.loads(capsys.readouterr().out)["step_time"]["phases"]
    forward = phases["before"]["implicit_prm_scoring"]["seconds"] - phases["after"]["implicit_prm_scoring"]["seconds"]
    assert forward > 0
    assert phases["after"]["implicit_prm_update"]["seconds"] == phases["before"]["implicit_prm_update"]["seconds"]
    if "old_logprobs" in phases["before"]:  # a policy forward over the same rows costs what the dropped one did
        assert forward == pytest.approx(phases["before"]["old_logprobs"]["seconds"], rel=1e-6)


def test_the_shipped_cpu_factors_are_the_ones_the_cpu_validation_fitted():
    """plan --steps --device CPU prices with CPU_EFFICIENCY: the factors bench/step_time_cpu.py fitted and recorded
    (rounded to three figures), not the GPU runs' (a CPU's decode is bound by its eager layers, not its bytes)."""
    from dataclasses import asdict

    from grpo_mega.plan.devices import PROFILES
    from grpo_mega.plan.step_time import CPU_EFFICIENCY, fitted_efficiency

    record = json.loads((ROOT / "bench/results/step_time_cpu.json").read_text())
    shipped = asdict(CPU_EFFICIENCY)
    assert {k: shipped[k] for k in record["factors"]} == pytest.approx(record["factors"], rel=5e-3)
    # factors added after that fit (issue 77): its one per-layer cost serves the hf decode too, no optimizer cost
    assert set(shipped) - set(record["factors"]) == {"eager_decode_overhead", "optimizer_step_overhead"}
    assert shipped["eager_decode_overhead"] == shipped["layer_overhead"] and shipped["optimizer_step_overhead"] == 0
    assert fitted_efficiency(PROFILES["CPU"]) is CPU_EFFICIENCY
    assert fitted_efficiency(PROFILES["H100"]) == Efficiency()


def test_pipeline_stages_split_the_layers_not_the_tp_traffic_per_layer():
    """At PP2 each stage runs half the layers over all of its DP share's tokens: the TP bytes per rank halve (the
    same total as PP1 spread over two ranks), they are not divided by PP twice."""
    tp2, tp2pp2 = TrainLayout(2, 1, 1, 8), TrainLayout(2, 2, 1, 8)
    compute_free = DeviceProfile("links", peak_flops=1e30, memory_bandwidth=1e30, intra_node_bandwidth=1e10,
                                 inter_node_bandwidth=1e9, memory_gib=80)
    one = forward_pass_seconds(MODEL, LENGTHS, 64, tp2, compute_free, PERFECT, micro_batches=1)
    two = forward_pass_seconds(MODEL, LENGTHS, 64, tp2pp2, compute_free, PERFECT, micro_batches=1)
    # TP2 ring all-reduce: 2 (2 - 1) / 2 = 1 x the bytes; 2 per layer: 2 x 10 x 64 x 110 tokens x 1000 x 2 bytes / 1e10
    assert one == pytest.approx(2 * 10 * 64 * 110 * 1000 * 2 / 1e10)
    assert two == pytest.approx(one / 2)


def test_on_a_gpu_the_host_fixed_costs_overlap_the_device_work_and_on_the_cpu_they_add():
    from grpo_mega.plan.step_time import with_fixed_costs

    gpu = replace(DEVICE, host_overlap=True)
    assert with_fixed_costs(2.0, 0.5, gpu) == 2.0 and with_fixed_costs(0.1, 0.5, gpu) == 0.5
    assert with_fixed_costs(2.0, 0.5, DEVICE) == 2.5  # the CPU (and a profile that says nothing) runs both in turn
    one = TrainLayout(1, 1, 1, 8)
    kw = dict(epochs=1, optimizer_steps=1, micro_batches=1, distributed_optimizer=False)
    compute = update_seconds(MODEL, LENGTHS, 64, one, gpu, PERFECT, **kw)
    # a layer overhead smaller than the compute is hidden on a GPU, a larger one sets the pace
    assert update_seconds(MODEL, LENGTHS, 64, one, gpu, replace(PERFECT, layer_overhead=1e-3), **kw) == compute
    assert update_seconds(MODEL, LENGTHS, 64, one, gpu, replace(PERFECT, layer_overhead=10.0), **kw) == \
        pytest.approx(10 * 3 * 10.0)


def test_every_optimizer_step_pays_its_fixed_cost():
    one = TrainLayout(1, 1, 1, 8)
    kw = dict(epochs=2, micro_batches=1, distributed_optimizer=False)
    for steps in (1, 4):
        extra = update_seconds(MODEL, LENGTHS, 64, one, DEVICE, replace(PERFECT, optimizer_step_overhead=0.5),
                               optimizer_steps=steps, **kw) - \
            update_seconds(MODEL, LENGTHS, 64, one, DEVICE, PERFECT, optimizer_steps=steps, **kw)
        assert extra == pytest.approx(0.5 * steps)
