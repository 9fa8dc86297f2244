"""The multi-turn turn loop (``grpo_mega.rollout.turn_loop``) through the engine seam with a scripted policy and an
in-test calculator: token in / token out, the masks, tools run once per turn for all rows, the limits (max_turns,
per-turn tokens, the response budget, the tool output cap), invalid calls, the code format, the metrics, the
fields surviving every copy of a completion, the training mask (loss, KL, entropy and log-prob diff never read a
tool token) and the config's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_mega.config import AlgorithmConfig, GRPOConfig
from grpo_mega.config.cross_field import validate_multi_turn
from grpo_mega.config.loading import ConfigError
from grpo_mega.config.turn_checks import validate_turn_credit
from grpo_mega.data.tokenizer import train_tokenizer
from grpo_mega.data.prompts import PromptRecord
from grpo_mega.engine.base import LossScale
from grpo_mega.rollout.base import Completion, SamplingConfig
from grpo_mega.rollout.tool_turns import cap_tool_output
from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings, _Row
from grpo_mega.rollout.turn_metrics import turn_metrics
from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn
from grpo_mega.stages.rollout import RolloutBatch, row_tool_kwargs
from grpo_mega.stages.rollout_feed import batch_from_state, batch_state
from grpo_mega.stages.training_batch import build_training_batch
from turn_loop_doubles import Calculator, ScriptedEngine

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
TEXTS = ["Q: what is 12 * 34? A: The answer is 408.", CALL % "12 * 34", "<tool_response>408</tool_response>",
         "Let me compute. ```python\nprint(6 * 7)\n```\n```output\n42\n```\n"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE (the repo's offline tokenizer) with the hermes tags as plain added tokens (as Qwen2.5's
    are: not special, so they stay in the text and stop strings see them); EOS ``</s>``, no chat template."""
    tok = train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=400)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tok


def two_turns(prompt, sample, turn, prefix):
    """Call the calculator on 3 * (prompt + 1) * (sample + 2), then answer."""
    if turn == 0:
        return f"I will compute. {CALL % f'3 * {prompt + 1} * {sample + 2}'}"
    return f"The answer is {3 * (prompt + 1) * (sample + 2)}.</s>"


def run(tokenizer, script, prompts=2, n=2, toolset=None, encode=None, tool_kwargs=None, context=None, **settings):
    engine = ScriptedEngine(tokenizer, script, encode)
    engine.context_length = context
    toolset = toolset or Calculator()
    loop = TurnLoopEngine(engine, toolset, tokenizer, TurnLoopSettings(**{"max_response_tokens": 200, **settings}))
    prompt_ids = [tokenizer.encode(f"Q{p}: compute. A:", add_special_tokens=False) for p in range(prompts)]
    out = loop.generate(prompt_ids, SamplingConfig(n=n, max_new_tokens=200, seed=5), tool_kwargs=tool_kwargs)
    return out, engine, toolset, loop


def test_token_in_token_out_with_tool_turns_masked(tokenizer):
    # the policy writes "The answer" as single-character tokens: not the canonical encoding, kept as sampled
    def spelled(text):
        if not text.startswith("The answer"):
            return tokenizer.encode(text, add_special_tokens=False)
        body = text.removesuffix("</s>")
        return [i for ch in body for i in tokenizer.encode(ch, add_special_tokens=False)] + [tokenizer.eos_token_id]

    completions, engine, toolset, _ = run(tokenizer, two_turns, encode=spelled)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]  # grouped like any engine's
    for row, c in enumerate(completions):
        first, second = c.turns
        assert first.ended == "tool_call" and second.ended == "answer" and c.finish_reason == "eos"
        value = 3 * (c.prompt_index + 1) * (row % 2 + 2)
        assert first.calls[0].arguments == {"expression": f"3 * {c.prompt_index + 1} * {row % 2 + 2}"}
        tool = c.response_ids[first.end:first.tool_end]
        assert tokenizer.decode(tool) == f"<tool_response>{value}</tool_response>"
        assert c.response_mask == [1] * first.end + [0] * len(tool) + [1] * (second.end - second.start)
        assert second.start == first.tool_end and second.end == len(c.response_ids)
        # policy tokens carry the engine's log-probs, exactly; tool tokens 0
        assert c.response_logprobs[:first.end] == [-0.01 * (k + 1) for k in range(first.end)]
        assert c.response_logprobs[first.end:first.tool_end] == [0.0] * len(tool)
        assert c.response_logprobs[second.start:] == [-0.01 * (k + 1) for k in range(second.end - second.start)]
        # the answer's ids are the policy's spelled-out ids, not the canonical encoding of its text
        assert c.response_ids[second.start:] == spelled(f"The answer is {value}.</s>")
        assert c.response_ids[second.start:] != tokenizer.encode(f"The answer is {value}.</s>",
                                                                 add_special_tokens=False)
        assert c.text == tokenizer.decode(c.response_ids, skip_special_tokens=True)  # the reward sees the tool turn
        assert f"<tool_response>{value}</tool_response>The answer is {value}." in c.text
    # turn 1: one call of n=G over the prompts; turn 2: n=1 over each row's whole prefix, another seed
    (prompts1, sampling1), (prompts2, sampling2) = engine.calls
    assert sampling1.n == 2 and sampling1.seed == 5 and "</tool_call>" in sampling1.stop
    assert sampling2.n == 1 and sampling2.seed != 5 and len(prompts2) == 4
    assert prompts2[0] == completions[0].prompt_ids + completions[0].response_ids[:completions[0].turns[0].tool_end]
    # every row's call ran in one ToolSet.run
    assert len(toolset.runs) == 1 and len(toolset.runs[0][0]) == 4


