"""Training checkpoints: exact resume after a crash, resume at TP=2 / PP=2, broken folders never loaded, keep_last.

One scenario is shared by most tests (module fixture): a straight 4-step run at TP=1, and a run that saves
after steps 1 and 2 (keep_last=1), trains step 3 and dies while saving it (after its tensors are on disk,
before the checkpoint is published). Resuming then continues exactly where the straight run went, at TP=1;
at TP=2 (which saves again) and then at PP=2 from that TP=2 checkpoint, it follows the straight run to 1e-5.
"""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from checkpoint_layout import common_state_range
from dist_utils import run_distributed, tiny_qwen2_config

SEED = 11
TOTAL_STEPS = 4
CRASH_EXIT_CODE = 17
CONFIG = {"parallel": {"tensor": 1, "pipeline": 1}, "trainer": {"total_steps": TOTAL_STEPS}}


def _hf_config():
    return tiny_qwen2_config(tied=True, num_layers=2)


def _engine(total_steps=TOTAL_STEPS, **optim_settings):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    settings = dict(lr=2e-2, weight_decay=0.1, clip_grad=1.0, warmup_steps=1, decay_style="cosine")
    optim = OptimConfig(**{**settings, **optim_settings})
    return build_policy_engine(_hf_config(), optim=optim, total_steps=total_steps, max_tokens_per_micro_batch=40)


def _rows(step):
    """The batch of trainer step ``step``: a pure function of the step, like a resumable data loader."""
    generator = torch.Generator().manual_seed(1000 + step)
    lengths = torch.tensor([12, 7, 9, 5, 12, 10])
    input_ids = torch.randint(0, _hf_config().vocab_size, (6, 12), generator=generator)
    attention_mask = (torch.arange(12) < lengths[:, None]).long()
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    advantages = torch.randn(6, 1, generator=generator).expand(6, 12).contiguous()
    # Old log-probs off the current policy by up to 0.3 nats, so ratios and clipping take part.
    policy_shift = (torch.rand(6, 12, generator=generator) - 0.5) * 0.6
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, advantages=advantages)
    return batch, policy_shift


def _probe_logprobs(engine):
    batch, _ = _rows(99)
    logprobs, _ = engine.forward_logprobs({key: batch[key] for key in ("input_ids", "attention_mask")})
    return logprobs * batch["attention_mask"]


def _rng_draws():
    """One draw from every stream a step may use (the megatron tracker's model-parallel stream included)."""
    import random

    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker_draw = torch.rand(1).item()
    return [random.random(), float(np.random.rand()), torch.rand(1).item(), tracker_draw]


def _grpo_update(engine, step) -> dict:
    """One GRPO update of ``engine`` on step ``step``'s rows (old log-probs shifted off the policy), then one
    learning-rate step (one optimizer step per trainer step here); the engine's metrics. Shared by the optimizer
    resume tests (test_distributed_optimizer, test_group_step_adam_resume)."""
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    batch, policy_shift = _rows(step)
    logprobs, _ = engine.forward_logprobs(batch)
    batch["old_logprobs"] = logprobs + policy_shift
    metrics = engine.train_step(batch, grpo_loss_fn(GRPOLossSettings()))
    engine.lr_schedule_step()
    return metrics


def _train_step(engine, step):
    metrics = _grpo_update(engine, step)
    return {"loss": metrics["loss"], "lr": metrics["lr"], "rng": _rng_draws()}


def _params(engine):
    return {name: p.detach().clone() for name, p in engine.stage.named_parameters()}


def _straight_run():
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=SEED, device="cpu")
    engine = _engine()
    steps, probes = [], []
    for step in range(1, TOTAL_STEPS + 1):
        steps.append(_train_step(engine, step))
        probes.append(_probe_logprobs(engine))
    return {"steps": steps, "probes": probes, "params": _params(engine)}


