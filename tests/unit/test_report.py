"""The short report of an uncaught dsml error (`dsml/_report.py`), and how the launcher's
summary reads it. The tracebacks are real: code compiled under a file name inside the dsml
package stands for dsml's own frames."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

import pytest

import dsml
from dsml import _report
from dsml.errors import CollectiveMismatchError, ConfigError, PeerLostError
from dsml.launch.failure import Failure

INTERNAL = os.path.join(os.path.dirname(os.path.abspath(dsml.__file__)), "transport", "fake.py")
MESSAGE = "collective #2 does not match across ranks: rank 0 called all_reduce(shape=(2,))"


def _internal(source: str) -> Callable[[], None]:
    """A function `inner()` whose frame is in a dsml file, running `source`."""
    namespace: dict[str, object] = {
        "CollectiveMismatchError": CollectiveMismatchError,
        "ConfigError": ConfigError,
        "PeerLostError": PeerLostError,
    }
    body = "".join(f"    {line}\n" for line in source.splitlines())
    exec(compile(f"def inner():\n{body}", INTERNAL, "exec"), namespace)
    return namespace["inner"]  # type: ignore[return-value]


def _raised(fn: Callable[[], None]) -> tuple[BaseException, TracebackType | None]:
    """Call `fn` from the user's frame below; what it raised, with its traceback."""

    def users_train_step() -> None:
        fn()

    try:
        users_train_step()
    except BaseException as exc:  # the test inspects what it raised
        return exc, exc.__traceback__
    raise AssertionError("fn raised nothing")


def _report_of(hook: _report.ReportHook, fn: Callable[[], None], capsys) -> str:
    exc, tb = _raised(fn)
    hook(type(exc), exc, tb)
    return capsys.readouterr().err


def test_a_dsml_error_shows_the_users_frames_and_its_message_but_no_dsml_frame(capsys):
    inner = _internal(f"raise CollectiveMismatchError({MESSAGE!r})")
    err = _report_of(_report.ReportHook(), inner, capsys)
    lines = err.splitlines()
    assert lines[0] == _report.HEADER
    assert "DSML_TRACEBACK=1" in lines[0]  # how to see everything
    assert lines[-1] == f"dsml.errors.CollectiveMismatchError: {MESSAGE}"
    assert "users_train_step" in err
    assert __file__ in err
    assert INTERNAL not in err
    assert "inner" not in err


def test_a_message_chained_through_causes_and_contexts_is_printed_once(capsys):
    inner = _internal(
        "try:\n"
        "    try:\n"
        "        raise KeyError('gave up')\n"
        "    except KeyError:\n"
        f"        raise CollectiveMismatchError({MESSAGE!r})\n"  # context: the KeyError
        "except CollectiveMismatchError as exc:\n"
        f"    raise CollectiveMismatchError({MESSAGE!r}) from exc\n"
    )
    err = _report_of(_report.ReportHook(), inner, capsys)
    assert err.count(MESSAGE) == 1, err
    assert "gave up" not in err  # a context is dsml's business, not the user's
    assert "During handling" not in err
    assert "direct cause" not in err
    assert len(err.splitlines()) <= 6, err


def test_an_explicit_cause_that_adds_to_the_message_is_named_under_it(capsys):
    inner = _internal(
        "try:\n"
        "    raise PermissionError('[Errno 13] /dev/shm/dsml-1: permission denied')\n"
        "except OSError as exc:\n"
        "    raise ConfigError('cannot map the shared memory segment') from exc\n"
    )
    err = _report_of(_report.ReportHook(), inner, capsys)
    assert err.splitlines()[-2:] == [
        "dsml.errors.ConfigError: cannot map the shared memory segment",
        "  caused by PermissionError: [Errno 13] /dev/shm/dsml-1: permission denied",
    ]