def test_tool_kwargs_reach_each_rows_call_and_verl_rows_are_read(tokenizer):
    kwargs = [{"calculator": {"precision": 0}}, {}]
    _, _, toolset, _ = run(tokenizer, two_turns, tool_kwargs=kwargs)
    assert toolset.runs[0][1] == [{"precision": 0}, {"precision": 0}, {}, {}]
    verl = {"extra_info": {"tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": "72"},
                                                     "execute_kwargs": {"mode": "x"}}}}}
    assert row_tool_kwargs(verl) == {"calc": {"ground_truth": "72", "mode": "x"}}
    assert row_tool_kwargs({"tools_kwargs": {"calc": {"a": 1}}}) == {"calc": {"a": 1}}
    assert row_tool_kwargs({}) == {}


def test_invalid_calls_are_shown_to_the_policy_and_not_run(tokenizer):
    def script(prompt, sample, turn, prefix):
        if turn == 0:
            return "<tool_call>{not json}</tool_call>" if sample == 0 else CALL.replace("calculator", "abacus") % "1"
        return "I give up.</s>"

    completions, _, toolset, _ = run(tokenizer, script, prompts=1)
    bad, unknown = completions
    assert bad.turns[0].calls[0].error == "invalid_call" and "not valid JSON" in bad.text
    assert unknown.turns[0].calls[0].error == "unknown_tool"  # the toolset's own verdict
    assert [c.name for c in toolset.runs[0][0]] == ["abacus"]  # the invalid call never reached the tools
    assert bad.turns[1].ended == "void" and unknown.turns[1].ended == "void"  # neither a call nor an answer


def test_max_turns_ends_a_rollout_without_running_its_last_call(tokenizer):
    def always_call(prompt, sample, turn, prefix):
        return CALL % f"{turn} + 1"

    completions, engine, toolset, _ = run(tokenizer, always_call, prompts=1, n=1, max_turns=3)
    (c,) = completions
    assert [t.ended for t in c.turns] == ["tool_call", "tool_call", "max_turns"]
    assert len(engine.calls) == 3 and len(toolset.runs) == 2 and c.turns[2].tool_end is None
    assert c.response_mask[-1] == 1 and c.finish_reason == "stop"
    assert turn_metrics(completions)["tools/max_turns_fraction"] == 1.0


