"""The step-time model (grpo_mega.plan.step_time, devices, timing) on hand-computed cases, and
`grpo-mega plan --steps N` on shipped configs."""

import json
import math
from dataclasses import replace

import pytest

from grpo_mega.config import ConfigError
from grpo_mega.plan.devices import PROFILES, DeviceProfile, cpu_profile, device_profile
from grpo_mega.plan.step_time import (
    Efficiency, Lengths, ModelCost, TrainLayout, combine, concurrent_sequences, decode_steps, forward_flops,
    forward_pass_seconds, generation_seconds, pipeline_bubble, rank_imbalance, ring_seconds, save_seconds,
    update_seconds,
)

# a round device and model: 1e12 FLOP/s, 1e11 B/s memory, 1e10 B/s links
DEVICE = DeviceProfile("test", peak_flops=1e12, memory_bandwidth=1e11, intra_node_bandwidth=1e10,
                       inter_node_bandwidth=1e9, memory_gib=80, storage_bandwidth=1e9)
MODEL = ModelCost(matmul_params=1e9, weight_bytes=2e9, layers=10, attention_width=1000, hidden=1000,
                  kv_bytes_per_token=4e4)
PERFECT = Efficiency(mfu_train=1.0, mfu_forward=1.0, decode_bandwidth=1.0, comm=1.0, decode_step_overhead=0.0,
                     layer_overhead=0.0, eager_decode_overhead=0.0, optimizer_step_overhead=0.0,
                     collective_latency=0.0)


def test_model_cost_from_shapes_counts_matmul_parameters_and_kv_bytes():
    from grpo_mega.plan.activations import Shapes

    s = Shapes(hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, layers=3, vocab=100)
    cost = ModelCost.from_shapes(s)
    attention = 8 * (8 + 2 * 4) + 8 * 8  # QKV + output projection
    assert cost.matmul_params == 3 * (attention + 3 * 8 * 16) + 100 * 8
    assert cost.weight_bytes == 2 * (3 * (attention + 3 * 8 * 16) + 2 * 100 * 8)  # embedding and head
    assert cost.kv_bytes_per_token == 2 * 3 * 4 * 2


def test_forward_flops_are_two_per_parameter_and_token_plus_causal_attention():
    lengths = Lengths(prompt=100, response_mean=300, response_tail=300, response_cv=0.0)
    # 2 N S (P + L) + 2 l a S (P + L)^2
    assert forward_flops(MODEL, lengths, 8) == pytest.approx(2e9 * 8 * 400 + 2 * 10 * 1000 * 8 * 400**2)


def test_decode_time_doubles_when_the_memory_bandwidth_halves():
    """Few sequences of a big model: decoding reads weights and KV cache, compute is idle."""
    lengths = Lengths(prompt=10, response_mean=100, response_tail=100, response_cv=0.0)
    fast = generation_seconds(MODEL, lengths, sequences=4, replicas=1, tp=1, concurrent=4, device=DEVICE,
                              eff=PERFECT)["decode"]
    slow = generation_seconds(MODEL, lengths, sequences=4, replicas=1, tp=1, concurrent=4,
                              device=replace(DEVICE, memory_bandwidth=5e10), eff=PERFECT)["decode"]
    assert slow == pytest.approx(2 * fast)
    # by hand: 100 steps x 2e9 weight bytes + 4 x 4e4 x (10 x 100 + 100^2 / 2) KV bytes, over 1e11 B/s
    assert fast == pytest.approx((100 * 2e9 + 4 * 4e4 * (1000 + 5000)) / 1e11)


def test_decode_steps_are_the_tail_when_everything_fits_else_full_batches_then_the_tail():
    lengths = Lengths(prompt=0, response_mean=100, response_tail=400)
    assert decode_steps(64, 64, lengths) == 400
    assert decode_steps(256, 64, lengths) == 400 + 100 * 3
    with pytest.raises(ValueError, match="KV cache holds none"):
        decode_steps(8, 0, lengths)


def test_a_longer_tail_costs_weight_reads_and_the_step_overhead():
    lengths = Lengths(prompt=10, response_mean=100, response_tail=100, response_cv=0.0)
    longer = replace(lengths, response_tail=300)
    eff = replace(PERFECT, decode_step_overhead=0.01)
    base = generation_seconds(MODEL, lengths, sequences=4, replicas=1, tp=1, concurrent=4, device=DEVICE, eff=eff)
    tail = generation_seconds(MODEL, longer, sequences=4, replicas=1, tp=1, concurrent=4, device=DEVICE, eff=eff)
    assert tail["decode"] - base["decode"] == pytest.approx(200 * (2e9 / 1e11 + 0.01))


