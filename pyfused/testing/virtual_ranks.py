"""Virtual ranks: W ranks of the fused kernels and schedules inside ONE process, on one device.

The device machines lent to this project have one GPU. Several processes sharing it time-slice: a
kernel that spins on a peer's flag progresses only when the peer's context gets its slice, and two
ranks' kernels never run at the same moment, so the ordering and race bugs of the fused schedules
cannot show. Here the W ranks are W CUDA streams of one context instead:

  * rank r runs on its own stream (``streams[r]``) and, through ``streams.owned_by``, has its own
    side streams (comm stream, push streams);
  * every fused kernel of rank r is capped at ``sm_budget`` programs (``config.sm_budget``; default
    SMs // W), so all ranks' persistent, spinning kernels are resident together and truly concurrent;
    torch's GEMMs in a call target the same budget (``torch_gemms_in_budget``);
  * the peers' symmetric buffers and signal pads are ordinary zeroed allocations of this context,
    one per rank and size class, shared by every rank's ``SymmetricBuffer`` (backend "virtual");
    each rank keeps its own epochs, as a process would;
  * ``run`` launches every rank from its own long-lived host thread, all before any host
    synchronization: a host-blocking step inside one rank's call (a pageable copy) blocks only that
    rank's thread, never another rank's launch. Then it waits for the threads, synchronizes the
    device and reports the kernels' wait timeouts. ``launch(..., threads=False)`` queues the ranks
    in order from one thread without a sync (timing loops, once a first call has built every table).

One context for all ranks has a cost that W processes do not: whatever makes CUDA wait for the
context's running kernels -- loading a module, allocating device or pinned memory -- waits for the
peers' spinning kernels too, and a rank that does it in the middle of a call holds up the work the
spinners wait for. So, before a call's ranks run at once, the group fills every rank stream's pool
of the caching allocator (``_reserve_memory``), and the first call of each function and argument
signature runs as a preload pass (pyfused/kernels/preload.py), which compiles and loads its Triton
kernels with nothing spinning.

A barrier between ranks therefore costs microseconds, as on a real node, and the adversarial modes
make the schedules' assumptions fail loudly: ``delay`` holds one rank back (a sleep kernel on its
stream before its launch), ``poison`` fills every rank's buffers with NaN before a call, and
``skip`` leaves one rank out, so its peers' waits must end in a timeout naming rank, peer and slot.

On CPU the same harness runs the CPU models: the CPU kernels of ``pyfused::all_reduce_rows`` /
``symm_barrier`` (their waits spin in C++ with the GIL released, so the rank threads meet at each
barrier) and the Triton interpreter (which runs programs one after another; the fused schedules
set every flag before a kernel reads it on CPU, and the launchers serialize interpreted launches).
That covers the harness's plumbing -- rank -> stream -> buffer tables, SM budgets, epochs across
calls -- in CI; the Triton kernels' waits between ranks that run at once are checked on CPU by
pyfused/testing/threaded_ranks.py (interpreted launches that overlap), the rest of the concurrency
needs the GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from ..comm import streams
from ..comm.group import BufferProvider
from ..comm.symmetric import MAX_WORLD, PAD_BYTES, Mapping, SymmetricBuffer
from ..fused import config
from ..kernels import preload

BACKEND = "virtual"
_group_ids = itertools.count()


class VirtualRank(BufferProvider):
    """Rank ``rank`` of a ``VirtualGroup``: what the fused methods take as ``group``."""

    def __init__(self, group: "VirtualGroup", rank: int):
        self.group = group
        self.rank = rank
        self.world = group.world
        self.group_name = f"{group.name}/r{rank}"

    def symmetric_buffer(self, data_bytes: int, device: torch.device) -> SymmetricBuffer:
        if torch.device(device) != self.group.device:
            raise ValueError(f"{self.group_name} serves {self.group.device}, not {device}")
        return self.group.buffer(self.rank, data_bytes)

    def __repr__(self) -> str:
        return f"VirtualRank({self.rank}/{self.world} of {self.group.name})"


@dataclass
class _SizeClass:
    buffers: List[SymmetricBuffer]
    ready: Optional["torch.cuda.Event"]  # the zeroing of the allocations, on the creating stream
    waited: List[bool]                    # whether rank r's stream already waits for ``ready``


CU_MODULE_LAZY_LOADING = 0x2  # cuda.h, CUmoduleLoadingMode


def cuda_loads_modules_lazily() -> Optional[bool]:
    """Whether this process's CUDA driver loads a kernel only at its first launch
    (``cuModuleGetLoadingMode``, once CUDA has started); None where no driver answers."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    mode = ctypes.c_int(0)
    if driver.cuModuleGetLoadingMode(ctypes.byref(mode)) != 0:
        return None
    return mode.value == CU_MODULE_LAZY_LOADING


