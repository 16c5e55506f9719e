"""The bucket copy kernel (pyfused/kernels/bucket.py) against its torch reference, and the bucket
layout.

On CPU the kernel runs in the Triton interpreter (conftest sets TRITON_INTERPRET=1); it truncates
fp32 -> bf16/fp16 where the GPU rounds to nearest even, so low-precision outputs may differ by one
unit in the last place there (exact on GPU: the ``gpu`` test). Segment sizes are odd on purpose
(1, 97, 1025, 4099: partial blocks, a segment smaller than a block, several blocks).
"""
import pytest
import torch

from pyfused.dp import bucket_copy, buckets

SIZES = [(97,), (5, 7), (1,), (1025,), (3, 1366)]  # 4099 elements in the last one
CASTS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
         (torch.bfloat16, torch.float32), (torch.float32, torch.float16)]


def _ulp_close(actual, expected):
    if actual.dtype == torch.float32 and expected.dtype == torch.float32:
        assert torch.equal(actual, expected), (actual - expected).abs().max()
        return
    # one unit in the last place of the output dtype (interpreter truncation vs torch's RNE)
    a, e = actual.float(), expected.float()
    eps = torch.finfo(actual.dtype).eps
    assert ((a - e).abs() <= eps * e.abs() + 1e-30).all(), (a - e).abs().max()


def _case(src_dtype, dst_dtype, device, interpret):
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(s, generator=g).to(device, src_dtype) for s in SIZES]
    numel = sum(s.numel() for s in srcs)
    plan = bucket_copy.CopyPlan([s.numel() for s in srcs], torch.device(device),
                                max(src_dtype.itemsize, dst_dtype.itemsize), interpret=interpret)
    flat = torch.full((numel + 5,), 7.0, dtype=dst_dtype, device=device)  # +5: untouched padding
    ref = flat.clone()
    return srcs, plan, flat, ref


@pytest.mark.parametrize("src_dtype,dst_dtype", CASTS, ids=str)
def test_flatten_scale_matches_reference(src_dtype, dst_dtype):
    srcs, plan, flat, ref = _case(src_dtype, dst_dtype, "cpu", interpret=True)
    bucket_copy.flatten_scale(srcs, flat, 1 / 3, plan)
    bucket_copy.flatten_scale_ref(srcs, ref, 1 / 3)
    _ulp_close(flat, ref)
    assert (flat[-5:] == 7.0).all(), "the kernel wrote past the last segment"


@pytest.mark.parametrize("src_dtype,dst_dtype", CASTS, ids=str)
def test_unflatten_matches_reference(src_dtype, dst_dtype):
    g = torch.Generator().manual_seed(4)
    numel = sum(torch.Size(s).numel() for s in SIZES)
    flat = torch.randn(numel, generator=g).to(src_dtype)
    dsts = [torch.zeros(s, dtype=dst_dtype) for s in SIZES]
    refs = [d.clone() for d in dsts]
    plan = bucket_copy.CopyPlan([d.numel() for d in dsts], torch.device("cpu"),
                                max(src_dtype.itemsize, dst_dtype.itemsize), interpret=True)
    bucket_copy.unflatten_scale(flat, dsts, 1.0, plan)
    bucket_copy.unflatten_scale_ref(flat, refs, 1.0)
    for d, r in zip(dsts, refs):
        _ulp_close(d, r)


def test_noncontiguous_gradient_takes_the_torch_path():
    srcs = [torch.randn(6, 4).t(), torch.randn(9)]  # the first is a transposed view
    plan = bucket_copy.CopyPlan([24, 9], torch.device("cpu"), 4, interpret=True)
    flat, ref = torch.zeros(33), torch.zeros(33)
    bucket_copy.flatten_scale(srcs, flat, 0.5, plan)
    bucket_copy.flatten_scale_ref(srcs, ref, 0.5)
    assert torch.equal(flat, ref)
    assert torch.equal(flat[:24], (srcs[0] * 0.5).reshape(-1))  # logical (row-major) order


