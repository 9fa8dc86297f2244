"""The static KV cache of the hf decode loop (grpo_mega.rollout.static_decode, ``rollout.decode_graphs: static``): the
same greedy tokens and the same samples at a seed as today's loop on a tiny Qwen2 model (float32 on the CPU, where
the rounding of attention over masked columns and of the bucket's batch size does not flip a token), rows moving to
smaller buckets as they end, multi-turn caches kept from the static buffers, the step traced by torch.compile (the
eager backend: dynamo's graph, no C++ compile), no host read per step, the bucket logic, and the refusals."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, Qwen2ForCausalLM

from dist_utils import tiny_qwen2
from grpo_mega.perf.host_syncs import HostSyncCounter
from grpo_mega.rollout.decode_graphs import CompiledSteps, static_decoder_for
from grpo_mega.rollout.hf_decode import decode
from grpo_mega.rollout.sampling import TokenSampler
from grpo_mega.rollout.static_decode import StaticDecoder, bucket_for, bucket_sizes, capacity_for

PAD = 0
NEW = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2(vocab_size=24, max_position_embeddings=64, pad_token_id=PAD,
                                       initializer_range=0.3, attn_implementation="sdpa")).eval()


def _prompts():
    """18 distinct prompts (buckets 32 -> 16 -> 8 ... as rows end), a third of them left-padded by 1-3 tokens."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(4, 24, (18, 5), generator=generator)
    for row in range(0, 18, 3):
        input_ids[row, : 1 + row % 3] = PAD
    return input_ids, (input_ids != PAD).long()


def _decode(model, *, static=None, seed=None, eos=None, **options):
    input_ids, attention_mask = _prompts()
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return decode(model, input_ids, attention_mask, DynamicCache(), max_new_tokens=NEW,
                      eos_token_ids=[_eos(model)] if eos is None else eos, pad_token_id=PAD, static=static, **options)


def _eos(model) -> int:
    """A token greedy decoding emits in some rows at several different steps and never in others: as EOS it ends
    rows at different lengths."""
    free = _decode(model, greedy=True, eos=[]).tokens
    best, spread = None, 0
    for token in free.unique().tolist():
        steps = {(row == token).nonzero()[:, 0].min().item() for row in free if (row == token).any()}
        hit = sum(bool((row == token).any()) for row in free)
        if hit < free.shape[0] and len(steps) > spread:
            best, spread = token, len(steps)
    assert spread > 2, free
    return best


def _ends_at_different_steps(tokens: torch.Tensor) -> bool:
    return len({int((row != PAD).sum()) for row in tokens}) > 2


def test_buckets_are_nano_vllms_sizes_and_hold_the_rows():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(5) == (1, 2, 4, 8)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(40) == (1, 2, 4, 8, 16, 32, 48)
    assert bucket_sizes(256)[-3:] == (224, 240, 256)
    buckets = bucket_sizes(256)
    assert [bucket_for(rows, buckets) for rows in (1, 3, 8, 9, 16, 17, 200, 256)] == [1, 4, 8, 16, 16, 32, 208, 256]
    with pytest.raises(ValueError, match="exceed the largest bucket 48"):
        bucket_for(49, bucket_sizes(40))
    assert (capacity_for(1), capacity_for(64), capacity_for(65)) == (64, 64, 128)


def test_greedy_tokens_and_logprobs_equal_todays_loop_while_the_batch_moves_to_smaller_buckets(model):
    reference = _decode(model, greedy=True)
    assert _ends_at_different_steps(reference.tokens)
    for sync_every in (1, 4):
        static = StaticDecoder(model)
        ours = _decode(model, greedy=True, static=static, sync_every=sync_every)
        assert torch.equal(ours.tokens, reference.tokens)
        torch.testing.assert_close(ours.logprobs, reference.logprobs, atol=2e-5, rtol=0)
        assert static.bucket < 32  # 18 rows started at bucket 32 and moved down as rows ended
    again = _decode(model, greedy=True, static=static)  # the buffers are reused by the next call
    assert torch.equal(again.tokens, reference.tokens)


@pytest.mark.parametrize("sampler", [TokenSampler(method="inverse_cdf"), TokenSampler(method="race"),
                                     TokenSampler(temperature=0.8, top_k=6, top_p=0.9, method="race")],
                         ids=["inverse_cdf", "race", "top_k_top_p"])
def test_samples_at_a_seed_equal_todays_loop(model, sampler):
    reference = _decode(model, sampler=sampler, seed=11)
    ours = _decode(model, sampler=sampler, seed=11, static=StaticDecoder(model))
    assert _ends_at_different_steps(reference.tokens)
    assert torch.equal(ours.tokens, reference.tokens)
    torch.testing.assert_close(ours.logprobs, reference.logprobs, atol=2e-5, rtol=0)


