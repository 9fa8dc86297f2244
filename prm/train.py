"""PRM training on the Megatron or DeepSpeed engine (``engine``): ``grpo-mega prm train --config FILE [key=value ...]``.

Each example is rendered once (``prm.rendering``: prompt + step_1 + tag + ...); the loss is the cross-entropy of
the head's good/bad distribution at every step's tag against the step's label (hard 0/1, or the Monte-Carlo
fraction with ``data.labels: soft``), averaged over all steps of the global batch. The training rows are those of
``data.train_file`` plus, for iterative RL, a replayed share of earlier label files (``data.replay_files``,
``data.replay_fraction``). TP / PP / DP, checkpoints and
exact resume, metrics and the progress bar are the policy trainer's (``grpo_mega.harness.lifecycle``). SIGTERM / SIGUSR1 /
SIGUSR2 (a scheduler's warning before preemption or the time limit) make every rank save the step in flight and
stop with ``StoppedEarly`` (``grpo_mega.run.control``); the same command resumes from that checkpoint.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from grpo_mega.data.prompts import BadRows
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.engine import LossScale
from grpo_mega.harness.lifecycle import RunHarness
from grpo_mega.harness.resume import trainer_state
from grpo_mega.model.config_map import load_model_hf_config
from prm.config import PRMConfig
from prm.examples import StepExample
from prm.metrics import step_classification
from prm.rendering import RenderedExample, RenderSettings
from prm.turn_rendering import render_example
from prm.scoring import StepScorer, rendered_batch

if TYPE_CHECKING:
    from grpo_mega.checkpoint.source import ModelSource

logger = logging.getLogger(__name__)

PRM_HF_CONFIG_DIR = "prm_hf_config"
"""Where a run writes the HF config of a classifier PRM built on a policy's backbone (``model.hf_config`` is a
causal LM's config)."""


def prm_loss(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor], scale: LossScale):
    """``-sum over tags [y log P(good) + (1 - y) log P(bad)] / global steps`` (this micro-batch's share), with
    the step accuracy (P(good) > 0.5 against y > 0.5) as a metric."""
    mask = micro["loss_mask"].to(torch.float32)
    target = micro["targets"].to(torch.float32)
    good, bad = outputs["good_logprob"], outputs["bad_logprob"]
    loss = -((target * good + (1.0 - target) * bad) * mask).sum() / scale.global_tokens
    hit = ((good > math.log(0.5)) == (target > 0.5)).to(torch.float32)
    return loss, {"prm/loss": loss.detach(), "prm/step_accuracy": (hit * mask).sum().detach() / scale.global_tokens}


def training_targets(example: StepExample, labels: str,
                     stop_at_first_bad_step: bool = False) -> tuple[list[str], list[float]] | None:
    """The steps to train on and their targets, or None when the example carries no labels.

    ``soft`` uses the Monte-Carlo fractions where present, else the hard labels. A ProcessBench-style example
    (only ``first_error`` known) trains on the steps up to its first error: good, ..., good, bad; with
    ``stop_at_first_bad_step`` so does every example.
    """
    if labels == "soft" and example.soft_labels is not None:
        targets = [float(v) for v in example.soft_labels]
        bad = [target < 0.5 for target in targets]
    elif example.labels is not None:
        targets = [1.0 if good else 0.0 for good in example.labels]
        bad = [not good for good in example.labels]
    else:
        targets = None
    if targets is not None:
        end = bad.index(True) + 1 if stop_at_first_bad_step and any(bad) else len(targets)
        return example.steps[:end], targets[:end]
    if example.first_error is not None:
        if example.first_error < 0:
            return example.steps, [1.0] * len(example.steps)
        kept = example.steps[: example.first_error + 1]
        return kept, [1.0] * example.first_error + [0.0]
    return None


def render_training_set(
    examples: list[StepExample], tokenizer, settings: RenderSettings, *, labels: str, max_length: int, policy: str,
    source: str, stop_at_first_bad_step: bool = False,
) -> tuple[list[RenderedExample], list[list[float]]]:
    """Rendered examples and their per-step targets; unusable rows (no labels, no steps, too long, tags that do
    not tokenize apart) are reported with file:line and skipped or raised per ``policy``."""
    bad_rows = BadRows(policy)
    rendered, targets = [], []
    for example in examples:
        steps_and_targets = training_targets(example, labels, stop_at_first_bad_step)
        if steps_and_targets is None or not steps_and_targets[0]:
            bad_rows.reject(example.source, "no step labels" if steps_and_targets is None else "no steps")
            continue
        steps, values = steps_and_targets
        try:
            rendered.append(render_example(tokenizer, example, settings, num_steps=len(steps), max_length=max_length))
        except ValueError as error:
            bad_rows.reject(example.source, str(error))
            continue
        targets.append(values)
    bad_rows.finish(len(rendered), source)
    return rendered, targets


