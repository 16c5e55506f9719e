"""pyfused.pipeline.split: units, profiling, the plan it picks, and rank 0 deciding for everyone."""
import pytest
import torch
import torch.nn as nn

from pyfused.comm import InputError
from pyfused.pipeline import PipelineError, layer_units, partition, split, stage_sums
from tests.utils import assert_close


def uneven_mlp():
    torch.manual_seed(0)
    widths = [16, 64, 8, 96, 96, 12, 40, 4]  # very different layer costs on purpose
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + self.lin(self.norm(x))


class TinyTransformer(nn.Module):
    """embed -> blocks (a ModuleList) -> norm -> head: a chain once the list is expanded."""

    def __init__(self, residual_around_blocks=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 24)
        self.layers = nn.ModuleList([Block(24) for _ in range(5)])
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 11)
        self.residual_around_blocks = residual_around_blocks

    def forward(self, tokens):
        h = self.embed(tokens)
        h0 = h
        for block in self.layers:
            h = block(h)
        if self.residual_around_blocks:
            h = h + h0
        return self.head(self.norm(h))


@pytest.mark.parametrize("balance", ["time", "memory"])
def test_split_is_optimal_for_its_own_profile_and_keeps_the_function(balance):
    model = uneven_mlp()
    x = torch.randn(32, 16)
    stages, report = split(model, 3, (x,), balance=balance)
    costs = report.layer_time_ms if balance == "time" else report.layer_memory_bytes
    assert report.split_points == partition(costs, 3)
    assert max(stage_sums(costs, report.split_points)) <= report.even_bottleneck
    assert len(stages) == 3 and len(report.stage_time_ms) == 3
    assert report.imbalance >= 1.0
    h = x
    for s in stages:
        h = s(h)
    assert_close(h, model(x), name="chained stages")
    assert all(p.grad is None for p in model.parameters()), "profiling must not touch .grad"
    assert "stage 2" in str(report)


def test_memory_counts_parameters_and_saved_activations():
    model = nn.Sequential(nn.Linear(10, 1000), nn.ReLU(), nn.Linear(1000, 10))
    x = torch.randn(64, 10)
    _, report = split(model, 2, (x,), balance="memory")
    params = [sum(p.numel() * 4 for p in m.parameters()) for _, m in layer_units(model)]
    # Linear saves its input; ReLU saves its output
    assert report.layer_memory_bytes[0] == params[0] + 64 * 10 * 4
    assert report.layer_memory_bytes[1] == 64 * 1000 * 4
    assert report.layer_memory_bytes[2] == params[2] + 64 * 1000 * 4


def test_module_list_body_is_expanded_and_checked():
    model = TinyTransformer()
    tokens = torch.randint(0, 11, (4, 7))
    stages, report = split(model, 4, (tokens,))
    assert report.layer_names == ["embed", *[f"layers.{i}" for i in range(5)], "norm", "head"]
    h = tokens
    for s in stages:
        h = s(h)
    assert_close(h, model(tokens), name="chained transformer")
    with pytest.raises(PipelineError, match="not the chain of its layers"):
        split(TinyTransformer(residual_around_blocks=True), 2, (tokens,))


def test_manual_split_points_and_bad_arguments():
    model = uneven_mlp()
    stages, report = split(model, 3, split_points=[2, 9])
    assert report.split_points == (2, 9) and [len(s.layers) for s in stages] == [2, 7, 5]
    with pytest.raises(InputError, match="strictly increasing"):
        split(model, 3, split_points=[9, 2])
    with pytest.raises(InputError, match="balance must be one of"):
        split(model, 2, (torch.randn(2, 16),), balance="speed")
    with pytest.raises(InputError, match="num_stages=15"):
        split(model, 15, (torch.randn(2, 16),))


def test_profiling_restores_buffers():
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    before = model[1].running_mean.clone()
    split(model, 2, (torch.randn(8, 6) + 5,))
    assert torch.equal(model[1].running_mean, before)


# --- distributed: rank 0 decides ---------------------------------------------------------------

def decide_with_rank_dependent_timings(rank, world):
    import pyfused.pipeline.autosplit as split_mod

    model = uneven_mlp()
    n = len(layer_units(model))
    # Pretend every rank measures something different: only rank 0's numbers may count.
    fake = [float((i * (rank + 3)) % 7 + 1 + (5 * rank if i == rank else 0)) for i in range(n)]
    real = split_mod._profile
    split_mod._profile = lambda model, units, example, repeats: (fake, [1] * n)
    try:  # (the rank processes are reused by later tests)
        _, report = split(model, world, (torch.randn(4, 16),))
    finally:
        split_mod._profile = real
    rank0 = [float((i * 3) % 7 + 1) for i in range(n)]
    return report.split_points, report.decided_by_rank, partition(rank0, world), \
        partition(fake, world)


def test_plan_is_decided_on_rank_0_and_broadcast(ranks):
    results = ranks.run(3, decide_with_rank_dependent_timings, timeout=60)
    points = {r[0] for r in results}
    assert len(points) == 1, f"ranks built different stages: {results}"
    assert results[0][0] == results[0][2] and all(r[1] == 0 for r in results)
    assert any(r[3] != r[2] for r in results), "the fake timings must disagree for the test to bite"


def disagreeing_arguments(rank, world):
    try:
        split(uneven_mlp(), 3 if rank != 2 else 2, (torch.randn(4, 16),))
    except InputError as e:
        return str(e)
    return None


def test_disagreeing_arguments_fail_everywhere(ranks):
    results = ranks.run(3, disagreeing_arguments, timeout=60)
    assert results[0] is not None and all(r == results[0] for r in results), results
    assert "differs between ranks" in results[0]
