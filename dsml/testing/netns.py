"""Several "hosts" on one Linux machine, each a network namespace (testing helpers).

`netns_hosts(4)` builds, for one test or benchmark run:

- one namespace per host, with loopback and an `eth0` that holds the host's address
  (`10.217.44.1`, `.2`, ... in a private /24 that exists only inside these namespaces;
  with `family=6`, only `fd00:217:44::1`, `::2`, ... in a /64 of unique-local addresses,
  added `nodad` so they are usable at once, and no IPv4 address on `eth0`),
  and its own host name (`h0`, `h1`, ...) that every command started there sees, with an
  `/etc/hosts` naming all the hosts;
- a bridge in a namespace of its own, so the machine's own networking is never touched;
- a veth pair per host from its `eth0` to a bridge port, shaped in both directions with a
  token-bucket filter (`tc qdisc ... tbf rate 1gbit`), like a full-duplex NIC.

Names carry the creating process's id, so concurrent runs never collide, and everything
is removed again on `close()` (and, for namespaces of processes that died without
cleaning up, by the next run). It needs root, `ip` and `tc` (iproute2), and `nsenter`,
`unshare`, `mount` (util-linux); `unavailable_reason()` says what is missing.

    from dsml.testing.netns import netns_hosts

    with netns_hosts(4, rate="10gbit") as hosts:
        procs = [h.popen(["python", "worker.py", h.address]) for h in hosts]
        hosts.set_rate("1gbit")                   # every link; or hosts[2].set_rate(...)
        print(hosts[0].run(["ip", "addr"]).stdout)
        print(measure_rate(hosts[0], hosts[1]) / 1e9, "Gbit/s")

From a benchmark (benchmarks/*.py, run as root from the repository root with dsml
importable: installed, or `PYTHONPATH=$PWD`), import it the same way; `unavailable_reason()`
tells a script what to say instead of running. Tests use the fixture in
tests/harness/netns.py (`hosts`, in tests/multihost). `python -m dsml.testing.netns
1gbit 10gbit none` measures what one TCP stream gets through each kind of link.

Commands run through `nsenter --net` plus a private UTS and mount namespace (for the host
name and `/etc/hosts`), not `ip netns exec`, which also remounts `/sys`. Nothing in dsml
imports this module.

This module holds the hosts (`Host`, `NetnsHosts`, `netns_hosts`) and the command line;
the commands under them (availability, `_sh`, `tbf_args`, leftovers, killing what ran)
are in netns_commands.py, and `measure_rate` in netns_measure.py, both re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..transport.addresses import format_tcp
from .netns_commands import (
    _NETNS_DIR,
    _PREFIX,
    NetnsError,
    _kill_group,
    _kill_inside,
    _rate_bits,
    _remove_orphans,
    _sh,
    leftover_namespaces,
    tbf_args,
    unavailable_reason,
)
from .netns_measure import measure_rate

__all__ = ["Host", "NetnsError", "NetnsHosts", "leftover_namespaces", "netns_hosts"]
__all__ += ["measure_rate", "tbf_args", "unavailable_reason"]

SUBNET = "10.217.44"  # a private /24, configured only inside the namespaces made here
SUBNET6 = "fd00:217:44::"  # a unique-local /64, likewise (family=6)
_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespaced host: run commands there; reach it at `address`."""

    index: int
    name: str  # the host name commands see (`hostname`), also in every host's /etc/hosts
    netns: str  # the namespace's name for `ip netns` / `/run/netns/<netns>`
    address: str  # its address on the shared bridge (IPv4, or IPv6 with family=6)
    port: str  # its veth end in the bridge's namespace
    bridge_netns: str
    hosts_file: str
    _procs: list[subprocess.Popen[Any]] = dataclasses.field(repr=False, compare=False)
    family: int = 4  # 4 or 6: which kind of address `address` is

    def tcp(self, port: int | str) -> str:
        """The tcp:// address of `port` on this host (`tcp://[fd00:217:44::1]:5555` for v6)."""
        return format_tcp(self.address, port)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run on this host (its network, host name and /etc/hosts)."""
        setup = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return [
            "nsenter",
            f"--net={_NETNS_DIR / self.netns}",
            "--",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            setup,
            self.name,
            self.hosts_file,
            *argv,
        ]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` on this host; the harness kills its process group on close.

        Keyword arguments go to `subprocess.Popen`; the child leads a new session, so
        `os.killpg(proc.pid, ...)` reaches it and whatever it started. Its pid is the
        command's own (the wrappers exec it).
        """
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to completion; text output captured by default."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), timeout=timeout, check=check, **kwargs)

    def set_rate(self, rate: str) -> None:
        """Shape this host's link to `rate` in both directions."""
        _sh("tc", "-n", self.netns, "qdisc", "replace", "dev", "eth0", "root", *tbf_args(rate))
        _sh(*_port_qdisc(self, rate))


def _port_qdisc(host: Host, rate: str) -> list[str]:
    """`tc` command shaping the bridge's end of `host`'s link (what the host receives)."""
    port = ["tc", "-n", host.bridge_netns, "qdisc", "replace", "dev", host.port, "root"]
    return [*port, *tbf_args(rate)]


