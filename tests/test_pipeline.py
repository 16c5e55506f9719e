"""Pipeline schedules on gloo ranks: exact agreement with unsplit training, and errors that reach
every rank instead of hanging one.

Every rank builds the whole model from one seed, so it can train the unsplit copy itself (the fp32
reference) and compare its own stages' gradients, and -- on the last stage's rank -- the loss and
the output, after every step of an SGD-with-momentum run.

Grid, cut for a 2-core machine (each multi-rank case costs ~0.5-2 s): every schedule at world 3
(odd, so no power-of-two luck), plus world 2 and 4 for 1F1B and interleaved, microbatch counts
below, equal to and above the stage count, and one case each for the automatic split (plan
broadcast from rank 0), declared shapes and tuple activations with an integer tensor.
"""
import copy

import pytest
import torch
import torch.nn as nn

from pyfused.pipeline import (
    PipelineSegment,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    even_starts,
    layer_units,
    split,
)
from pyfused.pipeline.plan import local_stages
from tests.utils import assert_close, long_test

TIMEOUT = 60        # a healthy case takes a few seconds; a hang fails fast
ERROR_TIMEOUT = 30
STEPS = 3


class Fork(nn.Module):
    """Returns a tuple with an integer tensor, so activations cross stages as tuples."""

    def forward(self, h):
        idx = (h.detach().abs() * 7).long() % 5
        return torch.tanh(h), torch.sigmoid(h), idx[:, 0]


class Mix(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.emb = nn.Embedding(5, width)

    def forward(self, a, b, idx):
        return a * b + self.emb(idx)


def build_model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "tuple":
        return nn.Sequential(nn.Linear(12, 16), Fork(), Mix(16), nn.Linear(16, 7))
    # odd widths; 9 layers so that interleaved runs (p * v <= 9 stages) have something in each
    return nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 20), nn.GELU(),
                         nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 20), nn.Tanh(),
                         nn.Linear(20, 7))


def make_schedule(kind, stages, m, loss_fn):
    if kind == "gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn)
    if kind == "1f1b":
        return Schedule1F1B(stages[0], m, loss_fn)
    return ScheduleInterleaved1F1B(stages, m, loss_fn)


def batch(step: int, m: int, rows: int = 3):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(m * rows, 12, generator=g), torch.randn(m * rows, 7, generator=g)


def train_and_compare(rank, world, schedule, v, m, how="even", model_kind="mlp"):
    model = build_model(model_kind)
    ref = copy.deepcopy(model)
    ref_chain = PipelineSegment(layer_units(ref))  # nn.Sequential cannot pass tuples on
    n_stages = world * v
    mine = local_stages(rank, world, v)
    x0, _ = batch(0, m)
    if how == "time":
        mods, report = split(model, n_stages, (x0[:3],), balance="time")
        assert report.decided_by_rank == 0
    elif how == "tuple":
        mods, _ = split(model, n_stages, split_points=[2, 3][:n_stages - 1])
    else:
        mods, _ = split(model, n_stages, split_points=even_starts(len(layer_units(model)), n_stages))
    rows = x0.shape[0] // m
    stages = []
    for s in mine:
        declared = {}
        if how == "declared":  # shapes of one microbatch, given instead of inferred
            xs = x0[:rows]
            for mod in mods[:s]:
                xs = mod(xs)
            declared = dict(input_args=xs.detach().to("meta"),
                            output_args=mods[s](xs).detach().to("meta"))
        stages.append(PipelineStage(mods[s], s, n_stages, "cpu", **declared))
    loss_fn = nn.MSELoss()
    sched = make_schedule(schedule, stages, m, loss_fn)
    params = [p for s in mine for p in mods[s].parameters()]
    # (a stage may hold only activations, e.g. 9 layers over 8 stages)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if params else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    allocated = None
    for step in range(STEPS):
        x, y = batch(step, m)
        if opt:
            opt.zero_grad()
        ref_opt.zero_grad()
        losses = []
        out = sched.step(*((x,) if 0 in mine else ()), target=y if n_stages - 1 in mine else None,
                         losses=losses)
        ref_out = ref_chain(x)
        ref_loss = loss_fn(ref_out, y)
        ref_loss.backward()
        for p in params:
            assert_close(p.grad, ref.get_parameter(names[id(p)]).grad,
                         name=f"{schedule} step {step} grad of {names[id(p)]} on rank {rank}")
        if n_stages - 1 in mine:
            assert len(losses) == m
            assert_close(torch.stack(losses).mean(), ref_loss.detach(), name=f"loss step {step}")
            assert_close(out, ref_out.detach(), name=f"output step {step}")
        else:
            assert out is None and losses == []
        if opt:
            opt.step()
        ref_opt.step()
        if step == 1:
            allocated = sched._transport.pool.allocated
    # Receive buffers are pooled: the third step allocates none.
    assert sched._transport.pool.allocated == allocated
    for p in params:
        assert_close(p.detach(), ref.get_parameter(names[id(p)]).detach(), name="trained weights")
    return True


