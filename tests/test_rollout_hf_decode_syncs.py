"""Host syncs and sorts in one generate call of the hf engine, on the CPU, counted as they would happen on CUDA
(grpo_mega.perf.host_syncs): the decode loop runs its CUDA schedule (a host read every ``SYNC_EVERY_CUDA`` steps), and
the counter sees every ``.item()`` / ``nonzero`` / copy to the host, transformers' own included. Floors (issue 77):
at most one host read per 16 decode steps, and no sort or top-k over the vocabulary."""

import functools
import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from dist_utils import tiny_qwen2
from grpo_mega.perf.host_syncs import HostSyncCounter
from grpo_mega.rollout import SamplingConfig, hf_engine
from grpo_mega.rollout.hf_decode import SYNC_EVERY_CUDA, decode
from grpo_mega.rollout.hf_engine import HFRolloutEngine

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHARS = string.ascii_lowercase + string.digits
VOCAB = len(SPECIALS) + len(CHARS)


@pytest.fixture(scope="module")
def engine():
    vocab = {token: index for index, token in enumerate(SPECIALS + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2(vocab_size=VOCAB, max_position_embeddings=256, eos_token_id=2,
                                        pad_token_id=3)).eval()
    # EOS never sampled: every row runs every step, the most steps (and reads) a call can have
    model.lm_head.register_forward_hook(lambda module, inputs, output: output.index_fill_(-1, torch.tensor([2]),
                                                                                        float("-inf")))
    return HFRolloutEngine(model, tokenizer, generation_batch_size=8)


def counted_generate(engine, monkeypatch, prompts, sampling, method="race"):
    """One generate call on the CUDA schedule (a host read every 16 steps, the CUDA sampler unless ``method`` says
    otherwise), with its host syncs and sorts counted. The engine runs under ``torch.inference_mode``, which hides
    ``item`` / ``_to_copy`` from dispatch modes: counted under ``no_grad``."""
    monkeypatch.setattr(hf_engine, "decode", functools.partial(decode, sync_every=SYNC_EVERY_CUDA))
    monkeypatch.setattr(hf_engine, "method_for", lambda device: method)
    monkeypatch.setattr(torch, "inference_mode", torch.no_grad)
    with HostSyncCounter() as counter:
        completions = engine.generate(prompts, sampling)
    return completions, counter


@pytest.mark.parametrize("method, top_k, top_p", [("race", 0, 1.0), ("race", 5, 0.9), ("race", 0, 0.9),
                                                   ("inverse_cdf", 5, 0.9)])
def test_one_host_read_per_16_decode_steps_and_no_sort_of_the_vocabulary(engine, monkeypatch, method, top_k, top_p):
    prompts = [engine.tokenizer.encode(text, add_special_tokens=False) for text in ("abc12", "hello", "q9q9q")]
    for new in (32, 64):
        sampling = SamplingConfig(temperature=0.9, top_k=top_k, top_p=top_p, n=4, max_new_tokens=new, seed=1)
        completions, counter = counted_generate(engine, monkeypatch, prompts, sampling, method)
        assert all(len(c.response_ids) == new for c in completions)  # every row ran every step
        assert counter.syncs <= new // 16, (new, counter.by_op)
        print(f"{method} {top_k=} {top_p=} {new} steps: {counter.syncs} host reads {dict(counter.by_op)}")
        # top-k returns k of the vocabulary; nothing sorts or selects over the whole vocabulary
        assert all(name.startswith("aten.topk") and k == top_k for name, _, k in counter.sorts), counter.sorts
        assert bool(counter.sorts) == bool(top_k)


def test_padded_prompts_add_only_the_prefills_mask_check(engine, monkeypatch):
    """Prompts of several lengths (left-padded): the decode steps use a sliced 4D mask, so only the prompt prefill's
    2D mask is checked by transformers (2 reads per call, whatever the length)."""
    prompts = [engine.tokenizer.encode(text, add_special_tokens=False) for text in ("abc12", "h", "q9q")]
    counts = []
    for new in (32, 64):
        sampling = SamplingConfig(temperature=1.0, n=4, max_new_tokens=new, seed=1)
        _, counter = counted_generate(engine, monkeypatch, prompts, sampling)
        counts.append(counter.syncs)
        assert counter.syncs <= new // 16 + 2, (new, counter.by_op)
    assert counts[1] - counts[0] <= 32 // 16  # 32 more steps: at most 2 more reads
    print(f"padded: {counts} host reads at 32 / 64 steps")


def test_the_counter_sees_what_the_per_step_loop_reads(engine, monkeypatch):
    """The CPU schedule (a read every step) on the same call: one read per step, so the counter is not blind."""
    monkeypatch.setattr(torch, "inference_mode", torch.no_grad)
    prompts = [engine.tokenizer.encode("abc12", add_special_tokens=False)]
    with HostSyncCounter() as counter:
        engine.generate(prompts, SamplingConfig(temperature=1.0, n=4, max_new_tokens=32, seed=1))
    assert counter.syncs >= 32, counter.by_op
