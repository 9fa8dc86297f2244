"""The hf rollout engine on a tiny random Qwen2 model with a character-level tokenizer (no hub)."""

import copy
import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from dist_utils import tiny_qwen2
from grpo_mega.rollout import RolloutEngine, SamplingConfig, build_rollout_engine, sync_weights
from grpo_mega.rollout.hf_engine import HFRolloutEngine
from grpo_mega.rollout.kv_cache import preallocated_cache
from grpo_mega.rollout.stopping import cut_response

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
CHARS = string.ascii_lowercase + string.digits + " .:=+-*"
PROMPTS = ["ab", "hello world", "12+3=", "q"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model is tiny: intra-op threads only add synchronisation (3x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    """One token per character, EOS "</s>", PAD "<pad>"."""
    vocab = {token: index for index, token in enumerate(SPECIALS + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    assert tok.decode(tok.encode("ab 1=2.", add_special_tokens=False)) == "ab 1=2."
    return tok


def tiny_model(seed: int, tie: bool = True) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    # initializer_range: sharper than the default 0.02, for varied greedy outputs from a random model
    config = tiny_qwen2(vocab_size=len(SPECIALS) + len(CHARS), max_position_embeddings=64, tie_word_embeddings=tie,
                        initializer_range=0.2)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


def greedy_ids(engine, prompts, max_new_tokens=16):
    greedy = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens)
    return [c.response_ids for c in engine.generate(prompts, greedy)]


def test_n_completions_per_prompt_grouped_contiguously(tokenizer, prompts):
    engine = HFRolloutEngine(tiny_model(0), tokenizer, generation_batch_size=3)  # 2 chunks of prompts
    assert isinstance(engine, RolloutEngine)
    completions = engine.generate(prompts, SamplingConfig(n=3, max_new_tokens=10, seed=1))
    assert len(completions) == 3 * len(prompts)
    for index, completion in enumerate(completions):
        assert completion.prompt_index == index // 3
        assert completion.prompt_ids == prompts[index // 3]
        assert 1 <= len(completion.response_ids) <= 10
        assert len(completion.response_logprobs) == len(completion.response_ids)
        assert all(lp <= 0 for lp in completion.response_logprobs)
        assert completion.text == tokenizer.decode(completion.response_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("eos", "length")
    assert len({tuple(c.response_ids) for c in completions[:3]}) > 1  # sampled, not copies


def test_same_seed_reproduces_other_seed_differs_caller_rng_untouched(tokenizer, prompts):
    model = tiny_model(0)
    sampling = SamplingConfig(n=2, max_new_tokens=12, seed=5)
    first, twin = HFRolloutEngine(model, tokenizer), HFRolloutEngine(model, tokenizer)
    rng_before = torch.get_rng_state()
    a = [c.response_ids for c in first.generate(prompts, sampling)]
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert a == [c.response_ids for c in twin.generate(prompts, sampling)]
    other = HFRolloutEngine(model, tokenizer).generate(prompts, SamplingConfig(n=2, max_new_tokens=12, seed=6))
    assert a != [c.response_ids for c in other]
    # no hidden call counter: the same seed on the same engine samples the same again (exact resume relies on it)
    assert a == [c.response_ids for c in first.generate(prompts, sampling)]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.7, n=2, max_new_tokens=12, seed=3),
        SamplingConfig(temperature=1.3, n=2, max_new_tokens=12, seed=3, top_p=0.6, top_k=8),
        SamplingConfig(temperature=0.0, max_new_tokens=12),
    ],
    ids=["T0.7", "T1.3-top_p-top_k", "greedy"],
)
def test_logprobs_equal_teacher_forced_recompute(tokenizer, prompts, sampling):
    """log_softmax(logits / T) of the full vocabulary at each response token (T = 1 when greedy), also with
    top-p / top-k on (documented: no renormalisation over the kept tokens)."""
    model = tiny_model(0)
    completions = HFRolloutEngine(model, tokenizer, generation_batch_size=4).generate(prompts, sampling)
    with torch.no_grad():
        for c in completions:
            logits = model(torch.tensor([c.prompt_ids + c.response_ids])).logits[0].float()
            start = len(c.prompt_ids) - 1
            logprobs = torch.log_softmax(logits[start : start + len(c.response_ids)] / sampling.logprob_temperature, -1)
            expected = logprobs.gather(1, torch.tensor(c.response_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(c.response_logprobs), expected, atol=1e-4, rtol=0)
            if sampling.top_k:
                ranks = (logprobs > expected[:, None]).sum(1)
                assert int(ranks.max()) < sampling.top_k  # every sampled token was in the top k


def test_shared_prompt_prefill_samples_what_n_separate_prefills_sample(tokenizer, prompts, monkeypatch):
    """n samples of a prompt start from one prefill of the prompt, repeated n times: the same tokens and
    log-probs as prefilling each row on its own (left-padded batch; "q" is a one-token prompt)."""
    model = tiny_model(0)
    sampling = SamplingConfig(temperature=1.0, n=3, max_new_tokens=12, seed=4)
    shared = HFRolloutEngine(model, tokenizer, generation_batch_size=4).generate(prompts, sampling)
    engine = HFRolloutEngine(model, tokenizer, generation_batch_size=4)
    calls = []

    def no_sharing(input_ids, attention_mask, samples, *, capacity):
        calls.append(samples)
        return preallocated_cache(model.config, capacity)  # empty: generate prefills all n rows itself

    monkeypatch.setattr(engine, "_shared_prompt_cache", no_sharing)
    separate = engine.generate(prompts, sampling)
    assert calls == [3]
    assert [c.response_ids for c in shared] == [c.response_ids for c in separate]
    for a, b in zip(shared, separate):
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs),
                                   atol=1e-5, rtol=0)


def test_greedy_output_does_not_depend_on_batching_and_padding(tokenizer, prompts):
    model = tiny_model(0)
    one_by_one = greedy_ids(HFRolloutEngine(model, tokenizer, generation_batch_size=1), prompts)
    batched = greedy_ids(HFRolloutEngine(model, tokenizer, generation_batch_size=4), prompts)  # left-padded
    assert one_by_one == batched
    copies = HFRolloutEngine(model, tokenizer).generate(prompts, SamplingConfig(temperature=0, n=3, max_new_tokens=16))
    assert [c.response_ids for c in copies[::3]] == batched
    assert all(copies[3 * p + j].response_ids == batched[p] for p in range(len(prompts)) for j in range(3))


def shortest_prefix_containing(token_ids, stops, tokenizer):
    for k in range(1, len(token_ids) + 1):
        if any(s in tokenizer.decode(token_ids[:k], skip_special_tokens=True) for s in stops):
            return k
    return None


def test_stop_string_ends_response_after_it_and_keeps_it(tokenizer, prompts):
    engine = HFRolloutEngine(tiny_model(0), tokenizer)
    full = greedy_ids(engine, prompts[:1])[0]
    full_text = tokenizer.decode(full, skip_special_tokens=True)
    stops = [full_text[6:8], full_text[9:11]]  # the first to complete wins
    expected = shortest_prefix_containing(full, stops, tokenizer)
    assert expected is not None and expected < len(full)
    completion = engine.generate(prompts[:1], SamplingConfig(temperature=0, max_new_tokens=16, stop=stops))[0]
    assert completion.finish_reason == "stop"
    assert completion.response_ids == full[:expected]
    assert completion.text == tokenizer.decode(full[:expected], skip_special_tokens=True)
    assert any(completion.text.endswith(s) for s in stops)


def test_stop_strings_while_sampling(tokenizer, prompts):
    completions = HFRolloutEngine(tiny_model(1), tokenizer).generate(
        prompts, SamplingConfig(n=4, max_new_tokens=24, stop=["a", "e"], seed=2)
    )
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert len(stopped) >= 3 and len(stopped) < len(completions)
    for c in completions:
        k = shortest_prefix_containing(c.response_ids, ["a", "e"], tokenizer)
        if c.finish_reason == "stop":
            assert k == len(c.response_ids)
        else:  # eos or length: no stop string before the end
            assert k is None


def test_max_new_tokens_gives_length(tokenizer, prompts):
    completions = HFRolloutEngine(tiny_model(0), tokenizer).generate(
        prompts, SamplingConfig(n=4, max_new_tokens=5, seed=4)
    )
    assert all(len(c.response_ids) <= 5 for c in completions)
    assert any(c.finish_reason == "length" for c in completions)
    for c in completions:
        assert (c.finish_reason == "length") == (len(c.response_ids) == 5 and c.finish_reason != "eos")


def test_eos_ends_response_and_is_kept(tokenizer, prompts):
    """An EOS id from the checkpoint's generation_config (how chat models end a turn) ends the response."""
    model = tiny_model(0)
    full = greedy_ids(HFRolloutEngine(model, tokenizer), prompts[:1])[0]
    # A token whose first occurrence is at position >= 3: declared EOS, the response must end exactly there.
    eos_id = full[next(i for i in range(3, len(full)) if full[i] not in full[:i])]
    model.generation_config.eos_token_id = eos_id
    engine = HFRolloutEngine(model, tokenizer)
    assert engine.eos_token_ids == {eos_id, tokenizer.eos_token_id}
    completion = engine.generate(prompts[:1], SamplingConfig(temperature=0, max_new_tokens=16))[0]
    end = full.index(eos_id) + 1
    assert completion.finish_reason == "eos"
    assert completion.response_ids == full[:end] and completion.response_ids[-1] == eos_id
    assert len(completion.response_logprobs) == end


def test_cut_response_rules():
    def decode(ids):
        return "".join("xyzE"[i] for i in ids if i != 3)  # token 3 is a special EOS, skipped in the text

    cut = lambda ids, stop=(): cut_response(ids, eos_token_ids={3}, stop=list(stop), decode=decode, max_new_tokens=6)
    assert (cut([0, 1, 3, 9, 9, 9]).length, cut([0, 1, 3, 9, 9, 9]).finish_reason) == (3, "eos")
    assert cut([0, 1, 2, 0, 3, 3], stop=["z"]).length == 3  # stop string before the EOS wins
    assert cut([0, 1, 2, 0, 3, 3], stop=["yz", "x"]).length == 1
    assert cut([0, 3, 2, 3, 3, 3], stop=["z"]).finish_reason == "eos"  # a stop string after EOS does not count
    assert cut([0, 1, 0, 1, 0, 1], stop=["z"]).finish_reason == "length"
    with pytest.raises(RuntimeError, match="max_new_tokens"):
        cut([0, 1, 0])


@pytest.mark.parametrize("tie", [True, False])
def test_update_weights_makes_engine_generate_like_the_source_model(tokenizer, prompts, tie):
    target, source = tiny_model(0, tie), tiny_model(1, tie)
    engine = HFRolloutEngine(copy.deepcopy(target), tokenizer)
    before = greedy_ids(engine, prompts)
    reference = greedy_ids(HFRolloutEngine(source, tokenizer), prompts)
    assert before != reference
    named = [(n, t) for n, t in source.state_dict().items() if not (tie and n == "lm_head.weight")]
    stats = sync_weights(iter(named), engine, bucket_bytes=16 * 1024)
    assert greedy_ids(engine, prompts) == reference
    assert engine.weight_version == 1
    assert stats.num_tensors == len(named) and stats.num_buckets > 1
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in named)
    for name, tensor in source.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name


