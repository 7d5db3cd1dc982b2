"""init_process_group / destroy_process_group three times under `dsml run`, where rank 0
leaves each destroy only after the other ranks have already made the next group in torch's
store (a probe for the race of issue 38 item 3, made certain instead of rare).

torch's env:// rendezvous has rank 0 serve the TCPStore at MASTER_PORT. A rank that left
destroy first connected, for the next group, to rank 0's server of the old one, which
closed a moment later: `DistNetworkError: Failed to recv, got 0 bytes` (seen under load).
Here rank 0 waits, inside destroy (its ProcessGroupDsml.shutdown, wrapped), until every
other rank has counted itself into the next formation in that server, then lets go.
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

from dsml.torch import ProcessGroupDsml

_shutdown = ProcessGroupDsml.shutdown
WAIT_S = 60.0


def late_shutdown(self: ProcessGroupDsml) -> None:
    store, size = self._store, self.size()  # the group's store, as torch gave it
    before = int(store.add("dsml/formations", 0))  # rendezvous.py's formation counter
    _shutdown(self)
    if self.rank() != 0:
        return
    deadline = time.monotonic() + WAIT_S
    while int(store.add("dsml/formations", 0)) < before + size - 1:  # the others joined
        assert time.monotonic() < deadline, "the other ranks never reached the next group"
        time.sleep(0.01)


ProcessGroupDsml.shutdown = late_shutdown

rounds = 3
for round_ in range(rounds):
    dist.init_process_group("dsml", timeout=datetime.timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.full((4,), float(rank + round_))
    dist.all_reduce(x)
    assert x.tolist() == [float(sum(range(size)) + size * round_)] * 4, x
    if round_ == rounds - 1:
        ProcessGroupDsml.shutdown = _shutdown  # nobody makes a group after the last
    dist.destroy_process_group()
    os.write(1, f"round {round_} ok\n".encode())  # one write: ranks share stdout
