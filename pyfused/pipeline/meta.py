"""Agreeing on activation shapes: one metadata pass down the pipeline on the first step.

Each rank walks its stages in increasing stage order. Stage ``s`` receives a fixed-size header from
stage ``s-1`` (the shapes and dtypes of the activation, or "failed upstream"), runs its module once
under ``no_grad`` on zeros of those shapes (skipped when ``output_args`` declares the result), and
sends its own header on. Because the header has a fixed length the exchange itself cannot
mismatch, and because every rank walks its stages in stage order it cannot deadlock. One
agreement at the end (errors.raise_if_any) then fails every rank if any stage failed, e.g. a
stage whose output the next stage cannot take, or a declaration that does not match.

The pass runs again whenever the first stage's microbatch shapes change (every rank learns them
from the per-step argument check), so a new batch size is handled without a restart.

Uneven microbatches: the header also carries ``n_large``, how many microbatches are one row larger
than the rest (``batch % n_microbatches``, known on the first stage's rank). When it is not zero,
every rank has learnt so from the first pass, and a second pass agrees on the shapes of the smaller
microbatches (``PipelineStage.small_metas``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm
from ..comm.validate import SIG_LEN
from .plan import stage_rank
from .stage import Metas, PipelineStage, as_tuple, describe, metas_of, zeros

_HEADER = comm.op_code("pipeline.activation_header")
_MAX_TENSORS = (SIG_LEN - 5) // 12  # what fits in one fixed-size header
SHAPES = "pipeline shape exchange"  # what a failed header transfer is reported as
_OK, _FAILED = 0, 1


def _encode(status: int, n_large: int, metas: Metas, device: torch.device) -> torch.Tensor:
    sig = comm.Signature(_HEADER, (status, n_large), tuple(comm.TensorMeta(m.shape, m.dtype, "cpu")
                                                   for m in metas))
    return torch.tensor(sig.encode(), dtype=torch.int64, device=device)


def _decode(header: torch.Tensor) -> Tuple[int, int, Metas]:
    sig = comm.Signature.decode(header.tolist())
    return sig.ints[0], sig.ints[1], tuple(comm.TensorMeta(t.shape, t.dtype, None)
                                           for t in sig.tensors)


def infer_all(stages: Sequence[PipelineStage], pg, large: Optional[Tuple[torch.Tensor, ...]],
              small: Optional[Tuple[torch.Tensor, ...]], n_large: int, p: int,
              v_shaped: bool = False) -> Optional[str]:
    """Agree on the activation shapes of every microbatch: one pass for the (larger) first
    microbatch ``large`` and, when the split is uneven, one for the smaller last one ``small``.
    ``large``, ``small`` and ``n_large`` are known on the first stage's rank only."""
    for st in stages:
        st.small_metas = None
    error, n_large = infer(stages, pg, large, p, v_shaped, n_large)
    if n_large and error is None:
        saved = [(st.in_metas, st.out_metas) for st in stages]
        error, _ = infer(stages, pg, small, p, v_shaped, n_large, small_pass=True)
        for st, (in_m, out_m) in zip(stages, saved):
            st.small_metas = (n_large, st.in_metas, st.out_metas)
            st.in_metas, st.out_metas = in_m, out_m
    return error


