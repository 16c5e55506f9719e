"""The tuner: its decision rule, the cache it writes, that ``auto`` follows it, and that rank 0's
choice is the one every rank records and runs."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from pyfused import tune
from pyfused.tune import CacheError, Entry
from pyfused.tune.tuner import decide

# ---- the decision rule -------------------------------------------------------------------------

def test_decide_picks_the_fastest_only_when_it_beats_unfused():
    u, d2, d4 = ("unfused", 0), ("decomposed", 2), ("decomposed", 4)
    assert decide({u: 10.0, d2: 9.0, d4: 5.0}) == Entry("decomposed", 4)
    assert decide({u: 10.0, d2: 11.0}) == Entry("unfused")
    assert decide({u: 10.0, d2: 9.9}, margin=0.02) == Entry("unfused")   # inside the noise margin
    assert decide({u: 10.0, d2: 9.9}, margin=0.0) == Entry("decomposed", 2)
    assert decide({u: 10.0, d2: float("nan")}) == Entry("unfused")
    with pytest.raises(ValueError, match="unfused"):
        decide({d2: 1.0})


def test_decide_is_never_slower_than_unfused():
    rng = random.Random(0)
    cands = [("unfused", 0), ("decomposed", 0), ("decomposed", 2), ("fused", 0)]
    for _ in range(2000):
        times = {c: rng.uniform(0.1, 10.0) for c in cands if c[0] == "unfused" or rng.random() < 0.7}
        margin = rng.choice([0.0, 0.02, 0.1])
        e = decide(times, margin)
        chosen = times[(e.method, e.chunks)]
        assert chosen <= times[("unfused", 0)]
        if e.method != "unfused":
            assert chosen < times[("unfused", 0)] * (1 - margin)
            assert chosen == min(times.values())


# ---- the cache file ----------------------------------------------------------------------------

@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("PYFUSED_TUNE_CACHE", str(path))
    tune.reload()
    yield path
    tune.reload()


@pytest.mark.parametrize("op, a_shape, b_shape, method", [
    # 8B-like MLP shard at W=2: the rings decompose; the all-reduce of the same GEMM does not
    ("all_gather_matmul", (256, 512), (512, 896), "decomposed"),  # 512 gathered rows
    ("matmul_reduce_scatter", (512, 896), (896, 512), "decomposed"),
    ("matmul_all_reduce", (512, 896), (896, 512), "unfused"),
    ("matmul_all_reduce", (512, 1792), (1792, 1024), "decomposed"),
    # a quarter of the work: below every threshold
    ("all_gather_matmul", (256, 256), (256, 448), "unfused"),
    ("matmul_reduce_scatter", (512, 448), (448, 256), "unfused"),
])
def test_untuned_auto_follows_the_size_rule(cache_file, monkeypatch, op, a_shape, b_shape, method):
    """With no tuned entry, ``auto`` decomposes a GEMM from its collective's FLOP threshold up,
    counting all_gather_matmul's GEMM over the gathered rows (the work a rank does)."""
    from pyfused.ops import _common

    two_ranks = object()
    monkeypatch.setattr(_common.comm, "world_size", lambda pg: 2 if pg is two_ranks else 1)
    a, b = torch.empty(a_shape), torch.empty(b_shape)
    choice = _common.auto_preference(op, two_ranks, (a, b), False)
    assert choice.method == method, choice


def test_store_merges_atomically_and_refuses_a_corrupt_file(cache_file, caplog):
    k1 = tune.key("matmul_all_reduce", 2, (4, 8), (8, 3), torch.float32, torch.device("cpu"))
    tune.store({k1: {"method": "decomposed", "chunks": 2}})
    tune.store({"other": {"method": "unfused", "chunks": 0}})
    assert set(json.loads(cache_file.read_text())) == {k1, "other"}
    assert tune.lookup("matmul_all_reduce", 2, (4, 8), (8, 3), torch.float32,
                       torch.device("cpu")) == Entry("decomposed", 2)
    assert [p.name for p in cache_file.parent.iterdir() if p.suffix == ".tmp"] == []
    cache_file.write_text("{not json")
    with pytest.raises(CacheError, match="not valid JSON"):
        tune.store({k1: {"method": "unfused", "chunks": 0}})
    assert cache_file.read_text() == "{not json"  # left for the user to look at
    tune.reload()
    with caplog.at_level("WARNING", logger="pyfused"):
        assert tune.lookup("matmul_all_reduce", 2, (4, 8), (8, 3), torch.float32,
                           torch.device("cpu")) is None
    assert "ignoring the tuning cache" in caplog.text


