"""``parallelize`` with an ``ep`` mesh dim on tiny mixture-of-experts models == single-process
training.

Every rank builds the same tiny random-weight MoE model (tests/moe_models.py), keeps an untouched
copy as the reference and parallelizes the other. The ranks along dp and ep feed their own batches
(the ep dim is a data-parallel dim that shares the experts out); tp ranks share theirs. The
reference trains on the mean of the data ranks' losses -- what the parallel step averages -- and
the parallel model must match it: each rank's logits (on a pipeline's last stage) and loss on its
batch, every gradient (gathered), the gradient norm, and after three SGD steps with momentum the
losses and the gathered state dict (AdamW divides each gradient by its own running scale, which
turns the last-bit differences of summing experts' rows in another order into visible ones where a
gradient is ~0). Bad meshes and combinations that are not supported raise the same error on every
rank.

Grids are cut to what covers each path once (each body loops over its families, so a pool and the
transformers import are paid once per world size): ep=2 for the six families, ep=3 (odd),
dp=2 x ep=2 with dp="ddp" and with dp="fsdp", pp=2 x ep=2 with dp="ddp" and with dp="fsdp",
ep=2 x tp=2 with sequence parallelism; PYFUSED_FULL_MOE_MATRIX=1 adds ep=4 (one expert per rank),
ep=2 with dp="fsdp" and no dp dim, dp=2 x pp=2 x ep=2 with dp="fsdp", tp without sequence
parallelism and a second family where a body has one.
"""
import pytest
import torch

from tests import moe_checks
from tests.utils import assert_close

pytest.importorskip("transformers", reason="the MoE parallelize tests need transformers")

TIMEOUT = 400
STEPS = 3


def _data_rank(info) -> int:
    return info.coord["dp"] * info.size["ep"] + info.coord["ep"]


def _train(rank, world, families, dims, shape, sp=True, experts=4, steps=STEPS, dp="ddp"):
    """``steps`` SGD steps of each family on a mesh ``dims`` x ``shape`` against the reference,
    with data parallelism ``dp``."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from tests.moe_models import batch, build

    for family in families:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        pm = pyfused.parallelize(build(family, experts=experts), mesh, sequence_parallel=sp,
                                 dp=dp)
        ref = build(family, experts=experts)
        data_ranks = pm.mesh_info.size["dp"] * pm.mesh_info.size["ep"]
        opt = torch.optim.SGD(pm.parameters(), lr=0.5, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
        tag = f"{family} mesh {dict(zip(dims, shape))} sp={sp} dp={dp} rank {rank}"
        for step in range(steps):
            batches = [batch(seed=100 * step + d, seq=8) for d in range(data_ranks)]
            ids, labels = batches[_data_rank(pm.mesh_info)]
            out = pm(input_ids=ids, labels=labels)
            pm.backward(out.loss)
            ref_outs = [ref(input_ids=i, labels=lab) for i, lab in batches]
            (sum(o.loss for o in ref_outs) / data_ranks).backward()
            mine = ref_outs[_data_rank(pm.mesh_info)]
            if out.logits is not None:  # None on the ranks of a pipeline's earlier stages
                assert_close(out.logits, mine.logits, name=f"logits step {step} {tag}")
            assert_close(out.loss, mine.loss, name=f"loss step {step} {tag}")
            if step == 0:
                grads = pm.full_grad_dict()
                for name, p in ref.named_parameters():
                    assert_close(grads[name], p.grad, name=f"grad {name} {tag}")
            norm = pm.clip_grad_norm_(1e9)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            assert_close(norm, ref_norm, name=f"grad norm step {step} {tag}")
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        full = pm.full_state_dict()
        for k, v in ref.state_dict().items():
            assert_close(full[k], v, name=f"state {k} after {steps} steps {tag}")
    return True


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def test_ep2_every_family(ranks):
    assert all(ranks.run(2, _train, FAMILIES, ("ep",), (2,), timeout=TIMEOUT))


def test_ep3_and_ep4(ranks):
    assert all(ranks.run(3, _train, moe_checks.grid(("mixtral", "qwen3_moe"), ("qwen3_moe",)),
                         ("ep",), (3,), experts=6, timeout=TIMEOUT))
    if moe_checks.FULL_MATRIX:  # one expert per rank; tests/test_moe_checkpoint.py trains at ep=4
        assert all(ranks.run(4, _train, ("mixtral",), ("ep",), (4,), timeout=TIMEOUT))


def test_dp_and_ep_share_ranks(ranks):
    assert all(ranks.run(4, _train, ("qwen2_moe",), ("dp", "ep"), (2, 2), timeout=TIMEOUT))


def test_fully_sharded_dp_and_ep(ranks):
    """dp="fsdp": the experts sharded over dp (their own units), the rest over dp x ep."""
    assert all(ranks.run(4, _train, ("gpt_oss",), ("dp", "ep"), (2, 2), dp="fsdp",
                         timeout=TIMEOUT))
    if moe_checks.FULL_MATRIX:  # no dp dim: the rest sharded over ep, the experts whole
        assert all(ranks.run(2, _train, ("mixtral",), ("ep",), (2,), dp="fsdp", timeout=TIMEOUT))


def test_ep_within_pipeline_stages(ranks):
    """pp=2 x ep=2: each stage's experts over its ep ranks, 1F1B over two microbatches."""
    assert all(ranks.run(4, _train, ("qwen2_moe",), ("pp", "ep"), (2, 2), timeout=TIMEOUT))


