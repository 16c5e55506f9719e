"""``pyfused.parallelize`` on 2-D meshes: dp x tp (pyfused's DistributedDataParallel) and pp x tp
(pyfused.pipeline's splitter and 1F1B schedule) == the single-process model (see test_parallelize.py).

Sizes as in test_parallelize.py, with a batch of 4 (two dp halves, or two pipeline microbatches).
"""
import pytest
import torch

from tests.test_parallelize import SEQ, VOCAB, build
from tests.utils import assert_close

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers (the 'models' extra)")


def _mesh_matches(rank, world, family, shape, names, sp, pipeline_options, overrides=None):
    """dp x tp or pp x tp: each dp rank trains on its half of a batch of 4; the gradients must be the
    full batch's (DDP averages), the logits and loss those of the rank's half."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize.steps import MeshInfo

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    info = MeshInfo(mesh)  # dp: the "dp" dim, or HSDP's dp_replicate x dp_shard
    dp, dp_rank = info.size["dp"], info.coord["dp"]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels[0, :3] = -100  # padding: the halves' token counts differ, DDP still averages the means
    rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    overrides = overrides or {}
    ref = build(family, **overrides)
    with torch.no_grad():
        ref_out = ref(input_ids=ids[rows], labels=labels[rows])
    if dp == 1:
        full = ref(input_ids=ids, labels=labels)
        full.loss.backward()
    else:  # DDP's gradient: the mean of the dp ranks' mean-loss gradients
        for r in range(dp):
            part = slice(r * 4 // dp, (r + 1) * 4 // dp)
            (ref(input_ids=ids[part], labels=labels[part]).loss / dp).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    pm = pyfused.parallelize(build(family, **overrides), mesh, sequence_parallel=sp, **pipeline_options)
    tag = f"{family} mesh {dict(zip(names, shape))} sp={sp} rank {rank}"
    last = "pp" not in names or mesh.get_local_rank("pp") == mesh.size(names.index("pp")) - 1
    with torch.no_grad():  # forward only (with pp: an eval step of the schedule, no backward)
        ev = pm(input_ids=ids[rows], labels=labels[rows])
    assert_close(ev.loss, ref_out.loss, name=f"eval loss {tag}")
    if last:
        assert_close(ev.logits, ref_out.logits, name=f"eval logits {tag}")
    assert all(p.grad is None for p in pm.parameters()), f"an eval call left gradients {tag}"
    out = pm(input_ids=ids[rows], labels=labels[rows])
    if last:
        assert_close(out.logits, ref_out.logits, name=f"logits {tag}")
    else:
        assert out.logits is None, tag
    assert_close(out.loss, ref_out.loss, name=f"loss {tag}")  # pp: broadcast from the last stage
    pm.backward(out.loss)
    grads = pm.full_grad_dict()
    assert list(grads) == list(ref_grads), tag
    for name, gr in grads.items():
        assert_close(gr, ref_grads[name], name=f"grad {name} {tag}")
    # clipping sees the full model's norm (shards summed, replicas and the tied head counted once)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert_close(pm.clip_grad_norm_(0.05), ref_norm, name=f"grad norm {tag}")
    clipped = pm.full_grad_dict()
    for name, p in ref.named_parameters():
        assert_close(clipped[name], p.grad, name=f"clipped grad {name} {tag}")
    full_sd, orig = pm.full_state_dict(), ref.state_dict()
    assert list(full_sd) == list(orig), tag
    for k in orig:
        assert torch.equal(full_sd[k], orig[k]), f"state {k} {tag}"
    return True


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_data_parallel_x_tensor_parallel(ranks, family):
    assert all(ranks.run(4, _mesh_matches, family, (2, 2), ("dp", "tp"), True, {}, timeout=240))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pipeline_x_tensor_parallel(ranks, family):
    # gpt2 ties its LM head to the embedding: the two copies live on different stages. llama: a cut
    # after both blocks (units: embedding, block 0, block 1, head), so that a stage's second block
    # receives the first one's sequence shard; gpt2: the profiled (time-balanced) cut
    options = {"n_microbatches": 2, **({"split_points": [3]} if family == "llama" else {})}
    assert all(ranks.run(4, _mesh_matches, family, (2, 2), ("pp", "tp"), True, options, timeout=240))


def test_data_parallel_x_pipeline(ranks):
    # DDP inside a pipeline stage reduces once, on the last microbatch's backward (gpt2: the tied
    # LM head's gradient is then also summed across the two stages)
    assert all(ranks.run(4, _mesh_matches, "gpt2", (2, 2), ("dp", "pp"), True,
                         {"n_microbatches": 2}, timeout=240))


def test_pipeline_x_tensor_parallel_padded_vocabulary(ranks):
    # vocabulary 101 at tp=2: the padded embedding (first stage) and the tied, padded LM head (last
    # stage) must stay the same Parameter's shards across the stages
    assert all(ranks.run(4, _mesh_matches, "gpt2", (2, 2), ("pp", "tp"), True, {"n_microbatches": 2},
                         {"vocab_size": VOCAB + 1}, timeout=240))


def test_pipeline_uneven_microbatches(ranks):
    # a batch of 4 in 3 microbatches (rows 2, 1, 1) with padded labels: each microbatch's loss is its
    # token sum over the whole batch's token count, so the losses add up to the full batch's mean and
    # the gradients are the full batch's (a schedule that scaled them again would be off by m * rows)
    assert all(ranks.run(2, _mesh_matches, "llama", (2,), ("pp",), False, {"n_microbatches": 3},
                         timeout=240))
