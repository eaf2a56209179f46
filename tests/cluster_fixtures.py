"""Real cluster components for tests: a two-node SLURM cluster on this machine, udocker set up offline.

Import the fixtures into a test module (`from cluster_fixtures import slurm_cluster`); pytest
then shares one cluster per session. Everything is started here and stopped here, by PID:

* SLURM: a private munged (own key and socket), slurmctld and two slurmd, `node1` and `node2`,
  both on 127.0.0.1 with distinct ports, configured in a temporary directory that SLURM_CONF
  points to. Linux process tracking and no task plugin, so no cgroups or root-only set-up.
* udocker: a repository in a temporary UDOCKER_DIR, set up by `dptrain container setup`
  (autoinstall off, the system's proot through a wrapper), holding a container made from a
  tiny root filesystem (busybox and /etc) built here; the Python runtime, the venv and the
  project are bound into it at run time.

A fixture skips only when a component is not installed on this machine, naming it.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dptrain.runtime.env import free_port

REPO = Path(__file__).resolve().parents[1]
SLURM_DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
START_TIMEOUT = 60.0


def require(*programs: str) -> None:
    """Skip (with the reason) when a program this test needs is not installed here."""
    missing = [name for name in programs if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if missing:
        pytest.skip(f"not installed on this machine: {', '.join(missing)}")


def program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def wait_for(check, what: str, timeout: float = START_TIMEOUT, logs: tuple[Path, ...] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tails = "".join(f"\n--- {log}:\n{log.read_text()[-3000:]}" for log in logs if log.exists())
    raise RuntimeError(f"{what} not ready within {timeout:g} s{tails}")


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@dataclass
class SlurmCluster:
    """A running two-node cluster; `env` is what a client (sbatch, srun, scontrol) needs."""

    root: Path
    conf: Path
    nodes: tuple[str, ...]
    env: dict[str, str]
    daemons: list[Daemon] = field(default_factory=list)

    def run(self, *argv: str, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs)

    def logs(self) -> str:
        return "".join(f"\n--- {d.log.name}:\n{d.log.read_text()[-3000:]}" for d in self.daemons if d.log.exists())

    def state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return out.split("JobState=")[1].split()[0] if "JobState=" in out else "UNKNOWN"

    def wait_until(self, check, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:g} s" + self.logs())
            time.sleep(0.5)

    def preempt(self, job_id: str, metrics: Path, after_epochs: int, timeout: float = 180, signal: str = "USR1") -> None:
        """Send the time-limit warning (`signal`, by default SIGUSR1, to every rank) once `after_epochs` epochs are
        recorded, then wait for the job to requeue itself (it starts again cred_expire seconds later)."""
        self.wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= after_epochs,
                        f"epoch {after_epochs} of job {job_id}", timeout)
        self.run("scancel", f"--signal={signal}", job_id)
        self.wait_until(lambda: self.state(job_id) == "PENDING", f"requeue of job {job_id}", timeout)


def slurm_conf(root: Path, *, controller_port: int, node_ports: dict[str, int], munge_socket: Path) -> str:
    host = socket.gethostname()
    lines = [
        "ClusterName=dptrain-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={controller_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also sets how long SLURM holds a requeued job back (default 120 s): a job
        # started again sooner is refused by slurmd ("Job credential revoked").
        f"AuthInfo=socket={munge_socket},cred_expire=10",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd'}-%n.pid",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd'}-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        # Look at pending jobs every 5 s (default 60): a requeued job starts soon after its hold.
        "SchedulerParameters=sched_interval=5",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        # Finished jobs stay visible to `scontrol show job` (there is no accounting database).
        "MinJobAge=3600",
        "SlurmdParameters=config_overrides",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "KillWait=5",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for name, port in node_ports.items():
        lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} CPUs=2 State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def start_munged(root: Path) -> tuple[Daemon, Path]:
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge.socket"
    log = root / "munged.log"
    proc = subprocess.Popen(
        [program("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
         f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munged.seed'}", f"--log-file={log}"],
        stdout=subprocess.DEVNULL, stderr=open(root / "munged.err", "w"), start_new_session=True)
    daemon = Daemon("munged", proc, log)
    wait_for(lambda: sock.exists() or proc.poll() is not None, "munged", logs=(log, root / "munged.err"))
    if proc.poll() is not None:
        raise RuntimeError(f"munged exited with {proc.returncode}: {(root / 'munged.err').read_text()}")
    return daemon, sock


def start_slurm(root: Path, nodes: tuple[str, ...] = ("node1", "node2")) -> SlurmCluster:
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(root=root, conf=root / "slurm.conf", nodes=nodes, env={})
    try:
        munged, sock = start_munged(root)
        cluster.daemons.append(munged)
        cluster.conf.write_text(slurm_conf(root, controller_port=free_port(),
                                           node_ports={name: free_port() for name in nodes}, munge_socket=sock))
        cluster.env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
        for name, argv in [("slurmctld", [program("slurmctld"), "-D", "-i"])] + [
                (f"slurmd-{node}", [program("slurmd"), "-D", "-N", node]) for node in nodes]:
            log = root / f"{name}.out"
            proc = subprocess.Popen(argv, env=cluster.env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=root)
            cluster.daemons.append(Daemon(name, proc, log))

        def nodes_idle() -> bool:
            for daemon in cluster.daemons:
                if daemon.proc.poll() is not None:
                    raise RuntimeError(f"{daemon.name} exited with {daemon.proc.returncode}{cluster.logs()}")
            result = cluster.run(program("sinfo"), "--noheader", "--Node", "--format=%N %t")
            states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
            return result.returncode == 0 and all(states.get(node) == "idle" for node in nodes)

        wait_for(nodes_idle, "SLURM nodes " + ",".join(nodes), logs=tuple(d.log for d in cluster.daemons))
    except BaseException:
        stop_slurm(cluster)
        raise
    return cluster


def stop_slurm(cluster: SlurmCluster) -> None:
    # slurmd first: they end their job steps; munged last, everyone authenticates through it.
    for daemon in reversed(cluster.daemons):
        daemon.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    require(*SLURM_DAEMONS, "sinfo")
    cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    yield cluster
    stop_slurm(cluster)


# ---- udocker ---------------------------------------------------------------------------------

@dataclass
class UdockerContainer:
    """A udocker container set up offline, and the binds that give it this machine's Python and venv."""

    name: str
    directory: Path
    binds: tuple[str, ...]
    env: dict[str, str]
    dptrain: str  # how a rank runs dptrain inside: the venv's python, bound in


