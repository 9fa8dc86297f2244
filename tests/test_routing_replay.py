"""Routing replay (``rollout.routing_replay``) on a tiny random Qwen3-MoE, on 2 gloo processes: the hf engine's routes
equal megatron's own routing (RECORD mode) of the same sequences in fp32; replayed routes reach every router at EP=2,
TP=2 x EP=2 (sequence parallel, packed rows) and PP=2, and the log-probs equal transformers' forced to those routes
after the routers were perturbed so that they would route otherwise; a short GRPO run with replay trains and reports
the sampler-vs-trainer log-prob difference; the settings replay cannot run with are refused before launch."""

import subprocess
from pathlib import Path

import pytest
import torch

from cli_runner import run_grpo_mega
from dist_utils import run_distributed
from test_qwen3_moe import write_moe_model

REPO = Path(__file__).resolve().parent.parent

# (tp, pp, ep, share_prompt_prefix) on 2 processes; DP = 2 / (tp * pp)
REPLAY_LAYOUTS = {"dp2_ep2": (1, 1, 2, False), "tp2_ep2_sp_packed": (2, 1, 2, True), "pp2": (1, 2, 1, False)}


def _batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """Two prompts with two responses each (rows share their prompt: packed micro-batches), rows of odd and even
    length (sequence-parallel padding)."""
    from grpo_mega.data.batch import sequences_to_batch

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (5, 4)]
    responses = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (4, 6, 3, 5)]
    return sequences_to_batch([prompts[0], prompts[0], prompts[1], prompts[1]], responses, pad_id=0)


def _rows(batch) -> list[list[int]]:
    return [batch["input_ids"][row, :int(n)].tolist() for row, n in enumerate(batch["attention_mask"].sum(1))]


def _hf_logprobs(model, batch, routes=None) -> torch.Tensor:
    """transformers' log-probs [B, L] of the batch's tokens (0 at position 0), each layer's router forced to
    ``routes`` [B, L, layers, top-k] when given (the probabilities: its own softmax at those experts, renormalised,
    as Qwen3-MoE's router with norm_topk_prob)."""
    gates = [layer.mlp.gate for layer in model.model.layers]

    def forced(gate, indices):
        def forward(hidden):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            top = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, indices)
            return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), indices
        return forward

    if routes is not None:
        for layer, gate in enumerate(gates):
            gate.forward = forced(gate, routes[:, :, layer].reshape(-1, routes.shape[-1]).long())
    try:
        with torch.no_grad():
            logits = model(batch["input_ids"]).logits.float()
    finally:
        for gate in gates:
            gate.__dict__.pop("forward", None)
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, batch["input_ids"][:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logp, (1, 0))


def _megatron_records_routes(hf_dir: str, batch) -> torch.Tensor:
    """megatron's own routing of ``batch``'s rows at TP=PP=EP=1 in fp32 (RECORD mode): [B, L, layers, top-k]."""
    from transformers import AutoConfig
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from grpo_mega.checkpoint import HFWeights, load_hf_weights, mcore_logits
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf

    config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(gpt_config_from_hf(config, overrides={"perform_initialization": False,
                                                                   "moe_enable_routing_replay": True}))
    load_hf_weights(model, HFWeights(hf_dir), config)
    routers = sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number)
    for router in routers:
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    mcore_logits(model, batch["input_ids"])
    rows, length = batch["input_ids"].shape
    # each router saw [S, B, H] as rows s * B + b
    return torch.stack([r.router_replay.get_recorded_indices().view(length, rows, -1).transpose(0, 1)
                        for r in routers], dim=2)


