"""`dptrain container setup | recipe | check`: prepare a rootless container runtime for `dptrain launch --container`."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shlex
from pathlib import Path
from typing import Optional

import dptrain
from dptrain import registry
from dptrain.errors import UserError
from dptrain.io import atomic_write_bytes, make_dirs, write_text
from dptrain.cluster import apptainer, udocker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Prepare the container that 'dptrain launch --container' runs every rank in."
    actions = parser.add_subparsers(dest="container_action", metavar="ACTION")
    setup = actions.add_parser("setup", help="udocker: import an image, create the container, set it up offline",
                               allow_abbrev=False)
    setup.add_argument("--runtime", choices=["udocker"], default="udocker",
                       help="udocker (Apptainer needs no set-up: build the .sif with 'recipe')")
    setup.add_argument("--image", required=True, metavar="TARBALL",
                       help="a 'docker save' archive or a root-filesystem tarball")
    setup.add_argument("--name", required=True, help="container name, used as --container udocker:NAME")
    setup.add_argument("--nvidia", action="store_true", help="copy the host's NVIDIA driver libraries in (on a GPU node)")
    setup.add_argument("--execmode", default="auto", choices=["auto", *udocker.EXECMODES],
                       help="udocker execution mode: auto (default: the fastest that runs here of "
                            f"{', '.join(udocker.AUTO_MODES)}, each tried in turn), P1 (PRoot with seccomp), P2 "
                            "(PRoot), F1-F4 (Fakechroot), R1 (runc)")

    recipe = actions.add_parser("recipe", help="write a Dockerfile, its .dockerignore and an Apptainer definition for dptrain",
                                allow_abbrev=False)
    recipe.description = ("Write a Dockerfile, an ignore file for its build context and an Apptainer definition that "
                          "install dptrain from its source tree (the checkout this is run in, or the one dptrain runs "
                          "from), or from a wheel with --wheel; print the commands that build them.")
    recipe.add_argument("--out", default=".", help="directory for Dockerfile and dptrain.def (default: .)")
    recipe.add_argument("--base", default=udocker.DEFAULT_BASE, help=f"base image (default: {udocker.DEFAULT_BASE})")
    recipe.add_argument("--torch", default=installed_torch(),
                        help="PyTorch requirement to install (default: the version installed here without its local "
                             f"suffix such as +cpu, {installed_torch()}; 'torch', the newest, where none is)")
    recipe.add_argument("--torch-index-url", default=None, metavar="URL",
                        help="pip index to install torch from, e.g. https://download.pytorch.org/whl/cu124 for "
                             "PyTorch's CUDA 12.4 builds, or a site's mirror (default: PyPI)")
    recipe.add_argument("--wheel", default=None, metavar="PATH",
                        help="install dptrain from this wheel (copied into --out, the build context) instead of a "
                             "source tree")
    recipe.add_argument("--force", action="store_true", help="overwrite files already in --out")

    check = actions.add_parser("check", help="check that a container runs dptrain", allow_abbrev=False)
    check.add_argument("--runtime", choices=registry.names("container runtime"), default="udocker",
                       help=f"{', '.join(registry.names('container runtime'))} (default: udocker)")
    check.add_argument("--name", required=True, metavar="NAME_OR_IMAGE", help="udocker container, or the image (a .sif, an image directory, a podman image)")
    check.add_argument("--dptrain", default="dptrain", metavar="COMMAND",
                       help="how dptrain is run inside (default: dptrain)")
    check.add_argument("--bind", action="append", default=[], metavar="PATH[:DEST]", help="path to bind in (repeatable)")


def installed_torch() -> str:
    """`torch==VERSION` of the PyTorch installed here, less its local suffix (2.13.0+cpu is 2.13.0, which
    pip finds for the image's platform), so the image trains with the torch the recipe was written under;
    `torch` when none is installed."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "torch"
    return f"torch=={version.split('+')[0]}"


def main(args: argparse.Namespace) -> int:
    if args.container_action == "setup":
        udocker.setup(Path(args.image), args.name, nvidia=args.nvidia, execmode=args.execmode)
        print(f"dptrain: container {args.name} is ready; use {shlex.join(['dptrain', 'launch', '--container', f'udocker:{args.name}'])} ...")
        return 0
    if args.container_action == "recipe":
        return recipe(Path(args.out), base=args.base, torch=args.torch, torch_index_url=args.torch_index_url,
                      wheel=Path(args.wheel) if args.wheel else None, force=args.force)
    if args.container_action == "check":
        command = [*shlex.split(args.dptrain), "--version"]
        results = registry.load("container runtime", args.runtime).check(args.name, command, binds=args.bind)
        for what, ok, detail in results:
            print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
        return 0 if all(ok for _, ok, _ in results) else 1
    raise UserError("dptrain container needs an action: setup, recipe or check")


def is_source_tree(path: Path) -> bool:
    """Whether `path` is a dptrain checkout: its pyproject.toml names dptrain and src/dptrain is there."""
    try:
        pyproject = (path / "pyproject.toml").read_text()
    except OSError:
        return False
    return (path / "src" / "dptrain" / "__init__.py").is_file() and bool(
        re.search(r'^name\s*=\s*"dptrain"\s*$', pyproject, re.M))


def source_tree(cwd: Path) -> Optional[Path]:
    """The dptrain source tree to build from: the working directory if it is one, else the checkout
    this dptrain runs from (an editable install, PYTHONPATH=src); None for an installed package."""
    running = Path(dptrain.__file__).resolve().parents[2]
    return next((path for path in (cwd, running) if is_source_tree(path)), None)


def _shown(path: Path, base: Path) -> str:
    """`path` relative to `base` when inside it ('.' for base itself), else absolute."""
    relative = os.path.relpath(path, base)
    return str(path) if relative == ".." or relative.startswith(".." + os.sep) else relative


def check_index_url(url: Optional[str]) -> None:
    """--torch-index-url must be a URL pip takes as an index, and one the recipe can quote as it is."""
    if url is not None and not re.fullmatch(r"(https?|file)://[^\s\"'\\$`]+", url):
        raise UserError(f"--torch-index-url {url!r} is not a pip index URL; give one such as "
                        "https://download.pytorch.org/whl/cu124 (http, https or file; no spaces, quotes, $ or `)")


def recipe(out: Path, *, base: str, torch: str, wheel: Optional[Path], force: bool,
           torch_index_url: Optional[str] = None) -> int:
    """`dptrain container recipe`: write OUT/Dockerfile, its ignore file and OUT/dptrain.def; refuse
    to overwrite any file already there unless `force`. The build context is the dptrain source tree,
    or OUT itself with `wheel` (copied into OUT). The Dockerfile's ignore file is OUT/.dockerignore
    when OUT is the build context, else OUT/Dockerfile.dockerignore, the name BuildKit (Docker's
    builder since 23.0) looks for beside a Dockerfile that lies outside the context's root."""
    check_index_url(torch_index_url)
    cwd = Path.cwd().resolve()
    out_dir = (cwd / out).resolve()
    wheel_name = None
    if wheel is not None:
        if not wheel.is_file() or not re.fullmatch(r"dptrain-[^-]+-.+\.whl", wheel.name):
            raise UserError(f"--wheel '{wheel}' is not a dptrain wheel file (dptrain-VERSION-...whl); build one in the "
                            "source tree with 'python -m pip wheel --no-deps -w dist .'")
        wheel_name = wheel.name
        context = out_dir
    else:
        context = source_tree(cwd)
        if context is None:
            raise UserError("the image is built from the dptrain source tree, and there is none here: dptrain runs as "
                            "an installed package; run this in a dptrain checkout, or give --wheel PATH")
    ignore_name = ".dockerignore" if out_dir == context else "Dockerfile.dockerignore"
    docker_build = f"docker build -t dptrain -f {shlex.quote(_shown(out_dir / 'Dockerfile', context))} ."
    apptainer_build = f"apptainer build dptrain.sif {shlex.quote(_shown(out_dir / 'dptrain.def', context))}"
    files = {
        "Dockerfile": udocker.dockerfile(base, torch, wheel=wheel_name, build=docker_build, ignore_file=ignore_name,
                                         torch_index_url=torch_index_url),
        ignore_name: udocker.dockerignore(wheel_name),
        "dptrain.def": apptainer.definition(base, torch, wheel=wheel_name, build=apptainer_build,
                                            torch_index_url=torch_index_url),
    }
    copy_wheel = wheel is not None and wheel.resolve() != out_dir / wheel.name
    present = [name for name in (*files, *([wheel_name] if copy_wheel else [])) if (out_dir / name).exists()]
    if present and not force:
        raise UserError(f"{_shown(out_dir / present[0], cwd)} is already there; dptrain container recipe overwrites "
                        "nothing: choose another --out, or add --force to replace "
                        f"{'it' if len(present) == 1 else ', '.join(present)}")
    make_dirs(out_dir)
    for name, text in files.items():
        write_text(out_dir / name, text)
    if copy_wheel:
        atomic_write_bytes(out_dir / wheel.name, wheel.read_bytes())
    written = [*files, *([wheel_name] if copy_wheel else [])]
    where = "the dptrain source tree" if wheel is None else f"{_shown(out_dir, cwd)}, which holds {wheel_name}"
    print(f"dptrain: wrote {', '.join(_shown(out_dir / name, cwd) for name in written)}; the build context is "
          f"{where}. Build there:")
    if context != cwd:
        print(f"  cd {shlex.quote(str(context))}")
    print(f"  {docker_build} && docker save dptrain -o dptrain.tar")
    print(f"  {apptainer_build}")
    print("then, on the cluster: dptrain container setup --runtime udocker --image dptrain.tar --name dptrain")
    return 0
