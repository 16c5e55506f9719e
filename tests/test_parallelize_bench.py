"""benchmarks/bench_parallelize.py runs on 2 gloo ranks: one row per family and variant, the same loss
for torch's DTensor TP / TP+SP and pyfused's TP / TP+SP (the suite refuses to time a wrong result),
finite timings, each pyfused row timed against the torch row of its own parallelism; torch's plans
give the unsharded model's gradients."""
import math

import pytest

pytest.importorskip("transformers", reason="bench_parallelize needs transformers (the 'models' extra)")


def _run_suite(rank, world):
    import torch
    import torch.distributed as dist

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_parallelize

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=1)
    return bench_parallelize.run(ctx)


def test_bench_parallelize_quick(ranks):
    rows = ranks.run(2, _run_suite, timeout=180)[0]
    variants = ["torch-tp", "torch-tp+sp", "pyfused-tp", "pyfused-tp+sp"]
    assert [(r["family"], r["method"]) for r in rows] == [
        (f, v) for f in ("llama", "phi3", "gemma2") for v in variants]
    for r in rows:
        assert r["status"] == "ok" and r["time_ms"] > 0 and math.isfinite(r["tokens_per_s"]), r
        assert r["tp"] == 2 and r["transport"] == "gloo", r
    for r in rows:
        if r.get("peer"):
            assert r["vs_peer_lo"] <= r["vs_peer"] <= r["vs_peer_hi"], r
    peers = {r["method"]: r.get("peer") for r in rows}
    assert peers == {"torch-tp": None, "torch-tp+sp": None, "pyfused-tp": "torch-tp",
                     "pyfused-tp+sp": "torch-tp+sp"}, peers


def _torch_plan_grads(rank, world, family, sequence_parallel):
    """Every parameter's gradient after one backward under torch's plan, as the full tensor, and
    the unsharded model's; for a replicated parameter, this rank's local gradient as it stands (a
    sum left partial would differ from the full model's)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    from pyfused.bench.harness import BenchContext
    from pyfused.benchmarks import bench_parallelize as bp

    ctx = BenchContext(rank, world, dist.group.WORLD, torch.device("cpu"), "gloo", quick=True,
                       warmup=0, iters=1)
    size = bp.SIZES[("cpu", True)]
    full = bp.build(size, ctx, family)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("tp",))
    model = bp.torch_tp(copy.deepcopy(full), mesh, family, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(3))
    full(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
    cfg = full.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    sections = {"qkv_proj": (cfg.num_attention_heads * head_dim,
                             2 * cfg.num_key_value_heads * head_dim),
                "gate_up_proj": (cfg.intermediate_size,) * 2}
    out = []
    for (name, p), (_, q) in zip(model.named_parameters(), full.named_parameters()):
        grad = p.grad
        if isinstance(grad, DTensor):
            replicated = all(isinstance(pl, Replicate) for pl in grad.placements)
            grad = grad.to_local() if replicated else grad.full_tensor()
        expected = q.grad
        kind = name.split(".")[-2]
        if family == "phi3" and kind in sections:  # the torch plan's rank-major row order
            q_rows, kv_rows = sections[kind]
            split = (q_rows, kv_rows // 2, kv_rows // 2) if kind == "qkv_proj" else (q_rows, kv_rows)
            expected = bp._rank_major(expected, split, world)
        out.append((name, (grad - expected).abs().max().item() / expected.abs().max().item()))
    return out


@pytest.mark.parametrize("family", ["llama", "phi3", "gemma2"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_torch_peer_plans_give_the_full_models_gradients(ranks, family, sequence_parallel):
    """The torch rows are timed as what they claim to be: their gradients (the sequence-parallel
    norms' summed over the ranks) are the unsharded model's."""
    for name, err in ranks.run(2, _torch_plan_grads, family, sequence_parallel, timeout=180)[0]:
        assert err < 1e-4, (name, err)
