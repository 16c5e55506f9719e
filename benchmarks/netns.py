"""Network namespaces for the multi-host test bed (benchmarks/multihost_testbed.py): iproute2
calls, the probe that says whether namespaces can be made here, ending every process of a
namespace, removing the namespaces of beds whose creator died, and link shaping with tc.

Every namespace of a bed is named ``pfmh-<pid of the creating process>-...``: ``clean_stale``
deletes those whose creator is gone and leaves live beds of concurrent runs alone.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence

PREFIX = "pfmh-"
LINK = "mhlink"  # each host's interface (GLOO_SOCKET_IFNAME)
STOP_GRACE_S = 5.0


class TestbedError(RuntimeError):
    """A command building or driving the bed failed; the message holds its output."""


class TestbedTimeout(TestbedError):
    """A launch did not finish in time; every process of the bed was stopped."""


def ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return run(["ip", *args], check=check, timeout=timeout)


def run(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable_reason() -> Optional[str]:
    """Why a bed cannot be made on this machine, or None: checked by making (and deleting) one
    namespace with a veth pair and running a command inside it, which is what a bed needs."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed (.ci/run installs it with apt-get)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}{os.getpid()}-probe{uuid.uuid4().hex[:6]}"
    try:
        ip("netns", "add", probe)
        ip("link", "add", LINK, "netns", probe, "type", "veth", "peer", "name", "p0", "netns", probe)
        ip("netns", "exec", probe, "true")
    except (TestbedError, OSError, subprocess.SubprocessError) as e:
        return f"cannot create a network namespace with a veth pair here: {e}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def namespaces() -> List[str]:
    """The test bed namespaces on this machine (every bed, live or stale)."""
    out = ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_namespace_processes(ns: str, grace_s: float = STOP_GRACE_S) -> List[int]:
    """End every process whose network namespace is ``ns``; returns the pids that were found."""
    def pids() -> List[int]:
        out = ip("netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    found = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids():
            break
    return found


def delete_namespaces(names: Sequence[str]) -> None:
    for ns in names:
        stop_namespace_processes(ns)
    # hosts first: deleting a host's namespace removes its veth pair, then the switch goes
    for ns in sorted(names, key=lambda n: n.endswith("-sw")):
        ip("netns", "del", ns, check=False)


def clean_stale() -> List[str]:
    """Delete the namespaces of beds whose creating process is gone (a crashed or killed run),
    ending the processes inside them first. Live beds of other processes are left alone."""
    stale = []
    for ns in namespaces():
        m = re.match(rf"{re.escape(PREFIX)}(\d+)-", ns)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    delete_namespaces(stale)
    return stale


# tc's rate units, in bits per second (tc also takes bytes: "bps" = bytes per second).
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def rate_bits(rate: str) -> float:
    """A tc rate ("1gbit", "500mbit", "125mbps") in bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]+)\s*", rate.lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 1gbit, 500mbit, 10gbit)")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


@dataclass(frozen=True)
class Shaping:
    """How every inter-host link is shaped, in tc's units ("1gbit", "0.2ms").

    ``tc netem`` where the kernel has it (rate and delay); otherwise a token bucket (``tbf``) for
    the rate, and a delay cannot be emulated (``Testbed.up`` then refuses it: a bed that silently
    dropped the delay would report figures for a link it did not build)."""

    rate: Optional[str] = None
    delay: Optional[str] = None

    def __post_init__(self):
        if self.rate:
            rate_bits(self.rate)

    def netem(self, outbound: bool) -> List[str]:
        """netem arguments of one side of a host's link: outbound gets the delay (counted once
        per direction), both get the rate."""
        args = ["delay", self.delay] if outbound and self.delay else []
        return args + (["rate", self.rate] if self.rate else [])

    def tbf(self) -> List[str]:
        """tbf arguments for the rate: a burst of 2 ms at line rate (at least 256 KiB, above the
        largest GSO packet of a veth) and a queue of up to 50 ms."""
        burst = max(256 * 1024, int(rate_bits(self.rate) / 8 * 2e-3))
        return ["rate", self.rate, "burst", str(burst), "latency", "50ms"]

    def __bool__(self) -> bool:
        return bool(self.rate or self.delay)


