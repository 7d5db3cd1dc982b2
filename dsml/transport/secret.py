"""The job secret: what every dsml connection proves before any message of it is read.

Every endpoint (registry, peer links, worker daemons, launcher nodes) is a ZeroMQ PLAIN
server whose ZAP handler (zap.py) admits a connection only if its password is
`HMAC-SHA256(secret, b"dsml-link-1" + username)` and its username is the routing identity
it will carry. So a process without the secret cannot open a connection at all, and the
secret itself never crosses the network: a connection carries only the HMAC of its own
name. See docs/security.md for the threat model and for CURVE across untrusted networks.

Where the secret comes from, first match wins:

1. `DSML_SECRET` (the secret itself);
2. `DSML_SECRET_FILE` (or `--secret-file`): a file only its owner may read;
3. a launcher's own channel: `dsml run` makes one per job and hands it to its ranks in
   `DSML_SECRET`; under torchrun rank 0 publishes one through torch's store;
4. the per-user file `$XDG_CONFIG_HOME/dsml/secret` (`~/.config/dsml/secret`), created
   (mode 0600) by the first process that needs it. Under Slurm and mpirun, whose
   launchers have no channel of their own, this is how ranks on hosts sharing a home
   directory agree.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "JobSecret",
    "adopt_published",
    "adopt_secret",
    "job_secret",
    "make_secret",
    "secret_to_publish",
    "user_secret_file",
]

#: fixed public names: the secret itself, or a file holding it
SECRET_ENV = "DSML_SECRET"
SECRET_FILE_ENV = "DSML_SECRET_FILE"
_CONTEXT = b"dsml-link-1"
_MIN_CHARS = 16  # shorter is guessable; `make_secret` gives 43


@dataclass(frozen=True)
class JobSecret:
    """A job's secret key and where it came from (`origin`, for messages; never the key)."""

    key: bytes = field(repr=False)
    origin: str

    @property
    def fingerprint(self) -> str:
        """A short public name of the key: two processes print the same one iff they agree."""
        return hashlib.sha256(b"dsml-fingerprint" + self.key).hexdigest()[:12]

    @property
    def domain(self) -> bytes:
        """The ZAP domain of sockets that check this secret."""
        return b"dsml-secret-" + self.fingerprint.encode()

    def password(self, username: bytes) -> bytes:
        """What a connection named `username` presents (hex of an HMAC: not the key)."""
        return hmac.new(self.key, _CONTEXT + username, hashlib.sha256).hexdigest().encode()

    def admits(self, username: bytes, password: bytes) -> bool:
        return hmac.compare_digest(self.password(username), password)

    def export(self) -> str:
        """The secret as `DSML_SECRET` carries it (for a launcher's child processes)."""
        return self.key.decode()

    def __str__(self) -> str:
        return f"job secret {self.fingerprint} ({self.origin})"


def make_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def from_text(text: str, origin: str) -> JobSecret:
    """A secret from its text form, or ConfigError if it is too short to be one."""
    text = text.strip()
    if len(text) < _MIN_CHARS:
        raise ConfigError(
            f"the job secret from {origin} has {len(text)} characters, fewer than "
            f"{_MIN_CHARS}: make one with `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    return JobSecret(text.encode(), origin)


def read_secret_file(path: str | os.PathLike[str], origin: str | None = None) -> JobSecret:
    """Read a secret file, refusing one that users other than its owner can read."""
    target = Path(path).expanduser()
    what = origin or str(target)
    try:
        mode = target.stat().st_mode
        text = target.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the job secret file {target}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"the job secret file {target} is readable by other users (mode "
            f"{stat.S_IMODE(mode):04o}): `chmod 600 {target}`"
        )
    return from_text(text, what)


def user_secret_file() -> Path:
    """The per-user secret file: `$XDG_CONFIG_HOME/dsml/secret`, else ~/.config/dsml/secret."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dsml" / "secret"


def _user_secret() -> JobSecret:
    """The per-user file's secret, creating the file (0600) if there is none yet.

    Creation is atomic: the secret is written to a private temporary file that is then
    hard-linked into place, so processes starting together all read the one that won.
    """
    path = user_secret_file()
    if not path.exists():
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f".secret-{os.getpid()}-{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, (make_secret() + "\n").encode())
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: use theirs
            finally:
                os.unlink(tmp)
        except OSError as exc:
            raise ConfigError(
                f"no job secret: {SECRET_ENV} and {SECRET_FILE_ENV} are unset and the "
                f"per-user file {path} cannot be created ({exc.strerror})"
            ) from None
    return read_secret_file(path, f"the per-user file {path}")


def resolve_secret(env: os._Environ[str] | dict[str, str] | None = None) -> JobSecret:
    """The secret the environment names (see the module docstring), or the per-user one."""
    env = os.environ if env is None else env
    text = env.get(SECRET_ENV)
    if text:
        return from_text(text, SECRET_ENV)
    path = env.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(path, f"{SECRET_FILE_ENV}={path}")
    return _user_secret()


def explicit_secret(env: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """Whether the environment names a secret itself (not the per-user fallback)."""
    env = os.environ if env is None else env
    return bool(env.get(SECRET_ENV) or env.get(SECRET_FILE_ENV))


_lock = threading.Lock()
_current: JobSecret | None = None


def job_secret() -> JobSecret:
    """This process's secret: adopted, else resolved from the environment once."""
    global _current
    with _lock:
        if _current is None:
            _current = resolve_secret()
        return _current


def adopt_secret(secret: JobSecret | str, origin: str = "a launcher") -> JobSecret:
    """Use `secret` for every later connection of this process, and hand it to the
    processes it starts (`DSML_SECRET`)."""
    global _current
    chosen = from_text(secret, origin) if isinstance(secret, str) else secret
    with _lock:
        _current = chosen
        os.environ[SECRET_ENV] = chosen.export()
        os.environ.pop(SECRET_FILE_ENV, None)
    return chosen


def secret_to_publish(origin: str) -> str:
    """What rank 0 publishes through a launcher's store for the other ranks: a fresh
    secret it adopts itself, or "" when the environment names one (each rank then uses
    its own: a secret the user chose is never written to a store)."""
    if explicit_secret():
        return ""
    return adopt_secret(make_secret(), origin).export()


def adopt_published(text: str, origin: str) -> None:
    """Adopt what rank 0 published (see `secret_to_publish`) unless it is empty."""
    if text and not explicit_secret():
        adopt_secret(text, origin)


def forget_secret() -> None:
    """Resolve the secret from the environment again at the next use (tests, CLIs)."""
    global _current
    with _lock:
        _current = None
