"""A multi-host test bed on one Linux machine: N hosts as network namespaces on one bridge, each
running real ``torchrun`` against the first host's address, or against a rendezvous host of its
own (docs/MULTIHOST.md).

Layout. Every name starts with the bed's tag, ``pfmh-<pid of the creating process>``, so that
several beds (concurrent test runs) never collide and a bed whose creator died is recognised as
stale and removed (``clean_stale``)::

    namespace <tag>-sw    the switch: bridge "br0" with one port "p<i>" per host
    namespace <tag>-h<i>  host i: "lo" and "mhlink" (10.77.0.<i+1>/24), the far end of port p<i>
    namespace <tag>-rdzv  the rendezvous host (``rendezvous_host=True``): "mhlink" 10.77.0.254/24,
                          the far end of port "pr"; it runs no ranks, only torch's TCPStore

Nothing is created in the machine's own network namespace: no address, route or link of it
changes, and the hosts' traffic can reach nothing but the other hosts of the bed. gloo binds to
"mhlink" (``GLOO_SOCKET_IFNAME``) and torchrun's rendezvous store listens on host 0's address
(``--rdzv-endpoint``, ``--local-addr``), so every byte between two hosts crosses the bridge.

The rendezvous store. By default host 0's torchrun agent serves it (``is_host=1``), as the first
node of a c10d rendezvous does, so losing host 0 ends the job on every host. With
``rendezvous_host=True`` the bed starts the store in a namespace of its own -- torch's
``TCPStore(..., is_master=True)`` in a ``python -c`` process (``STORE_SERVER``), the bed's for its
whole life -- and every agent joins it with ``is_host=0``: any host may then be lost. Each agent's
``--local-addr`` is its own address, which torchrun makes the workers' ``MASTER_ADDR`` when its
node is rank 0 of a round, so a job re-formed without host 0 forms its workers' store on its new
rank 0's host (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on a store the workers make
themselves, without it on one the agent serves).

Shaping (optional): ``tc netem`` on both ends of each host's link -- the egress of "mhlink" (what
the host sends: ``rate`` and ``delay``) and of port p<i> (what it receives: ``rate``) -- so each
host has a full-duplex NIC of ``rate`` and the one-way latency between two hosts is ``delay``.
A kernel without netem gets a token bucket (``tbf``) for the rate and cannot add a delay
(``Shaping``). Traffic between the ranks of one host stays inside its namespace (local routing)
and is not shaped.

Processes. ``launch`` starts one command per host inside its namespace, in a session of its own,
its output in a log file per host. ``stop`` ends every process that lives in a host namespace
(SIGTERM, then SIGKILL after a grace period): torchrun's workers run in sessions of their own, so
the namespace, not a process group, is what holds all of them. ``kill_host``, ``freeze_host`` and
``cut_link`` / ``restore_link`` act on one host, for failure tests; ``Elastic`` gives a launch
torchrun's elastic options (``--nnodes MIN:N``, ``--max-restarts``, rendezvous settings).

By hand::

    python -m benchmarks.multihost_testbed --hosts 2 --rate 1gbit --delay 0.2ms -- \\
        -m pyfused.bench --suites multihost --out bench_out/multihost
    python -m benchmarks.multihost_testbed --clean      # remove beds left by crashed runs

Needs root, Linux network namespaces and iproute2 (``ip``, ``tc``); ``netns.unavailable_reason()``
says why a bed cannot be made here. The namespace plumbing (probe, stopping processes, stale beds,
shaping) is in benchmarks/netns.py.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .netns import (  # noqa: F401  (the bed's interface: tests use these names from here)
    LINK,
    PREFIX,
    STOP_GRACE_S,
    Shaping,
    TestbedError,
    TestbedTimeout,
    clean_stale,
    delete_namespaces,
    ip,
    namespaces,
    run,
    stop_namespace_processes,
    unavailable_reason,
)

SUBNET = "10.77.0"
PREFIX_LEN = 24
BRIDGE = "br0"
RDZV_PORT = 29400
RENDEZVOUS_ADDRESS = f"{SUBNET}.254"  # the rendezvous host's (rendezvous_host=True)
RENDEZVOUS_PORT_NAME = "pr"           # its port on the switch
STORE_READY_S = 180.0                 # importing torch on a loaded 2-core box
# What the rendezvous host runs: torch's TCPStore server, serving until the bed ends the process.
STORE_SERVER = ("import datetime, signal, sys; import torch.distributed as dist; "
                "store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, "
                "wait_for_workers=False, timeout=datetime.timedelta(seconds=60)); "
                "print('serving the rendezvous store on', sys.argv[1], sys.argv[2], flush=True); "
                "signal.pause()")
MAX_HOSTS = 16
# Set in every host's environment to describe the links (benchmarks record it in their rows).
LINK_ENV = "MULTIHOST_LINK"
# Variables a bed's hosts must not inherit: torchrun sets its own, and a stale one (from a shell
# or an outer launcher) would point a rank at the wrong rendezvous or host name.
LAUNCH_ENV_DROP = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE",
                   "TORCHELASTIC_RUN_ID", "PYFUSED_HOST", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True)
class Elastic:
    """torchrun's elastic options for a launch: ``--nnodes <min_nodes>:<hosts>``,
    ``--max-restarts``, and rendezvous settings (``"last_call_timeout=5"``, ...) added to
    ``--rdzv-conf``."""

    min_nodes: int = 1
    max_restarts: int = 0
    rdzv_conf: Sequence[str] = ()


@dataclass
class Launch:
    """The processes of one launch (one per host) and their logs."""

    procs: List[subprocess.Popen]
    logs: List[Path]
    bed: "Testbed"
    returncodes: List[Optional[int]] = field(default_factory=list)

    def wait(self, timeout: float, hosts: Optional[Sequence[int]] = None) -> List[int]:
        """The exit status of every host (or of ``hosts``); past ``timeout`` seconds the bed's
        processes are stopped and ``TestbedTimeout`` names the hosts still running, with the end of
        their logs."""
        hosts = range(len(self.procs)) if hosts is None else hosts
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.procs[i].poll() is None for i in hosts):
            time.sleep(0.2)
        running = [i for i in hosts if self.procs[i].poll() is None]
        if running:
            self.bed.stop()
            for p in self.procs:
                p.wait(timeout=STOP_GRACE_S)
            raise TestbedTimeout(f"host(s) {running} did not finish within {timeout:.0f} s; every "
                                 f"process of the bed was stopped\n{self.tails()}")
        self.returncodes = [p.returncode for p in self.procs]
        return [self.returncodes[i] for i in hosts]

    def tails(self, lines: int = 40) -> str:
        parts = []
        for i, log in enumerate(self.logs):
            text = log.read_text(errors="replace").splitlines() if log.exists() else []
            parts.append(f"--- host {i} ({log}), last {lines} lines:\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)


class Testbed:
    """``hosts`` network namespaces on one bridge; use as a context manager (``up`` / ``down``).
    ``rendezvous_host``: serve torchrun's rendezvous store from a namespace of its own, which runs
    no ranks, instead of from host 0's agent (module docstring)."""

    def __init__(self, hosts: int = 2, shaping: Shaping = Shaping(), log_dir: Optional[Path] = None,
                 rendezvous_host: bool = False):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in [1, {MAX_HOSTS}], got {hosts}")
        self.hosts = hosts
        self.shaping = shaping
        self.tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-sw"
        self.rendezvous_namespace = f"{self.tag}-rdzv" if rendezvous_host else None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.launches = 0
        self.shaper: Optional[str] = None  # the qdisc that shapes the links: "netem" or "tbf"
        self.store: Optional[subprocess.Popen] = None  # the rendezvous host's store server
        self._created: List[str] = []

    def namespace(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    @staticmethod
    def address(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    @property
    def rendezvous_address(self) -> str:
        """Where torchrun's rendezvous store listens: the rendezvous host, else host 0."""
        return RENDEZVOUS_ADDRESS if self.rendezvous_namespace else self.address(0)

    # ------------------------------------------------------------------ building and removing
    def up(self) -> "Testbed":
        """Create the namespaces, links and shaping; on any failure remove what was made."""
        clean_stale()
        try:
            self._add_namespace(self.switch)
            ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            ip("-n", self.switch, "link", "set", BRIDGE, "up")
            for i in range(self.hosts):
                self._add_host(i)
            if self.rendezvous_namespace:
                self._add_rendezvous_host()
        except BaseException:
            self.down()
            raise
        return self

    def _add_namespace(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._created.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def _add_host(self, i: int) -> None:
        ns, port = self.namespace(i), f"p{i}"
        self._plug(ns, port, self.address(i))
        if self.shaping:
            self._shape(ns, LINK, outbound=True)
            if self.shaping.rate:
                self._shape(self.switch, port, outbound=False)

    def _plug(self, ns: str, port: str, address: str) -> None:
        """A new namespace ``ns`` whose link, at ``address``, is port ``port`` of the switch."""
        self._add_namespace(ns)
        ip("link", "add", LINK, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", BRIDGE)
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", LINK)
        ip("-n", ns, "link", "set", LINK, "up")

    def _add_rendezvous_host(self) -> None:
        """The rendezvous host (unshaped: it carries only the agents' store traffic) and its
        store server, once it listens."""
        ns = self.rendezvous_namespace
        self._plug(ns, RENDEZVOUS_PORT_NAME, RENDEZVOUS_ADDRESS)
        log_dir = self.log_dir or Path.cwd() / "multihost_logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / "rendezvous_store.log"
        with log.open("w") as out:
            self.store = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", STORE_SERVER, RENDEZVOUS_ADDRESS,
                 str(RDZV_PORT)], env=self.host_env(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + STORE_READY_S
        while "serving" not in log.read_text(errors="replace"):
            if self.store.poll() is not None or time.monotonic() > deadline:
                raise TestbedError(f"the rendezvous store did not start within {STORE_READY_S:g} s "
                                   f"(exit status {self.store.poll()}): {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _shape(self, ns: str, dev: str, outbound: bool) -> None:
        """netem on ``dev``'s egress; tbf where the kernel has no netem and no delay is asked."""
        if self.shaper in (None, "netem"):
            proc = run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem",
                         *self.shaping.netem(outbound)], check=False)
            if proc.returncode == 0:
                self.shaper = "netem"
                return
            if "unknown" not in proc.stderr.lower():
                raise TestbedError(f"tc netem on {dev} in {ns} failed: {proc.stderr.strip()}")
            if self.shaping.delay:
                raise TestbedError(
                    f"this kernel has no netem qdisc (sch_netem), so the link delay "
                    f"{self.shaping.delay} cannot be emulated; leave the delay out to shape the "
                    f"rate alone with tbf")
            self.shaper = "tbf"
        run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", *self.shaping.tbf()])

    def down(self) -> None:
        """Stop every process of the bed and delete its namespaces (safe to call twice)."""
        delete_namespaces(self._created)
        self._created = []
        if self.store is not None:
            self.store.wait(timeout=STOP_GRACE_S)  # ended with its namespace; reap it
            self.store = None

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ processes
    def popen(self, host: int, argv: Sequence[str], env: Dict[str, str], log: Path) -> subprocess.Popen:
        """``argv`` inside host ``host``'s namespace, in a new session, output into ``log``."""
        with log.open("w") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def host_env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_DROP}
        env.setdefault("OMP_NUM_THREADS", "1")
        env["GLOO_SOCKET_IFNAME"] = LINK
        env[LINK_ENV] = self.link_description()
        env.update(extra or {})
        return env

    def torchrun_argv(self, host: int, command: Sequence[str], nproc_per_node: int = 2,
                      run_id: str = "bed", port: int = RDZV_PORT,
                      elastic: Optional[Elastic] = None) -> List[str]:
        """torchrun on host ``host``, joining the c10d rendezvous whose store host 0 serves, or the
        rendezvous host; ``command`` is what torchrun runs: ``["-m", "module", ...]`` or
        ``["script.py", ...]``. Without ``elastic``: exactly the bed's hosts, no restart."""
        elastic = elastic or Elastic(min_nodes=self.hosts)
        serves = host == 0 and not self.rendezvous_namespace
        conf = ",".join([f"is_host={int(serves)}", *elastic.rdzv_conf])
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", f"{elastic.min_nodes}:{self.hosts}",
                "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.rendezvous_address}:{port}",
                "--rdzv-id", run_id, "--rdzv-conf", conf, "--local-addr", self.address(host),
                "--max-restarts", str(elastic.max_restarts), *command]

    def launch(self, command: Sequence[str], nproc_per_node: int = 2,
               env: Optional[Dict[str, str]] = None, log_dir: Optional[Path] = None,
               elastic: Optional[Elastic] = None) -> Launch:
        """torchrun with ``command`` on every host at once; wait with ``Launch.wait``."""
        log_dir = Path(log_dir or self.log_dir or Path.cwd() / "multihost_logs")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.launches += 1
        run_id = f"{self.tag}-{self.launches}"
        host_env = self.host_env(env)
        procs, logs = [], []
        try:
            for i in range(self.hosts):
                log = log_dir / f"launch{self.launches}_host{i}.log"
                argv = self.torchrun_argv(i, command, nproc_per_node, run_id, elastic=elastic)
                procs.append(self.popen(i, argv, host_env, log))
                logs.append(log)
        except BaseException:
            self.stop()
            raise
        return Launch(procs, logs, self)

    def stop(self) -> None:
        """End every process of every host (the bed itself stays up)."""
        for i in range(self.hosts):
            if self.namespace(i) in self._created:
                stop_namespace_processes(self.namespace(i))

    # ------------------------------------------------------------------ failures of one host
    def kill_host(self, host: int) -> List[int]:
        """SIGKILL every process of host ``host`` at once (a host that lost power)."""
        return self._signal_host(host, signal.SIGKILL)

    def _signal_host(self, host: int, sig: signal.Signals) -> List[int]:
        pids = [int(p) for p in ip("netns", "pids", self.namespace(host), check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def freeze_host(self, host: int) -> List[int]:
        """SIGSTOP every process of host ``host`` (a host that hangs: its sockets stay open, nothing
        answers). ``kill_host`` or ``stop`` ends them (SIGKILL reaches a stopped process)."""
        return self._signal_host(host, signal.SIGSTOP)

    def cut_link(self, host: int) -> None:
        """Take host ``host``'s link down: its processes live on, unreachable."""
        ip("-n", self.namespace(host), "link", "set", LINK, "down")

    def restore_link(self, host: int) -> None:
        ip("-n", self.namespace(host), "link", "set", LINK, "up")

    def link_description(self) -> str:
        """What the links are, for the rows of a benchmark: e.g. "tbf rate 1gbit"."""
        if not self.shaping:
            return "unshaped veth"
        parts = [self.shaper or "?"]
        parts += [f"rate {self.shaping.rate}"] if self.shaping.rate else []
        parts += [f"delay {self.shaping.delay}"] if self.shaping.delay else []
        return " ".join(parts)

    def qdiscs(self, host: int) -> str:
        """``tc qdisc show`` of host ``host``'s link (what shaping is in force)."""
        return run(["tc", "-n", self.namespace(host), "qdisc", "show", "dev", LINK]).stdout


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multihost_testbed",
        description="Run a command under torchrun on N hosts made of network namespaces.",
        epilog="Everything after -- is what torchrun runs on every host, e.g. "
               "-- -m pyfused.bench --suites multihost")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rate", help="tc netem rate of every host's link, e.g. 1gbit")
    parser.add_argument("--delay", help="one-way host-to-host delay, e.g. 0.2ms")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before every process "
                        "is stopped (default 1800)")
    parser.add_argument("--min-nodes", type=int, help="elastic: torchrun --nnodes MIN:HOSTS "
                        "(default: exactly HOSTS)")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun --max-restarts")
    parser.add_argument("--rdzv-conf", default="", help="more torchrun --rdzv-conf settings, e.g. "
                        "last_call_timeout=5,keep_alive_interval=1")
    parser.add_argument("--rendezvous-host", action="store_true", help="serve torchrun's "
                        "rendezvous store from a namespace of its own (10.77.0.254), running no "
                        "ranks, so that host 0 can be lost too (default: host 0's agent serves it)")
    parser.add_argument("--logs", type=Path, default=Path("multihost_logs"))
    parser.add_argument("--clean", action="store_true", help="only remove stale beds and exit")
    args, rest = parser.parse_known_args(argv)
    if args.clean:
        removed = clean_stale()
        print(f"removed {len(removed)} stale namespace(s): {removed}")
        return 0
    command = rest[1:] if rest[:1] == ["--"] else rest
    if not command:
        parser.error("give the command torchrun runs after --")
    why = unavailable_reason()
    if why:
        print(f"multihost test bed unavailable: {why}", file=sys.stderr)
        return 2
    with Testbed(args.hosts, Shaping(args.rate, args.delay), args.logs,
                 rendezvous_host=args.rendezvous_host) as bed:
        for i in range(bed.hosts):
            print(f"host {i}: namespace {bed.namespace(i)}, address {bed.address(i)} "
                  f"(ip netns exec {bed.namespace(i)} bash)")
            if bed.shaping:
                print("   " + bed.qdiscs(i).strip().replace("\n", "\n   "))
        if bed.rendezvous_namespace:
            print(f"rendezvous host: namespace {bed.rendezvous_namespace}, address "
                  f"{bed.rendezvous_address}, serving torchrun's store on port {RDZV_PORT}")
        elastic = Elastic(args.min_nodes or args.hosts, args.max_restarts,
                          tuple(c for c in args.rdzv_conf.split(",") if c))
        launch = bed.launch(command, args.nproc_per_node, elastic=elastic)
        print(f"logs: {', '.join(map(str, launch.logs))}", flush=True)
        try:
            codes = launch.wait(args.timeout)
        except TestbedTimeout as e:
            print(e, file=sys.stderr)
            return 124
        print(launch.tails(20))
        print(f"exit status per host: {codes}")
        return max(abs(c) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
