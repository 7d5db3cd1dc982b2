"""CURVE: key folders, `dsml keys generate`, and encrypted, allowlisted sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import dsml
from dsml import CommConfig, ConfigError, RegistryConfig, RegistryUnavailableError, open_registry
from dsml.membership.client import query_status
from dsml.transport import Beacon, Channel, Curve, Endpoint, generate_keys, is_loopback
from dsml.wire import Envelope, Kind

from .waiting import eventually

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "tcp://127.0.0.1:0"
Arrival = tuple[bytes, Envelope, list[bytes]]


class Inbox:
    """A handler that keeps what an endpoint or channel delivers, and waits for it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Arrival] = asyncio.Queue()

    def __call__(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        self.queue.put_nowait((sender, env, [bytes(frame) for frame in payload]))

    async def next(self) -> Arrival:
        async with asyncio.timeout(5):
            return await self.queue.get()

    async def expect_nothing(self, within: float = 1.0) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                arrival = await self.queue.get()
                raise AssertionError(f"delivered although it should not be: {arrival}")


class Refusals:
    """An `on_refused` callback that keeps the reasons and wakes who waits for one."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self._event = asyncio.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self._event.set()

    async def wait(self) -> str:
        async with asyncio.timeout(5):
            await self._event.wait()
        return self.reasons[0]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """A cluster's key folder as `dsml keys generate` makes it."""
    folder = tmp_path / "keys"
    generate_keys(folder)
    return folder


@pytest.fixture
def stranger(tmp_path: Path, keys: Path) -> Curve:
    """A client pair from another folder, with this cluster's server key: not allowlisted."""
    other = tmp_path / "other"
    generate_keys(other)
    shutil.copyfile(keys / "server.key", other / "server.key")
    return Curve.load(other, "client")


@contextlib.asynccontextmanager
async def endpoint(inbox: Inbox, curve: Curve | None) -> AsyncIterator[Endpoint]:
    ep = Endpoint.bind(LOOPBACK, inbox, max_frame_bytes=1 << 20, curve=curve)
    try:
        yield ep
    finally:
        await ep.aclose()


@contextlib.asynccontextmanager
async def channel(address: str, curve: Curve | None, **options: object) -> AsyncIterator[Channel]:
    ch = Channel.connect(address, b"client-1", curve=curve, **options)  # type: ignore[arg-type]
    try:
        yield ch
    finally:
        await ch.aclose(linger_s=0.0)


def hello(n: int = 0) -> Envelope:
    return Envelope(Kind.STATUS_REQUEST, body={"n": n})


# -- key folders -------------------------------------------------------------------------------


def test_generating_keys_writes_both_pairs_and_the_allowlist_with_private_secrets(tmp_path):
    folder = tmp_path / "new" / "keys"
    written = generate_keys(folder)
    names = {str(path.relative_to(folder)) for path in written}
    assert names == {
        "server.key",
        "server.key_secret",
        "client.key",
        "client.key_secret",
        "authorized/server.key",
        "authorized/client.key",
    }
    assert all(path.is_file() for path in written)
    for secret in folder.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    assert not list(folder.glob(".keys-*")), "the temporary folder was left behind"
    assert (folder / "authorized" / "client.key").read_bytes() == (
        folder / "client.key"
    ).read_bytes()
    server, client = Curve.load(folder), Curve.load(folder, "client")
    assert server.server_public == client.server_public == server.public
    assert client.public != server.public
    assert client.authorized == folder / "authorized"


def test_generating_again_without_a_new_client_name_fails_naming_the_folder(keys):
    before = sorted(p.read_bytes() for p in keys.rglob("*.key*"))
    with pytest.raises(ConfigError, match="--client NAME") as failure:
        generate_keys(keys)
    assert str(keys) in str(failure.value)
    assert sorted(p.read_bytes() for p in keys.rglob("*.key*")) == before, "a key was replaced"


def test_a_named_client_is_added_to_an_existing_folder_and_allowlisted(keys):
    server_before = (keys / "server.key_secret").read_bytes()
    written = generate_keys(keys, client="bob")
    assert sorted(str(p.relative_to(keys)) for p in written) == [
        "authorized/bob.key",
        "bob.key",
        "bob.key_secret",
    ]
    assert (keys / "server.key_secret").read_bytes() == server_before
    bob = Curve.load(keys, "client", client="bob")
    assert bob.public != Curve.load(keys, "client").public
    with pytest.raises(ConfigError, match="'bob'"):
        generate_keys(keys, client="bob")


def test_a_client_host_with_only_the_server_key_and_its_own_pair_loads_that_pair(keys, tmp_path):
    generate_keys(keys, client="bob")
    host = tmp_path / "bob-host"
    host.mkdir()
    for name in ("server.key", "bob.key", "bob.key_secret"):
        shutil.copy(keys / name, host / name)
    curve = Curve.load(host, "client")
    assert curve.public == Curve.load(keys, "client", client="bob").public
    with pytest.raises(ConfigError, match=r"server\.key_secret"):
        Curve.load(host, "server")


def test_loading_keys_from_an_empty_or_missing_folder_says_how_to_create_them(tmp_path):
    for folder in (tmp_path, tmp_path / "absent"):
        with pytest.raises(ConfigError, match="dsml keys generate") as failure:
            Curve.load(folder)
        assert str(folder) in str(failure.value)


def test_loading_a_malformed_key_or_an_unknown_role_is_a_config_error(keys):
    (keys / "client.key_secret").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(ConfigError, match=r"client\.key_secret"):
        Curve.load(keys, "client")
    with pytest.raises(ConfigError, match="role"):
        Curve.load(keys, "admin")


def test_a_curve_repr_never_shows_the_secret_key(keys):
    curve = Curve.load(keys)
    assert curve.secret.decode() not in repr(curve)
    assert curve.public.decode() in repr(curve)


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("ipc:///tmp/dsml.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.8.9.10:0", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.7:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://example.com:5555", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_only_addresses_that_stay_on_this_host_count_as_loopback(address, local):
    assert is_loopback(address) is local


# -- sockets -----------------------------------------------------------------------------------


async def test_a_curve_endpoint_and_an_allowlisted_client_exchange_messages_both_ways(keys):
    inbox, replies, refusals = Inbox(), Inbox(), Refusals()
    async with (
        endpoint(inbox, Curve.load(keys)) as ep,
        channel(ep.address, Curve.load(keys, "client"), handler=replies, on_refused=refusals) as ch,
    ):
        assert "CURVE" in repr(ep)
        await ch.send(hello(1), [b"payload"])
        sender, env, frames = await inbox.next()
        assert (sender, env.body, frames) == (b"client-1", {"n": 1}, [b"payload"])
        assert ep.send_nowait(sender, hello(2), [b"back"])
        _, reply, frames = await replies.next()
        assert (reply.body, frames) == ({"n": 2}, [b"back"])
        assert refusals.reasons == []


async def test_servers_authenticate_to_each_other_with_the_server_pair(keys):
    inbox = Inbox()
    async with (
        endpoint(inbox, Curve.load(keys)) as ep,
        channel(ep.address, Curve.load(keys, "server")) as ch,  # a worker's peer link
    ):
        await ch.send(hello(3))
        assert (await inbox.next())[1].body == {"n": 3}


async def test_a_client_key_that_is_not_allowlisted_is_refused_and_delivers_nothing(keys, stranger):
    inbox, refusals = Inbox(), Refusals()
    async with (
        endpoint(inbox, Curve.load(keys)) as ep,
        channel(ep.address, stranger, on_refused=refusals) as ch,
    ):
        ch.send_nowait(hello())  # queued, or not if the refusal was faster: never delivered
        reason = await refusals.wait()
        assert "key" in reason
        assert "allowlist" in reason
        # libzmq gives a refused connection up; once it is gone, send fails instead of waiting
        await eventually(lambda: ch.send_nowait(hello()) is None, "the connection is given up")
        with pytest.raises(ConfigError, match="not allowlisted"):
            await ch.send(hello())
        await inbox.expect_nothing(within=1.0)
        assert ep.received == 0
        assert refusals.reasons == [reason], "one refusal is reported once"


async def test_the_allowlist_is_read_again_when_an_endpoint_binds(keys, stranger):
    """A key added to `authorized` admits its client to sockets bound afterwards; a key
    removed from it refuses its client there."""
    client = Curve.load(keys, "client")
    (keys / "authorized" / "stranger.key").write_bytes(
        (stranger.directory / "client.key").read_bytes()
    )
    (keys / "authorized" / "client.key").unlink()
    inbox, admitted, refusals = Inbox(), Refusals(), Refusals()
    async with (
        endpoint(inbox, Curve.load(keys)) as ep,
        channel(ep.address, stranger, on_refused=admitted) as newly_allowed,
        channel(ep.address, client, on_refused=refusals) as revoked,
    ):
        await newly_allowed.send(hello(1))
        revoked.send_nowait(hello(2))  # the refusal may come first: then nothing is queued
        assert (await inbox.next())[1].body == {"n": 1}
        assert "not allowlisted" in await refusals.wait()
        await inbox.expect_nothing(within=0.5)
        assert ep.received == 1
        assert admitted.reasons == []


async def test_a_plain_channel_to_a_curve_endpoint_delivers_nothing(keys):
    inbox, refusals = Inbox(), Refusals()
    async with (
        endpoint(inbox, Curve.load(keys)) as ep,
        channel(ep.address, None, on_refused=refusals) as ch,
    ):
        ch.send_nowait(hello())  # the refusal may come first: then nothing is queued
        assert "CURVE" in await refusals.wait()
        await inbox.expect_nothing(within=0.5)
        assert ep.received == 0


async def test_a_curve_channel_to_a_plain_endpoint_delivers_nothing(keys):
    inbox, refusals = Inbox(), Refusals()
    async with (
        endpoint(inbox, None) as ep,
        channel(ep.address, Curve.load(keys, "client"), on_refused=refusals) as ch,
    ):
        ch.send_nowait(hello())  # the refusal may come first: then nothing is queued
        assert "both ends" in await refusals.wait()
        await inbox.expect_nothing(within=0.5)
        assert ep.received == 0


async def test_a_plain_endpoint_works_beside_a_curve_endpoint_in_the_same_process(keys):
    secure, plain = Inbox(), Inbox()
    async with (
        endpoint(secure, Curve.load(keys)) as secure_ep,
        endpoint(plain, None) as plain_ep,
        channel(secure_ep.address, Curve.load(keys, "client")) as secure_ch,
        channel(plain_ep.address, None) as plain_ch,
    ):
        assert "CURVE" not in repr(plain_ep)
        await plain_ch.send(hello(1))
        await secure_ch.send(hello(2))
        assert (await plain.next())[1].body == {"n": 1}
        assert (await secure.next())[1].body == {"n": 2}


async def test_binding_with_an_unreadable_allowlist_fails_without_leaving_a_socket(keys):
    (keys / "authorized" / "broken.key").write_text("no key in here\n")
    with pytest.raises(ConfigError, match="allowlist"):
        Endpoint.bind(LOOPBACK, Inbox(), max_frame_bytes=4096, curve=Curve.load(keys))


async def test_a_beacon_with_curve_reaches_a_curve_endpoint(keys):
    inbox = Inbox()
    async with endpoint(inbox, Curve.load(keys)) as ep:
        beacon = Beacon(ep.address, b"hb", 0.01, hello, curve=Curve.load(keys, "client"))
        try:
            sender, env, _ = await inbox.next()
            assert (sender, env.kind) == (b"hb", Kind.STATUS_REQUEST)
            await eventually(lambda: ep.received >= 3, "three heartbeats over CURVE")
        finally:
            beacon.stop()


# -- the command -------------------------------------------------------------------------------


def test_dsml_keys_generate_writes_a_folder_and_refuses_to_overwrite_it(tmp_path):
    folder = tmp_path / "cluster-keys"
    command = [sys.executable, "-m", "dsml", "keys", "generate", str(folder)]
    first = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert first.returncode == 0, first.stderr
    assert f"wrote {folder / 'server.key_secret'}" in first.stdout
    assert "authorized" in first.stdout
    assert Curve.load(folder, "client").server_public == Curve.load(folder).public
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert again.returncode == 2
    assert str(folder) in again.stderr
    assert "--client NAME" in again.stderr
    bob = subprocess.run(
        [*command, "--client", "bob"], capture_output=True, text=True, cwd=ROOT, timeout=30
    )
    assert bob.returncode == 0, bob.stderr
    assert (folder / "authorized" / "bob.key").is_file()


async def test_a_client_without_keys_or_with_a_stranger_key_is_told_keys_may_be_why(keys, stranger):
    """A CURVE registry does not answer them: the error says so, not only 'is it running?'."""
    config = RegistryConfig(address="tcp://127.0.0.1:0", curve=Curve.load(keys, "server"))
    async with open_registry(config=config) as registry:
        with pytest.raises(RegistryUnavailableError, match="--curve-keys DIR or DSML_CURVE"):
            await query_status(registry.address, registry_timeout=0.5)
        with pytest.raises(RegistryUnavailableError, match="public key in its DIR/authorized"):
            await query_status(registry.address, registry_timeout=0.5, curve=stranger)
        status = await query_status(registry.address, curve=Curve.load(keys, "client"))
        assert isinstance(status, dict)


async def test_init_without_keys_against_a_curve_registry_fails_at_once(keys):
    """It hung forever (most runs): the failed join's clean-up waited to queue a leave on a
    connection whose handshake never completed. Now the refused handshake is reported."""
    config = RegistryConfig(address="tcp://127.0.0.1:0", curve=Curve.load(keys, "server"))
    async with open_registry(config=config) as registry:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            started = loop.time()
            with pytest.raises(RegistryUnavailableError, match="--curve-keys DIR"):
                await dsml.init(registry.address, 2, config=CommConfig(registry_timeout=0.5))
            assert loop.time() - started < 5


def test_the_commands_read_the_keys_from_dsml_curve_keys_as_the_ranks_do(keys):
    """`dsml status` and `dsml registry` (and worker, run, bench: one code path) took keys
    only from --curve-keys, while the no-answer message suggested DSML_CURVE_KEYS."""
    env = {**os.environ, "DSML_CURVE_KEYS": str(keys), "PYTHONPATH": str(ROOT)}
    dsml_cmd = [sys.executable, "-m", "dsml"]
    registry = subprocess.Popen(
        [*dsml_cmd, "registry", "--address", LOOPBACK],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert registry.stdout is not None
        address = next(w for w in registry.stdout.readline().split() if w.startswith("tcp://"))
        status = [*dsml_cmd, "status", "--registry", address, "--wait", "2"]
        with_keys = subprocess.run(status, env=env, capture_output=True, text=True, timeout=30)
        assert with_keys.returncode == 0, with_keys.stderr
        plain = {k: v for k, v in env.items() if k != "DSML_CURVE_KEYS"}
        without = subprocess.run(status, env=plain, capture_output=True, text=True, timeout=30)
        assert without.returncode == 1  # the registry uses CURVE: it came from the variable
        assert "uses CURVE" in without.stderr  # told at once, not after a timeout
    finally:
        registry.terminate()
        registry.wait(timeout=10)