def runtime_dirs() -> list[str]:
    """Directories holding this Python, its venv, the project and every shared library torch maps."""
    probe = "import torch, numpy, sklearn; print(open('/proc/self/maps').read())"
    maps = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          timeout=120).stdout
    dirs = {sys.base_prefix, sys.prefix, str(REPO)}
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if path.startswith("/") and ".so" in path:
            dirs.add(os.path.dirname(path))
    # keep only the outermost directories
    kept: list[str] = []
    for path in sorted(dirs):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def build_rootfs(tarball: Path) -> None:
    """A tiny root filesystem: busybox as /bin/sh, /etc, and mount points laid out like Debian's."""
    busybox = shutil.which("busybox")
    with tarfile.open(tarball, "w:gz") as archive:
        def add_dir(name: str) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            archive.addfile(info)

        def add_link(name: str, target: str) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)

        def add_text(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))

        for name in ("usr", "usr/bin", "usr/lib", "usr/lib64", "etc", "tmp", "proc", "dev", "sys", "root", "home",
                     "work", "run"):
            add_dir(name)
        for name, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/bin"),
                             ("usr/lib64/ld-linux-x86-64.so.2", "../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")):
            add_link(name, target)
        archive.add(busybox, "usr/bin/busybox")
        for applet in ("sh", "ls", "cat", "env", "id", "true", "seq", "sleep"):
            add_link(f"usr/bin/{applet}", "busybox")
        add_text("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
        add_text("etc/group", "root:x:0:\nnogroup:x:65534:\n")


@pytest.fixture(scope="session")
def udocker_container(tmp_path_factory) -> UdockerContainer:
    """A container made by `dptrain container setup` from a tiny root filesystem, in a private UDOCKER_DIR."""
    require("proot", "busybox")
    if shutil.which("udocker") is None and not (Path(sys.executable).parent / "udocker").exists():
        pytest.skip("not installed on this machine: udocker (pip install udocker)")
    root = tmp_path_factory.mktemp("udocker")
    tarball = root / "rootfs.tar.gz"
    build_rootfs(tarball)
    env = {**os.environ, "UDOCKER_DIR": str(root / "repo"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    name = "dptrain-test"
    result = subprocess.run([sys.executable, "-m", "dptrain", "container", "setup", "--image", str(tarball),
                             "--name", name], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return UdockerContainer(name=name, directory=root / "repo", binds=tuple(runtime_dirs()), env=env,
                            dptrain=f"{sys.executable} -m dptrain")


# ---- what a run inside a container wrote ------------------------------------------------------

def assert_run_written(run_dir: Path, workers: int, epochs: int, *, config: bool = True) -> dict:
    """Every file a finished run writes, each whole, as the ranks wrote them from inside their containers:
    config.yaml (`dptrain train`'s; a user's script has none: config=False), metrics.jsonl and metrics.csv (one line an epoch), the last checkpoint (each
    rank's file, its checksum and the manifest), summary.json and model.pt (loadable). Returns the summary."""
    import csv
    import hashlib
    import json

    import torch

    assert (run_dir / "config.yaml").is_file() == config
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in records] == list(range(1, epochs + 1)), records
    with open(run_dir / "metrics.csv", newline="") as handle:
        assert [int(row["epoch"]) for row in csv.DictReader(handle)] == list(range(1, epochs + 1))
    last = run_dir / "checkpoints" / f"epoch-{epochs:06d}"
    manifest = json.loads((last / "checkpoint.json").read_text())
    assert manifest["members"] == list(range(workers)) and manifest["world_size"] == workers, manifest
    for rank in range(workers):
        data = (last / f"rank-{rank:05d}.pt").read_bytes()
        assert (last / f"rank-{rank:05d}.pt.sha256").read_text().split()[0] == hashlib.sha256(data).hexdigest()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workers"] == workers and summary["epochs"] == epochs, summary
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert state and all(torch.isfinite(value).all() for value in state.values() if value.is_floating_point())
    assert not list(run_dir.rglob("*.tmp")), list(run_dir.rglob("*.tmp"))  # no write left half-done
    return summary
