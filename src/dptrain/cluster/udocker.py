"""udocker: rootless containers from a Docker image or a root-filesystem tarball, run through PRoot.

Rendering (pure): the run command of one rank, the udocker configuration, the PRoot wrapper
and a Dockerfile for the image. Set-up and checks (processes) are at the bottom.

Offline by design: udocker's engine download at first run ("autoinstall") is switched off in
its configuration file, and it runs the system's proot through a wrapper. The configuration
is passed with --config on every call, because udocker reads `$UDOCKER_DIR/udocker.conf`
only for its default directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

from dptrain.errors import UserError
from dptrain.cluster.spec import JobSpec, bind_paths, quote, train_command

CONFIG_NAME = "udocker.conf"
WRAPPER_NAME = "proot-no-kernel"
DEFAULT_BASE = "python:3.11-slim"
IMAGE = "NAME"  # what follows "udocker:" in --container


def running_inside(env: Mapping[str, str]) -> bool:
    """udocker marks the processes it starts with container_* variables."""
    return "container_uuid" in env and "container_execmode" in env


# ---- rendering -------------------------------------------------------------------------------

def preamble(spec: JobSpec) -> list[str]:
    gpu = (["# GPUs: the container holds the host's NVIDIA libraries once 'dptrain container setup --nvidia' has run",
            "# on a GPU node; udocker run has no flag for them."] if spec.gpus_per_node > 0 else [])
    return [
        "# udocker: the repository is $UDOCKER_DIR (default ~/.udocker); its configuration keeps it",
        "# offline. As root udocker needs --allow-root; a normal user needs nothing.",
        *gpu,
        'udocker=(udocker "--config=${UDOCKER_DIR:-$HOME/.udocker}/' + CONFIG_NAME + '")',
        'if [ "$(id -u)" = 0 ]; then udocker+=(--allow-root); fi',
    ]


def wrap(spec: JobSpec) -> str:
    """One rank: the host's environment (ranks, rendezvous) passes in with --hostenv.

    The host's /etc/hosts goes in too: images carry none (Docker writes it at run time), and
    without it gloo and NCCL cannot resolve this node's name to an address.
    """
    binds = " ".join(f"-v {quote([path])}" for path in ["/etc/hosts", *bind_paths(spec)])
    return (f'"${{udocker[@]}}" run --nobanner --hostenv {binds} -w {quote([spec.workdir])} '
            f"{quote([spec.container.image])} {quote(train_command(spec))}")


def config_text(proot: Optional[str]) -> str:
    """udocker.conf: no engine download ever; the given proot executable when there is one."""
    lines = [
        "# Written by dptrain container setup.",
        "[DEFAULT]",
        # Empty, not False: udocker keeps the file's string, and any non-empty string is true.
        "autoinstall =",
    ]
    if proot:
        lines.append(f"use_proot_executable = {proot}")
    return "\n".join(lines) + "\n"


def proot_wrapper(real_proot: str) -> str:
    """The proot udocker runs: the system's, without `-k RELEASE` (Debian's proot 5.1 fails with it on recent
    kernels), and with PROOT_DONT_POLLUTE_ROOTFS set.

    Without that variable PRoot makes each bind's destination (and its missing parents, such as /tmp/x/run
    for a run directory /tmp/x/run) inside the container's root filesystem, and deletes what it made when it
    exits. Every rank on a node, and on a shared $HOME every rank of the job, runs the same container
    directory: when the rank whose PRoot made them ends first, the others' paths under that bind vanish
    (ENOENT), and rank 0 could not write summary.json or model.pt at the end of a finished run. With it, each
    PRoot keeps those directories in a private one of its own under /tmp and the image is never changed.
    """
    return f"""#!/bin/sh
# Written by dptrain container setup: runs {real_proot} without udocker's -k (kernel release)
# option, which makes this proot fail on recent kernels; the container sees the real release.
# PROOT_DONT_POLLUTE_ROOTFS: each proot makes the binds' destinations in a private directory, not in the
# container's root filesystem, which every rank shares and the first proot to exit would empty of them.
export PROOT_DONT_POLLUTE_ROOTFS=1
skip=0
for arg in "$@"; do
    shift
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$arg" in
        -k) skip=1; continue ;;
        -k*|--kernel-release=*) continue ;;
    esac
    set -- "$@" "$arg"
