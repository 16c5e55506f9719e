"""Virtual ranks (pyfused/testing/virtual_ranks.py): W ranks of the fused ops in one process.

CPU (CI): the harness's plumbing through the CPU models -- rank -> stream -> buffer tables, the SM
budget every fused launch receives, epochs across calls, and the adversarial modes (a late rank, NaN
poisoned buffers, a rank that never comes). The CPU kernels of the all-reduce and the barriers block
in C++ until every rank thread arrives; the Triton interpreter runs one launch at a time (its flags
are set before it reads them, so none spins; tests/test_threaded_ranks.py runs the launches at
once, the kernels waiting for each other). Shapes are tiny: each interpreted launch costs ~0.3 s.

GPU (``gpu``-marked): every case at W = 2, 4, 8 in bf16 and fp16 against the fp64 reference and the
unfused composition on the same harness; the adversarial modes with truly concurrent ranks; a lost
rank in a subprocess (the CUDA barrier traps, which ends the CUDA context).
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.utils import TOLERANCES

pytestmark = pytest.mark.interpreter
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_SHAPE = dict(rows=6, n=20, k=12)  # odd sizes: partial tiles everywhere


def _cases():
    """Every virtual-rank case of the registered ops (pyfused/testing/virtual_cases.py)."""
    from pyfused.ops.registry import OPS
    from pyfused.testing.virtual_cases import cases

    return cases(OPS.values())


def _group(world, device="cpu", **kw):
    from pyfused.testing.virtual_ranks import VirtualGroup

    return VirtualGroup(world, device, **kw)


def _check_case(group, name, dtype, rows, n, k, seed=0, preload=False, **run_kw):
    from pyfused.testing.virtual_cases import max_rel_error

    case = _cases()[name]
    inputs = case.make(group.world, rows, n, k, dtype, group.device, seed)
    if preload:  # what the first call on a GPU runs (pyfused/kernels/preload.py)
        before = group.epochs()
        group._preload(case.fused, inputs, list(range(group.world)), 60.0)
        after = group.epochs()
        assert all(len(set(size)) == 1 for size in after), f"{name}: epochs apart: {after}"
        assert len(after) >= len(before) and after != before, f"{name}: no collective in the pass"
    outs = group.run(case.fused, inputs, **run_kw)
    err = max_rel_error(outs, case.reference(inputs))
    rtol = TOLERANCES[dtype][0]
    assert err <= 4 * rtol, f"{name} W={group.world} {dtype}: relative error {err:.3g} > {4 * rtol:.3g}"
    return inputs, outs


@pytest.mark.parametrize("world", [2, 3])
def test_every_case_on_cpu_models(world):
    """Every case (forward, backward, both all-reduce algorithms) matches its fp64 reference with the
    ranks as threads of one process; world 3 catches power-of-two assumptions. At world 3 each case
    first runs the preload pass a GPU's first call runs: it ends (its host barriers meet, it queues
    no wait: a CPU flag wait that nobody signalled raises), moves every rank's epochs alike, and the
    real call after it is still exact."""
    CASES = _cases()

    group = _group(world)
    try:
        for name in CASES:
            _check_case(group, name, torch.float32, **CPU_SHAPE, seed=world, preload=world == 3)
    finally:
        group.free()


def test_rank_stream_buffer_tables():
    """Each rank has its own handle, group name and buffer; every rank's table lists the same W
    allocations in rank order, and a rank's local view is its own entry."""
    from pyfused.comm.group import rank, world_size
    from pyfused.comm.symmetric import SymmetricBuffer

    group = _group(3)
    bufs = [SymmetricBuffer.get(group.ranks[r], 1000, "cpu") for r in range(3)]
    assert [rank(h) for h in group.ranks] == [0, 1, 2] and {world_size(h) for h in group.ranks} == {3}
    assert len({h.group_name for h in group.ranks}) == 3
    assert bufs[0].buffer_ptrs == bufs[1].buffer_ptrs == bufs[2].buffer_ptrs
    assert len(set(bufs[0].buffer_ptrs)) == 3
    for r, buf in enumerate(bufs):
        assert buf.rank == r and buf.backend == "virtual"
        assert buf.local_view().data_ptr() == buf.buffer_ptrs[r]
        assert buf.buffer_ptrs_dev.tolist() == buf.buffer_ptrs
        buf.peer((r + 1) % 3, (4,), torch.int32).fill_(r + 1)  # a write through a peer view ...
    for r, buf in enumerate(bufs):
        assert buf.local_view((4,), torch.int32).tolist() == [(r - 1) % 3 + 1] * 4  # ... lands there
    assert SymmetricBuffer.get(group.ranks[1], 5000, "cpu") is bufs[1]  # one size class (64 KiB)
    group.free()
    assert all(b.freed for b in bufs)


