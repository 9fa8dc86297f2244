"""SDPADotProductAttention against megatron-core's DotProductAttention: the same context and the same gradients
(grouped-query and multi-head attention), megatron's path where the fused one does not apply (an explicit mask),
and the local layer spec using it."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _attention_pair(heads: int, groups: int):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from grpo_mega.model.attention import SDPADotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0, hidden_dropout=0.0,
                               use_cpu_initialization=True)
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(config, **kwargs), SDPADotProductAttention(config, **kwargs)


def _context_and_grads(module, query, key, value, weight, attention_mask=None):
    inputs = [t.clone().requires_grad_() for t in (query, key, value)]
    context = module(*inputs, attention_mask)
    (context * weight).sum().backward()
    return context.detach(), [t.grad for t in inputs]


def _job() -> dict:
    from grpo_mega.model.gpt import transformer_layer_spec
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=0, device="cpu")
    generator = torch.Generator().manual_seed(0)
    seq, batch, head_dim = 7, 3, 16
    results = {}
    for heads, groups in ((4, 2), (4, 4)):
        megatron_attention, sdpa_attention = _attention_pair(heads, groups)
        query = torch.randn(seq, batch, heads, head_dim, generator=generator)
        key = torch.randn(seq, batch, groups, head_dim, generator=generator)
        value = torch.randn(seq, batch, groups, head_dim, generator=generator)
        weight = torch.randn(seq, batch, heads * head_dim, generator=generator)
        results[(heads, groups)] = (
            _context_and_grads(megatron_attention, query, key, value, weight),
            _context_and_grads(sdpa_attention, query, key, value, weight),
        )
        if (heads, groups) == (4, 2):
            # an explicit mask (True = masked) that also hides key 0 from every query: megatron's path, not sdpa's
            mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
            mask[:, 0] = True
            mask[0, 0] = False
            mask = mask.expand(batch, 1, seq, seq)
            results["masked"] = (
                _context_and_grads(megatron_attention, query, key, value, weight, mask),
                _context_and_grads(sdpa_attention, query, key, value, weight, mask),
                _context_and_grads(sdpa_attention, query, key, value, weight),
            )
    spec = transformer_layer_spec()
    results["spec"] = spec.submodules.self_attention.submodules.core_attention.__name__
    return results


@pytest.fixture(scope="module")
def job():
    return run_distributed(_job, 1)[0]


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4)])
def test_sdpa_attention_matches_megatron_context_and_grads(job, heads, groups):
    (expected, expected_grads), (actual, actual_grads) = job[(heads, groups)]
    assert actual.shape == expected.shape == (7, 3, heads * 16)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    for name, got, want in zip(("query", "key", "value"), actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_explicit_mask_takes_megatrons_path(job):
    (expected, expected_grads), (actual, actual_grads), (causal_only, _) = job["masked"]
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    for got, want in zip(actual_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # the mask mattered: without it the context differs
    assert not torch.allclose(causal_only, actual, atol=1e-3)


def test_local_layer_spec_uses_sdpa_attention(job):
    assert job["spec"] == "SDPADotProductAttention"
