"""One rendering of a conversation into the policy's tokens, shared by GRPO's prompts and SFT's examples.

GRPO gives the policy ``render_prompt(...)`` and lets it write the response; SFT trains on ``render_example(...)``,
whose prompt part is exactly what GRPO would give for the same conversation and whose response part is what the
policy should write after it (the assistant turn, through its end-of-turn token). So a chat model is SFT'd and
GRPO'd in one format.

With ``use_chat_template`` the tokenizer's chat template writes the text (its default system prompt included when
the conversation has no system turn) and no special tokens are added when tokenizing, since the template writes
its own. Without it, the prompt is ``prompt_format`` filled with the user's text and tokenized with the
tokenizer's special tokens (a BOS, if it adds one), and the response is the assistant's text followed by EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

ROLES = ("system", "user", "assistant")


class ChatFormatError(ValueError):
    """A conversation that cannot be rendered (bad roles, no final assistant turn, a template that breaks the
    prompt/response split); the message says what to change."""


@dataclass(frozen=True)
class ChatFormat:
    """How conversations become text: the tokenizer's chat template, or a plain format string."""

    tokenizer: Any
    use_chat_template: bool = True
    prompt_format: str = "{prompt}"
    tools: tuple | None = None
    """JSON schemas of the tools the policy may call (``rollout.multi_turn``), given to the chat template as
    ``tools=`` (where the template lists them: Qwen's system prompt, Llama 3's first user turn)."""

    def __post_init__(self) -> None:
        if "{prompt}" not in self.prompt_format:
            raise ValueError(f"prompt_format must contain '{{prompt}}', got {self.prompt_format!r}")

    @property
    def uses_chat_template(self) -> bool:
        return bool(self.use_chat_template and getattr(self.tokenizer, "chat_template", None))

    def render_prompt(self, messages: Sequence[dict]) -> tuple[str, list[int]]:
        """(text, ids) the policy is given for ``messages`` (ending with a user turn), its generation prompt
        included."""
        check_messages(messages, final_role="user")
        if self.uses_chat_template:
            tools = {"tools": list(self.tools)} if self.tools else {}
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                      **tools)
            return text, self._ids(text, special=False)
        if len(messages) != 1:
            fix = ("the tokenizer has no chat template: use a tokenizer that has one (model.tokenizer)"
                   if self.use_chat_template else "set data.chat_template=true for conversations")
            raise ChatFormatError(f"a plain prompt_format renders one user turn, got roles "
                                  f"{[m['role'] for m in messages]}: {fix}")
        text = self.prompt_format.format(prompt=messages[0]["content"])
        return text, self._ids(text, special=True)

    def render_example(self, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of a conversation ending with an assistant turn: the prompt is
        ``render_prompt`` of the turns before it, the response that turn as the template writes it, up to and
        including the first EOS (the token a rollout stops at); EOS is appended when the template writes none."""
        check_messages(messages, final_role="assistant")
        prompt_text, prompt_ids = self.render_prompt(messages[:-1])
        eos = self.tokenizer.eos_token_id
        if self.uses_chat_template:
            full = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False)
            if not full.startswith(prompt_text):
                raise ChatFormatError(
                    "the chat template writes the conversation's earlier turns differently when an assistant turn "
                    f"follows ({prompt_text[-60:]!r} is not a prefix of the full text), so the response cannot be "
                    "split off the prompt GRPO would see; use a template whose generation prompt is a prefix")
            response = self._ids(full[len(prompt_text):], special=False)
        else:
            response = self._ids(messages[-1]["content"], special=False)
        if eos in response:
            return prompt_ids, response[: response.index(eos) + 1]
        return prompt_ids, response + [eos]

    def _ids(self, text: str, *, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])


def check_messages(messages: Any, *, final_role: str) -> None:
    """ChatFormatError unless ``messages`` is a non-empty list of {role, content} with known roles, a system turn
    only first, and ``final_role`` last."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"messages must be a non-empty list of {{role, content}} objects, got {messages!r:.80}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ChatFormatError(f"message {index} must be an object with a string 'content', got {message!r:.80}")
        if message.get("role") not in ROLES:
            raise ChatFormatError(f"message {index} has role {message.get('role')!r}; expected one of {ROLES}")
        if message["role"] == "system" and index > 0:
            raise ChatFormatError(f"message {index} is a system turn; only the first message may be one")
    if messages[-1]["role"] != final_role:
        raise ChatFormatError(f"the last message must be the {final_role}'s turn, got {messages[-1]['role']!r}")


def user_turn(text: str) -> list[dict]:
    """The conversation of a plain prompt: one user turn."""
    return [{"role": "user", "content": text}]
