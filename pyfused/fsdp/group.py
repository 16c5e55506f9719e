"""One ``fully_shard`` unit's parameters: their shards, their gathered form, their gradient reduction.

Layout. Parameter p of shape ``[rows, *rest]`` is cut along dim 0 as ``torch.chunk`` cuts it:
``chunk = ceil(rows / world)`` rows per rank, rank r holding rows ``[r*chunk, (r+1)*chunk)`` clipped
to ``rows`` (the last ranks may hold fewer rows, or none). That is ``Shard(0)``'s layout, so the
shard is a ``DTensor`` over the data-parallel mesh and torch's ``state_dict`` / DCP read and write
it. Each rank's all-gather input is one flat buffer: every parameter's shard padded to
``chunk * prod(rest)`` elements, in registration order. One ``all_gather_single`` of that buffer
gives ``[world, shard_numel]``; parameter p is the ``[world, chunk, *rest]`` view of its columns,
cut back to ``rows``. The input is this rank's row of the output (an in-place all-gather), so a
gather holds one buffer, not two.

Gathered form. Each parameter has one persistent leaf (an ``nn.Parameter`` in the compute dtype)
that the module holds while the unit is unsharded. Resharding frees the leaf's storage
(``resize_(0)``) but keeps the tensor, so the tensors autograd saved in forward come back to life
when backward gathers again into the same storage. Copies into a leaf go through ``.data`` (a fresh
version counter), so autograd does not see an in-place change of a saved tensor.

Reduction. The gradients of the trainable parameters (same padded layout, scaled by 1/world) are
reduce-scattered as one buffer, whose output becomes the sharded ``.grad`` (views, nothing copied).
Beside it, one "has a gradient" flag per trainable parameter, written into every rank's segment of
a small second buffer, is reduce-scattered in the same coalesced call, so every rank receives the
sum of the flags: a parameter no rank produced a gradient for keeps its sharded ``.grad`` untouched
(None after ``zero_grad``), as torch's FSDP leaves an unused parameter's gradient. The flags live
in their own buffer so that the gradients' storage is exactly the padded shards, as FSDP2's is.

Accumulation without sync. When the reduce dtype differs from the compute dtype (bf16 compute,
fp32 reduction), FSDP2 casts each backward's gradient to the reduce dtype and sums the micro-steps
there; here the sum lives in the reduce-scatter's own input layout (``accumulated``, unscaled):
the first gradient of a parameter is copied in, the later ones added, each backward's gradient
leaving the leaf as soon as it is folded in. The synchronising backward adds its gradient, scales
the buffer by 1/world and reduce-scatters it in place of a fresh buffer. With equal dtypes
autograd sums the micro-steps on the leaves, as in FSDP2.

HSDP (a 2-D (replicate, shard) mesh, mesh.py). The layout, gather and reduce-scatter above run
within the shard group (``world`` is its size), with the gradients scaled by 1/(replicas x world);
the reduce-scatter's output, this rank's shard of the shard group's sum, is then all-reduced across
the replicate group together with the flags, in one coalesced call, before it becomes ``.grad``. A
reduction therefore advances in two stages (``Reduction``), so that the all-reduce of one unit runs
while the next unit's backward computes. ``all_reduce = False`` (FSDP2's
``set_requires_all_reduce(False)``) keeps the reduce-scattered shards in ``partial`` instead (the
reduce dtype, already scaled by 1/(R x S)): the next reduction that all-reduces adds them first, so
gradient accumulation over micro-steps crosses the replicate groups once.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from ..comm import all_gather_single, failures_named, rank, reduce_scatter_single

SHARDED, GATHERING, UNSHARDED = "sharded", "gathering", "unsharded"
# the stages of a gradient reduction (``Reduction``)
REDUCE_SCATTERING, ALL_REDUCING, REDUCED = "reduce-scattering", "all-reducing", "reduced"


def set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<name>`` without ``nn.Module.__setattr__``'s checks, except for
    modules that keep their own view of their parameters (``nn.RNNBase``'s flat weight list)."""
    if getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


