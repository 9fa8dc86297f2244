"""TF32 for the LM head's products of upcast bf16/fp16 operands (`grpo_mega.model.tf32`, `model.logits_in_fp32`).

What a CPU can show: the context restores torch's setting (also on an exception, whichever API the user set it
with, without deprecation warnings); and, through the real `vocab_parallel_logprobs_and_entropy` (forward and
backward, one gloo process), exactly the matmuls whose fp32 operands are all exact in TF32 run with TF32 allowed,
while products with a genuine fp32 operand (dL/dz, an fp32 model's weight) do not; and the log-probs, entropies
and gradients are bitwise those computed without the scope. The speed and GPU equality are checked by
`bench/lm_head_tf32.py` on a GPU.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

import grpo_mega.model.tf32 as tf32_module
from grpo_mega.model.tf32 import tf32_if_exact, tf32_matmuls

MATMUL = torch.backends.cuda.matmul
BENCH = Path(__file__).resolve().parents[1] / "bench" / "lm_head_tf32.py"


@pytest.fixture
def restore_precision():
    saved = MATMUL.fp32_precision
    yield
    MATMUL.fp32_precision = saved


@pytest.mark.parametrize("prior", ["none", "ieee", "tf32"])
def test_tf32_matmuls_sets_and_restores_the_setting_also_on_exception(prior, restore_precision):
    MATMUL.fp32_precision = prior
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation (or other) warning from the API used
        with tf32_matmuls():
            assert MATMUL.fp32_precision == "tf32"
        assert MATMUL.fp32_precision == prior
        with pytest.raises(RuntimeError, match="boom"), tf32_matmuls():
            assert MATMUL.fp32_precision == "tf32"
            raise RuntimeError("boom")
    assert MATMUL.fp32_precision == prior


def test_tf32_if_exact_enters_only_for_low_precision_operands(restore_precision):
    MATMUL.fp32_precision = "ieee"
    for dtypes, expected in [((torch.bfloat16, torch.bfloat16), "tf32"), ((torch.float16, torch.bfloat16), "tf32"),
                             ((torch.bfloat16, torch.float32), "ieee"), ((torch.float32, torch.float32), "ieee"),
                             ((), "ieee")]:
        with tf32_if_exact(*dtypes):
            assert MATMUL.fp32_precision == expected, dtypes
        assert MATMUL.fp32_precision == "ieee"


# Users often set TF32 with the legacy API; torch refuses to read a flag whose legacy and new settings were mixed
# inconsistently. Each prior runs in a fresh interpreter (legacy settings stick to the process).
_LEGACY_PRIOR = """
import importlib.util
import torch
spec = importlib.util.spec_from_file_location("tf32", {path!r})  # the module alone: no megatron import
tf32 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tf32)
m = torch.backends.cuda.matmul
{prior}
def observe():
    return (m.allow_tf32, m.fp32_precision, torch.get_float32_matmul_precision())
before = observe()
with tf32.tf32_matmuls():
    assert m.fp32_precision == "tf32"
assert observe() == before, (observe(), before)
print("ok", before)
"""


@pytest.mark.parametrize("prior", ["torch.backends.cuda.matmul.allow_tf32 = True",
                                   "torch.backends.cuda.matmul.allow_tf32 = False",
                                   "torch.set_float32_matmul_precision('high')"])
def test_tf32_matmuls_leaves_legacy_settings_readable_and_unchanged(prior):
    code = _LEGACY_PRIOR.format(prior=prior, path=tf32_module.__file__)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def _tf32_exact(tensor: torch.Tensor) -> bool:
    """No fp32 mantissa bit below TF32's 10 stored bits is set."""
    return bool(((tensor.detach().contiguous().view(torch.int32) & 0x1FFF) == 0).all())


