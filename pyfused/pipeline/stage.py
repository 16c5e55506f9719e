"""``PipelineStage``: one contiguous piece of the model on one rank, and what it keeps per microbatch.

Mirrors ``torch.distributed.pipelining.PipelineStage(submodule, stage_index, num_stages, device,
group=None)``; ``input_args`` / ``output_args`` (example tensors of ONE microbatch, any device,
``meta`` included) declare the activation shapes instead of inferring them on the first step, as
torch's ``PipelineStage`` accepts them too.

Between stages an activation is a tensor or a tuple of tensors: stage ``s`` returns it and stage
``s+1`` is called as ``submodule(*activation)``. The gradient sent back holds one tensor for each
floating-point tensor of the activation (integer tensors such as token ids carry none).

``gradient_accumulation_fusion`` (default True, as Megatron-LM's option of that name): a linear
layer's weight gradient is accumulated into ``.grad`` inside its GEMM rather than formed and then
added, on every microbatch (weight_accumulation.py); False runs plain autograd. Weights with
gradient hooks (a data-parallel stage module's) are left to autograd either way. With
``PYFUSED_LOG=debug`` the stage's first backward logs which weights are fused and why the others
are not.

Nothing here talks to other ranks: a stage computes, keeps each microbatch's inputs and outputs
until its backward (or, when the schedule splits the backward, its input-gradient part B keeps the
graph until the weight-gradient part W: split_backward.py), and validates what its module returns.

With uneven microbatches (a batch that ``n_microbatches`` does not divide, split like
``torch.tensor_split``) the first ``n_large`` microbatches are one row larger than the others, so
their activations may have two shapes; both are agreed by the metadata pass (meta.py). A constructor
problem is recorded, not raised, so the schedule can report it on every rank at once (see
errors.py).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .. import comm
from .._logging import logger
from . import weight_accumulation
from .split_backward import backward_input, backward_weight

Metas = Tuple[comm.TensorMeta, ...]


def as_tuple(value: Any) -> Tuple:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(value)
    return (value,)


def metas_of(tensors) -> Metas:
    return tuple(comm.TensorMeta(tuple(t.shape), t.dtype, None) for t in tensors)


def describe(metas: Optional[Metas]) -> str:
    if metas is None:
        return "nothing"
    return "(" + ", ".join(f"{list(m.shape)} {str(m.dtype).replace('torch.', '')}" for m in metas) + ")"


def grad_metas(metas: Metas) -> Metas:
    """The gradient message of an activation: its floating-point tensors."""
    return tuple(m for m in metas if m.dtype.is_floating_point or m.dtype.is_complex)


def zeros(metas: Metas, device: torch.device) -> Tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(m.shape, dtype=m.dtype, device=device) for m in metas)


class _MicrobatchState:
    __slots__ = ("inputs", "outputs", "buffers", "loss", "failed", "weight_work")

    def __init__(self, inputs, outputs, buffers, loss=None, failed=False):
        self.inputs, self.outputs, self.buffers, self.loss, self.failed = (
            inputs, outputs, buffers, loss, failed)
        self.weight_work = None  # after a split B: what W must do


class PipelineStage:
    """One stage of the pipeline (see the module docstring)."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str, group=None, *, input_args=None, output_args=None,
                 gradient_accumulation_fusion: bool = True):
        self.submod = submodule
        self.fuse_accumulation = gradient_accumulation_fusion
        self._fusion_reported = not gradient_accumulation_fusion
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.error: Optional[str] = None  # reported on every rank by the schedule's first check
        self.group = None
        try:
            self.group = comm.resolve_group(group)
        except comm.GroupError as e:
            self.error = str(e)
        self.group_rank = comm.rank(self.group)
        self.group_size = comm.world_size(self.group)
        if not isinstance(submodule, nn.Module):
            self.error = f"submodule must be an nn.Module, got {type(submodule).__name__}"
        elif not (isinstance(stage_index, int) and isinstance(num_stages, int)
                  and 0 <= stage_index < num_stages):
            self.error = (f"stage_index must be an int in [0, num_stages); got stage_index="
                          f"{stage_index!r}, num_stages={num_stages!r}")
        self.declared_in = self._declared(input_args, "input_args")
        self.declared_out = self._declared(output_args, "output_args")
        self.in_metas: Optional[Metas] = None   # agreed on the first step (microbatch 0)
        self.out_metas: Optional[Metas] = None
        # (n_large, in, out): microbatches from n_large on are one row smaller and have these
        self.small_metas: Optional[Tuple[int, Metas, Metas]] = None
        self._state: Dict[int, _MicrobatchState] = {}
        self.output_chunks: List[Tuple[torch.Tensor, ...]] = []
        self.losses: List[torch.Tensor] = []

    def _declared(self, args, name: str) -> Optional[Metas]:
        if args is None:
            return None
        tensors = as_tuple(args)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            self.error = f"{name} must be a tensor or a tuple of tensors"
            return None
        return metas_of(tensors)

    def in_metas_of(self, mb: int) -> Metas:
        small = self.small_metas
        return self.in_metas if small is None or mb < small[0] else small[1]

    def out_metas_of(self, mb: int) -> Metas:
        small = self.small_metas
        return self.out_metas if small is None or mb < small[0] else small[2]

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return (f"PipelineStage(stage {self.stage_index} of {self.num_stages}, rank "
                f"{self.group_rank} of {self.group_size}, {self.device})")

    # --- one microbatch -------------------------------------------------------------------------

    def forward_one(self, mb: int, inputs: Tuple[torch.Tensor, ...], buffers: Tuple, *,
                    grad: bool, target=None, loss_fn=None) -> Tuple[torch.Tensor, ...]:
        """Run the module on one microbatch; keep what its backward needs. ``inputs`` of a stage
        other than the first come from a receive (or a local stage) and become graph leaves."""
        if not self.is_first:
            inputs = tuple(t.detach().requires_grad_(grad and t.dtype.is_floating_point)
                           for t in inputs)
        with torch.set_grad_enabled(grad):
            out = self.submod(*inputs)
        outs = as_tuple(out)
        bad = [type(o).__name__ for o in outs if not isinstance(o, torch.Tensor)]
        if bad:
            raise TypeError(f"stage {self.stage_index} returned {bad[0]}; a stage must return a "
                            f"tensor or a tuple of tensors")
        if not self.is_last and metas_of(outs) != self.out_metas_of(mb):
            if self.declared_out is not None:
                why = f"but its output_args declare {describe(self.out_metas_of(mb))}"
            else:
                why = (f"but {describe(self.out_metas_of(mb))} was agreed on the first step; the shapes "
                       f"between stages must not change from microbatch to microbatch")
            raise ValueError(f"stage {self.stage_index} returned {describe(metas_of(outs))} for "
                             f"microbatch {mb} {why}")
        loss = None
        if self.is_last:
            self.output_chunks.append(tuple(o.detach() for o in outs))
            if loss_fn is not None:
                with torch.set_grad_enabled(grad):
                    loss = loss_fn(out, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn must return a one-element tensor, got "
                                     f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
                self.losses.append(loss.detach())
        self._state[mb] = _MicrobatchState(inputs if grad else (), outs if grad else (), buffers, loss)
        return outs

    def forward_failed(self, mb: int, buffers: Tuple) -> Tuple[torch.Tensor, ...]:
        """Stand-in outputs (zeros of the agreed shapes) after the module raised, so that the next
        stage still gets its transfer; the step then fails on every rank."""
        self._state[mb] = _MicrobatchState((), (), buffers, failed=True)
        if self.is_last:
            return ()
        return zeros(self.out_metas_of(mb), self.device)

    def forward_ok(self, mb: int) -> bool:
        state = self._state.get(mb)
        return state is not None and not state.failed

    def drop(self, mb: int) -> Tuple:
        """Forget microbatch ``mb`` (forward-only steps); return its receive buffers."""
        return self._state.pop(mb).buffers

    def backward_one(self, mb: int, output_grads: Tuple[torch.Tensor, ...], scale: float,
                     split: bool = False, hold: Tuple = ()) -> Tuple[Tuple[torch.Tensor, ...], Tuple]:
        """Backward of one microbatch. Returns (gradients of the floating inputs to send, receive
        buffers now free). The last stage backpropagates ``loss * scale``; the others the
        gradients they received (already scaled). ``split=True`` runs B only: the weight
        gradients wait for ``backward_weight_one``, which frees the buffers (the received
        activation and ``hold``, the received gradient: W may still read both)."""
        st = self._state[mb] if split else self._state.pop(mb)
        if st.failed:
            raise RuntimeError(f"stage {self.stage_index}: no backward for microbatch {mb} because "
                               f"its forward failed")
        if split:
            return self._backward_input(mb, st, output_grads, scale, hold)
        if self.is_last:
            if st.loss is None:
                raise RuntimeError("the last stage has no loss to backpropagate (loss_fn is None)")
            self._backward([st.loss * scale if scale != 1.0 else st.loss], [None])
        else:
            floating = [o for o in st.outputs if o.dtype.is_floating_point or o.dtype.is_complex]
            pairs = [(o, g) for o, g in zip(floating, output_grads) if o.requires_grad]
            if pairs:
                self._backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.is_first:
            return (), st.buffers
        grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x)
                      for x in st.inputs if x.dtype.is_floating_point or x.dtype.is_complex)
        return grads, st.buffers

    def _backward(self, tensors, grads) -> None:
        if self.fuse_accumulation:
            self._report_fusion(tensors)
            weight_accumulation.backward(tensors, grads)
        else:
            torch.autograd.backward(tensors, grads)

    def _report_fusion(self, tensors) -> None:
        """Log (debug level), on the stage's first backward, which weights accumulate their
        gradients inside their GEMMs and why the others do not."""
        if self._fusion_reported:
            return
        self._fusion_reported = True
        reasons: Dict[int, str] = {}
        graph = weight_accumulation.reachable([t.grad_fn for t in tensors if t.grad_fn is not None])
        fusion = weight_accumulation.plan(graph, reasons=reasons)
        fused = {id(w) for _, w in fusion.linear.values()}
        names = [(n, id(p)) for n, p in self.submod.named_parameters() if p.requires_grad]
        lines = [f"  {n}: not fused, {reasons[i]}" for n, i in names if i in reasons]
        logger.debug("stage %d: %d of its parameters accumulate their gradients inside their "
                     "GEMMs (%s)%s", self.stage_index, len(fused),
                     ", ".join(n for n, i in names if i in fused) or "none",
                     "".join("\n" + line for line in lines))

    def _backward_input(self, mb: int, st: _MicrobatchState, output_grads, scale: float, hold
                        ) -> Tuple[Tuple[torch.Tensor, ...], Tuple]:
        if self.is_last:
            if st.loss is None:
                raise RuntimeError("the last stage has no loss to backpropagate (loss_fn is None)")
            outputs, grads = [st.loss * scale if scale != 1.0 else st.loss], [None]
        else:
            floating = [o for o in st.outputs if o.dtype.is_floating_point or o.dtype.is_complex]
            outputs, grads = floating, list(output_grads)
        floating_in = [x for x in st.inputs if x.dtype.is_floating_point or x.dtype.is_complex]
        params = [p for p in self.submod.parameters() if p.requires_grad]
        if self.fuse_accumulation:
            self._report_fusion(outputs)
        input_grads, st.weight_work = backward_input(outputs, grads, floating_in, params,
                                                     fuse=self.fuse_accumulation)
        # W starts from the kept frontier: the outputs and input leaves are no longer needed (the
        # graph keeps what W reads; the receive buffers stay out of the pool until W)
        st.inputs, st.outputs, st.loss = (), (), None
        st.buffers = tuple(st.buffers) + tuple(hold)
        if self.is_first:
            return (), ()
        return tuple(g if g is not None else torch.zeros_like(x)
                     for g, x in zip(input_grads, floating_in)), ()

    def backward_weight_one(self, mb: int) -> Tuple:
        """W of one microbatch after its split B; returns the receive buffers now free."""
        st = self._state[mb]
        if st.failed or st.weight_work is None:
            raise RuntimeError(f"stage {self.stage_index}: no weight gradients for microbatch {mb} "
                               f"because its {'forward' if st.failed else 'B'} failed")
        backward_weight(st.weight_work)
        return self._state.pop(mb).buffers

    def weight_failed(self, mb: int) -> Tuple:
        st = self._state.pop(mb, None)
        return st.buffers if st is not None else ()

    def backward_failed(self, mb: int, split: bool = False, hold: Tuple = ()
                        ) -> Tuple[Tuple[torch.Tensor, ...], Tuple]:
        """Zeros for the previous stage after a failure. With ``split`` the microbatch stays
        (marked failed) until its W, which releases its buffers and ``hold``."""
        grads = () if self.is_first else zeros(grad_metas(self.in_metas_of(mb)), self.device)
        if split:
            st = self._state.get(mb)
            if st is None:
                st = self._state[mb] = _MicrobatchState((), (), (), failed=True)
            st.failed = True
            st.buffers = tuple(st.buffers) + tuple(hold)
            return grads, ()
        st = self._state.pop(mb, None)
        return grads, (st.buffers if st is not None else ())

    def reset_step(self) -> None:
        self._state.clear()
        self.output_chunks = []
        self.losses = []
        begin = getattr(self.submod, "begin_step", None)
        if callable(begin):  # a module that counts its microbatches (accumulation.py)
            begin()