def require_eager_module_loading() -> None:
    """Refuse lazy module loading, CUDA's default. The driver loads a kernel at its first launch and
    first waits for the context's running kernels to finish; virtual ranks share one context, so a
    rank whose first launch of some kernel comes after a peer's kernel started spinning on that
    rank's flag waits behind it until the fused timeout traps: a deadlock that real ranks, each in
    its own context, never meet."""
    lazy = cuda_loads_modules_lazily()
    if lazy is None:
        lazy = os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER"
    if lazy:
        raise RuntimeError(
            "virtual ranks on CUDA need eager module loading: set CUDA_MODULE_LOADING=EAGER in the "
            "environment before the process starts CUDA (the tests' conftest.py and "
            "benchmarks/gpu_check.sh do). With lazy loading a rank's first launch of a kernel waits "
            "for the peers' kernels that spin on that rank's flags, until the fused timeout traps.")


DEFAULT_DEVICE_CONNECTIONS = 8  # CUDA's default of CUDA_DEVICE_MAX_CONNECTIONS
OTHER_STREAMS = 2  # hardware queues left to the process's other streams (the default stream, ...)


def device_connections() -> int:
    """The hardware work queues CUDA gives the context (``CUDA_DEVICE_MAX_CONNECTIONS``, read by
    the driver when CUDA starts; 8 unless set, 32 at most)."""
    return int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", DEFAULT_DEVICE_CONNECTIONS))


