"""Split backward for any ``nn.Module`` stage: B (input gradients) now, W (weight gradients) later.

A stage's autograd graph runs from its outputs (or loss) down to two kinds of leaves: the stage
inputs (received activations) and the parameters. Call a graph node an *input node* when a stage
input is reachable from it: those are exactly the nodes B must run to produce the input gradients.
Every other node reachable from the outputs leads only to parameters (a node that reached an input
node would itself be one), so W can run it later without touching the input path.

B (``backward_input``):
  * finds the *frontier*: input nodes with an edge to a node that leads to a parameter, and the
    output nodes that are not input nodes at all (the whole graph of a stage whose inputs need no
    gradient, e.g. the first). A fused op such as ``addmm`` is one node that produces both the
    input gradient and the weight gradient; it is an input node on the frontier;
  * registers a pre-hook on each frontier input node that keeps the gradient flowing into it,
    then runs ``torch.autograd.grad(outputs, inputs, retain_graph=True)``. The engine executes only
    what the inputs need, and a node computes only the outputs whose edges lead there, so no
    weight-gradient product is formed (``addmm`` computes ``grad @ W`` and skips ``x.T @ grad``).
W (``backward_weight``):
  * for each frontier node, one ``torch.autograd.backward`` from that node (``GradientEdge``) with
    the kept gradient, into the parameters reachable from it without passing another input node. The
    node runs a second time with the other half of its outputs requested (``addmm``: only
    ``x.T @ grad``). Every path from an output to a parameter leaves the input path at exactly one
    frontier node (its last input node), so summing the per-node results counts each path once and
    the sum equals the unsplit backward's ``.grad``.
  * a parameter reachable both through a frontier node's own branch and through that node's input
    path (a weight shared between layers of one stage) would be reached twice from one call; such
    frontier nodes are run together in one call whose pre-hooks replace the gradient reaching each of
    them by the kept one (correct, at the cost of re-running the input path between them).
  * with ``fuse=True`` (a stage's default) each call other than those grouped ones accumulates
    its linear layers' weight gradients inside their GEMMs, planned over the nodes the call runs
    (weight_accumulation.py).

Memory: between B and W the microbatch's graph is kept (``retain_graph=True``): the saved tensors
W needs (a Linear's input) and those of nodes only B needed, which autograd cannot free one by
one; the schedule bounds how many microbatches wait for their W. The stage outputs are dropped after
B. After W nothing of the microbatch remains (W calls also retain the graph, because two frontier
nodes may share a weight-only node; the graph is freed when the last reference goes).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node

from . import weight_accumulation
from .weight_accumulation import children, leads_to, reachable


def _node(t: torch.Tensor) -> Optional[Node]:
    """The graph node a tensor's gradient enters: its grad_fn, or a leaf's AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


class WeightWork:
    """What B keeps for W: the frontier nodes, the gradients flowing into them, the parameters."""

    __slots__ = ("calls",)

    def __init__(self, calls):
        # [(edges, grads, params, clamp, region)]: one engine call each; region: the nodes
        # it runs when its weight gradients are fused (weight_accumulation.py), else None
        self.calls = calls


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                   fuse: bool = False) -> Tuple[Tuple[Optional[torch.Tensor], ...], WeightWork]:
    """B of one microbatch. Returns the gradient of each input (None where it needs none or is
    unused) and the work W must do."""
    pairs = [(o, g if g is not None else torch.ones_like(o))
             for o, g in zip(outputs, output_grads) if o.requires_grad]
    roots = [_node(o) for o, _ in pairs]
    graph = reachable(roots)
    input_nodes = leads_to(graph, {n for n in map(_node, inputs) if n is not None})
    param_nodes = {_node(p): p for p in params if p.requires_grad}
    weighty = leads_to(graph, set(param_nodes)) - input_nodes
    frontier = [n for n in graph if n in input_nodes and any(c in weighty for c in children(n))]
    kept: Dict[Node, Tuple] = {}
    handles = [n.register_prehook(lambda grads, n=n: kept.__setitem__(n, grads)) for n in frontier]
    wanted = [x for x in inputs if x.requires_grad and _node(x) in input_nodes]
    try:
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                  retain_graph=True, allow_unused=True) if wanted else ()
    finally:
        for h in handles:
            h.remove()
    by_input = dict(zip(map(id, wanted), got))
    input_grads = tuple(by_input.get(id(x)) for x in inputs)
    # Output nodes outside the input path: W starts there with the output gradients themselves.
    root_grads: Dict[Node, List] = {}
    for (o, g), node in zip(pairs, roots):
        if node in weighty:
            slot = root_grads.setdefault(node, [None] * _n_outputs(node))
            nr = o.output_nr if o.grad_fn is not None else 0
            slot[nr] = g if slot[nr] is None else slot[nr] + g
    starts = {n: kept[n] for n in frontier if n in kept}
    starts.update({n: tuple(g) for n, g in root_grads.items()})
    return input_grads, _plan_weight_calls(starts, input_nodes, weighty, param_nodes, fuse)