def evaluate_steps(scorer: StepScorer, rendered: list[RenderedExample], targets: list[list[float]]) -> dict[str, float]:
    """``eval/step_accuracy``, ``eval/step_f1`` (wrong steps as the positive class) of held-out examples."""
    scores = scorer.score_rendered(rendered)
    report = step_classification(scores, [[t > 0.5 for t in row] for row in targets])
    return {f"eval/{key}": float(report[key]) for key in ("step_accuracy", "step_f1", "step_f1_good")}


def run_prm_train(cfg: PRMConfig) -> Path:
    """Train the PRM, checkpoint on schedule and at the end; returns the final checkpoint folder. Raises
    ``StoppedEarly`` after saving the step in flight when a stop signal arrived (on any rank) or the time limit
    came near (``grpo_mega.harness.lifecycle``)."""
    from grpo_mega.lora import lora_attacher
    from prm.engines import build_prm_engine
    from prm.spec import PRMSpec

    harness = RunHarness(cfg, command="grpo-mega prm train")
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_config)
    cfg.model.tokenizer = cfg.model.tokenizer or cfg.model.hf_config
    cfg.model.hf_config = str(_prm_hf_config(cfg, harness.run_dir))
    hf_config = load_model_hf_config(cfg.model)
    spec = PRMSpec(layout=cfg.prm.layout, step_tag=cfg.prm.step_tag, good_token=cfg.prm.good_token,
                   bad_token=cfg.prm.bad_token)
    # Data first: a bad file fails in seconds, before the model is built.
    settings = RenderSettings(step_tag=cfg.prm.step_tag, chat_template=cfg.prm.chat_template,
                              likelihood_tokens=cfg.prm.likelihood_tokens,
                              system_prompt=cfg.prm.system_prompt)
    examples, replayed, history = training_examples(cfg)
    if harness.is_rank0:
        say_what_was_read(cfg, examples, replayed, history)
    rendered, targets = _render(cfg, examples, tokenizer, settings, source=_training_source(cfg),
                                stop_at_first_bad_step=cfg.data.stop_at_first_bad_step)
    eval_set = (_render(cfg, _read(cfg, cfg.data.eval_file), tokenizer, settings, source=cfg.data.eval_file)
                if cfg.data.eval_file else None)
    harness.startup.mark("data")
    engine = build_prm_engine(hf_config, spec, tokenizer, optim=cfg.optim, total_steps=cfg.trainer.total_steps,
                              max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
                              engine_kind=cfg.engine, deepspeed=cfg.deepspeed,
                              sequence_parallel=cfg.parallel.sequence_parallel, recompute=cfg.parallel.recompute,
                              distributed_optimizer=cfg.parallel.distributed_optimizer,
                              attach_adapters=lora_attacher(cfg.model.lora, seed=cfg.parallel.seed,
                                                            base=cfg.model.init_from, trained_modules=("head",)))
    harness.startup.mark("model_build")
    if cfg.model.lora.enabled:  # the frozen base, under a resumed run's adapters too (checkpoints hold only those)
        _load_initial_weights(engine, cfg)
        logger.info("LoRA rank %d (alpha %g) on %s: %d trained parameters (adapters and the head)",
                    cfg.model.lora.rank, cfg.model.lora.alpha, ", ".join(cfg.model.lora.target_modules),
                    engine.lora.trainable_parameters())
    harness.start(engine, state=trainer_state("prm"), initial_weights=lambda: _load_initial_weights(engine, cfg),
                  shown={"loss": "prm/loss", "step accuracy": "eval/step_accuracy"})
    scorer = StepScorer(engine, tokenizer, settings, max_length=cfg.data.max_length)
    for step in harness.steps():
        # The rows of step s depend only on (seed, s): a resumed run sees the batches it would have seen.
        rows = np.random.default_rng([cfg.parallel.seed, step]).choice(len(rendered), cfg.trainer.batch_size)
        batch = rendered_batch([rendered[i] for i in rows], scorer.pad_id, [targets[i] for i in rows],
                               step_ids=spec.layout == "likelihood")
        metrics = engine.train_step(batch, prm_loss)
        engine.lr_schedule_step()
        if eval_set is not None and harness.on_schedule(step, cfg.trainer.eval_every):
            metrics.update(evaluate_steps(scorer, *eval_set))
        harness.end_step(step, metrics)
    return harness.finish()


def training_examples(cfg: PRMConfig) -> tuple[list[StepExample], int, int]:
    """The rows to train on: every row of ``data.train_file`` plus ``round(data.replay_fraction * N)`` of the N rows
    of ``data.replay_files``, drawn and shuffled with ``parallel.seed`` (``prm.data.replay_mix``), so a resumed run
    trains on the same set in the same order. Returns (rows, replayed rows, N)."""
    from prm.data import replay_mix

    new = _read(cfg, cfg.data.train_file)
    if not cfg.data.replay_files:
        return new, 0, 0
    history = [example for path in cfg.data.replay_files for example in _read(cfg, path)]
    mixed = replay_mix(new, history, cfg.data.replay_fraction, cfg.parallel.seed)
    return mixed, len(mixed) - len(new), len(history)


