"""The gradient reducer: bucketed, overlapped averaging of gradients over a process group.

Design (after torch DDP's C++ reducer; see docs/DDP.md):

* Every trainable parameter has a post-accumulate-grad hook. A synchronising forward (grad mode on,
  not inside ``no_sync``) arms the hooks; the first hook of the backward (or a hook on the forward's
  outputs, whichever fires first) queues ``_finalize`` to run when the autograd engine finishes.
* A hook marks its parameter ready; when a bucket has no pending parameter it is *ready*. Buckets
  are launched strictly in index order (a ready bucket waits for the ones before it), so that every
  rank issues the same collectives in the same order whatever order its gradients arrive in.
* Launching a bucket: on the comm stream (after it waited for the compute stream), gather the
  bucket's gradients into one buffer, multiplied by 1/world and cast to ``comm_dtype`` (one Triton
  launch on CUDA; on CPU each gradient was already multiplied into its slot by its own hook), then
  start an asynchronous all-reduce -- or, with a sharded optimizer, a reduce-scatter into this
  rank's shard; the full gradients are released once copied. Backward continues while the
  collective runs. With the host-aware all-reduce (pyfused/dp/reduction.py) a bucket's reduction
  is three collectives (inside the host, across hosts, inside the host); each bucket launch first
  moves the earlier buckets' reductions one collective on (``PipelinedHostAllReduce``), so every
  group sees the same order on every rank, and the end of backward completes them in order.
* In-place buckets (CPU, ``in_place_bytes``): a gradient of at least 1 MiB has a bucket of its
  own, and its collective runs on ``.grad`` itself, multiplied by 1/world in place first: no copy
  into a bucket and none back. On CPU those two copies cost more than the extra collective's
  launch (docs/DDP.md, "In-place gradients", has the figures).
* ``_finalize`` (end of backward): launches whatever is left in order (gradients that never arrived
  count as zeros, so the ranks' collectives still match), waits for the outstanding collectives and
  writes the averages back into ``.grad`` (or hands shards to the sharded optimizer). A small status
  vector (missing gradients, hooks fired twice, "used" flags) is all-reduced asynchronously right
  after the last bucket's launch -- when every parameter is ready, so the status is complete -- and
  read here. Problems are raised here, with the same message on every rank, after the group is
  back in a consistent state -- never as a hang. On a CPU backend each of these waits is bounded by
  the group's timeout counted from the wait (``comm.faults.transfer_timeout``, read once per
  backward), as NCCL's watchdog times a collective from its launch: gloo starts a collective's
  own clock only when a worker thread picks it up, so one queued behind buckets that a peer
  joined late would otherwise time out that much later.

Unused parameters. With ``find_unused_parameters=True`` the forward's autograd graph is walked from
its outputs; parameters it does not reach are marked ready when backward starts (their bucket slots
hold zeros, or a stale ``.grad`` as torch DDP does) and a parameter reached but never hooked is
treated the same way at the end. The per-parameter "locally used" flags are summed over the group:
a parameter unused on every rank keeps its ``.grad`` untouched (None stays None), one used on some
rank receives the average. With ``find_unused_parameters=False`` a parameter without a gradient is
an error (torch DDP's, raised on every rank); the status vector that detects it on every rank costs
one tiny all-reduce per step and is skipped with ``pyfused.comm.set_validation(False)``.

Bucket rebuild (torch DDP's, once). The first buckets follow reverse registration order, a guess at
the order backward produces gradients. The first synchronising backward records the order the
gradients actually became ready; at its end rank 0's order is broadcast and, if it differs, the
buckets are rebuilt from it (same caps), so that later backwards fill bucket 0 first and its
reduction starts as early as it can. As in torch, not with ``find_unused_parameters`` (the set of
used parameters, hence the order, may change between iterations) -- and not with a sharded
optimizer, whose state is laid out by bucket.
"""
from __future__ import annotations

