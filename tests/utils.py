"""The one tolerance policy of the test suite, and helpers shared by tests.

Results are compared with an fp32 (fp64 for fp64 inputs) reference computed from the same
(already rounded) inputs, elementwise: |actual - expected| <= atol * max|expected| + rtol * |expected|.
The atol term is relative to the tensor's scale because a GEMM's rounding error scales with the
magnitude of its outputs, not of each element.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import torch

# dtype -> (rtol, atol relative to max|expected|). Low-precision rows allow for the output rounding
# plus the extra roundings of partial sums that travel between ranks in the input dtype.
TOLERANCES: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-4, 2e-5),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (3e-2, 1.6e-2),
}

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WORLD_SIZES = (1, 2, 3, 4)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 name: str = "tensor") -> None:
    """Assert ``actual`` matches ``expected`` under the tolerance of ``dtype`` (default: actual's),
    printing where the first mismatch is."""
    dtype = dtype or actual.dtype
    rtol, atol = TOLERANCES[dtype]
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    act = actual.detach().to("cpu", torch.float64)
    exp = expected.detach().to("cpu", torch.float64)
    if not torch.isfinite(act).all():
        idx = tuple(torch.nonzero(~torch.isfinite(act))[0].tolist())
        raise AssertionError(f"{name}: non-finite value {act[idx].item()} at {idx}")
    scale = exp.abs().max().item() if exp.numel() else 0.0
    err = (act - exp).abs()
    bad = err > atol * scale + rtol * exp.abs()
    if bad.any():
        idx = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{name} ({dtype}): {int(bad.sum())}/{bad.numel()} elements out of tolerance "
            f"(rtol={rtol}, atol={atol}*{scale:.3g}); first at {idx}: got {act[idx].item():.6g}, "
            f"expected {exp[idx].item():.6g}; max abs err {err.max().item():.3g}"
        )


def rank_tensors(seed: int, world: int, shape, dtype, scale: float = 1.0):
    """One tensor per rank, the same on every rank for the same seed (so each rank can build the
    single-device reference of the whole group)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * scale).to(dtype) for _ in range(world)]


def test_device() -> torch.device:
    """Where a rank body should put its tensors: the GPU when the pool runs NCCL
    (``PYFUSED_TEST_BACKEND=nccl``, see benchmarks/gpu_check.sh), else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def long_test(what: str):
    """Mark a test that costs more of CI's 25-minute budget (2 cores) than it adds: it runs with
    ``PYFUSED_LONG_TESTS=1`` and is skipped, saying so, otherwise."""
    import pytest

    return pytest.mark.skipif(os.environ.get("PYFUSED_LONG_TESTS") != "1",
                              reason=f"set PYFUSED_LONG_TESTS=1 to run {what} (over CI's time budget)")

