"""Kubernetes: a manifest of a headless Service and an Indexed Job (one pod per rank, its rank the pod's
completion index), applied with `kubectl apply -f`, the job's state from `kubectl get job -o json`, and
inside a pod its job, its rank and the pods' addresses.

Why an Indexed Job and a headless Service, not a JobSet: both are built into Kubernetes (batch/v1 and v1),
so the manifest applies on any current cluster (1.28 or later: podFailurePolicy is on by default from 1.26,
GA in 1.31; pods carry the labels batch.kubernetes.io/job-name from 1.27 and ...job-completion-index from
1.28) and is validated against the official API models (the `kubernetes` client's), while JobSet is a
controller that a cluster must install first (a CRD the client does not know). What JobSet adds, restarting
the whole world when one pod fails, dptrain does not need: a rank that fails fails the job (backoffLimit 0,
as srun --kill-on-bad-exit), and a job resumes from its checkpoint by being run again.

Ranks and rendezvous: the Job runs `--nodes` pods (`--tasks-per-node` must be 1: a pod is the unit the
cluster places, so ask for one pod per GPU with `--nodes N --gpus-per-node 1`). Kubernetes gives each pod
JOB_COMPLETION_INDEX, its rank, and the host name NAME-INDEX in the Service's subdomain NAME, so rank 0 is
reached at NAME-0.NAME (the Service publishes addresses before the pods are ready, so that DNS answers
while the ranks start). The manifest sets MASTER_ADDR, MASTER_PORT (fixed: every pod has its own network)
and DPTRAIN_KUBERNETES_JOB / DPTRAIN_KUBERNETES_PODS, from which `job` and `ranks` below tell the rank; a
command's pods also get torchrun's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE.

Requeue (exit 75): a pod that is evicted, pre-empted or deleted gets SIGTERM and `--stop-before` seconds
(terminationGracePeriodSeconds) before SIGKILL; dptrain's ranks agree to stop at the current epoch's end,
save a checkpoint and exit with 75. The Job's podFailurePolicy ignores exit code 75 (and pods the cluster
disrupted): such a pod is recreated with its index without counting against backoffLimit, and resumes
from the checkpoint, provided the run directory is on a volume every pod mounts (`--volume CLAIM:PATH`, a
PersistentVolumeClaim). Any other failure fails the Job. `--time` is activeDeadlineSeconds; `--partition`
names a Kueue LocalQueue (label kueue.x-k8s.io/queue-name); `--image` is the pods' container image;
`--mem` each pod's memory request and limit (SLURM's binary units: 16G is 16Gi).
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from dptrain.cluster.base import Job, Placement, integer
from dptrain.cluster.spec import JobSpec, header, train_command
from dptrain.cluster.submit import JobStatus, run_tool
from dptrain.errors import UserError

SCRIPT_NAME = "job.yaml"
SUBMIT_COMMAND = "kubectl apply -f"  # what submits the manifest (the program is its first word)
# After the launchers that a pod's command may start itself (torchrun, mpirun, mpiexec): their ranks also
# see the pod's variables, but their own rank is the one they were given.
PRIORITY = 35
PORT = 29500  # the rendezvous port: each pod has its own network namespace, so one fixed port never clashes
CONTAINER = "rank"  # the one container of each pod, named in the podFailurePolicy rule
REQUEUE_EXIT = 75  # a rank that stopped at a checkpoint to be resumed
NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
NAME_MAX = 50  # a pod's host name NAME-INDEX must stay a DNS label (63), and Kubernetes adds suffixes to NAME
MANAGED_BY = {"app.kubernetes.io/managed-by": "dptrain"}
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _check(spec: JobSpec) -> None:
    """One line for what a Kubernetes job cannot take: checked here, before anything is written."""
    if not NAME.fullmatch(spec.job_name) or len(spec.job_name) > NAME_MAX:
        raise UserError(f"--job-name {spec.job_name!r} is not a Kubernetes name: lowercase letters, digits and '-', "
                        f"starting with a letter and ending with a letter or digit, at most {NAME_MAX} characters")
    if not spec.image:
        raise UserError("--scheduler kubernetes needs --image IMAGE: the container image every pod runs "
                        "(with dptrain, or the command's program, installed)")
    if spec.tasks_per_node != 1:
        raise UserError(f"--tasks-per-node {spec.tasks_per_node}: a Kubernetes job runs one rank per pod; ask for "
                        f"--nodes {spec.world_size} pods (e.g. with --gpus-per-node 1) and --tasks-per-node 1")
    if spec.container is not None:
        raise UserError(f"--container {spec.container.runtime}:{spec.container.image} is for SLURM, PBS and local "
                        "jobs; a Kubernetes pod runs its --image itself")
    if spec.binds:
        raise UserError(f"--bind {spec.binds[0]} binds a path into --container; a Kubernetes pod mounts a "
                        "PersistentVolumeClaim with --volume CLAIM:PATH")
    if spec.account:
        raise UserError(f"--account {spec.account} has no meaning for a Kubernetes job; its namespace is kubectl's "
                        "(kubectl config set-context --current --namespace NAME)")


def cpus(spec: JobSpec) -> int:
    """The CPUs a pod asks for and its rank's threads: --cpus-per-task, else 1 (a pod sees the whole node's
    CPUs in nproc, not its share, so there is nothing to derive them from)."""
    return spec.cpus_per_task or 1


def memory(amount: str) -> str:
    """SLURM's --mem amount (16G; M when no unit; binary units, as SLURM's) as a Kubernetes quantity (16Gi)."""
    number, unit = (amount[:-1], amount[-1]) if amount[-1] in "KMGT" else (amount, "M")
    return f"{number}{unit}i"


def volumes(spec: JobSpec) -> list[tuple[str, str]]:
    """(claim, mount path) of each --volume CLAIM:PATH; one line naming a bad one."""
    pairs = []
    for text in spec.volumes:
        claim, sep, path = text.partition(":")
        if not sep or not NAME.fullmatch(claim) or not posixpath.isabs(path):
            raise UserError(f"--volume {text!r} is not CLAIM:PATH, a PersistentVolumeClaim's name and the absolute "
                            "path every pod mounts it at, e.g. runs-claim:/home/ada/project/runs")
        pairs.append((claim, path))
    return pairs


def pod_run_dir(spec: JobSpec) -> str:
    """The run directory as the pods see it: --out as given (relative to the image's working directory), else
    the spec's."""
    return spec.pod_run_dir or spec.run_dir


def expected_files(spec: JobSpec) -> list[str]:
    """Where each file the pods read must be, one sentence each (`dptrain launch` says them; nothing on the
    launching machine is checked, since the pods see only the image and the volumes)."""
    mounts = volumes(spec)
    sentences = []
    for flag, path in spec.pod_files:
        if not posixpath.isabs(path):
            where = "in the image's working directory"
        else:
            claim = next((claim for claim, mount in mounts if _on_volume(path, [(claim, mount)])), None)
            where = (f"on volume {claim} (mounted at {dict(mounts)[claim]})" if claim is not None
                     else "in the image (on no --volume)")
        sentences.append(f"{path} ({flag}) {where}")
    return sentences


def seconds(time: str) -> int:
    """--time D-HH:MM:SS (or HH:MM:SS) in seconds."""
    days, _, clock = time.rpartition("-")
    hours, minutes, secs = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + secs


def _on_volume(path: str, mounts: list[tuple[str, str]]) -> bool:
    return any(path == mount or path.startswith(mount.rstrip("/") + "/") for _, mount in mounts)


def manifests(spec: JobSpec) -> list[dict[str, Any]]:
    """The headless Service and the Indexed Job, as the API objects `kubectl apply` reads."""
    _check(spec)
    mounts = volumes(spec)
    name = spec.job_name
    env: list[dict[str, Any]] = [
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(PORT)},
        {"name": "OMP_NUM_THREADS", "value": str(cpus(spec))},
        # torch reads it once, at import: the rank's process starts with it (as the job scripts export it).
        {"name": "TORCH_CPP_LOG_LEVEL", "value": "ERROR"},
        {"name": "DPTRAIN_KUBERNETES_JOB", "value": name},
        {"name": "DPTRAIN_KUBERNETES_PODS", "value": str(spec.nodes)},
    ]
    if spec.command:
        # The command meets its world as under torchrun; RANK is the pod's completion index.
        env += [{"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
                {"name": "LOCAL_RANK", "value": "0"},
                {"name": "WORLD_SIZE", "value": str(spec.world_size)},
                {"name": "LOCAL_WORLD_SIZE", "value": "1"},
                {"name": "DPTRAIN_RUN_DIR", "value": pod_run_dir(spec)}]
    resources: dict[str, Any] = {"requests": {"cpu": str(cpus(spec))}}
    if spec.mem:  # asked and capped alike: a pod over it is killed (OOMKilled), not its node's other pods
        resources["requests"]["memory"] = memory(spec.mem)
        resources["limits"] = {"memory": memory(spec.mem)}
    if spec.gpus_per_node:
        resources.setdefault("limits", {})["nvidia.com/gpu"] = str(spec.gpus_per_node)
    # No workingDir: the pods start in the image's own, which the relative paths (--out, --data ...) are
    # taken from; the launching machine's directories exist in neither the image nor a volume.
    container: dict[str, Any] = {"name": CONTAINER, "image": spec.image,
                                 "command": train_command(spec, pod_run_dir(spec)), "env": env,
                                 "resources": resources}
    pod: dict[str, Any] = {"subdomain": name, "restartPolicy": "Never"}
    if spec.stop_before:
        pod["terminationGracePeriodSeconds"] = spec.stop_before
    if mounts:
        container["volumeMounts"] = [{"name": f"volume-{i}", "mountPath": path} for i, (_, path) in enumerate(mounts)]
        pod["volumes"] = [{"name": f"volume-{i}", "persistentVolumeClaim": {"claimName": claim}}
                          for i, (claim, _) in enumerate(mounts)]
    pod["containers"] = [container]
    labels = dict(MANAGED_BY)
    if spec.partition:
        labels["kueue.x-k8s.io/queue-name"] = spec.partition
    job: dict[str, Any] = {
        "completionMode": "Indexed", "completions": spec.nodes, "parallelism": spec.nodes,
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                 "values": [REQUEUE_EXIT]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
    }
    if spec.time:
        job["activeDeadlineSeconds"] = seconds(spec.time)
    job["template"] = {"metadata": {"labels": dict(MANAGED_BY)}, "spec": pod}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": dict(MANAGED_BY)},
               "spec": {"clusterIP": "None", "selector": {"batch.kubernetes.io/job-name": name},
                        "publishNotReadyAddresses": True,
                        "ports": [{"name": "rendezvous", "port": PORT, "protocol": "TCP"}]}}
    return [service, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
                      "spec": job}]


