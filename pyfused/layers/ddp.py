"""``DistributedDataParallel``: torch DDP's semantics, overlapped bucketed reduction, optional ZeRO.

    ddp = DistributedDataParallel(model, process_group=None, bucket_cap_mb=25,
                                  find_unused_parameters=False, gradient_as_bucket_view=False,
                                  broadcast_buffers=True, comm_dtype=None, shard_optimizer=False,
                                  all_reduce="auto", host_mesh=None)

Semantics follow ``torch.nn.parallel.DistributedDataParallel`` (a one-line switch):
* construction checks that every rank wraps an identical module with identical options (a clear
  ``InputError`` on every rank otherwise, never a hang), then broadcasts parameters and buffers from
  rank 0;
* each forward broadcasts buffers from rank 0 first (``broadcast_buffers=True``; skipped after a
  forward that did not synchronise, as torch does);
* backward averages gradients over the group, bucket by bucket, overlapped with the rest of backward
  (pyfused/dp/reducer.py); ``no_sync()`` accumulates locally instead;
* ``comm_dtype=torch.bfloat16`` reduces in bf16 and writes the result back into the fp32 gradients;
* ``shard_optimizer=True`` + ``opt = ddp.wrap_optimizer(opt)``: ZeRO-1/2 (pyfused/dp/sharded.py);
* ``all_reduce="hierarchical"`` reduces each bucket inside each host, then across hosts, then
  inside again; ``"auto"`` does so exactly where the group spans hosts with several ranks on each
  (pyfused/dp/reduction.py states the rule; ``ddp.all_reduce`` says what was chosen and why).
  ``host_mesh=`` names the hosts as a ("host", "local") DeviceMesh where the group is a subgroup.

Buckets follow reverse registration order at first and are rebuilt once from the gradient order the
first synchronising backward observed (torch DDP's rule; not with find_unused_parameters or a
sharded optimizer). Differences from torch DDP (docs/DDP.md): no ``static_graph``, ``join`` or comm
hooks (``comm_dtype`` covers the bf16/fp16 compression hooks), no input scattering to
``device_ids``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from .. import comm
from ..dp import buckets as _buckets, reduction
from ..dp.checks import agree_module, broadcast_coalesced
from ..dp.reducer import Reducer, in_place_bytes
from ..dp.sharded import ShardedState


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, process_group=None, bucket_cap_mb: float = 25,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 broadcast_buffers: bool = True, comm_dtype: Optional[torch.dtype] = None, *,
                 shard_optimizer: bool = False, all_reduce: str = "auto", host_mesh=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"pyfused.DistributedDataParallel wraps an nn.Module, "
                            f"got {type(module).__name__}")
        if shard_optimizer and gradient_as_bucket_view:
            raise ValueError("pyfused.DistributedDataParallel: gradient_as_bucket_view=True has no "
                             "meaning with shard_optimizer=True (full gradients are released once "
                             "reduce-scattered); drop one of them")
        self.module = module
        self.process_group = comm.resolve_group(process_group)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.comm_dtype = comm_dtype
        self.shard_optimizer = shard_optimizer
        self.bucket_cap_mb = bucket_cap_mb
        pg = self.process_group

        named_params = list(module.named_parameters())
        entries = [("parameter", n, p) for n, p in named_params]
        entries += [("buffer", n, b) for n, b in module.named_buffers()]
        options = dict(bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                       gradient_as_bucket_view=gradient_as_bucket_view,
                       broadcast_buffers=broadcast_buffers, comm_dtype=comm_dtype,
                       shard_optimizer=shard_optimizer, all_reduce=all_reduce, host_mesh=host_mesh)
        agree_module(pg, entries, options)
        self.all_reduce = reduction.choose(pg, all_reduce, host_mesh, shard_optimizer)

        cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._buffers_to_sync = [b for _, b in module.named_buffers()]
        broadcast_coalesced(pg, [p.detach() for _, p in named_params] + self._buffers_to_sync,
                            cap_bytes)

        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        params = [p for _, p in trainable]
        self.device = params[0].device
        first_cap = min(cap_bytes, _buckets.FIRST_BUCKET_BYTES)
        own_bytes = in_place_bytes(self.device, comm_dtype=comm_dtype,
                                   find_unused=find_unused_parameters,
                                   as_view=gradient_as_bucket_view, sharded=shard_optimizer,
                                   hierarchical=self.all_reduce.reduce is not None)
        indices = _buckets.assign(list(enumerate(params)), cap_bytes, first_cap,
                                  own_bytes=own_bytes)
        world = comm.world_size(pg)
        self._bucket_list = _buckets.build(params, indices, world, shard_optimizer,
                                           self.all_reduce.ranks_per_host)
        self._param_names = [n for n, _ in trainable]
        self.reducer = Reducer(params, self._param_names, self._bucket_list, pg, self.device,
                               comm_dtype=comm_dtype, find_unused=find_unused_parameters,
                               as_view=gradient_as_bucket_view, sharded=shard_optimizer,
                               host_reduce=self.all_reduce.reduce, in_place_bytes=own_bytes)
        self.reducer.enable_rebuild(cap_bytes, first_cap)
        self._sharded: Optional[ShardedState] = None
        if shard_optimizer:
            self._sharded = ShardedState(params, self._bucket_list, pg, self.device, module,
                                         self.reducer)
            self.reducer.on_shard_reduced = self._sharded.on_shard_reduced
            self.reducer.on_all_reduced = self._sharded.agree_nonfinite
            self.register_load_state_dict_post_hook(lambda *_: self._sharded.refresh_masters())
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs, **kwargs):
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if sync:
            self.reducer.prepare_for_forward()
        if self.require_forward_param_sync and self.broadcast_buffers and self._buffers_to_sync:
            self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        if sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output)
        else:
            self.require_forward_param_sync = False
        return output

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        bufs = [b for _, b in self.module.named_buffers()]  # buffers may have been reassigned
        with torch.autograd._unsafe_preserve_version_counter(tuple(bufs)):
            broadcast_coalesced(self.process_group, bufs, int(self.bucket_cap_mb * 1024 * 1024))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of forwards run inside accumulate locally; the first forward + backward outside
        reduces the sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------------------------ sharded optimizer
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, *, master_dtype: Optional[torch.dtype] = None,
                       elementwise: Optional[bool] = None) -> torch.optim.Optimizer:
        """With ``shard_optimizer=True``: make ``optimizer`` (built from ``ddp.parameters()``) step
        only this rank's shard and gather updated parameters after each step; returns it (the same
        object). Without sharding it returns ``optimizer`` unchanged.

        ``master_dtype``: keep the shard's master weights in this dtype (e.g. fp32 for a bf16 model).
        ``elementwise``: declare a non-torch optimizer's update elementwise (required for sharding)."""
        if self._sharded is None:
            return optimizer
        return self._sharded.wrap_optimizer(optimizer, master_dtype, elementwise)

    def synchronize_params(self) -> None:
        """Wait for the parameter all-gathers still in flight after a sharded step (a no-op
        otherwise); the next forward waits per module by itself."""
        if self._sharded is not None:
            self._sharded.wait_all()

    def state_dict(self, *args, **kwargs):
        self.synchronize_params()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.synchronize_params()  # a gather still in flight would overwrite what is loaded
        return super().load_state_dict(*args, **kwargs)

    # ------------------------------------------------------------------ introspection
    def bucket_info(self):
        """Per bucket: parameter names, elements, padded length, shard length, dtype, and whether
        its collective runs on the gradient itself (``in_place``)."""
        return [dict(index=b.index, params=[self._param_names[s.param] for s in b.slots],
                     numel=b.numel, padded=b.padded, shard=b.shard, dtype=b.dtype,
                     in_place=b.extra.get("in_place", False))
                for b in self.reducer.buckets]

    def optimizer_state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        from ..dp import optimizer_state_bytes

        return optimizer_state_bytes(optimizer)
