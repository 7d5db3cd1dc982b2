"""Message kinds of the dsml protocol (wire layer).

One line per kind says what its sender means; docs/protocol.md has the full table.
"""

from __future__ import annotations

import enum

__all__ = ["Kind"]


class Kind(enum.IntEnum):
    """Every message kind; the number travels in the envelope."""

    # -- membership: worker <-> registry ------------------------------------------------
    JOIN_REQUEST = 1  # worker: "add me to the group" (id, address, world size, wanted rank)
    JOIN_ACCEPTED = 2  # registry: "you are queued; k of n members have joined"
    JOIN_REJECTED = 3  # registry: "you cannot join" (reason)
    VIEW_CHANGED = 4  # registry: "this is the group now" (epoch, members in ring order)
    LEAVE_REQUEST = 5  # worker: "I am leaving the group"
    HEARTBEAT = 6  # worker: "I am alive; my epoch, last started/finished call, progress"
    STATUS_REQUEST = 7  # anyone: "describe the group"
    STATUS_REPLY = 8  # registry: the description
    SUSPECT = 9  # worker: "my connection to this member dropped" (member id)
    PROPOSE = 10  # registry: "members want in: where will you be?" (proposed epoch)
    READY = 11  # worker: "my next collective id is n; I hold later calls" (proposed epoch)
    EVICTED = 12  # registry: "you are no longer a member" (epoch, reason)
    REREGISTER = 13  # registry: "I restarted and do not know you: tell me your view"
    REJOIN = 14  # worker: "I am this member of this view" (after REREGISTER)
    PING = 15  # registry: "are you connected?" (ignored; only its delivery matters)
    WORKER_HELLO = 16  # worker daemon: "I serve jobs at this address; idle or busy" (periodic)
    WORKER_BYE = 17  # worker daemon: "I am shutting down"
    VIEW_AGREED = 18  # worker: "while you were away, the survivors agreed on this view"
    HEARTBEAT_ACK = 19  # registry: "I heard your heartbeat" (epoch): the member knows it is heard

    # -- data plane: peer <-> peer --------------------------------------------------------
    CHUNK = 20  # peer: "payload of step/chunk of collective #cid" (raw frames follow)
    ABORT = 21  # peer: "collective #cid failed here; fail it too" (reason, ranks)
    PROBE = 22  # peer: "I timed out in #cid: where are you?"
    PROGRESS = 23  # peer: "my last started / finished collectives" (answer to PROBE)
    GOODBYE = 24  # peer: "I closed my communicator after collective #cid"
    PEER_MESSAGE = 25  # peer: "point-to-point payload for (tag, sequence)" (send/recv)
    CONFIRM = 26  # peer: "I reached round `step` of the agreement of collective #cid"
    PEER_BEAT = 27  # peer: "I am alive and at this epoch" (links idle longer than an interval)
    VIEW_PROPOSAL = 28  # peer: "without the registry, I count these members of epoch e lost"

    # -- jobs: client <-> worker daemon -------------------------------------------------------
    JOB_SUBMIT = 30  # client: "run this function as rank r of a job" (pickled fn + raw frames)
    JOB_ACCEPTED = 31  # worker: "I run it" (rank 0 adds the address of the job's registry)
    JOB_REFUSED = 32  # worker: "I cannot run it" (busy, malformed; reason)
    JOB_OUTPUT = 33  # worker: "the job printed this" (stream, text)
    JOB_RESULT = 34  # worker: "the job ended" (ok + value frames, or error + traceback)
    JOB_CANCEL = 35  # client: "stop that job"

    # -- launch: `dsml run --nnodes` launcher <-> node 0's launcher ---------------------------
    LAUNCH_HELLO = 40  # launcher: "I start ranks of node i of n, -n k each" (its shape)
    LAUNCH_WELCOME = 41  # node 0: "your shape is this job's: start your ranks"
    LAUNCH_REFUSED = 42  # node 0: "you do not belong to this job" (reason)
    LAUNCH_FAILED = 43  # launcher: "rank r failed" (node, host, exit code, last lines)
    LAUNCH_DONE = 44  # launcher: "all my ranks ended" (exit code)
    LAUNCH_BEAT = 45  # launcher <-> node 0: "still here" (every second; node 0 answers)