def test_kept_row_caches_equal_todays_loop(model):
    """The multi-turn continuation: the cache of each row a stop string ended, cut out of the static buffers."""
    input_ids, _ = _prompts()
    columns = [torch.nonzero(row != PAD)[:, 0] for row in input_ids]
    stop_token = _eos(model)

    def run(static):
        torch.manual_seed(5)
        return _decode(model, static=static, sampler=TokenSampler(method="inverse_cdf"), eos=[2],
                       stopped=lambda ids: ids[-1] == stop_token, keep_columns=columns, sync_every=3)

    reference, ours = run(None), run(StaticDecoder(model))
    assert torch.equal(ours.tokens, reference.tokens)
    assert reference.kept and sorted(ours.kept) == sorted(reference.kept)
    for row, layers in reference.kept.items():
        for (keys, values), (our_keys, our_values) in zip(layers, ours.kept[row]):
            torch.testing.assert_close(our_keys, keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(our_values, values, atol=1e-5, rtol=0)


def test_a_compiled_step_traces_and_gives_the_same_tokens(model):
    """``static_compile``'s code path on the CPU: torch.compile with the eager backend (dynamo's trace of the step,
    one bucket, no CUDA graphs) gives the eager static loop's tokens."""
    reference = _decode(model, greedy=True)
    compiled = StaticDecoder(model, runner=lambda step: CompiledSteps(step, mode=None, backend="eager"), shrinks=False)
    ours = _decode(model, greedy=True, static=compiled)
    assert torch.equal(ours.tokens, reference.tokens)
    assert compiled.bucket == 32 and compiled.step_fn.first_call_seconds is not None


def test_no_host_read_of_its_own(model):
    """The static steps read nothing on the host: the call's reads are today's loop's (the final copy and the padded
    prefill's mask check, tests/test_rollout_hf_decode_syncs.py)."""
    input_ids, attention_mask = _prompts()
    reads = []
    for static in (None, StaticDecoder(model)):
        with HostSyncCounter() as counter, torch.no_grad():
            decode(model, input_ids, attention_mask, DynamicCache(), max_new_tokens=NEW, eos_token_ids=[2],
                   pad_token_id=PAD, static=static, sync_every=NEW, sampler=TokenSampler(method="race"))
        reads.append(dict(counter.by_op))
    assert reads[1] == reads[0] and sum(reads[1].values()) <= 1 + 2, reads


class _OpNames(TorchDispatchMode):
    """The aten ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_the_captured_step_runs_nothing_a_cuda_graph_capture_refuses(model):
    """What ``cuda_graphs`` captures (the eager static step over the buffers), checked on the CPU: no host read
    (``_local_scalar_dense``, ``nonzero``, a copy to the host) and no tensor made from Python data (``lift_fresh``:
    a host-to-device copy on CUDA), either of which fails a capture; and a replay reads its inputs from the buffers
    (the same step twice, inputs changed in between, gives the fresh inputs' logits)."""
    input_ids, attention_mask = _prompts()
    cache = DynamicCache()
    static = StaticDecoder(model)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        static.begin(cache, 18, 5, 4, attention_mask)
        first = static.step(input_ids[:, -1:], torch.full((18, 1), 5), 5)
        with _OpNames() as ops:
            static.step_fn(static.bucket)
        again = static.step(input_ids[:, -2:-1], torch.full((18, 1), 5), 5)
    forbidden = {"_local_scalar_dense", "nonzero", "lift_fresh", "item"}
    assert ops.names and not ops.names & forbidden, ops.names & forbidden
    assert not torch.equal(first, again)  # the buffers, not the first call's inputs, feed the step


def test_graph_modes_refused_off_cuda_and_for_eager_attention(model):
    with pytest.raises(ValueError, match=r"decode_graphs=cuda_graphs needs a CUDA device"):
        static_decoder_for(model, "cuda_graphs", "cpu")
    with pytest.raises(ValueError, match=r"decode_graphs=static_compile needs a CUDA device"):
        static_decoder_for(model, "static_compile", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"expected one of off, static, static_compile, cuda_graphs"):
        static_decoder_for(model, "graphs", "cpu")
    assert static_decoder_for(model, "off", "cpu") is None
    config = tiny_qwen2(vocab_size=24, num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                        num_attention_heads=2, num_key_value_heads=1, attn_implementation="eager")
    with pytest.raises(ValueError, match="full attention through SDPA"):
        static_decoder_for(Qwen2ForCausalLM(config), "static", "cpu")


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    from grpo_mega.data.tokenizer import train_tokenizer
    from test_turn_loop_kv import TEXTS

    tok = train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=400)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tok


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_with_a_static_cache_gives_todays_multi_turn_rollouts(tool_tokenizer, temperature):
    """``HFRolloutEngine(decode_graphs="static")`` through the turn loop, continuing rows' caches across tool turns
    (kept out of the static buffers): today's trajectories, at temperature 0 and at a seed."""
    from grpo_mega.rollout.hf_engine import HFRolloutEngine
    from test_turn_loop_kv import rollouts, tool_calling_model

    results = []
    for mode in ("off", "static"):
        engine = HFRolloutEngine(tool_calling_model(tool_tokenizer, attn_implementation="sdpa"), tool_tokenizer,
                                 generation_batch_size=2, decode_graphs=mode)
        results.append(rollouts(engine, tool_tokenizer, temperature, continues_kv=True)[0])
    today, static = results
    assert [c.response_ids for c in static] == [c.response_ids for c in today]
    assert [c.finish_reason for c in static] == [c.finish_reason for c in today]
    assert max(len(c.turns) for c in today) >= 3  # caches were kept and continued
    for a, b in zip(static, today):
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=2e-5,
                                   rtol=0)