def _logprob_job() -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    import grpo_mega.model.logprobs as logprobs
    from grpo_mega.parallel import init_distributed

    init_distributed(1, 1, seed=0, device="cpu")
    matmuls = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2),
               torch.ops.aten.addmm_.default: (1, 2), torch.ops.aten.bmm.default: (0, 1)}

    class RecordMatmuls(TorchDispatchMode):
        """Each fp32 matmul: whether all its operands are exact in TF32, and whether TF32 was allowed."""

        def __init__(self):
            super().__init__()
            self.records = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in matmuls:
                operands = [args[i] for i in matmuls[func]]
                if all(op.dtype == torch.float32 for op in operands):
                    self.records.append((all(_tf32_exact(op) for op in operands),
                                         torch.backends.cuda.matmul.fp32_precision == "tf32"))
            return func(*args, **(kwargs or {}))

    def run(hidden_dtype, weight_dtype, logits_in_fp32):
        generator = torch.Generator().manual_seed(3)
        hidden = torch.randn(23, 16, generator=generator).to(hidden_dtype).requires_grad_()
        weight = (torch.randn(37, 16, generator=generator) * 2).to(weight_dtype).requires_grad_()
        labels = torch.randint(0, 35, (23,), generator=generator)
        logp, entropy = logprobs.vocab_parallel_logprobs_and_entropy(
            hidden, weight, labels, vocab_size=35, chunk_size=5, temperature=0.7, logits_in_fp32=logits_in_fp32)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        return [t.detach().clone() for t in (logp, entropy, hidden.grad, weight.grad)]

    cases = {"bf16": (torch.bfloat16, torch.bfloat16, True), "fp16": (torch.float16, torch.float16, True),
             "fp32": (torch.float32, torch.float32, True), "bf16-hidden-fp32-weight": (torch.bfloat16,
             torch.float32, True), "bf16-logits-in-bf16": (torch.bfloat16, torch.bfloat16, False)}
    result = {}
    for name, case in cases.items():
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        with RecordMatmuls() as recorder:
            scoped = run(*case)
        restored = torch.backends.cuda.matmul.fp32_precision
        real = logprobs.tf32_if_exact
        logprobs.tf32_if_exact = lambda *dtypes: __import__("contextlib").nullcontext()  # the head before TF32
        try:
            unscoped = run(*case)
        finally:
            logprobs.tf32_if_exact = real
        result[name] = {"records": recorder.records, "restored": restored,
                        "bitwise_equal": [torch.equal(a, b) for a, b in zip(scoped, unscoped)]}
    result["bench"] = _load_bench().compare_tf32_head("cpu", tokens=24, hidden_size=16, vocab_size=40, chunk_size=8,
                                                      repeats=1, reference_tokens=8)
    return result


@pytest.fixture(scope="module")
def logprob_runs():
    return run_distributed(_logprob_job, 1)[0]


def test_tf32_runs_exactly_the_products_of_tf32_exact_operands(logprob_runs):
    for name, run in logprob_runs.items():
        if name == "bench":
            continue
        assert run["records"], name
        for exact, tf32 in run["records"]:
            # Never a TF32 product that could round; never an exact fp32 product left off the tensor cores.
            assert tf32 == exact, (name, run["records"])
        assert run["restored"] == "ieee", name


def test_low_precision_logit_products_get_tf32_and_gradient_products_do_not(logprob_runs):
    for name in ("bf16", "fp16"):
        records = logprob_runs[name]["records"]
        # Forward logits (5 chunks of 23 tokens x 7 blocks of the 35 real rows) and their recomputation in backward.
        assert sum(tf32 for _, tf32 in records) == 2 * 5 * 7, name
        assert any(not tf32 for _, tf32 in records), name  # dL/dz W and dL/dz^T h stay IEEE fp32
    for name in ("fp32", "bf16-hidden-fp32-weight", "bf16-logits-in-bf16"):
        assert not any(tf32 for _, tf32 in logprob_runs[name]["records"]), name


def test_logprobs_entropy_and_gradients_are_unchanged_on_cpu(logprob_runs):
    for name, run in logprob_runs.items():
        if name != "bench":
            assert all(run["bitwise_equal"]), (name, run["bitwise_equal"])


