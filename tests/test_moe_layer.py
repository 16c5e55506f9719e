"""pyfused.layers.ExpertParallelExperts in real transformers models == the model run in one process.

Every rank builds the same tiny random-weight MoE model (tests/moe_models.py; 2 experts per rank),
replaces each experts module by the expert-parallel layer over all ranks, and runs its own batch
(expert parallelism shares ranks with data parallelism): logits, loss, the auxiliary
load-balancing loss and the router logits equal the single-process model's on that batch; the
replicated parameters' gradients equal the single-process gradients of that batch, and each rank's
experts' gradients the sum over every rank's batch of the single-process gradients of those
experts. Worlds 2 and 3 (4 runs through parallelize's tests); the families of a world in one rank
body, so a pool and the transformers import are paid once per world size.
"""
import pytest
import torch

from tests import moe_checks
from tests.utils import assert_close

pytest.importorskip("transformers", reason="the MoE layer tests need transformers")

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
TIMEOUT = 300


def _forward(model, ids, labels):
    routed = hasattr(model.config, "output_router_logits")
    return model(input_ids=ids, labels=labels,
                 **({"output_router_logits": True} if routed else {}))


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def _matches_single_process(rank, world, method, families):
    from pyfused.layers import ExpertParallelExperts
    from tests.moe_models import batch, build, experts_modules

    for family in families:
        experts = 2 * world
        model = build(family, experts=experts)
        for name, module in experts_modules(model).items():
            parent, _, child = name.rpartition(".")
            layer = ExpertParallelExperts(module, method=method)
            setattr(model.get_submodule(parent), child, layer)
        ids, labels = batch(seed=rank)
        out = _forward(model, ids, labels)
        out.loss.backward()
        mine = _grads(model)

        ref = build(family, experts=experts)
        totals = {}
        for source in range(world):  # the experts' gradients sum every rank's batch
            ref.zero_grad()
            ref_out = _forward(ref, *batch(seed=source))
            ref_out.loss.backward()
            for n, g in _grads(ref).items():
                totals[n] = totals.get(n, 0) + g
            if source == rank:
                own, expected = _grads(ref), ref_out
        tag = f"{family} world {world} rank {rank} {method}"
        assert_close(out.logits, expected.logits, name=f"logits {tag}")
        assert_close(out.loss, expected.loss, name=f"loss {tag}")
        if getattr(expected, "aux_loss", None) is not None:
            assert_close(out.aux_loss, expected.aux_loss, name=f"aux loss {tag}")
            for a, b in zip(out.router_logits, expected.router_logits):
                assert_close(a, b, name=f"router logits {tag}")
        rows = slice(rank * 2, rank * 2 + 2)
        for n, g in mine.items():
            if ".experts." in n:  # the experts' weights (and gpt-oss's expert biases)
                assert_close(g, totals[n][rows], name=f"grad {n} {tag}")
            else:
                assert_close(g, own[n], name=f"grad {n} {tag}")
    return True


# by default world 3 on the families whose MoE block adds to the experts (a shared expert, grouped
# routing) or whose experts differ from the default (gpt-oss); tests/test_moe_parallelize.py runs
# the layer in every family at ep=2. PYFUSED_FULL_MOE_MATRIX=1: both worlds, every family.
@pytest.mark.parametrize("world,families", moe_checks.grid(
    [(2, FAMILIES), (3, FAMILIES)], [(3, ("qwen2_moe", "deepseek_v3", "gpt_oss"))]))
def test_layer_in_models_matches_single_process(ranks, world, families):
    method = "decomposed" if world == 3 else "unfused"
    assert all(ranks.run(world, _matches_single_process, method, families, timeout=TIMEOUT))


def _refusal(rank, world, case):
    import torch.nn as nn

    from pyfused.comm import InputError, forget_seen
    from pyfused.layers import ExpertParallelExperts
    from tests.moe_models import build, experts_modules

    forget_seen()
    module = next(iter(experts_modules(build("mixtral", experts=6 if case != "indivisible" else 4)
                                       ).values()))
    if case == "not an experts module" and rank == 1:
        module = nn.Linear(4, 4)
    if case == "a gate of its own":  # a subclass that changes what each expert computes
        module.__class__ = type("SquaredGateExperts", (type(module),),
                                {"_apply_gate": lambda self, h: h.chunk(2, dim=-1)[0] ** 2})
    try:
        ExpertParallelExperts(module)
    except InputError as e:
        return str(e)
    return None


REFUSED = {
    "not an experts module": "the module passed (rank 1) is not a transformers experts module",
    "a gate of its own": "applies a gate of its own (_apply_gate)",
    "indivisible": "num_experts=4 is not divisible by the expert-parallel size 3",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_on_every_rank(ranks, case):
    errors = ranks.run(3, _refusal, case, timeout=TIMEOUT)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert errors[0].startswith("pyfused.ExpertParallelExperts: ") and REFUSED[case] in errors[0]
