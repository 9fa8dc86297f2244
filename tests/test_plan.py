"""`grpo-mega plan` on its own (no engine): what it reads from the config, the micro-batch it plans for, the verdict
and exit status, and every shipped real-model config fitting its documented hardware with 10 % headroom in every
phase. The checks against the engine's real allocations are in test_plan_engine.py."""

import json
from types import SimpleNamespace

import pytest

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate

REAL_CONFIGS = ["qwen2.5-math-1.5b_grpo", "qwen2.5-math-7b_grpo", "qwen2.5-math-7b_grpo_prm",
                "qwen2.5-math-7b_grpo_2node", "llama-3.1-8b_grpo", "llama-3.1-8b_grpo_2node",
                "qwen2.5-math-7b_grpo_async", "qwen2.5-math-7b_grpo_prm_async", "qwen3-8b_grpo",
                "qwen3-30b-a3b_grpo_2node", "qwen2.5-math-7b_grpo_implicit", "qwen2.5-math-7b_grpo_lora"]
# The PRM config points at a downloaded folder; plan it with the architecture shipped in configs/models.
PRM_ARCHITECTURE = "process_reward.prm=configs/models/qwen2.5-math-prm-7b"


def _load(name, *overrides):
    return load_config(GRPOConfig, f"configs/{name}.yaml", [PRM_ARCHITECTURE, *overrides] if "prm" in name
                       else list(overrides), validate)


def _plan(name, *overrides, **assume):
    from grpo_mega.plan import plan_config
    from grpo_mega.plan.settings import documented_hardware

    hardware = documented_hardware(f"configs/{name}.yaml")
    assert hardware is not None, f"configs/{name}.yaml has no '# hardware:' line"
    return plan_config(_load(name, *overrides), gpus_per_node=hardware.gpus_per_node,
                       gpu_memory_gib=hardware.gpu_memory_gib, nodes=hardware.nodes, assume=assume)


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_shipped_config_fits_its_documented_hardware(name):
    """Every phase leaves >= 10 % of the GPU free, at the config's rollout layout and with vLLM at the policy's TP
    (the two rollout.tensor_parallel choices), and vLLM's KV cache holds at least one full-length sequence."""
    cfg = _load(name)
    for rollout_tp in sorted({cfg.rollout.tensor_parallel or cfg.parallel.tensor, cfg.parallel.tensor}):
        plan = _plan(name, f"rollout.tensor_parallel={rollout_tp}")
        assert plan.fits, (rollout_tp, plan.problems)
        assert {p.name for p in plan.phases} >= {"update", "generation", "save"}
        assert all(plan.headroom(p) >= 0.10 for p in plan.phases)
        assert plan.vllm.sequences_held >= 1
    if "prm" in name:
        assert plan.prm and plan.prm > 0 and plan.phase("prm_scoring").total > plan.phase("generation").total


def test_lora_fits_the_7b_on_2_gpus_where_full_training_does_not():
    """model.lora: the frozen base has no gradients or optimizer state and the KL reference is the base itself."""
    lora = _plan("qwen2.5-math-7b_grpo_lora", "algorithm.use_kl_loss=true")
    full = _plan("qwen2.5-math-7b_grpo_lora", "algorithm.use_kl_loss=true", "model.lora.rank=0")
    assert lora.fits and not full.fits
    update, full_update = lora.phase("update"), full.phase("update")
    assert update.items["reference (KL)"] == 0 and full_update.items["reference (KL)"] > 0
    assert update.items["optimizer"] < full_update.items["optimizer"] / 100
    assert update.items["gradients"] < full_update.items["gradients"] / 100
    assert update.items["parameters"] >= full_update.items["parameters"]  # the base, plus the adapters


def test_the_implicit_prm_is_a_second_trained_policy_in_every_phase_and_shares_the_kl_reference():
    """process_reward.source=implicit: the implicit PRM's weights, gradients and optimizer state (the policy's own
    figures: same model and layout) in every phase, and its reference, unless the KL reference serves as it."""
    outcome = _plan("qwen2.5-math-7b_grpo_implicit", "algorithm.supervision=outcome", "process_reward.source=function")
    implicit = _plan("qwen2.5-math-7b_grpo_implicit")
    shared = _plan("qwen2.5-math-7b_grpo_implicit", "algorithm.use_kl_loss=true")
    key, reference = "implicit PRM (weights, gradients, optimizer)", "implicit PRM reference"
    for name in ("update", "generation", "save"):
        extra = implicit.phase(name).total - outcome.phase(name).total
        assert implicit.phase(name).items[key] == implicit.policy.total > 0
        assert extra == implicit.policy.total + implicit.phase(name).items[reference], name
    assert implicit.phase("update").items[reference] > 0
    # with KL on, the KL reference is the implicit PRM's: one copy, counted once
    assert shared.phase("update").items[reference] == 0
    assert shared.phase("update").items["reference (KL)"] == implicit.phase("update").items[reference]
    assert shared.phase("update").total == implicit.phase("update").total