def test_the_response_budget_counts_tool_turns_and_cuts_rows_separately(tokenizer):
    def script(prompt, sample, turn, prefix):
        return CALL % "2 * 3" if turn == 0 else ("The answer is 6. " * (1 + 20 * sample)) + "</s>"

    probe, *_ = run(tokenizer, script, prompts=1, n=1)
    budget = probe[0].turns[0].tool_end + 12
    completions, *_ = run(tokenizer, script, prompts=1, max_response_tokens=budget)
    short, long = completions
    assert short.finish_reason == "eos" and len(short.response_ids) < budget
    assert long.finish_reason == "length" and len(long.response_ids) == budget and long.turns[1].ended == "length"
    # a tool turn that would leave no token to answer with is not appended
    tight, *_ = run(tokenizer, script, prompts=1, n=1, max_response_tokens=probe[0].turns[0].tool_end)
    assert tight[0].finish_reason == "length" and tight[0].turns[0].tool_end is None
    assert tight[0].response_mask == [1] * tight[0].turns[0].end
    # a per-turn limit cuts the turn ("length") and ends the rollout
    capped, *_ = run(tokenizer, script, prompts=1, n=1, max_tokens_per_turn=5)
    assert capped[0].turns[0].ended == "length" and len(capped[0].response_ids) == 5


def test_a_later_turn_never_asks_the_engine_past_the_context_and_each_row_keeps_its_own_budget(tokenizer):
    """Rows that reach their next turn at different lengths: one engine call with the largest row's budget would ask
    for the longest prefix plus that budget, past a context of the longest prompt plus the budget (the hf engine
    refuses such a call); the loop splits the turn into calls that stay within the engine's context_length, and no
    row is cut short of its own budget."""
    def script(prompt, sample, turn, prefix):
        if turn == 0:
            return "Let me think. " * (1 + 6 * sample) + CALL % "2 * 3"
        return "The answer is 6. " * 40 + "</s>"

    budget = 150
    context = max(len(tokenizer.encode(f"Q{p}: compute. A:", add_special_tokens=False)) for p in range(2)) + budget
    completions, engine, *_ = run(tokenizer, script, prompts=2, n=3, max_response_tokens=budget, context=context)
    (first_prompts, _), *later = engine.calls
    assert later and all(max(len(p) for p in prompts) + sampling.max_new_tokens <= context
                         for prompts, sampling in later)
    assert len(later) > 1  # one call would not have fitted
    assert all(c.finish_reason == "length" and len(c.response_ids) == budget for c in completions)


class RecordingEngine:
    """An engine that returns one empty completion per prompt and records each call's prompts and sampling."""

    def __init__(self, context_length):
        self.context_length, self.calls = context_length, []

    def generate(self, prompt_ids, sampling):
        self.calls.append(([list(p) for p in prompt_ids], sampling))
        return [Completion(i, list(p), [], [], "", "stop") for i, p in enumerate(prompt_ids)]


def test_a_later_turns_calls_are_the_fewest_within_the_context_longest_prefix_first():
    """``_continue``'s split on 200 rows of random prefixes and budgets: each call takes the next rows, longest prefix
    first, while its longest prefix plus the largest limit of its rows stays within the context (as many rows as
    fit, so as few calls as a greedy split gives), its max_new_tokens that largest limit, each call's rows in the
    loop's order; the loop returns the rows in call order."""
    generator = torch.Generator().manual_seed(0)
    per_turn, budget, context = 100, 90, 140  # each row fits alone: prompt + budget <= context
    rows = []
    for index in range(200):
        prompt, response = torch.randint(1, 50, (2,), generator=generator).tolist()
        rows.append(_Row(index, [7] * prompt, {}, response_ids=[8] * response))
    engine = RecordingEngine(context)
    loop = TurnLoopEngine(engine, Calculator(), None, TurnLoopSettings(max_response_tokens=budget, max_turns=3),
                          tool_turns=object())
    returned, outputs = loop._continue(rows, SamplingConfig(n=4, seed=5), [], per_turn, context, turn=1)

    limit = {row.prompt_index: min(per_turn, budget - len(row.response_ids)) for row in rows}
    prefix = {row.prompt_index: len(row.prompt_ids) + len(row.response_ids) for row in rows}
    expected, call = [], []
    for index in sorted(limit, key=lambda i: -prefix[i]):  # the greedy split, written out
        if call and prefix[call[0]] + max(limit[i] for i in call + [index]) > context:
            expected.append(call)
            call = []
        call.append(index)
    expected.append(call)
    assert len(engine.calls) == len(expected) > 1
    for (prompts, sampling), indices in zip(engine.calls, expected):
        assert [len(p) for p in prompts] == [prefix[i] for i in sorted(indices)]
        assert sampling.max_new_tokens == max(limit[i] for i in indices) and sampling.n == 1
        assert max(len(p) for p in prompts) + sampling.max_new_tokens <= context
    assert [row.prompt_index for row in returned] == [i for indices in expected for i in sorted(indices)]
    assert len(outputs) == len(rows)


