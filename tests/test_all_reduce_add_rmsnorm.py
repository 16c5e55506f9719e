"""pyfused.ops.all_reduce_add_rmsnorm: forward and backward against the fp64 single-device reference
at world sizes 1-4, every dtype, odd hidden sizes; the same error on every rank for bad input;
opcheck of the registered op; the fused method on GPUs (marked gpu)."""
import os

import pytest
import torch

from tests import utils
from tests.utils import DTYPES, WORLD_SIZES, assert_close, rank_tensors

OP = "all_reduce_add_rmsnorm"
# Odd hidden sizes (33, 97) and leading dims on purpose; a 1-D x is a single row.
SHAPES = [(5, 3, 33), (7, 97), (65,)]
EPS = 1e-5
TIMEOUT = 60


def check_against_reference(rank, world, method, dtype, shape, seed, weight_dtype=None, chunks=0,
                            device=None, backward=True):
    """Both outputs and the gradients of x, residual and weight on this rank == the fp64 reference
    of the whole group (the loss counted once: the outputs are replicated)."""
    from pyfused.ops import all_reduce_add_rmsnorm, all_reduce_add_rmsnorm_ref

    hidden = shape[-1]
    x_all = rank_tensors(seed, world, shape, dtype)
    residual = rank_tensors(seed + 1, 1, shape, dtype)[0]
    weight = (1 + 0.25 * rank_tensors(seed + 2, 1, (hidden,), torch.float32)[0]).to(weight_dtype or dtype)
    dev = torch.device(device) if device else utils.test_device()
    x = x_all[rank].to(dev, copy=True).requires_grad_(backward)
    res = residual.to(dev, copy=True).requires_grad_(backward)
    w = weight.to(dev, copy=True).requires_grad_(backward)
    normed, new_res = all_reduce_add_rmsnorm(x, res, w, EPS, method=method, chunks=chunks)

    x64 = [t.double().requires_grad_(backward) for t in x_all]
    r64, w64 = residual.double().requires_grad_(backward), weight.double().requires_grad_(backward)
    ref_normed, ref_res = all_reduce_add_rmsnorm_ref(x64, r64, w64, EPS)
    assert normed.dtype == new_res.dtype == dtype and normed.shape == new_res.shape == x.shape
    what = f"{OP}[{method}] world {world} rank {rank} {tuple(shape)}"
    assert_close(new_res, ref_res, dtype, f"{what} new_residual")
    assert_close(normed, ref_normed, dtype, f"{what} normed")
    if not backward:
        return True
    g_normed, g_res = rank_tensors(seed + 3, 2, shape, dtype)
    ((ref_normed * g_normed.double()).sum() + (ref_res * g_res.double()).sum()).backward()
    torch.autograd.backward([normed, new_res], [g_normed.to(dev), g_res.to(dev)])
    assert_close(x.grad, x64[rank].grad, dtype, f"{what} grad x")
    assert_close(res.grad, r64.grad, dtype, f"{what} grad residual")
    # the activations' dtype sets the error of grad weight, whatever the weight's own dtype
    assert_close(w.grad, w64.grad, dtype, f"{what} grad weight")
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("method", ["unfused", "decomposed", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(ranks, world, method, dtype):
    for i, shape in enumerate(SHAPES):
        assert all(ranks.run(world, check_against_reference, method, dtype, shape, 40 * world + i))


@pytest.mark.parametrize("chunks", [1, 2, 5, 64])
def test_chunk_counts(ranks, chunks):
    """Any chunk count, including more chunks than rows (7), gives the same result."""
    assert all(ranks.run(3, check_against_reference, "decomposed", torch.float32, (7, 33), 9,
                         chunks=chunks))


def test_fp32_weight_with_bf16_activations(ranks):
    assert all(ranks.run(2, check_against_reference, "decomposed", torch.bfloat16, (6, 40), 3,
                         weight_dtype=torch.float32))


def test_only_one_output_used(ranks):
    """A loss on normed alone (grad of new_residual None or zero) still gives exact gradients."""
    assert all(ranks.run(2, _normed_only))


def _normed_only(rank, world):
    from pyfused.ops import all_reduce_add_rmsnorm, all_reduce_add_rmsnorm_ref

    x_all = rank_tensors(1, world, (4, 9), torch.float64)
    res, w = torch.randn(4, 9, dtype=torch.float64), torch.rand(9, dtype=torch.float64) + 0.5
    x = x_all[rank].clone().requires_grad_()
    normed, _ = all_reduce_add_rmsnorm(x, res, w, EPS, method="decomposed")
    normed.sum().backward()
    x64 = [t.clone().requires_grad_() for t in x_all]
    all_reduce_add_rmsnorm_ref(x64, res, w, EPS)[0].sum().backward()
    assert_close(x.grad, x64[rank].grad, torch.float64, "grad x")
    return True


# --- bad input: the same InputError on every rank, before any collective ----------------------

def _inputs(rank, world, case):
    x, res, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    kwargs = {"eps": 1e-6, "method": "decomposed"}
    last = rank == world - 1
    if case == "x shape differs between ranks" and last:
        x, res = torch.randn(6, 8), torch.randn(6, 8)
    elif case == "residual shape":
        res = torch.randn(4, 7)
    elif case == "weight size" and last:
        w = torch.randn(7)
    elif case == "residual dtype":
        res = res.half()
    elif case == "integer x":
        x, res = x.long(), res.long()
    elif case == "eps differs" and last:
        kwargs["eps"] = 1e-5
    elif case == "negative eps":
        kwargs["eps"] = -1.0
    elif case == "method differs" and last:
        kwargs["method"] = "unfused"
    elif case == "unknown method" and last:
        kwargs["method"] = "fastest"
    elif case == "x not a tensor" and last:
        x = x.tolist()
    return x, res, w, kwargs


BAD_CASES = {
    "x shape differs between ranks": "x differs between ranks",
    "residual shape": "residual must have x's shape",
    "weight size": "weight must be 1-D of x's last dim",
    "residual dtype": "residual must have x's dtype",
    "integer x": "must be float32",
    "eps differs": "eps differs between ranks",
    "negative eps": "eps must be a finite number",
    "method differs": "method differs between ranks",
    "unknown method": "method must be one of",
    "x not a tensor": "x must be a tensor",
}


def error_of(rank, world, case):
    from pyfused.comm import InputError
    from pyfused.ops import all_reduce_add_rmsnorm

    x, res, w, kwargs = _inputs(rank, world, case)
    eps = kwargs.pop("eps")
    try:
        all_reduce_add_rmsnorm(x, res, w, eps, **kwargs)
    except InputError as e:
        return ("InputError", str(e))
    except Exception as e:  # noqa: BLE001 - the test wants to see what else was raised
        return (type(e).__name__, str(e))
    return None


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_same_error_everywhere(ranks, world, case):
    errors = ranks.run(world, error_of, case, timeout=TIMEOUT)
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, f"ranks raised different errors: {errors}"
    kind, msg = errors[0]
    assert kind == "InputError" and BAD_CASES[case] in msg and f"pyfused.{OP}" in msg, msg


def _fused_on_cpu(rank, world):
    from pyfused.ops import MethodUnavailable, all_reduce_add_rmsnorm

    try:
        all_reduce_add_rmsnorm(torch.randn(3, 8), torch.randn(3, 8), torch.ones(8), method="fused")
    except MethodUnavailable as e:
        return str(e)
    return None


def test_fused_unavailable_on_cpu_says_why(ranks):
    msgs = ranks.run(2, _fused_on_cpu, timeout=TIMEOUT)
    assert len(set(msgs)) == 1 and msgs[0] is not None, msgs
    assert "not available here because inputs are on cpu" in msgs[0]


def _opcheck(rank, world):
    from pyfused.comm import group_name, resolve_group

    torch.manual_seed(rank)
    x = torch.randn(5, 12, requires_grad=True)
    res = torch.randn(5, 12, requires_grad=True)
    w = torch.randn(12, requires_grad=True)
    torch.library.opcheck(torch.ops.pyfused.all_reduce_add_rmsnorm.default,
                          (x, res, w, 1e-6, group_name(resolve_group(None)), "decomposed", 2))
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(ranks, world):
    """Schema, fake implementation, autograd registration and AOT dispatch of the registered op."""
    assert all(ranks.run(world, _opcheck, timeout=300))


def test_single_process_without_init():
    from pyfused.ops import all_reduce_add_rmsnorm, all_reduce_add_rmsnorm_ref

    x, res, w = torch.randn(3, 6), torch.randn(3, 6), torch.rand(6)
    normed, new_res = all_reduce_add_rmsnorm(x, res, w)
    ref_normed, ref_res = all_reduce_add_rmsnorm_ref([x], res, w)
    assert_close(new_res, ref_res)
    assert_close(normed, ref_normed)


# --- GPU: the fused method (benchmarks/gpu_check.sh runs these with NCCL ranks on one GPU) ------

def _need_nccl_pool(world):
    if world > 1 and "nccl" not in os.environ.get("PYFUSED_TEST_BACKEND", "gloo"):
        pytest.skip("multi-rank GPU runs need the NCCL pool: PYFUSED_TEST_BACKEND=nccl "
                    "(benchmarks/gpu_check.sh sets it)")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_matches_reference_gpu(ranks, world, dtype):
    """Fused forward (one-shot at these sizes) and backward vs the reference; (4096, 8192) bf16 is
    16 MiB, above the one-shot limit, so it runs two-shot."""
    _need_nccl_pool(world)
    shapes = [(5, 3, 33), (7, 97), (64, 4096)] + ([(4096, 8192)] if dtype == torch.bfloat16 else [])
    for i, shape in enumerate(shapes):
        if world == 1:
            assert check_against_reference(0, 1, "fused", dtype, shape, 70 + i, device="cuda")
        else:
            assert all(ranks.run(world, check_against_reference, "fused", dtype, shape, 70 + i,
                                 timeout=300))


def _bench_quick(rank, world):
    import torch.distributed as dist

    from benchmarks import bench_all_reduce_add_rmsnorm as suite
    from pyfused.bench.harness import BenchContext

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=1)
    return suite.run(ctx)


def test_benchmark_suite_quick(ranks):
    """The suite runs collectively, checks every method against unfused, and reports fused as
    unavailable (with the reason) on CPU instead of a number."""
    rows = ranks.run(2, _bench_quick, timeout=300)[0]
    methods = [r["method"] for r in rows]
    assert methods.count("unfused") == 2 and methods.count("all_reduce alone") == 2, methods
    fused = [r for r in rows if r["method"] == "fused"]
    assert fused and all(r["status"].startswith("unavailable: ") and "inputs are on cpu" in r["status"]
                         for r in fused)
    timed = [r for r in rows if r["method"] in ("unfused", "decomposed", "auto")]
    assert all(r["time_ms"] > 0 and r["algbw_GBps"] > 0 for r in timed), timed
