"""The text of a tool turn: what the turn loop appends after a policy turn that ended in a call (loss mask 0).

Token in, token out: the policy's sampled ids are never re-encoded; only this text is, and it is chosen so that
``policy tokens + encode(tool turn)`` equals the chat template's encoding of the conversation so far, the policy's
turns and the tool messages as they were written:

- **chat template** (``format: hermes`` and a tokenizer with one): the template's own rendering of a ``tool``
  message: ``render(conversation + [tool message], add_generation_prompt=True)`` after the assistant turn, i.e. the
  template's end of the assistant turn, the tool message and the next assistant header. It is taken from a dummy
  conversation whose assistant turn is a placeholder (what follows an assistant turn does not depend on its text in
  Qwen2.5, Qwen3, Llama 3 or SmolLM2's templates), and checked at start-up to begin at a token boundary (a special
  token), so encoding it alone gives the tokens the whole conversation's encoding has there.
  A template that knows no ``tool`` role (its source never says "tool": SmolLM2's) gets the output as a ``user``
  message ``<tool_response>\\nCONTENT\\n</tool_response>`` (how Qwen2.5 writes tool results), still through the
  template, so the stream stays the template's encoding of the conversation.
- **no chat template** (``format: hermes``): the documented fallback, raw text ``<tool_response>CONTENT</tool_response>``
  right after ``</tool_call>`` (the quickstart's tool regime).
- **code** (ToRL): the output and the closing fence, right after the policy's ```` ```output ````:
  ``"\\n" + CONTENT + "\\n```\\n"`` (no leading newline when the policy's turn already ends with one).

A tool's output longer than ``max_tool_response_tokens`` is cut on ``tool_response_truncate_side`` (left | right |
middle) and the cut is said in the text (``[... N tokens cut ...]``).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from grpo_mega.data.tool_format import FALLBACK_RESPONSE_CLOSE as FALLBACK_CLOSE
from grpo_mega.data.tool_format import FALLBACK_RESPONSE_OPEN as FALLBACK_OPEN
from grpo_mega.data.tool_format import fallback_tool_turn_text

TRUNCATE_SIDES = ("left", "right", "middle")
PLACEHOLDER = "\u2063TURN-LOOP-PLACEHOLDER\u2063"
"""The dummy assistant turn's text (invisible separators make it a string no template or tool writes)."""


def cap_tool_output(content: str, tokenizer: Any, max_tokens: int, side: str) -> str:
    """``content`` cut to ``max_tokens`` of its tokens on ``side`` (left: keep the end; right: keep the start;
    middle: keep both ends), with the number of tokens cut said where the cut is."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got {side!r}")
    ids = tokenizer.encode(content, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return content
    cut = len(ids) - max_tokens

    def text(part):
        return tokenizer.decode(part, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    if side == "right":
        return text(ids[:max_tokens]) + f"\n[... {cut} tokens cut]"
    if side == "left":
        return f"[{cut} tokens cut ...]\n" + text(ids[len(ids) - max_tokens:])
    head = max_tokens // 2
    return text(ids[:head]) + f"\n[... {cut} tokens cut ...]\n" + text(ids[len(ids) - (max_tokens - head):])


class ToolTurns(Protocol):
    """Writes the text of the tool turn that answers a policy turn."""

    def text(self, outputs: Sequence[str], turn_text: str) -> str:
        """The tool turn for the (capped) ``outputs`` of the calls of a turn whose text was ``turn_text``."""
        ...


class TemplateToolTurns:
    """The chat template's rendering of tool messages after an assistant turn (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.role = "tool" if "tool" in str(tokenizer.chat_template) else "user"
        self.check_token_boundary()

    def messages(self, outputs: Sequence[str]) -> list[dict]:
        """The messages that carry ``outputs`` in this template's conversation."""
        if self.role == "tool":
            return [{"role": "tool", "content": output} for output in outputs]
        return [{"role": "user", "content": "\n".join(f"{FALLBACK_OPEN}\n{o}\n{FALLBACK_CLOSE}" for o in outputs)}]

    def text(self, outputs: Sequence[str], turn_text: str = "") -> str:
        conversation = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": PLACEHOLDER},
                        *self.messages(outputs)]
        rendered = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        at = rendered.find(PLACEHOLDER)
        if at < 0:
            raise ValueError("the chat template does not write an assistant turn's text as given; use a template that "
                             "does, or no chat template (the <tool_response> fallback)")
        return rendered[at + len(PLACEHOLDER):]

    def check_token_boundary(self) -> None:
        """ValueError unless the tool turn encodes alone to the tokens it has inside the whole conversation."""
        before = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A call."}], tokenize=False,
            add_generation_prompt=False)
        head = before[:before.find("A call.") + len("A call.")]
        turn = self.text(["42"])

        def encode(text):
            return self.tokenizer.encode(text, add_special_tokens=False)

        if encode(head + turn) != encode(head) + encode(turn):
            raise ValueError(f"the chat template's tool turn {turn[:40]!r} does not start at a token boundary, so "
                             "appending it would change the policy's tokens; use format=code or no chat template")


class RawToolTurns:
    """The fallback without a chat template: ``<tool_response>CONTENT</tool_response>`` after the call."""

    def text(self, outputs: Sequence[str], turn_text: str = "") -> str:
        return "".join(fallback_tool_turn_text(output) for output in outputs)  # the SFT demonstrations' form


class CodeToolTurns:
    """ToRL's output block after ```` ```output ````."""

    def text(self, outputs: Sequence[str], turn_text: str = "") -> str:
        return ("" if turn_text.endswith("\n") else "\n") + "\n".join(outputs) + "\n```\n"


def tool_turns_for(fmt: str, tokenizer: Any, *, use_chat_template: bool | None = True) -> ToolTurns:
    """The tool-turn writer of a format and tokenizer: ``code`` -> ToRL's block; ``hermes`` -> the chat template's
    tool message when the tokenizer has a template (and ``use_chat_template`` is not False), else the raw
    ``<tool_response>`` fallback."""
    if fmt == "code":
        return CodeToolTurns()
    if use_chat_template is not False and getattr(tokenizer, "chat_template", None):
        return TemplateToolTurns(tokenizer)
    return RawToolTurns()