def _run_saving_then_crash(run_dir):
    import os

    import grpo_mega.checkpoint.training as training
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=SEED, device="cpu")
    engine = _engine()
    manager = CheckpointManager(run_dir, keep_last=1)
    for step in (1, 2):
        _train_step(engine, step)
        extra = {"prompts_consumed": 6 * step, "order": torch.arange(step + 3)}
        manager.save(engine, step, extra_state=extra, config=CONFIG)
    _train_step(engine, 3)
    write_tensors = training.dist_checkpointing.save

    def write_then_die(*args, **kwargs):
        write_tensors(*args, **kwargs)
        os._exit(CRASH_EXIT_CODE)  # killed: no barrier, no completion marker, no rename

    training.dist_checkpointing.save = write_then_die
    manager.save(engine, 3, extra_state={"prompts_consumed": 18}, config=CONFIG)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _resume_at(run_dir, save_dir, load_model_only_too):
    """Resume from ``run_dir`` at megatron's current layout, save again into ``save_dir`` (unless None) at once,
    and train to the end."""
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.checkpoint.weights_only import load_model_only

    records = _Records()
    logging.getLogger("grpo_mega.checkpoint.training").addHandler(records)
    engine = _engine()
    manager = CheckpointManager(run_dir, keep_last=1)
    path = manager.find_resume("auto")
    loaded = manager.load(engine, path, seed=SEED)
    result = {
        "path": str(path), "step": loaded.step, "extra_state": loaded.extra_state, "config": loaded.config,
        "steps_done": engine.steps_done, "probe_at_load": _probe_logprobs(engine), "steps": [],
    }
    if save_dir is not None:
        # Twice: the second save of a step replaces the first. Saving must not disturb the RNG streams.
        for _ in range(2):
            CheckpointManager(save_dir).save(engine, loaded.step, extra_state=loaded.extra_state, config=loaded.config)
    for step in range(loaded.step + 1, TOTAL_STEPS + 1):
        result["steps"].append(_train_step(engine, step))
    result["probe_at_end"] = _probe_logprobs(engine)
    result["params"] = _params(engine)
    try:  # rank 0 judges the folder; every rank must raise the same error instead of hanging
        manager.find_resume(f"{run_dir}/checkpoints/.tmp-step_000003")
        result["explicit_broken_error"] = None
    except ValueError as error:
        result["explicit_broken_error"] = str(error)
    if load_model_only_too:
        fresh = _engine()
        result["model_only_folder"] = str(load_model_only(fresh, run_dir))
        result["model_only_probe"] = _probe_logprobs(fresh)
        result["model_only_state"] = (fresh.steps_done, fresh.schedule_state_dict()["num_steps"])
    logging.getLogger("grpo_mega.checkpoint.training").removeHandler(records)
    result["warnings"] = records.messages
    return result


def _resume(phases, load_model_only_too=False):
    """Resume once per phase (TP, PP, run dir to resume from, run dir to save into or None), switching
    megatron's groups inside one job."""
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    results = []
    for index, (tp, pp, run_dir, save_dir) in enumerate(phases):
        # Another seed than the saving run: whatever the resumed run needs must come from the checkpoint.
        if index == 0:
            init_distributed(tp, pp, seed=SEED + 500, device="cpu")
        else:
            destroy_model_parallel()
            init_model_parallel(tp, pp, seed=SEED + 500)
        results.append(_resume_at(run_dir, save_dir, load_model_only_too))
    return results


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    straight = run_distributed(_straight_run, 1)[0]
    with pytest.raises(ProcessExitedException) as crash:
        run_distributed(_run_saving_then_crash, 1, str(run_dir))
    assert crash.value.exit_code == CRASH_EXIT_CODE
    return {"run_dir": run_dir, "straight": straight}


