"""Pure planning: which compute each rank runs in which order, and when each transfer is posted.

Nothing here touches torch.distributed, so every rank computes the identical plan from the same four
numbers (ranks ``p``, stages per rank ``v``, microbatches ``m``, forward-only or not), and the tests
check the plan itself with a simulator instead of hoping a multi-rank run happens to hit a race.

Placement is torch's "loop" style (stage ``s`` on group rank ``s % p``), or for ZBV and DualPipeV its
"v" style (stage ``s`` on rank ``s`` for ``s < p``, on rank ``2p-1-s`` after).

Orders (one list of ``Action`` per rank):
  * GPipe: all forwards, then all backwards.
  * 1F1B: ``p - 1 - rank`` warm-up forwards, then alternate one forward and one backward, then the
    remaining backwards (PipeDream-flush).
  * Interleaved 1F1B (Narayanan et al. 2021, torch's flexible variant): microbatches go through each
    local stage in rounds of ``mpr = m // max(1, m // p)`` (``m`` must be a multiple of the number
    of rounds); ``(v - 1) * mpr + 2 * (p - 1 - rank)`` warm-up forwards, then F/B pairs, then the
    remaining backwards.
  * Split-backward schedules (ZB-H1, interleaved zero bubble, ZBV, DualPipeV): actions F, B (input
    gradients) and W (weight gradients, no message), ordered by zero_bubble.py.

Messages: a forward of stage ``s < S-1`` produces ``act(s, mb)`` for stage ``s+1``; a backward of stage
``s > 0`` produces ``grad(s, mb)`` (the gradient of stage ``s``'s input) for stage ``s-1``.

Communication plan of a rank on gloo (``build_plan``): one ``Step`` per compute action. Step ``k``
  1. posts, as ONE ``batch_isend_irecv``, the sends of action ``k-1`` and the receives of every input
     that actions ``k .. k+lookahead`` need and that are not posted yet;
  2. waits for the receives action ``k`` needs;
  3. runs action ``k``.
So with ``lookahead=2`` the receive of the next microbatch is posted before the current compute, and
in the steady 1F1B phase each batch carries one forward and one backward transfer (after a backward:
its gradient send + the next-but-one forward's activation receive). Sends are never waited for in
the loop; the executor completes them lazily (at the end of the step, or when too many are open).

Matching: NCCL and gloo pair the k-th send from rank a to rank b with the k-th receive that b posts
from a (pyfused does not use tags, which NCCL ignores). A receiver therefore posts receives in the
*sender's production order*: to post message M from rank a it first posts every earlier message of
a -> b. ``simulate`` checks this pairing and that no rank waits forever, both for per-operation
completion (gloo) and for NCCL, which runs a rank's batches in order on one stream and completes a
receive only while its send's batch runs. Under NCCL's model a receive posted ahead holds back every
later send of its rank (2-stage 1F1B with lookahead 2 deadlocks: stage 0's first batch waits for
the gradient of microbatch 0, stage 1's for the activations of microbatches 0 and 1, which stage 0
sends in its next batches), so on NCCL the plan is ``build_lockstep_plan``'s: one batch per unit
tick whose operations all pair with the peers' batches of the same tick.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .actions import (  # noqa: F401  (local_stages: re-exported with the rest of the vocabulary)
    BACKWARD,
    FORWARD,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    WEIGHT,
    Action,
    local_stages,
    rounds,
    stage_rank,
)
from .cost_orders import Costs, measured_orders
from .zero_bubble import replay, zero_bubble_orders

ACT, GRAD = "act", "grad"
DEFAULT_LOOKAHEAD = 2


@dataclass(frozen=True)
class Message:
    kind: str  # ACT (to stage src+1) or GRAD (to stage src-1)
    src_stage: int
    mb: int

    @property
    def dst_stage(self) -> int:
        return self.src_stage + 1 if self.kind == ACT else self.src_stage - 1

    def __str__(self) -> str:
        return f"{self.kind}[{self.src_stage}->{self.dst_stage}, mb {self.mb}]"


@dataclass(frozen=True)
class Step:
    sends: Tuple[Message, ...]   # remote messages produced by the previous action
    recvs: Tuple[Message, ...]   # receives newly posted here, in per-sender production order
    waits: Tuple[Message, ...]   # remote inputs of ``action``
    action: Optional[Action]     # None: a tick that only transfers, or the closing step


def check_counts(schedule: str, p: int, v: int, m: int) -> Optional[str]:
    """Why (p, v, m) cannot run ``schedule``, or None. Pure, so every rank gives the same answer."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}"
    if p < 1 or v < 1:
        return f"need at least one rank and one stage per rank (got {p} ranks, {v} stages per rank)"
    if m < 1:
        return f"n_microbatches must be >= 1, got {m}"
    if schedule in V_SHAPED and v != 2:
        return (f"{schedule} runs exactly 2 stages per rank in a V (rank r holds stages r and "
                f"2p-1-r, so num_stages must be 2 x the group size); got {v} stages per rank")
    if schedule in ("gpipe", "1f1b", "zbh1") and v != 1:
        return (f"{schedule} runs one stage per rank; got {v} (use ScheduleInterleaved1F1B or "
                f"ScheduleInterleavedZeroBubble)")
    if schedule == "interleaved_1f1b":
        n_rounds, _ = rounds(p, m)
        if m % n_rounds:
            return (f"interleaved 1F1B with {p} ranks needs n_microbatches to be a multiple of the "
                    f"number of rounds max(1, m // p) = {n_rounds}; got {m}")
    return None


