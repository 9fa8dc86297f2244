"""The hf engine's decode loop (grpo_mega.rollout.hf_decode): greedy decoding equals transformers' generate token
for token while ended rows leave the batch; sampled tokens do not depend on the compaction nor on how often the host
reads the device (``sync_every``); stop strings found at a later checkpoint end rows where the per-step check did;
the inverse-CDF reference sampler draws from the distribution it is given. The engine around it:
tests/test_rollout_hf.py; host syncs and the sampler: tests/test_rollout_hf_decode_syncs.py,
tests/test_rollout_sampling.py."""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, Qwen2ForCausalLM

from dist_utils import tiny_qwen2
from grpo_mega.rollout.hf_decode import decode
from grpo_mega.rollout.kv_cache import preallocated_cache
from grpo_mega.rollout.sampling import TokenSampler, sample_inverse_cdf

PAD = 0
NEW = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2(vocab_size=24, max_position_embeddings=64, pad_token_id=PAD,
                                       initializer_range=0.3)).eval()


def _prompts():
    """Left-padded prompts of three lengths, each twice."""
    input_ids = torch.tensor([[0, 0, 0, 5, 6], [0, 8, 9, 10, 11], [12, 13, 14, 15, 16]]).repeat_interleave(2, dim=0)
    return input_ids, (input_ids != PAD).long()


def _reference_greedy(model, eos):
    input_ids, attention_mask = _prompts()
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return out[:, input_ids.shape[1]:]


def _decode(model, *, eos, cache=None, **options):
    input_ids, attention_mask = _prompts()
    with torch.no_grad():
        return decode(model, input_ids, attention_mask, cache if cache is not None else DynamicCache(),
                      max_new_tokens=NEW, eos_token_ids=eos, pad_token_id=PAD, **options)


def _ending_token(model) -> int:
    """A token greedy decoding emits in some rows, at different steps, and not in others: as EOS it ends rows at
    different lengths."""
    free = _reference_greedy(model, eos=None)
    firsts = {}
    for token in free.unique().tolist():
        steps = [(row == token).nonzero()[:, 0].min().item() for row in free if (row == token).any()]
        if 1 <= len(steps) < free.shape[0] and len(set(steps)) > 1:
            firsts[token] = steps
    assert firsts, free
    return min(firsts)


def test_greedy_equals_transformers_generate_while_ended_rows_leave_the_batch(model):
    eos = _ending_token(model)
    reference = _reference_greedy(model, eos=eos)
    for cache in (DynamicCache(), preallocated_cache(model.config, capacity=5 + NEW)):
        ours = _decode(model, eos=[eos], cache=cache, greedy=True)
        assert torch.equal(ours.tokens, reference[:, : ours.tokens.shape[1]])
        assert (reference[:, ours.tokens.shape[1]:] == PAD).all()  # generate ran longer only on padding
        assert ours.row_steps < ours.tokens.numel()  # rows left the batch


def test_sampled_tokens_do_not_depend_on_which_rows_remain_in_the_batch(model):
    eos = _ending_token(model)

    def sampled(compact_at, sync_every=1, sampler=None):
        torch.manual_seed(7)
        return _decode(model, eos=[eos], compact_at=compact_at, sync_every=sync_every, sampler=sampler)

    compacted, kept = sampled(0.25), sampled(2.0)  # 2.0: never compacts
    assert torch.equal(compacted.tokens, kept.tokens)
    torch.testing.assert_close(compacted.logprobs, kept.logprobs, atol=1e-5, rtol=0)
    assert compacted.row_steps < kept.row_steps == kept.tokens.numel()
    ended = (compacted.tokens == eos).any(dim=1)
    assert ended.any() and not ended.all()  # some rows ended early, the others ran to the limit
    # The CUDA schedule (a host read every few steps: ended rows wait longer for the compaction) on the same noise
    for sync_every in (3, 16):
        late = sampled(0.25, sync_every)
        assert torch.equal(late.tokens, kept.tokens)
        torch.testing.assert_close(late.logprobs, kept.logprobs, atol=1e-5, rtol=0)
        assert compacted.row_steps <= late.row_steps <= kept.row_steps
    # both methods with top-p draw per call row too: still independent of the compaction
    for method in ("race", "inverse_cdf"):
        nucleus = TokenSampler(temperature=0.8, top_p=0.9, method=method)
        assert torch.equal(sampled(0.25, 3, nucleus).tokens, sampled(2.0, 1, nucleus).tokens)


@pytest.mark.parametrize("sync_every", [1, 5])
def test_a_stop_callback_ends_a_row_after_the_token_that_completes_it(model, sync_every):
    """Every step (the CPU's schedule) or found up to 4 steps late at a checkpoint (the CUDA one): the same ends."""
    free = _reference_greedy(model, eos=None)
    target = free[2, 3].item()  # row 2 ends at its 4th token (or earlier if that token came before)
    calls = []

    def stopped(ids):
        calls.append(len(ids))
        return target in ids

    ours = _decode(model, eos=[], greedy=True, stopped=stopped, sync_every=sync_every)
    for row in range(free.shape[0]):
        hits = (free[row] == target).nonzero()[:, 0]
        end = int(hits[0]) + 1 if len(hits) else NEW
        assert ours.tokens[row, :end].tolist() == free[row, :end].tolist()
        assert (ours.tokens[row, end:] == PAD).all()
        assert (ours.logprobs[row, end:] == 0).all() and (ours.logprobs[row, :end] < 0).all()
    assert max(calls) <= NEW  # never asked about tokens past the limit


def test_inverse_cdf_sampling_draws_from_the_distribution_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(200_000, 1)
    generator = torch.Generator().manual_seed(0)
    chosen = sample_inverse_cdf(probs, torch.rand(probs.shape[0], generator=generator))
    frequencies = torch.bincount(chosen, minlength=5).float() / probs.shape[0]
    torch.testing.assert_close(frequencies, probs[0], atol=0.005, rtol=0)
    # unnormalised rows and a number at the very top of [0, 1): the last token with probability, not past it
    edge = sample_inverse_cdf(torch.tensor([[2.0, 6.0, 0.0, 0.0]]), torch.tensor([1.0 - 1e-12]))
    assert edge.tolist() == [1]
    assert sample_inverse_cdf(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([0.0])).tolist() == [2]