def test_sm_budget_reaches_every_launch(monkeypatch):
    """Every persistent kernel of a fused call is capped at the group's SM budget, launched from a
    thread per rank or in order from one; outside a rank's context the device default applies."""
    from pyfused.fused import config, gemm_collectives

    seen = []
    real_gemm, real_reduce = gemm_collectives.gemm, gemm_collectives.multi_source_reduce

    def spy_gemm(*args, **kw):
        seen.append(("gemm", kw["num_programs"]))
        return real_gemm(*args, **kw)

    def spy_reduce(*args, **kw):
        seen.append(("reduce", kw["num_programs"]))
        return real_reduce(*args, **kw)

    monkeypatch.setattr(gemm_collectives, "gemm", spy_gemm)
    monkeypatch.setattr(gemm_collectives, "multi_source_reduce", spy_reduce)
    group = _group(2, sm_budget=3)
    def budget(pg):
        return pg.rank, config.budget_in_force(), config.grid_budget(group.device)

    assert group.run(budget) == [(0, 3, 3), (1, 3, 3)]
    assert group.launch(budget, threads=False) == [(0, 3, 3), (1, 3, 3)]  # the timing loops' path
    assert config.budget_in_force() is None and config.grid_budget(torch.device("cpu")) == 4
    for name in ("all_gather_matmul", "matmul_reduce_scatter"):
        _check_case(group, name, torch.float32, **CPU_SHAPE)
    assert sorted(set(seen)) == [("gemm", 3), ("reduce", 3)] and len(seen) == 2 + 2 * 2
    real_ar = torch.ops.pyfused.all_reduce_rows

    def spy_all_reduce(*args):
        seen.append(("all_reduce_rows", args[-1]))  # max_blocks
        return real_ar(*args)

    monkeypatch.setattr(torch.ops.pyfused, "all_reduce_rows", spy_all_reduce)
    _check_case(group, "all_reduce_add_rmsnorm.one_shot", torch.float32, **CPU_SHAPE)
    assert seen[-2:] == [("all_reduce_rows", 3)] * 2
    group.free()


def test_all_reduce_bits_do_not_depend_on_the_budget():
    """The all-reduce kernel's block count (capped by the SM budget) changes which block reduces a
    row, never the row's bits: 130 rows over 3 blocks and over 64 give identical outputs."""
    CASES = _cases()

    for name in ("all_reduce_add_rmsnorm.one_shot", "all_reduce_add_rmsnorm.two_shot"):
        case = CASES[name]
        inputs = case.make(3, 130, 33, 0, torch.float32, torch.device("cpu"), 5)
        outs = []
        for budget in (3, 64):
            group = _group(3, sm_budget=budget)
            outs.append(group.run(case.fused, inputs))
            group.free()
        assert all(torch.equal(a, b) for a, b in zip(*outs)), name
        assert all(torch.equal(outs[0][0], o) for o in outs[0]), f"{name}: ranks differ"


def test_epochs_advance_together_across_calls():
    """Each rank keeps its own epochs; one collective call moves every rank's by one, and the chunk
    flags a call leaves in every pad hold that call's epoch."""
    group = _group(2)
    for _ in range(3):
        _check_case(group, "all_gather_matmul", torch.float32, **CPU_SHAPE)
    _check_case(group, "matmul_reduce_scatter", torch.float32, **CPU_SHAPE)
    epochs = group.epochs()
    assert all(len(set(per_rank)) == 1 for per_rank in epochs), epochs
    assert sorted(e[0] for e in epochs) in ([4], [1, 3]), epochs  # one or two size classes
    for size in group.buffers():
        for buf in size:
            assert buf.flags(count=2).tolist() == [buf.epoch] * 2
    group.free()


def test_adversarial_modes_on_cpu(monkeypatch):
    """A late rank and NaN-poisoned buffers change nothing; a rank that never comes ends in a timeout
    that names the waiting rank, the missing peer and the barrier slot (channel)."""
    group = _group(2)
    _check_case(group, "matmul_reduce_scatter", torch.float32, **CPU_SHAPE)
    group.poison()
    assert torch.isnan(group.buffers()[0][0].local_view((4,), torch.float32)).all()
    _check_case(group, "matmul_reduce_scatter", torch.float32, **CPU_SHAPE, delay=1)
    _check_case(group, "all_reduce_add_rmsnorm.two_shot", torch.float32, **CPU_SHAPE, delay=0)
    monkeypatch.setenv("PYFUSED_FUSED_TIMEOUT_MS", "1500")
    with pytest.raises(RuntimeError, match=r"virtual rank 0/2 failed.*rank 0 waited \d+ ms for rank 1 "
                                           r"at channel \d+ block \d+"):
        _check_case(group, "all_gather_matmul", torch.float32, **CPU_SHAPE, skip=1)
    group.free()