@pytest.mark.gpu
@pytest.mark.parametrize("src_dtype,dst_dtype", CASTS, ids=str)
def test_kernel_on_gpu_is_exact(src_dtype, dst_dtype):
    srcs, plan, flat, ref = _case(src_dtype, dst_dtype, "cuda", interpret=False)
    bucket_copy.flatten_scale(srcs, flat, 1 / 3, plan)
    bucket_copy.flatten_scale_ref(srcs, ref, 1 / 3)
    assert torch.equal(flat, ref)
    outs = [torch.empty_like(s, dtype=src_dtype) for s in srcs]
    bucket_copy.unflatten_scale(flat, outs, 3.0, plan)
    refs = [torch.empty_like(o) for o in outs]
    bucket_copy.unflatten_scale_ref(flat, refs, 3.0)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs))


# ----------------------------------------------------------------------------- layout

def _params(*specs):
    return [torch.empty(n, dtype=dt) for n, dt in specs]


def test_assignment_is_reverse_order_per_dtype_with_small_first_bucket():
    f32, bf16 = torch.float32, torch.bfloat16
    ps = _params((100, f32), (100_000, f32), (10, bf16), (200_000, f32), (50, f32), (7, bf16))
    idx = buckets.assign(list(enumerate(ps)), cap_bytes=1_000_000, first_cap_bytes=1000)
    # reversed: 5(bf16) 4 3 2(bf16) 1 0. fp32 first bucket closes at >= 1000 bytes: [4, 3];
    # then [1, 0] under 1 MB; bf16 never reaches its first cap: [5, 2]
    assert idx == [[5, 2], [4, 3], [1, 0]]


def test_one_large_parameter_gets_its_own_bucket():
    ps = _params((10, torch.float32), (1_000_000, torch.float32), (10, torch.float32))
    idx = buckets.assign(list(enumerate(ps)), cap_bytes=4000, first_cap_bytes=4000)
    assert idx == [[2, 1], [0]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_padding_gives_equal_aligned_shards(world):
    ps = _params((97, torch.float32), (1025, torch.float32), (13, torch.bfloat16))
    idx = buckets.assign(list(enumerate(ps)), cap_bytes=1 << 20)
    for b in buckets.build(ps, idx, world, sharded=True):
        elem = torch.empty((), dtype=b.dtype).element_size()
        assert b.padded == b.shard * world >= b.numel
        assert (b.shard * elem) % 16 == 0
        assert b.padded - b.numel < world * 16 // elem + world
        offs = [s.offset for s in b.slots]
        assert offs == sorted(offs) and b.slots[-1].offset + b.slots[-1].numel == b.numel


# ----------------------------------------------------------------------------- kernel inside DDP

def _ddp_with_interpreted_kernel(rank, world, comm_dtype, shard):
    from pyfused.layers import DistributedDataParallel
    from tests import test_ddp_helpers as H

    bucket_copy.set_kernel_mode("interpret")
    try:
        probe = DistributedDataParallel(H.build("mlp", 0), bucket_cap_mb=0.002)
        assert probe.reducer._use_kernel and all("plan" in b.extra for b in probe.reducer.buckets)
        # bf16 communication: SGD (AdamW would turn bf16 rounding of near-zero gradients into
        # whole-lr steps), against torch's bf16 compression hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        theirs = dict(comm_hook=bf16_compress_hook) if comm_dtype else {}
        H.compare_training(rank, world, "mlp", opt="sgd" if comm_dtype else "adamw", steps=2,
                           full=False, tol=comm_dtype or torch.float32, theirs=theirs,
                           ours=dict(comm_dtype=comm_dtype, shard_optimizer=shard,
                                     bucket_cap_mb=0.002))
    finally:
        bucket_copy.set_kernel_mode("auto")
    return True


@pytest.mark.parametrize("comm_dtype,shard", [(None, False), (torch.bfloat16, False),
                                              (None, True)], ids=["fp32", "bf16", "sharded"])
def test_ddp_runs_the_kernel_in_the_interpreter(ranks, comm_dtype, shard):
    """The reducer's flatten / unflatten through the Triton kernel (interpreted on CPU) trains like
    torch DDP: the kernel's addressing is exercised end to end, not only in isolation."""
    assert all(ranks.run(3, _ddp_with_interpreted_kernel, comm_dtype, shard, timeout=120))