def test_weight_update_errors_name_the_tensor(tokenizer, prompts):
    model = tiny_model(0)
    engine = HFRolloutEngine(model, tokenizer)
    weights = dict(tiny_model(1).state_dict())
    with pytest.raises(RuntimeError, match="begin_weight_update"):
        engine.update_weights([("model.norm.weight", weights["model.norm.weight"])])
    engine.begin_weight_update()
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(31,\).*\(32,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(31))])
    engine.update_weights((n, t) for n, t in weights.items() if n != "model.layers.1.self_attn.k_proj.bias")
    with pytest.raises(ValueError, match="1 tensors were not sent: model.layers.1.self_attn.k_proj.bias"):
        engine.finish_weight_update()
    with pytest.raises(RuntimeError, match="weight sync"):
        engine.generate(prompts, SamplingConfig())


def test_engine_from_model_folders(tmp_path, tokenizer, prompts):
    source = tiny_model(2)
    tokenizer.save_pretrained(tmp_path / "tok")
    source.config.save_pretrained(tmp_path / "config_only")
    source.save_pretrained(tmp_path / "with_weights")
    reference = greedy_ids(HFRolloutEngine(source, tokenizer), prompts)

    loaded = build_rollout_engine("hf", model_path=tmp_path / "with_weights", tokenizer=tmp_path / "tok", dtype="fp32")
    assert greedy_ids(loaded, prompts) == reference

    placeholder = build_rollout_engine(
        "hf", model_path=tmp_path / "config_only", tokenizer=tokenizer, dtype="float32", generation_batch_size=2
    )
    with pytest.raises(RuntimeError, match="placeholder weights"):
        placeholder.generate(prompts, SamplingConfig())
    sync_weights(source.state_dict().items(), placeholder, bucket_bytes=1 << 20)
    assert greedy_ids(placeholder, prompts) == reference


def test_bad_requests_raise_clear_errors(tokenizer, prompts, tmp_path):
    engine = HFRolloutEngine(tiny_model(0), tokenizer)
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        engine.generate([prompts[0], []], SamplingConfig())
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.generate([[1, 500]], SamplingConfig())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate(prompts, SamplingConfig(max_new_tokens=60))
    with pytest.raises(ValueError, match="unknown rollout engine"):
        build_rollout_engine("sglang", model_path=tmp_path, tokenizer=tokenizer, dtype="bf16")
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_rollout_engine("hf", model_path=tmp_path, tokenizer=tokenizer, dtype="bf16")
    with pytest.raises(ValueError, match="unknown rollout dtype"):
        build_rollout_engine("hf", model_path=tmp_path, tokenizer=tokenizer, dtype="int8")


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
     ({"max_new_tokens": 0}, "max_new_tokens"), ({"n": 0}, "n"), ({"stop": "\n"}, "stop"), ({"stop": [""]}, "stop")],
)
def test_sampling_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
        SamplingConfig(**kwargs)