def test_sanitizer_driver_virtual_mode_on_cpu():
    """benchmarks/sanitize_fused.py --virtual: every case through the driver, in one process."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sanitize_fused.py"),
                           "--cpu", "--virtual", "--world", "3", "--iters", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "all kernels ran and matched" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

GPU_SHAPE = dict(rows=384, n=1280, k=1024)  # per rank; rows * W divisible by W; ~ a TP=8 rank's


# One test per case, so that a case that fails or hangs is reported by name and `-k` can pick cases.
GPU_CASES = sorted(_cases())


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_gpu_every_case(world, dtype, name):
    """The case with truly concurrent ranks, twice (epochs), against the fp64 reference and the
    unfused composition on the same harness."""
    from pyfused.testing.virtual_cases import max_rel_error, run_unfused

    case = _cases()[name]
    group = _group(world, "cuda")
    try:
        for seed in (1, 2):
            inputs, outs = _check_case(group, name, dtype, **GPU_SHAPE, seed=seed)
        unfused = run_unfused(group, case, inputs)
        torch.cuda.synchronize()
        assert max_rel_error(outs, unfused) <= 4 * TOLERANCES[dtype][0], name
    finally:
        group.free()


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
@pytest.mark.parametrize("world", [2, 8])
def test_gpu_adversarial(world, name):
    """One rank 50 ms late (a sleep kernel on its stream), then NaN in every buffer before the call:
    the case still matches (a read before its flag would show the NaN)."""
    group = _group(world, "cuda")
    try:
        _check_case(group, name, torch.bfloat16, **GPU_SHAPE)
        group.poison()
        _check_case(group, name, torch.bfloat16, **GPU_SHAPE, delay=world - 1)
    finally:
        group.free()


@pytest.mark.gpu
def test_gpu_lost_rank_times_out_with_its_name():
    """A rank that never launches: its peers' entry barrier gives up after PYFUSED_FUSED_TIMEOUT_MS
    and the kernel prints rank, peer and slot before trapping (in a subprocess: a trap ends the CUDA
    context)."""
    code = textwrap.dedent("""
        import torch
        from pyfused.testing.virtual_cases import cases
        from pyfused.testing.virtual_ranks import VirtualGroup
        from pyfused.ops.registry import OPS
        case = cases(OPS.values())["all_gather_matmul"]
        group = VirtualGroup(2, "cuda")
        inputs = case.make(2, 64, 128, 128, torch.bfloat16, group.device, 0)
        group.run(case.fused, inputs, skip=1)
    """)
    env = dict(os.environ, PYFUSED_FUSED_TIMEOUT_MS="2000")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "barrier timed out after 2000 ms: rank 0 block 0 channel 3 waits for rank 1" in text, \
        text[-4000:]


@pytest.mark.gpu
def test_gpu_pushes_use_a_stream_per_peer(monkeypatch):
    """all_gather_matmul pushes each peer's chunk on a stream of its own (so a chunk's flag is not
    queued behind the other peers' copies), and virtual ranks do not share side streams."""
    from pyfused.comm import streams

    seen = []
    real = streams.push_streams

    def spy(device, count):
        out = real(device, count)
        seen.append([id(s) for s in out])
        return out

    monkeypatch.setattr(streams, "push_streams", spy)
    group = _group(4, "cuda")
    try:
        _check_case(group, "all_gather_matmul", torch.bfloat16, **GPU_SHAPE)
    finally:
        group.free()
    assert len(seen) == 4 and all(len(set(ids)) == 3 for ids in seen), seen
    assert len({i for ids in seen for i in ids}) == 12, seen


