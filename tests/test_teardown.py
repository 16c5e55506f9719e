"""At exit, no process group that ``destroy_process_group`` removed is still alive
(pyfused/comm/teardown.py): a gloo group left to the interpreter's finalization can abort the
process after a clean run, when one of its worker threads drops a finished collective's last
reference to a Python tensor and cannot take the GIL. The abort is a race, rare in a single run;
what this checks is its cause, deterministically: after a workload that touches every holder known
(validation's record and the plan cache, a registered op called in grad mode, DDP's gradient hooks,
``fully_shard``'s shard owners and DTensor's caches), the group is gone and its worker threads
joined by the time the interpreter finalizes.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter. The checker is registered with atexit before pyfused is imported,
# so it runs after pyfused's exit hook (atexit runs the last registered first).
SCRIPT = """
import atexit, gc, os, sys, weakref
import torch, torch.distributed as dist

def gloo_workers():
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sum(name == "pt_gloo_runloop" for name in names)

def check():
    print("at exit: group alive", group() is not None, "gloo workers", gloo_workers(), flush=True)

atexit.register(check)
if sys.argv[1] == "unhooked":
    import pyfused.comm.teardown
    atexit.unregister(pyfused.comm.teardown.release_destroyed_groups)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = weakref.ref(dist.group.WORLD)

import pyfused
from pyfused import ops
from pyfused.layers import DistributedDataParallel
from tests import test_fsdp_helpers as H

# validation's record and the plan cache; a registered op in grad mode (torch then imports
# torch.distributed.nn.functional, whose defaults take the default group)
a, b = torch.randn(4, 6, requires_grad=True), torch.randn(6, 2)
ops.matmul_all_reduce(a, b, method="unfused").sum().backward()
ops.matmul_all_reduce(a.detach(), b, method="unfused")

# DDP: its gradient hooks live on the parameters
ddp = DistributedDataParallel(torch.nn.Linear(6, 3))
ddp(torch.randn(5, 6)).sum().backward()

# fully_shard, then DTensor redistribution (the state dict's full tensors)
model = H.build("mlp")
for unit in model.units():
    pyfused.fully_shard(unit)
pyfused.fully_shard(model)
model.loss(H.batch("mlp", 0, 0, 4)).backward()
full = {k: v.full_tensor() for k, v in model.state_dict().items()}

del a, b, ddp, model, unit, full
dist.destroy_process_group()
print("after destroy: group alive", group() is not None, "gloo workers", gloo_workers(), flush=True)
"""


def run(mode: str) -> list:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_destroyed_groups_are_gone_before_the_interpreter_finalizes():
    # without the exit hook, the workload leaves the group alive (the check can fail) ...
    after_destroy, at_exit = run("unhooked")
    assert after_destroy.startswith("after destroy: group alive True"), after_destroy
    assert at_exit.startswith("at exit: group alive True"), at_exit
    # ... with it, the group is destroyed and its worker threads joined before finalization
    after_destroy, at_exit = run("hooked")
    assert at_exit == "at exit: group alive False gloo workers 0", at_exit