class _Dumper(yaml.SafeDumper):
    """Block-style YAML whose lists are indented under their key, as kubectl users write them."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def render(spec: JobSpec) -> str:
    documents = manifests(spec)
    # header()'s first lines less the shebang and its layout (a rank per pod, not tasks per node).
    comments = header(spec, "Kubernetes job")[1:]
    comments[0] = f"# Kubernetes job: {spec.nodes} rank{'s' if spec.nodes > 1 else ''}, one pod each."
    name = spec.job_name
    mounts = volumes(spec)
    comments += [
        f"# Apply it with 'kubectl apply -f {SCRIPT_NAME}' (to run it again, first 'kubectl delete job,service "
        f"{name}');",
        f"# rank 0's output: kubectl logs -f -l {rank_0(name)}",
        f"# Each pod's rank is its completion index; rank 0 is reached at {name}-0.{name} (the headless Service).",
        f"# A rank that exits with {REQUEUE_EXIT} (it stopped at a checkpoint after SIGTERM) has its pod recreated, "
        "not counted as",
        "# a failure, and resumes from the checkpoint; any other failure fails the job.",
    ]
    comments += [f"# The pods expect {where}" for where in expected_files(spec)]
    if not _on_volume(pod_run_dir(spec), mounts):
        comments += ["# The run directory is on no --volume: each pod writes it into its own file system, which is",
                     "# lost with the pod (and with it the checkpoints a recreated pod would resume from)."]
    body = yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120,
                         explicit_start=True)
    return "\n".join(comments) + "\n" + body


def output_path(run_dir: Path, job_id: str) -> Path:
    """The pods' output stays in the cluster (kubectl logs); `--wait` follows the job's state only."""
    return run_dir / f"kubernetes-{job_id}.out"


def rank_0(name: str) -> str:
    """The label selector of the Job's rank-0 pod."""
    return f"batch.kubernetes.io/job-name={name},batch.kubernetes.io/job-completion-index=0"


