"""A bug in the communicator's own machinery fails it loudly: never a silent hang."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dsml.errors import CollectiveAbortedError
from dsml.testing import open_local_cluster
from dsml.wire import Kind


async def test_a_bug_while_handling_a_message_fails_pending_and_later_calls_on_every_rank(caplog):
    async with open_local_cluster(2) as cluster:
        broken = cluster[1]
        table = broken._session.table

        def buggy(rank, env, payload):
            raise RuntimeError("injected bug in a handler")

        table.inbound[Kind.CHUNK] = buggy
        outcomes = await asyncio.gather(  # the ring: its data travels as CHUNK messages
            *(c.all_reduce(np.ones(4), algorithm="ring", timeout=30) for c in cluster),
            return_exceptions=True,
        )
        # Rank 0 may have had all it needed from rank 1 already; rank 1 cannot finish.
        assert isinstance(outcomes[0], np.ndarray | CollectiveAbortedError), outcomes[0]
        assert isinstance(outcomes[1], CollectiveAbortedError), outcomes[1]
        assert "internal error" in str(outcomes[1])
        assert "injected bug in a handler" in caplog.text  # logged with its traceback
        with pytest.raises(CollectiveAbortedError, match="internal error"):
            await broken.barrier()  # later calls on the broken rank
        with pytest.raises(CollectiveAbortedError, match="internal error"):
            await cluster[0].barrier(timeout=30)  # its peer is told: no wait for a timeout
