"""`dptrain container setup | recipe | check`: prepare a rootless container runtime for `dptrain launch --container`."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from dptrain import registry
from dptrain.errors import UserError
from dptrain.launch import apptainer, udocker


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
    setup.add_argument("--execmode", default="P1", choices=["P1", "P2"],
                       help="udocker execution mode: P1 (PRoot with seccomp, default) or P2 (PRoot)")

    recipe = actions.add_parser("recipe", help="write a Dockerfile and an Apptainer definition for dptrain",
                                allow_abbrev=False)
    recipe.add_argument("--out", default=".", help="directory for Dockerfile and dptrain.def (default: .)")
    recipe.add_argument("--base", default=udocker.DEFAULT_BASE, help=f"base image (default: {udocker.DEFAULT_BASE})")
    recipe.add_argument("--torch", default="torch", help="PyTorch requirement to install (default: torch)")

    check = actions.add_parser("check", help="check that a container runs dptrain", allow_abbrev=False)
    check.add_argument("--runtime", choices=registry.names("container runtime"), default="udocker",
                       help=f"{', '.join(registry.names('container runtime'))} (default: udocker)")
    check.add_argument("--name", required=True, metavar="NAME_OR_IMAGE", help="udocker container or .sif image")
    check.add_argument("--dptrain", default="dptrain", metavar="COMMAND",
                       help="how dptrain is run inside (default: dptrain)")
    check.add_argument("--bind", action="append", default=[], metavar="PATH[:DEST]", help="path to bind in (repeatable)")


def main(args: argparse.Namespace) -> int:
    if args.container_action == "setup":
        udocker.setup(Path(args.image), args.name, nvidia=args.nvidia, execmode=args.execmode)
        print(f"dptrain: container {args.name} is ready; use 'dptrain launch --container udocker:{args.name} ...'")
        return 0
    if args.container_action == "recipe":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "Dockerfile").write_text(udocker.dockerfile(args.base, args.torch))
        (out / "dptrain.def").write_text(apptainer.definition(args.base, args.torch))
        print(f"dptrain: wrote {out / 'Dockerfile'} and {out / 'dptrain.def'}; build them from the project directory:")
        print(f"  docker build -t dptrain -f {out / 'Dockerfile'} . && docker save dptrain -o dptrain.tar")
        print(f"  apptainer build dptrain.sif {out / 'dptrain.def'}")
        return 0
    if args.container_action == "check":
        command = [*shlex.split(args.dptrain), "--version"]
        results = registry.load("container runtime", args.runtime).check(args.name, command, binds=args.bind)
        for what, ok, detail in results:
            print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
        return 0 if all(ok for _, ok, _ in results) else 1
    raise UserError("dptrain container needs an action: setup, recipe or check")
