"""A scheduler is one file plus one registry line: a toy LSF, written here into a temporary package,
gets its job script from `dptrain launch` and is recognised inside its own jobs.

The toy's file holds both sides, as dptrain.cluster's schedulers do: `render` (a #BSUB script whose
`blaunch` starts one task per slot) and the in-job environment (LSB_JOBID, the hosts of
LSB_MCPU_HOSTS, the rank from blaunch's 1-based LSF_PM_TASKID). Nothing else of dptrain is changed.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dptrain import registry
from dptrain.cli import dispatch as dptrain
from dptrain.cluster.base import Scheduler
from dptrain.cluster.spec import JobSpec
from dptrain.runtime.env import DistEnv, detect, port_from_job_id

TOY_LSF = '''
"""LSF: a #BSUB script, blaunch starts one rank per slot; inside, LSB_JOBID, LSB_MCPU_HOSTS and LSF_PM_TASKID."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Optional

from dptrain.cluster.base import Job, Placement, integer
from dptrain.cluster.containers import rank_command
from dptrain.cluster.spec import JobSpec, header, quote
from dptrain.cluster.submit import JobStatus, run_tool

SCRIPT_NAME = "job.lsf"
SUBMIT_COMMAND = "bsub"
PRIORITY = 45


def render(spec: JobSpec) -> str:
    setup, command = rank_command(spec)
    return "\\n".join([
        *header(spec, "LSF job"),
        f"#BSUB -J {spec.job_name}",
        f"#BSUB -n {spec.world_size}",
        f'#BSUB -R "span[ptile={spec.tasks_per_node}]"',
        f"#BSUB -o {spec.run_dir}/lsf-%J.out",
        "set -euo pipefail",
        f"cd {quote([spec.workdir])}",
        *setup,
        f"blaunch {command}",
    ]) + "\\n"


def output_path(run_dir: Path, job_id: str) -> Path:
    return run_dir / f"lsf-{job_id}.out"


def submit(script: Path) -> str:
    out = run_tool(["sh", "-c", f"bsub < {quote([str(script)])}"], what="submit the job", cwd=script.parent)
    return re.search(r"Job <(\\d+)>", out).group(1)


def poll(job_id: str) -> JobStatus:
    state = run_tool(["bjobs", "-noheader", "-o", "stat", job_id], what=f"ask for job {job_id}").strip()
    return JobStatus(state=state, finished=state in ("DONE", "EXIT"), exit_code=0 if state == "DONE" else 1)


def _slots(env: Mapping[str, str]) -> list[tuple[str, int]]:
    words = env.get("LSB_MCPU_HOSTS", "").split()
    return [(host, int(count)) for host, count in zip(words[::2], words[1::2])]


def job(env: Mapping[str, str]) -> Optional[Job]:
    if "LSB_JOBID" not in env:
        return None
    return Job("lsf", env["LSB_JOBID"], tuple(host for host, _ in _slots(env)))


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    if "LSB_JOBID" not in env or "LSF_PM_TASKID" not in env:
        return None
    rank, slots = integer(env, "LSF_PM_TASKID") - 1, _slots(env)
    first = 0
    for _, count in slots:  # blaunch fills the hosts in order
        if rank < first + count:
            return Placement("blaunch", rank, sum(count for _, count in slots), rank - first, count)
        first += count
    return Placement("blaunch", rank, sum(count for _, count in slots), 0, 1)
