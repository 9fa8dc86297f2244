"""Supervised fine-tuning of the policy on (prompt, response) rows, on the same engine as GRPO (``engine``:
Megatron or DeepSpeed).

``grpo-mega sft --config FILE [key=value ...]``: the loss is the token-mean negative log-likelihood of the
response tokens (prompt tokens are context only), normalised over the global batch. Tool-use rows
(``data.segments_field``) are encoded turn by turn as the multi-turn rollout encodes them, and their tool turns
are context only too. Examples are rendered as GRPO
renders its prompts (``grpo_mega.data.chat``), so ``data.chat_template`` gives a chat model its own format in both.
Resume, saves and stopping early are GRPO's (``grpo_mega.harness.lifecycle``): SIGTERM / SIGUSR1 / SIGUSR2 or
``trainer.save_before_seconds`` before the time limit save the step in flight and exit with status 3; the same
command resumes exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from grpo_mega.checkpoint.initial_weights import load_initial_weights
from grpo_mega.config import SFTConfig, SFTDataConfig
from grpo_mega.data.batch import sequences_to_batch
from grpo_mega.data.chat import ChatFormat, ChatFormatError, check_messages, user_turn
from grpo_mega.data.fields import field_value
from grpo_mega.data.prompts import BadRows, check_row, read_rows
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.engine import LossScale, build_policy_engine
from grpo_mega.model.config_map import load_model_hf_config
from grpo_mega.harness.lifecycle import RunHarness
from grpo_mega.harness.resume import trainer_state

logger = logging.getLogger(__name__)


def sft_loss(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor], scale: LossScale):
    """``-sum(log p(response tokens)) / global response tokens`` (this micro-batch's share)."""
    mask = micro["loss_mask"].to(outputs["logprobs"].dtype)
    loss = -(outputs["logprobs"] * mask).sum() / scale.global_tokens
    return loss, {"sft/nll": loss.detach()}


def sft_messages(row: dict, data: SFTDataConfig) -> list[dict]:
    """The conversation of one checked row: its ``data.messages_field`` list, or user = prompt field and
    assistant = response field."""
    if data.messages_field is not None:
        return row[data.messages_field]
    return [{"role": "user", "content": field_value(row, data.prompt_field)},
            {"role": "assistant", "content": field_value(row, data.response_field)}]


def check_sft_row(row, data: SFTDataConfig) -> str | None:
    """Why a row cannot be an SFT example, naming the config key to change; None when it can."""
    if data.segments_field is not None:
        return _check_segments_row(row, data)
    if data.messages_field is None:
        error = check_row(row, data.prompt_field, data.response_field, answer_key="data.response_field",
                          answer_kind="response")
        response = field_value(row, data.response_field) if error is None else None
        if error is None and not isinstance(response, str):
            error = f"response field {data.response_field!r} must be a string, got {response!r:.60}"
        return error
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if data.messages_field not in row:
        return (f"missing messages field {data.messages_field!r}; set data.messages_field to the field that holds "
                f"the conversation, or data.messages_field=null for prompt/response rows (this row has {sorted(row)})")
    try:
        check_messages(row[data.messages_field], final_role="assistant")
    except ChatFormatError as error:
        return f"{data.messages_field}: {error}"
    return None


def _check_segments_row(row, data: SFTDataConfig) -> str | None:
    """``check_sft_row`` for tool-use rows: a prompt string and a valid segment list."""
    from grpo_mega.data.tool_task import check_segments

    error = check_row(row, data.prompt_field, None)
    if error is None and data.segments_field not in row:
        error = (f"missing segments field {data.segments_field!r}; set data.segments_field to the field that holds "
                 f"the tool-use response, or data.segments_field=null for prompt/response rows (this row has "
                 f"{sorted(row)})")
    elif error is None:
        try:
            check_segments(row[data.segments_field], where=f"segments field {data.segments_field!r}")
        except ValueError as bad:
            error = str(bad)
    return error


def load_sft_examples(cfg: SFTConfig, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Tokenized (prompt, response) pairs (``load_sft_data`` without the response masks)."""
    prompts, responses, _ = load_sft_data(cfg, tokenizer)
    return prompts, responses


def load_sft_data(cfg: SFTConfig, tokenizer) -> tuple[list[list[int]], list[list[int]], list[list[int]] | None]:
    """Tokenized (prompts, responses, response loss masks or None); bad rows are reported with file:line and
    skipped or raised.

    Rows are conversations (``data.messages_field``) or prompt/response pairs, rendered by
    ``grpo_mega.data.chat.ChatFormat``: with ``data.chat_template`` the prompt is the chat template up to the
    assistant's generation prompt (what GRPO gives the policy) and the response is the last assistant turn through
    its end-of-turn token; earlier turns are context. Only the response tokens carry the loss. With
    ``data.segments_field`` the response is a tool-use trajectory encoded segment by segment
    (``grpo_mega.data.tool_task.encode_segments``) and the masks are 0 on its tool turns; otherwise the masks are
    None (every response token carries the loss)."""
    data = cfg.data
    if data.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"data.chat_template=true but the tokenizer ({cfg.model.tokenizer or cfg.model.hf_config}) "
                         "has no chat template: set data.chat_template=false or use a tokenizer that has one")
    chat = ChatFormat(tokenizer, use_chat_template=data.chat_template)
    prompts, responses, masks = [], [], []
    bad_rows = BadRows(data.on_bad_row)
    for location, row, error in read_rows(data.train_file):
        error = error or check_sft_row(row, data)
        mask = None
        if error is None and data.segments_field is not None:
            prompt, response, mask = _render_segments_example(chat, row, data)
        elif error is None:
            try:
                prompt, response = chat.render_example(sft_messages(row, data))
            except ChatFormatError as format_error:
                error = str(format_error)
        if error is None and len(prompt) + len(response) > data.max_length:
            error = f"{len(prompt) + len(response)} tokens, more than data.max_length={data.max_length}"
        if error is not None:
            bad_rows.reject(location, error)
            continue
        prompts.append(prompt)
        responses.append(response)
        masks.append(mask)
    bad_rows.finish(len(prompts), str(data.train_file))
    return prompts, responses, (masks if data.segments_field is not None else None)


def _render_segments_example(chat: ChatFormat, row: dict, data: SFTDataConfig):
    """(prompt ids, response ids, response mask) of a checked tool-use row: the prompt as GRPO renders it (plain
    format), the response segment by segment with EOS appended."""
    from grpo_mega.data.tool_task import check_segments, encode_segments

    _, prompt = chat.render_prompt(user_turn(field_value(row, data.prompt_field)))
    segments = check_segments(row[data.segments_field], where=data.segments_field)
    response, mask = encode_segments(chat.tokenizer, segments, chat.tokenizer.eos_token_id)
    return prompt, response, mask


def run_sft(cfg: SFTConfig) -> Path:
    """Train, checkpoint on schedule and at the end; returns the final checkpoint folder. Raises ``StoppedEarly``
    after saving the step in flight when a stop signal arrived (on any rank) or the time limit came near
    (``grpo_mega.harness.lifecycle``)."""
    harness = RunHarness(cfg, command="grpo-mega sft")
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_config)
    # Data first: a bad file fails in seconds, before the model is built.
    prompts, responses, masks = load_sft_data(cfg, tokenizer)
    harness.startup.mark("data")
    engine = build_policy_engine(
        load_model_hf_config(cfg.model),
        optim=cfg.optim,
        total_steps=cfg.trainer.total_steps,
        max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch,
        logprob_chunk_size=cfg.model.logprob_chunk_size,
        logits_in_fp32=cfg.model.logits_in_fp32,
        engine_kind=cfg.engine,
        deepspeed=cfg.deepspeed,
        sequence_parallel=cfg.parallel.sequence_parallel,
        recompute=cfg.parallel.recompute,
        distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    harness.startup.mark("model_build")
    initial_weights = (lambda: load_initial_weights(engine, cfg.model.init_from)) if cfg.model.init_from else None
    harness.start(engine, state=trainer_state("sft"), initial_weights=initial_weights, shown={"nll": "sft/nll"})
    for step in harness.steps():
        # The rows of step s depend only on (seed, s): a resumed run sees the batches it would have seen.
        rows = np.random.default_rng([cfg.parallel.seed, step]).choice(len(prompts), cfg.trainer.batch_size)
        batch = sequences_to_batch([prompts[i] for i in rows], [responses[i] for i in rows], tokenizer.pad_token_id,
                                   None if masks is None else [masks[i] for i in rows])
        metrics = engine.train_step(batch, sft_loss)
        engine.lr_schedule_step()  # one optimizer step and one schedule step per SFT step
        harness.end_step(step, metrics)
    return harness.finish()
