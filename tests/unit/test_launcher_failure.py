"""Which failed rank the launcher names as the root cause of a crash."""

import asyncio

from dsml.launch.failure import Failure


def _tail(*error: str) -> list[str]:
    return [
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "    asyncio.run(main())",
        *error,
    ]


def test_errors_caused_by_another_rank_are_consequences():
    for name in ("PeerLostError", "MemberLeftError", "CollectiveAbortedError", "NoQuorumError"):
        failure = Failure(1, 1, _tail(f"dsml.errors.{name}: collective #3 failed on rank 1"))
        assert failure.consequence, name


def test_a_rank_s_own_error_is_a_root_cause():
    for line in (
        "RuntimeError: rank 2 cannot find its batch",
        "dsml.errors.CollectiveMismatchError: collective #3 does not match",
        "dsml.errors.Unknown: not a dsml error name",
    ):
        assert not Failure(2, 1, _tail(line)).consequence, line
    assert not Failure(2, -9, []).consequence  # killed: no error printed


def test_a_multi_line_message_is_judged_by_its_first_line():
    tail = _tail("dsml.errors.MemberLeftError: rank 2 left the group", "  (details)", "")
    assert Failure(1, 1, tail).consequence


def test_the_root_cause_is_named_even_when_a_consequence_ended_first():
    from dsml.launch.launcher import Launch

    launch = Launch(["true"], 2, "tcp://127.0.0.1:1")
    launch._add_failure(Failure(1, 1, _tail("dsml.errors.MemberLeftError: rank 2 left")))
    launch._add_failure(Failure(2, 1, _tail("RuntimeError: rank 2 cannot find its batch")))
    assert launch.failure is not None
    assert launch.failure.rank == 2


def test_the_daemon_client_names_the_root_cause_the_same_way():
    from dsml.daemon.client import _Job  # the client's record of one job's outcomes
    from dsml.errors import RemoteError

    def error(rank: int, kind: str) -> RemoteError:
        return RemoteError(f"rank {rank} raised {kind}", rank=rank, error_type=kind)

    async def cause() -> RemoteError:
        job = _Job("j", [], "train")
        job.errors += [error(0, "dsml.errors.MemberLeftError"), error(1, "CancelledError")]
        job.errors += [error(2, "ValueError"), error(3, "dsml.errors.PeerLostError")]
        return job.root_cause()

    assert asyncio.run(cause()).rank == 2
