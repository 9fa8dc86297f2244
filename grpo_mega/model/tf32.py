"""TensorFloat-32 for exactly the fp32 products whose operands are upcast bf16 / fp16 values.

torch runs fp32 CUDA matmuls in full IEEE fp32 by default, on the GPU's general cores: on an H100 that is about a
seventh of the tensor cores' TF32 rate. TF32 keeps fp32's 8-bit exponent and 10 of its 23 stored mantissa bits and
accumulates in fp32. A value upcast from bf16 (8-bit exponent, 7 stored mantissa bits) or fp16 (5-bit exponent, 10
stored bits) has no mantissa bit past the 10th, so TF32 holds it exactly; the product of two such values needs at
most 22 significant bits and is exact in the fp32 accumulator. A TF32 matmul of upcast bf16 / fp16 operands
therefore computes the same products, summed in fp32, as the IEEE fp32 matmul: only the summation order differs,
as it does between any two fp32 GEMM kernels. An operand that is genuinely fp32 (a gradient, an fp32 model's
weight) would be rounded to 11 significant bits: those products keep IEEE fp32.

The setting is torch's process-wide `torch.backends.cuda.matmul.fp32_precision` (torch >= 2.9; the legacy
`allow_tf32` flag before that), saved on entry and restored on exit, also when the body raises. Only this one
setting is touched: reading and writing it leaves torch's legacy flags (`allow_tf32`,
`torch.get_float32_matmul_precision()`) as they were, whichever API the user set them with, whereas flipping the
legacy flag can leave torch refusing to read the new one. The flag only affects cuBLAS: CPU matmuls are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import ContextManager

import torch

EXACT_IN_TF32 = (torch.bfloat16, torch.float16)
"""Dtypes whose every value TF32 represents exactly (module docstring)."""


def _has_fp32_precision() -> bool:
    # torch >= 2.9 has the per-backend setting; older builds raise AttributeError for the unknown name.
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


@contextmanager
def tf32_matmuls() -> Iterator[None]:
    """Let fp32 CUDA matmuls inside run as TF32 on tensor cores; the previous setting comes back on exit (also on
    an exception). Use it only around products whose operands are all exact in TF32 (`tf32_if_exact`)."""
    matmul = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "tf32") if _has_fp32_precision() else ("allow_tf32", True)
    saved = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def tf32_if_exact(*dtypes: torch.dtype) -> ContextManager[None]:
    """`tf32_matmuls()` when every operand's original dtype is bf16 / fp16 (exact in TF32), else a no-op context:
    a product with any genuinely fp32 operand keeps IEEE fp32."""
    if dtypes and all(dtype in EXACT_IN_TF32 for dtype in dtypes):
        return tf32_matmuls()
    return nullcontext()
