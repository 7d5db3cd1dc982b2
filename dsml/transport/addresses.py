"""Addresses as others reach them, and the interfaces to bind (transport layer).

The one place that reads and writes `tcp://` addresses. A host is kept unbracketed inside
(`::1`, `10.0.0.1`, `node-3`) and bracketed when written into an address
(`tcp://[::1]:5555`), as ZeroMQ and URLs spell IPv6. Names resolve with `getaddrinfo`
and keep their family: a name with an IPv4 address resolves to it (as before IPv6
support), a name with only IPv6 addresses to its first IPv6 one.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct

from ..errors import ConfigError

__all__ = [
    "advertised",
    "bracketed",
    "family_of",
    "format_tcp",
    "host_of",
    "interface_address",
    "is_local_address",
    "is_loopback_host",
    "loopback_bind",
    "resolve_host",
    "route_to",
    "split_tcp",
    "wants_ipv6",
]

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::")
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_IF_INET6 = "/proc/net/if_inet6"  # Linux: one line per IPv6 address of every interface


def split_tcp(address: str, what: str = "address") -> tuple[str, str]:
    """Split `tcp://host:port` or `tcp://[v6]:port` into (host, port), host unbracketed.

    The port is returned as written: digits, or `*` (ZeroMQ's "any port").

    Raises:
        ConfigError: not a tcp:// address with a host and a port; `what` names it.
    """
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ConfigError(f"{what} {address!r} is not a tcp://host:port address")
    rest = address[len("tcp://") :]
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        port = tail[1:] if close and tail.startswith(":") else ""
        ok = bool(close) and ":" in host and tail.startswith(":")
    else:
        host, colon, port = rest.rpartition(":")
        ok = bool(colon) and ":" not in host
        if colon and ":" in host:
            raise ConfigError(
                f"{what} {address!r}: write an IPv6 address in brackets, e.g. tcp://[::1]:5555"
            )
    if not ok or not host or not (port.isdigit() or port == "*"):
        raise ConfigError(
            f"{what} {address!r} needs a host and a port, e.g. tcp://127.0.0.1:5555 "
            "or tcp://[::1]:5555"
        )
    if port.isdigit() and int(port) > 65535:  # ZeroMQ would take it modulo 65536
        raise ConfigError(f"{what} {address!r}: a port is 0-65535")
    return host, port


def bracketed(host: str) -> str:
    """A host as it is written in an address: IPv6 in brackets, anything else as is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def format_tcp(host: str, port: int | str) -> str:
    """The tcp:// address of host and port (`tcp://[::1]:5555` for IPv6)."""
    return f"tcp://{bracketed(host)}:{port}"


def host_of(address: str) -> str:
    """The unbracketed host of a tcp:// address; any other address is returned as is."""
    try:
        return split_tcp(address)[0]
    except ConfigError:
        return address


def family_of(host: str) -> socket.AddressFamily | None:
    """AF_INET or AF_INET6 for an IP address literal (bracketed or not); None for a name."""
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]").partition("%")[0])
        return socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return None


def wants_ipv6(address: str) -> bool:
    """Whether a ZeroMQ socket needs IPV6=1 for address.

    Yes for an IPv6 literal, for `*` (then a bind takes both families) and for a name
    with no IPv4 address. Not for IPv4 or a name that has one: libzmq with IPV6=1 asks
    for IPv6 first, so `localhost` would go to ::1 while the peer listens on 127.0.0.1.
    """
    if not address.startswith("tcp://"):
        return False
    host = split_tcp(address)[0]
    if host == "*":
        return True
    family = family_of(host)
    if family is not None:
        return family == socket.AF_INET6
    return _has_family(host, socket.AF_INET6) and not _has_family(host, socket.AF_INET)


def _has_family(host: str, family: socket.AddressFamily) -> bool:
    try:
        return bool(socket.getaddrinfo(host, None, family, socket.SOCK_STREAM))
    except OSError:
        return False


