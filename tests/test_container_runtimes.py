"""pyxis, Podman, Charliecloud and the CSCS Container Engine beside udocker and Apptainer.

Each runtime's job scripts are pinned by golden files (tests/golden/launch/SCHEDULER-RUNTIME.sh) and their
container lines checked word by word against each tool's documented syntax. Where the tool is not on this
machine (pyxis, Apptainer, the CSCS engine, Podman: `podman run` cannot set its rlimits in this sandbox), a
stand-in on the PATH checks the arguments it is given, fails on any other, and runs the command, so that the
rendered script trains 2 ranks end to end. Charliecloud runs for real: `ch-run` on a tiny root filesystem
this test makes (busybox, /etc), with this machine's Python and venv bound in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dptrain.cli import main
from dptrain.cluster import containers, cscs_edf, local, pbs, slurm
from dptrain.cluster.spec import ContainerSpec, JobSpec
from dptrain.errors import UserError
from dptrain.launch.commands import parse_container
from dptrain.runtime.env import detect_container

from cluster_fixtures import assert_run_written, build_rootfs, runtime_dirs, slurm_cluster  # noqa: F401 - a pytest fixture
from test_launch_render import GOLDEN, REGENERATE, example_spec

SCHEDULERS = {"slurm": slurm, "pbs": pbs, "local": local}
IMAGES = {"pyxis": "nvcr.io#nvidia/pytorch:24.05-py3", "cscs-edf": "/capstor/scratch/ada/pytorch.sqsh",
          "podman": "localhost/dptrain:latest", "charliecloud": "/scratch/ada/dptrain.sqfs"}
# Where each runtime makes sense: pyxis and the CSCS engine are plugins of srun.
WHERE = [(scheduler, runtime) for runtime in IMAGES
         for scheduler in (("slurm",) if runtime in ("pyxis", "cscs-edf") else ("slurm", "pbs", "local"))]
DIGITS = ["--dataset", "digits", "--model", "mlp", "--epochs", "5", "--lr", "0.05", "--batch-size", "32", "--strategy", "sync",
          "--no-progress", "--timeout", "120"]


def spec_of(scheduler: str, runtime: str, **changes) -> JobSpec:
    return dataclasses.replace(example_spec(scheduler, "udocker"), container=ContainerSpec(runtime, IMAGES[runtime]),
                               **changes)


def srun_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("srun --kill-on-bad-exit"))


@pytest.mark.parametrize("scheduler, runtime", WHERE)
def test_job_script_matches_its_golden_file(scheduler, runtime):
    text = SCHEDULERS[scheduler].render(spec_of(scheduler, runtime))
    golden = GOLDEN / f"{scheduler}-{runtime}.sh"
    if REGENERATE:
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}; run with DPTRAIN_REGENERATE_GOLDEN=1"
    assert text == golden.read_text()
    assert subprocess.run(["bash", "-n"], input=text, text=True, timeout=10).returncode == 0


def test_the_edf_matches_its_golden_file_and_is_toml():
    text = cscs_edf.edf(spec_of("slurm", "cscs-edf"))
    golden = GOLDEN / "slurm-cscs-edf.toml"
    if REGENERATE:
        golden.write_text(text)
    assert text == golden.read_text()
    assert tomllib.loads(text) == {
        "image": "/capstor/scratch/ada/pytorch.sqsh",
        "mounts": ["/home/ada/project:/home/ada/project", "/scratch/ada/data:/scratch/ada/data"],
        "workdir": "/home/ada/project", "writable": True,
        "annotations": {"com": {"hooks": {"aws_ofi_nccl": {"enabled": "true", "variant": "cuda12"}}}}}
    assert "annotations" not in tomllib.loads(cscs_edf.edf(spec_of("slurm", "cscs-edf", gpus_per_node=0,
                                                                     tasks_per_node=2)))


TRAIN = "dptrain train --dataset digits --strategy sync --epochs 10 --out /home/ada/project/runs/digits-sync"
STEP = "srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 --cpus-per-task=4 "
RANK = "bash -c 'trap \"\" USR1 USR2 TERM; exec \"$@\"' rank "


def test_pyxis_options_go_on_the_step_s_srun_and_the_task_runs_dptrain_as_on_the_host():
    # pyxis' srun --help: --container-image=IMAGE, --container-mounts=SRC:DST[,SRC:DST...], --container-workdir=PATH,
    # --container-name=NAME; the GPUs are mounted by enroot's hooks, so --gpus-per-node adds nothing.
    assert srun_line(slurm.render(spec_of("slurm", "pyxis"))) == (
        STEP + "'--container-image=nvcr.io#nvidia/pytorch:24.05-py3' "
        "--container-mounts=/home/ada/project:/home/ada/project,/scratch/ada/data:/scratch/ada/data "
        "--container-workdir=/home/ada/project --container-name=dptrain " + RANK + TRAIN + " || status=$?")
    cpu = slurm.render(spec_of("slurm", "pyxis", gpus_per_node=0))
    assert srun_line(cpu) == srun_line(slurm.render(spec_of("slurm", "pyxis")))


def test_the_cscs_engine_runs_the_step_in_the_edf_beside_the_script():
    assert srun_line(slurm.render(spec_of("slurm", "cscs-edf"))) == (
        STEP + "--environment=/home/ada/project/runs/digits-sync/edf.toml " + RANK + TRAIN + " || status=$?")
    own = dataclasses.replace(spec_of("slurm", "cscs-edf"), container=ContainerSpec("cscs-edf", "pytorch.toml"))
    assert "--environment=pytorch.toml " in srun_line(slurm.render(own)) and cscs_edf.files(own) == {}


PODMAN = ("podman run --rm --userns=keep-id --network=host --ipc=host {gpu}--env RANK --env LOCAL_RANK --env WORLD_SIZE "
          "--env LOCAL_WORLD_SIZE --env MASTER_ADDR --env MASTER_PORT --env OMP_NUM_THREADS --env TORCH_CPP_LOG_LEVEL "
          "--env 'DPTRAIN_*' --env 'SLURM_*' --env 'PBS_*' --env 'OMPI_*' --env 'PMI_*' --env 'PMIX_*' --env 'NCCL_*' "
          "--volume /home/ada/project:/home/ada/project --volume /scratch/ada/data:/scratch/ada/data "
          "--workdir /home/ada/project localhost/dptrain:latest ")


def test_podman_runs_rootless_on_the_host_network_with_gpus_by_cdi_only_when_asked():
    assert srun_line(slurm.render(spec_of("slurm", "podman"))) == (
        STEP + RANK + PODMAN.format(gpu="--device nvidia.com/gpu=all ") + TRAIN + " || status=$?")
    cpu = srun_line(slurm.render(spec_of("slurm", "podman", gpus_per_node=0)))
    assert cpu == STEP + RANK + PODMAN.format(gpu="") + TRAIN + " || status=$?"


def test_charliecloud_binds_with_ch_run_and_makes_the_destinations_in_a_directory_image():
    text = slurm.render(spec_of("slurm", "charliecloud"))
    assert srun_line(text) == (STEP + RANK + "ch-run -b /home/ada/project -b /scratch/ada/data -c /home/ada/project "
                               "/scratch/ada/dptrain.sqfs -- " + TRAIN + " || status=$?")
    assert ("if [ -d /scratch/ada/dptrain.sqfs ]; then mkdir -p /scratch/ada/dptrain.sqfs/home/ada/project "
            "/scratch/ada/dptrain.sqfs/scratch/ada/data; fi\n") in text
    assert 'export USER="${USER:-$(id -un)}"\n' in text
    assert "ch-fromhost --nvidia" in text and "ch-fromhost" not in slurm.render(
        spec_of("slurm", "charliecloud", gpus_per_node=0))


@pytest.mark.parametrize("runtime, image, marker", [
    ("apptainer", "img.sif", '"$apptainer" exec --nv '),  # binds the host's driver libraries at each run
    ("podman", "img", "--device nvidia.com/gpu=all "),  # CDI, the site's nvidia-ctk cdi generate
    ("charliecloud", "/img", "ch-fromhost --nvidia"),  # copied into a directory image once; ch-run has no flag
    ("udocker", "img", "dptrain container setup --nvidia"),  # copied in once by udocker setup --nvidia
])
def test_gpus_per_node_sets_each_runtime_s_gpu_flag_and_only_then(runtime, image, marker):
    for scheduler in ("slurm", "pbs"):
        gpu = dataclasses.replace(example_spec(scheduler, "udocker"), container=ContainerSpec(runtime, image))
        assert gpu.gpus_per_node > 0
        assert marker in SCHEDULERS[scheduler].render(gpu)
        assert marker not in SCHEDULERS[scheduler].render(dataclasses.replace(gpu, gpus_per_node=0))


@pytest.mark.parametrize("env, runtime", [({"CH_RUNNING": "Weird Al Yankovic"}, "charliecloud"),
                                          ({"container": "podman"}, "podman"), ({"container": "docker"}, None)])
def test_dptrain_info_names_the_runtime_it_runs_in_from_its_marker(env, runtime):
    assert detect_container(env) == runtime


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------

def launch(tmp_path, capsys, *words: str) -> tuple[int, str]:
    os.chdir(tmp_path)
    code = main(["launch", *words, "--out", "run", "--", "--dataset", "digits"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("words, message", [
    (("--scheduler", "pbs", "--container", "pyxis:img"),
     "--container pyxis:img starts each rank through srun's pyxis plugin, which only SLURM jobs have; under "
     "--scheduler pbs use one of udocker, apptainer, podman, charliecloud"),
    (("--scheduler", "local", "--container", "cscs-edf:img.sqsh"),
     "--container cscs-edf:img.sqsh starts each rank through srun's --environment (the Container Engine's SLURM "
     "plugin), which only SLURM jobs have; under --scheduler local use one of udocker, apptainer, podman, "
     "charliecloud"),
    (("--scheduler", "slurm", "--container", "pyxis:img", "--sbatch-option=--container-image=img"),
     "--sbatch-option '--container-image=img' with --container pyxis:img: sbatch would run the whole job script in "
     "that container, where srun is gone, so no rank could start; drop the --sbatch-option, --container starts one "
     "container per rank"),
    (("--scheduler", "slurm", "--container", "podman:img", "--sbatch-option=--environment=pytorch"),
     "--sbatch-option '--environment=pytorch' with --container podman:img: sbatch would run the whole job script"),
    (("--scheduler", "kubernetes", "--image", "img", "--container", "charliecloud:/img"),
     "--container charliecloud:/img is for SLURM, PBS and local"),
    (("--scheduler", "slurm", "--container", "podman:"), "--container 'podman:' is not RUNTIME:IMAGE; use "),
])
def test_a_container_a_scheduler_cannot_start_is_one_line_and_nothing_is_written(tmp_path, capsys, words, message):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "job.slurm").write_text("mine\n")
    code, err = launch(tmp_path, capsys, *words)
    assert code == 2
    assert err.startswith(f"dptrain: error: {message}") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["job.slurm"]
    assert (tmp_path / "run" / "job.slurm").read_text() == "mine\n"


def test_the_forms_of_every_runtime_are_named_when_one_is_unknown():
    with pytest.raises(UserError, match="udocker:NAME or apptainer:IMAGE.sif or pyxis:IMAGE or podman:IMAGE or "
                                        "charliecloud:IMAGE_DIR_OR.sqfs or cscs-edf:IMAGE$"):
        parse_container("docker:ubuntu")


def test_an_edf_changed_by_hand_is_never_overwritten(tmp_path, capsys):
    words = ("--scheduler", "slurm", "--container", "cscs-edf:img.sqsh")
    assert launch(tmp_path, capsys, *words)[0] == 0
    edf, script = tmp_path / "run" / "edf.toml", (tmp_path / "run" / "job.slurm").read_text()
    assert tomllib.loads(edf.read_text())["image"] == "img.sqsh"
    edf.write_text("image = 'mine'\n")
    code, err = launch(tmp_path, capsys, *words)
    assert code == 2
    assert err == (f"dptrain: error: '{edf}' already holds a different cscs-edf file; give --out a new directory "
                   "(or delete that file to replace it)\n")
    assert edf.read_text() == "image = 'mine'\n" and (tmp_path / "run" / "job.slurm").read_text() == script


# ---- the rendered scripts, run end to end: stand-ins for the tools this machine lacks ------------

STANDIN = r'''#!{python}
"""A stand-in for {tool}: checks the arguments dptrain's job script gives it (EXPECT, JSON), fails with exit
97 on any other, and runs the command as the tool would."""
import fnmatch, json, os, subprocess, sys, tomllib
tool, words, expect = os.path.basename(sys.argv[0]), sys.argv[1:], json.loads(os.environ["EXPECT_" + os.path.basename(sys.argv[0]).upper()])
def fail(why):
    print(f"stand-in {{tool}}: {{why}}: {{words}}", file=sys.stderr); sys.exit(97)
with open(os.environ["CALLS"], "a") as calls:
    calls.write(json.dumps([tool, *words]) + "\n")
if tool == "scontrol":
    print("node1" if words[:2] == ["show", "hostnames"] else "NodeName=node1 NodeAddr=127.0.0.1"); sys.exit(0)
if tool != "srun":  # apptainer, podman: the exact words before the command
    if words[:len(expect)] != expect:
        fail(f"expected {{expect}} first")
    command, env, cwd = words[len(expect):], dict(os.environ), None
    for flag, value in zip(expect, expect[1:]):
        cwd = value if flag in ("--pwd", "--workdir") else cwd
    if tool == "podman":  # only the variables named with --env pass in
        names = [value for flag, value in zip(expect, expect[1:]) if flag == "--env"]
        env = {{key: value for key, value in os.environ.items() if key in ("PATH", "HOME", "PYTHONPATH")
               or any(fnmatch.fnmatchcase(key, name) for name in names)}}
    os.chdir(cwd); os.execvpe(command[0], command, env)
options = {{}}
while words and words[0].startswith("--"):
    key, _, value = words.pop(0).partition("=")
    options[key] = value
container = {{key: value for key, value in options.items() if key.startswith("--container") or key == "--environment"}}
if container != expect.get("step", {{}}):
    fail(f"container options {{container}}, expected {{expect.get('step', {{}})}}")
cwd = options.get("--container-workdir") or os.getcwd()
if "--environment" in options:
    with open(options["--environment"], "rb") as file:
        edf = tomllib.load(file)
    if edf != expect["edf"]:
        fail(f"EDF {{edf}}, expected {{expect['edf']}}")
    cwd = edf["workdir"]
nodes, per_node = int(options["--nodes"]), int(options["--ntasks-per-node"])
tasks = []
for rank in range(nodes * per_node):
    env = {{**os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node), "SLURM_STEP_ID": "0",
           "SLURM_NODEID": str(rank // per_node), "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
           "SLURM_STEP_TASKS_PER_NODE": f"{{per_node}}(x{{nodes}})"}}
    tasks.append(subprocess.Popen(words, env=env, cwd=cwd))
sys.exit(max(task.wait() for task in tasks))
'''


def run_job(tmp_path: Path, runtime: str, image: str, *, tools: dict, scheduler: str = "slurm",
            nodes: str = "2") -> tuple[subprocess.CompletedProcess, list]:
    """`dptrain launch` a 2-rank digits job in `runtime`, then its script by bash with stand-ins for `tools`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in [*tools, *(["scontrol"] if scheduler == "slurm" else [])]:
        (bin_dir / tool).write_text(STANDIN.format(python=sys.executable, tool=tool))
        (bin_dir / tool).chmod(0o755)
    project = tmp_path / "project"
    project.mkdir()
    layout = ["--nodes", nodes, "--tasks-per-node", str(2 // int(nodes))] if scheduler == "slurm" else \
        ["--tasks-per-node", "2"]
    done = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", scheduler, *layout, "--container",
                           f"{runtime}:{image}", "--dptrain", f"{sys.executable} -m dptrain", "--out", "run", "--",
                           *DIGITS], cwd=project, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    run = project / "run"
    expect = {f"EXPECT_{tool.upper()}": json.dumps(value(project, run)) for tool, value in tools.items()}
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls.jsonl"),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node1", "EXPECT_SCONTROL": "{}", **expect,
           "OMP_NUM_THREADS": "1"}
    script = run / SCHEDULERS[scheduler].SCRIPT_NAME
    result = subprocess.run(["bash", str(script)], cwd=project, env=env, capture_output=True, text=True, timeout=240)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    return result, calls


