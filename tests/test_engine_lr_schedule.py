"""The learning-rate schedule counts trainer steps (``lr_schedule_step``), not optimizer steps, and a resumed run
follows the config's schedule from the saved position: extending a finished cosine run trains at a non-zero LR,
and changed ``optim.*`` settings take effect."""

import logging
import math

import pytest
import torch

from dist_utils import run_distributed, tiny_qwen2_config

SEED = 3
LR = 2e-2


def _engine(total_steps, lr=LR, **optim_settings):
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine

    optim = OptimConfig(lr=lr, min_lr=0.0, warmup_steps=0, decay_style="cosine", clip_grad=1.0, **optim_settings)
    return build_policy_engine(
        tiny_qwen2_config(tied=True, num_layers=2), optim=optim, total_steps=total_steps, max_tokens_per_micro_batch=40
    )


def _batch(step):
    generator = torch.Generator().manual_seed(step)
    input_ids = torch.randint(0, 301, (4, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


class InterfaceOnly:
    """An engine seen only through a protocol of ``grpo_mega.engine.base``: checkpoint and weight-loading code
    given this proxy fails (AttributeError) if it reaches for anything else (``.stage``, ``.optimizer``, ...)."""

    def __init__(self, engine, protocol):
        members = set()
        for cls in protocol.__mro__:
            if cls.__module__ == "grpo_mega.engine.base":
                members |= {name for name in vars(cls) if not name.startswith("_")}
                members |= set(vars(cls).get("__annotations__", {}))
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_members", members)

    def __getattr__(self, name):
        if name not in self._members:
            raise AttributeError(f"engine.{name} is not part of the engine interface")
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        if name not in self._members:
            raise AttributeError(f"engine.{name} is not part of the engine interface")
        setattr(self._engine, name, value)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _params(engine):
    return {name: p.detach().clone() for name, p in engine.stage.named_parameters()}


def _extend_finished_run(run_dir):
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.engine import TrainingEngine
    from grpo_mega.parallel import init_distributed
    from grpo_mega.sft import sft_loss

    init_distributed(1, 1, seed=SEED, device="cpu")

    def interface(engine):  # checkpoint code touches nothing but the TrainingEngine interface
        return InterfaceOnly(engine, TrainingEngine)

    records = _Records()
    logger = logging.getLogger("grpo_mega.checkpoint.training")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    result = {}

    engine = _engine(total_steps=2)
    result["first_lrs"] = []
    for step in (1, 2):
        result["first_lrs"].append(engine.train_step(_batch(step), sft_loss)["lr"])
        engine.lr_schedule_step()
    result["lr_at_end"] = engine.current_lr
    manager = CheckpointManager(run_dir)
    path = manager.save(interface(engine), 2)

    # trainer.total_steps raised to 4 on resume: the cosine continues from position 2 of 4.
    longer = _engine(total_steps=4)
    manager.load(interface(longer), path, seed=SEED)
    before = _params(longer)
    # One trainer step of two optimizer steps (two mini-batches): both at the same learning rate.
    result["resumed_lrs"] = [longer.train_step(_batch(3), sft_loss)["lr"] for _ in range(2)]
    result["moved"] = max((p - before[n]).abs().max().item() for n, p in _params(longer).items())
    longer.lr_schedule_step()
    result["lr_after_trainer_step"] = longer.current_lr
    result["steps_done"] = longer.steps_done
    result["schedule_position"] = longer.schedule_state_dict()["num_steps"]

    # optim.lr and optim.adam_beta2 changed on resume: the new peak, at the saved position, and the new beta.
    changed = _engine(total_steps=4, lr=LR / 2, adam_beta2=0.95)
    manager.load(interface(changed), path, seed=SEED)
    result["changed_lr"] = changed.train_step(_batch(3), sft_loss)["lr"]
    result["changed_betas"] = [group["betas"] for group in changed.optimizer.param_groups]

    # Nothing changed: said so.
    same = _engine(total_steps=2)
    manager.load(interface(same), path, seed=SEED)
    result["same_lr"] = same.current_lr
    logger.removeHandler(records)
    result["messages"] = [m for m in records.messages if "learning-rate schedule" in m]
    result["optimizer_messages"] = [m for m in records.messages if "optimizer settings" in m]
    return result


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    return run_distributed(_extend_finished_run, 1, str(tmp_path_factory.mktemp("run")))[0]


def _cosine(position, total, peak=LR):
    return peak * 0.5 * (1 + math.cos(math.pi * position / total))


def test_finished_cosine_run_extended_on_resume_trains_at_the_config_schedule(extended):
    assert extended["first_lrs"] == pytest.approx([_cosine(0, 2), _cosine(1, 2)], rel=1e-12)
    assert extended["lr_at_end"] == 0.0  # the 2-step cosine ran down to min_lr
    # Resumed with total_steps=4: position 2 of 4, not the checkpoint's 2 of 2 (which would train at LR 0).
    assert extended["resumed_lrs"] == pytest.approx([_cosine(2, 4)] * 2, rel=1e-12)
    assert extended["resumed_lrs"][0] > 0 and extended["moved"] > 1e-4
    assert "learning-rate schedule follows the config (lr_decay_steps 2 -> 4)" in extended["messages"][0]


def test_schedule_counts_trainer_steps_not_optimizer_steps(extended):
    # Two optimizer steps in one trainer step moved the schedule by one.
    assert extended["lr_after_trainer_step"] == pytest.approx(_cosine(3, 4), rel=1e-12)
    assert extended["schedule_position"] == 3
    assert extended["steps_done"] == 4  # optimizer steps actually taken: 2 saved + 2 after the resume


def test_changed_learning_rate_on_resume_is_followed(extended):
    assert extended["changed_lr"] == pytest.approx(_cosine(2, 4, peak=LR / 2), rel=1e-12)
    assert "(max_lr 0.02 -> 0.01, lr_decay_steps 2 -> 4)" in extended["messages"][1]
    assert extended["changed_betas"] and all(betas == (0.9, 0.95) for betas in extended["changed_betas"])
    assert extended["optimizer_messages"] == ["optimizer settings follow the config (betas (0.9, 0.999) -> (0.9, 0.95))"]
    assert extended["same_lr"] == 0.0
    assert "learning-rate schedule follows the config (unchanged)" in extended["messages"][2]


def test_keep_optimizer_settings_restores_config_and_names_changes():
    from grpo_mega.engine.lr_schedule import keep_optimizer_settings, optimizer_settings

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    built = optimizer_settings(optimizer)
    assert "params" not in built[0] and built[0]["betas"] == (0.9, 0.95)
    # what a checkpoint's state would bring back: other betas and lr (lr is the schedule's, so not reported)
    optimizer.param_groups[0].update(betas=(0.8, 0.99), lr=5.0)
    assert keep_optimizer_settings(optimizer, built) == ["betas (0.8, 0.99) -> (0.9, 0.95)"]
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95) and optimizer.param_groups[0]["lr"] == 1e-3
    assert keep_optimizer_settings(optimizer, built) == []
    with pytest.raises(ValueError, match="2 parameter groups, this model 1"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
        keep_optimizer_settings(optimizer, built)


def test_keep_optimizer_settings_never_puts_back_a_fresh_optimizers_step():
    """The group ``step`` (TE / apex FusedAdam's bias-correction counter) is state: the checkpoint's stays, and an
    unchanged config reports nothing (a betas list from the checkpoint equals the config's tuple)."""
    from grpo_mega.engine.lr_schedule import keep_optimizer_settings, optimizer_settings

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, betas=(0.9, 0.95))
    optimizer.param_groups[0]["step"] = 1  # what megatron's dummy step leaves in a fresh distributed optimizer
    built = optimizer_settings(optimizer)
    optimizer.param_groups[0].update(step=7, betas=[0.9, 0.95])  # the loaded checkpoint's
    assert keep_optimizer_settings(optimizer, built) == []
    assert optimizer.param_groups[0]["step"] == 7
