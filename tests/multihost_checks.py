"""Rank bodies of the multi-host tests, shared by the one-host pool (tests/test_multihost.py, hosts
faked with ``PYFUSED_HOST``) and the namespace test bed (tests/multihost_worker.py under torchrun,
real hosts). Each takes ``(rank, world, ...)`` and returns what the test compares across ranks.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from tests import test_ddp_helpers as H
from tests.utils import assert_close


@contextlib.contextmanager
def fake_hosts(rank: int, ranks_per_host: int) -> Iterator[str]:
    """Within the block this rank says it is on host ``fake<rank // ranks_per_host>``
    (``PYFUSED_HOST``); cached layouts are forgotten on the way in and out (every rank calls it)."""
    from pyfused import comm

    old = os.environ.get(comm.topology.HOST_ENV)
    os.environ[comm.topology.HOST_ENV] = f"fake{rank // ranks_per_host}"
    comm.forget_layouts()
    try:
        yield os.environ[comm.topology.HOST_ENV]
    finally:
        if old is None:
            os.environ.pop(comm.topology.HOST_ENV, None)
        else:
            os.environ[comm.topology.HOST_ENV] = old
        comm.forget_layouts()
        comm.forget_seen()


def layout_and_mesh(rank: int, world: int) -> Dict:
    """The default group's layout and host mesh, and the layout of a group the user built from
    every rank but rank 0 (in reverse order) -- the same on every member."""
    from pyfused import comm

    layout = comm.host_layout()
    mesh = comm.host_mesh()
    local = dist.get_process_group_ranks(mesh.get_group("local"))
    across = dist.get_process_group_ranks(mesh.get_group("host"))
    assert [layout.hosts[r] for r in local] == [comm.local_host()] * len(local), (local, layout)
    assert len({layout.hosts[r] for r in across}) == len(across), (across, layout)
    sub_ranks = list(range(world - 1, 0, -1))
    sub = dist.new_group(sub_ranks)
    sub_layout = comm.host_layout(sub).hosts if rank in sub_ranks else None
    if sub_layout is not None:
        expect = tuple(layout.hosts[g] for g in sorted(sub_ranks))  # group ranks follow global order
        assert sub_layout == expect, (sub_layout, expect)
    return {"hosts": list(layout.hosts), "describe": layout.describe(),
            "mesh": [mesh.size(0), mesh.size(1)], "local": local, "across": across,
            "sub": list(sub_layout) if sub_layout else None}


def fused_across_hosts(rank: int, world: int) -> Dict:
    """``method="fused"`` raises MethodUnavailable naming the hosts; ``auto`` with every rank able
    and willing to run fused takes decomposed and says why (and computes the right product)."""
    from pyfused import comm
    from pyfused.ops import MethodUnavailable, _common, all_gather_matmul, observe_methods
    from pyfused.ops.all_gather_matmul import all_gather_matmul_ref

    g = torch.Generator().manual_seed(7)
    shards = [torch.randn(3, 8, generator=g) for _ in range(world)]
    b = torch.randn(8, 5, generator=g)
    refused = ""
    try:
        all_gather_matmul(shards[rank], b, method="fused")
    except MethodUnavailable as e:
        refused = str(e)
    seen: List = []
    prefer_fused = _common.Choice("fused", 0, "every rank prefers fused (test)")
    originals = _common.fused_status, _common.auto_preference
    _common.fused_status = lambda *args, **kwargs: (True, "")
    _common.auto_preference = lambda *args, **kwargs: prefer_fused
    comm.forget_seen()
    try:
        with observe_methods(lambda op, choice: seen.append(choice)):
            out = all_gather_matmul(shards[rank], b, method="auto")
    finally:
        _common.fused_status, _common.auto_preference = originals
        comm.forget_seen()
    assert_close(out, all_gather_matmul_ref(shards, b), torch.float32, "auto across hosts")
    return {"refused": refused, "auto": seen[0].method, "auto_reason": seen[0].reason}


def host_all_reduce_equals_flat(rank: int, world: int, mesh=None) -> List[int]:
    """HostAllReduce == dist.all_reduce, bit for bit on integer values (any summation order is
    exact), on lengths that need padding: whole, cut into pieces of 24 elements (chunk_bytes=100),
    and four buffers pipelined."""
    from pyfused import comm
    from pyfused.comm.hierarchical import HostAllReduce, PipelinedHostAllReduce, padded_length

    mesh = mesh if mesh is not None else comm.host_mesh()
    reduce, cut = HostAllReduce(mesh), HostAllReduce(mesh, chunk_bytes=100)
    lengths = [1, 97, 1025, 4099]
    bufs, expect = [], []
    for n in lengths:
        g = torch.Generator().manual_seed(1000 * rank + n)
        x = torch.zeros(padded_length(n, reduce.ranks_per_host))
        x[:n] = torch.randint(-50, 50, (n,), generator=g).float()
        flat = x.clone()
        dist.all_reduce(flat)
        bufs.append(x)
        expect.append(flat)
        assert torch.equal(reduce(x.clone()), flat), f"length {n}: whole buffer"
        assert torch.equal(cut(x.clone()), flat), f"length {n}: in pieces of 24"
    pipe = PipelinedHostAllReduce(reduce)
    works = [pipe.start(b) for b in bufs]
    assert [w.works[-1].stage for w in works] == [min(len(bufs) - 1 - i, 3) for i in range(len(bufs))]
    pipe.finish()
    for n, got, want in zip(lengths, bufs, expect):
        assert torch.equal(got, want), f"length {n}: pipelined host-aware all-reduce differs"
    return [b.numel() for b in bufs]


def ddp_matches(rank: int, world: int, all_reduce: str = "auto", mesh_shape=None,
                as_view: bool = False, steps: int = 3) -> Dict:
    """pyfused DDP with ``all_reduce`` == torch DDP == one process on the full batch (fp32, a few
    AdamW steps, buckets small enough for several to be in flight); returns the choice."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel

    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("host", "local"))
    local = H.build("mlp", 1 + rank)  # differs per rank: the broadcast must fix it
    ref = TorchDDP(copy.deepcopy(local))
    mine = DistributedDataParallel(copy.deepcopy(local), bucket_cap_mb=0.0005,
                                   gradient_as_bucket_view=as_view, all_reduce=all_reduce,
                                   host_mesh=mesh)
    single = H.build("mlp", 1)
    opts = [H.make_opt("adamw", m.parameters()) for m in (ref, mine, single)]
    for s in range(steps):
        data = [H.batch("mlp", 1, s, rank)]
        H.train_step("mlp", ref, opts[0], data, ddp=True)
        H.train_step("mlp", mine, opts[1], data, ddp=True)
        H.train_step("mlp", single, opts[2], [H.full_batch("mlp", 1, s, world)], ddp=False)
    tag = f"all_reduce={all_reduce} rank={rank}"
    for (name, p), q, r in zip(ref.module.named_parameters(), mine.module.parameters(),
                               single.parameters()):
        assert_close(q, p, torch.float32, f"{tag}: {name} vs torch DDP")
        assert_close(q, r, torch.float32, f"{tag}: {name} vs one process on the full batch")
    hierarchical = mine.reducer.host_reduce is not None
    assert hierarchical == (mine.all_reduce.method == "hierarchical"), mine.all_reduce
    return {"method": mine.all_reduce.method, "reason": mine.all_reduce.reason,
            "buckets": len(mine.bucket_info()), "padded": [b["padded"] for b in mine.bucket_info()]}


