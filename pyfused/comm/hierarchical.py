"""The host-aware all-reduce: reduce-scatter inside each host, all-reduce across hosts, all-gather
inside each host.

Over a ("host", "local") mesh of H hosts with L ranks each and a buffer of S bytes per rank:

  1. reduce-scatter over ``mesh["local"]``: local rank l gets the host's sum of piece l (S / L);
  2. all-reduce over ``mesh["host"]``: the L pieces of a host cross the network in parallel, each
     between the H ranks that hold the same piece, so that every rank holds the sum over all
     ranks of its piece;
  3. all-gather over ``mesh["local"]``: every rank gets every piece back.

What crosses a host's link, per direction: a flat ring all-reduce over the W = H*L ranks sends
2(W-1)/W * S from each rank, and a host's L ranks reach the network through one ring edge per
host, which carries 2(W-1)/W * S. The hierarchical schedule sends 2(H-1)/H * S/L from each of the
L ranks: 2(H-1)/H * S per host. With 2 hosts x 2 ranks that is S against 1.5 S, so on a link that
is the bottleneck the hierarchical all-reduce takes 2/3 of the flat one's time (1.5x faster),
provided steps 1 and 3, which stay inside the host, cost little beside it.

The steps inside the host: NCCL's reduce-scatter and all-gather for CUDA tensors. For CPU tensors
(gloo) they are point-to-point transfers instead (each rank sends piece j to local rank j, and its
own piece to every other), because gloo's reduce_scatter_tensor is an all-reduce of a copy of the
whole buffer and its all_gather_into_tensor goes through a temporary: both cost about as much as the
network step they are meant to save (64 MiB, 2 ranks, one 2-core host: reduce-scatter 0.36 s,
all-reduce 0.20 s). Transfers of the two steps carry different tags, and are posted in the same
order on every rank, so that each receive matches its send.

Buffers are reduced in pieces of at most ``chunk_bytes`` (4 MiB by default), pipelined: the network
step of one piece overlaps the host steps of its neighbours. Every rank holds the same result, bit
for bit (each piece is summed by one rank, in rank order, then all-reduced and copied), which is
the sum of a flat all-reduce in another order: fp32 results agree with it to rounding. The
buffer's length must be a multiple of L (``padded_length``).

``HostAllReduce.start`` returns a ``HostAllReduceWork`` whose three steps are launched one at a
time by ``step()``: each waits for the previous one, then starts the next. Callers that keep
several in flight must advance them at the same points on every rank, oldest first, so that every
group sees its transfers in the same order on every rank: ``PipelinedHostAllReduce`` does that.
Each wait for a step is bounded by the timeout of that step's group, counted from the wait
(``faults.wait_bounded``), so a frozen peer cannot hold a step longer than its group says.
"""
from __future__ import annotations

import datetime
from typing import List, Optional

import torch
import torch.distributed as dist

from .collectives import all_gather_single, reduce_scatter_single
from .faults import wait_bounded
from .topology import MESH_DIMS

# The steps of one host-aware all-reduce, in order.
STEPS = ("reduce-scatter inside the host", "all-reduce across hosts", "all-gather inside the host")
DEFAULT_CHUNK_BYTES = 4 << 20
# Point-to-point tags of the host steps (CPU): the two steps' transfers can never match each other.
_SCATTER_TAG, _GATHER_TAG = 71, 73


