"""An emulated cluster on one machine: hosts joined by links of a chosen speed.

Each host is a network namespace of its own with one interface, `eth0`, at 10.213.0.<k + 1>; the
hosts' interfaces meet on a bridge in a switch namespace, which reaches nothing else, so no
traffic leaves the namespaces made here. The kernel's traffic control caps each host's link both
ways: an HTB class on the host's `eth0` (its uplink) and one on its port of the bridge (its
downlink). Processes started on a host (`command`) see only its interface and loopback; shared
memory stays between processes of one host because a shard maps a segment only for a process of
its own network namespace.

Needs root and iproute2. Namespaces are named after the process that made them
(`gradps-<pid>-h<k>`), so a network left by a process that was killed is deleted by the next one.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EmulatedNetwork", "Host", "Layout", "NetemError", "enter", "format_rate", "parse_links", "unavailable"]

_PREFIX = "gradps-"
_SUBNET = "10.213.0"
_MTU = 9000  # jumbo frames, as on a cluster's fabric
_CLONE_NEWNET = 0x40000000
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit|bps|b)?(?:/s)?", re.IGNORECASE)
# The most hosts one emulated network has (one /24, with room for the switch).
MAX_HOSTS = 200


class NetemError(RuntimeError):
    """An emulated network that cannot be made as asked (one line, for the user)."""


def parse_rate(text: str) -> int:
    """Bits per second of a rate such as "10gbit", "1.5Gbit/s", "100mbit"."""
    match = _RATE.fullmatch(text.strip())
    if not match or float(match[1]) <= 0:
        raise ValueError(f"bad link rate {text!r}: expected a positive rate such as 10gbit, 1gbit or 100mbit")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def format_rate(bits_per_s: int) -> str:
    """ "10gbit", "2.5gbit", "100mbit": the rate as `parse_rate` reads it back."""
    for unit, scale in (("t", 10**12), ("g", 10**9), ("m", 10**6), ("k", 10**3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}bit"
    return f"{bits_per_s}bit"


def parse_links(text: str, hosts: int) -> list[int]:
    """Each host's link rate from "RATE" or "RATE,host3=RATE,...": every host at RATE but those
    named (hosts count from 0)."""
    default: int | None = None
    overrides: dict[int, int] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, sep, rate = item.partition("=")
        if not sep:
            if default is not None:
                raise ValueError(f"link {text!r}: one default rate, then host<K>=RATE overrides")
            default = parse_rate(name)
            continue
        index = re.fullmatch(r"host(\d+)", name.strip())
        if not index:
            raise ValueError(f"link {item!r}: expected host<K>=RATE, e.g. host3=1gbit")
        if int(index[1]) >= hosts:
            raise ValueError(f"link {item!r}: there are {hosts} hosts, host0 to host{hosts - 1}")
        overrides[int(index[1])] = parse_rate(rate)
    if default is None:
        raise ValueError(f"link {text!r}: give a rate for every host, e.g. 10gbit or 10gbit,host3=1gbit")
    return [overrides.get(k, default) for k in range(hosts)]


@dataclass(frozen=True)
class Layout:
    """Which host each process runs on: the coordinator, shard i, worker i."""

    coordinator: int
    shards: tuple[int, ...]
    workers: tuple[int, ...]

    @property
    def hosts(self) -> int:
        return 1 + max(self.coordinator, *self.shards, *self.workers)

    @classmethod
    def colocated(cls, shards: int, workers: int) -> Layout:
        """Worker i and shard i share host i (BytePS's colocated placement); the coordinator on host 0."""
        return cls(0, tuple(range(shards)), tuple(range(workers)))

    @classmethod
    def separate(cls, shards: int, workers: int) -> Layout:
        """Workers on hosts 0..W-1, shards on hosts of their own after them; the coordinator on host 0."""
        return cls(0, tuple(range(workers, workers + shards)), tuple(range(workers)))

    @classmethod
    def named(cls, name: str, shards: int, workers: int) -> Layout:
        if name not in LAYOUTS:
            raise ValueError(f"hosts {name!r}: expected {' or '.join(LAYOUTS)}")
        return cls.colocated(shards, workers) if name == "colocated" else cls.separate(shards, workers)


LAYOUTS = ("colocated", "separate")


def unavailable() -> str | None:
    """Why this machine cannot emulate a network here (not root, no iproute2), or None."""
    if os.geteuid() != 0:
        return "emulated links need root (network namespaces and traffic control)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "emulated links need iproute2 (ip and tc)"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetemError(f"{' '.join(argv)}: {(done.stderr or done.stdout).strip().splitlines()[-1]}")


def _namespaces() -> list[str]:
    try:
        return sorted(os.listdir("/run/netns"))
    except FileNotFoundError:
        return []


def sweep() -> None:
    """Delete the emulated networks of processes that are gone (a bench killed mid-run)."""
    for name in _namespaces():
        match = re.fullmatch(rf"{_PREFIX}(\d+)-\w+", name)
        if match and not os.path.exists(f"/proc/{match[1]}"):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def enter(namespace: str) -> None:
    """Move the calling thread into `namespace` (a name of `ip netns`): every socket it opens from
    now on, and every thread and process it starts, is on that host. Call it before the process
    opens any connection (gRPC's threads start with the first channel)."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise NetemError(f"cannot enter network namespace {namespace}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Host:
    """One emulated host, as a process that moves onto it needs it: its namespace and address."""

    namespace: str
    address: str

    def enter(self) -> None:
        """Move this process (new, still one thread) onto the host."""
        enter(self.namespace)


class EmulatedNetwork:
    """Hosts in network namespaces of their own, each link capped at its rate (bits per second)."""

    def __init__(self, rates: Sequence[int]) -> None:
        if not 1 <= len(rates) <= MAX_HOSTS:
            raise NetemError(f"an emulated network has 1 to {MAX_HOSTS} hosts, not {len(rates)}")
        if reason := unavailable():
            raise NetemError(reason)
        self.rates = list(rates)
        self._tag = f"{_PREFIX}{os.getpid()}"
        self._made: list[str] = []

    @property
    def hosts(self) -> int:
        return len(self.rates)

    def namespace(self, host: int) -> str:
        return f"{self._tag}-h{host}"

    def address(self, host: int) -> str:
        """Host `host`'s address, on its interface `eth0`."""
        return f"{_SUBNET}.{host + 1}"

    def host(self, host: int) -> Host:
        return Host(self.namespace(host), self.address(host))

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host` (in its namespace; `ip netns exec` then execs it, so the pid is its)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def start(self) -> EmulatedNetwork:
        sweep()
        switch = f"{self._tag}-sw"
        try:
            self._add(switch)
            _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", switch, "link", "set", "br0", "up")
            for host, rate in enumerate(self.rates):
                self._add_host(switch, host, rate)
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, namespace: str) -> None:
        _run("ip", "netns", "add", namespace)
        self._made.append(namespace)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")

    def _add_host(self, switch: str, host: int, rate: int) -> None:
        ns, port = self.namespace(host), f"port{host}"
        self._add(ns)
        # Made in the two namespaces at once: the names never meet the machine's own.
        _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", port, "netns", switch)
        _run("ip", "-n", ns, "link", "set", "eth0", "mtu", str(_MTU))
        _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", switch, "link", "set", port, "mtu", str(_MTU), "master", "br0", "up")
        _cap(ns, "eth0", rate)  # the uplink: what the host sends
        _cap(switch, port, rate)  # the downlink: what the switch sends it

    def set_rates(self, rates: Sequence[int]) -> None:
        """Cap each host's link at its new rate (both ways), the hosts and their connections kept."""
        if len(rates) != self.hosts:
            raise NetemError(f"{len(rates)} rates for {self.hosts} hosts")
        for host, rate in enumerate(rates):
            _cap(self.namespace(host), "eth0", rate, "change")
            _cap(f"{self._tag}-sw", f"port{host}", rate, "change")
        self.rates = list(rates)

    def close(self) -> None:
        """Delete every namespace made here (their interfaces and queues go with them); a process
        still inside one keeps it until it exits."""
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
        self._made.clear()

    def __enter__(self) -> EmulatedNetwork:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cap(namespace: str, device: str, rate: int, verb: str = "add") -> None:
    """An HTB class at `rate` for all of `device`'s egress (`verb` "change": a new rate for it).
    Its bursts hold a millisecond at the rate (at least two 64 KiB segments: the veth hands the
    queue whole GSO segments)."""
    burst = max(128 << 10, rate // 8 // 1000)
    quantum = 200_000  # HTB's largest: a class of its own needs no fairness within it
    tc = ("ip", "netns", "exec", namespace, "tc")
    if verb == "add":
        _run(*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1")
    _run(
        *tc, "class", verb, "dev", device, "parent", "1:", "classid", "1:1", "htb",
        "rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", str(burst), "cburst", str(burst), "quantum", str(quantum),
    )  # fmt: skip
