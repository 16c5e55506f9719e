"""torch.compile(fullgraph=True) of a Column -> GELU -> Row MLP traces with no graph break and
matches eager, forward and backward, at world size 2 with sequence parallelism on and off.

Host-side work (validation, method choice) happens inside the registered ops when they run, so
Dynamo never traces it."""
import pytest
import torch.nn as nn

from tests.utils import assert_close

HIDDEN, FFN = 12, 16


def _compiled_mlp_matches_eager(rank, world, sp, backend, overlap):
    import torch._dynamo

    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    torch._dynamo.reset()
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    col = ColumnParallelLinear.from_linear(fc1, sequence_parallel=sp, overlap=overlap)
    row = RowParallelLinear.from_linear(fc2, sequence_parallel=sp, overlap=overlap)
    mlp = nn.Sequential(col, nn.GELU(), row)
    seq = 4 * world
    x = torch.randn(seq, 3, HIDDEN, generator=torch.Generator().manual_seed(1))
    if sp:
        x = x[rank * seq // world:(rank + 1) * seq // world]
    x_eager, x_comp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_eager = mlp(x_eager)
    y_eager.square().sum().backward()
    grads_eager = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()

    compiled = torch.compile(mlp, backend=backend, fullgraph=True)
    y_comp = compiled(x_comp)
    y_comp.square().sum().backward()
    assert_close(y_comp, y_eager, torch.float32, f"output sp={sp} {backend}")
    assert_close(x_comp.grad, x_eager.grad, torch.float32, f"input grad sp={sp} {backend}")
    for p, g in zip(mlp.parameters(), grads_eager):
        assert_close(p.grad, g, torch.float32, f"param grad sp={sp} {backend}")
    return True


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("sp", [False, True])
def test_compiled_tp_mlp_matches_eager(ranks, sp, backend):
    assert all(ranks.run(2, _compiled_mlp_matches_eager, sp, backend, "auto", timeout=300))


def _compiled_ops_match_eager(rank, world):
    """Each functional op called eagerly first (its plan is then in the plan cache, which Dynamo
    must not consult), then compiled with fullgraph=True, with and without gradients."""
    import torch
    import torch._dynamo

    from pyfused.ops.registry import OPS

    torch._dynamo.reset()
    for name, spec in OPS.items():
        inputs = spec.make_inputs(world, 2, 3, 5, seed=3)[rank]
        for grad in (False, True):
            fn = spec.function
            eager_in = [t.clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
            for _ in range(2):
                eager = fn(*eager_in)
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
            comp_in = [t.clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
            comp = compiled(*comp_in)
            eager, comp = (eager, comp) if isinstance(eager, tuple) else ((eager,), (comp,))
            for e, c in zip(eager, comp):
                assert_close(c, e, torch.float32, f"{name} grad={grad}")
            if grad:
                sum(o.square().sum() for o in eager).backward()
                sum(o.square().sum() for o in comp).backward()
                for e, c in zip(eager_in, comp_in):
                    if e.requires_grad:
                        assert_close(c.grad, e.grad, torch.float32, f"{name} input grad")
    return True


def test_compiled_ops_match_eager_after_eager_calls(ranks):
    assert all(ranks.run(2, _compiled_ops_match_eager, timeout=300))
