"""Running one rank's plan: post, wait, compute, in the order plan.py fixed.

A B directly followed in the rank's order by the W of the same stage and microbatch runs as one
unsplit backward (``fuses_weight``): the same gradients, one autograd pass instead of two (on CPU
the split pair costs 15-20 % more than the unsplit backward of a 2-block stage), and the W's step
then only posts its transfers. The plan is unchanged: B's result is posted by the W's step either
way, after the W's compute instead of before it. A step that measures costs keeps the pair split,
so that B and W are timed apart.

A stage that raises does not stop the loop: it records the first error, hands zeros of the agreed
shapes to whoever expects its result, and the loop runs to the end so that every transfer of every
rank finds its partner. The caller then fails the step on every rank (errors.raise_if_any). A
communication failure is the exception: a failed transfer, or a stage's own collective that lost a
peer (``PeerFailure``), ends the step on this rank at once -- its peers' transfers can no longer all
find their partners, and each of them raises within the group's timeout.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import comm
from .p2p import Transport
from .plan import ACT, BACKWARD, FORWARD, WEIGHT, Action, Message, Step, needed, produced, stage_rank
from .stage import PipelineStage, grad_metas


class StepRun:
    def __init__(self, stages: Sequence[PipelineStage], transport: Transport, p: int, *,
                 backward: bool, loss_fn, scale: Sequence[float], arg_mbs: List[Tuple],
                 target_mbs: Optional[List], recorder=None, split_backward: bool = False,
                 v_shaped: bool = False, meter=None):
        self.stages: Dict[int, PipelineStage] = {st.stage_index: st for st in stages}
        self.num_stages = stages[0].num_stages
        self.tr = transport
        self.p = p
        self.backward = backward
        self.loss_fn = loss_fn
        self.scale = scale  # per microbatch: the factor of its loss
        self.split = split_backward  # B computes input gradients only; W the weight gradients
        self.v_shaped = v_shaped
        self.arg_mbs = arg_mbs
        self.target_mbs = target_mbs
        self.recorder = recorder
        self.meter = meter  # a costs.CostMeter: times every compute action of this step
        self.error: Optional[str] = None
        self._outbox: Dict[Message, Tuple[torch.Tensor, ...]] = {}  # produced, not yet posted
        self._local: Dict[Message, Tuple[torch.Tensor, ...]] = {}   # for a stage on this rank

    def _remote(self, msg: Message) -> bool:
        return self._rank_of(msg.src_stage) != self._rank_of(msg.dst_stage)

    def _rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.p, self.v_shaped)

    def _recv_buffers(self, msg: Message) -> Tuple[torch.Tensor, ...]:
        receiver = self.stages[msg.dst_stage]
        metas = (receiver.in_metas_of(msg.mb) if msg.kind == ACT
                 else grad_metas(receiver.out_metas_of(msg.mb)))
        return tuple(self.tr.pool.acquire(m) for m in metas)

    def _input(self, msg: Optional[Message], remote: bool) -> Tuple[torch.Tensor, ...]:
        if msg is None:
            return ()
        return self.tr.wait_recv(msg) if remote else self._local.pop(msg)

    def _release(self, buffers) -> None:
        for b in buffers:
            self.tr.pool.release(b)

    def _fail(self, what: str, e: BaseException) -> None:
        # a collective of the stage's own (TP, DDP, FSDP) lost a peer: raise now, as a failed
        # transfer does; going on would add a wait of up to the group's timeout per transfer
        if isinstance(e, comm.PeerFailure):
            raise e
        if comm.faults.is_comm_failure(e):
            raise comm.faults.peer_failure(e, f"pipeline {what}", self.tr.pg) from e
        if self.error is None:
            self.error = f"{what}: {type(e).__name__}: {e}"

    def run(self, steps: Sequence[Step]) -> None:
        tr = self.tr
        tr.reset()
        tr.recorder = self.recorder
        fused: Optional[Action] = None  # the W already run by its B's unsplit backward
        try:
            for k, step in enumerate(steps):
                sends = [(m, self._rank_of(m.dst_stage), self._outbox.pop(m)) for m in step.sends]
                recvs = [(m, self._rank_of(m.src_stage), self._recv_buffers(m))
                         for m in step.recvs]
                tr.post(sends, recvs)
                if step.action is None or step.action == fused:  # only transfers
                    continue
                a = step.action
                st = self.stages[a.stage]
                need = needed(a, self.num_stages)
                received = self._input(need, bool(step.waits))
                bufs = received if step.waits else ()
                t0 = time.perf_counter()
                if a.op == FORWARD:
                    out = self._forward(st, a.mb, received, bufs)
                elif a.op == BACKWARD:
                    whole = self.fuses_weight(a, steps[k + 1].action if k + 1 < len(steps) else None)
                    fused = Action(WEIGHT, a.stage, a.mb) if whole else None
                    out = self._backward(st, a.mb, received, bufs, whole)
                else:
                    out = self._weight(st, a.mb)
                if self.recorder is not None or self.meter is not None:
                    t1 = time.perf_counter()
                    if self.recorder is not None:
                        self.recorder.compute(a, t0, t1)
                    if self.meter is not None:
                        self.meter.add(a, (t1 - t0) * 1e3)
                msg = produced(a, self.num_stages)
                if msg is not None:
                    (self._outbox if self._remote(msg) else self._local)[msg] = out
            tr.finish()
        finally:
            tr.recorder = None

    def fuses_weight(self, b: Action, following: Optional[Action]) -> bool:
        """Whether B ``b`` runs as one unsplit backward with ``following``, the next action of the
        rank's order: its own W, the stage's forward succeeded, and no cost is being measured."""
        return (self.split and self.meter is None and following == Action(WEIGHT, b.stage, b.mb)
                and self.stages[b.stage].forward_ok(b.mb))

    def _forward(self, st: PipelineStage, mb: int, received, bufs) -> Tuple[torch.Tensor, ...]:
        inputs = self.arg_mbs[mb] if st.is_first else received
        target = self.target_mbs[mb] if (st.is_last and self.target_mbs is not None) else None
        loss_fn = self.loss_fn if target is not None else None
        try:
            outs = st.forward_one(mb, inputs, bufs, grad=self.backward, target=target,
                                  loss_fn=loss_fn)
        except Exception as e:
            self._fail(f"stage {st.stage_index} failed in the forward of microbatch {mb}", e)
            outs = st.forward_failed(mb, bufs)
        if not self.backward:
            self._release(st.drop(mb))
        return tuple(o.detach().contiguous() for o in outs)

    def _backward(self, st: PipelineStage, mb: int, grads_in, grad_bufs, whole: bool = False
                  ) -> Tuple[torch.Tensor, ...]:
        """B of ``mb``, or with ``whole`` (or an unsplit schedule) its whole backward."""
        split = self.split and not whole
        hold = grad_bufs if split else ()  # W may still read the received gradient
        if st.forward_ok(mb):
            try:
                grads, bufs = st.backward_one(mb, grads_in, self.scale[mb], split, hold)
            except Exception as e:
                self._fail(f"stage {st.stage_index} failed in the backward of microbatch {mb}", e)
                grads, bufs = st.backward_failed(mb, split, hold)
        else:  # its forward failed (already recorded): zeros keep the transfers matched
            grads, bufs = st.backward_failed(mb, split, hold)
        self._release(bufs)
        if not split:
            self._release(grad_bufs)
        return tuple(g.detach().contiguous() for g in grads)

    def _weight(self, st: PipelineStage, mb: int) -> Tuple:
        if st.forward_ok(mb):
            try:
                self._release(st.backward_weight_one(mb))
            except Exception as e:
                self._fail(f"stage {st.stage_index} failed in the weight gradients of microbatch "
                           f"{mb}", e)
                self._release(st.weight_failed(mb))
        else:
            self._release(st.weight_failed(mb))
        return ()