CASES = [
    # (schedule, world, stages per rank, microbatches, split, model)
    ("gpipe", 3, 1, 6, "even", "mlp"),
    ("gpipe", 2, 1, 4, "declared", "mlp"),
    ("1f1b", 3, 1, 5, "time", "mlp"),
    ("1f1b", 3, 1, 2, "even", "mlp"),       # fewer microbatches than stages
    ("1f1b", 2, 1, 8, "even", "mlp"),
    ("1f1b", 4, 1, 8, "even", "mlp"),
    ("1f1b", 3, 1, 4, "tuple", "tuple"),    # tuple activation with an int64 tensor
    ("interleaved", 3, 2, 6, "even", "mlp"),
    ("interleaved", 2, 2, 4, "even", "mlp"),
    ("interleaved", 2, 3, 3, "even", "mlp"),
    ("interleaved", 4, 2, 8, "even", "mlp"),
]


@pytest.mark.parametrize("schedule,world,v,m,how,model_kind", CASES,
                         ids=[f"{c[0]}-w{c[1]}-v{c[2]}-m{c[3]}-{c[4]}" for c in CASES])
def test_matches_unsplit_training(ranks, schedule, world, v, m, how, model_kind):
    assert all(ranks.run(world, train_and_compare, schedule, v, m, how, model_kind,
                         timeout=TIMEOUT))


# --- errors: the same message on every rank, then the group still works ------------------------