def test_tune_argument_errors():
    with pytest.raises(ValueError, match="auto is what tuning is for"):
        tune.tune("all_gather_matmul", (4, 8), (8, 3), methods=["auto"], write=False)
    with pytest.raises(ValueError, match="all_reduce_add_rmsnorm only"):
        tune.tune("all_gather_matmul", (4, 8), (8, 3), chunks=[2], write=False)
    with pytest.raises(ValueError, match="op must be one of"):
        tune.tune("matmul", (4, 8), (8, 3), write=False)


# ---- on 2 ranks --------------------------------------------------------------------------------

def _scripted(per_candidate_ms):
    """A ``timer`` that runs each candidate once (they are collectives) and reports scripted times,
    in the tuner's candidate order: unfused, decomposed (per chunk count), fused."""
    def timer(fns, ctx):
        assert len(fns) == len(per_candidate_ms), list(fns)
        for fn in fns.values():
            fn()
        return dict(zip(fns, per_candidate_ms))
    return timer


def _use_cache(path):
    old = os.environ.get("PYFUSED_TUNE_CACHE")
    os.environ["PYFUSED_TUNE_CACHE"] = str(path)
    tune.reload()
    return old


def _restore_cache(old):
    if old is None:
        os.environ.pop("PYFUSED_TUNE_CACHE", None)
    else:
        os.environ["PYFUSED_TUNE_CACHE"] = old
    tune.reload()


class _Recorder:
    """Counts the decomposed schedule's runs (and matmul_all_reduce's chunk counts) in this rank."""

    def __init__(self):
        import importlib

        # the modules, not the functions pyfused.ops re-exports under the same names
        agm = importlib.import_module("pyfused.ops.all_gather_matmul")
        mar = importlib.import_module("pyfused.ops.matmul_all_reduce")

        self.mods = (agm, mar)
        self.orig = (agm.chunked_ring_all_gather_matmul, mar.chunked_matmul_all_reduce)
        self.calls = []

        def ring(*args, **kw):
            self.calls.append(("ring", None))
            return self.orig[0](*args, **kw)

        def chunked(a, b, pg, chunks):
            self.calls.append(("chunked", chunks))
            return self.orig[1](a, b, pg, chunks)
        agm.chunked_ring_all_gather_matmul, mar.chunked_matmul_all_reduce = ring, chunked

    def close(self):
        self.mods[0].chunked_ring_all_gather_matmul, self.mods[1].chunked_matmul_all_reduce = \
            self.orig


def _tune_then_auto(rank, world, tmpdir):
    import pyfused.ops as ops
    from pyfused.ops import _common
    from tests.utils import assert_close

    old = _use_cache(Path(tmpdir) / f"rank{rank}.json")
    rec = None
    try:
        a_shape, b_shape = (16, 24), (24, 20)  # far below auto's size rule: untuned auto = unfused
        a = torch.randn(a_shape, generator=torch.Generator().manual_seed(rank))
        b = torch.randn(b_shape, generator=torch.Generator().manual_seed(10 + rank))
        before = _common.prepare_matmul("matmul_all_reduce", a, b, None, "auto")[1]
        assert before.method == "unfused", before
        # candidates: unfused, decomposed/c2, /c4, /c8 -> c4 measured fastest
        res = tune.tune("matmul_all_reduce", a_shape, b_shape, torch.float32,
                        timer=_scripted([10.0, 9.0, 5.0, 7.0]))
        assert res.entry == Entry("decomposed", 4)
        assert res.times_ms == {"unfused": 10.0, "decomposed/c2": 9.0, "decomposed/c4": 5.0,
                                "decomposed/c8": 7.0}
        tune.reload()  # read back from the file, not the in-memory copy
        choice = _common.prepare_matmul("matmul_all_reduce", a, b, None, "auto")[1]
        assert (choice.method, choice.chunks) == ("decomposed", 4), choice
        rec = _Recorder()
        y = ops.matmul_all_reduce(a, b, method="auto")
        assert rec.calls == [("chunked", 4)]
        assert_close(y, ops.matmul_all_reduce(a, b, method="unfused"))
        return json.loads(Path(res.path).read_text())
    finally:
        if rec:
            rec.close()
        _restore_cache(old)