'''

# What blaunch does in an LSF job: start the command once per slot, each with its task id (1-based).
FAKE_BLAUNCH = textwrap.dedent("""\
    #!/bin/bash
    status=0
    for task in 1 2 3 4; do LSF_PM_TASKID=$task "$@" || status=$?; done
    exit $status
    """)

# What a rank sees, as JSON in the run directory; the toy is registered in the rank's own process too.
PROBE = textwrap.dedent("""\
    import dataclasses, json, os
    from dptrain import registry
    registry.SCHEDULERS["lsf"] = registry.Entry("toysched.lsf", "bsub")
    from dptrain.runtime.env import detect
    env = detect()
    with open(os.path.join(os.environ["RUN_DIR"], f"rank-{env.rank}.json"), "w") as out:
        json.dump(dataclasses.asdict(env), out)
    """)

LSF_JOB = {"LSB_JOBID": "777", "LSB_MCPU_HOSTS": "hostA 2 hostB 2", "LSB_HOSTS": "hostA hostA hostB hostB"}


@pytest.fixture
def toy_lsf(tmp_path, monkeypatch):
    """The toy LSF module, in a package of its own on sys.path, registered with one line."""
    package = tmp_path / "toysched"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lsf.py").write_text(TOY_LSF)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.SCHEDULERS, "lsf", registry.Entry("toysched.lsf", "bsub"))
    return registry.load("scheduler", "lsf")


def test_the_toy_satisfies_the_scheduler_protocol(toy_lsf):
    assert isinstance(toy_lsf, Scheduler)


def test_dptrain_launch_renders_the_toy_s_job_script(toy_lsf, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = dptrain(["launch", "--scheduler", "lsf", "--nodes", "2", "--tasks-per-node", "2", "--out", "runs/toy",
                    "--dry-run", "--", "--dataset", "digits", "--strategy", "sync", "--epochs", "2"])
    text = capsys.readouterr().out
    assert code == 0
    run_dir = tmp_path / "runs" / "toy"
    assert text.splitlines()[1] == "# LSF job: 4 ranks (2 nodes x 2 tasks)."
    assert "#BSUB -n 4\n" in text and '#BSUB -R "span[ptile=2]"\n' in text
    # ranks run dptrain by the launching interpreter's absolute path, not whatever `dptrain` is on the job's PATH
    assert text.endswith(f"blaunch {shlex.quote(sys.executable)} -m dptrain train --dataset digits --strategy sync "
                         f"--epochs 2 --out {run_dir}\n")


def test_dptrain_launch_writes_the_toy_s_script_under_its_own_name(toy_lsf, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = dptrain(["launch", "--scheduler", "lsf", "--out", "runs/toy", "--", "--dataset", "digits"])
    assert code == 0
    script = tmp_path / "runs" / "toy" / "job.lsf"
    assert f"dptrain: submit it by running this command again with --submit, or with: bsub {script}\n" in \
        capsys.readouterr().out
    assert script.read_text() == toy_lsf.render(JobSpec(
        scheduler="lsf", workdir=str(tmp_path), run_dir=str(script.parent), train_args=("--dataset", "digits"),
        dptrain=f"{shlex.quote(sys.executable)} -m dptrain"))


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_inside_a_toy_job_each_task_knows_its_rank_hosts_and_rendezvous(toy_lsf, rank):
    env = detect({**LSF_JOB, "LSF_PM_TASKID": str(rank + 1)})
    assert env == DistEnv(launcher="blaunch", rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2,
                          master_addr="hostA", master_port=port_from_job_id("777"), scheduler="lsf", job_id="777",
                          nodes=("hostA", "hostB"))


def test_the_toy_s_batch_script_itself_is_not_a_rank(toy_lsf):
    env = detect(LSF_JOB)
    assert (env.launcher, env.launched, env.scheduler, env.job_id, env.nodes) == (
        "single", False, "lsf", "777", ("hostA", "hostB"))


def test_registering_the_toy_leaves_the_other_environments_as_they_were(toy_lsf):
    srun = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1"}
    env = detect(srun)
    assert (env.launcher, env.rank, env.world_size, env.scheduler, env.master_addr) == (
        "srun", 1, 2, "slurm", "node07")
    assert detect({}).launcher == "single"


def test_the_toy_s_rendered_job_runs_and_its_ranks_detect_themselves(toy_lsf, tmp_path):
    # The script as `dptrain launch` renders it for a command, run by bash against a stand-in blaunch.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "blaunch").write_text(FAKE_BLAUNCH)
    (bin_dir / "blaunch").chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = JobSpec(scheduler="lsf", workdir=str(tmp_path), run_dir=str(run_dir),
                   command=(sys.executable, "-c", PROBE), nodes=2, tasks_per_node=2)
    script = tmp_path / "job.lsf"
    script.write_text(toy_lsf.render(spec))
    python_path = f"{tmp_path}:{Path(__file__).resolve().parents[1] / 'src'}"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "RUN_DIR": str(run_dir),
                               "PYTHONPATH": python_path, **LSF_JOB})
    assert done.returncode == 0, done.stderr
    seen = {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in run_dir.glob("rank-*.json")}
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, env in seen.items():
        assert env == {"launcher": "blaunch", "rank": rank, "world_size": 4, "local_rank": rank % 2,
                       "local_world_size": 2, "master_addr": "hostA", "master_port": port_from_job_id("777"),
                       "scheduler": "lsf", "job_id": "777", "nodes": ["hostA", "hostB"]}