class ShapeChanger(nn.Module):
    """A stage whose output loses a column from its third call on (call 1 is the shape pass,
    call 2 the first microbatch)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(20, 20)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y if self.calls <= 2 else y[:, :-1]


def error_case(rank, world, case):
    from pyfused.comm import InputError
    from pyfused.pipeline import PipelineError

    torch.manual_seed(0)
    widths = [12, 20, 20, 20, 7][:world + 1]
    mods = [nn.Sequential(nn.Linear(widths[s], widths[s + 1])) for s in range(world)]
    m, x, y = 4, torch.randn(8, 12), torch.randn(8, widths[-1])
    kwargs = {}
    if case == "too_few_rows":
        x, y = torch.randn(3, 12), torch.randn(3, widths[-1])
    elif case == "wrong_shape":
        mods[1] = nn.Linear(20, 19)  # the next stage cannot take it
    elif case == "changing_shape":
        mods[1] = ShapeChanger()
    elif case == "declared_mismatch" and rank == 0:
        # a whole batch declared where one microbatch (2 rows) is meant: stage 0 really returns 2 rows
        kwargs = dict(output_args=torch.empty(4, 20, device="meta"))
    elif case == "microbatch_count":
        m = 4 if rank != 1 else 2
    stage = PipelineStage(mods[rank], rank, world, "cpu", **kwargs)
    sched = Schedule1F1B(stage, m, nn.MSELoss())
    outcome = None
    for _ in range(2):  # the shape-changing stage fails on its second step
        try:
            sched.step(*((x,) if rank == 0 else ()),
                       target=y if (rank == world - 1 and case != "missing_target") else None)
        except (InputError, PipelineError) as e:
            outcome = (type(e).__name__, str(e))
            break
    # The group must still work: a correct step on fresh stages.
    good = Schedule1F1B(PipelineStage(nn.Linear(12, 12) if rank == 0 else nn.Identity(), rank,
                                      world, "cpu"), 2, nn.MSELoss())
    good.step(*((torch.ones(4, 12),) if rank == 0 else ()),
              target=torch.zeros(4, 12) if rank == world - 1 else None)
    return outcome


ERRORS = {
    "too_few_rows": ("InputError", "batch of 3"),
    "microbatch_count": ("InputError", "n_microbatches differs between ranks"),
    "missing_target": ("InputError", "target"),
    "wrong_shape": ("PipelineError", "stage 2: its module failed"),
    "changing_shape": ("PipelineError", "agreed on the first step"),
    "declared_mismatch": ("PipelineError", "its output_args declare ([4, 20] float32)"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_reach_every_rank(ranks, case):
    results = ranks.run(3, error_case, case, timeout=ERROR_TIMEOUT)
    kind, words = ERRORS[case]
    assert results[0] is not None, f"{case}: no error raised"
    assert all(r == results[0] for r in results), f"ranks disagree: {results}"
    assert results[0][0] == kind and words in results[0][1], results[0]


# --- timeline ---------------------------------------------------------------------------------

def record_timeline(rank, world, path):
    import torch.distributed as dist

    from pyfused.pipeline import timeline

    torch.manual_seed(0)
    stage = PipelineStage(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), rank, world, "cpu")
    sched = Schedule1F1B(stage, 4, nn.MSELoss())
    args = (torch.randn(8, 16),) if rank == 0 else ()
    tgt = torch.randn(8, 16) if rank == world - 1 else None
    sched.step(*args, target=tgt)
    dist.barrier()
    sched.timeline = timeline.Recorder()
    sched.step(*args, target=tgt)
    rec, sched.timeline = sched.timeline, None
    events = timeline.gather(rec)
    if rank == 0:
        timeline.draw(events, path, "test")
    computes = [e for e in events[rank] if e["kind"] == "compute"]
    return len(computes), timeline.bubble(events), len(events)


def test_timeline(ranks, tmp_path):
    path = tmp_path / "t.png"
    results = ranks.run(2, record_timeline, str(path), timeout=TIMEOUT)
    for n_compute, bub, n_events in results:
        assert n_compute == 8  # 4 forwards + 4 backwards
        assert 0 <= bub < 1
    assert path.stat().st_size > 1000


# --- the benchmark suite (smoke: rows and pictures, not speed) --------------------------------

def bench_quick(rank, world, out):
    import torch.distributed as dist

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_pipeline

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=1, iters=2, options={"out": out})
    return bench_pipeline.run(ctx)


@long_test("the pipeline bench suite at its quick sizes (its plumbing runs in tests/test_bench.py "
           "and tests/test_faults.py)")
def test_benchmark_suite_quick(ranks, tmp_path):
    from pathlib import Path

    results = ranks.run(2, bench_quick, str(tmp_path), timeout=120)
    rows = results[0]
    split = ("zbh1", "interleaved_zb", "zbv", "dualpipev")  # also timed with measured-cost orders
    assert [(r["schedule"], r["method"]) for r in rows] == [
        (s, impl) for s in ("gpipe", "1f1b", "interleaved_1f1b") + split
        for impl in ("torch", "pyfused") + (("pyfused-measured",) if s in split else ())]
    for r in rows:
        assert r["time_ms"] > 0 and r["compute_only_ms"] > 0
        if r["method"].startswith("pyfused"):
            assert 0 <= r["bubble_timeline"] < 1 and Path(r["timeline_png"]).stat().st_size > 1000
    assert [r["shape"] for r in results[1]] == [r["shape"] for r in rows]