class NetnsHosts(Sequence[Host]):
    """Namespaced hosts on one bridge; index it for a `Host`; `close()` removes it all."""

    def __init__(
        self,
        n_hosts: int,
        *,
        rate: str | None = "1gbit",
        names: Sequence[str] = (),
        family: int = 4,
    ):
        if family not in (4, 6):
            raise ValueError(f"family must be 4 or 6, got {family}")
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts must be in 1..250, got {n_hosts}")
        if names and len(names) != n_hosts:
            raise ValueError(f"got {len(names)} names for {n_hosts} hosts")
        if rate is not None:
            _rate_bits(rate)  # a bad rate fails before anything is built
        self.rate = rate
        self.family = family
        tag = f"{_PREFIX}{os.getpid()}x{next(_counter)}"
        self.bridge_netns = f"{tag}br"
        host_names = list(names) or [f"h{i}" for i in range(n_hosts)]
        self._dir = tempfile.mkdtemp(prefix=f"{tag}-")
        hosts_file = os.path.join(self._dir, "hosts")
        procs: list[subprocess.Popen[Any]] = []
        self._procs = procs
        self._hosts = [
            Host(
                i,
                host_names[i],
                f"{tag}h{i}",
                f"{SUBNET6}{i + 1}" if family == 6 else f"{SUBNET}.{i + 1}",
                f"p{i}",
                self.bridge_netns,
                hosts_file,
                procs,
                family,
            )
            for i in range(n_hosts)
        ]
        self._made: list[str] = []
        self._closed = False

    def __repr__(self) -> str:
        names = ", ".join(f"{h.name}={h.address}" for h in self._hosts)
        return (
            f"NetnsHosts({names}, rate={self.rate}, family={self.family}, "
            f"bridge={self.bridge_netns})"
        )

    def __len__(self) -> int:
        return len(self._hosts)

    def __getitem__(self, index: int) -> Host:  # type: ignore[override]
        return self._hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts)

    @property
    def namespaces(self) -> list[str]:
        """The names of this instance's namespaces (bridge first), whether they exist or not."""
        return [self.bridge_netns, *(h.netns for h in self._hosts)]

    @property
    def addresses(self) -> list[str]:
        """Every host's address (IPv4, or IPv6 with family=6), in host order."""
        return [h.address for h in self._hosts]

    def open(self) -> NetnsHosts:
        """Build the namespaces, links and shaping; on failure, remove what was built."""
        _remove_orphans()
        try:
            self._write_hosts_file()
            self._add_netns(self.bridge_netns)
            _sh("ip", "-n", self.bridge_netns, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.bridge_netns, "link", "set", "br0", "up")
            for host in self._hosts:
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _write_hosts_file(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{h.address} {h.name}" for h in self._hosts]
        Path(self._hosts[0].hosts_file).write_text("\n".join(lines) + "\n")
        os.chmod(self._dir, 0o755)  # daemons that drop root (munge) read it too

    def _add_netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)

    def _add_host(self, host: Host) -> None:
        ns, br = host.netns, self.bridge_netns
        self._add_netns(ns)
        # Both ends are created inside their namespaces: no name ever appears in the root one.
        _sh(
            "ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", host.port, "netns", br
        )
        _sh("ip", "-n", br, "link", "set", host.port, "master", "br0", "up")
        if host.family == 6:  # nodad: usable at once, not "tentative" for a second or two
            _sh("ip", "-n", ns, "-6", "addr", "add", f"{host.address}/64", "dev", "eth0", "nodad")
        else:
            _sh("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        if self.rate is not None:
            _sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf_args(self.rate))
            _sh(*_port_qdisc(host, self.rate))

    def set_rate(self, rate: str) -> None:
        """Shape every host's link to `rate` (both directions)."""
        for host in self._hosts:
            host.set_rate(rate)
        self.rate = rate

    def close(self) -> None:
        """Kill what ran on the hosts, delete the namespaces; idempotent.

        First each command's process group, then, by PID, anything left inside the
        namespaces (processes that left their group, as daemons do).
        """
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _kill_group(proc)
        for name in self._made:
            _kill_inside(name)
        errors = []
        for name in reversed(self._made):
            try:
                _sh("ip", "netns", "delete", name)
            except NetnsError as exc:
                errors.append(str(exc))
        shutil.rmtree(self._dir, ignore_errors=True)
        if errors:
            raise NetnsError("; ".join(errors))

    def __enter__(self) -> NetnsHosts:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def netns_hosts(
    n_hosts: int = 4, *, rate: str | None = "1gbit", names: Sequence[str] = (), family: int = 4
) -> Iterator[NetnsHosts]:
    """`n_hosts` namespaced hosts on one bridge, links shaped to `rate` (None: unshaped),
    addressed by IPv4 or (`family=6`) by IPv6 only."""
    hosts = NetnsHosts(n_hosts, rate=rate, names=names, family=family)
    with hosts:
        yield hosts


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dsml.testing.netns [RATE ...]`: measure each shaped link (as root)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("rates", nargs="*", default=["1gbit", "10gbit", "none"])
    parser.add_argument("--mib", type=int, default=512, help="MiB sent per measure")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"cannot build namespaced hosts: {reason}", file=sys.stderr)
        return 2
    for rate in args.rates:
        shaped = None if rate == "none" else rate
        with netns_hosts(2, rate=shaped) as hosts:
            rates = [measure_rate(hosts[0], hosts[1], args.mib << 20) for _ in range(args.repeat)]
        figures = " ".join(f"{r / 1e9:.3f}" for r in rates)
        print(f"{rate:>8}: {figures} Gbit/s (one TCP stream h0 -> h1, {args.mib} MiB each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