def test_concurrent_sequences_are_capped_by_the_kv_cache_and_max_num_seqs():
    lengths = Lengths(prompt=100, response_mean=900, response_tail=1000)
    # 4e4 B/token x 1000 tokens = 4e7 B per sequence: 4e9 B hold 100
    assert concurrent_sequences(512, 1024, 4e9, MODEL, 1, lengths) == pytest.approx(100)
    assert concurrent_sequences(512, 64, 4e9, MODEL, 1, lengths) == 64
    assert concurrent_sequences(32, 1024, 4e9, MODEL, 1, lengths) == 32
    assert concurrent_sequences(512, 1024, 4e9, MODEL, 2, lengths) == pytest.approx(200)  # TP2 halves k per rank


def test_pipeline_bubble_is_pp_minus_one_over_micro_batches():
    assert pipeline_bubble(1, 8) == 0
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        pipeline_bubble(2, 0)


def test_ring_collectives_move_two_r_minus_one_over_r():
    assert ring_seconds(1e9, 1, 1e9, 1.0) == 0
    assert ring_seconds(1e9, 4, 1e9, 1.0) == pytest.approx(1.5)
    assert ring_seconds(1e9, 4, 1e9, 0.5, all_reduce=False) == pytest.approx(1.5)


def test_update_is_three_forward_passes_at_mfu_train_and_the_bubble_stretches_it():
    lengths = Lengths(prompt=100, response_mean=300, response_tail=300, response_cv=0.0)
    one = TrainLayout(tensor=1, pipeline=1, data=1, gpus_per_node=8)
    flops = forward_flops(MODEL, lengths, 64)
    eff = replace(PERFECT, mfu_train=0.5)
    seconds = update_seconds(MODEL, lengths, 64, one, DEVICE, eff, epochs=1, optimizer_steps=1, micro_batches=4,
                             distributed_optimizer=False)
    assert seconds == pytest.approx(3 * flops / (1e12 * 0.5))
    assert update_seconds(MODEL, lengths, 64, one, DEVICE, eff, epochs=2, optimizer_steps=1, micro_batches=4,
                          distributed_optimizer=False) == pytest.approx(2 * seconds)
    assert update_seconds(MODEL, lengths, 64, one, DEVICE, eff, epochs=1, optimizer_steps=1, micro_batches=4,
                          distributed_optimizer=False, recompute=True) == pytest.approx(4 / 3 * seconds)
    # PP2 on twice the GPUs: half the compute, stretched by 1 + 1/4
    pp2 = TrainLayout(tensor=1, pipeline=2, data=1, gpus_per_node=8)
    assert update_seconds(MODEL, lengths, 64, pp2, DEVICE, eff, epochs=1, optimizer_steps=1, micro_batches=4,
                          distributed_optimizer=False) == pytest.approx(seconds / 2 * 1.25)


def test_data_parallel_gradients_cross_nodes_when_the_job_spans_them():
    lengths = Lengths(prompt=100, response_mean=300, response_tail=300, response_cv=0.0)
    in_node = TrainLayout(tensor=1, pipeline=1, data=8, gpus_per_node=8)
    across = TrainLayout(tensor=1, pipeline=1, data=16, gpus_per_node=8)
    compute_free = replace(DEVICE, peak_flops=1e30)
    kw = dict(epochs=1, optimizer_steps=1, micro_batches=1, distributed_optimizer=False)
    # all-reduce of 4 bytes x 1e9 parameters: 2 x 7/8 x 4e9 / 1e10 and 2 x 15/16 x 4e9 / 1e9
    assert update_seconds(MODEL, lengths, 64, in_node, compute_free, PERFECT, **kw) == pytest.approx(0.7)
    assert update_seconds(MODEL, lengths, 64, across, compute_free, PERFECT, **kw) == pytest.approx(7.5)


def test_the_slowest_data_parallel_rank_sets_the_pace():
    lengths = Lengths(prompt=0, response_mean=100, response_tail=400, response_cv=0.5)
    assert rank_imbalance(lengths, 64, 1) == 1
    assert rank_imbalance(lengths, 64, 2) == pytest.approx(1 + 0.5 / 8 * math.sqrt(2 * math.log(2)))
    assert rank_imbalance(lengths, 16, 64) > rank_imbalance(lengths, 64, 16) > 1
    layout = TrainLayout(tensor=1, pipeline=1, data=4, gpus_per_node=8)
    flat = replace(lengths, response_cv=0.0)
    assert forward_pass_seconds(MODEL, lengths, 64, layout, DEVICE, PERFECT, micro_batches=1) > \
        forward_pass_seconds(MODEL, flat, 64, layout, DEVICE, PERFECT, micro_batches=1)


