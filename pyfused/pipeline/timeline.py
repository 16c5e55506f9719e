"""Recording one step: compute and transfer events per rank, gathered to every rank, drawn on one.

Set ``schedule.timeline = Recorder()`` (after a barrier, so that the ranks' clocks start together)
and run a step; every compute, every batched post and every blocking wait for a receive is recorded
with host timestamps (``time.perf_counter``, which on Linux is one clock for all processes of a
machine). ``gather`` collects all ranks' events, ``bubble`` measures the idle fraction and ``draw``
writes a PNG. On CUDA the timestamps are host times of enqueueing, not kernel times.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

from .. import comm
from .plan import Action, Message


def _msg(m: Message) -> tuple:
    return (m.kind, m.src_stage, m.mb)


class Recorder:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: List[Dict] = []

    def compute(self, action: Action, start: float, end: float) -> None:
        self.events.append({"kind": "compute", "op": action.op, "stage": action.stage,
                            "mb": action.mb, "start": start - self.t0, "end": end - self.t0})

    def post(self, start: float, end: float, sends: List[Message], recvs: List[Message]) -> None:
        self.events.append({"kind": "post", "start": start - self.t0, "end": end - self.t0,
                            "sends": [_msg(m) for m in sends], "recvs": [_msg(m) for m in recvs]})

    def wait(self, msg: Message, start: float, end: float) -> None:
        self.events.append({"kind": "wait", "msg": _msg(msg), "start": start - self.t0,
                            "end": end - self.t0})


def gather(recorder: Recorder, group=None) -> List[List[Dict]]:
    """Every rank's events, in group-rank order (one ``agree_on`` over the pipeline group)."""
    return comm.agree_on(comm.resolve_group(group), "pipeline timeline", recorder.events)


def span(events_by_rank: List[List[Dict]]) -> float:
    return max((e["end"] for evs in events_by_rank for e in evs), default=0.0)


def bubble(events_by_rank: List[List[Dict]]) -> float:
    """Mean over ranks of the fraction of the step (first start to last end, over all ranks) that
    a rank spent outside its own compute."""
    total = span(events_by_rank)
    if total <= 0:
        return float("nan")
    idle = [1 - sum(e["end"] - e["start"] for e in evs if e["kind"] == "compute") / total
            for evs in events_by_rank]
    return sum(idle) / len(idle)


def planned(times: Dict[Action, Tuple[float, float]], rank_of: Callable[[int], int],
            p: int) -> List[List[Dict]]:
    """The compute events of a replayed order (``zero_bubble.replay``: milliseconds per action)
    in the recorder's format, one list per rank, for ``draw``'s ``predicted`` panel."""
    out: List[List[Dict]] = [[] for _ in range(p)]
    for a, (start, end) in sorted(times.items(), key=lambda kv: kv[1]):
        out[rank_of(a.stage)].append({"kind": "compute", "op": a.op, "stage": a.stage,
                                      "mb": a.mb, "start": start / 1e3, "end": end / 1e3})
    return out


def draw(events_by_rank: List[List[Dict]], path, title: str,
         predicted: Optional[List[List[Dict]]] = None, predicted_title: str = "") -> None:
    """One row per rank: forward (blue), backward (green; input gradients only in a split
    schedule) and weight-gradient (purple) compute labelled stage.microbatch,
    time spent posting a batch of transfers (black, above), time blocked on a receive (red,
    below), and a grey line per transfer from the sender's post to the end of the receiver's wait.
    With ``predicted`` (``planned`` events), a second panel on the same time axis below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(events_by_rank)
    if predicted is None:
        fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * n))
    else:
        fig, (ax, ax_pred) = plt.subplots(2, 1, figsize=(12, 1.6 + 1.6 * n), sharex=True)
        _panel(ax_pred, predicted, predicted_title)
    _panel(ax, events_by_rank, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _panel(ax, events_by_rank: List[List[Dict]], title: str) -> None:
    n = len(events_by_rank)
    sent_at, received_at = {}, {}
    for rank, evs in enumerate(events_by_rank):
        y = n - 1 - rank
        for e in evs:
            ms = (e["start"] * 1e3, (e["end"] - e["start"]) * 1e3)
            if e["kind"] == "compute":
                color = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2"}[e["op"]]
                ax.broken_barh([ms], (y - 0.35, 0.7), facecolors=color, edgecolor="black", lw=0.3)
                if ms[1] > 0.02 * span(events_by_rank) * 1e3:
                    ax.text(ms[0] + ms[1] / 2, y, f"{e['op']}{e['stage']}.{e['mb']}", ha="center",
                            va="center", fontsize=6, color="white")
            elif e["kind"] == "wait":
                ax.broken_barh([ms], (y - 0.45, 0.1), facecolors="#C44E52")
                received_at[tuple(e["msg"])] = (e["end"] * 1e3, y)
            elif e["kind"] == "post":
                ax.broken_barh([ms], (y + 0.38, 0.08), facecolors="black")
                for m in e["sends"]:
                    sent_at[tuple(m)] = (e["start"] * 1e3, y)
    for key, (t_send, y_send) in sent_at.items():
        if key in received_at:
            t_recv, y_recv = received_at[key]
            ax.plot([t_send, t_recv], [y_send - 0.4, y_recv + 0.4], color="grey", lw=0.5,
                    alpha=0.6)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {n - 1 - i}" for i in range(n)])
    ax.set_xlabel("ms since the step started")
    ax.set_title(title, fontsize=9)
