"""The likelihood PRM layout's pieces that need no model: the per-step minimum (``prm.heads.segment_min``), the
``step_ids`` of a rendered batch, and the config checks. Its scores against transformers at TP=2 / PP=2 are in
tests/test_prm_model.py; a whole quickstart with it in tests/test_quickstart.py."""

import pytest
import torch

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
