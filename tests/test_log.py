"""dsml.log: levels, the rank and epoch on each line, rate-limited repeated warnings."""

from __future__ import annotations

import asyncio
import io
import logging
import subprocess
import sys

import numpy as np
import pytest
import zmq
import zmq.asyncio

import dsml
from dsml import log
from dsml.transport import prove_secret


@pytest.fixture
def captured():
    """dsml's log lines at debug, written to a string; the previous setup restored after."""
    logger = logging.getLogger("dsml")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    stream = io.StringIO()
    log.configure("debug", stream=stream)
    yield stream
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_level_names_parse_in_any_case_and_a_bad_one_lists_the_valid_names():
    assert log.parse_level("DEBUG") == logging.DEBUG
    assert log.parse_level(" warning ") == logging.WARNING
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        log.parse_level("verbose")


def test_a_bound_logger_puts_rank_and_epoch_on_each_line(captured):
    where = {"rank": 3, "epoch": 7}
    bound = log.bind(logging.getLogger("dsml.test"), lambda: (where["rank"], where["epoch"]))
    bound.info("first")
    where["epoch"] = 8
    bound.warning("second")
    lines = captured.getvalue().splitlines()
    assert "INFO    dsml.test [rank 3 epoch 7] first" in lines[0]
    assert "WARNING dsml.test [rank 3 epoch 8] second" in lines[1]


def test_lines_without_a_communicator_carry_the_process_rank_once_it_is_known(
    captured, monkeypatch
):
    monkeypatch.setattr(log, "_context", {"rank": None, "epoch": None})
    logging.getLogger("dsml.test").info("before")
    log.configure_from_env({"DSML_RANK": "5"})
    logging.getLogger("dsml.test").info("after")
    before, after = captured.getvalue().splitlines()
    assert "dsml.test before" in before
    assert "dsml.test [rank 5] after" in after


def test_configure_from_env_sets_the_level_and_configuring_twice_keeps_one_handler(captured):
    logger = logging.getLogger("dsml")
    log.configure_from_env({"DSML_LOG_LEVEL": "error"})
    log.configure_from_env({"DSML_LOG_LEVEL": "error"})
    assert logger.level == logging.ERROR
    assert sum(getattr(h, "_dsml", False) for h in logger.handlers) == 1


def test_a_flood_for_one_key_gives_one_line_per_interval_with_the_count_held_back(captured):
    clock = FakeClock()
    throttle = log.Throttle(10.0, clock=clock)
    logger = logging.getLogger("dsml.test")
    shown = 0
    for i in range(1000):  # 1000 lines over 25 s: at 0, 10 and 20 s
        clock.now = 100.0 + i * 0.025
        shown += throttle.warning(logger, b"peer-a", "dropped message %d", i)
    assert shown == 3
    lines = captured.getvalue().splitlines()
    assert len(lines) == 3
    assert "dropped message 0" in lines[0]
    assert "dropped message 400 (399 similar lines suppressed since the last one)" in lines[1]
    assert "dropped message 800 (399 similar lines suppressed" in lines[2]
    assert throttle.suppressed == 997


def test_each_key_has_its_own_budget_and_old_keys_are_forgotten_beyond_the_cap():
    clock = FakeClock()
    throttle = log.Throttle(10.0, max_keys=3, clock=clock)
    assert [throttle.allow(k)[0] for k in "abc"] == [True, True, True]
    assert [throttle.allow(k)[0] for k in "abc"] == [False, False, False]
    assert throttle.allow("d") == (True, 0)  # forgets "a", the oldest
    assert throttle.allow("a") == (True, 0)
    assert len(throttle._keys) == 3


async def test_a_flood_of_malformed_messages_from_one_sender_logs_one_line(captured):
    """Real sockets: 300 garbage messages to a registry give one warning, all counted."""
    async with dsml.open_registry("tcp://127.0.0.1:0") as registry:
        ctx = zmq.asyncio.Context()
        socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
        try:
            for i, sock in enumerate(socks):
                prove_secret(sock, f"garbage-{i}".encode())  # a member's bug, not an outsider
                sock.connect(registry.address)
                for _ in range(150):
                    await sock.send_multipart([b"\xc1 not msgpack"])
            for _ in range(200):
                if registry.dropped_messages >= 300:
                    break
                await asyncio.sleep(0.02)
        finally:
            for sock in socks:
                sock.close(linger=0)
            ctx.term()
        assert registry.dropped_messages == 300
    warnings = [line for line in captured.getvalue().splitlines() if "malformed" in line]
    assert len(warnings) == 2, warnings  # one per sender


def test_running_init_with_asyncio_run_says_how_to_use_it(monkeypatch):
    monkeypatch.setenv("DSML_REGISTRY", "tcp://127.0.0.1:9")
    monkeypatch.setenv("DSML_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"async with dsml\.init\(\.\.\.\) as comm") as info:
        asyncio.run(dsml.init())  # type: ignore[arg-type]
    assert "asyncio.run(main())" in str(info.value)


async def test_init_with_a_plain_with_or_without_await_says_how_to_use_it(monkeypatch):
    """The new-user slips: Python's own errors ('Opener' object has no attribute
    'all_reduce', does not support the context manager protocol) did not say what to do."""
    monkeypatch.setenv("DSML_REGISTRY", "tcp://127.0.0.1:9")
    monkeypatch.setenv("DSML_WORLD_SIZE", "1")
    opener = dsml.init()  # await forgotten
    with pytest.raises(AttributeError, match=r"comm = await dsml\.init\(\.\.\.\)"):
        opener.all_reduce(np.ones(2))  # type: ignore[attr-defined]
    assert not hasattr(opener, "all_reduce")  # still an AttributeError for hasattr
    with (
        pytest.raises(TypeError, match=r"async with dsml\.init\(\.\.\.\) as comm"),
        dsml.init(),  # type: ignore[attr-defined]
    ):
        pass
    with (
        pytest.raises(TypeError, match=r"async with dsml\.Client\(\.\.\.\) as client"),
        dsml.Client("tcp://127.0.0.1:9"),  # type: ignore[attr-defined]
    ):
        pass
    with (
        pytest.raises(TypeError, match=r"async with dsml\.LocalCluster\(n\) as cluster"),
        dsml.LocalCluster(2),  # type: ignore[attr-defined]
    ):
        pass
    with pytest.raises(dsml.DsmlError, match=r"not started: use `async with"):
        dsml.LocalCluster(2).client()


def test_blocking_and_testing_come_with_a_plain_import_dsml():
    code = "import dsml; print(dsml.blocking.init.__module__, dsml.testing.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["dsml.blocking", "dsml.testing"]