def test_other_exceptions_keep_pythons_full_traceback(capsys):
    inner = _internal("raise ValueError('not dsml')\n")
    err = _report_of(_report.ReportHook(), inner, capsys)
    assert err.startswith("Traceback (most recent call last):\n")
    assert INTERNAL in err
    assert err.endswith("ValueError: not dsml\n")


def test_full_tracebacks_are_asked_for_by_dsml_traceback_or_a_debug_log_level(capsys):
    assert _report.full_traceback({"DSML_TRACEBACK": "1"})
    assert _report.full_traceback({"DSML_LOG_LEVEL": "debug"})
    assert _report.full_traceback({"DSML_TRACEBACK": "yes", "DSML_LOG_LEVEL": "warning"})
    assert not _report.full_traceback({})
    assert not _report.full_traceback({"DSML_TRACEBACK": "0", "DSML_LOG_LEVEL": "info"})
    assert not _report.full_traceback({"DSML_LOG_LEVEL": "loud"})  # invalid: not debug
    inner = _internal(f"raise CollectiveMismatchError({MESSAGE!r})")
    err = _report_of(_report.ReportHook(full=True), inner, capsys)
    assert err.startswith("Traceback (most recent call last):\n")
    assert INTERNAL in err


def test_an_interrupt_is_one_line_naming_where_the_users_code_was(capsys):
    inner = _internal(
        "try:\n"
        "    raise RuntimeError('the cancelled wait')\n"  # as asyncio.run: a context
        "except RuntimeError:\n"
        "    raise KeyboardInterrupt\n"
    )
    err = _report_of(_report.ReportHook(), inner, capsys)
    assert err.count("\n") == 1, err
    assert err.startswith("interrupted (KeyboardInterrupt) in users_train_step at ")
    assert f"{__file__}:" in err


def test_install_keeps_a_hook_the_program_set_and_is_installed_once(monkeypatch):
    def own(*_: object) -> None:
        pass

    monkeypatch.setattr(sys, "excepthook", own)
    assert not _report.install({})
    assert sys.excepthook is own
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert _report.install({"DSML_TRACEBACK": "1"})
    hook = sys.excepthook
    assert isinstance(hook, _report.ReportHook)
    assert hook.full
    assert not _report.install({})
    assert sys.excepthook is hook


@pytest.mark.parametrize("own_hook", [False, True])
def test_dsml_init_installs_the_report_unless_the_program_has_a_hook(monkeypatch, own_hook):
    def own(*_: object) -> None:
        pass

    monkeypatch.setattr(sys, "excepthook", own if own_hook else sys.__excepthook__)
    dsml.init("tcp://127.0.0.1:1", world_size=1)  # resolves its settings; no I/O until awaited
    if own_hook:
        assert sys.excepthook is own
    else:
        assert isinstance(sys.excepthook, _report.ReportHook)


def test_the_launchers_summary_finds_the_error_of_a_short_report(capsys):
    inner = _internal(f"raise CollectiveMismatchError({MESSAGE!r})")
    tail = _report_of(_report.ReportHook(), inner, capsys).splitlines()
    failure = Failure(0, 1, tail)
    assert f"  dsml.errors.CollectiveMismatchError: {MESSAGE}" in failure.report().splitlines()
    assert not failure.consequence


def test_the_launchers_summary_finds_the_error_of_a_traceback_whose_header_scrolled_out():
    tail = [
        "           ^^^^^^^^^^^^^^^^^^^^^^",
        '  File "/site/dsml/transport/shm_link.py", line 356, in _mismatch',
        "    raise error",
        "dsml.errors.PeerLostError: rank 3 was lost",
        "  (more of the message)",
    ]
    failure = Failure(1, 1, tail)
    report = failure.report().splitlines()
    assert report[1:] == [
        "---- rank 1's error (traceback above) ----",
        "  dsml.errors.PeerLostError: rank 3 was lost",
        "    (more of the message)",
        "----",
    ]
    assert failure.consequence  # judged by the error, not by the last line