def trained(tmp_path: Path, result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "project" / "run" / "summary.json").read_text())
    assert summary["workers"] == 2, summary
    assert (tmp_path / "project" / "run" / "model.pt").is_file()
    return summary


@pytest.mark.slow
def test_a_pyxis_job_script_trains_two_ranks_through_a_stand_in_srun_that_checks_its_options(tmp_path):
    image = "nvcr.io#nvidia/pytorch:24.05-py3"

    def step(project, run):
        return {"step": {"--container-image": image, "--container-mounts": f"{project}:{project}",
                         "--container-workdir": str(project), "--container-name": "dptrain"}}

    result, calls = run_job(tmp_path, "pyxis", image, tools={"srun": step})
    trained(tmp_path, result)
    assert [call[0] for call in calls].count("srun") == 1


@pytest.mark.slow
def test_a_cscs_engine_job_script_trains_two_ranks_in_the_edf_it_wrote(tmp_path):
    image = "/capstor/scratch/ada/pytorch.sqsh"

    def step(project, run):
        return {"step": {"--environment": str(run / "edf.toml")},
                "edf": {"image": image, "mounts": [f"{project}:{project}"], "workdir": str(project), "writable": True}}

    result, _ = run_job(tmp_path, "cscs-edf", image, tools={"srun": step})
    trained(tmp_path, result)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["slurm", "local"])
