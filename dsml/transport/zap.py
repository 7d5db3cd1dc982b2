"""The process's ZAP handler: who may connect to this process's endpoints (transport layer).

libzmq asks a ZAP handler (one per context, a thread here) about every new connection to
a socket that has a ZAP domain, before any message of it is delivered. Two kinds of
domain are served:

- a job secret's domain (`secret.py`): PLAIN credentials, admitted when the password is
  the HMAC of the username under that secret; the username becomes the connection's
  User-Id, which the endpoint's reader compares with each message's routing identity;
- a CURVE allowlist folder (`curve.py`): a client key listed in the folder.

A refused connection never delivers a message; refusals are counted (`refused()`) and
logged once per peer address and interval.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ..errors import ConfigError
from ..log import Throttle
from .context import _shared_context
from .secret import JobSecret, job_secret

__all__ = ["curve_domain", "refused", "secret_domain"]

log = logging.getLogger("dsml.transport")

_REFUSAL_LOG_INTERVAL_S = 10.0


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, checking PLAIN passwords against job secrets by HMAC."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        super().__init__(context)
        self.secrets: dict[str, JobSecret] = {}
        self.refusals = 0
        self._throttle = Throttle(_REFUSAL_LOG_INTERVAL_S)

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        secret = self.secrets.get(domain)
        if secret is not None and secret.admits(username.encode(), password.encode()):
            return True, b"OK"
        self._throttle.warning(
            log,
            username[:64],
            "refused a connection claiming to be %r: it does not hold this job's secret",
            username[:64],
        )
        return False, b"not this job's secret"

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, *args: object) -> None:
        if status_code != b"200":  # every refusal (PLAIN or CURVE) ends here
            self.refusals += 1
        super()._send_zap_reply(request_id, status_code, *args)  # type: ignore[arg-type]


class _Zap:
    """Started on first use, on the shared context; restarted if the context was renewed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._auth: _Authenticator | None = None

    def running(self) -> _Authenticator:
        context = _shared_context()
        auth = self._auth
        if auth is None or auth.context is not context or not auth.is_alive():
            previous = auth.secrets if auth is not None else {}
            auth = self._auth = _Authenticator(context)
            auth.secrets.update(previous)
            auth.start()
        return auth

    def secret_domain(self, secret: JobSecret) -> bytes:
        with self._lock:
            self.running().secrets[secret.domain.decode()] = secret
        return secret.domain

    def curve_domain(self, folder: Path) -> bytes:
        folder = folder.resolve()
        try:
            zmq.auth.load_certificates(folder)  # configure_curve would only log a failure
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot read the CURVE allowlist {folder}: {exc}; it should hold the "
                "public keys (*.key) of the clients allowed to connect"
            ) from exc
        domain = "dsml-" + hashlib.sha256(os.fsencode(folder)).hexdigest()[:16]
        with self._lock:
            self.running().configure_curve(domain=domain, location=str(folder))
        return domain.encode()

    def refused(self) -> int:
        auth = self._auth
        return auth.refusals if auth is not None else 0


_zap = _Zap()


def secret_domain(secret: JobSecret) -> bytes:
    """The ZAP domain that admits connections proving `secret` (handler started if needed)."""
    return _zap.secret_domain(secret)


def curve_domain(folder: Path) -> bytes:
    """(Re-)read `folder` as a CURVE allowlist and return the ZAP domain that checks it."""
    return _zap.curve_domain(folder)


def refused() -> int:
    """Connections this process's endpoints refused so far (wrong secret or key)."""
    return _zap.refused()


def enforce(sock: zmq.Socket[bytes], domain: bytes) -> None:
    """Have libzmq consult the ZAP handler for every connection to `sock`, failing closed."""
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    # Without this, a server whose ZAP handler is gone admits anyone.
    with contextlib.suppress(AttributeError, zmq.ZMQError):
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def make_secret_server(sock: zmq.Socket[bytes], secret: JobSecret) -> None:
    """Admit only connections that prove `secret` (checked by the ZAP handler)."""
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    enforce(sock, secret_domain(secret))


def make_secret_client(sock: zmq.Socket[bytes], identity: bytes, secret: JobSecret) -> None:
    """Prove `secret` for `identity`: the HMAC of the name, never the secret itself."""
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.PLAIN_USERNAME, identity)
    sock.setsockopt(zmq.PLAIN_PASSWORD, secret.password(identity))


def prove_secret(sock: zmq.Socket[Any], identity: bytes, secret: JobSecret | None = None) -> None:
    """Let a socket of your own (not yet connected) talk to dsml endpoints as `identity`.

    Sets its routing identity and the PLAIN credentials that prove `secret` (by default
    this process's job secret) for that name, as every dsml channel does.
    """
    make_secret_client(sock, identity, secret or job_secret())
