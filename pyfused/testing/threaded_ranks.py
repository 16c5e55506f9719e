"""Ranks as threads running the real Triton kernels' cross-rank waits on CPU.

Each rank is a thread of a CPU ``VirtualGroup`` (pyfused/testing/virtual_ranks.py): its symmetric
buffers and flags are ordinary CPU tensors every thread can address, and its kernels run in the
Triton interpreter, made safe for concurrent launches by ``thread_safe_interpreter()``
(pyfused/testing/interpreter.py). A kernel that waits on a flag therefore really waits -- polls with
acquire semantics -- while the peers' threads copy the data and set the flag, as the ranks' GPUs
do. Waits are bounded by ``Faults.spin_limit`` polls (the interpreter has no clock).

Two kinds of calls run this way:
  * the library's fused schedules themselves (``run_fused_case``: the cases of
    pyfused/testing/virtual_cases.py whose kernels are Triton), whose CPU path lets the kernels wait
    for the peers when launches may overlap (``gemm_collectives._waits_block``);
  * the GPU paths of the schedules, side streams as side threads, including the parts whose CPU
    path differs (GEMM tile counters and their relay) and Triton forms of the all-reduces
    (``pyfused.testing.protocols``).

Adversarial schedules (``Faults``), shared by both: a random delay before every flag write; one
rank held back -- before it writes anything a peer reads (data or flag) it waits until every other
rank's kernel polls a flag that is not set, so a wait that does not hold reads missing data; one
flag write that never happens, which must end in ``LostFlag`` naming the rank, the flag and the
peer that should have set it (protocols only: the fused schedules' CPU errors name the rank and
the flag, see ``run_fused_case``).
"""
from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..comm.group import rank as group_rank, world_size
from ..comm.symmetric import SymmetricBuffer
from ..kernels.reduce_launch import WaitTimeout, new_status

# Polls a wait makes before it gives up. A poll of the interpreter costs 0.1-3 ms (by machine
# load); a legitimate wait lasts as long as the peers need to reach their flag writes: at most a few
# thousand polls at the tests' shapes, also with a rank held back. A lost flag costs the budget.
DEFAULT_SPIN_LIMIT = 200_000
# How long a held-back rank waits for every other rank's kernel to poll an unset flag. Correct
# schedules get there in seconds (each rank waits for the held-back rank's data); where they never
# do -- a wait that does not hold -- the held-back rank goes on after this.
HOLD_TIMEOUT_S = 30.0
# Wall-clock bound of a relay's host-side wait on its own GEMM's tile counters.
RELAY_TIMEOUT_S = 600.0


class LostFlag(RuntimeError):
    """A rank gave up waiting on a flag (or a tile count) that a peer should have set."""


@dataclass(frozen=True)
class Faults:
    """The adversarial schedule of one call (module docstring).

    flag_delay_s: each flag write first sleeps a random time in [0, flag_delay_s).
    held_back: this rank writes nothing a peer reads until every other rank's kernel polls an
      unset flag.
    lost_flag: (writer rank, owner rank, flag index) of a write that never happens.
    spin_limit: polls before a kernel's wait gives up.
    gemm_config: the protocols' GEMM tile (None: the launcher's); a small one gives a chunk several
      tiles to count."""

    flag_delay_s: float = 0.0
    held_back: Optional[int] = None
    lost_flag: Optional[Tuple[int, int, int]] = None
    spin_limit: int = DEFAULT_SPIN_LIMIT
    gemm_config: object = None
    seed: int = 0


NO_FAULTS = Faults()


class Call:
    """What the ranks of one call share: its faults, and which ranks' kernels have polled a flag
    that was not set (``spinning``, reported by ``observed_spins``)."""

    def __init__(self, world: int, faults: Faults):
        self.world = world
        self.faults = faults
        self.threads: Dict[int, int] = {}  # thread id -> the rank whose kernels it launches
        self.spinning = [threading.Event() for _ in range(world)]
        self.released = threading.Event()
        self.rng = random.Random(faults.seed)
        self.lock = threading.Lock()

    def enter(self, rank: int) -> None:
        """The calling thread launches rank ``rank``'s kernels."""
        self.threads[threading.get_ident()] = rank

    def on_spin(self) -> None:
        rank = self.threads.get(threading.get_ident())
        if rank is not None:
            self.spinning[rank].set()

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        """The rank threads' spins reach ``on_spin`` for the block (only needed to hold a rank)."""
        if self.faults.held_back is None:
            yield
            return
        from .interpreter import observed_spins

        with observed_spins(self.on_spin):
            yield

    def hold(self, rank: int) -> None:
        """If ``rank`` is the held-back one and was not released yet: wait until every other
        rank's kernel is polling an unset flag (or ``HOLD_TIMEOUT_S`` passed)."""
        if self.faults.held_back != rank or self.released.is_set():
            return
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        for q, event in enumerate(self.spinning):
            if q != rank:
                event.wait(max(0.0, deadline - time.monotonic()))
        self.released.set()

    def before_signal(self, rank: int) -> None:
        """The adversarial part of a flag write by ``rank``: the hold and the random delay."""
        self.hold(rank)
        if self.faults.flag_delay_s:
            with self.lock:
                pause = self.rng.uniform(0.0, self.faults.flag_delay_s)
            time.sleep(pause)

    def lost(self, writer: int, owner: int, index: int) -> bool:
        return self.faults.lost_flag == (writer, owner, index)