def test_gpu_comparison_bench_runs_on_cpu(logprob_runs):
    """`bench/lm_head_tf32.py` (the GPU check) keeps working: on the CPU both heads agree exactly."""
    report = logprob_runs["bench"]
    assert report["max_rel_diff"] == {"logprobs": 0.0, "entropy": 0.0, "grad_hidden": 0.0, "grad_weight": 0.0}
    # The fp64 reference is the gradient of the loss the bench trains on: bf16 rounding apart (~1e-3), the same.
    errors = report["grad_error_vs_fp64"]
    assert errors["tf32"] == errors["ieee"] and 0 < max(errors["tf32"].values()) < 1e-2, errors
    assert _load_bench().heads_agree(report) is None
    assert report["max_abs_err_vs_fp64"]["tf32"] < 1e-4
    assert set(report["seconds"]) == {"forward", "train"}
    assert report["fp32_precision_after"] == "ieee"  # as the job had set it


def _load_bench():
    spec = importlib.util.spec_from_file_location("lm_head_tf32", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _simulated_head_report(grad_logit_path: str) -> dict:
    """``compare_tf32_head``'s report for a bf16 head (64 tokens, hidden 64, 4,096 rows) against the IEEE head,
    where the compared head differs by ``grad_logit_path``: "sum_order" (its logits summed in another order, as
    TF32's exact products are: the GPU case) or "bf16" (dL/dz rounded to bf16 before its products)."""
    bench = _load_bench()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 64, generator=generator).bfloat16()
    weight = (torch.randn(4096, 64, generator=generator) * 3 / 64**0.5).bfloat16()
    labels = torch.randint(0, 4096, (64,), generator=generator)

    def head(logits, grad_logits_in_bf16: bool = False):
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        grad_logits = -log_p.exp() * (1 + 0.1 * (log_p + entropy[:, None]))
        grad_logits[torch.arange(64), labels] += 1
        if grad_logits_in_bf16:
            grad_logits = grad_logits.bfloat16().float()
        return (log_p.gather(-1, labels[:, None])[:, 0], entropy,
                (grad_logits @ weight.float()).bfloat16(), (grad_logits.t() @ hidden.float()).bfloat16())

    ieee_logits = hidden.float() @ weight.float().t()
    half = 32
    other_order = hidden[:, :half].float() @ weight[:, :half].float().t() + \
        hidden[:, half:].float() @ weight[:, half:].float().t()
    outputs = {"tf32": head(other_order if grad_logit_path == "sum_order" else ieee_logits,
                            grad_logits_in_bf16=grad_logit_path == "bf16"),
               "ieee": head(ieee_logits)}
    _, *exact = bench.fp64_head(hidden, weight, labels, chunk_size=16)
    fields = ("logprobs", "entropy", "grad_hidden", "grad_weight")
    return bench, {
        "max_rel_diff": {f: bench._max_rel(a, b) for f, a, b in zip(fields, outputs["tf32"], outputs["ieee"])},
        "share_differing": {f: bench._share_differing(a, b)
                            for f, a, b in zip(fields, outputs["tf32"], outputs["ieee"])},
        "grad_error_vs_fp64": {name: {"grad_hidden": bench.relative_error(out[2], exact[0]),
                                      "grad_weight": bench.relative_error(out[3], exact[1])}
                               for name, out in outputs.items()},
    }


def test_gpu_check_accepts_bf16_gradients_that_differ_by_sum_order_alone():
    """The first H200 run failed the check on correct code: a sum-order difference before the bf16 cast moved
    elements by one bf16 unit, 3.5e-3 of the largest. `heads_agree` judges each head against fp64 instead."""
    bench, report = _simulated_head_report("sum_order")
    assert report["share_differing"]["grad_weight"] > 0  # the heads' bf16 gradients do differ
    assert bench.heads_agree(report) is None


def test_gpu_check_rejects_a_less_accurate_gradient():
    bench, report = _simulated_head_report("bf16")
    problem = bench.heads_agree(report)
    assert problem is not None and "grad_hidden" in problem and "grad_weight" in problem, report["grad_error_vs_fp64"]
    report["max_rel_diff"]["entropy"] = 3e-4
    assert "entropy max relative difference 3.00e-04" in bench.heads_agree(report)
