"""ZeroMQ CURVE: key folders, encrypted sockets and a client allowlist (transport layer).

A cluster shares one folder of keys, made by `dsml keys generate DIR`:

    DIR/server.key, server.key_secret   the pair of every registry and worker daemon
    DIR/<client>.key, .key_secret       a pair per client (dsml.Client); `client` by default
    DIR/authorized/*.key                public keys allowed to connect (server.key, clients)

Servers (the registry, worker daemons, their peer links) all hold the server pair, so one
public key is what every connecting socket checks, and their own links to each other
authenticate with it too. Who may connect is decided by a ZAP handler: one thread per
process (`zmq.auth.thread.ThreadAuthenticator`) on the shared context, with one ZAP domain
per allowlist folder. A socket without CURVE keeps the NULL mechanism and no ZAP domain,
so libzmq never consults the handler for it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from ..errors import ConfigError
from .addresses import split_tcp
from .zap import curve_domain, enforce

__all__ = ["Curve", "generate_keys", "is_loopback", "make_curve_client", "make_curve_server"]

_ROLES = ("server", "client")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_Z85_KEY_CHARS = 40  # a 32-byte key in z85


@dataclass(frozen=True)
class Curve:
    """The CURVE keys of one process, loaded from a `dsml keys generate` folder."""

    directory: Path
    role: str  # "server" (registry, worker daemons, their peer links) or "client"
    public: bytes  # z85 public key of this process's own pair
    secret: bytes = field(repr=False)  # its z85 secret key: never in a repr or a log
    server_public: bytes  # the cluster's server key, checked by every connecting socket
    authorized: Path  # folder of allowlisted public keys (*.key), read when a server binds

    @classmethod
    def load(
        cls, directory: str | os.PathLike[str], role: str = "server", *, client: str | None = None
    ) -> Curve:
        """Load the keys `role` needs from a key folder.

        Args:
            directory: a folder made by `dsml keys generate` (or a copy of its needed part).
            role: "server" needs server.key_secret and an `authorized` folder; "client"
                needs server.key and a client pair.
            client: the client pair's name; by default `client`, or the only client pair
                in the folder (a client host keeps just its own).

        Raises:
            ConfigError: the folder or a needed file is missing, unreadable or malformed.
        """
        if role not in _ROLES:
            raise ConfigError(f"CURVE role {role!r} is not one of {', '.join(_ROLES)}")
        folder = Path(directory)
        if not folder.is_dir() or not any(folder.glob("*.key*")):
            raise ConfigError(
                f"no CURVE keys in {folder}: create them with `dsml keys generate {folder}`"
            )
        authorized = folder / "authorized"
        if role == "server":
            server_public, secret = _read_pair(folder / "server.key_secret", role)
            if not authorized.is_dir():
                raise ConfigError(
                    f"{folder} has no `authorized` folder: a server admits only the public "
                    f"keys in {authorized}; copy the whole folder `dsml keys generate` made"
                )
            return cls(folder, role, server_public, secret, server_public, authorized)
        server_public = _read_public(folder / "server.key")
        public, secret = _read_pair(_client_secret_file(folder, client), role)
        return cls(folder, role, public, secret, server_public, authorized)


def _client_secret_file(folder: Path, name: str | None) -> Path:
    """The secret file of the named client pair, else of `client`, else of the only one."""
    if name is not None:
        return folder / f"{_check_name(name)}.key_secret"
    default = folder / "client.key_secret"
    if default.exists():
        return default
    others = sorted(p for p in folder.glob("*.key_secret") if p.name != "server.key_secret")
    if len(others) > 1:
        names = ", ".join(p.name.removesuffix(".key_secret") for p in others)
        raise ConfigError(
            f"{folder} has several client pairs ({names}) and none named `client`: "
            "keep only this host's own pair there"
        )
    return others[0] if others else default  # a missing default is explained by the reader


def _read_public(path: Path) -> bytes:
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing: copy it from the folder `dsml keys generate` made "
            "(every host of the cluster needs server.key)"
        )
    public, _ = _load_certificate(path)
    return public


def _read_pair(path: Path, role: str) -> tuple[bytes, bytes]:
    if not path.is_file():
        how = (
            "copy server.key_secret to every registry and worker host"
            if role == "server"
            else f"create a client pair with `dsml keys generate {path.parent} --client NAME`"
        )
        raise ConfigError(f"{path} is missing: a CURVE {role} needs its secret key; {how}")
    public, secret = _load_certificate(path)
    if secret is None:
        raise ConfigError(f"{path} holds no secret-key line: it is not a secret key file")
    return public, _check_key(secret, path)


def _load_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE key {path}: {exc}") from exc
    return _check_key(public, path), secret


def _check_key(key: bytes, path: Path) -> bytes:
    """A z85 key of 32 bytes, or ConfigError naming the file."""
    try:
        valid = len(key) == _Z85_KEY_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise ConfigError(f"{path} holds a malformed key: regenerate it with `dsml keys generate`")
    return key


def _check_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name == "server":
        raise ConfigError(
            f"client name {name!r} is not usable: letters, digits, '_', '.', '-' (at most 64), "
            "not `server`"
        )
    return name


# -- key generation ----------------------------------------------------------------------------


def generate_keys(directory: str | os.PathLike[str], *, client: str = "client") -> list[Path]:
    """Create a cluster's key folder, or add a client pair to an existing one.

    The first call writes the server pair, the client pair named `client` and
    `authorized/{server,client}.key`; on a folder that has the server pair it adds only the
    client pair (and its public key to `authorized`). Secret files are mode 0600. Nothing
    that exists is overwritten.

    Returns:
        The paths written.

    Raises:
        ConfigError: a file to write exists already, or the folder cannot be written.
    """
    folder = Path(directory)
    _check_name(client)
    authorized = folder / "authorized"
    first = not (folder / "server.key_secret").exists()
    if first and (folder / "server.key").exists():
        raise ConfigError(
            f"{folder} has server.key but not server.key_secret (a client host's copy?): "
            "add clients on the host where the folder was first generated"
        )
    names = ["server", client] if first else [client]
    targets = [
        place / f"{name}{suffix}"
        for name in names
        for place, suffix in ((folder, ".key"), (folder, ".key_secret"), (authorized, ".key"))
    ]
    existing = [path for path in targets if path.exists()]
    if existing:
        found = existing[0]
        pair = found.name.removesuffix("_secret").removesuffix(".key")
        raise ConfigError(
            f"{folder} already has {found.relative_to(folder)} (a key pair named {pair!r}); "
            f"nothing written. Add another client with `dsml keys generate {folder} --client NAME`"
        )
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        authorized.mkdir(exist_ok=True)
        return [path for name in names for path in _create_pair(folder, name)]
    except OSError as exc:
        raise ConfigError(f"cannot write CURVE keys in {folder}: {exc}") from exc


def _create_pair(folder: Path, name: str) -> list[Path]:
    """Write NAME.key, NAME.key_secret (0600) and authorized/NAME.key.

    The pair is made in a private (0700) temporary folder and moved in once its modes are
    set, so the secret is never readable by others, whatever the umask.
    """
    with tempfile.TemporaryDirectory(dir=folder, prefix=".keys-") as tmp:
        public_tmp, secret_tmp = map(Path, zmq.auth.create_certificates(tmp, name))
        secret_tmp.chmod(0o600)
        public_tmp.chmod(0o644)
        public, secret = folder / public_tmp.name, folder / secret_tmp.name
        os.replace(secret_tmp, secret)
        os.replace(public_tmp, public)
    allowed = folder / "authorized" / public.name
    shutil.copyfile(public, allowed)
    return [public, secret, allowed]


# -- sockets -----------------------------------------------------------------------------------


def make_curve_server(sock: zmq.Socket[bytes], curve: Curve) -> None:
    """Make an unbound socket a CURVE server admitting only the keys in `curve.authorized`."""
    domain = curve_domain(curve.authorized)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
    # libzmq (4.3) asks the ZAP handler only about sockets that have a domain: without one,
    # a CURVE server admits every client that knows its public key.
    enforce(sock, domain)


def make_curve_client(sock: zmq.Socket[bytes], curve: Curve) -> None:
    """Make an unconnected socket a CURVE client of the cluster's servers."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)


def is_loopback(address: str) -> bool:
    """Whether `address` reaches only this host: ipc://, or tcp:// to a loopback host
    (127.0.0.0/8, ::1, ::ffff:127.x.y.z, `localhost`), bracketed IPv6 included."""
    if address.startswith("ipc://"):
        return True
    try:
        host = split_tcp(address)[0]
    except ConfigError:
        return False
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # `*`, an interface name or a DNS name: not provably local
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