def _replay(hf_dir: str, perturbed_dir: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    from megatron.core.transformer.moe.router import TopKRouter

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.config import OptimConfig
    from grpo_mega.data.batch import routes_to_tokens
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from grpo_mega.rollout.hf_routes import routed_experts

    init_distributed(1, 1, seed=0, device="cpu")
    config = AutoConfig.from_pretrained(hf_dir)
    batch = _batch(config.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    routes = routed_experts(hf, _rows(batch), pad_token_id=0, batch_size=3)  # the hf engine's routes
    batch["routed_experts"] = routes_to_tokens(batch, routes)
    out = {"hf_routes": routes, "megatron_routes": _megatron_records_routes(hf_dir, batch), "layouts": {}}
    perturbed = AutoModelForCausalLM.from_pretrained(perturbed_dir, dtype=torch.float32).eval()
    out["perturbed_routes"] = routed_experts(perturbed, _rows(batch), pad_token_id=0, batch_size=4)
    out["forced"] = _hf_logprobs(perturbed, batch, batch["routed_experts"])
    out["free"] = _hf_logprobs(perturbed, batch)
    out["batch"] = batch
    for name, (tp, pp, ep, share) in REPLAY_LAYOUTS.items():
        destroy_model_parallel()
        init_model_parallel(tp, pp, seed=0, ep=ep)
        policy = build_policy_engine(AutoConfig.from_pretrained(perturbed_dir), optim=OptimConfig(), total_steps=1,
                                     max_tokens_per_micro_batch=24, share_prompt_prefix=share, routing_replay=True)
        policy.load_hf_weights(HFWeights(perturbed_dir))
        calls = []

        def check(router, inputs, outputs):  # the router's experts are the targets set for this micro-batch
            target = router.router_replay.target_topk_idx
            expected = torch.zeros(outputs[1].shape, dtype=torch.int32).scatter(1, target, 1).bool()
            calls.append(bool(torch.equal(outputs[1], expected)) and target.shape[0] == outputs[1].shape[0])

        routers = [m for m in policy.stage.modules() if isinstance(m, TopKRouter)]
        for router in routers:
            router.register_forward_hook(check)
        logprobs, _ = policy.forward_logprobs(batch)
        targets_left = [r.router_replay.target_topk_idx for r in routers if r.router_replay.target_topk_idx is not None]
        out["layouts"][name] = {"logprobs": logprobs, "calls": calls, "routers": len(routers),
                                "packed": policy.share_prompt_prefix, "targets_left": len(targets_left)}
        try:
            policy.forward_logprobs({k: v for k, v in batch.items() if k != "routed_experts"})
        except ValueError as error:
            out["layouts"][name]["without_routes"] = str(error)
    return out


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("replay")
    hf_dir = write_moe_model(root / "hf")
    perturbed_dir = write_moe_model(root / "perturbed")  # same random weights (seed), routers then rolled
    state = load_file(str(perturbed_dir / "model.safetensors"))
    for name in [n for n in state if n.endswith("mlp.gate.weight")]:
        state[name] = state[name].roll(1, dims=0).contiguous()  # expert e now scores as expert e - 1 did
    save_file(state, str(perturbed_dir / "model.safetensors"), metadata={"format": "pt"})
    return run_distributed(_replay, 2, str(hf_dir), str(perturbed_dir))[0]


def test_the_hf_engines_routes_are_megatrons_own_routing_in_fp32(replayed):
    recorded = replayed["megatron_routes"].sort(dim=-1).values
    for row, route in enumerate(replayed["hf_routes"]):
        assert route.dtype.name == "uint8" and route.shape == (len(route), 4, 2)
        # the rows the rollout routed: every token but the last
        assert torch.equal(torch.as_tensor(route).long().sort(dim=-1).values, recorded[row, :len(route)]), row


def test_replayed_routes_reach_every_router_and_give_the_logprobs_of_those_routes(replayed):
    batch = replayed["batch"]
    real = batch["attention_mask"].bool().clone()
    real[:, 0] = False  # the first token has no log-prob
    # the perturbation changes routing (else replay would prove nothing), and the log-probs with it
    changed = [(torch.as_tensor(a).long().sort(-1).values != torch.as_tensor(b).long().sort(-1).values).any(-1)
               for a, b in zip(replayed["hf_routes"], replayed["perturbed_routes"])]
    assert torch.cat(changed).float().mean() > 0.5
    assert (replayed["free"] - replayed["forced"])[real].abs().max() > 1e-2
    for name, layout in replayed["layouts"].items():
        assert layout["calls"] and all(layout["calls"]), name  # every router call took the targets
        assert layout["targets_left"] == 0, name  # cleared after each micro-batch's forward
        assert "has no 'routed_experts'" in layout["without_routes"], name
        diff = (layout["logprobs"] - replayed["forced"])[real].abs().max()
        assert diff < 1e-4, (name, float(diff))
    assert replayed["layouts"]["tp2_ep2_sp_packed"]["packed"]  # the packed micro-batches were used
    assert replayed["layouts"]["pp2"]["routers"] == 2  # each stage drove its own two layers


def test_route_less_positions_get_distinct_valid_experts():
    from grpo_mega.data.batch import routes_to_tokens, sequences_to_batch

    batch = sequences_to_batch([[1, 2, 3], [4, 5]], [[6, 7], [8]], pad_id=0)
    routes = [torch.full((4, 3, 2), 5, dtype=torch.uint8), torch.full((2, 3, 2), 6, dtype=torch.uint8)]
    out = routes_to_tokens(batch, routes)
    assert out.shape == (2, 5, 3, 2) and out.dtype == torch.uint8
    assert (out[0, :4] == 5).all() and (out[1, :2] == 6).all()
    assert (out[0, 4] == torch.tensor([0, 1], dtype=torch.uint8)).all()  # last token
    assert (out[1, 2:] == torch.tensor([0, 1], dtype=torch.uint8)).all()  # last token and padding
    assert routes_to_tokens(batch, [r.to(torch.int32) * 100 for r in routes]).dtype == torch.int16


def test_stage_routes_follow_the_routers_row_order_and_sequence_parallel_slice():
    from grpo_mega.engine.routing_replay import stage_routes

    routes = torch.arange(2 * 3).view(2, 3, 1, 1).expand(2, 3, 1, 2).to(torch.uint8)  # value = b * 3 + s
    rows = stage_routes({"routed_experts": routes}, 1, 0, 1, False)[:, 0, 0]
    assert rows.tolist() == [0, 3, 1, 4, 2, 5, 0, 0]  # s * B + b, then one padded position (experts 0..k-1)
    second = stage_routes({"routed_experts": routes}, 1, 1, 2, True)[:, 0, 0]
    assert second.tolist() == [2, 5, 0, 0]  # the second half of the padded sequence
    packed = {"routed_experts": routes, "packed_source": torch.tensor([0, 1, 2, 4, 5])}
    assert stage_routes(packed, 0, 0, 1, False)[:, 0, 0].tolist() == [0, 1, 2, 4, 5]


def _train(*args: str) -> subprocess.CompletedProcess:
    return run_grpo_mega("train", *args)


@pytest.fixture(scope="module")
def moe_task(tmp_path_factory):
    from tiny_task import build_tiny_qwen3_task

    return build_tiny_qwen3_task(tmp_path_factory.mktemp("moe_task"), moe=True)


@pytest.mark.parametrize("setting, message", [
    (["parallel.expert=2", "parallel.recompute=full"], "rollout.routing_replay=true with parallel.recompute=full"),
    (["engine=deepspeed", "parallel.tensor=1"], "rollout.routing_replay=true replays routes through megatron-core"),
])
def test_settings_replay_cannot_run_with_are_refused_before_launch(moe_task, tmp_path, setting, message):
    from tiny_task import tiny_run_overrides

    result = _train("--config", "configs/quickstart_grpo.yaml", "--nproc", "2",
                    *tiny_run_overrides(moe_task, tmp_path / "run", "rollout.routing_replay=true", *setting))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr[-3000:]


def test_a_dense_model_is_refused_before_launch(tmp_path):
    from tiny_task import build_tiny_task, tiny_run_overrides

    task = build_tiny_task(tmp_path / "task")
    result = _train("--config", "configs/quickstart_grpo.yaml", "--nproc", "2",
                    *tiny_run_overrides(task, tmp_path / "run", "rollout.routing_replay=true"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "rollout.routing_replay=true is for mixture-of-experts models" in lines[0]


@pytest.mark.slow
def test_grpo_with_routing_replay_trains_at_ep2_and_reports_the_logprob_difference(moe_task, tmp_path):
    from tiny_task import tiny_run_overrides

    from grpo_mega.run.metrics import read_metrics

    run_dir = tmp_path / "run"
    result = _train("--config", "configs/quickstart_grpo.yaml", "--nproc", "2",
                    *tiny_run_overrides(moe_task, run_dir, "rollout.routing_replay=true", "rollout.engine=hf",
                                        "parallel.tensor=1", "parallel.expert=2", "trainer.total_steps=2",
                                        "algorithm.ppo_epochs=2", "optim.lr=1e-3"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(row["actor/optimizer_steps"] == 2 for row in rows)
    # the old log-probs (replayed) against the hf engine's: the same routes, fp32
    assert all(row["rollout/logprob_diff_max"] < 1e-3 for row in rows)
    assert all(row["moe/expert_load_max_over_mean"] >= 1.0 for row in rows)


def test_vllm_outputs_carry_their_routes_and_a_missing_one_is_named():
    """The vLLM side without vLLM (it cannot return routes on the CPU wheel): RequestOutputs shaped as vLLM 0.32's,
    and the arguments the engine adds to ``vllm.LLM``."""
    from types import SimpleNamespace

    import numpy as np

    from grpo_mega.rollout.vllm_outputs import completions_from_vllm
    from grpo_mega.rollout.vllm_settings import routing_replay_arguments

    def output(routes):
        logprobs = [{7: SimpleNamespace(logprob=-0.5)}, {8: SimpleNamespace(logprob=-0.25)}]
        sample = SimpleNamespace(index=0, token_ids=[7, 8], logprobs=logprobs, finish_reason="length",
                                 stop_reason=None, routed_experts=routes)
        return SimpleNamespace(outputs=[sample])

    routes = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)  # prompt 3 + response 2 - 1 rows
    done = completions_from_vllm([output(routes)], [[1, 2, 3]], 2, str, routed_experts=True)
    assert len(done) == 2 and all(c.routed_experts is routes for c in done)  # greedy: one sample copied
    assert completions_from_vllm([output(None)], [[1, 2, 3]], 1, str)[0].routed_experts is None
    with pytest.raises(RuntimeError, match="vLLM returned no routed_experts for prompt 0"):
        completions_from_vllm([output(None)], [[1, 2, 3]], 1, str, routed_experts=True)
    with pytest.raises(RuntimeError, match=r"expected \[4, layers, top-k\]"):
        completions_from_vllm([output(routes[:3])], [[1, 2, 3]], 1, str, routed_experts=True)
    assert routing_replay_arguments({}) == {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    with pytest.raises(ValueError, match="prefix caching"):
        routing_replay_arguments({"enable_prefix_caching": False})
    with pytest.raises(ValueError, match="pipeline parallelism"):
        routing_replay_arguments({"pipeline_parallel_size": 2})


def test_the_hf_engine_returns_each_completions_routes(moe_task):
    """Sampled and greedy (copied) completions carry [prompt + response - 1, layers, top-k] routes: those of one
    forward of the finished sequence."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_mega.rollout import SamplingConfig
    from grpo_mega.rollout.hf_engine import HFRolloutEngine
    from grpo_mega.rollout.hf_routes import routed_experts

    model_dir, _ = moe_task
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFRolloutEngine(model, tokenizer, return_routed_experts=True)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("Q: 3 + 4 = ? A:", "Q: 12 - 2 = ?")]
    for sampling in (SamplingConfig(temperature=1.0, max_new_tokens=6, n=2, seed=1),
                     SamplingConfig(temperature=0, max_new_tokens=6, n=2, stop=["="])):
        done = engine.generate(prompts, sampling)
        sequences = [c.prompt_ids + c.response_ids for c in done]
        expected = routed_experts(model, sequences, pad_token_id=engine.pad_token_id, batch_size=1)
        layers, topk = model.config.num_hidden_layers, model.config.num_experts_per_tok
        for completion, routes in zip(done, expected):
            assert completion.routed_experts.shape == (len(completion.prompt_ids) + len(completion.response_ids) - 1,
                                                       layers, topk)
            assert (completion.routed_experts == routes).all()
    assert HFRolloutEngine(model, tokenizer).generate(prompts, sampling)[0].routed_experts is None


def test_an_async_checkpoint_keeps_the_routes_of_batches_in_flight():
    """``rollout.mode: async`` checkpoints hold the batches in flight; their routes must load with weights_only."""
    import io

    import numpy as np

    from grpo_mega.data.prompts import PromptRecord
    from grpo_mega.rollout.base import Completion
    from grpo_mega.stages.rollout import RolloutBatch
    from grpo_mega.stages.rollout_feed import batch_from_state, batch_state

    routes = np.ones((3, 2, 2), dtype=np.uint8)
    completion = Completion(0, [1, 2], [3, 4], [-0.1, -0.2], "x", "length", routed_experts=routes)
    record = PromptRecord(prompt="p", prompt_ids=[1, 2], answer="a", raw_prompt="p", source="t:1")
    batch = RolloutBatch([record], [completion], torch.zeros(1), torch.zeros(1), None, None)
    buffer = io.BytesIO()
    torch.save(batch_state(batch), buffer)
    buffer.seek(0)
    loaded = batch_from_state(torch.load(buffer, weights_only=True))
    assert torch.equal(torch.as_tensor(loaded.completions[0].routed_experts), torch.as_tensor(routes))