def test_offload_during_rollout_takes_the_implicit_prms_training_state_off_the_gpu_while_vllm_generates():
    """parallel.offload_during_rollout: the implicit PRM's gradients and optimizer state leave with the policy's
    (its weights stay); it trains after the rollout stage, so the update holds it whole. Before dynamic sampling it
    trains inside the rollout stage: generation then holds it whole."""
    key = "implicit PRM (weights, gradients, optimizer)"
    kept = _plan("qwen2.5-math-7b_grpo_implicit")
    off = _plan("qwen2.5-math-7b_grpo_implicit", "parallel.offload_during_rollout=true")
    inside = _plan("qwen2.5-math-7b_grpo_implicit", "parallel.offload_during_rollout=true",
                   "implicit_prm.before_dynamic_sampling=true")
    assert kept.phase("generation").items[key] == kept.policy.total
    assert off.phase("generation").items[key] == off.policy.params < off.policy.total
    assert off.phase("update").items[key] == off.policy.total
    assert inside.phase("generation").items[key] == inside.policy.total


def test_async_rollouts_keep_the_implicit_prm_on_the_training_gpus():
    """rollout.mode=async with the implicit PRM: it trains where the policy trains, so the update and the save
    count it and generation on the rollout GPUs does not."""
    split = _plan("qwen2.5-math-7b_grpo_implicit", "rollout.mode=async", "rollout.async_ranks=4",
                  "rollout.tensor_parallel=1", "algorithm.rollout_is=tis", "parallel.tensor=4", "parallel.pipeline=1",
                  "rollout.gpu_memory_utilization=0.5")
    key = "implicit PRM (weights, gradients, optimizer)"
    for name in ("update", "save"):
        assert split.phase(name).items[key] == split.policy.total > 0, name
    assert split.phase("generation").items.get(key, 0) == 0


def test_async_rollouts_put_vllm_and_the_prm_on_the_rollout_gpus_and_the_policy_on_the_others():
    """rollout.mode=async: data parallelism counts the training GPUs only; the update and the save hold no vLLM
    and no PRM, generation and PRM scoring hold no policy state; vLLM's replicas are the rollout GPUs'."""
    colocated = _plan("qwen2.5-math-7b_grpo_prm")
    split = _plan("qwen2.5-math-7b_grpo_prm", "rollout.mode=async", "rollout.async_ranks=4", "rollout.tensor_parallel=1",
                  "algorithm.rollout_is=tis", "rollout.gpu_memory_utilization=0.5")
    assert (colocated.data, split.data) == (2, 1)
    assert split.vllm.replicas == 4
    for name in ("update", "save"):
        items = split.phase(name).items
        assert items.get("PRM weights", 0) == 0 and not any(key.startswith("vLLM") for key in items)
    for name in ("generation", "prm_scoring"):
        items = split.phase(name).items
        assert items["PRM weights"] > 0 and "parameters" not in items and "optimizer" not in items
    # the PRM runs at TP1 on a rollout GPU: a whole copy, 4x its TP4 share
    assert split.phase("generation").items["PRM weights"] == pytest.approx(4 * colocated.prm, rel=0.02)
    assert any("rollout.mode=async" in note for note in split.notes)


def test_seven_b_static_bytes_are_eighteen_bytes_a_parameter_and_shard_with_the_distributed_optimizer():
    """bf16 weights (2) + fp32 gradient buffer (4) + fp32 master (4) + Adam moments (8) per parameter of the rank;
    the distributed optimizer divides the last 12 by DP (up to megatron's padding)."""
    plan = _plan("qwen2.5-math-7b_grpo", distributed_optimizer="false")
    elements = plan.parameters
    assert plan.policy.params == 2 * elements  # norm weights included: bf16 like every other weight
    assert plan.policy.grads == 4 * elements  # one fp32 gradient buffer
    assert plan.policy.optimizer == 12 * elements
    sharded = _plan("qwen2.5-math-7b_grpo")  # the default at DP > 1
    assert sharded.settings.distributed_optimizer
    assert sharded.policy.optimizer == pytest.approx(plan.policy.optimizer / plan.data, rel=1e-3)
    assert sharded.phase("update").total < plan.phase("update").total