def resolve_host(host: str, what: str) -> str:
    """The IP address of a host (an address stays as it is, unbracketed).

    A name with both families resolves to its first IPv4 address, else its first IPv6.

    Raises:
        ConfigError: the name does not resolve; `what` says where it came from.
    """
    host = host.removeprefix("[").removesuffix("]")
    if family_of(host) is not None:
        return host
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve host {host!r} ({what}): {exc}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def route_to(host: str, port: int = 9) -> str | None:
    """The local address the kernel would send from to reach host (None: no route).

    A UDP socket's `connect`, of host's family, asks the routing table and sends nothing.
    """
    with contextlib.suppress(ConfigError):
        host = resolve_host(host, "route")
    family = family_of(host) or socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        local = str(s.getsockname()[0])
        return None if local in _WILDCARD_HOSTS else local
    return None


def advertised(address: str, toward: str | None = None) -> str:
    """A bound address as peers can reach it: a wildcard host becomes this host's address.

    With `toward` (the registry's address, which every peer reaches too), that is the
    address of the interface this host would use to reach it: the kernel's routing
    choice, learnt from a UDP socket `connect`, which sends nothing. Without it, or when
    that fails, it is what the host name resolves to (127.0.1.1 on Debian-family hosts,
    which other hosts cannot reach: bind a concrete address there).
    """
    if not address.startswith("tcp://"):
        return address
    host, port = split_tcp(address)
    if host not in _WILDCARD_HOSTS:
        return address
    local = _route_to(toward) or resolve_host(socket.gethostname(), "this host's name")
    return format_tcp(local, port)


def _route_to(address: str | None) -> str | None:
    """The local address the kernel would send from to reach a tcp:// address."""
    if not address or not address.startswith("tcp://"):
        return None
    try:
        host, port = split_tcp(address)
    except ConfigError:
        return None
    if host in _WILDCARD_HOSTS or not port.isdigit():
        return None
    return route_to(host, int(port))


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (also v4-mapped) and names that resolve there (`localhost`)."""
    with contextlib.suppress(ValueError, ConfigError):
        ip = ipaddress.ip_address(resolve_host(host, "loopback check").partition("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback
    return False


def loopback_bind(registry: str | None = None) -> str:
    """The loopback bind of a worker whose registry is `registry`: ::1 for an IPv6 one."""
    with contextlib.suppress(ConfigError, AttributeError):
        if registry and family_of(split_tcp(registry)[0]) == socket.AF_INET6:
            return "tcp://[::1]:0"
    return "tcp://127.0.0.1:0"


def is_local_address(ip: str) -> bool:
    """True if this host has the address ip (a socket of its family can bind it)."""
    family = family_of(ip) or socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip.removeprefix("[").removesuffix("]"), 0))
        except OSError:
            return False
    return True


def interface_address(ifname: str, family: int | None = None) -> str:
    """The address of the network interface named ifname (Linux), as DSML_IFNAME.

    Its IPv4 address, or its IPv6 one when `family` is AF_INET6 or it has no IPv4
    address. A link-local IPv6 address (fe80::/10) is taken only when it is the only one,
    with its zone (`fe80::1%eth0`), which it needs to be usable.

    Raises:
        ConfigError: no such interface, or it has no address of the family asked.
    """
    names = [name for _, name in socket.if_nameindex()]
    if ifname not in names:
        raise ConfigError(
            f"DSML_IFNAME={ifname!r}: this host has no such interface (it has {', '.join(names)})"
        )
    if family != socket.AF_INET6:
        v4 = _interface_ipv4(ifname)
        if v4 is not None or family == socket.AF_INET:
            if v4 is None:
                raise ConfigError(f"DSML_IFNAME={ifname!r} has no IPv4 address")
            return v4
    v6 = _interface_ipv6(ifname)
    if v6 is None:
        raise ConfigError(f"DSML_IFNAME={ifname!r} has no usable IPv6 address (nor IPv4)")
    return v6


def _interface_ipv4(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _interface_ipv6(ifname: str) -> str | None:
    """The first global (else link-local, with its zone) IPv6 address of ifname."""
    try:
        with open(_IF_INET6) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = [ip for ip, name in map(_parse_if_inet6, lines) if name == ifname]
    usable = [ip for ip in found if not ip.is_link_local]
    if usable:
        return str(usable[0])
    return f"{found[0]}%{ifname}" if found else None


def _parse_if_inet6(line: str) -> tuple[ipaddress.IPv6Address, str]:
    """One line of /proc/net/if_inet6: 32 hex digits, index, prefix, scope, flags, name."""
    fields = line.split()
    return ipaddress.IPv6Address(bytes.fromhex(fields[0])), fields[-1]