@pytest.fixture(scope="module")
def resumed_tp1(scenario, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("resaved_tp1")
    result = run_distributed(_resume, 1, [(1, 1, str(scenario["run_dir"]), str(save_dir))])[0][0]
    return result, save_dir


@pytest.fixture(scope="module")
def resumed_2_ranks(scenario, tmp_path_factory):
    """Two ranks resume from the TP=1 checkpoint at TP=2 (saving it again at TP=2), then, in the same job
    with new groups, at PP=2 from that TP=2 checkpoint."""
    tp2_dir = str(tmp_path_factory.mktemp("saved_tp2"))
    phases = [(2, 1, str(scenario["run_dir"]), tp2_dir), (1, 2, tp2_dir, None)]
    per_rank = run_distributed(_resume, 2, phases, True)
    return {"tp2": [rank[0] for rank in per_rank], "pp2": [rank[1] for rank in per_rank]}


def test_crash_mid_save_leaves_previous_checkpoint_and_keep_last_pruned(scenario, tmp_path):
    from grpo_mega.checkpoint.training_files import checkpoint_problem

    checkpoints = scenario["run_dir"] / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    # keep_last=1: step 1 went once step 2 was complete; step 2 survived the crash of step 3's save.
    assert names == [".tmp-step_000003", "latest", "step_000002"]
    assert (checkpoints / "latest").read_text().strip() == "step_000002"
    assert checkpoint_problem(checkpoints / "step_000002") is None
    staging = checkpoints / ".tmp-step_000003"
    assert (staging / "metadata.json").is_file()  # the tensors of step 3 were written...
    assert not (staging / "complete.json").exists()  # ...but it was never completed
    assert "staging folder" in checkpoint_problem(staging)
    staged_as_step = shutil.copytree(staging, tmp_path / "step_000003")
    assert "complete.json is missing" in checkpoint_problem(staged_as_step)


def test_resume_after_crash_continues_exactly(scenario, resumed_tp1):
    straight = scenario["straight"]
    resumed_tp1, resaved_dir = resumed_tp1
    assert resumed_tp1["path"].endswith("step_000002")
    assert resumed_tp1["step"] == 2 and resumed_tp1["steps_done"] == 2
    assert resumed_tp1["config"] == CONFIG
    assert resumed_tp1["extra_state"]["prompts_consumed"] == 12
    assert torch.equal(resumed_tp1["extra_state"]["order"], torch.arange(5))
    torch.testing.assert_close(resumed_tp1["probe_at_load"], straight["probes"][1], atol=1e-6, rtol=0)
    for resumed, reference in zip(resumed_tp1["steps"], straight["steps"][2:], strict=True):
        assert resumed["loss"] == pytest.approx(reference["loss"], abs=1e-6)
        assert resumed["lr"] == pytest.approx(reference["lr"], rel=1e-12)  # the scheduler resumed too
        assert resumed["rng"] == reference["rng"]  # every generator continues its stream exactly
    for name, value in straight["params"].items():
        torch.testing.assert_close(resumed_tp1["params"][name], value, atol=1e-6, rtol=0, msg=name)
    moved = (straight["probes"][3] - straight["probes"][1]).abs().max().item()
    assert moved > 1e-2  # steps 3 and 4 really changed the model, so the comparison above means something
    assert not any("reseeded" in message for message in resumed_tp1["warnings"])
    # Saved twice at step 2: the second replaced the first, and nothing else is left behind.
    assert sorted(p.name for p in (resaved_dir / "checkpoints").iterdir()) == ["latest", "step_000002"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_resume_at_another_layout_from_tp1_checkpoint(scenario, resumed_2_ranks, layout):
    straight = scenario["straight"]
    for result in resumed_2_ranks[layout]:  # every rank reports the same global results
        assert result["step"] == 2 and result["steps_done"] == 2
        torch.testing.assert_close(result["probe_at_load"], straight["probes"][1], atol=1e-5, rtol=0)
        # Optimizer moments and scheduler came along: the next steps follow the TP=1 run.
        for resumed, reference in zip(result["steps"], straight["steps"][2:], strict=True):
            assert resumed["loss"] == pytest.approx(reference["loss"], abs=1e-5)
            assert resumed["lr"] == pytest.approx(reference["lr"], rel=1e-12)
        torch.testing.assert_close(result["probe_at_end"], straight["probes"][3], atol=1e-5, rtol=0)
        # Model-only load (init_from a run directory): the weights of step 2, a fresh optimizer and schedule.
        assert result["model_only_folder"].endswith("step_000002") and result["model_only_folder"] == result["path"]
        torch.testing.assert_close(result["model_only_probe"], straight["probes"][1], atol=1e-5, rtol=0)
        assert result["model_only_state"] == (0, 0)
        assert "is not a complete training checkpoint" in result["explicit_broken_error"]
    # The layout changed: RNG states cannot be restored rank for rank, and rank 0 says so.
    assert any("reseeded" in message for message in resumed_2_ranks[layout][0]["warnings"])


def _tp_shard(full, shard_shape, tp_rank, gated):
    """Rank ``tp_rank``'s part of a TP=1 tensor: a contiguous slice along the split dimension, or for the
    gated MLP's fc1 ([gate; up] stacked) the same slice of gate and of up, stacked again."""
    dim = next(d for d in range(full.dim()) if shard_shape[d] != full.shape[d])
    parts = full.chunk(2, dim=dim) if gated else [full]
    size = shard_shape[dim] // len(parts)
    return torch.cat([part.narrow(dim, tp_rank * size, size) for part in parts], dim=dim)


def _key_bias_rows(shard_rows):
    """The rows of a (TP-local) megatron QKV bias that bias the keys: per query group, [queries; key; value]."""
    config = _hf_config()
    head_dim = config.hidden_size // config.num_attention_heads
    queries_per_group = config.num_attention_heads // config.num_key_value_heads
    group_rows = (queries_per_group + 2) * head_dim
    rows = torch.arange(shard_rows) % group_rows
    return (rows >= queries_per_group * head_dim) & (rows < (queries_per_group + 1) * head_dim)


def test_resume_at_tp2_parameters_follow_tp1_run(scenario, resumed_2_ranks):
    """After two resumed steps at TP=2 (optimizer moments resharded), every TP shard equals the TP=1 run's.

    The key bias alone gets 1e-4: a query's scores move together under it, so only RoPE's rotation gives it a
    gradient, a tiny one, and Adam's m / sqrt(v) scales that gradient's rounding (which differs between TP=1 and
    TP=2 sums) toward an update's size: up to 8.6e-6 on a development machine, over 1e-5 on CI's. A moment lost
    or resharded wrongly moves it by about lr (2e-2)."""
    straight = scenario["straight"]["params"]
    for tp_rank, result in enumerate(resumed_2_ranks["tp2"]):
        assert result["params"].keys() == straight.keys()
        for name, shard in result["params"].items():
            full = straight[name]
            if shard.shape != full.shape:  # split over TP (megatron's QKV is ordered by query group)
                full = _tp_shard(full, shard.shape, tp_rank, gated="linear_fc1" in name)
            if name.endswith("linear_qkv.bias"):
                keys = _key_bias_rows(shard.shape[0])
                torch.testing.assert_close(shard[keys], full[keys], atol=1e-4, rtol=0, msg=name + " (keys)")
                shard, full = shard[~keys], full[~keys]
            torch.testing.assert_close(shard, full, atol=1e-5, rtol=0, msg=name)


def _copy_as(source, target, step):
    """Copy a complete checkpoint under another step number (its completion marker updated to match)."""
    shutil.copytree(source, target)
    marker = target / "complete.json"
    complete = json.loads(marker.read_text())
    complete["step"] = step
    marker.write_text(json.dumps(complete))
    return target


def test_auto_resume_skips_broken_checkpoints(scenario, tmp_path, caplog):
    from grpo_mega.checkpoint.training import CheckpointManager

    good = scenario["run_dir"] / "checkpoints" / "step_000002"
    checkpoints = tmp_path / "checkpoints"
    _copy_as(good, checkpoints / "step_000002", 2)
    no_marker = _copy_as(good, checkpoints / "step_000003", 3)
    (no_marker / "complete.json").unlink()
    truncated = _copy_as(good, checkpoints / "step_000004", 4)
    shard = max(truncated.glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    deleted = _copy_as(good, checkpoints / "step_000005", 5)
    common_file = common_state_range(deleted)[0]  # common.pt (megatron-core 0.16) or the shard holding it (0.19)
    (deleted / common_file).unlink()
    _copy_as(good, checkpoints / ".tmp-step_000009", 9)  # staging folders are never candidates
    (checkpoints / "latest").write_text("step_000005\n")

    with caplog.at_level(logging.WARNING, logger="grpo_mega.checkpoint.training"):
        found = CheckpointManager(tmp_path).find_resume("auto")
    assert found == checkpoints / "step_000002"
    log = caplog.text
    assert f"step_000005, which cannot be loaded: {common_file} is missing" in log
    assert "step_000004" in log and "truncated" in log
    assert "step_000003" in log and "complete.json is missing" in log

    for broken in (no_marker, truncated, deleted, checkpoints / ".tmp-step_000009"):
        with pytest.raises(ValueError, match="not a complete training checkpoint"):
            CheckpointManager(tmp_path).find_resume(str(broken))
        with pytest.raises(ValueError, match="not a complete training checkpoint"):
            CheckpointManager(tmp_path).load(None, broken, seed=0)  # refused before touching the engine
    assert CheckpointManager(tmp_path).find_resume(str(good)) == good
    assert CheckpointManager(tmp_path).find_resume("none") is None
    assert CheckpointManager(tmp_path / "empty_run").find_resume("auto") is None


def test_keep_last_prunes_only_older_complete_checkpoints(scenario, tmp_path, caplog):
    from grpo_mega.checkpoint.training import CheckpointManager

    good = scenario["run_dir"] / "checkpoints" / "step_000002"
    checkpoints = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 7):
        _copy_as(good, checkpoints / f"step_00000{step}", step)
    (checkpoints / "step_000002" / "complete.json").unlink()  # broken: not counted, not deleted
    manager = CheckpointManager(tmp_path, keep_last=2)
    with caplog.at_level(logging.WARNING, logger="grpo_mega.checkpoint.training"):
        manager._prune(newest_step=4)
    # step 4 (just saved) and the newest older complete one (3) stay; step 7 is from an abandoned timeline.
    assert [step for step, _ in manager.step_dirs()] == [7, 4, 3, 2]
    assert "step_000007" in caplog.text
    CheckpointManager(tmp_path, keep_last=1)._prune(newest_step=4)
    assert [step for step, _ in manager.step_dirs()] == [7, 4, 2]
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_weights_format_and_bad_inputs(scenario, tmp_path):
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.checkpoint.training_files import weights_format

    assert weights_format(scenario["run_dir"] / "checkpoints" / "step_000002") == "training_checkpoint"
    assert weights_format(scenario["run_dir"]) == "training_run"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert weights_format(hf) == "hf"
    with pytest.raises(ValueError, match="none of"):
        weights_format(tmp_path)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="extra_state"):
        manager.save(None, 1, extra_state={"cursor": np.zeros(2)})
    with pytest.raises(ValueError, match="config"):
        manager.save(None, 1, config={"bad": object()})
    with pytest.raises(ValueError, match="trainer.resume"):
        manager.find_resume("")


def _save_and_list_children(run_dir):
    import queue

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=SEED, device="cpu")
    engine = _engine()
    manager = CheckpointManager(run_dir, keep_last=2)
    _train_step(engine, 1)
    manager.save(engine, 1, config=CONFIG)
    return {"children": [p.cmdline() for p in psutil.Process().children(recursive=True) if p.is_running()],
            "in_process_queue": isinstance(filesystem_async._results_queue, queue.Queue)}


def test_a_save_leaves_no_process_behind_for_its_write_results(tmp_path):
    # megatron's writer would start a spawn-context Manager on the first save (1.3 s of imports, alive to the end)
    (result,) = run_distributed(_save_and_list_children, 1, tmp_path / "run")
    assert result == {"children": [], "in_process_queue": True}
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000001"
