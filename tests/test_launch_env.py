"""Launcher variables resolved into a rendezvous: pure functions over a mapping."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from dsml.errors import ConfigError
from dsml.launch import (
    Hosting,
    choose_bind,
    detect_launcher,
    expand_hostlist,
    resolve_rendezvous,
    slurm_port,
)
from dsml.transport.addresses import interface_address

TORCHRUN = {
    "RANK": "2",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "2",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "1",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_STEP_NODELIST": "n[01-04,07],gpu3",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "1",
}


# -- host lists ------------------------------------------------------------------------------


def test_hostlist_expands_ranges_with_zero_padding_and_plain_names() -> None:
    assert expand_hostlist("n[01-04,07],gpu3") == ["n01", "n02", "n03", "n04", "n07", "gpu3"]


def test_hostlist_expands_several_brackets_in_one_name_slowest_first() -> None:
    assert expand_hostlist("r[1-2]n[8,10]") == ["r1n8", "r1n10", "r2n8", "r2n10"]


def test_hostlist_keeps_a_single_host_and_a_plain_list() -> None:
    assert expand_hostlist("node7") == ["node7"]
    assert expand_hostlist("a,b, c") == ["a", "b", "c"]


@pytest.mark.parametrize("text", ["n[1-2", "n1-2]", "n[2-1]", "n[a-b]", "", "n[1-99999999]"])
def test_hostlist_rejects_malformed_lists_with_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="host list"):
        expand_hostlist(text)


# -- detection -------------------------------------------------------------------------------


def test_torchrun_with_its_agent_store_makes_rank_zero_publish_and_others_look_up() -> None:
    others = resolve_rendezvous(None, None, None, TORCHRUN)
    assert (others.rank, others.world_size, others.local_rank) == (2, 4, 2)
    assert others.hosting is Hosting.LOOKUP
    assert others.registry is None
    assert others.store == ("127.0.0.1", 29500)
    assert others.store_key == "dsml/none/attempt_1/registry"  # a restart gets a new key
    first = resolve_rendezvous(None, None, None, TORCHRUN | {"RANK": "0"})
    assert first.hosting is Hosting.PUBLISH
    assert first.rank == 0


def test_env_style_without_agent_store_makes_rank_zero_serve_at_master_addr() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"}
    plan = resolve_rendezvous(None, None, None, env)
    assert plan.launcher == "env"
    assert plan.hosting is Hosting.SERVE
    assert plan.registry == "tcp://10.0.0.5:23456"
    assert plan.world_size == 3
    other = resolve_rendezvous(None, None, None, env | {"RANK": "1"})
    assert other.hosting is Hosting.NONE
    assert other.registry == "tcp://10.0.0.5:23456"


def test_slurm_derives_the_port_from_the_job_and_step_and_uses_the_first_node() -> None:
    plan = resolve_rendezvous(None, None, None, SLURM)
    assert plan.launcher == "slurm"
    assert (plan.rank, plan.world_size, plan.local_rank) == (5, 8, 1)
    assert plan.registry == f"tcp://n01:{20000 + (123456 % 10000) * 4 + 1}"
    assert plan.rank0_serves  # rank 0 may start late: the others wait as long as to form
    assert slurm_port(123456, 1) == 33825
    assert plan.hosting is Hosting.NONE


def test_slurm_takes_master_port_and_master_addr_when_set() -> None:
    plan = resolve_rendezvous(None, None, None, SLURM | {"MASTER_PORT": "4000"})
    assert plan.registry == "tcp://n01:4000"
    plan = resolve_rendezvous(None, None, None, SLURM | {"MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert plan.registry == "tcp://h:5"


def test_slurm_rank_zero_serves_and_refuses_to_when_it_is_not_on_the_first_node() -> None:
    plan = resolve_rendezvous(None, None, None, SLURM | {"SLURM_PROCID": "0", "SLURM_NODEID": "0"})
    assert plan.hosting is Hosting.SERVE
    with pytest.raises(ConfigError, match="first node"):
        resolve_rendezvous(None, None, None, SLURM | {"SLURM_PROCID": "0"})


def test_a_batch_script_outside_any_srun_step_is_not_a_slurm_launch() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert detect_launcher(env) is None


def test_open_mpi_variables_give_rank_size_and_local_rank() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "PMIX_RANK": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "7000",
    }
    plan = resolve_rendezvous(None, None, None, env)
    assert plan.launcher == "openmpi"
    assert (plan.rank, plan.world_size, plan.local_rank) == (3, 4, 1)
    assert plan.registry == "tcp://127.0.0.1:7000"


def test_mpich_hydra_variables_give_rank_size_and_local_rank() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "DSML_REGISTRY": "tcp://h:1"}
    plan = resolve_rendezvous(None, None, None, env)
    assert plan.launcher == "mpich"
    assert (plan.rank, plan.world_size) == (0, 2)
    assert plan.registry == "tcp://h:1"
    assert plan.hosting is Hosting.NONE


def test_mpirun_without_a_rendezvous_says_to_set_master_addr() -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT"):
        resolve_rendezvous(None, None, None, {"PMI_RANK": "1", "PMI_SIZE": "2"})


def test_mpirun_started_by_srun_directly_uses_slurms_rendezvous() -> None:
    env = SLURM | {"PMIX_RANK": "5"}
    plan = resolve_rendezvous(None, None, None, env)
    assert plan.launcher == "pmix"
    assert plan.world_size == 8
    assert plan.registry == "tcp://n01:33825"


def test_mpirun_whose_daemons_ran_under_srun_ignores_their_slurm_task_ids() -> None:
    env = SLURM | {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "32"}
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        resolve_rendezvous(None, None, None, env)


def test_torchrun_variables_win_over_an_outer_slurm_step() -> None:
    assert resolve_rendezvous(None, None, None, SLURM | TORCHRUN).launcher == "torchrun"


def test_pmix_alone_asks_for_the_world_size() -> None:
    env = {"PMIX_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "7000"}
    with pytest.raises(ConfigError, match="DSML_WORLD_SIZE"):
        resolve_rendezvous(None, None, None, env)
    assert resolve_rendezvous(None, None, None, env | {"DSML_WORLD_SIZE": "2"}).world_size == 2


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "x", "WORLD_SIZE": "2"},
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
    ],
)
def test_malformed_launcher_variables_raise_a_config_error_naming_them(
    env: dict[str, str],
) -> None:
    with pytest.raises(ConfigError, match=r"RANK|MASTER_PORT"):
        resolve_rendezvous(None, None, None, env)


# -- precedence ------------------------------------------------------------------------------


def test_arguments_win_over_dsml_variables_which_win_over_the_launcher() -> None:
    env = TORCHRUN | {"DSML_REGISTRY": "tcp://dsml:1", "DSML_WORLD_SIZE": "4", "DSML_RANK": "3"}
    plan = resolve_rendezvous(None, None, None, env)
    assert (plan.registry, plan.world_size, plan.rank) == ("tcp://dsml:1", 4, 3)
    assert plan.hosting is Hosting.NONE  # a registry was named: nobody serves one
    assert not plan.rank0_serves
    plan = resolve_rendezvous("tcp://arg:2", 4, 1, env)
    assert (plan.registry, plan.world_size, plan.rank) == ("tcp://arg:2", 4, 1)


def test_a_dsml_world_size_overriding_the_launchers_is_warned_about(caplog) -> None:
    caplog.set_level("WARNING", logger="dsml.launch")
    resolve_rendezvous(None, None, None, TORCHRUN | {"DSML_WORLD_SIZE": "3"})
    assert "DSML_WORLD_SIZE=3 overrides the world size 4 set by torchrun" in caplog.text
    caplog.clear()
    resolve_rendezvous(None, 3, None, TORCHRUN)  # an argument means it: no warning
    resolve_rendezvous(None, None, None, TORCHRUN | {"DSML_WORLD_SIZE": "4"})  # they agree
    # `dsml run` inside an srun step: its ranks inherit the step's one-task variables
    inner = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1"}
    inner |= {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    resolve_rendezvous(None, None, None, inner | {"DSML_WORLD_SIZE": "4", "DSML_RANK": "2"})
    assert caplog.text == ""


def test_the_launchers_rank_is_dropped_for_a_group_of_another_size() -> None:
    plan = resolve_rendezvous("tcp://h:1", 2, None, TORCHRUN)
    assert plan.world_size == 2
    assert plan.rank is None


def test_an_address_without_world_size_joins_a_running_group() -> None:
    plan = resolve_rendezvous("tcp://127.0.0.1:5555", None, None, {})
    assert plan.world_size is None
    assert plan.rank is None
    assert plan.hosting is Hosting.NONE


def test_nothing_naming_a_registry_explains_every_way_to_name_one() -> None:
    with pytest.raises(ConfigError, match=r"no registry address.*dsml run.*torchrun"):
        resolve_rendezvous(None, None, None, {"LOCAL_RANK": "0"})


def test_rank_without_world_size_says_which_is_missing() -> None:
    env = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
    with pytest.raises(ConfigError, match="RANK is set but WORLD_SIZE is not"):
        resolve_rendezvous(None, None, None, env)
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
    with pytest.raises(ConfigError, match="WORLD_SIZE is set but RANK is not"):
        resolve_rendezvous(None, None, None, env)


def test_a_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="out of range"):
        resolve_rendezvous(None, None, None, {"RANK": "4", "WORLD_SIZE": "4"})


# -- binding ---------------------------------------------------------------------------------


def test_a_loopback_registry_keeps_the_loopback_bind() -> None:
    assert choose_bind(None, None, "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:0"
    assert choose_bind(None, None, "tcp://localhost:5555") == "tcp://127.0.0.1:0"
    assert choose_bind(None, None, "ipc:///tmp/x") == "tcp://127.0.0.1:0"


def test_an_explicit_bind_wins_and_dsml_ifname_picks_that_interfaces_address() -> None:
    assert choose_bind("tcp://127.0.0.2:0", "lo", "tcp://10.1.2.3:1") == "tcp://127.0.0.2:0"
    assert choose_bind(None, "lo", "tcp://127.0.0.1:1") == "tcp://127.0.0.1:0"


def test_an_unknown_interface_name_is_a_config_error_listing_the_real_ones() -> None:
    with pytest.raises(ConfigError, match=r"no such interface.*lo"):
        choose_bind(None, "nosuchif0", "tcp://127.0.0.1:1")


def test_a_registry_on_another_address_binds_the_interface_that_routes_to_it() -> None:
    own = [name for _, name in socket.if_nameindex() if name != "lo"]
    addresses = []
    for name in own:
        try:
            addresses.append(interface_address(name, socket.AF_INET))
        except ConfigError:
            continue
    if not addresses:
        pytest.skip("this host has no IPv4 interface besides loopback")
    # A registry at one of this host's own non-loopback addresses routes from that address.
    assert choose_bind(None, None, f"tcp://{addresses[0]}:5555") == f"tcp://{addresses[0]}:0"


def test_importing_dsml_and_its_launch_layer_does_not_import_torch() -> None:
    code = "import sys, dsml, dsml.launch, dsml.cli.run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