def test_lazy_module_loading_is_refused(monkeypatch):
    """Virtual ranks on CUDA refuse lazy module loading (a rank's first launch of a kernel would wait
    behind a peer's spinning kernel), by the driver's answer, else by CUDA_MODULE_LOADING."""
    from pyfused.testing import virtual_ranks

    assert virtual_ranks.cuda_loads_modules_lazily() in (None, True, False)
    monkeypatch.setattr(virtual_ranks, "cuda_loads_modules_lazily", lambda: True)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # set too late to matter: the driver decides
    with pytest.raises(RuntimeError, match="CUDA_MODULE_LOADING=EAGER"):
        virtual_ranks.require_eager_module_loading()
    monkeypatch.setattr(virtual_ranks, "cuda_loads_modules_lazily", lambda: False)
    virtual_ranks.require_eager_module_loading()
    monkeypatch.setattr(virtual_ranks, "cuda_loads_modules_lazily", lambda: None)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    with pytest.raises(RuntimeError, match="eager module loading"):
        virtual_ranks.require_eager_module_loading()
    monkeypatch.setenv("CUDA_MODULE_LOADING", "eager")
    virtual_ranks.require_eager_module_loading()


def _sleep_on_rank_one(handle, seconds):
    if handle.rank == 1:
        time.sleep(seconds)
    return handle.rank


def test_a_late_rank_thread_shows_where_it_is(monkeypatch, capfd):
    """A rank thread still busy at half the fused timeout (on a GPU: blocked behind a peer's
    spinning kernel, which traps at the timeout and ends the process) prints its stack first."""
    monkeypatch.setenv("PYFUSED_FUSED_TIMEOUT_MS", "200")
    group = _group(2)
    try:
        assert group.launch(_sleep_on_rank_one, [(0.5,), (0.5,)]) == [0, 1]
        assert group.launch(_sleep_on_rank_one, [(0.0,), (0.0,)]) == [0, 1]  # the same threads
    finally:
        group.free()
    err = capfd.readouterr().err
    assert err.count("still busy after 0.1 s") == 1, err
    assert "--- rank 1:" in err and "_sleep_on_rank_one" in err and "--- rank 0:" not in err


def test_streams_fit_the_hardware_queues():
    """Every stream of a virtual group gets a hardware queue of its own: rank, comm and push streams
    per rank, 2 queues kept for the rest of the process; fewer distinct push streams where all do
    not fit, and a refusal naming CUDA_DEVICE_MAX_CONNECTIONS where one each does not."""
    from pyfused.comm.streams import push_slots
    from pyfused.testing.virtual_ranks import push_streams_per_rank

    assert [push_streams_per_rank(w, 32) for w in (1, 2, 3, 4, 8)] == [1, 1, 2, 3, 1]
    assert push_streams_per_rank(2, 8) == 1  # CUDA's default: 2 ranks fit (6 streams + 2)
    for w in (3, 4, 8):
        with pytest.raises(RuntimeError, match="CUDA_DEVICE_MAX_CONNECTIONS is 8.*=32"):
            push_streams_per_rank(w, 8)
    for w in (2, 3, 4, 8):
        per_rank = push_streams_per_rank(w, 32)
        assert w * (2 + per_rank) + 2 <= 32
    assert push_slots(7, 2) == [1, 2, 1, 2, 1, 2, 1]  # 7 peers' pushes on 2 streams in turn
    assert push_slots(3, None) == push_slots(3, 5) == [1, 2, 3]
    assert _group(3).push_limit is None  # CPU: no streams
    from pyfused.testing.virtual_ranks import queue_slots

    for w in (1, 2, 3, 4, 8):
        limit = push_streams_per_rank(w, 32)
        slots = queue_slots(w, limit)
        flat = [i for rank in slots for i in rank]
        assert len(flat) == len(set(flat)) == w * (2 + limit)  # a queue of its own each
        assert max(flat) < 32 - 2 and [rank[0] for rank in slots] == list(range(w))


def _gemm_settings(handle):
    return torch._C._get_sm_carveout_experimental(), str(torch.backends.cuda.preferred_blas_library())


def test_torch_gemm_budget_is_a_no_op_on_cpu():
    before = _gemm_settings(None)
    group = _group(2)
    try:
        with group.torch_gemms_in_budget():
            assert _gemm_settings(None) == before
        assert group.launch(_gemm_settings) == [before, before]
    finally:
        group.free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_torch_gemms_target_the_rank_budget(monkeypatch):
    """A rank's torch GEMMs run on cuBLASLt with the SM count target of the group's budget, in the
    call and in the unfused composition; the process's settings come back after."""
    before = _gemm_settings(None)
    group = _group(4, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        seen = group.run(_gemm_settings)
        assert all(carveout == sms - group.sm_budget and "Cublaslt" in library
                   for carveout, library in seen), seen
        assert _gemm_settings(None) == before
        monkeypatch.setenv("PYFUSED_VR_TORCH_GEMM_BUDGET", "0")
        assert group.run(_gemm_settings) == [before] * 4
    finally:
        group.free()
