"""pyfused.ops.ring_attention: every method's forward and dQ/dK/dV against single-device attention
over the whole sequence (fp32 / fp64 reference of the same rounded inputs), at context-parallel
sizes 1-4, fp32 and bf16; causal and not, grouped-query heads, a sliding window, softcapping, the
zigzag and contiguous layouts, odd local lengths (contiguous) and odd global lengths padded at the
end (causal: the real rows are exact); bad input -> one InputError on every rank.

Each rank body runs several cases, so that a world size costs one dispatch per method: the grid
is cut to what catches layout, mask and head-mapping bugs (world 3 for power-of-two assumptions,
D = 10 and 5-row chunks for odd sizes) within a few seconds.
"""
import pytest
import torch

from tests.utils import assert_close, rank_tensors

TIMEOUT = 120
B, D = 2, 10


def _cases(method: str, world: int):
    """(name, heads q, heads kv, S_local, layout, options) of one method at one world size."""
    hq, hkv = (2 * world, world) if method == "ulysses" else (6, 2)
    cases = [("causal", hq, hkv, 10, "zigzag", {}),
             ("full", hq, hq, 10, "zigzag", {"causal": False}),
             ("window", hq, hkv, 10, "zigzag", {"window": 7}),
             ("softcap+window", hq, hkv, 10, "zigzag", {"window": 9, "softcap": 2.0}),
             ("contiguous odd", hq, hkv, 7, "contiguous", {})]
    return cases


def _inputs(seed, world, hq, hkv, s_local, dtype):
    s = world * s_local
    q, g = rank_tensors(seed, 2, (B, hq, s, D), dtype)
    k, v = rank_tensors(seed + 1, 2, (B, hkv, s, D), dtype)
    return q, k, v, g


def _check(rank, world, method, dtype, name, hq, hkv, s_local, layout, options, seed):
    from pyfused.ops.ring_attention import ring_attention, ring_attention_ref
    from pyfused.ops.sequence_shards import shard_sequence

    q, k, v, g = _inputs(seed, world, hq, hkv, s_local, dtype)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = ring_attention_ref(*ref_in, **options)
    ref.backward(g.double())

    def mine(t):
        return shard_sequence(t, 2, rank, world, layout)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, method=method, layout=layout, **options)
    out.backward(mine(g))
    what = f"ring_attention[{method}] {name} world {world} rank {rank} {dtype}"
    assert out.dtype == dtype and out.shape == local[0].shape
    assert_close(out, mine(ref), dtype, f"{what} out")
    for label, mine_t, ref_t in zip("qkv", local, ref_in):
        assert_close(mine_t.grad, mine(ref_t.grad), dtype, f"{what} d{label}")
    return True


BF16_CASES = ("causal", "softcap+window")  # bf16 reuses the fp32 cases' code paths: two suffice


def _check_all(rank, world, method, seed):
    for i, case in enumerate(_cases(method, world)):
        _check(rank, world, method, torch.float32, *case, seed + i)
        if case[0] in BF16_CASES:
            _check(rank, world, method, torch.bfloat16, *case, seed + i)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_matches_single_device(ranks, world, method):
    assert all(ranks.run(world, _check_all, method, 10 * world, timeout=TIMEOUT))


def _one_rank_without_gradient(rank, world):
    """A one-rank call without a gradient runs the computation alone (torch's attention for the
    CPU flash kernel's masks): the same values as the registered op that a gradient call runs."""
    from pyfused.ops.ring_attention import ring_attention

    masks = ({}, {"causal": False}, {"window": 7}, {"softcap": 2.0}, {"scale": 0.3})
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for hq, hkv, s in ((6, 2, 10), (3, 3, 97)):
            for options in masks:
                q, k, v, _ = _inputs(len(options) + s, 1, hq, hkv, s, dtype)
                with torch.no_grad():
                    alone = ring_attention(q, k, v, **options)
                traced = ring_attention(q.requires_grad_(), k, v, **options).detach()
                assert torch.equal(alone, traced), (dtype, hq, hkv, s, options)
    return True


def test_one_rank_without_gradient_equals_the_gradient_path(ranks):
    assert all(ranks.run(1, _one_rank_without_gradient, timeout=TIMEOUT))


