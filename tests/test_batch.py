"""Sequences to the engine's batch layout."""

import pytest
import torch

from grpo_mega.data.batch import response_values_to_tokens, sequences_to_batch


def test_rows_are_right_padded_with_masks_on_response_tokens():
    batch = sequences_to_batch([[5, 6], [7]], [[8, 9, 10], [11]], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    values = response_values_to_tokens(batch, [[-1.0, -2.0, -3.0], [-4.0]])
    assert values.tolist() == [[0.0, 0.0, -1.0, -2.0, -3.0], [0.0, -4.0, 0.0, 0.0, 0.0]]


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="row 1 has an empty prompt"):
        sequences_to_batch([[1], []], [[2], [3]], pad_id=0)