def test_async_step_is_the_slower_side_plus_sync_and_colocated_the_sum():
    phases = {"generation": 30.0, "prm_scoring": 5.0, "old_logprobs": 10.0, "update": 20.0, "weight_sync": 2.0}
    colocated = combine(dict(phases), asynchronous=False, gpus=8)
    assert colocated.seconds == 67
    assert colocated.share("generation") == pytest.approx(30 / 67)
    asynchronous = combine(dict(phases), asynchronous=True, gpus=8)
    assert asynchronous.rollout_seconds == 35 and asynchronous.train_seconds == 30
    assert asynchronous.seconds == 37
    slower_train = combine({**phases, "update": 40.0}, asynchronous=True, gpus=8)
    assert slower_train.seconds == 52
    assert colocated.gpu_hours(100) == pytest.approx(67 * 100 * 8 / 3600)


def test_save_is_amortised_over_save_every():
    # 1e9 parameters x 14 bytes over 1e9 B/s on one node, every 10 steps
    assert save_seconds(MODEL, DEVICE, nodes=1, save_every=10) == pytest.approx(1.4)
    assert save_seconds(MODEL, DEVICE, nodes=2, save_every=10) == pytest.approx(0.7)
    assert save_seconds(MODEL, DEVICE, nodes=1, save_every=0) == 0


def test_efficiency_and_lengths_name_the_bad_field():
    with pytest.raises(ValueError, match="Efficiency.mfu_train"):
        Efficiency(mfu_train=1.5)
    with pytest.raises(ValueError, match="decode_step_overhead"):
        Efficiency(decode_step_overhead=-1)
    with pytest.raises(ValueError, match="response_mean"):
        Lengths(prompt=10, response_mean=500, response_tail=100)


def test_device_profiles():
    assert device_profile("h200") is PROFILES["H200"]
    assert device_profile("NVIDIA H20") is PROFILES["H20"]
    assert device_profile("NVIDIA A100-SXM4-80GB") is PROFILES["A100"]
    assert device_profile("NVIDIA H100 80GB HBM3") is PROFILES["H100"]
    assert PROFILES["H20"].peak_flops < PROFILES["A100"].peak_flops < PROFILES["H100"].peak_flops
    assert PROFILES["H20"].memory_bandwidth > PROFILES["H100"].memory_bandwidth
    with pytest.raises(ConfigError, match="--device 'TPU'"):
        device_profile("TPU")
    cpu = cpu_profile(4e11, 1e10)
    assert cpu.peak_flops == 4e11 and cpu.intra_node_bandwidth == 2e9
    with pytest.raises(ConfigError, match="peak_flops"):
        cpu_profile(0, 1e10)


def test_cli_prints_seconds_per_phase_and_gpu_hours_for_a_shipped_config(capsys):
    from grpo_mega.cli import main

    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--steps", "500"]) == 0
    out = capsys.readouterr().out
    assert "step time on 8 x H100" in out and "500 steps:" in out and "GPU-hours" in out
    for phase in ("generation", "old_logprobs", "update", "weight_sync", "save"):
        assert any(line.startswith(phase) for line in out.splitlines()), phase
    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--steps", "500", "--device", "H20",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["step_time"]
    assert report["device"]["name"] == "H20" and report["steps"] == 500
    assert sum(p["share"] for p in report["phases"].values()) == pytest.approx(1)
    assert report["gpu_hours"] == pytest.approx(report["step_seconds"] * 500 * 8 / 3600)
    # a slower device: a longer step
    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--steps", "500", "--device", "B200",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time"]["step_seconds"] < report["step_seconds"]


def test_cli_prices_the_prm_one_off_and_the_async_overlap(capsys):
    from grpo_mega.cli import main

    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo_prm.yaml", "--steps", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["step_time"]
    assert {"prm_scoring", "generation", "update"} <= set(report["phases"])
    assert set(report["one_off"]) == {"prm_labels", "prm_training"}
    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo_async.yaml", "--steps", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["step_time"]
    assert report["asynchronous"] is True
    assert report["step_seconds"] == pytest.approx(
        max(report["rollout_seconds"], report["train_seconds"]) + report["phases"]["weight_sync"]["seconds"]
        + report["phases"]["save"]["seconds"])