def _contiguous_stride(shape) -> Tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


class ShardedParam:
    """One parameter: where the module holds it, this rank's shard and its gathered leaf."""

    def __init__(self, owners: List[Tuple[nn.Module, str]], full: Tensor, mesh, rank: int,
                 world: int, compute_dtype: torch.dtype, placements: Tuple = (Shard(0),)):
        self.owners = owners  # (module, attribute name); several for a tied parameter
        self.shape = tuple(full.shape)
        self.rows = self.shape[0]
        self.rest = self.shape[1:]
        self.row_numel = math.prod(self.rest)
        self.chunk = -(-self.rows // world)
        self.padded = self.chunk * self.row_numel
        lo = min(rank * self.chunk, self.rows)
        self.local_rows = min(lo + self.chunk, self.rows) - lo
        self.mesh = mesh
        self.placements = tuple(placements)  # (Shard(0),), or HSDP's (Replicate(), Shard(0))
        self.stride = _contiguous_stride(self.shape)
        self.world = world
        local = full.detach()[lo:lo + self.local_rows].clone().contiguous()
        self.sharded = nn.Parameter(self.as_dtensor(local), requires_grad=full.requires_grad)
        self.compute_dtype = compute_dtype
        self.leaf_nbytes = math.prod(self.shape) * compute_dtype.itemsize
        self.leaf: Optional[nn.Parameter] = None
        # gradient hooks registered on the original parameter (tensor parallelism's sums over the
        # TP group) run on the gathered leaf, where backward produces the gradient
        self.grad_hooks = list((full._backward_hooks or {}).values())

    def as_dtensor(self, local: Tensor) -> DTensor:
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def grad_dtensor(self, local: Tensor) -> DTensor:
        """``local`` (this rank's gradient rows, the shard's dtype) as a DTensor of the shard's
        layout: the shard's own spec, without ``from_local``'s autograd function (~40 us each)."""
        return DTensor(local, self.sharded._spec, requires_grad=False)

    @property
    def local(self) -> Tensor:
        return self.sharded._local_tensor

    def alloc_leaf(self) -> nn.Parameter:
        if self.leaf is None:
            self.leaf = nn.Parameter(torch.empty(self.shape, dtype=self.compute_dtype,
                                                 device=self.local.device),
                                     requires_grad=self.sharded.requires_grad)
            for hook in self.grad_hooks:
                self.leaf.register_hook(hook)
        elif self.leaf.untyped_storage().nbytes() == 0:
            self.leaf.untyped_storage().resize_(self.leaf_nbytes)
        return self.leaf

    def free_leaf(self) -> None:
        if self.leaf is not None:
            self.leaf.untyped_storage().resize_(0)

    def rank_rows(self, r: int) -> int:
        return max(0, min(self.chunk, self.rows - r * self.chunk))

    def scatter_rows(self, dst: Tensor, src: Tensor, put: Callable[[Tensor, Tensor], object]
                     = Tensor.copy_) -> None:
        """``dst`` ``[world, chunk, *rest]`` (padded layout) <-> ``src`` ``[rows, *rest]``:
        ``put(dst[r, :n_r], src[r*chunk : r*chunk + n_r])`` (a copy, an add, a scaled copy)."""
        if self.rows == self.chunk * self.world:
            put(dst, src.view(dst.shape))
            return
        for r in range(self.world):
            n = self.rank_rows(r)
            if n:
                put(dst[r, :n], src[r * self.chunk:r * self.chunk + n])

    def gather_rows(self, dst: Tensor, src: Tensor) -> None:
        """The inverse: ``dst`` ``[rows, *rest]`` <- ``src`` ``[world, chunk, *rest]``."""
        if self.rows == self.chunk * self.world:
            dst.view(src.shape).copy_(src)
            return
        for r in range(self.world):
            n = self.rank_rows(r)
            if n:
                dst[r * self.chunk:r * self.chunk + n].copy_(src[r, :n])


class Reduction:
    """One unit's gradient reduction in flight: the reduce-scatter over the shard group, then (HSDP,
    ``all_reduce``) the all-reduce across the replicate group. ``work`` is the collective of the
    current ``stage``; ``out`` and ``used`` its gradient and flag buffers."""

    __slots__ = ("work", "out", "used", "all_reduce", "stage")

    def __init__(self, work, out: Tensor, used: Tensor, all_reduce: bool):
        self.work, self.out, self.used = work, out, used
        self.all_reduce = all_reduce
        self.stage = REDUCE_SCATTERING


class ParamGroup:
    """The parameters of one ``fully_shard`` unit and its gather / reduce-scatter (and, HSDP,
    all-reduce across the replicate group ``replicate_pg`` of ``replicas`` ranks)."""

    def __init__(self, params: List[ShardedParam], pg, world: int, compute_dtype, reduce_dtype,
                 device: torch.device, replicate_pg=None, replicas: int = 1):
        self.params = params
        self.pg = pg
        self.world = world
        self.rank = rank(pg) if world > 1 else 0
        self.replicate_pg = replicate_pg
        self.replicas = replicas
        self.all_reduce = True  # False: keep reduce-scattered shards in ``partial`` (HSDP)
        self.partial: Optional[Tuple[Tensor, Tensor]] = None  # (gradients, flags) not all-reduced
        self.device = device
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.padded
        self.shard_numel = off
        self.trainable = [i for i, p in enumerate(params) if p.sharded.requires_grad]
        self.grad_offsets, off = [], 0
        for i in self.trainable:
            self.grad_offsets.append(off)
            off += params[i].padded
        self.grad_numel = off
        self.leaf_nbytes = sum(p.leaf_nbytes for p in params)
        # the micro-steps without sync sum their gradients in the reduce dtype when it is not the
        # gradients' own (module docstring); None: autograd sums them on the leaves
        self.accumulate_dtype = reduce_dtype if reduce_dtype != compute_dtype else None
        self.accumulated: Optional[Tensor] = None  # [world, grad_numel], unscaled
        self.accumulated_has: List[bool] = []      # per trainable parameter: a gradient added
        self.state = SHARDED
        self._gather: Optional[tuple] = None
        self.gathers = 0  # all-gathers launched (tests: resharded units are gathered again)

    # ---- gather --------------------------------------------------------------------------------
    @torch.no_grad()
    def start_gather(self) -> None:
        """Launch the all-gather of this unit's parameters (asynchronous); no-op unless sharded."""
        if self.state != SHARDED:
            return
        self.state = GATHERING
        self.gathers += 1
        if not self.params:
            self._gather = (None, None)
            return
        out = torch.empty(self.world * self.shard_numel, dtype=self.compute_dtype, device=self.device)
        flat = out[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
        for p, off in zip(self.params, self.offsets):
            n = p.local_rows * p.row_numel
            flat[off:off + n].copy_(p.local.reshape(-1))
            if n < p.padded:
                flat[off + n:off + p.padded].zero_()
        if self.world == 1:
            self._gather = (None, out)
            return
        with failures_named("fully_shard", self.pg, "parameter all-gather"):
            work = all_gather_single(out, flat, group=self.pg, async_op=True)
        self._gather = (work, out)

    @torch.no_grad()
    def finish_gather(self) -> None:
        """Wait for the gather (launching it first if needed) and install the gathered leaves."""
        if self.state == UNSHARDED:
            return
        self.start_gather()
        work, out = self._gather
        self._gather = None
        if work is not None:
            with failures_named("fully_shard", self.pg, "parameter all-gather"):
                work.wait()
        if out is not None:
            table = out.view(self.world, self.shard_numel)
            for p, off in zip(self.params, self.offsets):
                leaf = p.alloc_leaf()
                src = table[:, off:off + p.padded].view(self.world, p.chunk, *p.rest)
                p.gather_rows(leaf.data, src)
        for p in self.params:
            for module, name in p.owners:
                set_param(module, name, p.leaf)
        self.state = UNSHARDED

    def reshard(self) -> None:
        """Put the shards back on the modules and free the gathered storage."""
        if self.state == GATHERING:
            self.finish_gather()
        if self.state != UNSHARDED:
            return
        for p in self.params:
            for module, name in p.owners:
                set_param(module, name, p.sharded)
            p.free_leaf()
        self.state = SHARDED

    def gathered_bytes(self) -> int:
        """Bytes of gathered leaves held: all of them while unsharded, none otherwise."""
        return self.leaf_nbytes if self.state == UNSHARDED else 0

    # ---- reduce --------------------------------------------------------------------------------
    def _grad_region(self, buf: Tensor, i: int, off: int) -> Tensor:
        p = self.params[i]
        return buf[:, off:off + p.padded].view(self.world, p.chunk, *p.rest)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Fold the leaves' gradients into ``accumulated`` (reduce dtype) and release them: the
        end of one backward without sync. A no-op when the dtypes are equal."""
        if self.accumulate_dtype is None or not self.trainable:
            return
        for j, (i, off) in enumerate(zip(self.trainable, self.grad_offsets)):
            p = self.params[i]
            g = p.leaf.grad if p.leaf is not None else None
            if g is None:
                continue
            if self.accumulated is None:
                self.accumulated = torch.empty(self.world, self.grad_numel,
                                               dtype=self.accumulate_dtype, device=self.device)
                self.accumulated_has = [False] * len(self.trainable)
            region = self._grad_region(self.accumulated, i, off)
            if self.accumulated_has[j]:
                p.scatter_rows(region, g, Tensor.add_)
            else:
                if p.rows != p.chunk * self.world:
                    region.zero_()  # the padding rows
                p.scatter_rows(region, g)
                self.accumulated_has[j] = True
            p.leaf.grad = None

    def _reduce_input(self) -> Tuple[Tensor, Tensor]:
        """The reduce-scatter's input, scaled by 1/(replicas x world): the leaves' gradients
        (released), added to what backwards without sync accumulated; and the "has a gradient"
        flags."""
        scale = 1.0 / (self.replicas * self.world)
        if self.accumulated is not None:
            self.accumulate_grads()
            buf, has = self.accumulated, self.accumulated_has
            self.accumulated, self.accumulated_has = None, []
            in_copy = False  # the sum is already in the reduce dtype: scaled there, once
        else:
            buf = torch.empty(self.world, self.grad_numel, dtype=self.reduce_dtype,
                              device=self.device)
            has = [False] * len(self.trainable)
            # scale in the wider of the two dtypes: in the copy into the buffer (before a
            # narrowing cast, or in the same dtype), else once over the widened buffer
            in_copy = self.reduce_dtype.itemsize <= self.compute_dtype.itemsize

        def scaled_copy(d: Tensor, s: Tensor) -> None:
            torch.mul(s, scale, out=d)

        flags = torch.zeros(self.world, len(self.trainable), dtype=self.reduce_dtype,
                            device=self.device)
        for j, (i, off) in enumerate(zip(self.trainable, self.grad_offsets)):
            p = self.params[i]
            g = p.leaf.grad if p.leaf is not None else None
            region = self._grad_region(buf, i, off)
            if g is not None:
                if p.rows != p.chunk * self.world:
                    region.zero_()  # the padding rows
                p.scatter_rows(region, g, scaled_copy if in_copy else Tensor.copy_)
                has[j] = True
                p.leaf.grad = None
            elif not has[j]:
                region.zero_()
                continue
            flags[:, j] = 1.0
        if not in_copy:
            buf.mul_(scale)
        return buf, flags

    @torch.no_grad()
    def start_reduce(self) -> Optional[Reduction]:
        """Launch the reduce-scatter of the unit's gradients (asynchronous; ``_reduce_input``).
        Returns the ``Reduction`` for ``advance_reduce`` / ``finish_reduce``; None when the unit has
        nothing trainable."""
        if not self.trainable:
            return None
        buf, flags = self._reduce_input()
        all_reduce = self.all_reduce and self.replicate_pg is not None
        if self.world == 1:
            return Reduction(None, buf.view(-1), flags.view(-1), all_reduce)
        out = torch.empty(self.grad_numel, dtype=self.reduce_dtype, device=self.device)
        used = torch.empty(len(self.trainable), dtype=self.reduce_dtype, device=self.device)
        with failures_named("fully_shard", self.pg, "gradient reduce-scatter"):
            # torch's coalescing manager issues both as one coalesced reduce-scatter (one NCCL
            # group on GPU) and returns one handle for the two
            with dist._coalescing_manager(group=self.pg, async_ops=True) as work:
                reduce_scatter_single(out, buf.view(-1), group=self.pg)
                reduce_scatter_single(used, flags.view(-1), group=self.pg)
        return Reduction(work, out, used, all_reduce)

    @torch.no_grad()
    def advance_reduce(self, red: Optional[Reduction]) -> bool:
        """Move ``red`` on by one stage, waiting for its current collective; True once the sharded
        ``.grad`` holds its result (or ``partial`` does, without ``all_reduce``). After the
        reduce-scatter, an HSDP reduction adds ``partial`` and launches the all-reduce across
        replicas (asynchronous: the next call waits for it)."""
        if red is None or red.stage == REDUCED:
            return True
        if red.work is not None:
            stage = "gradient reduce-scatter" if red.stage == REDUCE_SCATTERING else \
                "gradient all-reduce across replicas"
            pg = self.pg if red.stage == REDUCE_SCATTERING else self.replicate_pg
            with failures_named("fully_shard", pg, stage):
                red.work.wait()
            red.work = None
        if red.stage == REDUCE_SCATTERING and self.replicate_pg is not None:
            if not red.all_reduce:  # accumulate the shards; the next all-reduce adds them
                if self.partial is None:
                    self.partial = (red.out, red.used)
                else:
                    self.partial[0].add_(red.out)
                    self.partial[1].add_(red.used)
                red.stage = REDUCED
                return True
            if self.partial is not None:
                red.out.add_(self.partial[0])
                red.used.add_(self.partial[1])
                self.partial = None
            red.stage = ALL_REDUCING
            if self.replicas > 1:
                with failures_named("fully_shard", self.replicate_pg,
                                    "gradient all-reduce across replicas"):
                    with dist._coalescing_manager(group=self.replicate_pg, async_ops=True) as work:
                        dist.all_reduce(red.out, group=self.replicate_pg)
                        dist.all_reduce(red.used, group=self.replicate_pg)
                red.work = work
                return False
        self._write_grads(red.out, red.used)
        red.stage = REDUCED
        return True

    def finish_reduce(self, red: Optional[Reduction]) -> None:
        """Complete ``red``: wait for its collectives and write the sharded ``.grad``."""
        while not self.advance_reduce(red):
            pass

    def _write_grads(self, out: Tensor, used: Tensor) -> None:
        """Add the reduced gradients ``out`` to the sharded parameters' ``.grad``."""
        used = used.tolist()
        for j, (i, off) in enumerate(zip(self.trainable, self.grad_offsets)):
            if used[j] == 0:
                continue
            p = self.params[i]
            g = out[off:off + p.local_rows * p.row_numel].view(p.local_rows, *p.rest)
            g = g.to(p.local.dtype)  # a view of ``out`` (1/world of the unit) when dtypes match
            if p.sharded.grad is None:
                p.sharded.grad = p.grad_dtensor(g)
            else:
                p.sharded.grad._local_tensor.add_(g)
