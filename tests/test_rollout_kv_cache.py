"""The preallocated KV cache of the hf rollout engine: the same keys / values and the same generated tokens as
transformers' DynamicCache, including after batch selection and beyond the planned capacity."""

import pytest
import torch
from transformers import GenerationConfig, Qwen2ForCausalLM
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from dist_utils import tiny_qwen2
from grpo_mega.rollout.kv_cache import PreallocatedLayer, preallocated_cache


def _states(generator, batch=3, heads=2, length=1, dim=4):
    return (torch.randn(batch, heads, length, dim, generator=generator),
            torch.randn(batch, heads, length, dim, generator=generator))


def test_layer_matches_dynamic_layer_through_prefill_decode_growth_and_selection():
    generator = torch.Generator().manual_seed(0)
    ours, reference = PreallocatedLayer(capacity=6), DynamicLayer()
    for length in (4, 1, 1, 1, 2):  # prefill of 4, decode, then past the capacity of 6 (the buffer grows)
        keys, values = _states(generator, length=length)
        got, want = ours.update(keys, values), reference.update(keys, values)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ours.get_seq_length() == reference.get_seq_length() == 9
    indices = torch.tensor([2, 0])
    ours.batch_select_indices(indices)
    reference.batch_select_indices(indices)
    keys, values = _states(generator, batch=2)
    got, want = ours.update(keys, values), reference.update(keys, values)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape == (2, 2, 10, 4)


def test_crop_then_update_overwrites_the_dropped_positions():
    generator = torch.Generator().manual_seed(1)
    ours, reference = PreallocatedLayer(capacity=8), DynamicLayer()
    for layer in (ours, reference):
        layer.update(*_states(torch.Generator().manual_seed(2), length=5))
        layer.crop(-2)
    keys, values = _states(generator, length=1)
    got, want = ours.update(keys, values), reference.update(keys, values)
    assert torch.equal(got[0], want[0]) and got[0].shape[-2] == 4


def test_sliding_window_layers_are_left_to_transformers():
    config = tiny_qwen2(vocab_size=40, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                        layer_types=["full_attention", "sliding_attention"])
    layers = preallocated_cache(config, capacity=16).layers
    assert isinstance(layers[0], PreallocatedLayer)
    assert isinstance(layers[1], DynamicSlidingWindowLayer) and not isinstance(layers[1], PreallocatedLayer)


@pytest.mark.parametrize("greedy", [True, False])
def test_generate_gives_the_same_tokens_as_the_dynamic_cache(greedy):
    torch.manual_seed(0)
    config = tiny_qwen2(vocab_size=40, max_position_embeddings=64, pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    # Left-padded prompts of two lengths (an attention mask) and several samples per prompt.
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    attention_mask = (input_ids != 0).long()
    generation = GenerationConfig(max_new_tokens=12, do_sample=not greedy, num_return_sequences=1 if greedy else 3,
                                  pad_token_id=0, eos_token_id=None, top_k=0, top_p=1.0, temperature=1.0)

    def generate(**cache):
        torch.manual_seed(1)
        with torch.no_grad():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation,
                                  output_scores=True, return_dict_in_generate=True, **cache)

    reference = generate()
    ours = generate(past_key_values=preallocated_cache(config, capacity=input_ids.shape[1] + 12))
    assert torch.equal(ours.sequences, reference.sequences)
    for got, want in zip(ours.scores, reference.scores):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