def test_an_apptainer_job_script_trains_two_ranks_through_a_stand_in_apptainer(tmp_path, scheduler):
    image = str(tmp_path / "dptrain.sif")

    def exec_words(project, run):
        return ["exec", "--bind", str(project), "--pwd", str(project), image]

    tools = {"apptainer": exec_words, **({"srun": lambda project, run: {}} if scheduler == "slurm" else {})}
    result, calls = run_job(tmp_path, "apptainer", image, tools=tools, scheduler=scheduler)
    trained(tmp_path, result)
    assert [call[0] for call in calls].count("apptainer") == 2


@pytest.mark.slow
def test_a_podman_job_script_trains_two_ranks_with_only_the_variables_it_names(tmp_path):
    # podman run cannot run the ranks here (PODMAN_HERE, below), so a stand-in runs the command with only the host
    # variables named by --env: the ranks must meet their world from those alone.
    image = "localhost/dptrain:latest"

    def run_words(project, run):
        return shlex.split(PODMAN.format(gpu="").replace("/home/ada/project", str(project))
                           .replace("--volume /scratch/ada/data:/scratch/ada/data ", ""))[1:]

    tools = {"podman": run_words, "srun": lambda project, run: {}}
    result, calls = run_job(tmp_path, "podman", image, tools=tools, nodes="1")
    trained(tmp_path, result)
    assert [call[0] for call in calls].count("podman") == 2