def test_tuner_writes_the_entry_auto_follows(ranks, tmp_path):
    files = ranks.run(2, _tune_then_auto, str(tmp_path), timeout=60)
    assert files[0] == files[1] and len(files[0]) == 1
    (key, entry), = files[0].items()
    assert key == "cpu|w2|matmul_all_reduce|16x24|24x20|float32"
    assert (entry["method"], entry["chunks"]) == ("decomposed", 4)


def _rank0_wins(rank, world, tmpdir):
    import pyfused.ops as ops
    from pyfused.ops import _common

    old = _use_cache(Path(tmpdir) / f"rank{rank}.json")
    rec = None
    try:
        out = {}
        # Per-rank scripted times (no slowest-rank agreement): each rank alone would choose
        # differently; the entry every rank writes must be rank 0's choice.
        for shape, mine in (((8, 12), {0: [10.0, 5.0], 1: [5.0, 10.0]}),     # rank 0: decomposed
                            ((6, 12), {0: [5.0, 10.0], 1: [10.0, 5.0]})):    # rank 0: unfused
            res = tune.tune("all_gather_matmul", shape, (12, 10), torch.float32,
                            methods=["unfused", "decomposed"], timer=_scripted(mine[rank]))
            out[shape[0]] = res.method
        # Conflicting caches written apart: rank 0's file says decomposed, rank 1's unfused.
        # auto must run rank 0's choice on every rank.
        a = torch.randn(4, 12)
        b = torch.randn(12, 10)
        k = tune.key("all_gather_matmul", world, (4, 12), (12, 10), torch.float32,
                     torch.device("cpu"))
        tune.store({k: {"method": "decomposed" if rank == 0 else "unfused", "chunks": 0}})
        out["choice"] = _common.prepare_matmul("all_gather_matmul", a, b, None, "auto")[1].method
        rec = _Recorder()
        ops.all_gather_matmul(a, b, method="auto")
        out["ran"] = rec.calls
        return out
    finally:
        if rec:
            rec.close()
        _restore_cache(old)


def test_rank0_choice_wins(ranks, tmp_path):
    got = ranks.run(2, _rank0_wins, str(tmp_path), timeout=60)
    for r in got:
        assert r[8] == "decomposed" and r[6] == "unfused", got
        assert r["choice"] == "decomposed" and r["ran"] == [("ring", None)], got
    for rank in (0, 1):
        entries = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert entries["cpu|w2|all_gather_matmul|8x12|12x10|float32"]["method"] == "decomposed"
        assert entries["cpu|w2|all_gather_matmul|6x12|12x10|float32"]["method"] == "unfused"


def _tune_measured(rank, world, path):
    old = _use_cache(path)  # one file shared by both ranks: the locked, atomic merge
    try:
        res = tune.tune("matmul_reduce_scatter", (32, 24), (24, 16), torch.float32,
                        warmup=1, iters=3)
        return res.entry, res.times_ms, res.skipped
    finally:
        _restore_cache(old)


def test_tune_with_real_timings(ranks, tmp_path):
    path = tmp_path / "shared.json"
    got = ranks.run(2, _tune_measured, str(path), timeout=60)
    assert got[0] == got[1]  # the same entry and rank 0's measurements on every rank
    entry, times, skipped = got[0]
    assert set(times) == {"unfused", "decomposed"} and "fused" in skipped
    chosen = times[entry.method]
    assert chosen <= times["unfused"]
    stored = json.loads(path.read_text())["cpu|w2|matmul_reduce_scatter|32x24|24x16|float32"]
    assert (stored["method"], stored["chunks"]) == (entry.method, entry.chunks)


