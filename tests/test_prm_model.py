"""The PRM model: specs, layout detection, label tokens, and the head layouts on the Megatron engine.

Step scores of HF PRMs of both published layouts (tiny random Qwen2 models written the way the published ones are),
and of a causal LM read as a likelihood PRM, match what transformers computes, at TP=2 and at PP=2 on 2 gloo
processes; a training step of either head is the same
at TP=1 x DP=2 (megatron's distributed optimizer), TP=2 and PP=2 (values, gradients of the replicated classifier
head, parameters after the step);
a classifier PRM starts from a policy's backbone from each kind of source, its head untouched.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from transformers import Qwen2Config

from prm.model import load_prm_init_weights
from prm.spec import (
    PRMSpec,
    config_layout,
    default_spec,
    detect_layout,
    label_token_ids,
    prm_hf_config_from_policy,
)

VOCAB = 301
SPECIAL = ["<unk>", "+", "-", "ки", "<extra_0>"]  # ids 0..4; words w5 .. w300 after them
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6)
LENGTHS = (14, 9, 12)
TAG_POSITIONS = ((3, 7, 13), (4, 8), (2, 6, 11))  # the last token of each step tag, per row
STEP_SPANS = (((1, 3), (4, 7), (8, 13)), ((1, 4), (5, 8)), ((2, 6), (7, 11)))  # likelihood: (first, last) token
MAX_SCORE_DIFF = 1e-4


# ------------------------------------------------------------------------------------------------ fixtures
def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer: "+", "-", "ки" and "<extra_0>" are single tokens, words are w5 .. w300."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL)}
    vocab.update({f"w{index}": index for index in range(len(SPECIAL), VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(folder)


def _perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight random (norms 1 + N(0, 0.1^2), the rest N(0, 0.1^2)): a swapped tensor changes the scores."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator) + (1.0 if "norm" in name else 0.0))
    return module.float().eval()


def write_classifier_prm(folder: Path, seed: int = 0) -> Path:
    """An HF folder in the Qwen2.5-Math-PRM layout: Qwen2 backbone under model.* (no lm_head), score.0 / score.2."""
    from safetensors.torch import save_file
    from transformers import Qwen2Model

    config = Qwen2Config(**SHAPE, tie_word_embeddings=False, architectures=["Qwen2ForProcessRewardModel"])
    backbone = _perturb(Qwen2Model(config), seed)
    score = _perturb(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)), seed + 1)
    tensors = {f"model.{name}": t for name, t in backbone.state_dict().items()}
    tensors.update({f"score.{name}": t * 3 for name, t in score.state_dict().items()})  # spread the scores
    folder.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(folder)
    # The published folder loads its model class as remote code; the config itself is a plain qwen2 one.
    data = json.loads((folder / "config.json").read_text())
    data["auto_map"] = {"AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"}
    (folder / "config.json").write_text(json.dumps(data, indent=2))
    save_tokenizer(folder)
    return folder


def write_causal_lm(folder: Path, seed: int = 0, *, tied: bool = False, **changes) -> Path:
    """An HF Qwen2ForCausalLM folder with random weights and the test tokenizer (a policy, or an lm_tokens PRM)."""
    from transformers import Qwen2ForCausalLM

    config = Qwen2Config(**{**SHAPE, **changes}, tie_word_embeddings=tied, architectures=["Qwen2ForCausalLM"])
    _perturb(Qwen2ForCausalLM(config), seed).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def batch(tag_id: int) -> dict[str, torch.Tensor]:
    """Three right-padded rows of different lengths with a step tag at ``TAG_POSITIONS`` and hard step labels."""
    generator = torch.Generator().manual_seed(5)
    length = max(LENGTHS)
    input_ids = torch.randint(len(SPECIAL), VOCAB, (len(LENGTHS), length), generator=generator)
    attention_mask = (torch.arange(length) < torch.tensor(LENGTHS)[:, None]).long()
    loss_mask = torch.zeros_like(attention_mask)
    step_labels = torch.zeros(len(LENGTHS), length)
    for row, positions in enumerate(TAG_POSITIONS):
        for index, position in enumerate(positions):
            input_ids[row, position] = tag_id
            loss_mask[row, position] = 1
            step_labels[row, position] = float((row + index) % 2)
    input_ids[attention_mask == 0] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, step_labels=step_labels)


def likelihood_batch() -> dict[str, torch.Tensor]:
    """The rows of ``batch`` (no tags needed) with the likelihood layout's ``step_ids`` over ``STEP_SPANS``."""
    rows = batch(SPECIAL.index("+"))
    step_ids = torch.zeros_like(rows["input_ids"])
    for row, spans in enumerate(STEP_SPANS):
        for step, (first, last) in enumerate(spans):
            step_ids[row, first : last + 1] = step + 1
    return {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"], "step_ids": step_ids}


def reference_likelihood(folder: Path, ids: torch.Tensor) -> list[list[float]]:
    """log of the likelihood score as transformers computes it: per step, the smallest log p(token | tokens before)
    over its tokens, each row alone and unpadded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for row, spans in enumerate(STEP_SPANS):
            row_ids = ids[row, : LENGTHS[row]]
            logprobs = torch.log_softmax(model(row_ids[None]).logits[0], dim=-1)
            token_logprobs = logprobs[:-1].gather(1, row_ids[1:, None])[:, 0]  # token t at index t - 1
            scores.append([float(token_logprobs[first - 1 : last].min()) for first, last in spans])
    return scores


def tag_scores(good_logprob: torch.Tensor) -> list[list[float]]:
    """exp(good_logprob) at every tag position, per row."""
    return [[float(good_logprob[row, p].exp()) for p in positions] for row, positions in enumerate(TAG_POSITIONS)]


def reference_scores(folder: Path, layout: str, ids: torch.Tensor) -> list[list[float]]:
    """Step scores as transformers computes them: classifier = Qwen2Model + Sequential(score.*), softmax[1];
    lm_tokens = Qwen2ForCausalLM, P(+) / (P(+) + P(-)) at the tag. Each row alone, unpadded."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen2Model

    config = Qwen2Config.from_pretrained(folder)
    if layout == "classifier":
        tensors = load_file(str(folder / "model.safetensors"))
        model = Qwen2Model(config).float().eval()
        model.load_state_dict({n[len("model."):]: t for n, t in tensors.items() if n.startswith("model.")})
        score = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
        score.load_state_dict({n[len("score."):]: t for n, t in tensors.items() if n.startswith("score.")})
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for row, positions in enumerate(TAG_POSITIONS):
            row_ids = ids[row : row + 1, : LENGTHS[row]]
            if layout == "classifier":
                probs = torch.softmax(score(model(row_ids).last_hidden_state)[0], dim=-1)[:, 1]
            else:
                logits = model(row_ids).logits[0][:, [SPECIAL.index("+"), SPECIAL.index("-")]]
                probs = torch.softmax(logits, dim=-1)[:, 0]
            scores.append([float(probs[p]) for p in positions])
    return scores


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


# ------------------------------------------------------------------------------------------------ in-process
def test_spec_round_trip_defaults_and_errors():
    spec = PRMSpec("lm_tokens", " ки", "+", "-")
    assert PRMSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict() == {"layout": "lm_tokens", "step_tag": " ки", "good_token": "+", "bad_token": "-"}
    assert default_spec("classifier") == PRMSpec("classifier", "<extra_0>")
    assert default_spec("lm_tokens") == spec
    with pytest.raises(ValueError, match=r"prm.layout must be one of \('classifier', 'lm_tokens', 'likelihood'\), "
                                         r"got 'value'"):
        PRMSpec("value", "x")
    assert default_spec("likelihood") == PRMSpec("likelihood", "")
    assert PRMSpec.from_dict({"layout": "likelihood"}) == PRMSpec("likelihood", "")  # it has no tag to name
    with pytest.raises(ValueError, match="likelihood scores the steps as the policy wrote them, without a tag"):
        PRMSpec("likelihood", " ки")
    with pytest.raises(ValueError, match=r"prm.step_tag must be a non-empty string, got ''"):
        PRMSpec("lm_tokens", "")
    with pytest.raises(ValueError, match=r"run.yaml: unknown field\(s\) \['tag'\]"):
        PRMSpec.from_dict({"layout": "classifier", "tag": "x"}, where="run.yaml")
    with pytest.raises(ValueError, match=r"missing field\(s\) \['step_tag'\]"):
        PRMSpec.from_dict({"layout": "classifier"})
    with pytest.raises(ValueError, match="must differ"):
        PRMSpec("lm_tokens", " ки", "+", "+")


def test_detect_layout():
    assert detect_layout(Qwen2Config(architectures=["Qwen2ForProcessRewardModel"])) == "classifier"
    assert detect_layout({"architectures": ["LlamaForCausalLM"]}) == "lm_tokens"
    with pytest.raises(ValueError, match=r"architectures \['Qwen2ForSequenceClassification'\]"):
        detect_layout(Qwen2Config(architectures=["Qwen2ForSequenceClassification"]))
    with pytest.raises(ValueError, match=r"architectures \[\]"):
        detect_layout(Qwen2Config())
    assert config_layout(Qwen2Config()) == "lm_tokens"  # a bare config (no architectures) is a causal LM's
    assert config_layout(Qwen2Config(architectures=["Qwen2ForProcessRewardModel"])) == "classifier"


def test_label_token_ids(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert label_token_ids(tokenizer, default_spec("lm_tokens")) == (1, 2)
    assert label_token_ids(tokenizer, PRMSpec("lm_tokens", " ки", "w7", "w9")) == (7, 9)
    with pytest.raises(ValueError, match=r"prm.good_token 'w5 w6' must be exactly one token.*2 tokens: ids \[5, 6\]"):
        label_token_ids(tokenizer, PRMSpec("lm_tokens", " ки", "w5 w6", "-"))
    with pytest.raises(ValueError, match=r"prm.bad_token 'bad' is not in the tokenizer's vocabulary.*'<unk>'"):
        label_token_ids(tokenizer, PRMSpec("lm_tokens", " ки", "+", "bad"))
    with pytest.raises(ValueError, match=r"are the same token \(id 1\)"):
        label_token_ids(tokenizer, PRMSpec("lm_tokens", " ки", "+", " +"))


def test_prm_hf_config_from_policy(tmp_path):
    policy = write_causal_lm(tmp_path / "policy", tied=True)
    prm_dir = prm_hf_config_from_policy(policy, tmp_path / "classifier", "classifier")
    written = json.loads((prm_dir / "config.json").read_text())
    original = json.loads((policy / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForProcessRewardModel"] and written["tie_word_embeddings"] is False
    assert {k: v for k, v in written.items() if k not in ("architectures", "tie_word_embeddings")} == {
        k: v for k, v in original.items() if k not in ("architectures", "tie_word_embeddings")}
    assert (prm_dir / "tokenizer.json").read_text() == (policy / "tokenizer.json").read_text()
    assert not list(prm_dir.glob("*.safetensors"))
    assert detect_layout(Qwen2Config.from_pretrained(prm_dir)) == "classifier"

    lm_dir = prm_hf_config_from_policy(policy, tmp_path / "lm", "lm_tokens")
    assert json.loads((lm_dir / "config.json").read_text()) == original

    qwen3 = tmp_path / "qwen3"  # a Qwen3 policy makes a Qwen3 classifier
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    written = json.loads((prm_hf_config_from_policy(qwen3, tmp_path / "q3", "classifier") / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForProcessRewardModel"] and detect_layout(written) == "classifier"

    # A policy config written without architectures (as Qwen2Config().save_pretrained does) gets them.
    bare = tmp_path / "bare"
    Qwen2Config(**SHAPE).save_pretrained(bare)
    assert json.loads((prm_hf_config_from_policy(bare, tmp_path / "bare_lm", "lm_tokens") / "config.json")
                      .read_text())["architectures"] == ["Qwen2ForCausalLM"]
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"llama/config.json: the classifier layout needs .* qwen2 or qwen3"):
        prm_hf_config_from_policy(llama, tmp_path / "x", "classifier")
    with pytest.raises(ValueError, match="PRM layout must be one of"):
        prm_hf_config_from_policy(policy, tmp_path / "y", "value_head")


def test_init_from_a_policy_that_does_not_fit(tmp_path):
    # The sizes are compared before any weight is read or any collective runs.
    prm_config = Qwen2Config(**SHAPE, architectures=["Qwen2ForProcessRewardModel"])
    wider = write_causal_lm(tmp_path / "wide", hidden_size=96, intermediate_size=160, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"wide: its model does not fit the PRM's backbone.*hidden_size 96 vs 64; "
                                         r"intermediate_size 160 vs 128"):
        load_prm_init_weights(types.SimpleNamespace(hf_config=prm_config), str(wider))


# ------------------------------------------------------------------------------------------------ 2 processes
def _layout(tp: int, pp: int) -> None:
    from grpo_mega.parallel import destroy_model_parallel, init_model_parallel

    destroy_model_parallel()
    init_model_parallel(tp, pp, seed=0)


def _scores(folders: dict[str, str], run_dir: str, mcore_dir: str) -> dict:
    """Scores of open_prm at TP=2 and PP=2 for both HF layouts; of the classifier saved as a megatron folder at TP=2
    and as a training checkpoint at DP=2 (one copy of the replicated head), both opened at PP=2."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from grpo_mega.checkpoint import HFWeights, save_mcore_checkpoint
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import OptimConfig
    from prm.engines import build_prm_engine
    from prm.model import open_prm

    results: dict = {}
    for tp, pp in ((2, 1), (1, 2)):
        _layout(tp, pp)
        for layout, folder in folders.items():
            loaded = open_prm(folder, max_tokens_per_micro_batch=30)
            tag = loaded.tokenizer.convert_tokens_to_ids(loaded.spec.step_tag.strip())
            rows = batch(tag)
            outputs = loaded.engine.forward(rows)
            total = outputs["good_logprob"].exp() + outputs["bad_logprob"].exp()
            results[(layout, tp, pp)] = {
                "spec": loaded.spec, "scores": tag_scores(outputs["good_logprob"]),
                "sum_to_one": float((total - 1)[rows["attention_mask"] == 1].abs().max()),
                "no_output_layer": (not hasattr(loaded.engine.stage, "output_layer")
                                    if parallel_state.is_pipeline_last_stage() else None),
            }
            if (layout, tp) == ("classifier", 2):
                save_mcore_checkpoint(loaded.engine.stage, mcore_dir, folder)
        # the causal LM as a likelihood PRM (an explicit layout: its config says lm_tokens)
        loaded = open_prm(folders["lm_tokens"], spec_overrides={"layout": "likelihood", "step_tag": ""},
                          max_tokens_per_micro_batch=30)
        rows = likelihood_batch()
        outputs = loaded.engine.forward(rows)
        total = outputs["good_logprob"].exp() + outputs["bad_logprob"].exp()
        results[("likelihood", tp, pp)] = {
            "spec": loaded.spec,
            "log_scores": [[float(outputs["good_logprob"][row, last]) for _, last in spans]
                           for row, spans in enumerate(STEP_SPANS)],
            "sum_to_one": float((total - 1)[rows["step_ids"] > 0].abs().max()),
        }
    _layout(1, 1)
    spec = PRMSpec("classifier", "<extra_0>")
    engine = build_prm_engine(Qwen2Config.from_pretrained(folders["classifier"]), spec, None, optim=OptimConfig(),
                              total_steps=1, max_tokens_per_micro_batch=64)
    engine.load_hf_weights(HFWeights(folders["classifier"]))
    config = {"model": {"hf_config": folders["classifier"], "tokenizer": None}, "prm": spec.to_dict()}
    CheckpointManager(run_dir).save(engine, 0, config=config)
    _layout(1, 2)
    loaded = open_prm(run_dir, spec_overrides={"step_tag": "\n\n"})
    outputs = loaded.engine.forward(batch(SPECIAL.index("<extra_0>")))
    results["checkpoint"] = {"spec": loaded.spec, "scores": tag_scores(outputs["good_logprob"])}
    loaded = open_prm(mcore_dir)
    outputs = loaded.engine.forward(batch(SPECIAL.index("<extra_0>")))
    results["mcore"] = {"spec": loaded.spec, "scores": tag_scores(outputs["good_logprob"])}
    return results if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def hf_prms(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_prms")
    return {"classifier": write_classifier_prm(root / "classifier", seed=0),
            "lm_tokens": write_causal_lm(root / "lm_tokens", seed=2)}


def _two_rank_job(folders: dict[str, str], policy: str, prm_dir: str, root: str) -> dict:
    """Both tests' work on 2 processes in one job (a spawn costs ~10 s of imports per process): the scores, then
    the training steps; each part sets its layouts (destroy_model_parallel / init_model_parallel)."""
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=0, device="cpu")
    return {"scores": _scores(folders, f"{root}/run", f"{root}/mcore"),
            "training": _training(folders, policy, prm_dir, root)}


@pytest.fixture(scope="module")
def two_ranks(hf_prms, tmp_path_factory):
    """The 2-process job's results by rank; its policy (a tied causal LM) and the PRM config made from it."""
    root = tmp_path_factory.mktemp("two_ranks")
    policy = write_causal_lm(root / "policy", seed=3, tied=True)
    prm_dir = prm_hf_config_from_policy(policy, root / "prm_config", "classifier")
    return run_distributed(_two_rank_job, 2, {k: str(v) for k, v in hf_prms.items()}, str(policy), str(prm_dir),
                           str(root))


def test_step_scores_match_transformers_at_tp2_and_pp2(hf_prms, two_ranks):
    results = two_ranks[0]["scores"]
    ids = {layout: batch(SPECIAL.index(default_spec(layout).step_tag.strip()))["input_ids"] for layout in hf_prms}
    expected = {layout: reference_scores(folder, layout, ids[layout]) for layout, folder in hf_prms.items()}
    for layout in hf_prms:
        flat = [s for row in expected[layout] for s in row]
        assert max(flat) - min(flat) > 0.2, layout  # scores spread out: a wrong position or class would show
        for tp, pp in ((2, 1), (1, 2)):
            result = results[(layout, tp, pp)]
            assert result["spec"] == default_spec(layout)
            assert _max_diff(result["scores"], expected[layout]) <= MAX_SCORE_DIFF, (layout, tp, pp)
            assert result["sum_to_one"] < 1e-5
            if tp == 2:  # rank 0 is the last stage at TP=2; at PP=2 it is the first
                assert result["no_output_layer"] == (layout == "classifier")
    expected_likelihood = reference_likelihood(hf_prms["lm_tokens"], likelihood_batch()["input_ids"])
    flat = [s for row in expected_likelihood for s in row]
    assert max(flat) - min(flat) > 1.0  # log scores spread out: a step read at the wrong tokens would show
    for tp, pp in ((2, 1), (1, 2)):
        result = results[("likelihood", tp, pp)]
        assert result["spec"] == PRMSpec("likelihood", "")
        assert _max_diff(result["log_scores"], expected_likelihood) <= MAX_SCORE_DIFF, (tp, pp)
        assert result["sum_to_one"] < 1e-5
    checkpoint = results["checkpoint"]
    assert checkpoint["spec"] == PRMSpec("classifier", "\n\n")
    assert _max_diff(checkpoint["scores"], expected["classifier"]) <= MAX_SCORE_DIFF
    assert results["mcore"]["spec"] == default_spec("classifier")
    assert _max_diff(results["mcore"]["scores"], expected["classifier"]) <= MAX_SCORE_DIFF


def step_loss(outputs, micro, scale):
    """Binary cross-entropy of the hard step labels at the tag positions, a share of the mean over all tags."""
    labels, mask = micro["step_labels"], micro["loss_mask"].float()
    nll = -(labels * outputs["good_logprob"] + (1 - labels) * outputs["bad_logprob"])
    return (nll * mask).sum() / scale.global_tokens, {}


def _optim():
    from grpo_mega.config import OptimConfig

    # No clipping: the gradients read after the step are the raw ones. Adam's eps well above reduction-order
    # noise keeps the comparison of parameters after the step about the gradients (see test_engine_megatron).
    return OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, adam_eps=1e-4, decay_style="constant")


def _reduced_main_grads(engine) -> None:
    """Make every rank's ``main_grad`` the DP-reduced gradient, as the plain optimizer's all-reduce leaves it.

    With the distributed optimizer megatron reduce-scatters each gradient bucket: after the step a DP rank holds
    the reduced gradient only in its own 1/DP shard of the bucket, and elsewhere its own unreduced share (at DP=2
    the classifier head, first in the buffer, lies wholly in rank 0's shard). The shards are gathered here, the
    way megatron gathers the updated parameters."""
    import torch.distributed as dist

    if not engine.distributed_optimizer:
        return
    for bucket_group in engine.model.bucket_groups + engine.model.expert_parallel_bucket_groups:
        size = bucket_group.intra_distributed_optimizer_instance_size
        rank = bucket_group.intra_distributed_optimizer_instance_rank
        for bucket in bucket_group.buckets:
            shard = bucket.grad_data.numel() // size
            dist.all_gather_into_tensor(bucket.grad_data, bucket.grad_data[rank * shard : (rank + 1) * shard].clone(),
                                        group=bucket_group.intra_distributed_optimizer_instance_group)


def _training_step(folder: str, layout: str) -> dict:
    """One training step of the PRM in ``folder`` at the current layout: loss, grad norm, the head's gradients (on
    the last stage), every HF weight after the step."""
    from megatron.core import parallel_state
    from transformers import AutoConfig, AutoTokenizer

    from grpo_mega.checkpoint import HFWeights
    from prm.engines import build_prm_engine

    spec = default_spec(layout)
    engine = build_prm_engine(AutoConfig.from_pretrained(folder), spec, AutoTokenizer.from_pretrained(folder),
                              optim=_optim(), total_steps=1, max_tokens_per_micro_batch=24)
    engine.load_hf_weights(HFWeights(folder))
    metrics = engine.train_step(batch(SPECIAL.index(spec.step_tag.strip())), step_loss)
    assert engine.distributed_optimizer == (parallel_state.get_data_parallel_world_size() > 1)
    _reduced_main_grads(engine)
    head_grads = None
    if parallel_state.is_pipeline_last_stage():
        head_grads = {name: p.main_grad.clone() for name, p in engine.stage.head.named_parameters()}
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "head_grads": head_grads,
            "weights": {name: tensor.clone() for name, tensor in engine.export_hf_weights()}}


def _init_from_policy(policy: str, prm_dir: str, run_dir: str, mcore_dir: str) -> dict:
    """A classifier PRM started from a (tied) policy's HF folder, training run and megatron folder: each loaded
    backbone equals the policy's, the head stays as initialised."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights, save_mcore_checkpoint
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.engine import build_policy_engine
    from prm.engines import build_prm_engine

    policy_engine = build_policy_engine(AutoConfig.from_pretrained(policy), optim=_optim(), total_steps=1,
                                        max_tokens_per_micro_batch=64)
    policy_engine.load_hf_weights(HFWeights(policy))
    CheckpointManager(run_dir).save(policy_engine, 0, config={"model": {"hf_config": policy}})
    save_mcore_checkpoint(policy_engine.stage, mcore_dir, policy)
    expected = HFWeights(policy)
    results = {}
    for source in (policy, run_dir, mcore_dir):
        engine = build_prm_engine(AutoConfig.from_pretrained(prm_dir), default_spec("classifier"), None,
                                  optim=_optim(), total_steps=1, max_tokens_per_micro_batch=64)
        head_before = {name: t.clone() for name, t in engine.export_hf_weights() if name.startswith("score.")}
        kind = load_prm_init_weights(engine, source)
        exported = dict(engine.export_hf_weights())
        backbone = {name: t for name, t in exported.items() if not name.startswith("score.")}
        results[kind] = {
            "backbone_names_match": set(backbone) == set(expected) - {"lm_head.weight"},
            "backbone_equal": all(torch.equal(t, expected[name]) for name, t in backbone.items()),
            "head_kept": all(torch.equal(exported[name], t) for name, t in head_before.items()),
            "head_names": sorted(head_before),
        }
    return results


def _training(folders: dict[str, str], policy: str, prm_dir: str, root: str) -> dict:
    import torch.distributed as dist

    results: dict = {"steps": {}}
    for tp, pp in ((1, 1), (2, 1), (1, 2)):  # DP=2, TP=2, PP=2
        _layout(tp, pp)
        for layout, folder in folders.items():
            step = _training_step(folder, layout)
            if dist.get_rank() != 0:
                step["weights"] = None  # every rank exported the same tensors
            results["steps"][(layout, tp, pp)] = step
    _layout(1, 2)
    results["init"] = _init_from_policy(policy, prm_dir, f"{root}/policy_run", f"{root}/policy_mcore")
    return results


def reference_head_grads(folder: Path) -> dict[str, torch.Tensor]:
    """Gradients of ``step_loss`` (mean over all tags of the batch) w.r.t. score.* by torch autograd on the
    transformers model of the classifier folder."""
    from safetensors.torch import load_file
    from transformers import Qwen2Model

    tensors = load_file(str(folder / "model.safetensors"))
    model = Qwen2Model(Qwen2Config.from_pretrained(folder)).float().eval()
    model.load_state_dict({n[len("model."):]: t for n, t in tensors.items() if n.startswith("model.")})
    score = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    score.load_state_dict({n[len("score."):]: t for n, t in tensors.items() if n.startswith("score.")})
    rows = batch(SPECIAL.index("<extra_0>"))
    terms = []
    for row, positions in enumerate(TAG_POSITIONS):
        log_p = torch.log_softmax(score(model(rows["input_ids"][row : row + 1, : LENGTHS[row]]).last_hidden_state[0]),
                                  dim=-1)
        terms += [-log_p[p, int(rows["step_labels"][row, p])] for p in positions]
    torch.stack(terms).mean().backward()
    return {f"score.{name}": p.grad for name, p in score.named_parameters()}


def test_training_step_is_the_same_at_tp2_and_pp2_and_init_from_policy(hf_prms, two_ranks):
    ranks = [rank["training"] for rank in two_ranks]
    steps = ranks[0]["steps"]
    expected_head = reference_head_grads(hf_prms["classifier"])
    for layout in hf_prms:
        reference = steps[(layout, 1, 1)]
        assert reference["loss"] > 0.1 and reference["grad_norm"] > 0.01
        for tp, pp in ((2, 1), (1, 2)):
            step = steps[(layout, tp, pp)]
            assert step["loss"] == pytest.approx(reference["loss"], rel=1e-5), (layout, tp, pp)
            assert step["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), (layout, tp, pp)
            assert set(step["weights"]) == set(reference["weights"])
            for name, tensor in step["weights"].items():
                torch.testing.assert_close(tensor, reference["weights"][name], atol=2e-5, rtol=1e-5,
                                           msg=lambda m: f"{layout} tp={tp} pp={pp} {name}: {m}")
    # The replicated classifier head: every TP rank and every layout holds the gradient torch autograd gives on
    # the transformers model (not twice it, not a TP share of it).
    last_stage_grads = [(rank, key, r["steps"][key]["head_grads"]) for rank, r in enumerate(ranks)
                        for key in r["steps"] if key[0] == "classifier"]
    assert {key for _, key, grads in last_stage_grads if grads is not None} == {
        ("classifier", 1, 1), ("classifier", 2, 1), ("classifier", 1, 2)}
    for rank, key, grads in last_stage_grads:
        if grads is None:
            continue
        assert set(grads) == {"score.0.weight", "score.0.bias", "score.2.weight", "score.2.bias"}
        for name, grad in grads.items():
            scale = expected_head[name].abs().max().item()
            assert scale > 1e-3, name
            torch.testing.assert_close(grad, expected_head[name], atol=1e-5 * max(1.0, scale), rtol=1e-4,
                                       msg=lambda m: f"rank {rank} {key} {name}: {m}")
    init = ranks[0]["init"]
    assert set(init) == {"hf", "training_run", "mcore_model"}
    for kind, result in init.items():
        assert result["backbone_names_match"] and result["backbone_equal"], kind
        assert result["head_kept"] and len(result["head_names"]) == 4, kind
