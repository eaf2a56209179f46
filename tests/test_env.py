"""Rank, world, local rank and rendezvous address as each launcher's environment describes them.

Every environment here is a synthetic dict shaped like what the launcher really exports, so the
tests never depend on (or touch) os.environ.
"""

from __future__ import annotations

import socket

import pytest

from dptrain.errors import UserError
from dptrain.runtime.env import DEFAULT_PORT, DistEnv, detect, detect_container, free_port, port_from_job_id
from dptrain.runtime.spawn import worker_env


def _where(env: DistEnv) -> tuple:
    """The fields every case asserts, in one comparable tuple."""
    return (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size,
            env.scheduler, env.job_id, env.master_addr, env.master_port)


# ----------------------------------------------------------------------------- nothing launched

def test_empty_environment_is_a_single_unlaunched_process():
    env = detect({})
    assert _where(env) == ("single", 0, 1, 0, 1, "none", None, "127.0.0.1", DEFAULT_PORT)
    assert not env.launched
    assert env.nodes == ()


def test_unrelated_variables_do_not_look_like_a_launcher():
    env = detect({"HOME": "/home/me", "PATH": "/usr/bin", "OMP_NUM_THREADS": "4", "LOCAL_RANK": "0"})
    assert env.launcher == "single" and not env.launched


# ----------------------------------------------------------------------------- dptrain local launcher

@pytest.mark.parametrize("rank", [0, 2])
def test_local_launcher_worker_environment(rank):
    # The very dict our own launcher hands each worker, so launcher and detection cannot drift.
    env = detect(worker_env(rank, 3, 41234, 2, {"HOME": "/home/me"}))
    assert _where(env) == ("local", rank, 3, rank, 3, "none", None, "127.0.0.1", 41234)
    assert env.launched


def test_local_launcher_variables_spelled_out():
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "DPTRAIN_LAUNCHER": "local"})
    assert _where(env) == ("local", 1, 2, 1, 2, "none", None, "127.0.0.1", 29611)


def test_rank_and_world_without_a_known_launcher_is_the_generic_env_launcher():
    env = detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"})
    assert _where(env) == ("env", 0, 2, 0, 2, "none", None, "10.0.0.5", 29500)


# ----------------------------------------------------------------------------- torchrun

def _torchrun(rank: int, world: int, local_rank: int, local_world: int, **extra: str) -> dict[str, str]:
    """What torchrun 2.x exports to each worker it starts."""
    group_rank = rank // local_world
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(world // local_world),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
        "MASTER_ADDR": "node01.cluster", "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "job-77", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x/error.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1",
        **extra,
    }


