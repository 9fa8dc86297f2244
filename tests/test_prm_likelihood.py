"""The likelihood PRM layout's pieces that need no model: the per-step minimum (``prm.heads.segment_min``), the
``step_ids`` of a rendered batch, and the config checks. Its scores against transformers at TP=2 / PP=2 are in
tests/test_prm_model.py; a whole quickstart with it in tests/test_quickstart.py. The head's output products run only
at the positions that predict a counted token: checked against every position's log-probs here, outputs and
gradients."""

from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_distributed

from grpo_mega.config import ConfigError
from prm.config import PRMConfig, validate_prm
from prm.heads import segment_min
from prm.rendering import RenderedExample
from prm.scoring import rendered_batch


def test_segment_min_is_the_minimum_of_each_rows_segment_at_each_of_its_positions():
    values = torch.tensor([[3.0, 1.0, 2.0, 5.0, 0.5], [4.0, 4.0, -1.0, 1.0, 9.0]], requires_grad=True)
    ids = torch.tensor([[1, 1, 2, 2, 0], [0, 1, 1, 2, 2]])
    out = segment_min(values, ids)
    # row 0: step 1 = min(3, 1), step 2 = min(2, 5), id 0 = 0.5; row 1: id 0 = 4, step 1 = min(4, -1), step 2 = 1
    assert out.tolist() == [[1.0, 1.0, 2.0, 2.0, 0.5], [4.0, -1.0, -1.0, 1.0, 1.0]]
    # reading each step at its last token sends the gradient to that step's smallest value only
    out[0, 1].backward(retain_graph=True)
    out[1, 4].backward()
    assert values.grad.tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]]


def test_segment_min_shares_the_gradient_between_ties_and_checks_shapes():
    values = torch.tensor([[2.0, 2.0, 3.0]], requires_grad=True)
    segment_min(values, torch.tensor([[1, 1, 1]]))[0, 2].backward()
    assert values.grad.tolist() == [[0.5, 0.5, 0.0]]
    with pytest.raises(ValueError, match="differ in shape"):
        segment_min(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long))


def test_rendered_batch_numbers_the_tokens_of_each_step():
    rendered = [RenderedExample(input_ids=[5, 6, 7, 8, 9, 10], tag_positions=[2, 5], step_starts=[1, 3]),
                RenderedExample(input_ids=[5, 6, 7], tag_positions=[2], step_starts=[2])]
    batch = rendered_batch(rendered, pad_id=0, targets=[[1.0, 0.0], [1.0]], step_ids=True)
    assert batch["step_ids"].tolist() == [[0, 1, 1, 2, 2, 2], [0, 0, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0]]
    assert "step_ids" not in rendered_batch(rendered, pad_id=0)  # the tagged layouts do not need them
    with pytest.raises(ValueError, match="row 0: the rendered example has no step_starts"):
        rendered_batch([RenderedExample(input_ids=[5, 6], tag_positions=[1])], pad_id=0, step_ids=True)


def test_the_likelihood_layout_takes_no_step_tag():
    cfg = PRMConfig()
    cfg.data.train_file = "labels.jsonl"
    cfg.prm.layout = "likelihood"  # the default step_tag " ки" is left in place
    with pytest.raises(ConfigError, match='prm.layout=likelihood scores the steps as the policy wrote them: set '
                                          'prm.step_tag to "" '):
        validate_prm(cfg)
    cfg.prm.step_tag = ""
    validate_prm(cfg)
    cfg.prm.layout = "classifier"
    with pytest.raises(ConfigError, match="prm.step_tag must be a non-empty string"):
        validate_prm(cfg)


def _head_against_every_position() -> dict:
    """``StepLikelihoodHead`` (products at the positions that predict a counted token only) against the same reduction
    of every position's log-probs, on random hidden states, with and without ``step_counted``."""
    from grpo_mega.model import vocab_parallel_logprobs_and_entropy
    from grpo_mega.parallel import init_distributed
    from prm.heads import StepLikelihoodHead, step_likelihood_outputs

    init_distributed(1, 1, seed=0, device="cpu")
    generator = torch.Generator().manual_seed(3)
    rows, length, hidden_size, vocab = 3, 17, 16, 37
    weight = (0.5 * torch.randn(vocab + 3, hidden_size, generator=generator)).requires_grad_()  # 3 padding rows
    backbone = SimpleNamespace(lm_output_weight=lambda: weight, unpadded_vocab_size=vocab)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    step_ids = torch.zeros(rows, length, dtype=torch.long)
    step_ids[0, 2:6], step_ids[0, 6:11] = 1, 2
    step_ids[1, 1:4], step_ids[1, 9:16] = 1, 2  # a gap between the steps (a tag, say)
    step_ids[2, 5:17] = 1  # a step to the row's end
    counted = torch.zeros(rows, length, dtype=torch.long)
    counted[0, 4:6], counted[1, 9:12], counted[2, 16] = 1, 1, 1
    differences = {}
    for name, step_counted in (("all tokens", None), ("result tokens", counted)):
        batch = {"input_ids": input_ids, "step_ids": step_ids}
        if step_counted is not None:
            batch["step_counted"] = step_counted
        hidden = torch.randn(length, rows, hidden_size, generator=generator).requires_grad_()
        got = StepLikelihoodHead(chunk_size=5)(backbone, hidden, batch)
        loss = (got["good_logprob"] * 0.7 + got["bad_logprob"].clamp(min=-30) * 0.3).sum()
        got_grads = torch.autograd.grad(loss, (hidden, weight))
        next_tokens = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=0)
        every, _ = vocab_parallel_logprobs_and_entropy(hidden, weight, next_tokens.t(), vocab_size=vocab, chunk_size=5)
        token_logprobs = torch.nn.functional.pad(every.t()[:, :-1], (1, 0), value=0.0)
        want = step_likelihood_outputs(token_logprobs, step_ids, step_counted)
        loss = (want["good_logprob"] * 0.7 + want["bad_logprob"].clamp(min=-30) * 0.3).sum()
        want_grads = torch.autograd.grad(loss, (hidden, weight))
        differences[name] = {
            "good": float((got["good_logprob"] - want["good_logprob"]).abs().max()),
            "bad": float((got["bad_logprob"] - want["bad_logprob"]).abs().max()),
            "grads": [float((g - w).abs().max()) for g, w in zip(got_grads, want_grads)],
            "grad_sizes": [float(w.abs().max()) for w in want_grads],
            "steps_read": int((want["good_logprob"] < 0).sum()),
        }
    return differences


def test_the_likelihood_head_reads_only_the_positions_that_predict_a_counted_token_and_changes_nothing():
    (differences,) = run_distributed(_head_against_every_position, 1)
    for name, found in differences.items():
        assert found["steps_read"] > 10, name  # the comparison covers real steps, not zeros
        assert found["good"] <= 1e-5 and found["bad"] <= 1e-4, (name, found)
        assert all(size > 0.01 for size in found["grad_sizes"]), (name, found)
        assert all(diff <= 1e-5 for diff in found["grads"]), (name, found)