def _padded(rank, world, method):
    """An odd global length (23 at world 3), padded at the end to a multiple of 2 W: under a
    causal mask the real rows do not see the padding, so they are exact."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from pyfused.ops.ring_attention import ring_attention, ring_attention_ref
    from pyfused.ops.sequence_shards import padded_length, shard_sequence, unshard_sequence

    s = 23
    q, k, v, g = _inputs(5, 1, 6, 3, s, torch.float32)
    ref = ring_attention_ref(q, k, v)
    pad = padded_length(s, world) - s
    local = [shard_sequence(F.pad(t, (0, 0, 0, pad)), 2, rank, world) for t in (q, k, v)]
    out = ring_attention(*local, method=method)
    shards = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(shards, out.contiguous())
    assert_close(unshard_sequence(shards, 2)[:, :, :s], ref, torch.float32, f"padded {method}")
    return True


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_odd_global_length_padded_at_the_end(ranks, method):
    assert all(ranks.run(3, _padded, method, timeout=TIMEOUT))


def test_auto_runs_a_method(ranks):
    assert all(ranks.run(2, _check, "auto", torch.float32, "auto", 4, 2, 6, "zigzag", {}, 3,
                         timeout=TIMEOUT))


BAD = {  # case -> (what rank 1 alone passes, a piece of the message)
    "local length": (dict(s_local=8), "q's shape"),
    "heads": (dict(hq=5), "multiple of the key/value heads"),
    "mask": (dict(options={"causal": False, "window": 4}), "sliding window needs causal=True"),
    "method": (dict(method="fastest"), "method must be one of"),
    "window differs": (dict(options={"window": 3}), "window differs between ranks"),
}
EVERY_RANK = {  # case -> (what every rank passes, a piece of the message)
    "ulysses heads": (dict(method="ulysses", hq=4, hkv=2), "divisible by the group size (3)"),
    "odd zigzag": (dict(s_local=7), "S_local (7) must be even"),
}


def _error(rank, world, case):
    from pyfused.comm import InputError, forget_seen
    from pyfused.ops.ring_attention import ring_attention

    forget_seen()
    args = dict(hq=4, hkv=2, s_local=6, method="ring", options={})
    if case in EVERY_RANK:
        args.update(EVERY_RANK[case][0])
    elif rank == 1:
        args.update(BAD[case][0])
    q = torch.randn(1, args["hq"], args["s_local"], 8)
    k = torch.randn(1, args["hkv"], args["s_local"], 8)
    try:
        ring_attention(q, k, k.clone(), method=args["method"], **args["options"])
    except InputError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", sorted(BAD) + sorted(EVERY_RANK))
def test_bad_input_same_error_on_every_rank(ranks, case):
    errors = ranks.run(3, _error, case, timeout=TIMEOUT)
    expected = {**BAD, **EVERY_RANK}[case][1]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert errors[0].startswith("pyfused.ring_attention: ") and expected in errors[0], errors[0]


def _suite_rows(rank, world, out):
    import os

    import torch.distributed as dist

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_context_parallel as suite

    os.environ[suite.LENGTHS_ENV] = "64"
    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=1, options={"out": out})
    return [(r["method"], r["status"][:11], r["peak_MB"] > 0 if r["status"] == "ok" else None)
            for r in suite.run(ctx)]


def test_bench_suite_runs(ranks, tmp_path):
    """The context_parallel suite at one tiny length: every method ok with a peak, torch's
    context_parallel ok or unavailable (with its reason), the same rows on both ranks."""
    rows = ranks.run(2, _suite_rows, str(tmp_path), timeout=TIMEOUT)
    assert rows[0] == rows[1]
    methods = {m: (status, peak) for m, status, peak in rows[0]}
    for m in ("single device", "ring", "allgather", "ulysses"):
        assert methods[m] == ("ok", True), methods
    assert methods["torch context_parallel"][0] in ("ok", "unavailable"), methods


def _peak_ratios(rank, world, length):
    """Each method's peak of live tensor bytes on this rank during fwd + bwd, over single-device
    attention's (the suite's measure, MemTracker), at the suite's shape."""
    import torch.distributed as dist

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_context_parallel as suite

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=1)
    peaks = suite.peaks_at(length, ctx)
    return {name: peak / peaks["single device"] for name, peak in peaks.items()}


def test_ring_memory_per_rank_within_the_goal(ranks):
    """The goal of the context_parallel suite, at a length a test affords: ring's peak per rank
    <= 1/cp + 10% of single-device attention's (cp = 2)."""
    for ratios in ranks.run(2, _peak_ratios, 1024, timeout=TIMEOUT):
        assert ratios["ring"] <= 0.5 + 0.1, ratios