def test_torchrun_single_node():
    env = detect(_torchrun(1, 4, 1, 4, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"))
    assert _where(env) == ("torchrun", 1, 4, 1, 4, "none", None, "127.0.0.1", 29500)


def test_torchrun_second_node_of_two():
    env = detect(_torchrun(3, 4, 1, 2))
    assert _where(env) == ("torchrun", 3, 4, 1, 2, "none", None, "node01.cluster", 29400)


def test_torchrun_started_by_srun_takes_ranks_from_torchrun_not_slurm():
    # `srun --ntasks-per-node=1 torchrun ...`: SLURM_PROCID is the node index, RANK the worker's.
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[07-08]",
             "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    env = detect(_torchrun(3, 4, 1, 2, **slurm))
    assert _where(env) == ("torchrun", 3, 4, 1, 2, "slurm", "4242", "node01.cluster", 29400)


# ----------------------------------------------------------------------------- SLURM

def _srun(procid: int, ntasks: int, localid: int, nodelist: str, tasks_per_node: str,
          job_id: str = "4242", **extra: str) -> dict[str, str]:
    """What `srun` exports to one task of a step (the subset dptrain may read, and some noise)."""
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_LOCALID": str(localid),
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_CPUS_ON_NODE": "8", "SLURM_CLUSTER_NAME": "hpc", "SLURM_SUBMIT_DIR": "/home/me",
        **extra,
    }


@pytest.mark.parametrize("procid, localid", [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_srun_step_across_two_nodes(procid, localid):
    env = detect(_srun(procid, 4, localid, "node[07-08]", "2(x2)",
                       SLURMD_NODENAME="node07" if procid < 2 else "node08",
                       SLURM_NODEID=str(procid // 2)))
    assert _where(env) == ("srun", procid, 4, localid, 2, "slurm", "4242", "node07", port_from_job_id("4242"))
    assert env.nodes == ("node07", "node08")
    assert env.launched


def test_srun_ranks_agree_on_the_rendezvous():
    places = {(e.master_addr, e.master_port)
              for e in (detect(_srun(r, 4, r % 2, "node[07-08]", "2(x2)")) for r in range(4))}
    assert places == {("node07", port_from_job_id("4242"))}


def test_srun_with_a_mixed_node_list_meets_on_the_first_host():
    env = detect(_srun(5, 8, 1, "gpu-a[01,03-04],gpu-b7", "2(x4)"))
    assert env.nodes == ("gpu-a01", "gpu-a03", "gpu-a04", "gpu-b7")
    assert (env.master_addr, env.local_world_size, env.world_size, env.rank) == ("gpu-a01", 2, 8, 5)


def test_srun_on_part_of_the_allocation_meets_on_the_steps_first_node():
    env = detect(_srun(0, 2, 0, "node[01-04]", "1(x2)", SLURM_STEP_NODELIST="node[03-04]"))
    assert env.master_addr == "node03"
    assert env.nodes == ("node03", "node04")


def test_srun_on_one_node_meets_on_localhost():
    env = detect(_srun(1, 2, 1, "node07", "2"))
    assert _where(env) == ("srun", 1, 2, 1, 2, "slurm", "4242", "127.0.0.1", port_from_job_id("4242"))


def test_srun_without_step_counts_falls_back_to_job_counts():
    env = _srun(1, 2, 1, "node07", "2")
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_LOCALID"):
        del env[name]
    found = detect(env)
    assert (found.world_size, found.local_world_size, found.local_rank) == (2, 2, 0)


def test_srun_uneven_tasks_per_node_gives_each_node_its_own_local_world():
    # `srun -n 4` over two nodes with 3 CPUs free on the first: SLURM_STEP_TASKS_PER_NODE="3,1".
    env = detect(_srun(3, 4, 0, "node[07-08]", "3,1", SLURMD_NODENAME="node08", SLURM_NODEID="1"))
    assert (env.rank, env.local_rank, env.local_world_size) == (3, 0, 1)


def test_slurm_batch_script_itself_is_not_launched():
    # sbatch runs the script with SLURM_PROCID=0 but outside any srun step.
    env = detect({"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                  "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NODELIST": "node[07-08]",
                  "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    assert (env.launcher, env.launched, env.scheduler, env.job_id) == ("single", False, "slurm", "4242")
    assert (env.rank, env.world_size) == (0, 1)
    assert env.nodes == ("node07", "node08")


def test_slurm_batch_step_id_is_not_an_srun_step():
    env = detect({"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_STEP_ID": "batch", "SLURM_NTASKS": "4",
                  "SLURM_JOB_NODELIST": "node[07-08]"})
    assert (env.launcher, env.scheduler) == ("single", "slurm")


def test_unparsable_slurm_node_list_is_a_user_error():
    with pytest.raises(UserError, match=r"node\[07-"):
        detect(_srun(0, 2, 0, "node[07-", "1(x2)"))


# ----------------------------------------------------------------------------- Open MPI

def _ompi(rank: int, size: int, local_rank: int, local_size: int, **extra: str) -> dict[str, str]:
    """What Open MPI's mpirun exports to each rank."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(local_rank), "OMPI_UNIVERSE_SIZE": str(size),
        "OMPI_APP_CTX_NUM_PROCS": str(size), "OMPI_MCA_orte_precondition_transports": "0123456789abcdef-0",
        "PMIX_RANK": str(rank), "PMIX_NAMESPACE": "prterun-host-1234@1",
        **extra,
    }


def test_mpirun_on_one_node_meets_on_localhost():
    env = detect(_ompi(2, 4, 2, 4))
    assert _where(env) == ("mpirun", 2, 4, 2, 4, "none", None, "127.0.0.1", DEFAULT_PORT)


def test_mpirun_job_id_gives_the_port():
    env = detect(_ompi(0, 2, 0, 2, OMPI_MCA_ess_base_jobid="3217555457"))
    assert env.master_port == port_from_job_id("3217555457")


def test_mpirun_across_nodes_without_scheduler_asks_for_master_addr():
    with pytest.raises(UserError, match="set MASTER_ADDR") as caught:
        detect(_ompi(3, 4, 1, 2))
    assert "\n" not in str(caught.value)


def test_mpirun_across_nodes_with_master_addr_given():
    env = detect(_ompi(3, 4, 1, 2, MASTER_ADDR="head.cluster", MASTER_PORT="23456"))
    assert _where(env) == ("mpirun", 3, 4, 1, 2, "none", None, "head.cluster", 23456)


def test_mpirun_inside_a_slurm_allocation_uses_the_node_list():
    # mpirun run from the batch script: the ranks inherit the script's SLURM_* (no SLURM_STEP_ID).
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
             "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    env = detect(_ompi(3, 4, 1, 2, **slurm))
    assert _where(env) == ("mpirun", 3, 4, 1, 2, "slurm", "4242", "node07", port_from_job_id("4242"))


def test_mpirun_ranks_on_remote_nodes_ignore_the_srun_step_of_their_daemon():
    # Open MPI starts its daemons with srun, so remote ranks also see that step's SLURM_PROCID.
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
             "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1"}
    env = detect(_ompi(3, 4, 1, 2, **slurm))
    assert _where(env) == ("mpirun", 3, 4, 1, 2, "slurm", "4242", "node07", port_from_job_id("4242"))


# ----------------------------------------------------------------------------- PMI (MPICH / Intel MPI) and PBS

def _pmi(rank: int, size: int, local_rank: int, local_size: int, **extra: str) -> dict[str, str]:
    """What MPICH's or Intel MPI's mpiexec (Hydra) exports to each rank."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "PMI_FD": "7",
            "MPI_LOCALRANKID": str(local_rank), "MPI_LOCALNRANKS": str(local_size), **extra}


def _pbs(nodefile: str, job_id: str = "1234.pbs-server") -> dict[str, str]:
    return {"PBS_JOBID": job_id, "PBS_NODEFILE": nodefile, "PBS_O_WORKDIR": "/home/me",
            "PBS_ENVIRONMENT": "PBS_BATCH", "PBS_JOBNAME": "train", "PBS_QUEUE": "workq"}


@pytest.fixture
def nodefile(tmp_path):
    path = tmp_path / "nodefile"
    # One line per slot; hosts repeat and the first one is where rank 0 runs.
    path.write_text("cn05\ncn05\ncn02\ncn02\n\n")
    return str(path)


@pytest.mark.parametrize("rank, local_rank", [(0, 0), (3, 1)])
def test_mpiexec_under_pbs(nodefile, rank, local_rank):
    env = detect({**_pmi(rank, 4, local_rank, 2), **_pbs(nodefile)})
    assert _where(env) == ("pmi", rank, 4, local_rank, 2, "pbs", "1234.pbs-server", "cn05",
                           port_from_job_id("1234.pbs-server"))
    assert env.nodes == ("cn05", "cn02")


def test_mpiexec_under_pbs_without_a_node_file_asks_for_master_addr(tmp_path):
    with pytest.raises(UserError, match="set MASTER_ADDR"):
        detect({**_pmi(3, 4, 1, 2), **_pbs(str(tmp_path / "missing"))})


def test_mpiexec_on_one_node():
    env = detect(_pmi(1, 2, 1, 2))
    assert _where(env) == ("pmi", 1, 2, 1, 2, "none", None, "127.0.0.1", DEFAULT_PORT)


def test_mpiexec_inside_slurm_takes_ranks_from_pmi_not_from_the_proxys_srun_step():
    # mpiexec.hydra -n 4 -ppn 2 inside `salloc -N 2`: proxies run as `srun -N 2 -n 2 hydra_pmi_proxy`.
    proxy_step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                  "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[07-08]",
                  "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    env = detect({**_pmi(3, 4, 1, 2), **proxy_step})
    assert _where(env) == ("pmi", 3, 4, 1, 2, "slurm", "4242", "node07", port_from_job_id("4242"))


# ----------------------------------------------------------------------------- overrides and bad values

def test_master_addr_and_port_override_the_scheduler():
    env = detect(_srun(2, 4, 0, "node[07-08]", "2(x2)", MASTER_ADDR="login1", MASTER_PORT="12345"))
    assert _where(env) == ("srun", 2, 4, 0, 2, "slurm", "4242", "login1", 12345)


def test_master_addr_overrides_the_pbs_node_file(nodefile):
    env = detect({**_pmi(0, 4, 0, 2), **_pbs(nodefile), "MASTER_ADDR": "10.1.2.3"})
    assert (env.master_addr, env.master_port) == ("10.1.2.3", port_from_job_id("1234.pbs-server"))


def test_master_port_alone_overrides_the_derived_port():
    env = detect(_srun(0, 4, 0, "node[07-08]", "2(x2)", MASTER_PORT="31000"))
    assert (env.master_addr, env.master_port) == ("node07", 31000)


@pytest.mark.parametrize("name, env", [
    ("RANK", {"RANK": "x", "WORLD_SIZE": "2"}),
    ("WORLD_SIZE", {"RANK": "0", "WORLD_SIZE": "two"}),
    ("LOCAL_RANK", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0.5"}),
    ("MASTER_PORT", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}),
    ("OMPI_COMM_WORLD_SIZE", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "",
                              "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}),
    ("SLURM_PROCID", {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "zero", "SLURM_NTASKS": "1"}),
    ("PMI_RANK", {"PMI_RANK": "-", "PMI_SIZE": "2"}),
])
def test_non_integer_variable_is_a_user_error_naming_it(name, env):
    with pytest.raises(UserError) as caught:
        detect(env)
    message = str(caught.value)
    assert name in message and repr(env[name]) in message and "integer" in message


@pytest.mark.parametrize("rank, world", [("2", "2"), ("5", "4"), ("-1", "2"), ("0", "0")])
def test_rank_outside_the_world_is_a_user_error(rank, world):
    with pytest.raises(UserError, match=f"rank {rank} .*{world}"):
        detect({"RANK": rank, "WORLD_SIZE": world})


# ----------------------------------------------------------------------------- ports

JOB_IDS = ["0", "1", "4242", "19999", "20000", "99999999999", "1234.pbs-server", "1234_5", "1234[5].pbs-server",
           "abc", "", "job-🙂"]


@pytest.mark.parametrize("job_id", JOB_IDS)
def test_port_from_job_id_stays_in_range_and_is_deterministic(job_id):
    port = port_from_job_id(job_id)
    assert 20000 <= port < 40000
    assert port == port_from_job_id(job_id)


def test_port_from_job_id_differs_for_consecutive_jobs():
    for job in list(range(0, 100)) + [19999, 39999, 123456789]:
        assert port_from_job_id(str(job)) != port_from_job_id(str(job + 1)), job


def test_port_from_job_id_reads_pbs_and_array_job_ids():
    assert port_from_job_id("1234.pbs-server") == port_from_job_id("1234")
    assert port_from_job_id("1235.pbs-server") != port_from_job_id("1234.pbs-server")
    assert port_from_job_id("1234_5") != port_from_job_id("1234_6")
    assert port_from_job_id("1234[5].pbs-server") != port_from_job_id("1234[6].pbs-server")


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)


def test_container_runtime_is_detected_from_its_marker_variables():
    assert detect_container({"container_uuid": "x", "container_execmode": "P1"}) == "udocker"
    assert detect_container({"APPTAINER_CONTAINER": "/x.sif"}) == "apptainer"
    assert detect_container({"SINGULARITY_CONTAINER": "/x.sif"}) == "apptainer"
    assert detect_container({"container_uuid": "x"}) is None  # udocker sets both
    assert detect_container({}) is None