def rank_order(schedule: str, rank: int, p: int, v: int, m: int, backward: bool) -> List[Action]:
    """The compute actions of ``rank``, in execution order."""
    err = check_counts(schedule, p, v, m)
    if err:
        raise ValueError(err)
    if schedule == "interleaved_1f1b":
        return _interleaved_order(rank, p, v, m, backward)
    if schedule in SPLIT_BACKWARD:
        return list(zero_bubble_orders(schedule, p, v, m, backward)[rank])
    fwd = [Action(FORWARD, rank, i) for i in range(m)]
    if not backward:
        return fwd
    bwd = [Action(BACKWARD, rank, i) for i in range(m)]
    if schedule == "gpipe":
        return fwd + bwd
    warmup = min(m, p - 1 - rank)
    order = fwd[:warmup]
    for i in range(m - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[m - warmup:]


def _interleaved_order(rank: int, p: int, v: int, m: int, backward: bool) -> List[Action]:
    _, mpr = rounds(p, m)
    total = v * m

    def mb_of(k: int) -> int:
        return (k // (mpr * v)) * mpr + k % mpr

    def fwd(k: int) -> Action:
        return Action(FORWARD, ((k // mpr) % v) * p + rank, mb_of(k))

    def bwd(k: int) -> Action:
        return Action(BACKWARD, (v - 1 - (k // mpr) % v) * p + rank, mb_of(k))

    if not backward:
        return [fwd(k) for k in range(total)]
    warmup = min(total, (v - 1) * mpr + 2 * (p - 1 - rank))
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def produced(action: Action, num_stages: int) -> Optional[Message]:
    if action.op == WEIGHT:
        return None
    if action.op == FORWARD:
        return Message(ACT, action.stage, action.mb) if action.stage < num_stages - 1 else None
    return Message(GRAD, action.stage, action.mb) if action.stage > 0 else None


def needed(action: Action, num_stages: int) -> Optional[Message]:
    if action.op == WEIGHT:
        return None
    if action.op == FORWARD:
        return Message(ACT, action.stage - 1, action.mb) if action.stage > 0 else None
    return Message(GRAD, action.stage + 1, action.mb) if action.stage < num_stages - 1 else None


def build_plan(orders: Dict[int, List[Action]], p: int, num_stages: int,
               lookahead: int = DEFAULT_LOOKAHEAD, v_shaped: bool = False) -> Dict[int, List[Step]]:
    """The communication plan of every rank (see the module docstring)."""
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")

    def remote(msg: Message) -> bool:
        return stage_rank(msg.src_stage, p, v_shaped) != stage_rank(msg.dst_stage, p, v_shaped)

    # Per (sender, receiver): messages in the order the sender produces them.
    fifo: Dict[Tuple[int, int], List[Message]] = defaultdict(list)
    for src, order in orders.items():
        for a in order:
            msg = produced(a, num_stages)
            if msg is not None and remote(msg):
                fifo[src, stage_rank(msg.dst_stage, p, v_shaped)].append(msg)
    position = {(pair, msg): i for pair, msgs in fifo.items() for i, msg in enumerate(msgs)}

    plans: Dict[int, List[Step]] = {}
    for rank, order in orders.items():
        posted_upto: Dict[int, int] = defaultdict(int)  # sender -> how many of its messages posted
        steps: List[Step] = []
        for k in range(len(order) + 1):
            prev = produced(order[k - 1], num_stages) if k > 0 else None
            sends = (prev,) if prev is not None and remote(prev) else ()
            recvs: List[Message] = []
            for a in order[k:k + lookahead + 1]:
                msg = needed(a, num_stages)
                if msg is None or not remote(msg):
                    continue
                src = stage_rank(msg.src_stage, p, v_shaped)
                pair = (src, rank)
                target = position[pair, msg] + 1
                recvs += fifo[pair][posted_upto[src]:target]
                posted_upto[src] = max(posted_upto[src], target)
            action = order[k] if k < len(order) else None
            need = needed(action, num_stages) if action is not None else None
            waits = (need,) if need is not None and remote(need) else ()
            steps.append(Step(sends, tuple(recvs), waits, action))
        plans[rank] = steps
    return plans


def build_lockstep_plan(orders: Dict[int, List[Action]], p: int, num_stages: int,
                        v_shaped: bool = False) -> Dict[int, List[Step]]:
    """The plan of every rank for NCCL: transfers in batches that pair up across ranks.

    NCCL runs a rank's p2p batches one after another on one stream, and a receive completes only
    while the batch holding its send runs. A receive posted ahead therefore holds every later send
    of its rank until its sender gets there, and a send waits for the batch of its receive; both
    can close a cycle (``simulate``, ``grouped=True``). Here every action gets a tick, its rank's
    previous action's and its remote input's producer's tick plus one (unit-time, as soon as
    possible), and at tick t each rank posts ONE batch: the send of what it produced at t-1 and the
    receives of what its peers produced at t-1. Each batch's partners are all in the peers' batches
    of the same tick, so by induction on t every batch starts once the earlier ticks' have
    completed: no cycle, whatever the ranks' real speeds. A tick without an action of the rank
    (``action=None`` before the last step) only posts its transfers."""
    try:  # unit-time start of every action: its tick
        tick = {a: int(start) for a, (start, _) in
                replay(orders, p, num_stages, v_shaped, lambda a: 1.0).items()}
    except RuntimeError as e:
        raise PlanError(f"no lock-step plan: {e}") from None
    at: Dict[int, Dict[int, Action]] = {r: {tick[a]: a for a in order} for r, order in orders.items()}

    def rank_of(stage: int) -> int:
        return stage_rank(stage, p, v_shaped)

    arriving: Dict[Tuple[int, int], List[Message]] = defaultdict(list)  # (rank, tick) -> recvs
    for a, t in sorted(tick.items(), key=lambda item: (item[1], str(item[0]))):
        msg = produced(a, num_stages)
        if msg is not None and rank_of(msg.src_stage) != rank_of(msg.dst_stage):
            arriving[rank_of(msg.dst_stage), t + 1].append(msg)
    last = max(tick.values(), default=-1) + 1
    plans: Dict[int, List[Step]] = {}
    for rank in orders:
        steps: List[Step] = []
        for t in range(last + 1):
            prev = produced(at[rank][t - 1], num_stages) if t - 1 in at[rank] else None
            sends = (prev,) if prev is not None and rank_of(prev.dst_stage) != rank else ()
            recvs = tuple(arriving[rank, t])
            action = at[rank].get(t)
            need = needed(action, num_stages) if action is not None else None
            waits = (need,) if need is not None and rank_of(need.src_stage) != rank else ()
            if action is not None or sends or recvs or t == last:
                steps.append(Step(sends, recvs, waits, action))
        plans[rank] = steps
    return plans


class PlanError(RuntimeError):
    """The plan would pair a send with the wrong receive, or leave a rank waiting forever."""


def simulate(orders: Dict[int, List[Action]], plans: Dict[int, List[Step]], p: int,
             num_stages: int, grouped: bool, v_shaped: bool = False) -> None:
    """Run the plans on an abstract network; raise ``PlanError`` on a mismatch or a deadlock.

    ``grouped=False``: each send/receive completes once its partner is posted (gloo).
    ``grouped=True``: NCCL, whose p2p groups run as kernels on one stream per rank. A batch starts
    only when every earlier batch of its rank has completed; an operation completes only while the
    batch holding its partner has started too (a receive cannot take data from a send whose kernel
    waits behind an earlier batch of its sender, whatever the host has posted); a batch completes
    when all its operations have.
    Local hand-offs (both stages on one rank) must be produced before they are consumed; a
    backward runs after its forward, a weight-gradient step after its backward.
    """
    posted: Dict[Tuple[str, int, int], List[Message]] = defaultdict(list)
    batch_ops: Dict[int, List[Tuple[str, int, int, int]]] = {}
    batches_of: Dict[int, List[int]] = defaultdict(list)
    first_open: Dict[int, int] = defaultdict(int)  # grouped: batches_of[rank][:first_open] are done
    recv_at: Dict[Tuple[int, Message], Tuple[int, int]] = {}  # -> (batch, index in its channel)
    batch_of: Dict[Tuple[str, int, int, int], Tuple[int, int]] = {}  # op -> (its rank, its batch)
    batch_pos: Dict[int, int] = {}  # batch -> its place among its rank's batches
    done_actions = set()
    pc = {r: 0 for r in plans}
    posted_step = {r: -1 for r in plans}
    next_batch = 0

    def matched(kind: str, a: int, b: int, idx: int) -> bool:
        partner_kind = "recv" if kind == "send" else "send"
        partner = posted[partner_kind, a, b]
        if len(partner) <= idx:
            return False
        mine = posted[kind, a, b][idx]
        if partner[idx] != mine:
            raise PlanError(f"rank {a} -> rank {b}: {kind} #{idx} is {mine} but its partner is "
                            f"{partner[idx]}")
        return not grouped or started(*batch_of[partner_kind, a, b, idx])

    def started(rank: int, bid: int) -> bool:
        """Grouped: every earlier batch of ``rank`` has completed (or ``bid`` itself has)."""
        return batch_pos[bid] <= first_open[rank]

    def complete_batches(rank: int) -> bool:
        """Grouped: complete ``rank``'s batches in order while they can; whether any did."""
        mine, before = batches_of[rank], first_open[rank]
        while first_open[rank] < len(mine) and all(matched(*op) for op in batch_ops[mine[first_open[rank]]]):
            first_open[rank] += 1
        return first_open[rank] != before

    def settle() -> bool:
        """Grouped: complete every batch that can, over all ranks to a fixpoint (a batch of one rank
        may complete only once a peer's earlier batches have: checking ranks one at a time, each
        only when it waits, would miss that and report a deadlock that is not one)."""
        moved = False
        while any([complete_batches(rank) for rank in plans]):
            moved = True
        return moved

    def batch_done(rank: int, bid: int) -> bool:
        if not grouped:
            return all(matched(*op) for op in batch_ops[bid])
        complete_batches(rank)
        return batch_pos[bid] < first_open[rank]

    def recv_done(rank: int, msg: Message) -> bool:
        if (rank, msg) not in recv_at:
            raise PlanError(f"rank {rank} waits for {msg} before posting its receive")
        bid, idx = recv_at[rank, msg]
        if grouped:
            return batch_done(rank, bid)
        return matched("recv", stage_rank(msg.src_stage, p, v_shaped), rank, idx)

    progress = True
    while progress:
        progress = grouped and settle()
        for rank, steps in plans.items():
            while pc[rank] < len(steps):
                k = pc[rank]
                step = steps[k]
                if posted_step[rank] < k:
                    ops = []
                    for msg in step.sends:
                        dst = stage_rank(msg.dst_stage, p, v_shaped)
                        posted["send", rank, dst].append(msg)
                        ops.append(("send", rank, dst, len(posted["send", rank, dst]) - 1))
                        batch_of[ops[-1]] = (rank, next_batch)
                    for msg in step.recvs:
                        src = stage_rank(msg.src_stage, p, v_shaped)
                        posted["recv", src, rank].append(msg)
                        ops.append(("recv", src, rank, len(posted["recv", src, rank]) - 1))
                        batch_of[ops[-1]] = (rank, next_batch)
                        recv_at[rank, msg] = (next_batch, len(posted["recv", src, rank]) - 1)
                    if ops:
                        batch_ops[next_batch] = ops
                        batch_pos[next_batch] = len(batches_of[rank])
                        batches_of[rank].append(next_batch)
                        next_batch += 1
                    posted_step[rank] = k
                    progress = True
                if step.action is None:  # a tick that only transfers, or the closing flush
                    if k == len(steps) - 1 and not all(batch_done(rank, b)
                                                       for b in batches_of[rank]):
                        break
                else:
                    if not all(recv_done(rank, msg) for msg in step.waits):
                        break
                    need = needed(step.action, num_stages)
                    if need is not None and not step.waits:
                        producer = Action(FORWARD if need.kind == ACT else BACKWARD,
                                          need.src_stage, need.mb)
                        if producer not in done_actions:
                            raise PlanError(f"rank {rank}: {step.action} needs the local {need} "
                                            f"before {producer} has run")
                    before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(step.action.op)
                    if before and Action(before, step.action.stage,
                                         step.action.mb) not in done_actions:
                        raise PlanError(f"rank {rank}: {step.action} runs before its {before}")
                    done_actions.add(step.action)
                pc[rank] += 1
                progress = True
    stuck = {r: steps[pc[r]] for r, steps in plans.items() if pc[r] < len(steps)}
    if stuck:
        desc = "; ".join(f"rank {r} at {s.action or 'final send flush'} waiting for "
                         f"{', '.join(map(str, s.waits)) or 'its sends'}" for r, s in stuck.items())
        raise PlanError(f"deadlock ({'grouped' if grouped else 'per-op'} completion): {desc}")
    expected = {a for order in orders.values() for a in order}
    if done_actions != expected:
        raise PlanError(f"{len(expected - done_actions)} actions never ran")


def bubble_theory(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step with equal stage times and free transfers: (p-1) / (v*m + p-1)."""
    return (p - 1) / (v * m + p - 1)


def choose_plan(schedule: str, p: int, v: int, m: int, backward: bool, grouped: bool,
                lookahead: int = DEFAULT_LOOKAHEAD, costs: Optional[Costs] = None):
    """Orders and the plan of every rank for a backend whose batches complete per operation
    (``grouped=False``: gloo) or as ordered groups on one stream (``grouped=True``: NCCL).

    With ``costs`` (measured F, B, W per stage) a split-backward schedule of a training step takes
    the first of ``cost_orders.measured_orders`` (best predicted first, the fixed order among them)
    that has a deadlock-free plan. The compute order never depends on the backend. Per-operation
    completion: the plan posts receives ``lookahead`` actions ahead, or fewer where the simulator
    finds a deadlock (2 was safe in every case tested). Grouped completion: the lock-step plan
    (``build_lockstep_plan``), whose batches pair up across ranks. Every plan is simulated before it
    is returned. Returns (orders, plans, lookahead used, None for the lock-step plan); raises
    ``PlanError`` if no plan is deadlock-free.
    """
    if costs is not None and backward and schedule in SPLIT_BACKWARD:
        err = check_counts(schedule, p, v, m)
        if err:
            raise ValueError(err)
        candidates = [{r: list(o) for r, o in orders.items()}
                      for orders in measured_orders(schedule, p, v, m, costs)]
    else:
        candidates = [{r: rank_order(schedule, r, p, v, m, backward) for r in range(p)}]
    v_shaped = schedule in V_SHAPED
    errors = []
    for orders in candidates:
        if grouped:
            try:
                plans = build_lockstep_plan(orders, p, p * v, v_shaped)
                simulate(orders, plans, p, p * v, grouped, v_shaped)
                return orders, plans, None
            except PlanError as e:
                errors.append(f"lock-step: {e}")
            continue
        for look in range(lookahead, -1, -1):
            plans = build_plan(orders, p, p * v, look, v_shaped)
            try:
                simulate(orders, plans, p, p * v, grouped, v_shaped)
                return orders, plans, look
            except PlanError as e:
                errors.append(f"lookahead {look}: {e}")
    raise PlanError(f"no deadlock-free transfer plan for {schedule} with {p} ranks, {v} stages per "
                    f"rank, {m} microbatches: " + "; ".join(errors[:lookahead + 1]))


def describe(order: Sequence[Action]) -> str:
    return " ".join(map(str, order))