def ddp_error(rank: int, world: int, **kwargs) -> Dict[str, Optional[str]]:
    """The error pyfused DDP raises on this rank for ``kwargs`` (type and message)."""
    from pyfused.layers import DistributedDataParallel

    return H.error_text(DistributedDataParallel, H.build("mlp", 1), **kwargs)


def bench_rows(rank: int, world: int) -> List[Dict]:
    """The multihost suite's rows at its quick sizes, one timed iteration (its checks run: the
    all-reduces' sums and the training steps' losses; its timings are a benchmark's, never
    asserted). Its plot goes to a temporary folder."""
    import tempfile

    from benchmarks import bench_multihost
    from pyfused.bench.harness import BenchContext

    with tempfile.TemporaryDirectory() as out:
        ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                           warmup=0, iters=1, options={"out": out})
        rows = bench_multihost.run(ctx)
    keys = ("shape", "method", "status", "speedup", "hosts", "mesh", "baseline", "tokens_per_s")
    return [{k: r.get(k) for k in keys} for r in rows]


def hsdp_on_host_mesh(rank: int, world: int) -> Dict:
    """HSDP on the host mesh (replicate across hosts, shard inside one: ``pyfused.comm.host_mesh``)
    trains the MLP of tests/test_hsdp.py bit-identically to torch FSDP2's HSDP on the same mesh and
    as one process trains it on the global batches (the tolerances of tests/test_hsdp.py), without
    the host warning; the transposed mesh (shard across hosts) gets it on every rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pyfused
    from pyfused import comm
    from pyfused.fsdp import mesh as mesh_mod
    from tests import test_hsdp as T

    mesh = comm.host_mesh()
    want_first, _, want = T._train(rank, world, torch_fully_shard, mesh)
    first, _, got = T._train(rank, world, pyfused.fully_shard, mesh)
    assert sorted(first) == sorted(want_first)
    for k, v in want_first.items():
        assert torch.equal(first[k], v), f"step-0 gradient of {k}"
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k} after {T.STEPS} steps"
    # one process on the global batches; an infinite max_norm leaves the gradients as they are
    ref, _, ref_first = T.H.reference_training("mlp", T.STEPS, 1, T.ROWS, float("inf"))
    assert sorted(first) == sorted(ref_first)
    for k, v in ref_first.items():
        assert_close(first[k], v, name=f"step-0 gradient of {k} against one process")
    for k, v in ref.state_dict().items():  # the fp16 row: see tests/test_fsdp.py
        assert_close(got[k], v, dtype=torch.float16, name=f"{k} against one process")
    transposed = DeviceMesh(mesh.device_type, mesh.mesh.t(), mesh_dim_names=T.DIMS)
    cpu = torch.device("cpu")
    return {"mesh": list(mesh.shape),
            "warning": mesh_mod.host_warning(mesh_mod.resolve(mesh, cpu)),
            "transposed": mesh_mod.host_warning(mesh_mod.resolve(transposed, cpu))}


def training_across_hosts(rank: int, world: int) -> Dict:
    """The data-parallel methods and a pipeline train across the hosts as the one-host tests check
    them (their own rank bodies, here over the hosts' link): ZeRO-2 (pyfused DDP with a sharded
    optimizer) == torch DDP == one process; ``fully_shard`` == one process; GPT-2 under
    ``parallelize`` on a (pp, dp) mesh, so each pipeline's two stages sit on different hosts and
    its tied head's gradient is summed across them: logits, loss, gradients, clipped norm and
    state == one process."""
    from tests import test_ddp_sharded as Z, test_fsdp as F, test_parallelize_mesh as P

    H.compare_training(rank, world, "mlp", opt="adamw_groups", steps=3, ours=Z.SHARD)
    assert F._train(rank, world, "mlp", 1)
    assert P._mesh_matches(rank, world, "gpt2", (2, world // 2), ("pp", "dp"), False,
                           {"n_microbatches": 2})
    dp = world // 2  # the (pp, dp) mesh's pipeline of this rank: its column
    return {"pipeline_ranks": [rank % dp, rank % dp + dp]}


# Llama of tests/test_parallelize.py (hidden 48, FFN 44, vocabulary 100); the sequence is a
# multiple of tp=2, which sequence parallelism shards
DP_TP_SEQ, DP_TP_ROWS, DP_TP_STEPS, DP_TP_LR = 12, 2, 3, 1e-2


def parallelize_dp_x_tp(rank: int, world: int) -> Dict:
    """A tiny Llama under ``parallelize`` on a (dp, tp) mesh with tp=2, each tp pair on one host
    and dp across the hosts, trained 3 AdamW steps == one process on the global batches: the loss
    of every step, the first step's gradients and their norm (fp32 tolerance), every parameter
    after the steps (1% of the learning rate per step: tests/test_parallelize_context.py says
    why). Returns the ranks of this rank's tp and dp groups."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused import comm
    from tests.test_parallelize import VOCAB, build

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp_ranks = dist.get_process_group_ranks(mesh.get_group("tp"))
    hosts = comm.host_layout().hosts
    assert len({hosts[r] for r in tp_ranks}) == 1, f"tp group {tp_ranks} spans hosts {hosts}"
    dp, coord = mesh.size(0), mesh.get_local_rank("dp")
    ref, pm = build("llama", seed=3), pyfused.parallelize(build("llama", seed=3), mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=DP_TP_LR)
    opt = torch.optim.AdamW(pm.parameters(), lr=DP_TP_LR)
    g = torch.Generator().manual_seed(11)
    mine = slice(coord * DP_TP_ROWS, (coord + 1) * DP_TP_ROWS)
    for step in range(DP_TP_STEPS):
        ids, labels = (torch.randint(0, VOCAB, (DP_TP_ROWS * dp, DP_TP_SEQ), generator=g)
                       for _ in range(2))
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        out = pm(input_ids=ids[mine], labels=labels[mine])
        pm.backward(out.loss)
        tag = f"parallelize dp={dp} x tp=2 rank {rank} step {step}"
        if step == 0:
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            for name, grad in pm.full_grad_dict().items():
                assert_close(grad, ref_grads[name], name=f"grad {name} {tag}")
            ref_norm = torch.linalg.vector_norm(torch.stack([r.norm() for r in ref_grads.values()]))
            assert_close(pm.clip_grad_norm_(1e9), ref_norm, name=f"norm {tag}")  # clips nothing
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        assert_close(loss / dp, ref_loss, name=f"loss {tag}")
    full = pm.full_state_dict()
    for name, t in ref.state_dict().items():
        err = (full[name] - t).abs().max().item()
        assert err <= 0.01 * DP_TP_LR * DP_TP_STEPS, f"{name} after {DP_TP_STEPS} steps: {err:.3g}"
    return {"tp_ranks": tp_ranks, "dp_ranks": dist.get_process_group_ranks(mesh.get_group("dp"))}