def test_settings_read_from_the_config_when_it_has_them_else_the_engine_today():
    from grpo_mega.plan.settings import memory_settings

    today = SimpleNamespace(parallel=SimpleNamespace(tensor=4))
    assert memory_settings(today, 2) == memory_settings(today, 2, {})  # all off
    assert not memory_settings(today, 2).distributed_optimizer
    later = SimpleNamespace(parallel=SimpleNamespace(tensor=4, distributed_optimizer=None, sequence_parallel=None,
                                                     recompute="full", offload_during_rollout=True))
    settings = memory_settings(later, 2)
    assert (settings.distributed_optimizer, settings.sequence_parallel, settings.recompute,
            settings.offload_during_rollout) == (True, True, "full", True)
    assert not memory_settings(later, 1).distributed_optimizer  # automatic: only when DP > 1
    assumed = memory_settings(today, 2, {"distributed_optimizer": "true", "recompute": "selective"})
    assert assumed.distributed_optimizer and assumed.recompute == "selective"
    assert assumed.assumed == ("distributed_optimizer", "recompute")
    with pytest.raises(ConfigError, match="unknown setting"):
        memory_settings(today, 2, {"distributed_optimiser": "true"})
    with pytest.raises(ConfigError, match="true or false"):
        memory_settings(today, 2, {"distributed_optimizer": "maybe"})


def test_rollout_tensor_parallel_defaults_to_the_policy_tp_when_unset():
    from grpo_mega.plan.settings import rollout_tensor_parallel

    for value, expected in ((None, 4), (0, 4), (2, 2)):
        cfg = SimpleNamespace(rollout=SimpleNamespace(tensor_parallel=value), parallel=SimpleNamespace(tensor=4))
        assert rollout_tensor_parallel(cfg) == expected


def test_largest_micro_batch_on_the_shared_prompt_and_row_paths():
    from grpo_mega.plan.build import update_tokens

    cfg = load_config(GRPOConfig, "configs/quickstart_grpo.yaml", ["model.hf_config=x", "data.train_file=x"])
    # prompt 64, response 64, G 8, budget 1024: one packed group of 64 + 8 x 64 tokens, its 8 rows in the head
    assert update_tokens(cfg)[:2] == (576, 1024)
    cfg.parallel.share_prompt_prefix = False
    assert update_tokens(cfg)[:2] == (1024, 1024)  # 8 rows of 128
    cfg.parallel.share_prompt_prefix, cfg.parallel.max_tokens_per_micro_batch = True, 300
    assert update_tokens(cfg)[:2] == (64 + 3 * 64, 3 * 128)  # a group larger than the budget is split


def test_documented_hardware_line(tmp_path):
    from grpo_mega.plan.settings import documented_hardware

    path = tmp_path / "c.yaml"
    path.write_text("# a config\n# hardware: 2 nodes x 8 GPUs x 79.6 GiB (H100 80GB)\nparallel:\n  tensor: 4\n")
    hardware = documented_hardware(path)
    assert (hardware.nodes, hardware.gpus_per_node, hardware.gpu_memory_gib, hardware.world_size) == (2, 8, 79.6, 16)
    path.write_text("parallel:\n  tensor: 4\n")
    assert documented_hardware(path) is None