def _n_outputs(node: Node) -> int:
    """How many gradients flow into ``node`` (its forward outputs)."""
    return len(node._input_metadata)


def _plan_weight_calls(starts: Dict[Node, Tuple], input_nodes: Set[Node], weighty: Set[Node],
                       param_nodes: Dict[Node, torch.Tensor], fuse: bool) -> WeightWork:
    own: Dict[Node, Set[Node]] = {}   # params reachable through weight-only nodes
    region: Dict[Node, List[Node]] = {}  # the nodes a call from n runs
    for n in starts:
        first = [c for c in children(n) if c in weighty] if n in input_nodes else [n]
        region[n] = reachable(first) + ([n] if n in input_nodes else [])
        own[n] = {x for x in region[n] if x in param_nodes}
    deep: Dict[Node, Set[Node]] = {}  # params reachable through a node's input path
    for n in starts:
        below = [c for c in children(n) if c in input_nodes]
        deep[n] = {x for x in reachable(below) if x in param_nodes} if below else set()
    # Frontier nodes whose own parameters are also reached through their input path share a call
    # with every frontier node holding those parameters.
    group = {n: n for n in starts}

    def find(n):
        while group[n] is not n:
            group[n] = group[group[n]]
            n = group[n]
        return n

    holders: Dict[Node, List[Node]] = defaultdict(list)
    for n, ps in own.items():
        for x in ps:
            holders[x].append(n)
    for n in starts:
        for x in own[n] & deep[n]:
            for other in holders[x]:
                group[find(other)] = find(n)
    members: Dict[Node, List[Node]] = defaultdict(list)
    for n in starts:
        members[find(n)].append(n)
    calls = []
    for nodes in members.values():
        edges, grads = [], []
        for n in nodes:
            for i, g in enumerate(starts[n]):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(g)
        params = set().union(*(own[n] for n in nodes))
        if edges and params:
            clamp = {n: starts[n] for n in nodes} if len(nodes) > 1 else {}
            nodes_run = region[nodes[0]] if fuse and not clamp else None
            calls.append((edges, grads, [param_nodes[x] for x in params], clamp, nodes_run))
    return WeightWork(calls)


def backward_weight(work: WeightWork) -> None:
    """W of one microbatch: accumulate each parameter's gradient into ``.grad``. ``backward`` with
    ``inputs=`` accumulates like the unsplit backward does (a parameter's first gradient becomes its
    ``.grad`` without a copy, later ones are added in place, with ``.grad``'s usual layout)."""
    for edges, grads, params, clamp, region in work.calls:
        if region is not None:
            weight_accumulation.backward_from(edges, grads, region, params)
            continue
        handles = [n.register_prehook(lambda _, g=g: g) for n, g in clamp.items()]
        try:
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
        finally:
            for h in handles:
                h.remove()
    work.calls = []
