"""`ProcessGroupDsml`: torch.distributed's ProcessGroup over a dsml communicator (adapter).

torch calls these methods (from Python, or from C++ through its Python trampoline, as
DDP's reducer does) on the training thread. Each starts its dsml calls on the
communicator's loop thread (in call order, so every rank's calls match) and returns a
`DsmlWork` at once; results that are new arrays are copied into the caller's output
tensors on the loop thread before the work completes. Tensors reach dsml through its
array interop: CPU tensors without a copy (in-place calls write into them), CUDA tensors
through cupy.

Mapping of torch's calls onto dsml's collectives (inputs flattened where torch's layout is
a list of equal parts): allreduce -> all_reduce (several tensors, and
allreduce_coalesced: one all_reduce of them concatenated); broadcast; reduce; allgather and
all_gather_single -> all_gather; gather; scatter; reduce_scatter(_single) ->
reduce_scatter; alltoall -> an all_gather of the part sizes and an all_to_all of the parts
padded to the longest (all_to_all_single without split sizes -> all_to_all); barrier;
send; recv. allgather_coalesced -> one all_gather of the inputs concatenated, split into
outputs[rank][i]; a sparse allreduce -> sparse.py; recv_anysource and monitored_barrier
-> p2p.py. Every call form torch binds (options omitted, the tensor-and-argument
overloads) becomes torch's options object first (options.py).

Arguments that are wrong on one rank only (an output of the wrong size, unequal parts)
raise ValueError there after taking the call's turn with a barrier, which the peers'
calls do not match: they fail at once with a mismatch instead of waiting for their
timeout. gather, scatter and the coalesced all-reduce first all_gather every rank's sizes
(`_table`), so that what only one rank could see is an error on all. A group whose dsml
view changed (a member left or was lost) refuses every later call: torch groups keep their
size and ranks.

The helpers that map torch's arguments onto dsml's calls are in mapping.py; how a group
finds its registry (`create_backend`, `HostedRegistry`) is in rendezvous.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..blocking import BlockingCommunicator
from ..communicator import Communicator
from ..errors import MembershipChangedError
from .mapping import (
    Tensors,
    _all,
    _code,
    _copy_into,
    _exchange,
    _first_other,
    _flat,
    _gather_outputs_wrong,
    _op_name,
    _reduce_op,
    _refuse,
    _split_into,
    _table,
    _unequal,
)
from .options import options, tensor_list
from .p2p import Receives, monitored_barrier
from .sparse import all_reduce_sparse
from .work import DsmlWork, RunState

if TYPE_CHECKING:
    from .rendezvous import HostedRegistry

__all__ = ["ProcessGroupDsml"]

_UNSET_TIMEOUT_S = 0.0
#: `shutdown` waits at most this long for the other ranks to close too
_CLOSE_MEETING_S = 5.0


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
        self._receives = Receives()  # recv and recv_anysource (on the loop thread)
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
        _CLOSE_MEETING_S, until every rank of a group still whole has closed too (in
        torch's store), so that all leave `destroy_process_group` together, as Gloo's
        ranks do. A rank that left first and made the next process group at once reached
        rank 0's torch store of this one, closing a moment later, and failed."""
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
                _meet(store, self._closed_key, self.rank(), self.size())

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
            return self._allreduce_sparse(tensors, op, timeout_s)
        if len(tensors) > 1:
            return self._allreduce_together("allreduce", tensors, op, timeout_s)

        async def run(comm: Communicator) -> Tensors:
            await _all([comm.all_reduce(t, op, timeout=timeout_s) for t in tensors])
            return tensors

        return self._start("allreduce", run)

    def allreduce_coalesced(self, tensors: Tensors, opts: Any = None) -> DsmlWork:
        opts = options("allreduce_coalesced", opts)
        op, timeout = _op_name(_reduce_op(opts)), self._timeout(opts)
        return self._allreduce_together("allreduce_coalesced", tensors, op, timeout)

    def _allreduce_together(self, what: str, tensors: Tensors, op: str, timeout: float) -> DsmlWork:
        """Several tensors reduced as one: all or none of them change. Concatenated into one
        buffer (so a failure leaves every input as it was, where one all_reduce each would
        have written those that succeeded), after an all_gather of their layout, so that
        tensors of other shapes with the same total fail on every rank."""
        wrong = ""
        if len({(t.dtype, t.device) for t in tensors}) > 1:
            wrong = f"{what}: the tensors must all have one dtype and device"
        layout = _code([(tuple(t.shape), str(t.dtype)) for t in tensors])

        async def run(comm: Communicator) -> Tensors:
            table = await _table(comm, [bool(wrong), layout], timeout)
            if table[:, 0].any():
                bad = int(np.argmax(table[:, 0]))
                raise ValueError(wrong or f"{what}: rank {bad}'s tensors differ in dtype or device")
            other = _first_other(table, 0)
            if other is not None:
                raise ValueError(
                    f"{what}: rank {other}'s tensors differ from rank 0's in number, shape or dtype"
                )
            if not tensors:
                return tensors
            flat = torch.cat([_flat(t) for t in tensors])
            await comm.all_reduce(flat, op, timeout=timeout)
            start = 0
            for t in tensors:
                t.copy_(flat[start : start + t.numel()].reshape(t.shape))
                start += t.numel()
            return tensors

        return self._start(what, run)

    def _allreduce_sparse(self, tensors: Tensors, op: str, timeout: float) -> DsmlWork:
        async def run(comm: Communicator) -> Tensors:
            for t in tensors:
                await all_reduce_sparse(comm, t, op, timeout)
            return tensors

        return self._start("sparse allreduce", run)

    def broadcast(
        self, tensors: Tensors | torch.Tensor, opts: Any = None, timeout: timedelta | None = None
    ) -> DsmlWork:
        tensors = tensor_list(tensors)
        opts = options("broadcast", opts, timeout=timeout)
        root, timeout_s = opts.rootRank, self._timeout(opts)

        async def run(comm: Communicator) -> Tensors:
            await _all([comm.broadcast(t, root, timeout=timeout_s) for t in tensors])
            return tensors

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

        async def run(comm: Communicator) -> Tensors:
            await _all([comm.reduce(t, root, dsml_op, timeout=timeout_s) for t in tensors])
            return tensors

        return self._start("reduce", run)

    # -- gathering ------------------------------------------------------------------------

    def allgather(
        self, outputs: list[Tensors] | Tensors, inputs: Tensors | torch.Tensor, opts: Any = None
    ) -> DsmlWork:
        if isinstance(inputs, torch.Tensor):  # allgather(list of outputs, input)
            outputs, inputs = [tensor_list(outputs)], [inputs]
        timeout = self._timeout(options("allgather", opts))

        wrong = _gather_outputs_wrong(self.size(), outputs, inputs)

        async def run(comm: Communicator) -> list[Tensors]:
            if wrong:
                await _refuse(comm, len(inputs), ValueError(f"allgather: {wrong}"))
            handles = [comm.all_gather(_flat(x), timeout=timeout) for x in inputs]
            for parts, gathered in zip(outputs, await _all(handles), strict=True):
                _split_into(parts, gathered)
            return outputs

        return self._start("allgather", run)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> DsmlWork:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: Tensors, inputs: Tensors, opts: Any = None
    ) -> DsmlWork:
        timeout = self._timeout(opts)

        wrong = _gather_outputs_wrong(self.size(), [[o] for o in outputs], inputs, whole=True)

        async def run(comm: Communicator) -> Tensors:
            if wrong:
                await _refuse(comm, len(inputs), ValueError(f"all_gather_into_tensor: {wrong}"))
            handles = [comm.all_gather(_flat(x), timeout=timeout) for x in inputs]
            for out, gathered in zip(outputs, await _all(handles), strict=True):
                _copy_into(out, gathered)
            return outputs

        return self._start("all_gather_single", run)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(
        self, outputs: list[Tensors], inputs: Tensors, opts: Any = None
    ) -> DsmlWork:
        """`outputs[r][i]` is rank r's `inputs[i]`: one all_gather of the inputs joined."""
        timeout = self._timeout(options("allgather", opts))
        wrong = ""
        if len(outputs) != self.size():
            wrong = f"{len(outputs)} output lists for a group of {self.size()}"
        elif len({t.dtype for t in inputs}) > 1:
            wrong = "the inputs must all have one dtype"
        for outs in outputs if not wrong else []:
            if len(outs) != len(inputs):
                wrong = f"an output list has {len(outs)} tensors for {len(inputs)} inputs"
            wrong = wrong or _gather_outputs_wrong(1, [[o] for o in outs], inputs)
            if wrong:
                break

        async def run(comm: Communicator) -> list[Tensors]:
            if wrong:
                await _refuse(comm, 1, ValueError(f"allgather_coalesced: {wrong}"))
            if not inputs:
                return outputs
            whole = torch.cat([_flat(x) for x in inputs])
            gathered = await comm.all_gather(whole, timeout=timeout)
            _split_into([o for outs in outputs for o in outs], gathered)
            return outputs

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

        x, wrong = inputs[0], ""
        if self.rank() == root:
            wrong = _gather_outputs_wrong(self.size(), outputs, inputs)

        async def run(comm: Communicator) -> list[Tensors]:
            # Every rank learns every input's size and dtype and whether the root's outputs
            # fit: an error on one rank is an error on all (the root alone could tell).
            table = await _table(comm, [bool(wrong), x.numel(), _code(x.dtype)], timeout_s)
            if table[root, 0]:
                raise ValueError(f"gather: {wrong or f'rank {root} has wrong outputs'}")
            other = _first_other(table, root)
            if other is not None:
                raise ValueError(
                    f"gather: rank {other}'s input ({table[other, 1]} elements) differs in size "
                    f"or dtype from rank {root}'s ({table[root, 1]}): every rank's input must "
                    "match one output"
                )
            gathered = await comm.gather(_flat(x), root, timeout=timeout_s)
            if gathered is not None:
                _split_into(outputs[0], gathered)
            return outputs

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
        parts, out = (inputs[0] if inputs else None), outputs[0]
        wrong = _unequal("scatter", parts, self.size()) if parts is not None else ""
        if self.rank() == root and parts is None:
            wrong = "scatter: the root has no parts to scatter"
        part = parts[0] if parts and not wrong else out  # what every output must match

        async def run(comm: Communicator) -> Tensors:
            # Every rank learns whether the root's parts fit every rank's output, so a
            # wrong output on one rank is an error on all (not that rank alone).
            mine = [bool(wrong), out.numel(), _code(out.dtype), part.numel(), _code(part.dtype)]
            table = await _table(comm, mine, timeout_s)
            if table[root, 0]:
                raise ValueError(wrong or f"scatter: rank {root} has wrong parts")
            for r in range(len(table)):
                if table[r, 1] != table[root, 3] or table[r, 2] != table[root, 4]:
                    raise ValueError(
                        f"scatter: rank {r}'s output ({table[r, 1]} elements) does not match "
                        f"the parts of rank {root} ({table[root, 3]} elements) in size or dtype"
                    )
            whole = torch.cat([_flat(p) for p in parts]) if parts is not None else None
            mine = await comm.scatter(whole, root, timeout=timeout_s)
            _copy_into(outputs[0], mine)
            return outputs

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
        wrong = next(filter(None, (_unequal("reduce_scatter", p, self.size()) for p in inputs)), "")
        wholes = [torch.cat([_flat(p) for p in parts]) for parts in inputs]
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
        for out, whole in zip(outputs, wholes, strict=True):
            if not wrong and whole.numel() != out.numel() * self.size():
                wrong = (
                    f"{what}: the input has {whole.numel()} elements; it needs world size "
                    f"({self.size()}) x the output's {out.numel()}"
                )
            if not wrong and whole.dtype != out.dtype:
                wrong = f"{what}: the output is {out.dtype}, the input {whole.dtype}"

        async def run(comm: Communicator) -> Tensors:
            if wrong:
                await _refuse(comm, len(wholes), ValueError(wrong))
            handles = [comm.reduce_scatter(w, op, timeout=timeout) for w in wholes]
            for out, mine in zip(outputs, await _all(handles), strict=True):
                _copy_into(out, mine)
            return outputs

        return self._start(what, run)

    def alltoall(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> DsmlWork:
        timeout, size = self._timeout(opts), self.size()
        wrong = ""
        if len(inputs) != size or len(outputs) != size:
            wrong = (
                f"all_to_all: {len(inputs)} input and {len(outputs)} output parts in a group "
                f"of {size}"
            )

        async def run(comm: Communicator) -> Tensors:
            if wrong:  # one barrier: the peers fail at the first of their two collectives
                await _refuse(comm, 1, ValueError(wrong))
            # Always the same two collectives, whatever this rank's sizes: choosing by them
            # (equal parts: one all_to_all) let ranks take different paths and hang.
            await _exchange(comm, [_flat(t) for t in inputs], outputs, timeout)
            return outputs

        return self._start("alltoall", run)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> DsmlWork:
        size, timeout = self.size(), self._timeout(opts)
        if not output_split_sizes and not input_split_sizes:
            wrong = ""
            if input.shape[0] % size:
                wrong = (
                    f"all_to_all_single: dim 0 ({input.shape[0]}) must divide by the world "
                    f"size ({size}) when no split sizes are given"
                )

            async def even(comm: Communicator) -> Tensors:
                if wrong:
                    await _refuse(comm, 1, ValueError(wrong))
                _copy_into(output, await comm.all_to_all(_flat(input), timeout=timeout))
                return [output]

            return self._start("all_to_all_single", even)
        try:
            ins = list(torch.split(input, list(input_split_sizes) or input.shape[0] // size))
            outs = list(torch.split(output, list(output_split_sizes) or output.shape[0] // size))
        except RuntimeError as exc:  # split sizes that do not add up to the tensor
            error = ValueError(f"all_to_all_single: {exc}")

            async def refused(comm: Communicator) -> Tensors:
                await _refuse(comm, 1, error)
                return []

            return self._start("all_to_all_single", refused)
        return self.alltoall(outs, ins, opts)

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
            await monitored_barrier(comm, timeout_s, wait_all_ranks)
            return []

        work = self._start("monitored_barrier", run)
        try:
            work.wait()
        except dist.DistBackendError as exc:
            if isinstance(exc.__cause__, RuntimeError):  # gloo's message, as gloo raises it
                raise RuntimeError(str(exc.__cause__)) from exc.__cause__
            raise

    def send(self, tensors: Tensors, dst: int, tag: int) -> DsmlWork:
        async def run(comm: Communicator) -> Tensors:
            await _all([comm.send(t, dst, tag=tag, timeout=self._timeout_s) for t in tensors])
            return tensors

        return self._start(f"send to rank {dst}", run)

    def recv(self, tensors: Tensors, src: int, tag: int) -> DsmlWork:
        state = RunState(source=src)

        async def run(comm: Communicator) -> Tensors:
            for t in tensors:
                _copy_into(t, await self._receives.recv(comm, src, tag, self._timeout_s))
            return tensors

        return self._start(f"recv from rank {src}", run, state)

    def recv_anysource(self, tensors: Tensors, tag: int) -> DsmlWork:
        """Receive from whichever rank sends first (p2p.py); `work._source_rank()` says
        which, once the work has completed."""
        state = RunState()

        async def run(comm: Communicator) -> Tensors:
            for t in tensors:
                state.source, message = await self._receives.recv_any(comm, tag, self._timeout_s)
                _copy_into(t, message)
            return tensors

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
        run: Callable[[Communicator], Coroutine[Any, Any, Any]],
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


def _meet(store: dist.Store, key: str, rank: int, size: int) -> None:
    """Say in the store that this rank closed, and wait (bounded) for the others'."""
    try:
        store.set(f"{key}{rank}", b"1")
        wait = timedelta(seconds=_CLOSE_MEETING_S)
        store.wait([f"{key}{r}" for r in range(size)], wait)
    except Exception:  # a rank that never closes (or a store gone) must not fail shutdown
        return