@pytest.mark.parametrize("side,kept", [("right", "start"), ("left", "end"), ("middle", "both")])
def test_long_tool_outputs_are_cut_on_the_configured_side_and_say_so(tokenizer, side, kept):
    text = " ".join(str(n) for n in range(200))
    capped = cap_tool_output(text, tokenizer, 20, side)
    assert "tokens cut" in capped and len(tokenizer.encode(capped, add_special_tokens=False)) < 60
    assert capped.startswith("0 1") == (kept in ("start", "both"))
    assert capped.endswith("198 199") == (kept in ("end", "both"))
    assert cap_tool_output("42", tokenizer, 20, side) == "42"

    class Long(Calculator):
        def run(self, calls, kwargs=None):
            return [type(r)(text) for r in super().run(calls, kwargs)]

    completions, *_ = run(tokenizer, two_turns, prompts=1, n=1, toolset=Long(), max_tool_response_tokens=20,
                          tool_response_truncate_side=side)
    assert "tokens cut" in completions[0].text


def test_the_code_format_runs_python_blocks_and_appends_their_output(tokenizer):
    def script(prompt, sample, turn, prefix):
        if turn == 0:
            return "Let me compute. ```python\n6 * 7\n```\n```output"
        return "The answer is 42.</s>"

    completions, _, toolset, _ = run(tokenizer, script, prompts=1, n=1, format="code")
    (c,) = completions
    assert toolset.runs[0][0][0].name == "python" and toolset.runs[0][0][0].arguments == {"code": "6 * 7"}
    assert c.text == "Let me compute. ```python\n6 * 7\n```\n```output\n42\n```\nThe answer is 42."
    assert tokenizer.decode(c.response_ids[c.turns[0].end:c.turns[0].tool_end]) == "\n42\n```\n"


def test_metrics_count_turns_calls_errors_voids_and_tool_tokens(tokenizer):
    def script(prompt, sample, turn, prefix):
        if sample == 0:
            return "No tools, no answer.</s>"
        return CALL % "2 * 3" if turn == 0 else "The answer is 6.</s>"

    completions, _, _, loop = run(tokenizer, script, prompts=1, toolset=Calculator(reward=0.5))
    metrics = turn_metrics(completions)
    assert metrics["num_turns/min"] == 1 and metrics["num_turns/max"] == 2 and metrics["num_turns/mean"] == 1.5
    assert metrics["tools/calls_per_rollout"] == 0.5 and metrics["tools/call_rate"] == 0.5
    assert metrics["tools/void_turn_fraction"] == pytest.approx(1 / 3) and metrics["tools/error_fraction"] == 0
    assert metrics["tools/reward_mean"] == 0.5 and completions[1].turns[0].calls[0].reward == 0.5
    masks = [m for c in completions for m in c.response_mask]
    assert metrics["tools/output_token_fraction"] == pytest.approx(1 - sum(masks) / len(masks))
    assert loop.pop_tool_seconds() > 0 and loop.pop_tool_seconds() == 0
    assert turn_metrics([Completion(0, [1], [2], [0.0], "x", "eos")]) == {}


def test_the_new_fields_survive_selection_concatenation_and_a_checkpoint(tokenizer):
    completions, *_ = run(tokenizer, two_turns)
    records = [PromptRecord(f"Q{p}", [1], "1", f"Q{p}", f"f:{p}") for p in range(2)]
    batch = RolloutBatch(records, completions, torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4))
    joined = RolloutBatch.concat(batch.select_groups([1]), batch.first_groups(1))
    assert joined.completions[0].turns == completions[2].turns and joined.completions[2].response_mask == \
        completions[0].response_mask
    restored = batch_from_state(batch_state(batch))  # asdict -> Completion(**): the async feed, a checkpoint
    assert restored.completions == completions