def test_cli_names_a_bad_assumption(capsys):
    from grpo_mega.cli import main

    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--steps", "10",
                 "--mean-response", "9999"]) == 2
    assert "--mean-response 9999" in capsys.readouterr().err
    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--steps", "0"]) == 2
    assert "--steps 0" in capsys.readouterr().err


def test_the_hf_rollout_engine_generates_on_every_model_parallel_group_at_once(capsys):
    """Without vLLM (rollout.engine=hf) each TP x PP group generates its DP share of the rows in one batch: on half
    the devices each group has twice the rows, a longer generation where the device's work sets the pace (the CPU,
    where host and device are one); on a GPU the eager loop's per-step fixed cost sets it at this size (the H200
    fit: 5.4 ms per layer and step), so fewer GPUs are never faster. The CPU profile names its fitted factors."""
    from grpo_mega.cli import main

    base = ["plan", "--config", "configs/qwen2.5-math-1.5b_grpo.yaml", "--steps", "10", "--json", "rollout.engine=hf"]
    seconds = {}
    for device in ("H100", "CPU"):
        for gpus in (8, 4):
            assert main([*base, "--device", device, "--gpus-per-node", str(gpus)]) in (0, 1)
            timed = json.loads(capsys.readouterr().out)["step_time"]
            seconds[device, gpus] = timed["phases"]["generation"]["seconds"]
    assert seconds["CPU", 4] > 1.2 * seconds["CPU", 8]
    assert seconds["H100", 4] >= seconds["H100", 8]
    assert timed["device"]["name"] == "CPU" and any("fitted on this project's 2-core CPU" in n for n in timed["notes"])


def test_the_step_time_says_where_the_one_gpu_measurement_falsified_it(tmp_path, capsys):
    """The first GPU run (0.5B, hf rollouts, one H200) was 24x slower than the model: a plan of the hf engine on a
    GPU, of a small policy on a GPU, and of tree sampling (not modelled) says so; vLLM at 7B does not."""
    from grpo_mega.cli import main

    base = ["plan", "--config", "configs/qwen2.5-math-1.5b_grpo.yaml", "--steps", "10", "--json"]
    assert main([*base, "rollout.engine=hf", "process_reward.source=tree", "algorithm.supervision=process",
                 "tree_rollout.branching=[4,2]"]) in (0, 1)
    notes = json.loads(capsys.readouterr().out)["step_time"]["notes"]
    assert any(note.startswith("rollout.engine=hf on a GPU") and "gpu_check_h200.json" in note for note in notes)
    assert any(note.startswith("process_reward.source=tree") for note in notes)
    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--steps", "10", "--json"]) in (0, 1)
    notes = json.loads(capsys.readouterr().out)["step_time"]["notes"]
    assert not any("gpu_check_h200" in note or "tree" in note for note in notes)
    assert main([*base, "rollout.engine=hf", "--device", "CPU"]) in (0, 1)
    notes = json.loads(capsys.readouterr().out)["step_time"]["notes"]
    assert not any("gpu_check_h200" in note for note in notes)


def test_the_quickstart_config_is_priced_on_the_cpu_its_hardware_line_names(capsys):
    """Issue 79 item 10: `plan --steps` of the quickstart config priced "2 x H100" despite its hardware line (this
    project's CPU), and `--device CPU` reported GPU-hours."""
    from grpo_mega.cli import main
    from grpo_mega.plan.settings import documented_device

    assert main(["plan", "--config", "configs/quickstart_grpo.yaml", "--steps", "10"]) in (0, 1)
    out = capsys.readouterr().out
    assert "step time on 2 CPU processes" in out and "CPU-hours" in out and "GPU-hours" not in out
    assert main(["plan", "--config", "configs/quickstart_grpo.yaml", "--steps", "10", "--device", "H100"]) in (0, 1)
    assert "step time on 2 x H100" in capsys.readouterr().out
    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--steps", "10", "--device", "cpu"]) in (0, 1)
    out = capsys.readouterr().out
    assert "step time on 8 CPU processes" in out and "CPU-hours" in out and "GPU-hours" not in out
    # the device a hardware line names: the first profile after its memory, none for a line that names none
    assert documented_device("configs/qwen2.5-math-7b_grpo.yaml") == "H100"
    assert documented_device("configs/small-model_grpo.yaml") is None  # "(one 80 GB GPU; on a CPU add --device CPU"
