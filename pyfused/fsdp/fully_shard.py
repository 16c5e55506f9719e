"""``pyfused.fully_shard``: fully sharded data parallelism (ZeRO-3) with torch FSDP2's interface.

    for block in model.layers:
        pyfused.fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    pyfused.fully_shard(model, mesh=mesh)

Each call makes ``module`` one *unit*: its parameters (those not already in a unit below it) are
sharded along dim 0 over the 1-D data-parallel ``mesh`` (None: the default group) and replaced by
``DTensor`` parameters (group.py). A 2-D ``mesh`` is HSDP's (replicate, shard): the parameters are
sharded over its shard dim and replicated across its replicate dim, and each reduce-scattered
gradient shard is all-reduced across the replicate dim (mesh.py). The module's class becomes
``FSDP<Class>`` (an ``FSDPModule``).

Schedule (hooks; the unit whose forward runs first is the root, which owns the iteration):
  * pre-forward: wait for this unit's gather (launching it if no one did), then launch the gather of
    the unit that ran after it in the previous forward (registration order the first time) -- an
    asynchronous collective (gloo's threads on CPU, NCCL's stream on GPU) that runs while this
    unit computes. Inputs that need a gradient pass through ``_PostBackward``.
  * post-forward: free the gathered parameters (``reshard_after_forward``; never the root's, which
    backward needs at once), and hook the outputs so that backward reaching them runs pre-backward.
  * pre-backward: gather again (waiting for the prefetch), and prefetch the unit whose forward
    finished just before this one's (for the root, whose forward finishes last: the last block).
  * post-backward (``_PostBackward.backward``: gradients have reached the unit's inputs, so its
    parameters' gradients are complete): launch the reduce-scatter of its gradients, free the
    gathered parameters and gradients, and advance the reductions launched before: the previous
    unit's reduce-scatter is finished (HSDP: its all-reduce across replicas launched, which the
    next unit's post-backward finishes).
  * end of backward (an autograd engine callback): units whose post-backward did not run (inputs
    without gradient, such as the root's token ids) reduce now; all reduce-scatters are waited for
    and the sharded ``.grad`` written, so ``optimizer.step()`` sees finished gradients.

Gradient accumulation: ``set_requires_gradient_sync(False)`` (or ``with no_sync(model)``) keeps
the gathered parameters and accumulates unsharded gradients across micro-steps -- nothing is
resharded or reduced -- and the next synchronising backward reduce-scatters their sum once. As in
FSDP2, the sum is kept in the reduce dtype when it differs from the compute dtype: each backward's
gradient is cast and added when the unit's backward (or the whole backward) ends. A
unit's forward and backward calls are counted from the end of its last synchronising backward, so
the micro-steps' forwards and backwards may interleave (a pipeline schedule's 1F1B): the
synchronising backward reduces a unit when its backward calls have caught up with all of them.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from . import checks, mesh as mesh_mod
from .group import SHARDED, UNSHARDED, ParamGroup, ShardedParam, set_param

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy
except ImportError:  # pragma: no cover
    MixedPrecisionPolicy = None


class ShardOwner:
    """What ``pyfused.clip_grad_norm_`` asks of sharded parameters' owner: the local pieces of their
    gradients and the group to sum the norm over. One per process group."""

    def __init__(self, pg, world: int, device: torch.device):
        self.pg, self.world, self.device = pg, world, device
        self.index: Dict[int, int] = {}
        self._params: List[weakref.ref] = []  # weak: the parameters hold their owner

    def __deepcopy__(self, memo):  # a copied parameter keeps its owner, as it keeps its group
        return self

    def add(self, param: nn.Parameter) -> None:
        self.index[id(param)] = len(self._params)
        self._params.append(weakref.ref(param))
        param._pyfused_shard_owner = self  # the parameters keep their owner (and its group) alive

    def shard_grads(self, indices) -> List[torch.Tensor]:
        params = (self._params[i]() for i in sorted(indices))
        return [p.grad._local_tensor for p in params if p is not None and p.grad is not None]


# One owner per (group, device), while parameters it serves live: a destroyed process group is not
# held here past its models.
_owners: "weakref.WeakValueDictionary[tuple, ShardOwner]" = weakref.WeakValueDictionary()


class Tree:
    """The iteration state shared by the units under one root."""

    def __init__(self, root: "Unit", units: List["Unit"]):
        self.root = root
        self.units = units
        self.order: List[Unit] = []          # this forward's units, in the order they started
        self.post_order: List[Unit] = []     # ... in the order they finished (backward reverses it)
        self.last_order: List[Unit] = units  # the previous forward's (prefetch follows it)
        self.pending: List[tuple] = []       # reductions in flight: (unit, group.Reduction)
        self.callback_queued = False
        self.peak_gathered = 0                # bytes, for tests and the benchmark

    def next_after(self, unit: "Unit", step: int) -> Optional["Unit"]:
        """step 1: the unit to prefetch in forward (the previous forward's order); step -1: in
        backward (the unit that finished its forward just before ``unit``)."""
        order = self.last_order if step > 0 else self.post_order
        try:
            i = order.index(unit) + step
        except ValueError:
            return None
        return order[i] if 0 <= i < len(order) else None

    def note_gathered(self) -> None:
        self.peak_gathered = max(self.peak_gathered, sum(u.group.gathered_bytes() for u in self.units))

    def begin_forward(self) -> None:
        for u in self.units:
            if u.group.state != SHARDED and u.group.state != UNSHARDED:
                u.group.finish_gather()  # a prefetch this forward may not use
            if u.sync:  # a unit accumulating gradients keeps counting until its sync backward
                u.forward_calls = u.backward_calls = 0
        if self.order:
            self.last_order = self.order
        self.order, self.post_order = [], []

    def end_backward(self) -> None:
        """After a backward: a synchronising one reduces the units whose post-backward did not
        run (inputs without gradient) and closes their accumulation window; an accumulating one
        leaves the counts alone, so that the window's forwards are all matched at its sync."""
        self.callback_queued = False
        for u in self.units:
            if not u.sync:  # the units whose post-backward did not run (the root of token ids)
                u.group.accumulate_grads()
        for u in reversed(self.order):
            if u.sync and u.backward_calls < u.forward_calls:
                u.post_backward(final=True)
        for u, reduction in self.pending:
            u.group.finish_reduce(reduction)
        self.pending = []
        for u in self.units:
            if u.sync:
                if u.reshard_after_backward:
                    u.group.reshard()
                u.forward_calls = u.backward_calls = 0


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients exist, i.e. once the
    unit's own backward has finished."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None, *grads)


class Unit:
    """The hooks of one ``fully_shard``-ed module around its ``ParamGroup``."""

    def __init__(self, module: nn.Module, group: ParamGroup, reshard_after_forward: Optional[bool],
                 mp_policy):
        self.module = module
        self.group = group
        # None: FSDP2's default, True except for the root (set in _lazy_init)
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.reshard_after_backward = True
        self.sync = True
        self.mp = mp_policy
        self.tree: Optional[Tree] = None
        self.forward_calls = self.backward_calls = 0
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward, always_call=False)

    @property
    def is_root(self) -> bool:
        return self.tree is not None and self.tree.root is self

    def _lazy_init(self) -> None:
        units = [m._pyfused_fsdp for m in self.module.modules() if isinstance(m, FSDPModule)]
        tree = Tree(self, units)
        for u in units:
            u.tree = tree
        self.reshard_after_forward = False  # backward needs the root's parameters at once

    def _pre_forward(self, module, args, kwargs):
        if self.tree is None:
            self._lazy_init()
        tree = self.tree
        if self.is_root:
            tree.begin_forward()
        if self not in tree.order:
            tree.order.append(self)
        self.group.finish_gather()
        nxt = tree.next_after(self, 1)
        if nxt is not None:
            nxt.group.start_gather()
        tree.note_gathered()
        if torch.is_grad_enabled():
            self.forward_calls += 1
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if idx:
                outs = _PostBackward.apply(self, *[flat[i] for i in idx])
                for i, t in zip(idx, outs):
                    flat[i] = t
                args, kwargs = spec.unflatten(flat)
        if self.mp is not None and self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def _post_forward(self, module, args, output):
        grad = torch.is_grad_enabled()
        # without grad (eval) every unit, the root too, is done with its parameters; in training
        # the root keeps them for backward and no_sync micro-steps keep everything gathered
        if not grad or (self.sync and self.reshard_after_forward and not self.is_root):
            self.group.reshard()
        if grad:
            if self not in self.tree.post_order:
                self.tree.post_order.append(self)
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        if self.mp is not None and self.mp.output_dtype is not None:
            output = _cast_floats(output, self.mp.output_dtype)
        return output

    def _pre_backward(self, _grad) -> None:
        tree = self.tree
        if not tree.callback_queued:
            tree.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(tree.end_backward)
        self.group.finish_gather()
        prev = tree.next_after(self, -1)
        if prev is not None:
            prev.group.start_gather()
        tree.note_gathered()

    def post_backward(self, final: bool = False) -> None:
        self.backward_calls += 1
        if not self.sync:  # this backward's gradients join the micro-steps' sum (group.py)
            self.group.accumulate_grads()
        if self.backward_calls < self.forward_calls and not final:
            return  # the module ran several times in forward; wait for its last backward
        self.backward_calls = self.forward_calls
        if not self.sync:
            return
        if self.group.state != UNSHARDED:
            return  # never gathered for this backward: no gradient can exist
        reduction = self.group.start_reduce()
        if self.reshard_after_backward:
            self.group.reshard()
        tree = self.tree
        # the earlier reductions had this unit's whole backward to run: one stage on each
        tree.pending = [(u, r) for u, r in tree.pending if not u.group.advance_reduce(r)]
        tree.pending.append((self, reduction))


