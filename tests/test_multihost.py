"""Topology, the fused method across hosts and the host-aware DDP reduction, on one machine with
the hosts faked by ``PYFUSED_HOST`` (rank r says it is on host ``fake<r // ranks per host>``), so
that CI without network namespaces runs the same code and math as the namespace test bed
(tests/test_multihost_testbed.py, real hosts under torchrun).

Grid cut for the 2-core CI box: world 4 as 2 hosts x 2 ranks carries the main checks; world 3
covers uneven hosts and an odd number of ranks per host (padding to a multiple of 3).
"""
import pytest

from benchmarks import multihost_testbed as mt
from tests import multihost_checks as C

TIMEOUT = 90


def _with_fake_hosts(rank, world, per_host, body, *args, **kwargs):
    with C.fake_hosts(rank, per_host):
        return body(rank, world, *args, **kwargs)


def test_layout_mesh_and_user_group(ranks):
    out = ranks.run(4, _with_fake_hosts, 2, C.layout_and_mesh, timeout=TIMEOUT)
    same = ("hosts", "describe", "mesh")
    assert all({k: o[k] for k in same} == {k: out[0][k] for k in same} for o in out)
    assert out[0]["hosts"] == ["fake0", "fake0", "fake1", "fake1"]
    assert out[0]["describe"] == "2 hosts: 'fake0' (ranks 0, 1), 'fake1' (ranks 2, 3)"
    assert out[0]["mesh"] == [2, 2]
    assert [o["local"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["across"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert out[0]["sub"] is None and all(o["sub"] == ["fake0", "fake1", "fake1"] for o in out[1:])


def _uneven_mesh(rank, world):
    from pyfused import comm

    with C.fake_hosts(rank, 2):
        layout = comm.host_layout()
        try:
            comm.host_mesh()
        except comm.TopologyError as e:
            return layout.describe(), str(e)
    return layout.describe(), None


def test_uneven_hosts_have_no_mesh(ranks):
    out = ranks.run(3, _uneven_mesh, timeout=TIMEOUT)
    assert all(o == out[0] for o in out)
    assert out[0][0] == "2 hosts: 'fake0' (ranks 0, 1), 'fake1' (rank 2)"
    assert "different numbers of ranks" in out[0][1]


def _inconsistent_local_world_size(rank, world):
    import os

    from pyfused import comm

    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank else "3"
    try:
        with C.fake_hosts(rank, 2):
            comm.host_layout()
    except comm.TopologyError as e:
        return str(e)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    return None


def test_inconsistent_torchrun_environment_is_refused_everywhere(ranks):
    out = ranks.run(4, _inconsistent_local_world_size, timeout=TIMEOUT)
    assert out[0] and all(o == out[0] for o in out), out
    assert "host 'fake0'" in out[0] and "LOCAL_WORLD_SIZE values [2, 3]" in out[0]


def test_fused_is_refused_across_hosts(ranks):
    out = ranks.run(4, _with_fake_hosts, 2, C.fused_across_hosts, timeout=TIMEOUT)
    assert all(o == out[0] for o in out), out
    hosts = "2 hosts: 'fake0' (ranks 0, 1), 'fake1' (ranks 2, 3)"
    assert out[0]["refused"] == (f"pyfused.all_gather_matmul: method='fused' is not available here "
                                 f"because the group spans {hosts}; symmetric memory maps memory "
                                 f"within one host only")
    assert out[0]["auto"] == "decomposed"
    assert hosts in out[0]["auto_reason"]


def _fused_on_one_host(rank, world):
    return C.fused_across_hosts(rank, world)


def test_fused_on_one_host_is_not_refused_for_hosts(ranks):
    # the same calls without a host split: auto keeps fused's path open (here it then fails for
    # want of CUDA, which is the local reason, not the hosts)
    out = ranks.run(2, _fused_on_one_host, timeout=TIMEOUT)
    assert "hosts" not in out[0]["refused"] and "cpu" in out[0]["refused"]
    assert "hosts" not in out[0]["auto_reason"]


def test_host_all_reduce_equals_flat(ranks):
    lengths = ranks.run(4, _with_fake_hosts, 2, C.host_all_reduce_equals_flat, timeout=TIMEOUT)
    assert lengths[0] == [2, 98, 1026, 4100]


@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_auto_is_hierarchical_across_fake_hosts(ranks, as_view):
    out = ranks.run(4, _with_fake_hosts, 2, C.ddp_matches, "auto", as_view=as_view,
                    timeout=TIMEOUT)
    assert all(o == out[0] for o in out)
    assert out[0]["method"] == "hierarchical", out[0]
    assert "fake0" in out[0]["reason"] and out[0]["buckets"] >= 3
    assert all(p % 2 == 0 for p in out[0]["padded"])


def test_ddp_hierarchical_over_a_given_mesh(ranks):
    out = ranks.run(4, C.ddp_matches, "auto", mesh_shape=(2, 2), timeout=TIMEOUT)
    assert out[0]["method"] == "hierarchical" and "2 hosts x 2 ranks" in out[0]["reason"]


def test_ddp_hierarchical_three_ranks_per_host(ranks):
    # one host of 3: asked explicitly, the schedule runs with every bucket padded to a multiple of 3
    out = ranks.run(3, C.ddp_matches, "hierarchical", timeout=TIMEOUT)
    assert out[0]["method"] == "hierarchical"
    assert all(p % 3 == 0 for p in out[0]["padded"]) and any(p % 2 for p in out[0]["padded"])


@pytest.mark.parametrize("per_host,why", [
    (1, "one rank per host"),
    (4, "share one host"),
])
def test_ddp_auto_stays_flat(ranks, per_host, why):
    out = ranks.run(4, _with_fake_hosts, per_host, C.ddp_matches, "auto", steps=1, timeout=TIMEOUT)
    assert out[0]["method"] == "flat" and why in out[0]["reason"], out[0]


def test_ddp_auto_flat_on_uneven_hosts_and_explicit_refused(ranks):
    auto = ranks.run(3, _with_fake_hosts, 2, C.ddp_matches, "auto", steps=1, timeout=TIMEOUT)
    assert auto[0]["method"] == "flat" and "different numbers" in auto[0]["reason"]
    err = ranks.run(3, _with_fake_hosts, 2, C.ddp_error, all_reduce="hierarchical",
                    timeout=TIMEOUT)
    assert all(e == err[0] for e in err)
    assert err[0]["type"] == "InputError" and "different numbers" in err[0]["msg"]


@pytest.mark.parametrize("kwargs,expect", [
    (dict(all_reduce="ring"), "all_reduce must be one of ('auto', 'flat', 'hierarchical')"),
    (dict(all_reduce="hierarchical", shard_optimizer=True), "drop one of them"),
    (dict(host_mesh="not a mesh"), "host_mesh must be a 2-D DeviceMesh"),
])
def test_ddp_bad_reduction_options_error_on_every_rank(ranks, kwargs, expect):
    err = ranks.run(2, C.ddp_error, **kwargs, timeout=TIMEOUT)
    assert all(e == err[0] for e in err)
    assert err[0]["type"] == "InputError" and expect in err[0]["msg"], err[0]


def _one_rank_asks_hierarchical(rank, world):
    return C.ddp_error(rank, world, all_reduce="hierarchical" if rank == 1 else "auto")


def test_ddp_all_reduce_must_agree(ranks):
    err = ranks.run(2, _one_rank_asks_hierarchical, timeout=TIMEOUT)
    assert all(e == err[0] for e in err)
    assert ("the option all_reduce differs between ranks: rank 0 has 'auto', rank 1 has "
            "'hierarchical'") in err[0]["msg"], err[0]


def test_bench_suite_on_one_host_is_a_skipped_row(ranks):
    rows = ranks.run(2, C.bench_rows, timeout=TIMEOUT)
    assert len(rows[0]) == 1 and rows[0][0]["status"].startswith("skipped: needs several hosts")


STEP_ROWS = [("torch-ddp", "4", "torch-ddp"), ("pyfused ddp", "4", "torch-ddp"),
             ("pyfused zero2", "4", "torch-ddp"), ("torch-fsdp2", "4", "torch-fsdp2"),
             ("pyfused fsdp", "4", "torch-fsdp2"), ("torch-fsdp2 hsdp", "2x2", "torch-fsdp2 hsdp"),
             ("pyfused hsdp", "2x2", "torch-fsdp2 hsdp")]


@pytest.mark.skipif(mt.unavailable_reason() is None,
                    reason="the namespace test bed is available: the same suite runs there on real "
                           "hosts (tests/test_multihost_testbed.py::test_two_hosts_under_torchrun)")
def test_bench_suite_on_two_hosts_has_every_row(ranks):
    # the suite's checks run (equal sums, equal losses after one step); its timings are not asserted
    out = ranks.run(4, _with_fake_hosts, 2, C.bench_rows, timeout=3 * TIMEOUT)
    rows = out[0]
    assert [(r["shape"], r["method"], r["status"]) for r in rows[:4]] == [
        (f"{s} MiB", m, "ok") for s in (1, 4) for m in ("flat", "hierarchical")]
    steps = rows[4:]
    assert [(r["method"], r["mesh"], r["baseline"]) for r in steps] == STEP_ROWS, steps
    assert all(r["status"] == "ok" and r["hosts"] == 2 and r["tokens_per_s"] > 0 for r in steps)
