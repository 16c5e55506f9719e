"""What torchrun runs on every host of the namespace test bed (tests/test_multihost_testbed.py).

    python -m tests.multihost_worker OUT_DIR CHECK[,CHECK...]

Joins the job's gloo group (torchrun's environment; gloo on the bed's link), runs the named rank
bodies of tests/multihost_checks.py in order and writes ``OUT_DIR/rank<r>.json``: this rank's
torchrun environment and host name, what each check returned and how many seconds it took. A
failing check raises, so the rank, and with it torchrun, exits non-zero; the test then shows the
hosts' logs. ``hang`` sleeps forever after joining (for the test that the bed stops a stuck
launch).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tests import multihost_checks as C

CHECKS = {
    "layout": C.layout_and_mesh,
    "fused": C.fused_across_hosts,
    "allreduce": C.host_all_reduce_equals_flat,
    "ddp": C.ddp_matches,
    "bench": C.bench_rows,
    "hsdp": C.hsdp_on_host_mesh,
    "training": C.training_across_hosts,
    "parallelize": C.parallelize_dp_x_tp,
}
GROUP_TIMEOUT_S = 60
ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR",
       "GLOO_SOCKET_IFNAME")


def main(out_dir: str, checks: str) -> None:
    from pyfused import comm

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "host": comm.local_host(), "env": {k: os.environ.get(k) for k in ENV},
              "seconds": {}}
    for name in checks.split(","):
        if name == "hang":
            time.sleep(3600)
        started = time.monotonic()
        result[name] = CHECKS[name](rank, world)
        result["seconds"][name] = round(time.monotonic() - started, 2)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