def padded_length(numel: int, ranks_per_host: int) -> int:
    """The smallest multiple of ``ranks_per_host`` >= ``numel`` (the buffer length needed)."""
    return -(-numel // ranks_per_host) * ranks_per_host


class _Transfers:
    """Point-to-point transfers in flight, and what to do once they all arrived."""

    def __init__(self, works: List, then=None):
        self.works = works
        self.then = then

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> None:
        for work in self.works:
            work.wait(timeout)
        if self.then is not None:
            self.then()


class HostAllReduceWork:
    """One buffer's host-aware all-reduce in flight; ``step()`` moves it to its next step."""

    def __init__(self, owner: "HostAllReduce", buf: torch.Tensor, piece: torch.Tensor):
        self.owner = owner
        self.buf = buf
        self.piece = piece
        self.stage = 0  # index in STEPS of the step in flight; len(STEPS) once done
        self.work = owner.scatter_in_host(buf, piece)

    @property
    def done(self) -> bool:
        return self.stage == len(STEPS)

    def step(self) -> None:
        """Wait for the step in flight and launch the next one (nothing once done)."""
        if self.done:
            return
        owner = self.owner
        wait_bounded(self.work, owner.inter if self.stage == 1 else owner.intra, self.buf.device)
        self.stage += 1
        if self.stage == 1:
            self.work = dist.all_reduce(self.piece, group=self.owner.inter, async_op=True)
        elif self.stage == 2:
            self.work = self.owner.gather_in_host(self.buf, self.piece)
        else:
            self.work = None

    def wait(self) -> None:
        """Run the remaining steps; afterwards ``buf`` holds the sum over every rank."""
        while not self.done:
            self.step()


class HostAllReduce:
    """The host-aware all-reduce over a ("host", "local") DeviceMesh."""

    def __init__(self, mesh, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
            raise ValueError(f"the mesh's dims must be {MESH_DIMS}, got {mesh.mesh_dim_names}")
        self.mesh = mesh
        self.intra = mesh.get_group("local")
        self.inter = mesh.get_group("host")
        self.hosts = mesh.size(0)
        self.ranks_per_host = mesh.size(1)
        self.local_rank = mesh.get_local_rank("local")
        self.local_peers = dist.get_process_group_ranks(self.intra)  # global ranks, local order
        self.chunk_bytes = chunk_bytes

    # ------------------------------------------------------------------ the steps inside the host
    def scatter_in_host(self, buf: torch.Tensor, piece: torch.Tensor):
        """Start step 1: ``piece`` <- the host's sum of this rank's piece of ``buf``."""
        if buf.device.type != "cpu":
            return reduce_scatter_single(piece, buf, group=self.intra, async_op=True)
        pieces = buf.view(self.ranks_per_host, -1)
        me = self.local_rank
        got = {j: torch.empty_like(piece) for j in range(self.ranks_per_host) if j != me}
        works = [dist.isend(pieces[j], dst=self.local_peers[j], group=self.intra, tag=_SCATTER_TAG)
                 for j in got]
        works += [dist.irecv(got[j], src=self.local_peers[j], group=self.intra, tag=_SCATTER_TAG)
                  for j in got]

        def add_in_rank_order():
            parts = [pieces[me] if j == me else got[j] for j in range(self.ranks_per_host)]
            piece.copy_(parts[0])
            for part in parts[1:]:
                piece.add_(part)

        return _Transfers(works, add_in_rank_order)

    def gather_in_host(self, buf: torch.Tensor, piece: torch.Tensor):
        """Start step 3: ``buf`` <- every local rank's ``piece``, in local-rank order."""
        if buf.device.type != "cpu":
            return all_gather_single(buf, piece, group=self.intra, async_op=True)
        pieces = buf.view(self.ranks_per_host, -1)
        me = self.local_rank
        peers = [j for j in range(self.ranks_per_host) if j != me]
        works = [dist.isend(piece, dst=self.local_peers[j], group=self.intra, tag=_GATHER_TAG)
                 for j in peers]
        works += [dist.irecv(pieces[j], src=self.local_peers[j], group=self.intra, tag=_GATHER_TAG)
                  for j in peers]
        return _Transfers(works, lambda: pieces[me].copy_(piece))

    # ------------------------------------------------------------------ whole buffers
    def start(self, buf: torch.Tensor, piece: Optional[torch.Tensor] = None) -> HostAllReduceWork:
        """Begin summing the contiguous 1-D ``buf`` over every rank of the mesh, in place, in one
        piece. ``piece``: scratch of ``len(buf) // ranks_per_host`` elements (made if absent)."""
        return HostAllReduceWork(self, buf, self.scratch(buf, piece))

    def scratch(self, buf: torch.Tensor, piece: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``piece``, or a new one, after checking that ``buf`` can be reduced."""
        n = buf.numel()
        if buf.dim() != 1 or n % self.ranks_per_host or not buf.is_contiguous():
            raise ValueError(f"the buffer must be contiguous and 1-D with a length divisible by the "
                             f"{self.ranks_per_host} ranks per host, got shape {list(buf.shape)}")
        if piece is None:
            piece = torch.empty(n // self.ranks_per_host, dtype=buf.dtype, device=buf.device)
        return piece

    def chunk_numel(self, buf: torch.Tensor) -> int:
        """Elements per pipelined piece of ``buf``: ``chunk_bytes`` rounded to the ranks per host."""
        per = max(1, self.chunk_bytes // buf.element_size() // self.ranks_per_host)
        return per * self.ranks_per_host

    def __call__(self, buf: torch.Tensor, piece: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum ``buf`` over every rank of the mesh, in place (pipelined pieces); return it."""
        pipeline = PipelinedHostAllReduce(self)
        pipeline.start(buf, piece)
        pipeline.finish()
        return buf


class ChunkedWork:
    """The works of one buffer's pieces; ``wait`` completes them in order."""

    def __init__(self, works: List[HostAllReduceWork]):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class PipelinedHostAllReduce:
    """Host-aware all-reduces in flight, advanced in lockstep: a buffer is cut into pieces of
    ``reduce.chunk_bytes``, and before each piece starts every outstanding one moves a step
    (oldest first), so a piece started k pieces ago is at step k. The order in which each group
    sees its transfers then depends only on the number of pieces, the same on every rank, while
    the network step of one piece overlaps the host steps of others."""

    def __init__(self, reduce: HostAllReduce):
        self.reduce = reduce
        self.outstanding: List[HostAllReduceWork] = []

    def start(self, buf: torch.Tensor, piece: Optional[torch.Tensor] = None) -> ChunkedWork:
        """Begin the all-reduce of ``buf`` (contiguous, 1-D, a multiple of the ranks per host)."""
        reduce = self.reduce
        piece = reduce.scratch(buf, piece)
        step, per_host = reduce.chunk_numel(buf), reduce.ranks_per_host
        works = []
        for lo in range(0, buf.numel(), step):
            hi = min(lo + step, buf.numel())
            for work in self.outstanding:
                work.step()
            self.outstanding = [w for w in self.outstanding if not w.done]
            part = reduce.start(buf[lo:hi], piece[lo // per_host:hi // per_host])
            self.outstanding.append(part)
            works.append(part)
        return ChunkedWork(works)

    def finish(self) -> None:
        """Complete every outstanding all-reduce, oldest first."""
        for work in self.outstanding:
            work.wait()
        self.outstanding = []