import datetime
import logging
import weakref
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_leaves

from .. import comm
from .._logging import logger
from ..comm import InputError
from ..comm.faults import transfer_timeout
from ..comm.hierarchical import HostAllReduce, PipelinedHostAllReduce
from . import bucket_copy, buckets as _buckets, shard_comm
from .buckets import Bucket
from .status import StatusExchange

# What a failed collective of the backward's reduction is reported as (pyfused.comm.faults).
FINALIZE = "DistributedDataParallel backward (gradient bucket reduction)"
# From this size on a CPU gradient is reduced in place (module docstring).
IN_PLACE_BYTES_CPU = 1 << 20


def in_place_bytes(device: torch.device, *, comm_dtype: Optional[torch.dtype], find_unused: bool,
                   as_view: bool, sharded: bool, hierarchical: bool) -> Optional[int]:
    """The size from which a gradient is reduced in place (its own bucket, the collective on
    ``.grad`` itself), or None where every gradient goes through a bucket buffer.

    Only on CPU: there a copy into the bucket and back costs more than one more collective's
    launch; on a GPU the copies are cheap against a collective's latency. Not with a comm dtype
    (the bucket casts), ``find_unused_parameters`` (a parameter unused on every rank keeps its
    ``.grad`` untouched), gradient views (the bucket is the gradient already), a sharded optimizer
    (reduce-scatter into a shard) or the host-aware all-reduce (pieces of a padded buffer)."""
    if device.type != "cpu" or comm_dtype is not None or find_unused or as_view or sharded \
            or hierarchical:
        return None
    return IN_PLACE_BYTES_CPU