def label_counts(examples: list[StepExample], labels: str, stop_at_first_bad_step: bool) -> tuple[int, int]:
    """(labelled steps, good ones: target >= 0.5) of the steps the PRM trains on (:func:`training_targets`)."""
    steps = good = 0
    for example in examples:
        found = training_targets(example, labels, stop_at_first_bad_step)
        if found is not None:
            steps += len(found[1])
            good += sum(target >= 0.5 for target in found[1])
    return steps, good


def say_what_was_read(cfg: PRMConfig, examples: list[StepExample], replayed: int, history: int) -> None:
    """One line on what the PRM trains on (rows, labelled steps, the share of good ones), and a warning when every
    label is of one class: a file of only correct solutions trained a PRM that calls every step good, in silence."""
    steps, good = label_counts(examples, cfg.data.labels, cfg.data.stop_at_first_bad_step)
    replay = (f" plus {replayed} replayed of the {history} rows of data.replay_files (data.replay_fraction="
              f"{cfg.data.replay_fraction:g})" if cfg.data.replay_files else "")
    share = f"{good / steps:.0%} good" if steps else "none labelled"
    logger.info("training set: %d rows of %s%s: %d labelled steps, %s", len(examples) - replayed,
                cfg.data.train_file, replay, steps, share)
    if steps and good in (0, steps):
        logger.warning("every step label of %s is %s: the PRM learns one class and scores every step alike; train on "
                       "right and wrong steps (grpo-mega prm label labels the policy's own solutions)",
                       cfg.data.train_file, "good" if good else "bad")


def _training_source(cfg: PRMConfig) -> str:
    if not cfg.data.replay_files:
        return str(cfg.data.train_file)
    return f"{cfg.data.train_file} with replay from {', '.join(map(str, cfg.data.replay_files))}"


def _read(cfg: PRMConfig, path: str) -> list[StepExample]:
    from prm.data import read_examples

    options = {"neutral_is_good": cfg.data.neutral_is_good} if cfg.data.format in ("prm800k", "auto") else {}
    return read_examples(path, cfg.data.format, on_bad_row=cfg.data.on_bad_row, **options)


def _render(cfg: PRMConfig, examples: list[StepExample], tokenizer, settings: RenderSettings, *, source: str,
            stop_at_first_bad_step: bool = False):
    return render_training_set(examples, tokenizer, settings, labels=cfg.data.labels, max_length=cfg.data.max_length,
                               policy=cfg.data.on_bad_row, source=source, stop_at_first_bad_step=stop_at_first_bad_step)


def _prm_hf_config(cfg: PRMConfig, run_dir: Path) -> Path:
    """The PRM's HF config folder: ``model.hf_config`` when it already describes this layout; for a classifier
    on a causal LM's config, a PRM config written into the run directory (rank 0 writes, all wait)."""
    from prm.spec import detect_layout, prm_hf_config_from_policy

    given = Path(cfg.model.hf_config)
    hf_config = AutoConfig.from_pretrained(given)
    # A config without architectures (e.g. written from a bare Qwen2Config) is a policy's: a causal LM.
    layout = detect_layout(hf_config) if getattr(hf_config, "architectures", None) else "lm_tokens"
    if layout == cfg.prm.layout or (layout, cfg.prm.layout) == ("lm_tokens", "likelihood"):
        return given
    if cfg.prm.layout in ("lm_tokens", "likelihood"):
        raise ValueError(
            f"prm.layout={cfg.prm.layout} needs a causal LM's config, but model.hf_config={given} is a {layout} PRM"
        )
    target = run_dir / PRM_HF_CONFIG_DIR
    if dist.get_rank() == 0:
        prm_hf_config_from_policy(given, target, "classifier")
    dist.barrier()
    logger.info("classifier PRM on the backbone of %s: config written to %s", given, target)
    return target


def _load_initial_weights(engine, cfg: PRMConfig) -> None:
    """``model.init_from``: a PRM of this layout loads whole; a policy gives the backbone (classifier: the head
    starts from its initialisation). The source is resolved once, for the check and the load."""
    from grpo_mega.checkpoint.initial_weights import load_initial_weights
    from grpo_mega.checkpoint.source import resolve_model_source
    from prm.model import load_prm_init_weights

    if cfg.model.init_from is None:
        load_initial_weights(engine, None)
        return
    source = resolve_model_source(cfg.model.init_from)
    if cfg.prm.layout in ("lm_tokens", "likelihood") or _is_classifier_prm(source):
        load_initial_weights(engine, source)
    else:
        load_prm_init_weights(engine, source)


def _is_classifier_prm(source: ModelSource) -> bool:
    """Whether ``source`` holds a classifier PRM (its head included): an HF PRM folder or a grpo-mega PRM run."""
    from prm.spec import detect_layout

    if source.kind == "hf":
        return detect_layout(source.hf_config) == "classifier"
    return source.trained_prm.get("layout") == "classifier"