def _cast_floats(tree, dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, tree)


class FSDPModule:
    """Mixed into a ``fully_shard``-ed module's class: torch FSDP2's per-module controls."""

    def _units(self, recurse: bool):
        mods = self.modules() if recurse else [self]
        return [m._pyfused_fsdp for m in mods if isinstance(m, FSDPModule)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """False: backward accumulates unsharded gradients and keeps parameters gathered; the next
        backward with True reduce-scatters the accumulated sum once. With HSDP this switches the
        all-reduce across replicas too, as FSDP2's does."""
        for u in self._units(recurse):
            u.sync = bool(requires_gradient_sync)
            u.group.all_reduce = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True):
        """HSDP: False reduce-scatters each backward's gradients within the shard group but keeps
        the shards, not all-reduced across replicas; the next backward with True adds them before
        its all-reduce (FSDP2's accumulation with reduce-scatter only). No effect with a 1-D mesh."""
        for u in self._units(recurse):
            u.group.all_reduce = bool(requires_all_reduce)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        for u in self._units(recurse):
            u.reshard_after_backward = bool(reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True):
        for u in self._units(recurse):
            if not u.is_root:
                u.reshard_after_forward = bool(reshard_after_forward)

    def unshard(self, async_op: bool = False):
        """Gather this unit's parameters; ``async_op=True`` only launches the gather."""
        unit = self._pyfused_fsdp
        unit.group.start_gather()
        if not async_op:
            unit.group.finish_gather()

    def reshard(self):
        self._pyfused_fsdp.group.reshard()

    def gathered_bytes_peak(self) -> int:
        """The most bytes of gathered parameters held at once in this tree (since the last reset)."""
        tree = self._pyfused_fsdp.tree
        return tree.peak_gathered if tree is not None else 0