class Reducer:
    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 buckets: List[Bucket], pg, device: torch.device, *, comm_dtype: Optional[torch.dtype],
                 find_unused: bool, as_view: bool, sharded: bool,
                 host_reduce: Optional[HostAllReduce] = None, in_place_bytes: Optional[int] = None):
        self.params = list(params)
        self.names = list(names)
        self.buckets = buckets
        self.pg = pg
        self.world = comm.world_size(pg)
        self.rank = comm.rank(pg)
        self.device = device
        self.comm_dtype = comm_dtype
        self.find_unused = find_unused
        self.as_view = as_view and not sharded
        self.sharded = sharded
        self.scale = 1.0 / self.world
        # the host-aware all-reduce of unsharded buckets; None: one all-reduce over pg per bucket
        self.host_reduce = (PipelinedHostAllReduce(host_reduce)
                            if host_reduce is not None and not sharded and pg is not None else None)
        self.pad_multiple = host_reduce.ranks_per_host if self.host_reduce is not None else 1
        self.in_place_bytes = in_place_bytes  # the assignment's ``own_bytes`` (buckets.py)
        n = len(self.params)
        self._index_slots()
        self.on_shard_reduced: Optional[Callable[[Bucket, set], None]] = None  # set by ShardedState
        self.on_bucket_launched: Optional[Callable[[Bucket], None]] = None
        self.on_all_reduced: Optional[Callable[[], None]] = None  # set by ShardedState
        use_kernel, why = bucket_copy.kernel_available(device, [b.dtype for b in buckets])
        if not use_kernel:
            level = logging.INFO if device.type == "cuda" else logging.DEBUG
            logger.log(level, "pyfused DDP: bucket copies take the torch path (%s)", why)
        self._use_kernel = use_kernel
        self._interpret = why == "interpret"
        self._allocate()
        self.status = StatusExchange(pg, self.names, find_unused)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self.params)]
        self.expect_hooks = False
        self.in_backward = False
        # "used" flags accumulate over no_sync iterations until the next synchronising backward
        # (torch DDP's rule): a parameter used only in an earlier micro-batch still counts as used.
        self.used = bytearray(n)
        self.rebuild_caps: Optional[tuple] = None  # (cap, first cap) bytes: set by enable_rebuild
        self.observed: List[int] = []  # the order gradients became ready, until the rebuild
        self._reset()

    def enable_rebuild(self, cap_bytes: int, first_cap_bytes: int) -> None:
        """Rebuild the buckets once, from the gradient order of the first synchronising backward."""
        if self.find_unused or self.sharded:
            logger.debug("pyfused DDP: buckets are not rebuilt from the observed gradient order (%s)",
                         "find_unused_parameters=True" if self.find_unused else "sharded optimizer")
            return
        self.rebuild_caps = (cap_bytes, first_cap_bytes)

    def _index_slots(self) -> None:
        """``loc``: parameter index -> (its bucket, the position of its slot in the bucket)."""
        self.loc = [None] * len(self.params)
        for b in self.buckets:
            for k, s in enumerate(b.slots):
                self.loc[s.param] = (b, k)

    # ----------------------------------------------------------------------------- buffers
    def _comm_dtype_of(self, b: Bucket) -> torch.dtype:
        return self.comm_dtype or b.dtype

    def _allocate(self) -> None:
        dev = self.device
        for b in self.buckets:
            cdt = self._comm_dtype_of(b)
            b.extra["in_place"] = (self.in_place_bytes is not None and len(b.slots) == 1
                                   and b.numel * b.dtype.itemsize >= self.in_place_bytes)
            if b.extra["in_place"]:
                continue  # the gradient is the buffer
            if self.sharded:
                b.extra["shard_out"] = torch.zeros(b.shard, dtype=cdt, device=dev)
            elif self.as_view:
                grad_buf = torch.zeros(b.padded, dtype=b.dtype, device=dev)
                b.extra["grad_buf"] = grad_buf
                b.extra["views"] = [grad_buf[s.offset:s.offset + s.numel].view(s.shape)
                                    for s in b.slots]
                b.extra["comm_buf"] = (grad_buf if cdt == b.dtype
                                       else torch.zeros(b.padded, dtype=cdt, device=dev))
            else:
                b.extra["comm_buf"] = torch.zeros(b.padded, dtype=cdt, device=dev)
            if self.host_reduce is not None:
                b.extra["piece"] = torch.empty(b.padded // self.pad_multiple, dtype=cdt, device=dev)
            if self._use_kernel:
                b.extra["plan"] = bucket_copy.CopyPlan([s.numel for s in b.slots], dev,
                                                       max(b.dtype.itemsize, cdt.itemsize),
                                                       interpret=self._interpret)

    # ----------------------------------------------------------------------------- per iteration
    def _reset(self) -> None:
        n = len(self.params)
        self.ready = bytearray(n)
        self.dups: List[int] = []
        self.next_bucket = 0
        self.missing: List[int] = []
        if self.host_reduce is not None:
            self.host_reduce.outstanding = []  # a backward that raised may have left some
        self.callback_queued = False
        self.unused_marked = False
        self.unreached: List[int] = []
        for b in self.buckets:
            b.pending = len(b.slots)
            b.launched = False
            b.work = None
            b.comm_in = None

    def prepare_for_forward(self) -> None:
        if self.in_backward:
            raise RuntimeError(
                "pyfused.DistributedDataParallel: the previous backward started reducing gradients "
                "but did not finish (did it raise?); the process group may be out of step. Recreate "
                "the process group and the model.")

    def prepare_for_backward(self, output) -> None:
        """Arm the hooks for the backward of this forward's ``output``."""
        self._reset()
        self.observed = []  # a backward that raised left a partial record
        self.expect_hooks = True
        outs = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.grad_fn is not None]
        for t in outs:
            t.register_hook(self._output_hook)
        if self.find_unused:
            self.unreached = self._unreached(outs)

    def _unreached(self, outs: List[Tensor]) -> List[int]:
        """Parameters the autograd graph of ``outs`` does not reach (torch DDP's search)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        reached = set()
        seen = set()
        stack = [t.grad_fn for t in outs]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None and id(var) in index:
                reached.add(index[id(var)])
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return [i for i in range(len(self.params)) if i not in reached]

    def _output_hook(self, grad):
        self._backward_started()
        return None

    def _backward_started(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if self.find_unused and not self.unused_marked:
            self.unused_marked = True
            for i in self.unreached:
                if not self.ready[i]:
                    self._mark_ready(i)

    def _make_hook(self, i: int):
        # Weak: the hook lives on the parameter, in autograd state the garbage collector cannot
        # see, so a strong reference would keep the reducer and its process group alive forever.
        reducer = weakref.ref(self)

        def hook(param):
            self = reducer()
            if self is None:
                return
            if self.expect_hooks:
                self._on_grad_ready(i)
            elif param.grad is not None:
                self.used[i] = 1  # inside no_sync
        return hook

    def _on_grad_ready(self, i: int) -> None:
        self._backward_started()
        if self.ready[i]:
            self.dups.append(i)
            return
        if self.params[i].grad is not None:
            self.used[i] = 1
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        self.ready[i] = 1
        if self.rebuild_caps is not None:
            self.observed.append(i)
        b, k = self.loc[i]
        if self.as_view:
            self._grad_into_view(i, b.extra["views"][k])
        if "plan" not in b.extra and not b.extra["in_place"]:
            self._copy_slot(b, k)
        b.pending -= 1
        if b.pending == 0:
            while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
                self._launch(self.buckets[self.next_bucket])
                self.next_bucket += 1
                if self.next_bucket == len(self.buckets):
                    self._launch_status()

    def _grad_into_view(self, i: int, view: Tensor) -> None:
        """gradient_as_bucket_view: the gradient must live in the bucket (torch DDP's contract)."""
        p = self.params[i]
        g = p.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
            view.copy_(g)
            p.grad = view

    # ----------------------------------------------------------------------------- launching
    def _grads_of(self, b: Bucket) -> List[Tensor]:
        out = []
        for s in b.slots:
            g = self.params[s.param].grad
            out.append(g if g is not None else torch.zeros(s.shape, dtype=b.dtype, device=self.device))
        return out

    def _copy_slot(self, b: Bucket, k: int) -> None:
        """Torch path (no kernel): gradient k goes into the bucket, times 1/world, as soon as it is
        ready (as torch DDP's reducer does), so that when the bucket's last gradient arrives only
        that one is left to copy before the collective starts."""
        s = b.slots[k]
        p = self.params[s.param]
        with torch.no_grad():
            if self.as_view:
                view, comm_buf = b.extra["views"][k], b.extra["comm_buf"]
                if comm_buf is b.extra["grad_buf"]:
                    view.mul_(self.scale)
                else:
                    torch.mul(view, self.scale, out=comm_buf[s.offset:s.offset + s.numel].view(s.shape))
                return
            if self.sharded and b.comm_in is None:  # transient reduce-scatter input
                b.comm_in = torch.empty(b.padded, dtype=self._comm_dtype_of(b), device=self.device)
                b.comm_in[b.numel:].zero_()
            buf = b.comm_in if self.sharded else b.extra["comm_buf"]
            dst = buf[s.offset:s.offset + s.numel].view(s.shape)
            g = p.grad
            if g is None:
                dst.zero_()
            else:
                torch.mul(g if g.dtype == dst.dtype or g.dtype == torch.float32 else g.float(),
                          self.scale, out=dst)
                if self.sharded:
                    p.grad = None  # ZeRO-2: the full gradient is not kept

    def _launch(self, b: Bucket) -> None:
        cdt = self._comm_dtype_of(b)
        plan = b.extra.get("plan")
        with torch.no_grad(), comm.on_comm_stream(self.device) as stream:
            if b.extra["in_place"]:
                buf = self._in_place_input(b, stream)
            elif plan is None:  # torch path: every slot was copied by _copy_slot already
                buf = b.comm_in if self.sharded else b.extra["comm_buf"]
            elif self.as_view:
                grad_buf, comm_buf = b.extra["grad_buf"], b.extra["comm_buf"]
                if comm_buf is grad_buf:
                    grad_buf.mul_(self.scale)
                else:
                    torch.mul(grad_buf, self.scale, out=comm_buf)
                buf = comm_buf
            elif not self.sharded:
                grads = self._grads_of(b)
                buf = b.extra["comm_buf"]
                bucket_copy.flatten_scale(grads, buf, self.scale, plan)
                for g in grads:
                    comm.keep_alive(g, stream)
            else:
                grads = self._grads_of(b)
                buf = torch.empty(b.padded, dtype=cdt, device=self.device)
                bucket_copy.flatten_scale(grads, buf, self.scale, plan)
                if b.padded > b.numel:
                    buf[b.numel:].zero_()
                for s, g in zip(b.slots, grads):
                    comm.keep_alive(g, stream)
                    self.params[s.param].grad = None  # ZeRO-2: the full gradient is not kept
            b.comm_in = buf
            if self.pg is None:
                b.work = None
                if self.sharded:
                    b.extra["shard_out"].copy_(buf)
            else:
                with comm.failures_named(FINALIZE, self.pg, ("bucket", b.index)):
                    if self.sharded:
                        b.work = shard_comm.reduce_scatter(b.extra["shard_out"], buf, self.pg)
                    elif self.host_reduce is not None:
                        b.work = self.host_reduce.start(buf, b.extra["piece"])
                    else:
                        b.work = dist.all_reduce(buf, group=self.pg, async_op=True)
        b.launched = True
        if self.sharded:
            self._reap()
        if self.on_bucket_launched is not None:
            self.on_bucket_launched(b)

    def _in_place_input(self, b: Bucket, stream) -> Tensor:
        """An in-place bucket's collective buffer: its gradient itself, times 1/world; a transient
        copy where the gradient cannot be (missing, strided otherwise, another dtype)."""
        s = b.slots[0]
        g = self.params[s.param].grad
        if g is not None and g.dtype == b.dtype and g.layout == torch.strided and g.is_contiguous():
            g.mul_(self.scale)
            comm.keep_alive(g, stream)
            return g
        buf = torch.empty(s.shape, dtype=b.dtype, device=self.device)
        if g is None:
            buf.zero_()
        else:
            torch.mul(g.to(b.dtype), self.scale, out=buf)
        return buf

    def _reap(self) -> None:
        """Drop the inputs of reduce-scatters that already finished (ZeRO-2: the flattened full
        gradients are transient; without this they would all live until the end of backward).
        ``is_completed`` does not block; ``wait`` on a finished work only orders streams."""
        for b in self.buckets[:self.next_bucket + 1]:
            if b.work is not None and b.work.is_completed():
                b.work.wait()
                b.work = None
                b.comm_in = None

    # ----------------------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        self.expect_hooks = False
        try:
            with comm.failures_named(FINALIZE, self.pg):
                # complete every bucket (missing gradients as zeros) so that all ranks'
                # collectives match; the last launch also launches the status exchange
                self.missing = [i for i in range(len(self.params)) if not self.ready[i]]
                for i in self.missing:
                    self._mark_ready(i)
                timeout = transfer_timeout(self.pg, self.device)  # read once per backward
                global_used, problem = self.status.read(self.dups, timeout)
                for b in self.buckets:
                    self._complete(b, global_used, timeout)
                if self.on_all_reduced is not None and not problem:
                    self.on_all_reduced()
                if self.rebuild_caps is not None and not problem:
                    self._rebuild()
        finally:
            self.in_backward = False
            self.used = bytearray(len(self.params))
        if problem:
            raise InputError(problem)

    def _launch_status(self) -> None:
        local_missing = [] if self.find_unused else self.missing
        self.status.launch(local_missing, self.dups, self.used if self.find_unused else None)

    def _complete(self, b: Bucket, global_used: Optional[List[int]],
                  timeout: datetime.timedelta) -> None:
        if b.work is not None and self.host_reduce is not None:
            b.work.wait()  # each step bounded by its own group's timeout (comm/hierarchical.py)
        elif b.work is not None:
            b.work.wait(timeout)
        b.work = None
        unused = set()
        if global_used is not None:
            unused = {s.param for s in b.slots if global_used[s.param] == 0}
        with torch.no_grad():
            if self.sharded:
                self.on_shard_reduced(b, unused)
            elif b.extra["in_place"]:
                p = self.params[b.slots[0].param]
                if b.comm_in is not p.grad:  # reduced in a transient copy (_in_place_input)
                    if p.grad is None:
                        p.grad = b.comm_in
                    else:
                        p.grad.copy_(b.comm_in)
            elif self.as_view:
                if b.extra["comm_buf"] is not b.extra["grad_buf"]:
                    b.extra["grad_buf"].copy_(b.extra["comm_buf"])
                for k, s in enumerate(b.slots):
                    p = self.params[s.param]
                    if p.grad is None and s.param not in unused:
                        p.grad = b.extra["views"][k]
            else:
                self._unflatten(b, unused)
        b.comm_in = None

    def _unflatten(self, b: Bucket, unused: set) -> None:
        buf = b.extra["comm_buf"]
        dsts = []
        for s in b.slots:
            p = self.params[s.param]
            if s.param in unused:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
            dsts.append(p.grad)
        if not unused:
            bucket_copy.unflatten_scale(buf, dsts, 1.0, b.extra.get("plan"))
            return
        # Some slots keep their gradient untouched: copy the others one by one (rare: only with
        # parameters unused on every rank).
        logger.debug("pyfused DDP: bucket %d has parameters unused on every rank; unflattening it "
                     "per parameter", b.index)
        k = 0
        for s in b.slots:
            if s.param in unused:
                continue
            dsts[k].copy_(buf[s.offset:s.offset + s.numel].view(s.shape))
            k += 1

    def _rebuild(self) -> None:
        """Buckets from rank 0's observed gradient order (an agreement every rank makes, once)."""
        caps, self.rebuild_caps = self.rebuild_caps, None
        order, self.observed = self.observed, []
        n = len(self.params)
        if sorted(order) != list(range(n)):
            order = [-1] * n  # not one entry per parameter: keep the buckets (rank 0 decides)
        order = comm.agree_on(self.pg, "DistributedDataParallel", order, width=n,
                              detail="rank 0's gradient order")[0]
        if not order or order[0] < 0:
            return
        current = [s.param for b in self.buckets for s in b.slots]
        indices = _buckets.assign(list(enumerate(self.params)), caps[0], caps[1], order=order,
                                  own_bytes=self.in_place_bytes)
        if [i for members in indices for i in members] == current:
            return
        old_views = {s.param: b.extra["views"][k] for b in self.buckets if "views" in b.extra
                     for k, s in enumerate(b.slots)}
        self.buckets = _buckets.build(self.params, indices, self.world, self.sharded,
                                      self.pad_multiple)
        self._index_slots()
        self._allocate()
        if self.as_view:  # .grad stays a view of the (new) bucket, holding the same values
            with torch.no_grad():
                for b in self.buckets:
                    for k, s in enumerate(b.slots):
                        p = self.params[s.param]
                        if p.grad is not None and p.grad is old_views.get(s.param):
                            b.extra["views"][k].copy_(p.grad)
                            p.grad = b.extra["views"][k]
        self._reset()
        logger.debug("pyfused DDP: buckets rebuilt from the observed gradient order: %s",
                     [[s.param for s in b.slots] for b in self.buckets])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