def describe_output(job_id: str) -> str:
    """Where to read the job's output, said after submitting it."""
    return f"'kubectl logs -f -l {rank_0(job_id)}' (rank 0)"


def parse_job_id(apply_output: str) -> str:
    """The Job's name from `kubectl apply` ("job.batch/NAME created"); one line when kubectl changed nothing."""
    for line in apply_output.splitlines():
        match = re.match(r"job\.batch/(\S+)(?:\s+(\S+))?", line.strip())
        if match:
            if match.group(2) == "unchanged":
                raise UserError(f"job {match.group(1)} already exists with this manifest, so kubectl started "
                                f"nothing; to run it again, first 'kubectl delete job,service {match.group(1)}'")
            return match.group(1)
    raise UserError(f"kubectl apply did not say it created a job: {apply_output.strip()[:200]!r}")


def parse_status(job_json: str) -> JobStatus:
    """The Job's state from `kubectl get job NAME -o json`: its Complete or Failed condition, else RUNNING
    while pods are active, SUSPENDED while Kueue holds it, PENDING before."""
    status = json.loads(job_json).get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Complete" in conditions:
        return JobStatus(state="COMPLETED", finished=True, exit_code=0)
    if "Failed" in conditions:
        return JobStatus(state=f"FAILED ({conditions['Failed'].get('reason', 'no reason given')})", finished=True,
                         exit_code=1)
    if "Suspended" in conditions:
        return JobStatus(state="SUSPENDED", finished=False)
    return JobStatus(state="RUNNING" if status.get("active") else "PENDING", finished=False)