done
exec {real_proot} "$@"
"""


# What `pip install` needs of the dptrain source tree; the recipe copies nothing else from it.
SOURCE_FILES = ("pyproject.toml", "README.md", "src")


def torch_install(torch: str, index_url: Optional[str] = None) -> str:
    """pip's arguments installing `torch`: from `index_url` when given (PyTorch's CUDA builds, e.g.
    https://download.pytorch.org/whl/cu124, or a site's mirror), else from PyPI."""
    return f'"{torch}"' + (f' --index-url "{index_url}"' if index_url else "")


def dockerfile(base: str = DEFAULT_BASE, torch: str = "torch", *, wheel: Optional[str] = None,
               build: str = "docker build -t dptrain .", ignore_file: str = ".dockerignore",
               torch_index_url: Optional[str] = None) -> str:
    """A Dockerfile installing dptrain from the source tree (the build context) or, with `wheel`
    (a file name in the build context), from that wheel. `build` is the command its header shows,
    run in the build context; `ignore_file` names the ignore file written beside it; torch comes from
    `torch_index_url` when given (`torch_install`)."""
    pip_torch = torch_install(torch, torch_index_url)
    if wheel:
        context = (f"# The build context is the directory holding this file and {wheel}, all it copies\n"
                   "# (no dptrain source tree is needed). In that directory, on a machine with Docker:")
        install = f"COPY {wheel} /opt/dptrain/\nRUN python -m pip install {pip_torch} && python -m pip install /opt/dptrain/{wheel}"
        ignored = f"# {ignore_file}, beside this file, keeps anything else put in this directory out of the build context."
    else:
        context = ("# The build context is the dptrain source tree: only pyproject.toml, README.md and src/ are\n"
                   "# copied from it (with dptrain installed but no source tree, rerun the recipe with --wheel).\n"
                   "# In the source tree, on a machine with Docker:")
        install = ("COPY pyproject.toml README.md /opt/dptrain/\nCOPY src /opt/dptrain/src\n"
                   f"RUN python -m pip install {pip_torch} && python -m pip install /opt/dptrain")
        ignored = f"# {ignore_file}, beside this file, keeps .venv, runs/, .git and caches out of the build context"
        ignored += (".\n# BuildKit (Docker's builder since 23.0) reads it there; an older builder reads only a\n"
                    "# .dockerignore at the root of the source tree." if ignore_file != ".dockerignore" else ".")
    return f"""# An image holding dptrain and its dependencies, for udocker (or Docker, Podman).
{context}
#   {build} && docker save dptrain -o dptrain.tar
# then copy dptrain.tar to the cluster and there:
#   dptrain container setup --runtime udocker --image dptrain.tar --name dptrain [--nvidia]
{ignored}
# MPI and the scheduler stay on the host: srun or mpirun starts one container per rank, and
# ranks meet over torch.distributed (gloo, NCCL), so no MPI library is needed in here.
FROM {base}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
{install}
# Your own packages (what your --data and --model files or your script import) go here, pinned, e.g.
# RUN python -m pip install scikit-learn==1.6.1
WORKDIR /work
CMD ["dptrain", "info"]
"""


def dockerignore(wheel: Optional[str] = None) -> str:
    """The ignore file of the build context: everything but what the Dockerfile copies."""
    keep = [wheel] if wheel else list(SOURCE_FILES)
    return ("# Written by 'dptrain container recipe'. The image needs only the files named with '!';\n"
            "# everything else stays out of the build context: .venv, runs/ (checkpoints), data, .git,\n"
            "# .pytest_cache, build/, dist/, image tarballs.\n"
            "*\n" + "".join(f"!{name}\n" for name in keep)
            + "**/__pycache__\n**/*.pyc\n**/*.egg-info\n")


# ---- set-up and checks (processes) -----------------------------------------------------------

def udocker_dir(env: Mapping[str, str] = os.environ) -> Path:
    return Path(env.get("UDOCKER_DIR") or Path.home() / ".udocker")


