"""Gradient-accumulation fusion (pyfused/pipeline/weight_accumulation.py).

Over three microbatches the fused backward, whole and split into B and W, gives autograd's
gradients; the weights it fuses are exactly the linear ones without hooks, and their gradients are
formed by one ``addmm_`` into ``.grad`` (counted with a dispatch mode), never by a separate product
and add; every other weight is left to autograd, its hooks fire, and a stage logs why it was not
fused.
"""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pyfused.pipeline import PipelineStage, weight_accumulation as wa
from pyfused.pipeline.split_backward import backward_input, backward_weight
from tests.utils import assert_close

MICROBATCHES = 3


class Tied(nn.Module):
    """One Linear applied twice: two linear nodes, one weight."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x):
        return self.a(torch.tanh(self.a(x)))


class TiedEmbedding(nn.Module):
    """A head sharing the embedding's weight (as language models tie them): that weight's
    gradient also comes from the embedding, so it stays with autograd."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        tokens = (x.detach().abs().sum(-1) * 5).long() % 9
        return self.head(torch.relu(self.mid(self.emb(tokens) + x)))


class Explicit(nn.Module):
    """``x @ w.t()`` and ``addmm`` with alpha != 1 written out, no nn.Linear."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(7, 6) / 3)
        self.w2 = nn.Parameter(torch.randn(5, 7) / 3)
        self.b2 = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return torch.addmm(self.b2, torch.tanh(x @ self.w1.t()), self.w2.t(), alpha=0.5)


class Hooked(nn.Module):
    """A weight with a gradient hook (how data-parallel reducers learn a gradient is ready)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 5)
        self.seen = 0
        self.b.weight.register_post_accumulate_grad_hook(lambda p: setattr(self, "seen", self.seen + 1))

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