def loss_terms(batch):
    """The GRPO loss (policy loss + KL + entropy, TIS on) of a batch and its gradient w.r.t. the policy's
    log-probs, with made-up policy / reference log-probs that differ on every token."""
    torch.manual_seed(0)
    shape = batch["input_ids"].shape
    logp = (-torch.rand(shape)).requires_grad_(True)
    micro = {**batch, "old_logprobs": logp.detach() - 0.05, "ref_logprobs": logp.detach() + 0.1}
    settings = GRPOLossSettings(kl_coef=0.1, entropy_coef=0.01, rollout_is="tis")
    scale = LossScale(global_tokens=float(batch["loss_mask"].sum()), global_seqs=float(shape[0]))
    loss, metrics = grpo_loss_fn(settings)({"logprobs": logp, "entropy": torch.rand(shape)}, micro, scale)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def test_tool_tokens_get_no_loss_kl_entropy_advantage_or_gradient(tokenizer):
    completions, *_ = run(tokenizer, two_turns)
    records = [PromptRecord(f"Q{p}", [1], "1", f"Q{p}", f"f:{p}") for p in range(2)]
    algorithm = AlgorithmConfig(num_return_sequences_in_group=2)
    batch = RolloutBatch(records, completions, torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4))
    rows = build_training_batch(batch, algorithm, pad_id=0)
    for row, c in enumerate(completions):
        start = len(c.prompt_ids)
        response_loss_mask = rows["loss_mask"][row, start:start + len(c.response_ids)].tolist()
        assert response_loss_mask == c.response_mask and rows["loss_mask"][row, :start].sum() == 0
        tool = torch.tensor(c.response_mask) == 0
        assert (rows["advantages"][row, start:start + len(c.response_ids)][tool] == 0).all()
        assert (rows["advantages"][row, start:start + len(c.response_ids)][~tool] != 0).all()
    loss, grad, metrics = loss_terms(rows)
    # change what sits on the tool tokens: their rollout log-probs and advantages
    changed = {k: v.clone() for k, v in rows.items()}
    tool_positions = (rows["attention_mask"] == 1) & (rows["loss_mask"] == 0)
    for row, c in enumerate(completions):
        tool_positions[row, : len(c.prompt_ids)] = False  # the prompt: not a tool token
    assert tool_positions.sum() > 0
    changed["rollout_logprobs"][tool_positions] = -7.0
    changed["advantages"][tool_positions] = 3.0
    loss2, grad2, metrics2 = loss_terms(changed)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert (grad[tool_positions] == 0).all()  # no gradient reaches a tool token's log-prob
    for name in ("actor/pg_loss", "actor/entropy", "actor/tis_weight_mean", "actor/kl_loss"):
        assert torch.equal(metrics[name], metrics2[name]), name


def test_tool_specs_are_checked_before_launch_in_one_line(monkeypatch):
    import types

    from grpo_mega.config.preflight import check_tool_specs

    def check(specs):
        if "calculater" in specs:
            raise ValueError("unknown tool 'calculater' (did you mean 'calculator'?)")

    monkeypatch.setitem(__import__("sys").modules, "grpo_mega.tools", types.SimpleNamespace(check_tool_specs=check))
    config = GRPOConfig()
    config.rollout.multi_turn.tools = ["calculater"]
    check_tool_specs(config)  # multi-turn off: nothing is checked
    config.rollout.multi_turn.enable = True
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn.tools: unknown tool 'calculater'") as error:
        check_tool_specs(config)
    assert "\n" not in str(error.value)
    config.rollout.multi_turn.tools = ["calculator"]
    check_tool_specs(config)


def test_the_config_refuses_what_cannot_run_with_tools_in_one_line():
    def cfg(**multi_turn):
        config = GRPOConfig()
        config.rollout.multi_turn = dataclasses.replace(config.rollout.multi_turn,
                                                        **{"enable": True, "tools": ["calculator"], **multi_turn})
        return config

    validate_multi_turn(cfg())
    for config, message in [
        (cfg(tools=[]), "needs rollout.multi_turn.tools"),
        (cfg(format="code"), "add python to rollout.multi_turn.tools"),
        (cfg(format="json"), "rollout.multi_turn.format"),
        (cfg(max_turns=0), "max_turns=0 must be >= 1"),
        (cfg(tool_response_truncate_side="top"), "tool_response_truncate_side"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_multi_turn(config)
    process = cfg()
    process.algorithm.supervision = "process"
    validate_multi_turn(process)  # process supervision by turns: grpo_mega.config.turn_checks
    with pytest.raises(ConfigError, match="needs process_reward.steps=turns") as error:
        validate_turn_credit(process)
    assert "\n" not in str(error.value)