def push_streams_per_rank(world: int, connections: int) -> int:
    """How many distinct push streams each of ``world`` virtual ranks may use so that every stream
    of the group -- per rank its own, its comm stream and its push streams -- has a hardware queue of
    its own.

    CUDA multiplexes streams onto ``connections`` hardware queues, in order within each queue: a
    kernel in one stream can wait behind a blocked kernel of another stream that shares its queue.
    Between processes that costs only concurrency; between virtual ranks it is a deadlock, a rank's
    barrier kernel queued behind a peer's barrier kernel that spins waiting for it. Raises when
    even one push stream per rank does not fit."""
    if world == 1:
        return 1
    spare = connections - OTHER_STREAMS - 2 * world
    if spare < world:
        raise RuntimeError(
            f"{world} virtual ranks on CUDA use at least {3 * world} streams (each rank's own, its "
            f"comm stream and a push stream) and each needs a hardware queue of its own, but "
            f"CUDA_DEVICE_MAX_CONNECTIONS is {connections} ({OTHER_STREAMS} kept for the process's "
            f"other streams): set CUDA_DEVICE_MAX_CONNECTIONS=32 before the process starts CUDA "
            f"(the tests' conftest.py, the bench CLI and benchmarks/gpu_check.sh do). Streams that "
            f"share a queue run in one order, and a rank's kernel queued behind a peer's spinning "
            f"kernel never starts.")
    return min(world - 1, spare // world)


def queue_slots(world: int, push_limit: int) -> List[List[int]]:
    """Rank r's streams as indices into the group's stream batch (``queue_streams``): its own
    stream ``r``, then its comm stream and its ``push_limit`` push streams, after all ranks' own
    streams. Every index is distinct, so every stream of the group has a queue of its own."""
    side = 1 + push_limit
    return [[r] + [world + r * side + slot for slot in range(side)] for r in range(world)]


HIGH_PRIORITY = -1  # the priority of torch's high-priority stream pool (torch.cuda.Stream(priority=-1))
_QUEUE_STREAMS: Dict[int, List["torch.cuda.ExternalStream"]] = {}
_QUEUE_STREAMS_LOCK = threading.Lock()


def queue_streams(device: torch.device) -> List["torch.cuda.ExternalStream"]:
    """``device_connections()`` streams of ``device``, created one after another, once per process.

    The driver hands its hardware queues to streams in turn as they are created. torch's stream
    pool creates the streams of all its priorities together, so which queue a pool stream gets
    depends on torch's creation order, not on the group. (On an H100 with 32 connections,
    benchmarks/probe_stream_queues.py found 24 high-priority pool streams on 24 distinct queues.)
    A batch created back to back takes every queue once, by construction. Created through the
    driver API (``cuda.bindings``, a torch dependency on Linux) as non-blocking, high-priority
    streams, like the pool's; they live as long as the process, as the pool's do."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _QUEUE_STREAMS_LOCK:
        if index not in _QUEUE_STREAMS:
            _QUEUE_STREAMS[index] = [torch.cuda.ExternalStream(handle, device=device)
                                     for handle in _create_streams(index, device_connections())]
        return _QUEUE_STREAMS[index]


def _create_streams(index: int, count: int) -> List[int]:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise RuntimeError("virtual ranks on CUDA create their streams through cuda.bindings "
                           "(pip install cuda-bindings; torch on Linux depends on it)") from e

    def check(result):
        err, *values = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed while creating virtual-rank streams: {err}")
        return values[0] if len(values) == 1 else values

    torch.cuda.init()  # the primary context exists before it is retained here
    check(driver.cuInit(0))
    context = check(driver.cuDevicePrimaryCtxRetain(check(driver.cuDeviceGet(index))))
    check(driver.cuCtxPushCurrent(context))
    try:
        flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
        return [int(check(driver.cuStreamCreateWithPriority(flags, HIGH_PRIORITY)))
                for _ in range(count)]
    finally:
        check(driver.cuCtxPopCurrent())


def default_sm_budget(world: int, device: torch.device) -> int:
    """About SMs / W programs per rank (at least 1); the interpreter's default on CPU."""
    if device.type != "cuda":
        return config.INTERPRETER_PROGRAMS
    return max(1, torch.cuda.get_device_properties(device).multi_processor_count // world)


class VirtualGroup:
    """W virtual ranks on ``device`` (see the module docstring)."""

    def __init__(self, world: int, device=None, sm_budget: Optional[int] = None,
                 reserve_bytes: Optional[int] = None):
        if not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world must be an int in [1, {MAX_WORLD}], got {world!r}")
        device = torch.device(device if device is not None else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cuda":
            torch.cuda.init()
            require_eager_module_loading()
        self.world = world
        self.device = device
        self.name = f"virtual{next(_group_ids)}"
        self.sm_budget = sm_budget or default_sm_budget(world, device)
        self.ranks = [VirtualRank(self, r) for r in range(world)]
        # On CUDA: distinct push streams per rank that fit the hardware queues, and every stream of
        # the group -- each rank's own, comm and push streams -- one of the batch that takes each
        # queue once (queue_streams), so no rank's kernel queues behind another stream's.
        self.push_limit = (push_streams_per_rank(world, device_connections())
                           if device.type == "cuda" else None)
        self.streams: List[Optional["torch.cuda.Stream"]] = [None] * world
        if device.type == "cuda":
            batch = queue_streams(device)
            for r, slots in enumerate(queue_slots(world, self.push_limit)):
                self.streams[r] = batch[slots[0]]
                streams.assign(self._owner(r), device, [batch[i] for i in slots[1:]])
        self._lock = threading.Lock()
        self._sizes: Dict[int, _SizeClass] = {}
        self._preloaded: set = set()  # (fn, argument signature) whose kernels are loaded
        self._threads: List[_RankThread] = []  # one long-lived host thread per rank
        self._reserve_bytes = reserve_bytes
        self._reserved = device.type != "cuda"
        self._started: List[Optional["torch.cuda.Event"]] = [None] * world  # the last call's

    # -- memory ---------------------------------------------------------------------------------

    def buffer(self, rank: int, data_bytes: int) -> SymmetricBuffer:
        """Rank ``rank``'s buffer of size class ``data_bytes``; the first rank to ask allocates
        every rank's (zeroed on its stream; each rank's stream waits for that once)."""
        with self._lock:
            size = self._sizes.get(data_bytes)
            if size is None:
                size = self._sizes[data_bytes] = self._allocate(data_bytes)
            if size.ready is not None and not size.waited[rank]:
                torch.cuda.current_stream(self.device).wait_event(size.ready)
                size.waited[rank] = True
            return size.buffers[rank]

    def _allocate(self, data_bytes: int) -> _SizeClass:
        total = data_bytes + PAD_BYTES
        allocs = [torch.zeros(total, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        ptrs = [t.data_ptr() for t in allocs]
        buffers = [SymmetricBuffer(self.ranks[r], data_bytes, self.device, BACKEND,
                                   Mapping(allocs[r], list(allocs), ptrs),
                                   (self.ranks[r].group_name, str(self.device), BACKEND, data_bytes))
                   for r in range(self.world)]
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
            for stream in self.streams:
                for t in allocs:
                    t.record_stream(stream)
        return _SizeClass(buffers, ready, [False] * self.world)

    def buffers(self) -> List[List[SymmetricBuffer]]:
        """Every size class's buffers, rank by rank (smallest class first)."""
        with self._lock:
            return [self._sizes[k].buffers for k in sorted(self._sizes)]

    def poison(self) -> None:
        """Fill every rank's data areas (not the signal pads) with NaN: 0xFF bytes are NaN in fp32,
        fp16 and bf16 alike. Stream-ordered (current stream) before the next launch."""
        for size in self.buffers():
            for buf in size:
                buf.local_view().fill_(0xFF)

    def free(self) -> None:
        """Free every buffer (``SymmetricBuffer.free``: after the device finished with them)."""
        with self._lock:
            sizes, self._sizes = list(self._sizes.values()), {}
        for size in sizes:
            for buf in size.buffers:
                buf.free()
        for r in range(self.world):
            streams.forget_owner(self._owner(r))
        for thread in self._threads:
            thread.stop()
        self._threads = []

    def _reserve_memory(self) -> None:
        """Fill the caching allocator's pools of every rank's stream before any rank spins.

        Allocating device memory waits for every kernel of the context (CUDA's implicit
        synchronization), and the caching allocator allocates when none of the blocks it holds for
        the allocating stream fits. A rank that allocates while a peer's kernel spins on that rank's
        flag would wait until the spin gives up. So each rank's stream gets a large block
        (``reserve_bytes``; default a quarter of the free memory shared among the ranks, at most
        2 GiB) and small-pool segments, allocated and freed at once: its calls' allocations are
        then carved from blocks the allocator already holds."""
        if self._reserved:
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        large = self._reserve_bytes or min(2 << 30, free // (4 * self.world))
        for stream in self.streams:
            with torch.cuda.stream(stream):
                held = [torch.empty(large, dtype=torch.uint8, device=self.device)]
                held += [torch.empty(1 << 20, dtype=torch.uint8, device=self.device)
                         for _ in range(SMALL_RESERVE_SEGMENTS)]
                del held
        self._reserved = True

    def _rank_threads(self) -> List["_RankThread"]:
        if not self._threads:
            self._threads = [_RankThread(f"{self.name}-rank{r}") for r in range(self.world)]
        return self._threads

    def _on_rank_threads(self, job: Callable[[int], None], ranks: List[int], timeout_s: float,
                         what: str) -> None:
        """``job(r)`` on rank r's own thread for every r in ``ranks``, all at once; returns when all
        have ended."""
        threads = self._rank_threads()
        done = [threads[r].submit(lambda r=r: job(r)) for r in ranks]
        # A rank thread still busy at half the fused timeout is likely blocked in a call that waits
        # for the context's kernels while a peer spins (module docstring): where it is goes to
        # stderr before the spinning kernel traps and takes the process with it.
        hint = _half_the_fused_timeout() or timeout_s
        start = time.monotonic()
        for event in done:
            event.wait(max(0.0, min(hint, timeout_s) - (time.monotonic() - start)))
        late = [(r, threads[r]) for r, event in zip(ranks, done) if not event.is_set()]
        if late:
            _report(f"{self.name}: {what}: {len(late)} rank thread(s) still busy after {hint:.1f} s:\n"
                    + "".join(f"--- rank {r}:\n{t.stack()}" for r, t in late))
        for event in done:
            event.wait(max(0.0, timeout_s - (time.monotonic() - start)))
        stuck = [f"rank {r}" for r, event in zip(ranks, done) if not event.is_set()]
        if stuck:
            raise TimeoutError(f"{self.name}: {what} of {stuck} did not return within "
                               f"{timeout_s:.0f} s")

    # -- launching --------------------------------------------------------------------------------

    def _owner(self, rank: int):
        return (self.name, rank)

    @contextlib.contextmanager
    def rank_context(self, rank: int) -> Iterator[VirtualRank]:
        """Rank ``rank``'s stream, SM budget and side streams, for the calls made in the body."""
        stream = self.streams[rank]
        with contextlib.ExitStack() as stack:
            if stream is not None:
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(config.sm_budget(self.sm_budget))
            stack.enter_context(streams.owned_by(self._owner(rank)))
            stack.enter_context(streams.push_limit(self.push_limit))
            yield self.ranks[rank]

    @contextlib.contextmanager
    def torch_gemms_in_budget(self) -> Iterator[None]:
        """torch's GEMMs launched in the body (``torch.matmul`` inside the fused and the unfused
        compositions) target the group's SM budget, as the fused kernels do: cuBLASLt with
        torch's SM carveout (its ``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``), restored after.

        cuBLAS sizes its grids, persistent kernels' above all, for the whole GPU, while under
        virtual ranks the peers' spinning kernels hold the other SMs. (On an H100, W = 4 first lost
        ranks at the first case whose call runs a cuBLAS GEMM; with this every case passed at
        W = 4 and 8, though that case alone also passed without it.) Both settings are
        process-wide; the group sets them from the launching thread only.
        ``PYFUSED_VR_TORCH_GEMM_BUDGET=0`` leaves torch's GEMMs uncapped (to compare)."""
        if self.device.type != "cuda" or os.environ.get("PYFUSED_VR_TORCH_GEMM_BUDGET", "1") == "0":
            yield
            return
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        carveout = torch._C._get_sm_carveout_experimental()
        library = torch.backends.cuda.preferred_blas_library()
        torch._C._set_sm_carveout_experimental(max(0, sms - self.sm_budget))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(carveout)
            torch.backends.cuda.preferred_blas_library(library)

    def launch(self, fn: Callable[..., Any], args: Sequence[Sequence[Any]] = (), *,
               delay: Optional[int] = None, delay_s: float = 0.05, skip: Optional[int] = None,
               threads: bool = True, timeout_s: float = 300.0) -> List[Any]:
        """Queue ``fn(rank_handle, *args[r])`` for every rank r on its stream, all before any host
        synchronization, and make the current stream wait for every rank's; no host sync.

        threads: launch each rank from its own host thread (a host-blocking step inside one rank's
        call then blocks only that rank); ``False`` launches them in rank order from this thread,
        for timing calls already known not to block (warmed up by a threaded call: no preload
        pass, no memory reserve, nothing computed per call beyond the launch). delay: that rank starts
        ``delay_s`` late (a sleep kernel on its stream on a GPU, a host sleep on CPU). skip: that
        rank does not take part (its result is None): a lost flag."""
        args = list(args) or [()] * self.world
        if len(args) != self.world:
            raise ValueError(f"args must hold one tuple per rank ({self.world}), got {len(args)}")
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for stream in self.streams:
            if stream is not None:
                stream.wait_stream(current)  # the inputs were made on the current stream
        results: List[Any] = [None] * self.world
        errors: List[Optional[BaseException]] = [None] * self.world

        started: List[Optional["torch.cuda.Event"]] = [None] * self.world

        def one(r: int) -> None:
            try:
                with self.rank_context(r) as handle:
                    if r == delay:
                        _hold_back(self.device, delay_s)
                    if self.device.type == "cuda" and threads:
                        started[r] = torch.cuda.Event()
                        started[r].record()  # reached once the rank's stream is past its waits
                    results[r] = fn(handle, *args[r])
            except BaseException as e:  # reported below, rank by rank
                errors[r] = e

        ranks = [r for r in range(self.world) if r != skip]
        with self.torch_gemms_in_budget():
            if self.device.type == "cuda" and threads:  # threads=False: already warmed up
                self._reserve_memory()
                self._preload(fn, args, ranks, timeout_s)
            if threads:
                self._on_rank_threads(one, ranks, timeout_s, "the call")
            else:
                for r in ranks:
                    one(r)
        self._started = started
        if current is not None:
            for stream in self.streams:
                current.wait_stream(stream)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, e = failed[0]
            raise RuntimeError(f"virtual rank {r}/{self.world} failed: {type(e).__name__}: {e}"
                               + (f" (and ranks {[q for q, _ in failed[1:]]})" if failed[1:] else "")
                               ) from e
        return results

    def _preload(self, fn: Callable[..., Any], args: List[Sequence[Any]], ranks: List[int],
                 timeout_s: float) -> None:
        """The first call of ``fn`` on arguments of this signature: one preload pass of every rank
        (pyfused/kernels/preload.py), so that no Triton module is loaded while a rank's kernel
        spins on a peer."""
        key = (fn, _signature(args))
        if key in self._preloaded:
            return
        meet = threading.Barrier(len(ranks), timeout=timeout_s)
        errors: List[BaseException] = []

        def one(r: int) -> None:
            try:
                with self.rank_context(r) as handle, preload.preloading(meet.wait):
                    fn(handle, *args[r])
            except BaseException as e:
                errors.append(e)
                meet.abort()  # the peers' host barriers raise instead of waiting

        self._on_rank_threads(one, ranks, timeout_s, "the preload pass")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                     errors[0] if errors else None)
        if first is not None:
            raise RuntimeError(f"{self.name}: the preload pass failed: {type(first).__name__}: "
                               f"{first}") from first
        self._preloaded.add(key)

    def run(self, fn: Callable[..., Any], args: Sequence[Sequence[Any]] = (), **launch_kw
            ) -> List[Any]:
        """``launch`` from one thread per rank, then synchronize the device and raise the kernels'
        recorded wait timeouts (``WaitTimeout``); the ranks' results."""
        results = self.launch(fn, args, **launch_kw)
        if self.device.type == "cuda":
            self._wait_for_device()
        from ..fused.gemm_collectives import TIMEOUTS

        TIMEOUTS.check(sync=True)
        return results

    def _wait_for_device(self) -> None:
        """Synchronize the device. A rank stream still busy at half the fused timeout (a kernel
        spinning on a peer traps at the timeout and ends the process) is named on stderr first,
        with every rank's epochs: ranks whose epochs differ wait for each other forever."""
        done = []
        for stream in self.streams:
            event = torch.cuda.Event()
            event.record(stream)
            done.append(event)
        hint = _half_the_fused_timeout()
        if hint:
            deadline = time.monotonic() + hint
            while time.monotonic() < deadline and not all(e.query() for e in done):
                time.sleep(0.001)
            busy = [r for r, event in enumerate(done) if not event.query()]
            if busy:
                waiting = [r for r, event in enumerate(self._started)
                           if event is not None and not event.query()]
                _report(f"{self.name}: the streams of ranks {busy} are still busy after "
                        f"{hint:.1f} s; the streams of ranks {waiting} have not yet started the "
                        f"call's work; epochs per size class, rank by rank: {self.epochs()}")
        torch.cuda.synchronize(self.device)

    def epochs(self) -> List[List[int]]:
        """Every size class's epoch on every rank (they move together: one per collective call)."""
        return [[buf.epoch for buf in size] for size in self.buffers()]


def _report(message: str) -> None:
    """A diagnosis printed before a spinning kernel may trap and end the process: to the process's
    own stderr, so that it survives output capture (pytest's), flushed at once."""
    stream = sys.__stderr__ or sys.stderr
    print(message, file=stream, flush=True)


def _half_the_fused_timeout() -> Optional[float]:
    """Seconds after which a busy rank is reported, before a spinning kernel traps at the fused
    timeout (None: the waits never time out)."""
    ms = config.timeout_ms()
    return ms / 2000 if ms else None


SMALL_RESERVE_SEGMENTS = 16  # 2 MiB segments of the caching allocator's small pool, per rank


class _RankThread:
    """The long-lived host thread of one virtual rank: runs the jobs given to it, one at a time.
    A rank's calls then always come from the same thread, whose per-thread CUDA state (cuBLAS
    handle, current context) is set up once, in the first call, not in every call."""

    def __init__(self, name: str):
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Queue ``job`` (it must not raise); the event is set when it has run."""
        done = threading.Event()

        def run() -> None:
            try:
                job()
            finally:
                done.set()

        self._jobs.put(run)
        return done

    def stop(self, timeout_s: float = 60.0) -> None:
        """End the thread and wait for it: a thread still ending when the process exits can be cut
        in the middle of its C++ thread-local teardown, which aborts the process."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def stack(self) -> str:
        """Where the thread is now (its Python stack, innermost last)."""
        frame = sys._current_frames().get(self._thread.ident)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)\n"


def _signature(value: Any) -> Any:
    """What selects the compiled kernel variants of a call: every tensor's shape, dtype, strides and
    16-byte alignment, every other argument's value (its type where it is not hashable)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.stride(), value.data_ptr() % 16)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in sorted(value.items()))
    try:
        hash(value)
    except TypeError:
        return type(value).__qualname__
    return value


def _hold_back(device: torch.device, seconds: float) -> None:
    if device.type == "cuda":
        # _sleep counts clock cycles: ~1.5 GHz on current data-center GPUs, close enough for a delay.
        torch.cuda._sleep(int(seconds * 1.5e9))
    else:
        import time

        time.sleep(seconds)
