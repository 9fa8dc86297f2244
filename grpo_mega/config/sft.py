"""The SFT run config (``grpo-mega sft --config FILE [key=value ...]``): the shared sections plus its examples
and batch size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from grpo_mega.config.sections import DeepSpeedConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig


@dataclass
class SFTDataConfig:
    train_file: str = "???"
    """jsonl / parquet rows with a prompt and a target response."""
    prompt_field: str = "prompt"
    """Prompt/response rows: the field of the user's text."""
    response_field: str = "solution"
    """Prompt/response rows: the field of the target response (GSM8K: ``answer``)."""
    messages_field: Optional[str] = None
    """Conversation rows: the field holding a ``[{role, content}, ...]`` list (e.g. ``messages``) ending with the
    assistant turn to learn; earlier turns are context. Needs ``chat_template: true``. None: prompt/response rows."""
    segments_field: Optional[str] = None
    """Tool-use rows (``grpo_mega.data.tool_task``): the field holding the response as a list of segments
    ``{"text": str, "tool": bool}``, the policy's turns and the tool turns of a multi-turn trajectory. Each segment is
    encoded on its own, as the multi-turn rollout encodes its turns (token in, token out), and tool segments carry
    no loss; EOS ends the response. The prompt is ``prompt_field``; needs ``chat_template: false`` (the fallback
    tool format). None: prompt/response or conversation rows."""
    chat_template: bool = False
    """Render examples with the tokenizer's chat template exactly as GRPO's ``data.chat_template`` renders prompts:
    the loss is on the assistant turn (through its end-of-turn token) only. Set it for a chat / instruct model."""
    max_length: int = 512
    """Longest prompt + response in tokens; longer rows are reported and handled per ``on_bad_row``."""
    on_bad_row: str = "skip"
    """A row longer than ``max_length`` or malformed: ``skip`` (report file:line and go on) or ``error`` (stop at start-up)."""


@dataclass
class SFTTrainerConfig(RunConfig):
    """The run settings (``RunConfig``) plus the batch size."""

    run_dir: str = "runs/sft"
    total_steps: int = 1000
    batch_size: int = 64
    """Sequences per optimizer step."""


@dataclass
class SFTConfig:
    engine: str = "megatron"
    """Training engine: ``megatron`` (TP / PP / DP) or ``deepspeed`` (ZeRO over data parallel on the HF model;
    ``parallel.tensor`` and ``parallel.pipeline`` 1, settings in ``deepspeed``; N processes with ``--nproc N``)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
