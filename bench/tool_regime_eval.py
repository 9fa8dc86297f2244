"""An evaluation harness for the tool regime's SFT policies (``grpo-mega quickstart --regime tools``) that SUPPLIES
THE CALCULATOR'S ANSWERS, until the multi-turn rollout loop (``rollout.multi_turn``, issue 75) is merged and
replaces it: it is a bench tool, not the sandbox and not the turn loop.

One trajectory, token in / token out as the rollout loop does it: sample the policy's tokens (temperature 1 by
default) until EOS, the token budget, or the decoded turn containing ``</tool_call>``; then parse the hermes call,
compute the calculator's result IN-PROCESS with exact Python integer arithmetic on the parsed expression (only
integers, + - * and parentheses), append the fallback tool turn ``<tool_response>RESULT</tool_response>`` encoded on
its own, prefill it into the KV cache, and continue. The outcome is the synthetic reward on the decoded response,
tool turns included. ``supply_answers=False`` lets the policy run on past its calls with nothing appended (the tool
policy without its tool).
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo_mega.data.tool_format import TOOL_CALL_CLOSE, fallback_tool_turn_text, parse_hermes_call
from grpo_mega.data.tool_task import CALCULATOR

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def exact_calculator(expression: str) -> int:
    """The integer value of ``expression`` (integers, + - *, unary minus, parentheses); ValueError otherwise."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported expression {expression!r:.60}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r:.60}") from None
    return value(tree.body)


def calculator_turn(policy_turn: str) -> tuple[str, str | None]:
    """(the tool's output, the error kind or None) for a policy turn ending with a call."""
    try:
        name, arguments = parse_hermes_call(policy_turn)
    except ValueError as error:
        return f"error: {error}", "invalid_call"
    if name != CALCULATOR:
        return f"error: unknown tool {name!r}", "unknown_tool"
    if set(arguments) != {"expression"} or not isinstance(arguments["expression"], str):
        return 'error: the calculator takes one string argument "expression"', "bad_arguments"
    try:
        return str(exact_calculator(arguments["expression"])), None
    except ValueError as error:
        return f"error: {error}", "exception"


@dataclass
class Trajectory:
    """One rollout: its response token ids with the loss mask a trainer would use (0 on tool turns)."""

    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    """Ended with EOS (not the token budget or the turn limit)."""


def load_sft_policy(checkpoint: str | Path, model_dir: str | Path):
    """A grpo-mega (Megatron-engine) SFT checkpoint or run directory as an fp32 HF ``Qwen2ForCausalLM`` in eval
    mode; the process's megatron state is initialised once (1 process, CPU)."""
    from megatron.core import parallel_state
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.checkpoint.training_files import find_checkpoint_folder
    from grpo_mega.checkpoint.weights_only import read_checkpoint_model
    from grpo_mega.engine.deepspeed_weights import MegatronShadow
    from grpo_mega.parallel.distributed import init_distributed

    if not parallel_state.model_parallel_is_initialized():
        init_distributed(1, 1, seed=0, device="cpu")
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    shadow = MegatronShadow(hf_config)
    weights = shadow.hf_weights(read_checkpoint_model(shadow.sharded_state_dict(),
                                                      find_checkpoint_folder(checkpoint)))
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise ValueError(f"{checkpoint}: weights do not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def rollout(model, tokenizer, prompt_ids: list[int], *, seed: int, temperature: float = 1.0,
            max_tokens: int = 220, max_turns: int = 6, supply_answers: bool = True) -> Trajectory:
    """One trajectory of ``model`` from ``prompt_ids`` (see the module docstring); ``max_tokens`` bounds the
    response, tool turns included, and ``max_turns`` the policy's turns."""
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    cache, logits = out.past_key_values, out.logits[0, -1]
    trajectory, turn, turns = Trajectory(), [], 1
    while len(trajectory.response_ids) < max_tokens:
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(logits.argmax())
        trajectory.response_ids.append(token)
        trajectory.mask.append(1)
        if token == eos:
            trajectory.finished = True
            break
        turn.append(token)
        feed = [token]
        if supply_answers and TOOL_CALL_CLOSE in tokenizer.decode(turn[-12:]):
            trajectory.calls += 1
            content, error = calculator_turn(tokenizer.decode(turn))
            if error is not None:
                trajectory.errors[error] = trajectory.errors.get(error, 0) + 1
            tool = list(tokenizer.encode(fallback_tool_turn_text(content), add_special_tokens=False))
            trajectory.response_ids += tool
            trajectory.mask += [0] * len(tool)
            feed += tool
            turn, turns = [], turns + 1
            if turns > max_turns or len(trajectory.response_ids) >= max_tokens:
                break
        out = model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
    return trajectory