def infer(stages: Sequence[PipelineStage], pg, first_inputs: Optional[Tuple[torch.Tensor, ...]],
          p: int, v_shaped: bool = False, n_large: int = 0, small_pass: bool = False
          ) -> Tuple[Optional[str], int]:
    """Set ``in_metas``/``out_metas`` of this rank's ``stages``; return (this rank's error or None,
    ``n_large`` as the first stage's rank sent it).

    ``first_inputs`` is one microbatch of the first stage's arguments (on the rank that has it)."""
    error: Optional[str] = None
    local: dict = {}  # stage -> header, when the next stage lives on this rank too
    comm_dev = comm.comm_device(pg)
    wait_s = comm.faults.transfer_timeout(pg, comm_dev)  # the group's timeout (p2p.py says why)
    for stage in sorted(stages, key=lambda s: s.stage_index):
        s = stage.stage_index
        upstream_failed = False
        if stage.is_first:
            in_metas = metas_of(first_inputs)
        else:
            if stage_rank(s - 1, p, v_shaped) == stage_rank(s, p, v_shaped):
                status, n_large, in_metas = local.pop(s - 1)
            else:
                header = torch.empty(SIG_LEN, dtype=torch.int64, device=comm_dev)
                peer = stage_rank(s - 1, p, v_shaped)
                with comm.failures_named(SHAPES, pg, ("stage", s, "receiving"), peer):
                    dist.irecv(header, group=pg, group_src=peer).wait(wait_s)
                status, n_large, in_metas = _decode(header)
            upstream_failed = status != _OK
        out_metas: Metas = ()
        status = _FAILED
        if not upstream_failed:
            try:
                out_metas = _stage_outputs(stage, in_metas, first_inputs, small_pass)
                status = _OK
            except Exception as e:  # reported on every rank by the caller
                error = error or f"stage {s}: {e}"
        if not stage.is_last:
            if len(out_metas) > _MAX_TENSORS:
                error = error or (f"stage {s} returns {len(out_metas)} tensors; at most "
                                  f"{_MAX_TENSORS} may pass between two stages")
                status, out_metas = _FAILED, ()
            if stage_rank(s + 1, p, v_shaped) == stage_rank(s, p, v_shaped):
                local[s] = (status, n_large, out_metas)
            else:
                peer = stage_rank(s + 1, p, v_shaped)
                with comm.failures_named(SHAPES, pg, ("stage", s, "sending"), peer):
                    dist.isend(_encode(status, n_large, out_metas, comm_dev), group=pg,
                               group_dst=peer).wait(wait_s)
    return error, n_large


def _stage_outputs(stage: PipelineStage, in_metas: Metas,
                   first_inputs: Optional[Tuple[torch.Tensor, ...]], small_pass: bool) -> Metas:
    """The stage's output shapes for ``in_metas``. Declared shapes describe the first microbatch;
    the smaller microbatches of an uneven split are always run."""
    s = stage.stage_index
    if small_pass:
        stage.in_metas = in_metas
        return _run_for_shapes(stage, in_metas, first_inputs)
    if stage.declared_in is not None and stage.declared_in != in_metas:
        raise ValueError(f"input_args declares {describe(stage.declared_in)} but stage "
                         f"{'0 is given' if stage.is_first else f'{s - 1} produces'} "
                         f"{describe(in_metas)} per microbatch")
    stage.in_metas = in_metas
    if stage.declared_out is not None:
        stage.out_metas = stage.declared_out
        return stage.out_metas
    return _run_for_shapes(stage, in_metas, first_inputs)


def _run_for_shapes(stage: PipelineStage, in_metas: Metas,
                    first_inputs: Optional[Tuple[torch.Tensor, ...]]) -> Metas:
    s = stage.stage_index
    inputs = first_inputs if stage.is_first else zeros(in_metas, stage.device)
    try:
        with torch.no_grad():
            out = stage.submod(*inputs)
    except Exception as e:
        raise RuntimeError(f"its module failed on the activation it receives, {describe(in_metas)} "
                      f"(from {'the step inputs' if stage.is_first else f'stage {s - 1}'}): "
                      f"{e}") from e
    outs = as_tuple(out)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError("a stage must return a tensor or a tuple of tensors, got "
                        + ", ".join(type(o).__name__ for o in outs))
    stage.out_metas = metas_of(outs)
    return stage.out_metas


def describe_all(stages: List[PipelineStage]) -> str:
    return "; ".join(f"stage {st.stage_index}: {describe(st.in_metas)} -> {describe(st.out_metas)}"
                     for st in stages)
