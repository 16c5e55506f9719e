"""Whether torch symmetric memory maps two ranks (processes) on this one GPU: the line
benchmarks/gpu_check.sh appends to env.txt.

Two processes on cuda:0 join a gloo group, allocate and exchange through torch's symmetric memory
as ``SymmetricBuffer``'s "torch" backend does (its allocate / open, without pyfused's own check of
the switch, so that torch's answer is what shows), write through each other's mapping and read back.
Run once with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` and once with it unset: "honoured"
means the first maps and the second is refused. Prints one line per run and the verdict; exit 0
unless the probe itself broke.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def _rank(rank: int, port: int, allow: bool, results) -> None:
    os.environ[OVERLAP_ENV] = "1" if allow else "0"
    try:
        import torch
        import torch.distributed as dist

        from pyfused.comm.symmetric_backends import TorchSymmetricMemoryBackend

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=30))
        try:
            backend, device = TorchSymmetricMemoryBackend(), torch.device("cuda", 0)
            local, _, state = backend.allocate(1 << 16, device)
            mapping = backend.open(None, rank, local, state, 1 << 16, device, dist.group.WORLD)
            mapping.peers[1 - rank][:16].view(torch.int32).fill_(rank + 1)
            torch.cuda.synchronize()
            dist.barrier()
            got = local[:16].view(torch.int32).tolist()
            ok = got == [2 - rank] * 4
            results.put((rank, f"mapped, peer write {'seen' if ok else f'NOT seen ({got})'}", ok))
        except Exception as e:  # the refusal is the answer, not a failure of the probe
            results.put((rank, f"refused: {type(e).__name__}: {str(e)[:200]}", False))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "probe broke: " + traceback.format_exc()[-400:], None))


def _run(allow: bool):
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, port, allow, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    out = [q.get() for _ in procs if not q.empty()]
    return sorted(out)


def main() -> int:
    verdicts = {}
    for allow in (True, False):
        out = _run(allow)
        for rank, what, _ in out:
            print(f"{OVERLAP_ENV}={int(allow)} rank {rank}: {what}")
        if len(out) < 2 or any(ok is None for _, _, ok in out):
            print("symm-mem probe: broke (see above)")
            return 1
        verdicts[allow] = all(ok for _, _, ok in out)
    honoured = verdicts[True] and not verdicts[False]
    print(f"symm-mem probe: two ranks on one GPU map with the switch: {verdicts[True]}, without: "
          f"{verdicts[False]} -> {OVERLAP_ENV} honoured: {honoured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
