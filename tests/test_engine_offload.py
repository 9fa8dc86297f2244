"""``parallel.offload_during_rollout``: the megatron engine's gradient buffers and optimizer state really leave the
training device (their storages are released) and come back bit-identical, and training continues exactly as
without the offload. On the CPU "host" memory is the same memory, so the test reads storage sizes: what the
engine holds on its device against what it keeps in the host copy."""

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config
from grpo_mega.engine.offload import StorageOffload, device_bytes


def test_storage_offload_keeps_views_and_restores_bytes():
    buffer = torch.randn(64)
    view = buffer[8:24].view(4, 4)  # as megatron's main_grad views into its grad buffer
    moments = {"exp_avg": torch.randn(3, 5), "step": torch.tensor(7.0)}
    kept_values = {k: v.clone() for k, v in moments.items()}
    offload = StorageOffload()
    released = offload.offload(keep=moments.values(), discard=[buffer])
    assert released == 64 * 4 + 15 * 4 + 4 and offload.host_bytes == 15 * 4 + 4
    assert device_bytes([buffer, view, *moments.values()]) == 0  # every storage given back
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload.offload(keep=[], discard=[buffer])
    assert offload.restore() == released and not offload.active
    for key, value in moments.items():
        assert torch.equal(value, kept_values[key])  # the same tensor objects, bit for bit
    assert torch.equal(buffer, torch.zeros(64))  # discarded content comes back as zeros...
    view += 1.0
    assert buffer[8:24].sum() == 16  # ...and the view still points into the buffer


def _engine():
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    return build_policy_engine(tiny_qwen2_config(tied=False, num_layers=2), optim=optim, total_steps=4,
                               max_tokens_per_micro_batch=24)


def _batch(seed):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 301, (4, 10), generator=generator)
    attention_mask = (torch.arange(10) < torch.tensor([10, 7, 9, 6])[:, None]).long()
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=attention_mask.clone())


def _offloaded_training_equals_plain_training():
    from grpo_mega.parallel import init_distributed
    from grpo_mega.sft import sft_loss

    init_distributed(1, 1, seed=3, device="cpu")
    engine, twin = _engine(), _engine()
    twin.load_model_state_dict(engine.stage.state_dict())
    result = {"before_first_step": engine.held_bytes()}
    engine.train_step(_batch(0), sft_loss)
    twin.train_step(_batch(0), sft_loss)
    result["after_step"] = engine.held_bytes()
    moment = next(iter(engine.optimizer.optimizer.state.values()))["exp_avg"]
    main_grad = next(engine.stage.parameters()).main_grad
    saved_moment = moment.clone()
    result["released"] = engine.offload_to_host()
    result["offloaded"] = engine.held_bytes()
    result["storages_while_offloaded"] = (moment.untyped_storage().nbytes(), main_grad.untyped_storage().nbytes())
    result["restored"] = engine.reload_from_host()
    result["moment_identical"] = torch.equal(moment, saved_moment)
    result["reloaded"] = engine.held_bytes()
    # Two more steps each way; the second offload is never reloaded by hand (train_step takes the state back).
    losses = []
    for step, offload_first in ((1, False), (2, True)):
        if offload_first:
            engine.offload_to_host()
        losses.append((engine.train_step(_batch(step), sft_loss), twin.train_step(_batch(step), sft_loss)))
    result["metrics_equal"] = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in losses)
    twin_params = dict(twin.stage.named_parameters())
    result["params_equal"] = all(torch.equal(p, twin_params[n]) for n, p in engine.stage.named_parameters())
    return result


def test_offload_releases_grads_and_optimizer_state_and_training_continues_exactly():
    (result,) = run_distributed(_offloaded_training_equals_plain_training, 1)
    before, after = result["before_first_step"], result["after_step"]
    assert before["grad_buffers"] > 0 and before["optimizer_state"] == 0  # Adam's state appears at its first step
    # fp32 Adam: exp_avg + exp_avg_sq of every parameter (+ step counts), as large as the fp32 grad buffer twice
    assert after["optimizer_state"] >= 2 * after["grad_buffers"] and after["host"] == 0
    offloaded = result["offloaded"]
    assert offloaded == {"grad_buffers": 0, "optimizer_state": 0, "host": after["optimizer_state"]}
    assert result["storages_while_offloaded"] == (0, 0)
    assert result["released"] == result["restored"] == after["grad_buffers"] + after["optimizer_state"]
    assert result["reloaded"] == after and result["moment_identical"]
    assert result["metrics_equal"] and result["params_equal"]  # bit for bit against the twin that never offloaded


def test_the_option_is_for_the_megatron_engine():
    from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate

    required = ["model.hf_config=x", "data.train_file=y"]
    assert not load_config(GRPOConfig, None, required, validate).parallel.offload_during_rollout  # off by default
    assert load_config(GRPOConfig, None, [*required, "parallel.offload_during_rollout=true"], validate)
    with pytest.raises(ConfigError, match="offload_during_rollout applies to engine=megatron.*offload_optimizer"):
        load_config(GRPOConfig, None, [*required, "parallel.offload_during_rollout=true", "engine=deepspeed"],
                    validate)
