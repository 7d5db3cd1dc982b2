"""`ProcessGroupDsml`: torch.distributed's ProcessGroup over a dsml communicator (adapter).

torch calls these methods (from Python, or from C++ through its Python trampoline, as
DDP's reducer does) on the training thread. Each starts its dsml calls on the
communicator's loop thread (in call order, so every rank's calls match) and returns a
`DsmlWork` at once; results that are new arrays are copied into the caller's output
tensors on the loop thread before the work completes. Tensors reach dsml through its
array interop: CPU tensors without a copy (in-place calls write into them), CUDA tensors
through cupy.

This module is the object torch sees: its identity and devices, its end (`shutdown`,
`abort`), and one method per entry point, which makes torch's call forms one (options
omitted, the tensor-and-argument overloads: options.py) and starts the call that maps it
onto dsml's collectives:

- reductions.py: allreduce -> all_reduce (several tensors, and allreduce_coalesced: one
  all_reduce of them concatenated; sparse tensors: sparse.py); broadcast; reduce;
- gathers.py: allgather and all_gather_single -> all_gather; allgather_coalesced -> one
  all_gather of the inputs concatenated, split into outputs[rank][i]; gather; scatter;
- exchanges.py: reduce_scatter(_single) -> reduce_scatter; alltoall -> an all_gather of
  the part sizes and an all_to_all of the parts padded to the longest (all_to_all_single
  without split sizes -> all_to_all);
- here, with p2p.py: barrier, send, recv, recv_anysource and monitored_barrier.

Arguments that are wrong on one rank only (an output of the wrong size, unequal parts)
raise ValueError there after taking the call's turn with a barrier, which the peers'
calls do not match: they fail at once with a mismatch instead of waiting for their
timeout. gather, scatter and the coalesced all-reduce first all_gather every rank's sizes
(`_table`), so that what only one rank could see is an error on all. A group whose dsml
view changed (a member left or was lost) refuses every later call: torch groups keep their
size and ranks.

The helpers that map torch's arguments onto dsml's calls are in mapping.py; how a group
finds its registry (`create_backend`, `HostedRegistry`) is in rendezvous.py; what it keeps
in torch's store at its end in store.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..blocking import BlockingCommunicator
from ..communicator import Communicator
from ..errors import MembershipChangedError
from . import exchanges, gathers, p2p, reductions
from .mapping import Run, Tensors, _flat, _op_name, _reduce_op
from .options import options, tensor_list
from .store import meet_at_close
from .work import DsmlWork, RunState

if TYPE_CHECKING:
    from .rendezvous import HostedRegistry

__all__ = ["ProcessGroupDsml"]

_UNSET_TIMEOUT_S = 0.0


class ProcessGroupDsml(dist.ProcessGroup):  # type: ignore[misc]
    """A torch ProcessGroup whose collectives run on a dsml communicator.

    Made by torch through `create_backend` (`dist.init_process_group("dsml")`,
    `dist.new_group(backend="dsml")`); `comm` is the blocking communicator underneath.
    """

    def __init__(
        self,
        comm: BlockingCommunicator,
        timeout_s: float,
        registry: HostedRegistry | None,
        store: dist.Store | None = None,
    ) -> None:
        super().__init__(comm.rank, comm.world_size)
        self.comm = comm
        self._timeout_s = timeout_s
        self._registry = registry
        self._store = store  # torch's store of this group, for `shutdown`'s last meeting
        self._epoch = comm.epoch
        self._closed_key = f"dsml/closed/{comm.view.members[0].id}/"  # unique to this group
        self._group_name = ""
        self._group_desc = ""
        self._receives = p2p.Receives()  # recv and recv_anysource (on the loop thread)
        self._devices = [torch.device("cpu")]
        if importlib.util.find_spec("cupy") is not None:  # CUDA tensors go through cupy
            self._devices.append(torch.device("cuda"))

    # -- what torch asks of every process group ---------------------------------------------

    def getBackendName(self) -> str:
        return "dsml"

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def _device_types(self) -> list[torch.device]:
        return list(self._devices)

    def _get_backend(self, device: torch.device | str) -> ProcessGroupDsml:
        """The backend of `device`'s tensors: this group itself, for cpu (and cuda when
        cupy is installed). torch cannot register a Python backend per device (its
        Backend class has no Python constructor), so Python callers get it here; C++
        callers of getBackend do not."""
        kind = torch.device(device).type
        if all(d.type != kind for d in self._devices):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def abort(self) -> None:
        self._close(meet=False)

    def shutdown(self) -> None:
        """Close the communicator (and the registry this rank hosts), then wait, up to
        CLOSE_MEETING_S, until every rank of a group still whole has closed too (in
        torch's store), so that all leave `destroy_process_group` together, as Gloo's
        ranks do. (Rank 0 keeps serving that store for the next group: store.py.)"""
        self._close(meet=True)

    def _close(self, *, meet: bool) -> None:
        whole = self.comm.epoch == self._epoch  # nobody lost or left since it formed
        try:
            self.comm.close()
        finally:
            if self._registry is not None:
                self._registry.close()
                self._registry = None
            store, self._store = self._store, None  # torch closes it once nobody holds it
            if meet and whole and store is not None:
                meet_at_close(store, self._closed_key, self.rank(), self.size())

    def __repr__(self) -> str:
        return f"<ProcessGroupDsml rank={self.rank()}/{self.size()} {self.comm!r}>"

    # -- reductions in place ------------------------------------------------------------------

    def allreduce(
        self, tensors: Tensors | torch.Tensor, opts: Any = None, timeout: timedelta | None = None
    ) -> DsmlWork:
        tensors = tensor_list(tensors)
        opts = options("allreduce", opts, timeout=timeout)
        op, timeout_s = _op_name(_reduce_op(opts)), self._timeout(opts)
        if any(t.is_sparse for t in tensors):
            run = reductions.allreduce_sparse(tensors, op, timeout_s)
            return self._start("sparse allreduce", run)
        if len(tensors) > 1:
            run = reductions.allreduce_together("allreduce", tensors, op, timeout_s)
            return self._start("allreduce", run)
        return self._start("allreduce", reductions.allreduce(tensors, op, timeout_s))

    def allreduce_coalesced(self, tensors: Tensors, opts: Any = None) -> DsmlWork:
        opts = options("allreduce_coalesced", opts)
        op, timeout = _op_name(_reduce_op(opts)), self._timeout(opts)
        run = reductions.allreduce_together("allreduce_coalesced", tensors, op, timeout)
        return self._start("allreduce_coalesced", run)

    def broadcast(
        self, tensors: Tensors | torch.Tensor, opts: Any = None, timeout: timedelta | None = None
    ) -> DsmlWork:
        tensors = tensor_list(tensors)
        opts = options("broadcast", opts, timeout=timeout)
        run = reductions.broadcast(tensors, opts.rootRank, self._timeout(opts))
        return self._start("broadcast", run)

    def reduce(
        self,
        tensors: Tensors | torch.Tensor,
        opts: Any = None,
        op: Any = None,
        timeout: timedelta | None = None,
    ) -> DsmlWork:
        tensors = tensor_list(tensors)
        opts = options("reduce", opts, op=op, timeout=timeout)
        dsml_op, root, timeout_s = _op_name(opts.reduceOp), opts.rootRank, self._timeout(opts)
        return self._start("reduce", reductions.reduce(tensors, root, dsml_op, timeout_s))

    # -- gathering ------------------------------------------------------------------------

    def allgather(
        self, outputs: list[Tensors] | Tensors, inputs: Tensors | torch.Tensor, opts: Any = None
    ) -> DsmlWork:
        if isinstance(inputs, torch.Tensor):  # allgather(list of outputs, input)
            outputs, inputs = [tensor_list(outputs)], [inputs]
        timeout = self._timeout(options("allgather", opts))
        return self._start("allgather", gathers.allgather(self.size(), outputs, inputs, timeout))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> DsmlWork:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: Tensors, inputs: Tensors, opts: Any = None
    ) -> DsmlWork:
        run = gathers.allgather_into_tensors(self.size(), outputs, inputs, self._timeout(opts))
        return self._start("all_gather_single", run)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(
        self, outputs: list[Tensors], inputs: Tensors, opts: Any = None
    ) -> DsmlWork:
        """`outputs[r][i]` is rank r's `inputs[i]`: one all_gather of the inputs joined."""
        timeout = self._timeout(options("allgather", opts))
        run = gathers.allgather_coalesced(self.size(), outputs, inputs, timeout)
        return self._start("allgather_coalesced", run)

    def gather(
        self,
        outputs: list[Tensors] | Tensors,
        inputs: Tensors | torch.Tensor,
        opts: Any = None,
        timeout: timedelta | None = None,
    ) -> DsmlWork:
        if isinstance(inputs, torch.Tensor):  # gather(list of outputs, input, root)
            outputs, inputs = [tensor_list(outputs)], [inputs]
        opts = options("gather", opts, timeout=timeout)
        root, timeout_s = opts.rootRank, self._timeout(opts)
        run = gathers.gather(self.rank(), self.size(), outputs, inputs, root, timeout_s)
        return self._start("gather", run)

    def scatter(
        self,
        outputs: Tensors | torch.Tensor,
        inputs: list[Tensors] | Tensors,
        opts: Any = None,
        timeout: timedelta | None = None,
    ) -> DsmlWork:
        if isinstance(outputs, torch.Tensor):  # scatter(output, list of parts, root)
            outputs, inputs = [outputs], ([list(inputs)] if inputs else [])
        opts = options("scatter", opts, timeout=timeout)
        root, timeout_s = opts.rootRank, self._timeout(opts)
        run = gathers.scatter(self.rank(), self.size(), outputs, inputs, root, timeout_s)
        return self._start("scatter", run)

    # -- reduce-scatter and all-to-all --------------------------------------------------------

    def reduce_scatter(
        self,
        outputs: Tensors | torch.Tensor,
        inputs: list[Tensors] | Tensors,
        opts: Any = None,
        timeout: timedelta | None = None,
    ) -> DsmlWork:
        if isinstance(outputs, torch.Tensor):  # reduce_scatter(output, list of parts, op)
            outputs, inputs = [outputs], [list(inputs)]
        opts = options("reduce_scatter", opts, timeout=timeout)
        wholes, wrong = exchanges.reduce_scatter_parts(self.size(), inputs)
        return self._reduce_scatter("reduce_scatter", outputs, wholes, opts, wrong)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> DsmlWork:
        return self._reduce_scatter("reduce_scatter_single", [output], [_flat(input)], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: Tensors, inputs: Tensors, opts: Any = None
    ) -> DsmlWork:
        flat = [_flat(x) for x in inputs]
        return self._reduce_scatter("reduce_scatter_single", outputs, flat, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(
        self, what: str, outputs: Tensors, wholes: Tensors, opts: Any, wrong: str = ""
    ) -> DsmlWork:
        opts = options("reduce_scatter", opts)
        op, timeout = _op_name(opts.reduceOp), self._timeout(opts)
        run = exchanges.reduce_scatter(what, self.size(), outputs, wholes, op, timeout, wrong)
        return self._start(what, run)

    def alltoall(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> DsmlWork:
        run = exchanges.alltoall(self.size(), outputs, inputs, self._timeout(opts))
        return self._start("alltoall", run)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> DsmlWork:
        what, run = exchanges.alltoall_single(
            self.size(), output, input, output_split_sizes, input_split_sizes, self._timeout(opts)
        )
        return self._start(what, run)

    alltoall_base = all_to_all_single

    # -- synchronisation and point to point ---------------------------------------------------

    def barrier(self, opts: Any = None) -> DsmlWork:
        timeout = self._timeout(opts)

        async def run(comm: Communicator) -> Tensors:
            await comm.barrier(timeout=timeout)
            return []

        return self._start("barrier", run)

    def monitored_barrier(
        self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False
    ) -> None:
        """gloo's monitored barrier (p2p.py): rank 0 raises naming the ranks that did not
        arrive within `timeout` (the group's when None); the others, that rank 0 failed."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        timeout_s = self._timeout_s if seconds is None else float(seconds)

        async def run(comm: Communicator) -> Tensors:
            await p2p.monitored_barrier(comm, timeout_s, wait_all_ranks)
            return []

        work = self._start("monitored_barrier", run)
        try:
            work.wait()
        except dist.DistBackendError as exc:
            if isinstance(exc.__cause__, RuntimeError):  # gloo's message, as gloo raises it
                raise RuntimeError(str(exc.__cause__)) from exc.__cause__
            raise

    def send(self, tensors: Tensors, dst: int, tag: int) -> DsmlWork:
        return self._start(f"send to rank {dst}", p2p.send(tensors, dst, tag, self._timeout_s))

    def recv(self, tensors: Tensors, src: int, tag: int) -> DsmlWork:
        state = RunState(source=src)
        run = p2p.recv(self._receives, tensors, src, tag, self._timeout_s)
        return self._start(f"recv from rank {src}", run, state)

    def recv_anysource(self, tensors: Tensors, tag: int) -> DsmlWork:
        """Receive from whichever rank sends first (p2p.py); `work._source_rank()` says
        which, once the work has completed."""
        state = RunState()
        run = p2p.recv_anysource(self._receives, state, tensors, tag, self._timeout_s)
        return self._start("recv from any rank", run, state)

    # -- running on the loop ------------------------------------------------------------------

    def _timeout(self, opts: Any) -> float:
        """The call's timeout: the options' (or the timedelta given) when set, else the
        group's."""
        value = opts if isinstance(opts, timedelta) else getattr(opts, "timeout", None)
        seconds = value.total_seconds() if isinstance(value, timedelta) else 0.0
        return seconds if seconds > _UNSET_TIMEOUT_S else self._timeout_s

    def _start(
        self,
        what: str,
        run: Run,
        run_state: RunState | None = None,
    ) -> DsmlWork:
        """Run `run(comm)` on the loop thread (started in call order); its Work now."""
        comm = self.comm.async_comm
        size, rank = self.size(), self.rank()
        run_state = run_state or RunState()

        async def checked(comm: Communicator) -> Any:
            run_state.started = True
            try:
                if comm.world_size != size or comm.rank != rank:
                    raise MembershipChangedError(
                        f"this torch process group has {size} ranks (this is rank {rank}), "
                        f"but its dsml group now has {comm.world_size} (this is rank "
                        f"{comm.rank}): a member left or was lost. torch groups keep their "
                        "size: destroy and re-create the process group (or train with "
                        "dsml.elastic)",
                        rank=comm.rank,
                        epoch=comm.epoch,
                    )
                return await run(comm)
            finally:
                run_state.ended.set()

        future = asyncio.run_coroutine_threadsafe(checked(comm), self.comm.loop)
        return DsmlWork(future, what, run_state)
