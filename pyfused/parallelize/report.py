"""What ``parallelize`` did to each module, and which op method each parallel layer's call ran.

``ParallelModel.report()`` returns a ``ParallelizeReport``: per module of the plan (on this rank's
pipeline stage), the style applied, the module it became, its communication, and the method of its
GEMM + collective op -- ``unfused``, ``decomposed`` or ``fused`` -- with the reason. A method the
user asked for (``overlap="decomposed"``...) is reported as requested; under ``overlap="auto"`` the
op chooses per call from the shapes it sees (pyfused.ops: the tuned entry, else a size rule), so
the report shows the choices of the first call of the model, recorded by ``MethodRecorder``.
``parallelize(..., verbose=True)`` prints the report on global rank 0 after parallelizing and again
once the first call has recorded the methods.

The recorder reads the ops' own account of their choice: ``pyfused.ops.observe_methods`` calls
it with the method and reason of every op call prepared during the first call, which it notes
against the parallel layer running it (forward pre/post hooks on the parallel layers).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

# layer class -> (op whose method is chosen per call, or None; what it communicates)
COMMUNICATION = {
    "SequenceParallelColumn": ("all_gather_matmul", "all-gather of the sequence shard + GEMM "
                               "(backward: GEMM + reduce-scatter)"),
    "LocalInputColumn": (None, "local GEMM on the input its attention module gathered"),
    "ColumnParallelLinear": (None, "local GEMM (backward: all-reduce of the input gradient, async "
                             "under the weight-gradient GEMM unless overlap='unfused')"),
    "VocabParallelHead": (None, "local GEMM + all-gather of the logits (vocabulary padded)"),
    "SequenceParallelRow": ("matmul_reduce_scatter", "GEMM + reduce-scatter to the sequence shard"),
    "RowParallelLinear": ("matmul_all_reduce", "GEMM + all-reduce"),
    "VocabParallelEmbedding": (None, "lookup of this rank's rows + all-reduce"),
    "ColumnShardedRMSNorm": (None, "all-reduce of the squares' sums over the full width"),
    "ExpertParallelExperts": ("moe_dispatch", "all-to-all of the tokens to this rank's experts + "
                              "grouped GEMM, and back (moe_dispatch, moe_combine over ep)"),
}
STYLE_NOTES = {
    "sequence_parallel": "runs on the sequence shard; weight gradients all-reduced",
    "head_shared": "replicated, runs on this rank's heads; gradients all-reduced",
    "replicate": "replicated, full tensors",
    "blocks": "sequence-parallel region / pipeline units",
}


@dataclass
class ModuleReport:
    name: str
    style: str
    module: str  # class of the module after parallelize
    communication: str
    op: Optional[str] = None
    method: str = ""  # unfused | decomposed | fused, or "" (no op with a method)
    why: str = ""


@dataclass
class ParallelizeReport:
    mesh: str
    sequence_parallel: bool
    overlap: str
    modules: List[ModuleReport] = field(default_factory=list)

    def methods(self) -> Dict[str, int]:
        """How many modules ran each method (``unfused`` / ``decomposed`` / ``fused``)."""
        counts: Dict[str, int] = {}
        for m in self.modules:
            if m.method:
                counts[m.method] = counts.get(m.method, 0) + 1
        return counts

    def __str__(self) -> str:
        head = (f"pyfused.parallelize: mesh {self.mesh}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap!r}; methods: {self.methods() or 'none recorded yet'}")
        width = max([len(m.name) for m in self.modules] + [6])
        lines = [head]
        for m in self.modules:
            method = f" | {m.op}: {m.method} ({m.why})" if m.op else ""
            lines.append(f"  {m.name:<{width}}  {m.style:<22} {m.module}: {m.communication}{method}")
        return "\n".join(lines)


def build_report(model: nn.Module, styles: Dict[str, str], mesh: str, sequence_parallel: bool,
                 overlap: str, choices: Dict[str, Dict[str, Tuple[str, str]]]) -> ParallelizeReport:
    report = ParallelizeReport(mesh, sequence_parallel, overlap)
    modules = dict(model.named_modules())
    blocks = [n + "." for n, s in styles.items() if s == "blocks"]
    for name, style in styles.items():
        m = modules.get(name)
        if m is None or getattr(m, "pyfused_placeholder", False):
            continue  # on another pipeline stage
        cls = type(m).__name__
        note = STYLE_NOTES.get(style, "")
        if style == "replicate" and sequence_parallel and any(name.startswith(b) for b in blocks):
            note = STYLE_NOTES["sequence_parallel"]  # in the region: on the shard, like a norm
        op, what = COMMUNICATION.get(cls, (None, note))
        if style == "colwise_gather_output" and cls == "ColumnParallelLinear":
            what = "local GEMM + all-gather of the logits (backward: all-reduce of the input gradient)"
        if style in ("attention", "attention_sequence_sharded"):
            what = "head counts divided" + (", input gathered once" if style == "attention" and
                                            sequence_parallel else "")
        row = ModuleReport(name, style, cls, what, op)
        if op is not None:
            if overlap != "auto":
                row.method, row.why = overlap, "requested"
            elif op in choices.get(name, {}):
                row.method, row.why = choices[name][op]
            else:
                row.method, row.why = "", "not called yet"
        report.modules.append(row)
    return report


class MethodRecorder:
    """Records the ops' method choices against the parallel layer that made them."""

    def __init__(self):
        self.current: List[str] = []
        self.choices: Dict[str, Dict[str, Tuple[str, str]]] = {}

    def note(self, op: str, choice) -> None:
        if self.current:
            self.choices.setdefault(self.current[-1], {}).setdefault(op, (choice.method, choice.reason))

    @contextlib.contextmanager
    def recording(self, model: nn.Module):
        from ..ops import observe_methods

        def enter(name):
            def hook(module, args):
                self.current.append(name)
            return hook

        def leave(module, args, output):
            self.current.pop()

        handles = []
        for name, m in model.named_modules():
            if COMMUNICATION.get(type(m).__name__, (None,))[0]:
                handles.append(m.register_forward_pre_hook(enter(name)))
                handles.append(m.register_forward_hook(leave))
        try:
            with observe_methods(self.note):
                yield
        finally:
            for h in handles:
                h.remove()
            self.current.clear()
