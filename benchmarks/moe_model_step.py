"""The ``moe`` suite's model rows: a training step of a small Mixtral (transformers 5, random
weights) with its experts spread over the suite's group, each pyfused method against the torch
reference, in the same run.

Every rank builds the same model, feeds its own batch (expert parallelism shares ranks with data
parallelism) and replaces each experts module by ``ExpertParallelExperts(method=m)`` -- or, for the
reference, by ``TorchUserExperts`` (``moe_reference.py``: ``all_to_all_single`` with split sizes
and a loop over the local experts). A step is forward with labels, backward and an SGD update. The
replicated parameters' gradients are not averaged over the ranks: that all-reduce is the same work
in every variant and would only dilute the difference being measured. Before timing, each
variant's logits are checked against the reference's on the same batch. Rows: the median step
time, tokens/s (all ranks' tokens per second) and ``vs_torch``, the median over rounds of the
reference's time over the method's in the same round (``paired_speedup``).
"""
from __future__ import annotations

import copy
from typing import Dict, List

import torch

from pyfused.bench.harness import BenchContext, interleaved_samples, op_row
from pyfused.layers import ExpertParallelExperts
from pyfused.ops import MethodUnavailable

from .moe_reference import TorchUserExperts, rows_against_reference

VOCAB = 1024
EXPERTS_PER_RANK = 4
TOPK = 2
# (hidden, expert width, layers, batch rows, sequence); --quick: the first
MODEL_SHAPES = {"cpu": [(128, 256, 2, 2, 64), (256, 512, 2, 4, 128)],
                "cuda": [(1024, 2048, 4, 8, 1024)]}


def _mixtral(ctx: BenchContext, hidden: int, ffn: int, layers: int):
    import transformers as tf

    torch.manual_seed(0)  # the same weights on every rank
    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=EXPERTS_PER_RANK * ctx.world,
                           num_experts_per_tok=TOPK, max_position_embeddings=4096)
    return tf.MixtralForCausalLM(cfg).to(ctx.device, ctx.dtype)


def _spread(model, make) -> None:
    """Each experts module of ``model`` replaced by ``make(module)``."""
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, make(model.get_submodule(name)))


def _step(model, ids, labels):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    return run


def model_rows(ctx: BenchContext, methods, shapes=None) -> List[Dict]:
    """One row per variant and model shape (module docstring); ``shapes``: (hidden, expert width,
    layers, batch rows, sequence) tuples, default ``MODEL_SHAPES`` of the device."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return [op_row(ctx, shape="Mixtral step", dtype=ctx.dtype, method="torch",
                       transport=ctx.transport, ms=None, status="unavailable",
                       note="the model rows need transformers", suite_part="model")]
    rows: List[Dict] = []
    if shapes is None:
        shapes = MODEL_SHAPES.get(ctx.device.type, MODEL_SHAPES["cuda"])[: 1 if ctx.quick else None]
    for shape in shapes:
        rows += _shape_rows(ctx, shape, methods)
    return rows


def _shape_rows(ctx: BenchContext, shape, methods) -> List[Dict]:
    hidden, ffn, layers, batch, seq = shape
    base = _mixtral(ctx, hidden, ffn, layers)
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen).to(ctx.device)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen).to(ctx.device)
    reference = copy.deepcopy(base)
    _spread(reference, lambda m: TorchUserExperts(m, ctx.group))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    fns = {"torch": _step(reference, ids, labels)}
    unavailable = {}
    for method in methods:
        model = copy.deepcopy(base)
        try:
            _spread(model, lambda m, method=method: ExpertParallelExperts(m, ctx.group,
                                                                          method=method))
            with torch.no_grad():
                logits = model(input_ids=ids).logits
        except MethodUnavailable as e:  # raised on every rank alike
            unavailable[method] = str(e)
            continue
        torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)
        fns[method] = _step(model, ids, labels)
    samples = interleaved_samples(fns, ctx)
    tokens = batch * seq
    label = (f"Mixtral step: {layers} layers, H={hidden} F={ffn} E={EXPERTS_PER_RANK * ctx.world} "
             f"k={TOPK}, {batch}x{seq} tokens per rank")
    return rows_against_reference(ctx, samples, methods, unavailable, tokens * ctx.world,
                                  shape=label, dtype=ctx.dtype, transport=ctx.transport,
                                  suite_part="model", routing="router", tokens=tokens,
                                  hidden=hidden, ffn=ffn, experts=EXPERTS_PER_RANK * ctx.world)