class RankView:
    """One rank's side of a call: its identity, the shared ``Call``, and its side threads."""

    def __init__(self, pg, call: Call):
        self.pg = pg
        self.call = call
        self.faults = call.faults
        self.rank, self.world = group_rank(pg), world_size(pg)
        self.side: List[threading.Thread] = []
        self.side_errors: List[BaseException] = []

    def signal(self, buf: SymmetricBuffer, owner: int, index: int, value: int, count: int) -> None:
        """Flag ``index`` of rank ``owner`` := ``value``, unless it is the lost one. A plain store
        that follows this thread's copies of the data: x86-64 makes stores visible in program order
        (and the interpreter lock's handovers between them are full barriers), and the kernels
        read the flag with acquire semantics before the data."""
        self.call.before_signal(self.rank)
        if not self.call.lost(self.rank, owner, index):
            buf.flags(owner, count=count)[index] = value

    def spawn(self, body: Callable[[], None]) -> None:
        """Run ``body`` in a side thread (what a side stream is on the GPU)."""
        def guarded():
            try:
                body()
            except BaseException as e:  # re-raised by join()
                self.side_errors.append(e)

        thread = threading.Thread(target=guarded, name=f"rank{self.rank}-side{len(self.side)}",
                                  daemon=True)
        self.side.append(thread)
        thread.start()

    def join(self, raise_errors: bool = True) -> None:
        for thread in self.side:
            thread.join()
        if raise_errors and self.side_errors:
            raise self.side_errors[0]

    def waited(self, launch: Callable[[Tensor], Tensor],
               flag_of: Callable[[int], Tuple[int, int, str]]) -> Tensor:
        """``launch(status)`` of a waiting kernel; a wait that gave up is raised as ``LostFlag``:
        ``flag_of(code)`` is (flag index, peer that sets it, when) for the kernel's timeout code.
        Joins the side threads."""
        status = new_status(torch.device("cpu"))
        try:
            out = launch(status)
        except WaitTimeout as e:
            index, peer, when = flag_of(int(status.item()))
            lost = LostFlag(f"rank {self.rank} gave up after {self.faults.spin_limit} polls "
                            f"waiting on its flag {index}, which peer {peer} sets {when}")
            lost.__cause__ = e
        else:
            lost = None
        self.join(raise_errors=lost is None)
        if lost is not None:
            raise lost
        return out

    def await_tiles(self, counters: Tensor, chunk: int, tiles: int) -> None:
        """The relay's wait: until this rank's GEMM counted every tile of ``chunk`` (host side,
        as the GPU relay's one-thread kernel)."""
        deadline = time.monotonic() + RELAY_TIMEOUT_S
        while int(counters[chunk]) < tiles:
            if time.monotonic() > deadline:
                raise LostFlag(f"rank {self.rank}'s relay gave up waiting for chunk {chunk}'s "
                               f"{tiles} tiles (counted {int(counters[chunk])})")
            time.sleep(0.0005)


def run_ranks(group, fn: Callable[..., Tensor], inputs: Sequence[Tuple[Tensor, ...]],
              faults: Faults = NO_FAULTS) -> List[Tensor]:
    """``fn(RankView, *inputs[r])`` on every rank of the CPU ``VirtualGroup`` ``group``, one thread
    each. Call inside ``thread_safe_interpreter()``."""
    call = Call(group.world, faults)

    def body(pg, *args):
        me = RankView(pg, call)
        call.enter(me.rank)
        call.hold(me.rank)  # before it writes anything a peer reads
        return fn(me, *args)

    with call.observing():
        return group.run(body, inputs)


# -- the library's fused schedules -----------------------------------------------------------------

_current = threading.local()


@contextlib.contextmanager
def _faulty_schedules(call: Call) -> Iterator[None]:
    """Route the fused schedules' launches and flag writes (pyfused/fused/gemm_collectives.py)
    through ``call``'s faults for the block: waiting launches get the spin limit, the held-back
    rank stops before its first launch that writes into the peers or its first flag write, and
    flag writes are delayed."""
    from ..fused import gemm_collectives as schedules

    real = {name: getattr(schedules, name)
            for name in ("gemm", "multi_source_reduce", "signal_flag")}

    def with_faults(launch):
        def faulty_launch(*args, **kw):
            if kw.get("wait_flags") is not None:
                kw["spin_limit"] = call.faults.spin_limit
            else:
                call.hold(_current.rank)  # a GEMM that scatters into the peers
            return launch(*args, **kw)
        return faulty_launch

    def signal_flag(flags, index, value):
        call.before_signal(_current.rank)
        real["signal_flag"](flags, index, value)

    schedules.gemm = with_faults(real["gemm"])
    schedules.multi_source_reduce = with_faults(real["multi_source_reduce"])
    schedules.signal_flag = signal_flag
    try:
        yield
    finally:
        for name, value in real.items():
            setattr(schedules, name, value)


def run_fused_case(group, fused: Callable[..., Tensor], inputs: Sequence[Tuple[Tensor, ...]],
                   faults: Faults = NO_FAULTS) -> List[Tensor]:
    """``fused(pg, *inputs[r])`` -- a case of pyfused/testing/virtual_cases.py -- on every rank,
    with ``faults`` (not ``lost_flag``) applied to the schedule's launches and flag writes. A wait
    that gives up raises the launcher's ``WaitTimeout`` (naming the chunk) from the rank's
    thread."""
    if faults.lost_flag is not None:
        raise ValueError("run_fused_case applies flag delays and a held-back rank, not lost flags")
    call = Call(group.world, faults)

    def body(pg, *args):
        _current.rank = group_rank(pg)
        call.enter(_current.rank)
        return fused(pg, *args)

    with _faulty_schedules(call), call.observing():
        return group.run(body, inputs)