def executable() -> str:
    found = shutil.which("udocker") or shutil.which("udocker", path=str(Path(sys.executable).parent))
    if not found:
        raise UserError("udocker is not installed; install it as a normal user with 'pip install udocker'")
    return found


def base_argv(directory: Path) -> list[str]:
    argv = [executable(), f"--config={directory / CONFIG_NAME}"]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    return argv


def run_udocker(directory: Path, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "UDOCKER_DIR": str(directory)}
    argv = [*base_argv(directory), *args]
    try:
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(f"'udocker {' '.join(args)}' did not finish within {timeout:g} s") from None
    if check and result.returncode != 0:
        raise UserError(f"'udocker {' '.join(args)}' failed (exit {result.returncode}): "
                        f"{_last_error(result.stdout + result.stderr)}")
    return result


def _last_error(text: str) -> str:
    # udocker's runc mode prints its Popen object as it ends ("<Popen: returncode: ...>"), not a message.
    lines = [line.strip() for line in text.splitlines()
             if line.strip() and "autoinstall disabled" not in line and not line.startswith("<Popen")]
    errors = [line for line in lines if line.lower().startswith("error")]
    return (errors or lines or ["no output"])[-1]


def write_config(directory: Path, proot: Optional[str] = None) -> Path:
    """Write udocker.conf (and the proot wrapper) into the udocker directory; returns the config."""
    directory.mkdir(parents=True, exist_ok=True)
    real_proot = proot or shutil.which("proot")
    wrapper = None
    if real_proot:
        wrapper = directory / "bin" / WRAPPER_NAME
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(proot_wrapper(real_proot))
        wrapper.chmod(0o755)
    config = directory / CONFIG_NAME
    config.write_text(config_text(str(wrapper) if wrapper else None))
    return config


def is_docker_archive(tarball: Path) -> bool:
    """`docker save` archives carry manifest.json; anything else is taken as a root filesystem."""
    try:
        with tarfile.open(tarball) as archive:
            for member in archive:
                if member.name.lstrip("./") in ("manifest.json", "repositories"):
                    return True
    except tarfile.TarError as exc:
        raise UserError(f"--image {tarball} is not a tar archive: {exc}") from None
    return False


def container_exists(directory: Path, name: str) -> bool:
    return run_udocker(directory, "inspect", "-p", name, check=False, timeout=60).returncode == 0


# udocker's execution modes that `dptrain container setup --execmode` takes: PRoot (P1 with seccomp, P2 tracing
# every system call), Fakechroot (F1-F4) and runc/crun (R1).
EXECMODES = ("P1", "P2", "F1", "F2", "F3", "F4", "R1")
# What --execmode auto tries, fastest first as measured (benchmarks/README.md, section 24). R1 is left out:
# udocker 1.3's runc mode exits 1 whatever the command's exit when its output is no terminal (a job's never
# is), and writes the runc spec, the rank's environment in it, into the container's one directory at each
# start, so two ranks starting together on one container can run with each other's RANK. F1-F4 need
# udocker's own libfakechroot, which its offline set-up never downloads (Debian's has no path mapping).
AUTO_MODES = ("P1", "P2")
PROBE = ("true",)  # what a mode must run to be chosen


def choose_mode(directory: Path, name: str, modes: Sequence[str], log=print) -> str:
    """Set container NAME to the first of `modes` that sets up and runs PROBE; one line for each that cannot."""
    reasons = []
    for mode in modes:
        # --force: a mode tried before (F1 sets up, then cannot run) leaves links that only a forced set-up undoes.
        result = run_udocker(directory, "setup", f"--execmode={mode}", "--force", name, check=False, timeout=300)
        if result.returncode != 0:
            reasons.append(f"{mode}: {_last_error(result.stdout + result.stderr)}")
        else:
            result = run_udocker(directory, "run", "--nobanner", name, *PROBE, check=False, timeout=120)
            if result.returncode == 0:
                return mode
            said = _last_error(result.stdout + result.stderr)
            reasons.append(f"{mode}: '{' '.join(PROBE)}' inside it exited {result.returncode}"
                           + ("" if said == "no output" else f": {said}"))
        if mode != modes[-1]:
            log(f"dptrain: udocker execution mode {mode} cannot run here ({reasons[-1].split(': ', 1)[1]}); "
                f"trying {modes[modes.index(mode) + 1]}")
    if len(modes) == 1:
        raise UserError(f"--execmode {modes[0]} cannot run container {name} here: {reasons[0].split(': ', 1)[1]}; "
                        f"--execmode auto tries {', '.join(AUTO_MODES)} in turn")
    raise UserError(f"container {name} runs in none of the udocker execution modes {', '.join(modes)} here: "
                    + "; ".join(reasons))