@contextlib.contextmanager
def no_sync(module: FSDPModule):
    """``set_requires_gradient_sync(False)`` for the body, as DDP's ``no_sync()``."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


_classes: Dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _classes[cls]


def _unit_params(module: nn.Module):
    """{id: (param, [(owner module, attribute name)], qualified name)} of the parameters in
    ``module``'s tree outside units below it, in registration order."""
    found: Dict[int, tuple] = {}

    def visit(m: nn.Module, prefix: str):
        for name, p in m._parameters.items():
            if p is None:
                continue
            entry = found.setdefault(id(p), (p, [], prefix + name))
            entry[1].append((m, name))
        for name, child in m._modules.items():
            if child is not None and not isinstance(child, FSDPModule):
                visit(child, prefix + name + ".")

    visit(module, "")
    return list(found.values())


def _dtype_code(dtype) -> int:
    table = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)
    return table.index(dtype) if dtype in table else -1


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: Optional[bool] = True,
                mp_policy=None) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` (None: the default group; a 1-D DeviceMesh; or
    HSDP's 2-D (replicate, shard) DeviceMesh) and install the gather / reduce-scatter hooks (module
    docstring). Returns ``module`` (its class is now an ``FSDPModule``)."""
    if isinstance(module, FSDPModule):
        raise ValueError("pyfused.fully_shard: this module is already sharded")
    entries = _unit_params(module)
    device = entries[0][0].device if entries else torch.device("cpu")
    sm = mesh_mod.resolve(mesh, device)
    pg, world = sm.shard_pg, sm.shards
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
    valid = reshard_after_forward in (None, True, False) and -1 not in (
        _dtype_code(param_dtype), _dtype_code(reduce_dtype))
    options = (2 if reshard_after_forward is None else int(bool(reshard_after_forward)),
               _dtype_code(param_dtype), _dtype_code(reduce_dtype))
    checks.agree_unit(sm, [(name, p) for p, _, name in entries], options,
                      mixed_dtypes_ok=param_dtype is not None, options_ok=valid)
    mesh_mod.host_warning(sm)

    key = (pg, device)
    owner = _owners.get(key)
    if owner is None:
        owner = _owners[key] = ShardOwner(pg, world, device)
    params = []
    for p, owners, _ in entries:
        compute = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
        sp = ShardedParam(owners, p, sm.mesh, sm.shard_rank, world, compute, sm.placements)
        for m, name in owners:
            set_param(m, name, sp.sharded)
        owner.add(sp.sharded)
        params.append(sp)
    compute_dtype = param_dtype or (params[0].local.dtype if params else torch.float32)
    group = ParamGroup(params, pg, world, compute_dtype, reduce_dtype or compute_dtype, device,
                       sm.replicate_pg, sm.replicas)
    module.__class__ = _fsdp_class(type(module))
    module._pyfused_fsdp = Unit(module, group, reshard_after_forward, mp_policy)
    return module
