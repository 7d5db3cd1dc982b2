"""torch's own `DistributedTest._DistTestBase` (shipped in the torch wheel) against a backend.

    python tests/scripts/torch_dist_test_base.py --backend dsml --world 3 [--subset all]

Driven as pytorch's test/distributed/test_distributed_spawn.py drives it: one test class
made of `TestDistBackend` and `_DistTestBase`, the variables BACKEND, WORLD_SIZE and
TEMP_DIR (with its barrier/ and test_dir/ folders), one spawned process per rank and test.
The tests are chosen, and take their code paths, as for gloo (BACKEND=gloo); with
`--backend dsml` every group of the run is made with "dsml": the default group,
`new_group()` and the groups a test asks for by name with backend "gloo". torch's public
API checks the backend's name in a few places (`dist.monitored_barrier` is gloo's only,
test_get_backend compares it): those tests fail on "dsml" by torch's design.

`--subset ci` is a small selection (about two minutes at world 2 on two cores) that
tests/test_torch_suite.py runs; `--subset all` (the default) is the collectives, groups,
point-to-point and DDP tests that run on CPU. Prints one line per test and, last, a JSON
line with the counts.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import unittest

_WORLD_VAR = "DSML_SUITE_BACKEND"  # the backend every group is made with (dsml or gloo)
_START_VAR = "DSML_SUITE_START"  # spawn or fork

if __name__ == "__main__":  # the spawned ranks inherit what the parent sets here
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["dsml", "gloo"], default="dsml")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--subset", choices=["ci", "all"], default="all")
    parser.add_argument("-k", dest="pattern", default="", help="only tests matching this regex")
    parser.add_argument(
        "--start",
        choices=["spawn", "fork"],
        default="spawn",
        help="how each test starts its ranks: spawn (as pytorch's CI) re-imports torch's test "
        "module in every rank, seconds per test; fork does not",
    )
    ARGS = parser.parse_args()
    os.environ[_START_VAR] = ARGS.start
    os.environ[_WORLD_VAR] = ARGS.backend
    os.environ["WORLD_SIZE"] = str(ARGS.world)
    if "TEMP_DIR" not in os.environ:
        temp = tempfile.mkdtemp(prefix="dsml-dist-test-")
        os.makedirs(os.path.join(temp, "barrier"))
        os.makedirs(os.path.join(temp, "test_dir"))
        os.environ["TEMP_DIR"] = temp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

os.environ["BACKEND"] = "gloo"  # gloo's selection: decided as the module is imported
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

BACKEND = os.environ.get(_WORLD_VAR, "gloo")
if BACKEND == "dsml":
    import dsml.torch  # noqa: F401 (registers "dsml")

    # The tests still read BACKEND == "gloo" (gloo's code paths: the CPU ones); only the
    # groups change. test_get_backend, which compares the default group's backend name
    # with "gloo", fails on "dsml" for that reason alone.
    _init, _new_group = dist.init_process_group, dist.new_group

    def _dsml(backend: object) -> object:
        return "dsml" if backend is None or str(backend).lower() == "gloo" else backend

    def init_process_group(*args: object, backend: object = None, **kwargs: object) -> object:
        return _init(*args, backend=_dsml(backend), **kwargs)  # type: ignore[arg-type]

    def new_group(*args: object, backend: object = None, **kwargs: object) -> object:
        return _new_group(*args, backend=_dsml(backend), **kwargs)  # type: ignore[arg-type]

    dist.init_process_group = init_process_group
    dist.new_group = new_group

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        if os.environ.get(_START_VAR) == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


#: the tests that run on CPU: collectives, groups, point to point, DDP (no CUDA, no NCCL)
ALL = re.compile(
    r"test_(get_rank|get_backend|Backend_enum_class|destroy_|get_rank_size|barrier"
    r"|new_subgroups|send_recv|isend|irecv|batch_isend_irecv_gloo|broadcast|reduce|all_reduce"
    r"|sparse_all_reduce|scatter|gather|all_gather|all_to_all|monitored_barrier|coalescing_manager"
    r"|average_parameters|DistributedDataParallelCPU|accumulate_gradients|get_future"
    r"|ddp_hook_parity_allreduce|ddp_comm_hook_logging|DistributedSampler|ddp_logging_data_cpu"
    r"|static_graph_api_cpu|ddp_sync_module_states|ddp_uneven_input|ddp_join|ddp_grad_div"
    r"|ddp_ignore_params|ddp_shared_grad|ddp_namedtuple|grads_same_across_ranks"
    r"|ddp_control_flow|invalid_static_graph|ddp_buffer_hook|ddp_broadcast_buffer"
    r"|ddp_inference|ddp_new_tensor_in_fwd|ddp_remove_autograd_hooks|skip_all_reduce_unused)"
)
#: a few of each kind for CI: every entry point of issue 35 among them
CI = re.compile(
    r"test_(all_reduce_sum|all_reduce_coalesced_sum|sparse_all_reduce_sum|broadcast|reduce_max"
    r"|all_gather|all_gather_coalesced_simple|all_gather_coalesced_with_empty|gather|scatter"
    r"|all_to_all_single_unequal_split|barrier|send_recv|send_recv_any_source|send_recv_with_tag"
    r"|irecv|get_future|accumulate_gradients_no_sync_allreduce_hook"
    r"|monitored_barrier_gloo_rank_0_timeout|barrier_timeout_full_group|new_subgroups"
    r"|DistributedDataParallelCPU)"
)


def selected(subset: str, pattern: str) -> unittest.TestSuite:
    """The chosen tests, no CUDA ones (each would spawn its ranks only to skip)."""
    chosen = CI if subset == "ci" else ALL
    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    match = chosen.fullmatch if subset == "ci" else chosen.match
    keep = [
        n
        for n in names
        if match(n) and "cuda" not in n and "nccl" not in n and re.search(pattern, n)
    ]
    return unittest.TestSuite(TestDistBackendWithSpawn(n) for n in keep)


def main() -> int:
    suite = selected(ARGS.subset, ARGS.pattern)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = [t.id().rsplit(".", 1)[1] for t, _ in result.failures + result.errors]
    passed = result.testsRun - len(failed) - len(result.skipped) - len(result.unexpectedSuccesses)
    counts = {
        "backend": BACKEND,
        "world": ARGS.world,
        "subset": ARGS.subset,
        "passed": passed,
        "failed": len(failed),
        "skipped": len(result.skipped),
        "failures": sorted(failed),
    }
    print(json.dumps(counts), flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