def test_fully_sharded_pipeline_stages_with_ep(ranks):
    """pp=2 x ep=2 with dp="fsdp": each stage's experts units of their own (over no dp dim: whole
    on each rank), the rest of the stage sharded over its ep ranks, the microbatches' gradients
    reduce-scattered once per step."""
    assert all(ranks.run(4, _train, ("mixtral",), ("pp", "ep"), (2, 2), dp="fsdp",
                         timeout=TIMEOUT))
    if moe_checks.FULL_MATRIX:  # a dp dim too: the experts sharded over dp, the rest over dp x ep
        assert all(ranks.run(8, _train, ("qwen3_moe",), ("dp", "pp", "ep"), (2, 2, 2),
                             dp="fsdp", timeout=2 * TIMEOUT))


@pytest.mark.parametrize("sp", moe_checks.grid([True, False], [True]))
def test_ep_with_tp_for_attention(ranks, sp):
    assert all(ranks.run(4, _train, moe_checks.grid(("mixtral", "qwen3_moe"), ("qwen3_moe",)),
                         ("ep", "tp"), (2, 2), sp=sp, timeout=TIMEOUT))


def _refused(rank, world, family, dims, shape, experts, dp):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize import ParallelizeError
    from tests.moe_models import build

    if family == "llama":
        import transformers as tf

        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=101, hidden_size=32,
                                                   num_hidden_layers=1, num_attention_heads=4,
                                                   intermediate_size=24))
    else:
        model = build(family, experts=experts)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    try:
        pyfused.parallelize(model, mesh, dp=dp)
    except ParallelizeError as e:
        return str(e)
    return None


REFUSED = {  # case: (family, dims, shape, experts, dp, text)
    "no experts": ("llama", ("ep",), (2,), 4, "ddp", "the plan names no experts module"),
    "indivisible": ("mixtral", ("ep",), (3,), 4, "ddp", "4 experts are not divisible by the "
                    "expert-"),
    "with hsdp": ("mixtral", ("dp_replicate", "dp_shard", "ep"), (1, 2, 2), 4, "hsdp",
                  "expert parallelism (ep > 1) with dp='hsdp' is not supported"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_on_every_rank(ranks, case):
    family, dims, shape, experts, dp, text = REFUSED[case]
    world = 1
    for s in shape:
        world *= s
    errors = ranks.run(world, _refused, family, dims, shape, experts, dp, timeout=TIMEOUT)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert text in errors[0], errors[0]