def test_cli_exits_non_zero_naming_the_phase_when_the_config_does_not_fit(capsys):
    from grpo_mega.cli import main

    config = "configs/qwen2.5-math-7b_grpo.yaml"
    assert main(["plan", "--config", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and set(report["phases"]) == {"update", "generation", "save"}
    assert report["layout"] == {"tensor": 4, "pipeline": 1, "data": 2, "dtype": "bfloat16"}
    # 40 GiB GPUs: the update no longer fits
    assert main(["plan", "--config", config, "--gpu-memory-gib", "40"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "update:" in out and "max_tokens_per_micro_batch" in out
    assert main(["plan", "--config", config, "--gpus-per-node", "6"]) == 2  # TP4 does not divide 6 GPUs
    assert "does not divide" in capsys.readouterr().err


def test_prm_without_a_config_json_is_reported_unknown(capsys, tmp_path):
    from grpo_mega.cli import main

    args = ["plan", "--config", "configs/qwen2.5-math-7b_grpo_prm.yaml", f"process_reward.prm={tmp_path}"]
    code = main(args)
    out = capsys.readouterr().out
    assert "unknown" in out.split("PRM weights")[1].splitlines()[0]
    # what was not counted is named, and the verdict is no FITS: exit 1 unless the user accepts it
    assert code == 1 and "NOT COUNTED: PRM unknown" in out and "UNKNOWN:" in out and "FITS:" not in out
    assert f"process_reward.prm={tmp_path}: holds no config.json" in out
    assert main([*args, "--accept-unknown"]) == 0
    assert "FITS:" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["qwen2.5-math-7b_grpo_prm", "qwen2.5-math-7b_grpo_prm_async"])
def test_a_shipped_prm_config_plans_with_the_prm_shape_its_header_names(capsys, name):
    """Its process_reward.prm is a placeholder for the downloaded PRM; the header's '# plan-prm:' folder (shipped
    in configs/models) gives the PRM's shape until then, and a note says so."""
    from grpo_mega.cli import main

    assert main(["plan", "--config", f"configs/{name}.yaml", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    with_shape = _plan(name)  # process_reward.prm=configs/models/qwen2.5-math-prm-7b given
    assert report["fits"] and report["unknown"] == [] and report["prm"] == with_shape.prm > 0
    assert ("PRM: process_reward.prm=checkpoints/Qwen2.5-Math-PRM-7B is not here; planned with the shape the config's "
            "header names (configs/models/qwen2.5-math-prm-7b)") in report["notes"]
    assert not any(note.startswith("PRM:") for note in with_shape.notes)  # a PRM that is there is planned as it is


def test_a_missing_prm_folder_without_a_shape_is_named_as_missing(capsys, tmp_path):
    config = tmp_path / "prm.yaml"
    config.write_text("\n".join(line for line in open("configs/qwen2.5-math-7b_grpo_prm.yaml").read().splitlines()
                                if not line.startswith("# plan-prm:")))
    from grpo_mega.cli import main

    assert main(["plan", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "NOT COUNTED: PRM unknown: process_reward.prm=checkpoints/Qwen2.5-Math-PRM-7B: no such folder" in out


def test_documented_shape_lines(tmp_path):
    from grpo_mega.plan.settings import documented_shape

    path = tmp_path / "c.yaml"
    path.write_text("# hardware: 1 node x 8 GPUs x 79.6 GiB\n# plan-prm: configs/models/x-prm  (its shape)\n"
                    "# plan-model: configs/models/x\na: 1\n")
    assert documented_shape(path, "prm") == "configs/models/x-prm"
    assert documented_shape(path, "model") == "configs/models/x"
    path.write_text("a: 1  # plan-prm: elsewhere\n# plan-model:\n# hardware: 1 node x 8 GPUs x 79.6 GiB\n")
    assert documented_shape(path, "prm") is None and documented_shape(path, "model") is None


def test_the_plan_assumes_the_vllm_settings_the_engine_passes(capsys):
    """The planner and the engine read one definition (grpo_mega.rollout.vllm_settings): the configured limits,
    else vLLM's defaults for the GPU; enforce_eager drops the CUDA-graph pool from every phase."""
    default = _plan("qwen2.5-math-7b_grpo")
    assert (default.vllm.limits.max_num_seqs, default.vllm.limits.max_num_batched_tokens) == (1024, 16384)
    assert default.phase("update").items["vLLM CUDA graphs"] == default.vllm.cuda_graphs > 0
    set_here = _plan("qwen2.5-math-7b_grpo", "rollout.max_num_seqs=128", "rollout.max_num_batched_tokens=4096",
                     "rollout.enforce_eager=true")
    assert (set_here.vllm.limits.max_num_seqs, set_here.vllm.limits.max_num_batched_tokens) == (128, 4096)
    assert set_here.vllm.workspace < default.vllm.workspace and set_here.vllm.cuda_graphs == 0
    assert set_here.phase("update").total < default.phase("update").total
    assert set_here.vllm.kv_cache > default.vllm.kv_cache  # the budget is the same; graphs and workspace shrank
    from grpo_mega.cli import main

    assert main(["plan", "--config", "configs/qwen2.5-math-7b_grpo.yaml", "--gpu-name", "A100"]) == 0
    out = capsys.readouterr().out
    assert "max_num_seqs=256 max_num_batched_tokens=8192 enforce_eager=False" in out


def test_the_save_phase_counts_the_distributed_optimizers_gather():
    """The save comes after the sync (vLLM awake), with the optimizer state on the device; the distributed
    optimizer's fully_reshardable save gathers its fp32 state per bucket on the GPU and keeps the stage's three
    fp32 state tensors in host RAM on every rank."""
    sharded = _plan("qwen2.5-math-7b_grpo")
    save, generation = sharded.phase("save"), sharded.phase("generation")
    assert save.items["vLLM KV cache"] == generation.items["vLLM KV cache"] > 0
    assert save.items["optimizer"] == sharded.policy.optimizer and save.items["checkpoint gather"] > 0
    assert sharded.save_host.per_rank >= 12 * sharded.parameters
    assert sharded.save_host.per_node == 8 * sharded.save_host.per_rank
    plain = _plan("qwen2.5-math-7b_grpo", distributed_optimizer="false")
    assert plain.phase("save").items["checkpoint gather"] == 0
    assert plain.save_host.per_rank < sharded.save_host.per_rank
    offloaded = _plan("qwen2.5-math-7b_grpo", offload_during_rollout="true")
    assert offloaded.phase("generation").items["optimizer"] == 0 < offloaded.phase("save").items["optimizer"]


def test_stage_counts_follow_megatrons_layout_and_the_subprocess_path_gives_the_same(monkeypatch):
    """PP2 splits the layers (the first stage holds the embedding, the last the final norm and, tied, its own copy of
    the embedding); TP2 halves the matrices; a process with a process group or a GPU
    (the GPU check) counts in a subprocess with the same result."""
    from grpo_mega.plan import counts

    hf = json.loads(open("configs/models/qwen2.5-math-1.5b/config.json").read())  # tied embeddings
    whole, split, tp2 = counts.count_stage_params([
        counts.ModelRequest(hf, 1, 1, "float32"), counts.ModelRequest(hf, 1, 2, "float32"),
        counts.ModelRequest(hf, 2, 1, "float32")])
    n_whole = sum(p.numel for p in whole[0])
    embedding = next(p.numel for p in whole[0][0:1])
    first, last = split
    # megatron flags both copies of the tied embedding (each gets a bucket of its own with the distributed optimizer)
    assert [p.name for p in first if p.shared_embedding] == ["embedding.word_embeddings.weight"]
    assert [p.name for p in last if p.shared_embedding] == ["output_layer.weight"]
    assert sum(p.numel for p in first) + sum(p.numel for p in last) == n_whole + embedding
    assert sum(p.numel for p in tp2[0]) < 0.51 * n_whole
    monkeypatch.setattr(counts, "_can_build_here", lambda: False)
    assert counts.count_stage_params([counts.ModelRequest(hf, 1, 2, "float32")]) == [split]


def test_prm_read_from_an_hf_folder_or_a_grpo_mega_checkpoint(tmp_path, monkeypatch):
    """An HF PRM folder's config.json; for a grpo-mega checkpoint / run directory (no config.json), the config.json
    of the model.hf_config saved with it; None (reported unknown) when it is neither."""
    import grpo_mega.checkpoint.source as source
    from grpo_mega.plan.build import _prm_hf_config

    hf = json.loads(open("configs/models/qwen2.5-math-prm-7b/config.json").read())
    assert _prm_hf_config("configs/models/qwen2.5-math-prm-7b") == hf
    assert _prm_hf_config(str(tmp_path)) is None  # no config.json, no checkpoint
    saved = {"model": {"hf_config": "configs/models/qwen2.5-math-prm-7b"}}
    monkeypatch.setattr(source, "checkpoint_config", lambda path: saved)
    assert _prm_hf_config(str(tmp_path)) == hf


def test_the_deepspeed_engine_is_not_planned():
    """grpo-mega plan models the megatron engine only; with LoRA its message says the adapter count differs."""
    from grpo_mega.plan import plan_config

    cfg = GRPOConfig()
    cfg.engine = "deepspeed"
    with pytest.raises(ConfigError, match="plan with engine=megatron$"):
        plan_config(cfg, gpus_per_node=8, gpu_memory_gib=80)
    cfg.model.lora.rank = 16
    with pytest.raises(ConfigError, match="one A per fused linear, where peft's on DeepSpeed have one per q, k, v"):
        plan_config(cfg, gpus_per_node=8, gpu_memory_gib=80)