def submit(script: Path) -> str:
    return parse_job_id(run_tool([*shlex.split(SUBMIT_COMMAND), str(script)], what="submit the job",
                                 cwd=script.parent))


def poll(job_id: str) -> JobStatus:
    return parse_status(run_tool(["kubectl", "get", "job", job_id, "-o", "json"],
                                 what=f"ask for the state of job {job_id}"))


# ---- inside a job ----------------------------------------------------------------------------

def job(env: Mapping[str, str]) -> Optional[Job]:
    """The Job's name, and its pods' addresses (NAME-INDEX.NAME, rank 0's first) from DPTRAIN_KUBERNETES_PODS."""
    if "DPTRAIN_KUBERNETES_JOB" not in env:
        return None
    name = env["DPTRAIN_KUBERNETES_JOB"]
    pods = integer(env, "DPTRAIN_KUBERNETES_PODS") if "DPTRAIN_KUBERNETES_PODS" in env else 0
    return Job("kubernetes", name, tuple(f"{name}-{index}.{name}" for index in range(pods)))


def ranks(env: Mapping[str, str]) -> Optional[Placement]:
    """A pod of the manifest's Indexed Job: rank JOB_COMPLETION_INDEX of DPTRAIN_KUBERNETES_PODS, one per pod."""
    if not all(name in env for name in ("DPTRAIN_KUBERNETES_JOB", "DPTRAIN_KUBERNETES_PODS", "JOB_COMPLETION_INDEX")):
        return None
    pods = integer(env, "DPTRAIN_KUBERNETES_PODS")
    return Placement("kubernetes", integer(env, "JOB_COMPLETION_INDEX"), pods, 0, 1)