# Tried on the machine these tests were written on (Debian 12, podman 4.3.1, a sandbox with hybrid cgroups
# and no /dev/mqueue): as root, runc and crun cannot set the container's RLIMIT_NPROC ('operation not
# permitted'); rootless, as an unprivileged user, podman runs a container only with --runtime runc
# --cgroup-manager=cgroupfs and without --ipc=host, and that user cannot read this machine's Python (under
# /root, mode 0700), which the ranks need bound in. So the podman job script runs against a stand-in above.
PODMAN_HERE = ("podman cannot run a container here as {user}: {error} (rootless podman as an unprivileged user "
               "runs here only with --runtime runc --cgroup-manager=cgroupfs and no --ipc=host, and cannot read "
               "this machine's Python, which the ranks need)")


@pytest.fixture(scope="module")
def podman_image(tmp_path_factory):
    """The tiny root filesystem imported into podman, where a rootless podman runs a container with it."""
    if shutil.which("podman") is None or shutil.which("busybox") is None:
        pytest.skip("not installed on this machine: podman (apt-get install podman) or busybox")
    root = tmp_path_factory.mktemp("podman")
    build_rootfs(root / "rootfs.tar.gz")
    name = f"localhost/dptrain-test-{os.getpid()}"
    imported = subprocess.run(["podman", "import", str(root / "rootfs.tar.gz"), name], capture_output=True, text=True,
                              timeout=300)
    user = os.environ.get("USER") or ("root" if os.geteuid() == 0 else str(os.geteuid()))
    if imported.returncode != 0:
        pytest.skip(PODMAN_HERE.format(user=user, error=imported.stderr.strip().splitlines()[-1]))
    try:
        probe = subprocess.run(["podman", "run", "--rm", "--userns=keep-id", "--network=host", "--ipc=host", name,
                                "true"], capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            pytest.skip(PODMAN_HERE.format(user=user, error=(probe.stderr.strip().splitlines() or ["no output"])[-1]))
        yield name
    finally:
        subprocess.run(["podman", "rmi", "-f", name], capture_output=True, timeout=120)


@pytest.mark.slow
def test_podman_trains_two_ranks_of_a_local_job_each_in_podman_run(podman_image, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    binds = [word for path in runtime_dirs() for word in ("--bind", path)]
    done = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "local", "--tasks-per-node", "2",
                           "--container", f"podman:{podman_image}", *binds, "--dptrain", f"{sys.executable} -m dptrain",
                           "--out", "run", "--submit", "--wait", "--wait-timeout", "200", "--", *DIGITS], cwd=project,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert assert_run_written(project / "run", workers=2, epochs=5)["test_accuracy"] > 0.5


def test_a_stand_in_fails_on_arguments_it_does_not_expect(tmp_path):
    # The checks above mean something: a pyxis step without --container-workdir is refused.
    (tmp_path / "srun").write_text(STANDIN.format(python=sys.executable, tool="srun"))
    (tmp_path / "srun").chmod(0o755)
    env = {**os.environ, "CALLS": str(tmp_path / "calls"), "EXPECT_SRUN": json.dumps(
        {"step": {"--container-image": "img", "--container-workdir": "/w"}})}
    result = subprocess.run([str(tmp_path / "srun"), "--nodes=1", "--ntasks-per-node=1", "--container-image=img",
                             "true"], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 97 and "container options" in result.stderr


# ---- Charliecloud, for real ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def charliecloud_image(tmp_path_factory) -> Path:
    """An image directory: the tiny root filesystem of the udocker tests, unpacked."""
    if shutil.which("ch-run") is None or shutil.which("busybox") is None:
        pytest.skip("not installed on this machine: ch-run (apt-get install charliecloud) or busybox")
    root = tmp_path_factory.mktemp("charliecloud")
    build_rootfs(root / "rootfs.tar.gz")
    image = root / "image"
    image.mkdir()
    subprocess.run(["tar", "-xzf", str(root / "rootfs.tar.gz"), "-C", str(image)], check=True, timeout=60)
    return image


PROBE = """import os, torch, torch.distributed as dist
from dptrain.runtime.env import detect_container
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
where = [detect_container(), os.path.exists("/etc/debian_version"), total.item(), dist.get_world_size()]
open(os.path.join(os.environ["DPTRAIN_RUN_DIR"], f"rank-{dist.get_rank()}.txt"), "w").write(repr(where))
dist.destroy_process_group()
"""


def launch_in_charliecloud(image: Path, project: Path, *words: str) -> str:
    binds = [word for path in runtime_dirs() for word in ("--bind", path)]
    env = {**os.environ, "USER": os.environ.get("USER") or "root", "OMP_NUM_THREADS": "1"}
    dptrain = ["--dptrain", f"{sys.executable} -m dptrain"] if words[0].startswith("--") else []
    done = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "local", "--tasks-per-node", "2",
                           "--container", f"charliecloud:{image}", *binds, *dptrain, "--out", "run", "--submit",
                           "--wait", "--wait-timeout", "200", "--", *words], cwd=project, env=env,
                          capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "COMPLETED with exit code 0" in output
    return (project / "run" / "job.sh").read_text()


@pytest.mark.slow
def test_charliecloud_ranks_run_inside_ch_run_and_meet_there(charliecloud_image, tmp_path):
    # Inside: ch-run's marker, the image's root (busybox and /etc, no Debian release file), one world of 2.
    project = tmp_path / "project"
    project.mkdir()
    (project / "probe.py").write_text(PROBE)
    script = launch_in_charliecloud(charliecloud_image, project, sys.executable, "probe.py")
    assert f"ch-run -b {project} " in script
    for rank in (0, 1):
        assert (project / "run" / f"rank-{rank}.txt").read_text() == "['charliecloud', False, 3.0, 2]"


@pytest.mark.slow
def test_charliecloud_trains_two_ranks_of_a_local_job_each_in_ch_run(charliecloud_image, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    launch_in_charliecloud(charliecloud_image, project, *DIGITS)
    summary = assert_run_written(project / "run", workers=2, epochs=5)
    assert summary["test_accuracy"] > 0.5, summary


@pytest.mark.slow
def test_charliecloud_trains_two_ranks_on_two_slurm_nodes_through_the_real_srun(slurm_cluster, charliecloud_image,
                                                                               tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    binds = [word for path in runtime_dirs() for word in ("--bind", path)]
    env = {**os.environ, "USER": os.environ.get("USER") or "root", "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    done = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                           "--tasks-per-node", "1", "--container", f"charliecloud:{charliecloud_image}", *binds,
                           "--dptrain", f"{sys.executable} -m dptrain", "--out", "run", "--submit", "--wait",
                           "--wait-timeout", "200", "--", *DIGITS], cwd=project, env=env, capture_output=True,
                          text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:] + slurm_cluster.logs()
    assert "COMPLETED with exit code 0" in output
    summary = json.loads((project / "run" / "summary.json").read_text())
    assert summary["workers"] == 2 and (project / "run" / "model.pt").is_file(), summary
    assert "rank ch-run -b " in (project / "run" / "job.slurm").read_text()


@pytest.mark.slow
def test_container_check_runs_dptrain_inside_a_charliecloud_image(charliecloud_image):
    binds = runtime_dirs()
    for path in binds:  # (as a job script does for a directory image)
        (charliecloud_image / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-m", "dptrain", "container", "check", "--runtime", "charliecloud",
                             "--name", str(charliecloud_image), "--dptrain", f"{sys.executable} -m dptrain",
                             *[word for path in binds for word in ("--bind", path)]],
                            env={**os.environ, "USER": os.environ.get("USER") or "root"}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].startswith("ok   runs ") and "dptrain 0." in result.stdout


# ---- the MPI model, said and checked before a job is submitted ---------------------------------------

def image_with_mpi(root: Path, library: str | None) -> Path:
    """A directory image (Charliecloud's form, which dptrain looks into) holding the MPI library `library`."""
    (root / "usr" / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    if library:
        (root / "usr" / "lib" / "x86_64-linux-gnu" / library).write_bytes(b"\x7fELF")
    return root


@pytest.mark.parametrize("library, found", [("libmpi.so.40.30.4", "Open MPI 4"), ("libmpi.so.40.10.2", "Open MPI 3"),
                                            ("libmpi.so.40.40.0", "Open MPI 5"), ("libmpi.so.12.1.8", "MPICH ABI 12"),
                                            (None, None)])
def test_the_mpi_of_a_root_filesystem_is_read_from_its_library_s_name(tmp_path, library, found):
    assert containers.mpi_in(image_with_mpi(tmp_path, library)) == found


HOST_MPI = containers.mpi_in(Path("/"))
LIBRARY = {"Open MPI 3": "libmpi.so.40.10.2", "Open MPI 4": "libmpi.so.40.30.4", "Open MPI 5": "libmpi.so.40.40.0",
           "MPICH ABI 12": "libmpi.so.12.1.8"}
OTHER_MPI = LIBRARY["Open MPI 3" if HOST_MPI == "Open MPI 4" else "Open MPI 4"]


def launch_command(tmp_path, capsys, image: Path, *after: str) -> tuple[int, str, str]:
    os.chdir(tmp_path)
    (tmp_path / "script.py").write_text("print('hi')\n")
    code = main(["launch", "--scheduler", "pbs", "--container", f"charliecloud:{image}", "--out", "run", "--", *after])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.skipif(HOST_MPI is None, reason="this machine has no MPI library (.ci/run installs openmpi-bin)")
def test_a_command_in_an_image_whose_mpi_is_not_the_host_s_is_refused_in_one_line(tmp_path, capsys):
    image = image_with_mpi(tmp_path / "image", OTHER_MPI)
    code, out, err = launch_command(tmp_path, capsys, image, "python", "script.py")
    other = containers.mpi_in(image)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"dptrain: error: --container charliecloud:{image} holds {other} and this host {HOST_MPI}: "
                          "a program that calls MPI inside the container (the hybrid model"), err
    assert "build the image with" in err and "--no-mpi-check" in err
    assert not (tmp_path / "run").exists()
    assert main(["launch", "--scheduler", "pbs", "--container", f"charliecloud:{image}", "--no-mpi-check", "--out",
                 "run", "--", "python", "script.py"]) == 0
    assert "MPI model" not in capsys.readouterr().out and (tmp_path / "run" / "job.pbs").is_file()


@pytest.mark.skipif(HOST_MPI is None, reason="this machine has no MPI library (.ci/run installs openmpi-bin)")
def test_the_mpi_model_is_said_before_the_job_is_written(tmp_path, capsys):
    # dptrain train uses no MPI: an image's other MPI is named, not refused.
    image = image_with_mpi(tmp_path / "image", OTHER_MPI)
    code, out, err = launch_command(tmp_path, capsys, image, "--dataset", "digits")
    assert code == 0, err
    assert (f"dptrain: MPI model: Open MPI's mpirun starts one container per rank and the ranks of dptrain train "
            f"meet over torch.distributed (gloo, NCCL); no MPI is used inside (the image has "
            f"{containers.mpi_in(image)})\n") in out
    same = image_with_mpi(tmp_path / "same", LIBRARY[HOST_MPI])
    (tmp_path / "run2").mkdir()
    os.chdir(tmp_path)
    assert main(["launch", "--scheduler", "pbs", "--container", f"charliecloud:{same}", "--out", "run2", "--",
                 "python", "script.py"]) == 0
    assert (f"the hybrid model), for which the image's MPI ({HOST_MPI}) must be the host's ({HOST_MPI}): they "
            "match\n") in capsys.readouterr().out


def test_an_image_that_cannot_be_looked_into_is_said_so(tmp_path, capsys):
    os.chdir(tmp_path)
    assert main(["launch", "--scheduler", "slurm", "--container", "apptainer:img.sif", "--out", "run", "--",
                 "--dataset", "digits"]) == 0
    assert ("dptrain: MPI model: srun starts one container per rank and the ranks of dptrain train meet over "
            "torch.distributed (gloo, NCCL); no MPI is used inside (the image has an MPI that cannot be looked into "
            "from here)\n") in capsys.readouterr().out
