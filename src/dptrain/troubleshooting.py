"""The troubleshooting catalogue: what a user sees when something goes wrong, why, and what to do.

The documentation's troubleshooting page is generated from `PROBLEMS` (docs/hooks.py renders it
with `render_markdown`), and tests/test_troubleshooting.py checks every entry against the code:
an entry with a `case` is matched against the error line that case of tests/test_bad_inputs.py
really prints, and every `source` fragment must occur in src/dptrain. So a message that changes
in the code fails a test until its entry here is changed too, and the page cannot drift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Sections of the page, in order: the key of each Problem's `area` and its heading.
AREAS = {
    "config": "Settings (flags and YAML)",
    "data": "Data",
    "model": "Models",
    "rundir": "Run directories and checkpoints",
    "run": "While it trains",
    "launch": "Launching on a cluster",
    "container": "Containers",
}
PLACEHOLDER = re.compile(r"\{[a-z_ ]+\}")


@dataclass(frozen=True)
class Problem:
    """One entry of the catalogue.

    `message` is what is printed, verbatim but for the parts in braces ({value}, {path}), which
    stand for whatever varies; an entry that is a symptom rather than a line dptrain prints has
    `symptom=True` and describes it in words. `case` names the case of tests/test_bad_inputs.py
    whose error line `message` must match; `source` lists fragments of the message (or of the
    code that handles the symptom) exactly as they are written in src/dptrain."""

    area: str
    title: str
    message: str
    cause: str
    fix: str
    case: str = ""
    source: tuple[str, ...] = ()
    symptom: bool = False

    def shown(self) -> str:
        """`message` as the page shows it: {rest} as "…", other placeholders in capitals ({path} as PATH)."""
        return PLACEHOLDER.sub(lambda m: "…" if m.group(0) == "{rest}" else m.group(0)[1:-1].upper().replace(" ", "_"),
                               self.message)

    def pattern(self) -> re.Pattern[str]:
        """A regular expression matching every line `message` stands for (braces match anything)."""
        parts = PLACEHOLDER.split(self.message)
        return re.compile(".*?".join(re.escape(part) for part in parts), re.S)


PROBLEMS: tuple[Problem, ...] = (
    # ---------------------------------------------------------------- settings
    Problem("config", "An unknown key in a YAML config",
            "dptrain: error: unknown key '{key}' in '{file}'; did you mean '{close}'?",
            "the config file spells a setting that does not exist (keys are the flags without `--`, with `_` "
            "for `-`)", "rename the key as suggested; `dptrain train --help` lists every key",
            case="config-yaml-unknown-key"),
    Problem("config", "A value of the wrong type",
            "dptrain: error: --lr must be a number (got '{value}')",
            "a flag or key got a value that is not of its type", "give a value of the type named",
            case="config-flag-wrong-type"),
    Problem("config", "A number out of range",
            "dptrain: error: --epochs must be at least 1 (got {value})",
            "counts such as --epochs and --workers must be at least 1", "give a positive number",
            case="config-negative-epochs"),
    Problem("config", "An unknown flag",
            "dptrain: error: unknown option {flag} for 'dptrain train'; did you mean {close}?",
            "the flag does not exist (a typo, or a flag of another tool)",
            "use the flag suggested; `dptrain train --help` lists them all", case="config-unknown-flag"),
    Problem("config", "A batch larger than a worker's shard",
            "dptrain: error: --batch-size {size} is larger than a worker's shard of {n} samples{rest}",
            "each of the W workers sees about 1/W of the training set, and one batch must fit in it",
            "lower --batch-size or --workers, or use more data", case="config-batch-larger-than-shard"),
    Problem("config", "A config file that is not YAML",
            "dptrain: error: config file '{file}' is not valid YAML at line {line}, column {column}: {why}",
            "the file passed to --config does not parse", "fix the YAML at the line named",
            case="config-yaml-invalid-syntax"),
    # ---------------------------------------------------------------- data
    Problem("data", "A data file that does not exist",
            "dptrain: error: --data '{path}' does not exist{rest}",
            "the path is wrong, or relative to another directory than the one you run in",
            "give the path from the current directory, or an absolute one", case="data-missing-file"),
    Problem("data", "Arrays with other names than x and y",
            "dptrain: error: {file} has no array 'x'{rest}",
            "files are read by the names `x`, `y` (and optional `x_test`, `y_test`)",
            "save the arrays under those names, or load them yourself with a `--data module:factory`",
            case="data-wrong-keys"),
    Problem("data", "NaN or infinite values in the data",
            "dptrain: error: array 'x' in '{file}' has {n} NaN or infinite values; remove or replace them.",
            "the data holds values no model can train on", "clean or drop those rows before training",
            case="data-nan"),
    Problem("data", "A label outside the classes",
            "dptrain: error: {where}class label 7{rest}",
            "labels must be 0 .. C−1, and test labels cannot name a class the training set lacks",
            "remap the labels to 0 .. C−1", case="data-test-label-out-of-range"),
    Problem("data", "Fewer samples than workers",
            "dptrain: error: {what} has 2 samples, fewer than the 3 workers{rest}",
            "every worker needs at least one sample", "use fewer --workers or more data",
            case="data-fewer-samples-than-workers"),
    Problem("data", "Float labels read as a regression",
            "dptrain: y is float32: treating this as regression (loss mse unless --loss names one); {rest}",
            "float labels are taken for regression targets, a common slip when the classes were saved as floats",
            "save the labels as integers, or give `--task classify` (or `--task regress` to silence the line)",
            source=("treating this as regression (loss mse unless --loss names one)",)),
    # ---------------------------------------------------------------- models
    Problem("config", "A shard size that does not divide the ranks",
            "dptrain: error: invalid settings in the command line: --shard-size {size} does not divide the {world} ranks into replica groups; valid "
            "sizes: {sizes}",
            "--shard hybrid makes replica groups of --shard-size ranks each, and every rank must be in one",
            "give one of the sizes named (or --shard full: all ranks one group)",
            source=("does not divide the", "ranks into replica groups; valid")),
    Problem("config", "A setting sharding does not run with",
            "dptrain: error: invalid settings in the command line: --shard {mode} is refused with {setting}: {what runs}",
            "sharding (--shard full or hybrid) runs with allreduce and sync only, without live membership "
            "(a lost rank loses its group's shard), --monitor, --amp fp16 or --nnodes",
            "drop the setting named, or --shard none", source=("is refused with", "--shard full/hybrid runs with")),
    Problem("model", "A shard unit the model has no module of",
            "dptrain: error: --shard-unit {class} names no module of the model; its module classes are: {classes}",
            "--shard-unit names the class of the modules sharded one by one (a transformer's layer class, say)",
            "give one of the classes named, or leave --shard-unit out (each child holding 5 % of the parameters)",
            source=("names no module of the model; its module classes are",)),
    Problem("model", "A model module that cannot be imported",
            "dptrain: error: cannot import module '{module}'{rest}",
            "the module of `--model package.module:factory` is not on the Python path",
            "run from the directory that holds it, set PYTHONPATH, or name the file: `--model ./mymodels.py:make_net`",
            case="model-module-not-found"),
    Problem("model", "A model file that does not exist",
            "dptrain: error: --model {spec}: the file '{path}' does not exist; give the path of a Python file "
            "(relative to {directory}) or package.module:function",
            "the file of `--model path/to/file.py:factory` is not where the path says",
            "give the path from the current directory", case="model-file-missing"),
    Problem("model", "A model whose output does not fit the data",
            "dptrain: error: model output shape {shape} does not match the data: expected {expected} for {n} outputs; "
            "the data was read as {task}; if its labels are {other}, give --task {choice}",
            "the model returns another number of outputs than the data has classes (or targets), or the labels "
            "were read as the other task (float labels: regression; integer labels: classes)",
            "take `num_outputs` in your factory's signature and size the last layer with it, or give `--task` "
            "as the line says",
            case="model-output-shape-mismatch"),
    Problem("model", "An image model on flat samples",
            "dptrain: error: model 'cnn' {rest}",
            "`cnn`, `resnet` and `nfnet` need images (C, H, W); the data's samples are vectors",
            "use `--model mlp`, or data of images", case="model-image-model-on-flat-samples"),
    # ---------------------------------------------------------------- run directory
    Problem("rundir", "An --out that holds other files",
            "dptrain: error: --out '{path}' holds files that are not a dptrain run ({files}); give --out a new or "
            "empty directory",
            "a run never writes into a directory it did not make, so your files cannot be overwritten",
            "give --out a new or empty directory", case="rundir-holds-other-files"),
    Problem("rundir", "A finished run", "dptrain: error: run directory '{path}' holds a finished run{rest}",
            "the run directory has a summary.json: a finished run is never touched",
            "give --out a new directory", source=("holds a finished run",)),
    Problem("rundir", "A run directory in use",
            "dptrain: error: run directory '{path}' is in use by another dptrain run ({holder}); wait for it to end "
            "or give --out another directory",
            "one run per run directory: another run holds its lock (`dptrain.lock`, which names the holder)",
            "wait for that run to end, or give --out another directory; a lock left by a killed run is taken over "
            "by the next run with one line saying so",
            source=("is in use by another dptrain run", "taking over run directory")),
    Problem("rundir", "A full disk",
            "dptrain: error: cannot write '{path}': no space left on device; free space {rest}",
            "the disk or quota is full (the line names which)",
            "free space (or give --out a directory on another disk) and run the same command again: it continues "
            "from the last complete checkpoint", source=("cannot write '", "no space left on device", "free space")),
    Problem("rundir", "A read-only --out",
            "dptrain: error: cannot {write} '{path}': read-only file system, the directory '{directory}' is not "
            "writable; give --out a writable directory",
            "the directory is on a read-only file system, or its permissions forbid this user to write (the line "
            "names the cause: permission denied, operation not permitted)",
            "give --out a directory you can write to; a run stopped so continues there from its last complete "
            "checkpoint once that directory is writable again",
            source=("read-only file system", "is not writable; give --out a writable directory")),
    Problem("rundir", "A checkpoint of another model",
            "dptrain: error: checkpoint {path} does not fit this model{rest}",
            "the run directory's checkpoints were written by another model or settings",
            "give --out a new directory, or the settings of the run being continued",
            source=("does not fit this model",)),
    # ---------------------------------------------------------------- while it trains
    Problem("run", "A worker died",
            "dptrain: worker rank {rank} was killed by {signal}; stopping the other workers",
            "a worker process ended (often out of memory: the kernel's OOM killer sends SIGKILL)",
            "look at that rank's last lines; with `--max-restarts R` the run restarts from its last checkpoint",
            source=("was killed by", "stopping")),
    Problem("run", "A worker froze",
            "rank {rank}: {what} failed after {seconds} s (timeout {timeout} s): rank {peer} stopped responding "
            "(no heartbeat for {n} s){rest}",
            "a peer stopped taking part (stopped, swapped out, stuck in I/O); heartbeats in the rendezvous store "
            "name it", "find out what that rank was doing; lower --timeout to fail sooner while testing",
            source=("failed after", "stopped responding (no heartbeat for ")),
    Problem("run", "Rank 0 does not answer",
            "{where}rank 0 (the rendezvous store's host) does not answer{rest}",
            "rank 0 hosts the rendezvous store; when it is frozen or gone the others cannot reach it",
            "see what happened to rank 0; the others fail after --timeout plus at most 5 s",
            source=("rank 0 (the rendezvous store's host) does not answer",)),
    Problem("run", "A rank that does not end",
            "dptrain: worker rank {rank} had not ended {seconds} s after rank {other} did (frozen or stuck); "
            "stopping it",
            "one rank finished but another is still running --timeout seconds later",
            "look at that rank's last lines; it is stopped so that the launcher does not wait forever",
            source=("had not ended", "(frozen or stuck)")),
    Problem("run", "Averaging collapses",
            "dptrain: averaging collapses: in epoch {epoch}, for the second average in a row, the averaged model "
            "went wrong: {why}; try --lr-scaling none, a lower --lr, or averaging more often (--sync-every-steps)",
            "two averages in a row were clearly worse than the workers' own models (at chance, or far above the "
            "best loss so far): the learning rate is too large for averaging",
            "follow the line: --lr-scaling none, a lower --lr, or --sync-every-steps; `--stop-on-collapse` stops "
            "the run at that point", source=("averaging collapses: in epoch", "try --lr-scaling none")),
    # ---------------------------------------------------------------- launching on a cluster
    Problem("launch", "The job hangs at start, then fails after --timeout",
            "the job hangs at start, then fails after --timeout",
            "not all ranks started, or they wait at different addresses",
            "run `srun dptrain info` (or `mpirun ... dptrain info`) with the same layout: every rank must show the "
            "same `rendezvous` and `world_size`; lower --timeout while testing",
            symptom=True, source=('"rendezvous": f"{env.master_addr}:{env.master_port}"', '"world_size": env.world_size')),
    Problem("launch", "The rendezvous fails",
            "rank {rank}: rendezvous at {host}:{port} failed: {why}",
            "MASTER_ADDR is a name the nodes cannot resolve or reach (e.g. a login-node alias), or a firewall "
            "blocks the port",
            "let the job script set it (do not export your own), or set MASTER_ADDR to the first node's address "
            "on the cluster network and MASTER_PORT to an open port", source=("rendezvous at",)),
    Problem("launch", "Something else holds MASTER_PORT",
            "rank {rank}: rendezvous at {host}:{port} failed: something else answers there, not a "
            "torch.distributed store (another program holds MASTER_PORT {port}); choose a free port",
            "another program listens on MASTER_PORT", "choose a free port (MASTER_PORT)",
            source=("something else answers there, not a torch.distributed store",)),
    Problem("launch", "Only the first node works",
            "only the first node works (`launcher: local` in summary.json)",
            "`dptrain train` ran in the batch script itself, not under srun/mpirun, and spawned --workers "
            "processes there", "start it with `srun` or `mpirun`, as the script from `dptrain launch` does",
            symptom=True, source=('OWN_LAUNCHERS = ("local", "dptrain-run", "nodes")',)),
    Problem("launch", "A bad --time", "dptrain: error: --time '{value}'{rest}",
            "the scheduler's time limit is written HH:MM:SS (or D-HH:MM:SS)", "write it as 02:00:00",
            case="launch-bad-time"),
    Problem("launch", "A command that is not on the PATH",
            "dptrain: error: command '{program}' is not on the PATH{rest}",
            "the words after `--` start a command every rank runs, and its program was not found",
            "check the spelling, or give a path (`./train.sh`, executable)", case="launch-command-not-found"),
    Problem("launch", "A job told to stop ends with exit code 143 instead of requeueing",
            "the job ends FAILED with exit code 143, after `srun: ... Terminating StepId` and `task N: Terminated`",
            "the first rank to exit with 75 makes srun (`--kill-on-bad-exit`) end the step's other ranks with "
            "SIGTERM; a rank, or the container runtime around it, that dies of it before exiting with 75 itself "
            "turns the job's 75 into 143 (128 + SIGTERM)",
            "write the job script again with `dptrain launch`: the container runtime of `dptrain train`'s ranks "
            "ignores SIGTERM, SIGUSR1 and SIGUSR2 (the rank inside handles them); a command of your own, run on "
            "the host, must handle SIGTERM as it handles the warning (finish saving, and exit with 75)",
            symptom=True, source=("must not die of any stop signal",)),
    # ---------------------------------------------------------------- containers
    Problem("container", "MPI errors inside the container",
            "MPI errors inside the container (version mismatch, PMI)",
            "an MPI library in the image does not match the host's",
            "nothing in dptrain needs MPI inside the container; start ranks with the host's srun/mpirun and keep "
            "MPI out of the image", symptom=True, source=("started by the host's Open MPI",)),
    Problem("container", "An image whose MPI is not the host's",
            "dptrain: error: --container {container} holds {mpi} and this host {host}: a program that calls MPI "
            "inside the container {rest}",
            "your command runs in a container whose MPI library (read from `libmpi.so`'s name) is another vendor's "
            "or major version than the host's, and the host's launcher starts it (the hybrid model)",
            "build the image with the host's MPI, or add `--no-mpi-check` if the program uses no MPI; `dptrain "
            "train` itself never uses MPI inside", source=("a program that calls MPI inside the container",)),
    Problem("container", "A udocker execution mode that cannot run",
            "dptrain: error: --execmode {mode} cannot run container {name} here: {rest}",
            "Fakechroot (F1-F4) needs udocker's own libfakechroot, which an offline udocker never downloads; "
            "udocker 1.3's runc mode (R1) exits 1 without a terminal",
            "leave `--execmode` out: auto takes P1, else P2, whichever runs", source=("cannot run container",)),
    Problem("container", "Files of the run vanish inside udocker containers",
            "`No such file or directory` for a path under a bind (the run directory) inside a udocker container, "
            "while the path is there on the host, after another rank's container ended",
            "a udocker set up before dptrain's proot wrapper set PROOT_DONT_POLLUTE_ROOTFS: PRoot made the bind's "
            "missing destinations in the image every rank shares and deleted them when its rank ended",
            "run `dptrain container setup` again, which rewrites the wrapper", symptom=True,
            source=("export PROOT_DONT_POLLUTE_ROOTFS=1",)),
    Problem("container", "No GPU driver in the container",
            "`CUDA driver ... insufficient` or `libcuda.so` not found in the container",
            "the host's driver libraries are not inside",
            "udocker: run `dptrain container setup --nvidia` on a GPU node; Apptainer: the script adds `--nv` when "
            "--gpus-per-node is set", symptom=True, source=("`--nv` binds the",)),
    Problem("container", "udocker tries to download its engine",
            "udocker tries to download its engine and fails",
            "its configuration is missing or says `autoinstall = False` (read as true)",
            "rerun `dptrain container setup`, which writes an empty `autoinstall =`",
            symptom=True, source=('"autoinstall =",',)),
    Problem("container", "proot fails with a kernel release error",
            "`proot` fails with a kernel release error", "Debian's proot 5.1 and udocker's `-k` option",
            "`dptrain container setup` installs a wrapper that drops `-k`", symptom=True, source=("runs {real_proot} without udocker's -k (kernel release)",)),
)


def render_markdown(problems: tuple[Problem, ...] = PROBLEMS) -> str:
    """The catalogue as Markdown: one section per area, one entry per problem."""
    lines: list[str] = []
    for area, heading in AREAS.items():
        lines += [f"## {heading}", ""]
        for problem in (p for p in problems if p.area == area):
            seen = problem.shown() if problem.symptom else f"`{problem.shown()}`"
            lines += [f"### {problem.title}", "", f"**You see:** {seen}", "",
                      f"**Why:** {problem.cause}.", "", f"**What to do:** {problem.fix}.", ""]
    return "\n".join(lines)
