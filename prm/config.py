"""The PRM training config (``grpo-mega prm train --config FILE [key=value ...]``): the policy trainer's model,
parallel and optimizer sections, plus the PRM head, its data and the trainer settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from grpo_mega.config import (
    ConfigError,
    DeepSpeedConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    SFTTrainerConfig,
    check_choice,
    check_context_length,
    validate_engine,
    validate_experts,
    validate_optim,
    validate_parallel,
    validate_trainer_common,
)

PRM_LAYOUT_CHOICES = ("classifier", "lm_tokens", "likelihood")
LABEL_KINDS = ("hard", "soft")


@dataclass
class PRMHeadConfig:
    layout: str = "classifier"
    """``classifier`` (Qwen2.5-Math-PRM: a 2-way head on the backbone; a policy's config is turned into one) or
    ``lm_tokens`` (Math-Shepherd: the LM's logits of ``good_token`` vs ``bad_token``) or ``likelihood`` (a causal
    LM's own probability of each step as written: the smallest p(token | text before it) over its tokens; needs
    ``step_tag: ""``; training is binary cross-entropy on that score)."""
    step_tag: str = " ки"
    """Written after every step (``prompt + step_1 + tag + step_2 + tag ...``); the step's score is read at the
    tag's last token. Qwen2.5-Math-PRM uses "<extra_0>", Math-Shepherd " ки"; ``likelihood`` has none ("")."""
    good_token: str = "+"
    """``lm_tokens``: the label token of a good step (one token of the vocabulary)."""
    bad_token: str = "-"
    """``lm_tokens``: the label token of a bad step."""
    chat_template: bool = False
    """Wrap the rendered text with the tokenizer's chat template (user = prompt, assistant = tagged steps)."""
    system_prompt: Optional[str] = None
    """System message of the chat template, when ``chat_template`` is on."""
    likelihood_tokens: str = "all"
    """``likelihood``: a step's score is the minimum token probability over ``all`` its tokens (a self-consistency
    signal that fits formula-only steps such as the synthetic task's) or over its ``result`` (the numbers after
    its last ``=``; natural-language steps such as GSM8K's, where wording tokens would decide the minimum).
    Saved with the PRM: scoring and GRPO read it the same way."""


@dataclass
class PRMDataConfig:
    train_file: str = "???"
    """Step-labelled examples: stepwise (TRL; what ``grpo-mega prm label`` writes), Math-Shepherd, PRM800K or
    synthetic jsonl."""
    format: str = "auto"
    """``auto`` (from the first row's fields), ``stepwise``, ``math_shepherd``, ``prm800k``, ``synthetic``."""
    eval_file: Optional[str] = None
    """Held-out step-labelled examples: step accuracy and F1 on them every ``trainer.eval_every`` steps and at the end."""
    labels: str = "hard"
    """Train on ``hard`` labels (cross-entropy with 0/1 targets) or ``soft`` ones (the Monte-Carlo fraction of
    rollouts that reached the answer; falls back to the hard label where a row has none)."""
    stop_at_first_bad_step: bool = False
    """Train on each solution's steps up to and including its first bad one only (PRM800K's labellers stop there):
    the later steps of a solution that went wrong are labelled bad by inheritance, though each may be right in
    itself, and with ``prm.layout: likelihood`` training them as bad teaches the model that right steps are unlikely
    (docs/results.md). Hard labels decide the first bad step (soft ones: the first below 0.5)."""
    neutral_is_good: bool = True
    """PRM800K: count a rating of 0 as a good step (as Qwen does; TRL counts only +1)."""
    max_length: int = 512
    """Longest rendered example in tokens; longer rows are reported and handled per ``on_bad_row``."""
    on_bad_row: str = "skip"
    """``skip`` (report file:line and go on) or ``error``."""
    replay_files: list[str] = field(default_factory=list)
    """Earlier label files replayed beside ``train_file`` (iterative RL, DeepSeekMath Algorithm 1: the PRM trains
    on from its last checkpoint on fresh labels of the current policy plus a share of the earlier labels). On the
    command line: ``data.replay_files=[runs/it1/labels.jsonl,runs/it2/labels.jsonl]``. Read in ``format``."""
    replay_fraction: float = 0.1
    """Share of the rows of ``replay_files`` (all files together) added to every row of ``train_file``:
    ``round(fraction * rows)`` drawn without replacement, the same rows for the same ``parallel.seed`` (a resumed run
    trains on the same set). DeepSeekMath replays 10 %."""


@dataclass
class PRMTrainerConfig(SFTTrainerConfig):
    """The SFT trainer's settings (the run settings, with ``save_before_seconds`` and ``time_limit_seconds``;
    ``batch_size``: examples, i.e. solutions, per optimizer step) plus evaluation."""

    run_dir: str = "runs/prm"
    total_steps: int = 300
    eval_every: int = 0
    """Evaluate on ``data.eval_file`` every N steps; 0 = only at the end."""


@dataclass
class PRMConfig:
    engine: str = "megatron"
    """Training engine of the PRM: ``megatron`` (TP / PP / DP) or ``deepspeed`` (ZeRO over data parallel on the
    transformers model: ``parallel.tensor`` and ``parallel.pipeline`` 1, settings in ``deepspeed``; run it on N
    processes with ``--nproc N``)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    """``hf_config``: the PRM's HF config folder, or a policy's (a classifier PRM is then built on its backbone);
    ``init_from``: a policy or a PRM (HF folder, converted megatron folder, grpo-mega checkpoint or run dir)."""
    prm: PRMHeadConfig = field(default_factory=PRMHeadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: PRMDataConfig = field(default_factory=PRMDataConfig)
    trainer: PRMTrainerConfig = field(default_factory=PRMTrainerConfig)


def validate_prm(cfg: PRMConfig) -> None:
    """Cross-field checks of a PRM training config."""
    validate_engine(cfg)
    validate_optim(cfg.optim)
    validate_trainer_common(cfg.trainer)
    validate_parallel(cfg.parallel)
    check_choice(cfg.prm.layout, PRM_LAYOUT_CHOICES, "prm.layout")
    check_choice(cfg.data.labels, LABEL_KINDS, "data.labels")
    check_choice(cfg.prm.likelihood_tokens, ("all", "result"), "prm.likelihood_tokens")
    check_choice(cfg.data.on_bad_row, ("skip", "error"), "data.on_bad_row")
    if cfg.prm.layout == "lm_tokens" and cfg.prm.good_token == cfg.prm.bad_token:
        raise ConfigError(f"prm.good_token and prm.bad_token are both {cfg.prm.good_token!r}: the lm_tokens layout "
                          "scores a step by their odds, so they must differ")
    if cfg.prm.system_prompt is not None and not cfg.prm.chat_template:
        raise ConfigError("prm.system_prompt is the chat template's system turn: set prm.chat_template=true too "
                          "(or prm.system_prompt=null)")
    validate_experts(cfg.model, cfg.parallel)
    check_context_length(cfg.model, cfg.data.max_length, "data.max_length")
    _validate_replay(cfg.data)
    if cfg.prm.layout == "likelihood":
        if cfg.prm.step_tag != "":
            raise ConfigError(f"prm.layout=likelihood scores the steps as the policy wrote them: set prm.step_tag "
                              f"to \"\" (got {cfg.prm.step_tag!r})")
    elif not cfg.prm.step_tag:
        raise ConfigError("prm.step_tag must be a non-empty string")
    for key in ("total_steps", "batch_size"):
        if getattr(cfg.trainer, key) < 1:
            raise ConfigError(f"trainer.{key} must be >= 1")


def _validate_replay(data: PRMDataConfig) -> None:
    if not 0.0 <= data.replay_fraction <= 1.0:
        raise ConfigError(f"data.replay_fraction={data.replay_fraction} must be in [0, 1]")
    for path in data.replay_files:
        if not Path(path).is_file():
            raise ConfigError(f"data.replay_files: {path} does not exist (or is not a file)")
        if Path(path).resolve() == Path(data.train_file).resolve():
            raise ConfigError(f"data.replay_files holds data.train_file ({path}): its rows are all trained on "
                              "already; list only the earlier label files")