class Autocast(nn.Module):
    """bf16 autocast casts the weight first: no linear node sees the fp32 weight itself."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.a(x).float()


# name -> (module, input shape, fused weights with an input that needs a gradient, without one)
CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 5), nn.LayerNorm(5)),
            (4, 6), {"0.weight", "2.weight"}, {"0.weight", "2.weight"}),
    # a 3-D input and no bias: without an input gradient the first layer would not run at all
    "no_bias_3d": (lambda: nn.Sequential(nn.Linear(6, 7, bias=False), nn.GELU(),
                                         nn.Linear(7, 5, bias=False)),
                   (2, 3, 6), {"0.weight", "2.weight"}, {"2.weight"}),
    "tied": (Tied, (4, 6), {"a.weight"}, {"a.weight"}),
    "tied_embedding": (TiedEmbedding, (4, 6), {"mid.weight"}, {"mid.weight"}),
    "explicit": (Explicit, (4, 6), {"w1", "w2"}, {"w2"}),
    "hooked": (Hooked, (4, 6), {"a.weight"}, {"a.weight"}),
    "autocast": (Autocast, (4, 6), set(), set()),
}


def _fused_names(mod, out) -> set:
    fusion = wa.plan(wa.reachable([out.grad_fn]))
    ids = {id(w) for _, w in fusion.linear.values()}
    return {n for n, p in mod.named_parameters() if id(p) in ids}


class _CountGradOps(TorchDispatchMode):
    """Counts, per weight, the products written into its ``.grad`` and the adds into it."""

    def __init__(self, weights):
        super().__init__()
        self.grads = weights
        self.addmm_into = 0
        self.add_into = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if isinstance(target, torch.Tensor):
            for w in self.grads:
                if w.grad is not None and target.data_ptr() == w.grad.data_ptr():
                    if func is torch.ops.aten.addmm_.default:
                        self.addmm_into += 1
                    elif func is torch.ops.aten.add_.Tensor:
                        self.add_into += 1
        return func(*args, **(kwargs or {}))


def _run(mod, xs, needs_input_grad, how):
    """Backward of every microbatch; returns the input gradients."""
    params = [p for p in mod.parameters() if p.requires_grad]
    out_grads = []
    for x in xs:
        xi = x.clone().requires_grad_(needs_input_grad)
        out = mod(xi)
        g = torch.ones_like(out) * torch.linspace(0.5, 1.5, out.shape[-1])
        if how == "autograd":
            torch.autograd.backward([out], [g])
        elif how == "fused":
            wa.backward([out], [g])
        else:  # split: B, then W
            (gx,), work = backward_input([out], [g], [xi], params, fuse=True)
            backward_weight(work)
            out_grads.append(gx)
            continue
        out_grads.append(xi.grad)
    return out_grads


@pytest.mark.parametrize("needs_input_grad", [True, False], ids=["middle", "first"])
@pytest.mark.parametrize("how", ["fused", "split"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_accumulation_equals_autograd(case, how, needs_input_grad):
    make, shape, fused_middle, fused_first = CASES[case]
    torch.manual_seed(0)
    mod = make()
    torch.manual_seed(0)
    ref = make()  # built again, not copied: a copy's hooks would count on the original
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(*shape, generator=gen) for _ in range(MICROBATCHES)]
    expected = fused_middle if needs_input_grad else fused_first
    probe = mod(xs[0].clone().requires_grad_(needs_input_grad))
    assert _fused_names(mod, probe) == expected
    del probe
    got = _run(mod, xs, needs_input_grad, how)
    want = _run(ref, xs, needs_input_grad, "autograd")
    for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, name=f"{case}/{how}: grad of {name}")
    for k, (a, b) in enumerate(zip(got, want)):
        if needs_input_grad:
            assert_close(a, b, name=f"{case}/{how}: input grad of microbatch {k}")
        else:
            assert a is None and b is None
    if case == "hooked":  # left to autograd: its hook fired once per microbatch
        assert mod.seen == ref.seen == MICROBATCHES


@pytest.mark.parametrize("how", ["fused", "split"])
def test_fused_weights_take_one_addmm_into_grad(how):
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 5))
    weights = [mod[0].weight, mod[2].weight]
    xs = [torch.randn(4, 6) for _ in range(MICROBATCHES)]
    _run(mod, xs[:1], True, how)  # the first microbatch makes .grad
    grads = [w.grad for w in weights]
    counter = _CountGradOps(weights)
    with counter:
        _run(mod, xs[1:], True, how)
    assert all(w.grad is g for w, g in zip(weights, grads)), ".grad was replaced"
    assert counter.addmm_into == len(weights) * (MICROBATCHES - 1)
    assert counter.add_into == 0, "a weight product was formed and then added"


def test_plain_backward_forms_and_adds(how="autograd"):
    """The counter above sees autograd's own path: it is not blind to a formed-then-added
    gradient."""
    mod = nn.Sequential(nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 5))
    xs = [torch.randn(4, 6) for _ in range(MICROBATCHES)]
    _run(mod, xs[:1], True, how)
    counter = _CountGradOps([mod[0].weight, mod[2].weight])
    with counter:
        _run(mod, xs[1:], True, how)
    assert counter.addmm_into == 0 and counter.add_into == 2 * (MICROBATCHES - 1)


def test_stage_logs_what_it_fuses_and_why_not(caplog):
    mod = TiedEmbedding()
    mod.mid.weight.register_hook(lambda g: g)
    stage = PipelineStage(mod, 1, 3, "cpu")
    with caplog.at_level(logging.DEBUG, logger="pyfused"):
        stage._report_fusion([mod(torch.randn(4, 6, requires_grad=True))])
    text = caplog.text
    assert "0 of its parameters" in text
    assert "emb.weight: not fused, it is also used outside a linear layer (EmbeddingBackward0)" in text
    assert "mid.weight: not fused, it has a gradient hook" in text
    off = PipelineStage(nn.Linear(6, 6), 1, 3, "cpu", gradient_accumulation_fusion=False)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="pyfused"):
        off._backward([off.submod(torch.randn(2, 6)).sum()], [None])
    assert "accumulate" not in caplog.text
    assert off.submod.weight.grad is not None