def setup(tarball: Path, name: str, *, nvidia: bool = False, directory: Optional[Path] = None,
          execmode: str = "auto", log=print) -> Path:
    """Import the image, create container NAME, set its execution mode (auto: the fastest of AUTO_MODES that
    runs here) and (with nvidia) copy the host's GPU libraries into it."""
    directory = directory or udocker_dir()
    if not tarball.is_file():
        raise UserError(f"--image {tarball} does not exist; give a 'docker save' archive or a root-filesystem tarball")
    config = write_config(directory)
    log(f"udocker directory {directory}, configuration {config} (offline, system proot)")
    if container_exists(directory, name):
        log(f"container {name} exists already; kept")
    else:
        image = f"{name.lower()}:latest"
        if is_docker_archive(tarball):
            # udocker load prints the repositories it loaded, one a line.
            loaded = run_udocker(directory, "load", "-i", str(tarball), name.lower()).stdout.splitlines()
            repos = [line.strip() for line in loaded if ":" in line and not line.startswith(("Info", "Warning"))]
            image = repos[-1] if repos else image
        else:
            run_udocker(directory, "import", str(tarball), image)
        run_udocker(directory, "create", f"--name={name}", image)
        log(f"created container {name} from {image}")
    mode = choose_mode(directory, name, AUTO_MODES if execmode == "auto" else (execmode,), log)
    log(f"udocker execution mode {mode}" + (" (the fastest that runs here)" if execmode == "auto" else ""))
    if nvidia:
        run_udocker(directory, "setup", "--nvidia", "--force", name)
        log(f"copied the host's NVIDIA libraries into {name}")
    return directory


def image_root(name: str) -> Optional[Path]:
    """Container NAME's root filesystem (udocker inspect -p), None where udocker or the container is not here."""
    try:
        result = run_udocker(udocker_dir(), "inspect", "-p", name, check=False, timeout=60)
    except UserError:
        return None
    lines = result.stdout.split()
    return Path(lines[-1]) if result.returncode == 0 and lines and Path(lines[-1]).is_dir() else None


def check(name: str, command: Sequence[str], *, directory: Optional[Path] = None,
          binds: Sequence[str] = ()) -> list[tuple[str, bool, str]]:
    """(what, ok, detail) for: configuration offline, proot found, container present, command runs inside."""
    directory = directory or udocker_dir()
    results = []
    config = directory / CONFIG_NAME
    text = config.read_text() if config.exists() else ""
    offline = any(line.replace(" ", "") == "autoinstall=" for line in text.splitlines())
    results.append(("configuration offline", offline, str(config) if offline else
                     f"{config} does not switch autoinstall off; run 'dptrain container setup'"))
    proot_lines = [line.split("=", 1)[1].strip() for line in text.splitlines() if line.startswith("use_proot_executable")]
    proot_ok = bool(proot_lines) and os.access(proot_lines[0], os.X_OK)
    results.append(("proot", proot_ok, proot_lines[0] if proot_lines else "none configured; install proot"))
    exists = container_exists(directory, name)
    results.append((f"container {name}", exists, "present" if exists else "missing; run 'dptrain container setup'"))
    if exists:
        volumes = [arg for path in binds for arg in ("-v", path)]
        result = run_udocker(directory, "run", "--nobanner", "--hostenv", *volumes, name, *command,
                             check=False, timeout=300)
        output = _last_error(result.stdout + result.stderr)
        results.append((f"runs {' '.join(command)}", result.returncode == 0, output))
    return results