def test_tune_cli_under_torchrun_env(tmp_path, monkeypatch, capsys):
    """``python -m pyfused.tune``'s main as torchrun would start it (one rank, in this process: the
    2-rank logic is tested above; this checks the CLI's wiring from arguments to cache file)."""
    import socket

    from pyfused.tune import cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "cli.json"
    old = os.environ.get("PYFUSED_TUNE_CACHE")
    try:
        rc = cli.main(["--shapes", "32x16x24", "--ops", "matmul_all_reduce,all_gather_matmul",
                       "--iters", "2", "--warmup", "1", "--chunks", "2,4", "--cache", str(cache)])
    finally:
        _restore_cache(old)
    assert rc == 0
    entries = json.loads(cache.read_text())
    assert set(entries) == {"cpu|w1|matmul_all_reduce|32x16|16x24|float32",
                            "cpu|w1|all_gather_matmul|32x16|16x24|float32"}
    mar = entries["cpu|w1|matmul_all_reduce|32x16|16x24|float32"]
    assert set(mar["times_ms"]) == {"unfused", "decomposed/c2", "decomposed/c4"}
    out = capsys.readouterr().out
    assert "written to" in out and "matmul_all_reduce" in out
    assert cli.main(["--ops", "matmul"]) == 2
    assert cli.main(["--ops", "all_reduce_add_rmsnorm", "--shapes", "24x40x8"]) == 2

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    try:
        rc = cli.main(["--shapes", "24x40", "--ops", "all_reduce_add_rmsnorm", "--iters", "2",
                       "--warmup", "1", "--chunks", "2", "--cache", str(cache)])
    finally:
        _restore_cache(old)
    assert rc == 0
    norm = json.loads(cache.read_text())["cpu|w1|all_reduce_add_rmsnorm|24x40|40|float32"]
    assert set(norm["times_ms"]) == {"unfused", "decomposed/c2"} and "fused" in norm["skipped"]
    assert "x=24x40" in capsys.readouterr().out


def _tune_norm_then_auto(rank, world, tmpdir):
    """all_reduce_add_rmsnorm: tuned like the GEMM ops (x [rows, hidden], weight [hidden]), and
    ``auto`` then runs the tuned method and chunk count."""
    import pyfused.ops as ops
    from pyfused.ops.all_reduce_add_rmsnorm import prepare
    from tests.utils import assert_close

    old = _use_cache(Path(tmpdir) / f"rank{rank}.json")
    try:
        x = torch.randn(12, 40, generator=torch.Generator().manual_seed(rank))
        res_in = torch.randn(12, 40, generator=torch.Generator().manual_seed(5))
        w = torch.rand(40, generator=torch.Generator().manual_seed(6)) + 0.5
        assert prepare(x, res_in, w, 1e-6, None, "auto", 0)[1].method == "unfused"  # untuned
        # candidates: unfused, decomposed/c2, /c4, /c8 -> c2 measured fastest
        res = tune.tune("all_reduce_add_rmsnorm", (12, 40), (40,), torch.float32,
                        timer=_scripted([10.0, 6.0, 8.0, 9.0]))
        assert res.entry == Entry("decomposed", 2), res
        tune.reload()
        choice = prepare(x, res_in, w, 1e-6, None, "auto", 0)[1]
        got = ops.all_reduce_add_rmsnorm(x, res_in, w, 1e-6, method="auto")
        want = ops.all_reduce_add_rmsnorm(x, res_in, w, 1e-6, method="unfused")
        for g, r in zip(got, want):
            assert_close(g, r)
        return (choice.method, choice.chunks), json.loads(Path(res.path).read_text())
    finally:
        _restore_cache(old)


def test_tuner_covers_all_reduce_add_rmsnorm(ranks, tmp_path):
    got = ranks.run(2, _tune_norm_then_auto, str(tmp_path), timeout=60)
    for choice, entries in got:
        assert choice == ("decomposed", 2)
        entry = entries["cpu|w2|all_reduce_add_rmsnorm|12x40|40|float32"]
        assert (entry["method"], entry["chunks"]) == ("decomposed", 2)
    with pytest.raises(ValueError, match="weight"):
        tune.tune("all_reduce_add_rmsnorm", (12, 40), (12, 40), torch.float32)


def test_norm_shapes_for_the_tuner():
    from pyfused.benchmarks import shapes

    # the benchmark's default sizes at the device's hidden size: 8 KiB of fp32 at hidden 1024 = 2 rows
    assert shapes.norm_shapes(None, "cpu", True, 4) == [(2, 1024), (128, 1024)]
    assert shapes.norm_shapes(None, "cuda", False, 2)[0] == (1, 4096)
    assert shapes.norm_shapes(None, "cuda", False, 2)[-1] == (8192, 4096)  # 64 MiB of bf16
    assert shapes.norm_shapes("24x40,llama3-70b", "cpu", False, 4) == [(24, 40), (512, 1024)]
    with pytest.raises(ValueError, match="RxH"):
        shapes.norm_shapes("24x40x8", "cpu", False, 4)
