"""Kubernetes: the manifest `dptrain launch --scheduler kubernetes` writes, pinned by golden files
(tests/golden/launch/kubernetes-*.yaml, regenerated with DPTRAIN_REGENERATE_GOLDEN=1 and reviewed), checked
against the official API models (the `kubernetes` client), and the rank, world and rendezvous that a pod
of it finds (dptrain.cluster.kubernetes through dptrain.runtime.env), all in-process.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes import client  # a test extra: the official API models

from dptrain.cli import main as dptrain
from dptrain.cluster import kubernetes
from dptrain.cluster.spec import ContainerSpec, JobSpec
from dptrain.errors import UserError
from dptrain.runtime.env import detect, free_port

GOLDEN = Path(__file__).parent / "golden" / "launch"
REGENERATE = os.environ.get("DPTRAIN_REGENERATE_GOLDEN") == "1"
MODELS = {("v1", "Service"): "V1Service", ("batch/v1", "Job"): "V1Job"}


def example_spec(mode: str) -> JobSpec:
    """A 2-pod job with a GPU each, a time limit, a Kueue queue and the run directory on a volume."""
    # The laptop's directories (workdir, run_dir) are where the manifest is written; the pods see pod_run_dir.
    what = (dict(command=("python", "train.py", "--epochs", "3"), run_dir="/home/ada/project/runs/mine",
                 pod_run_dir="/runs/mine", pod_files=(("the command's script", "train.py"),))
            if mode == "command" else
            dict(train_args=("--data", "./mydata.py:make", "--strategy", "sync", "--epochs", "10"),
                 run_dir="/home/ada/project/runs/digits-sync", pod_run_dir="/runs/digits-sync",
                 pod_files=(("--data", "./mydata.py"), ("--model", "/runs/models/net.py"))))
    return JobSpec(scheduler="kubernetes", workdir="/home/ada/project", **what, nodes=2, gpus_per_node=1,
                   cpus_per_task=4, time="01:30:00", partition="team-a", job_name="digits-sync",
                   image="registry.example.org/ada/dptrain:1.0", volumes=("runs-claim:/runs",))


def documents(text: str) -> list[dict]:
    return [document for document in yaml.safe_load_all(text) if document is not None]


class _Response:
    """What ApiClient.deserialize reads before client 35: an HTTP response with the body as `data`."""

    def __init__(self, text: str):
        self.data = text


def through_the_api_models(document: dict) -> dict:
    """The document read into the client's model of its kind (V1Job, V1Service) and written back. The client
    drops keys its models do not know and refuses a missing required field, so an equal round trip means
    every field is one the API defines, with its type."""
    api, text, kind = client.ApiClient(), json.dumps(document), MODELS[document["apiVersion"], document["kind"]]
    if "content_type" in inspect.signature(api.deserialize).parameters:  # the client's generator changed it
        model = api.deserialize(text, kind, "application/json")
    else:
        model = api.deserialize(_Response(text), kind)
    return api.sanitize_for_serialization(model)


@pytest.mark.parametrize("mode", ["train", "command"])
def test_manifest_matches_its_golden_file(mode):
    text = kubernetes.render(example_spec(mode))
    golden = GOLDEN / f"kubernetes-{mode}.yaml"
    if REGENERATE:
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}; run with DPTRAIN_REGENERATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("mode", ["train", "command"])
def test_every_field_of_the_manifest_is_one_the_kubernetes_api_defines(mode):
    service, job = documents(kubernetes.render(example_spec(mode)))
    assert [service["kind"], job["kind"]] == ["Service", "Job"]  # the Service first: DNS before the pods start
    for document in (service, job):
        assert through_the_api_models(document) == document


def test_the_round_trip_would_catch_a_misspelt_field():
    service, job = documents(kubernetes.render(example_spec("train")))
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["gpus"] = 1
    assert through_the_api_models(job) != job
    del container["gpus"], container["name"]
    with pytest.raises(ValueError, match=r"(?s)name.*(must not be `None`|valid string)"):  # (client < 35, >= 35)
        through_the_api_models(job)


@pytest.mark.parametrize("mode", ["train", "command"])
def test_the_job_is_what_the_api_server_accepts_and_what_the_ranks_need(mode):
    service, job = documents(kubernetes.render(example_spec(mode)))
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    # An Indexed Job of one pod per rank; podFailurePolicy needs restartPolicy Never.
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] == 0
    # Exit 75 (stopped at a checkpoint) and a disruption recreate the pod without counting as a failure.
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onExitCodes": {"containerName": "rank", "operator": "In", "values": [75]}}
    assert rules[1]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert pod["containers"][0]["name"] == "rank"
    # Rendezvous: the pods' subdomain is the headless Service, which selects them by the Job's name.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"] == "digits-sync"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "digits-sync"}
    # Options: GPUs, CPUs, --time, --partition as a Kueue queue, --stop-before, --image, --volume.
    container = pod["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": "1"}}
    assert spec["activeDeadlineSeconds"] == 5400 and pod["terminationGracePeriodSeconds"] == 300
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert container["image"] == "registry.example.org/ada/dptrain:1.0"
    assert container["volumeMounts"] == [{"name": "volume-0", "mountPath": "/runs"}]
    assert pod["volumes"] == [{"name": "volume-0", "persistentVolumeClaim": {"claimName": "runs-claim"}}]


def pod_environment(mode: str, index: int) -> dict[str, str]:
    """The variables the rendered Job gives its pod of completion index `index`: the manifest's own (the
    completion index where it refers to it) and the one Kubernetes adds, JOB_COMPLETION_INDEX."""
    _, job = documents(kubernetes.render(example_spec(mode)))
    env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"digits-sync-{index}"}
    for variable in job["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "valueFrom" in variable:
            assert variable["valueFrom"] == {"fieldRef": {"fieldPath": kubernetes.COMPLETION_INDEX}}
            env[variable["name"]] = str(index)
        else:
            env[variable["name"]] = variable["value"]
    return env


@pytest.mark.parametrize("index", [0, 1])
def test_a_pod_of_a_train_job_knows_its_rank_world_and_rendezvous(index):
    env = detect(pod_environment("train", index))
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == \
        ("kubernetes", index, 2, 0, 1)
    assert (env.master_addr, env.master_port) == ("digits-sync-0.digits-sync", 29500)
    assert (env.scheduler, env.job_id, env.nodes) == ("kubernetes", "digits-sync",
                                                      ("digits-sync-0.digits-sync", "digits-sync-1.digits-sync"))


def test_a_train_pod_meets_rank_0_at_its_service_address_without_master_addr():
    env = pod_environment("train", 1)
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    detected = detect(env)
    assert (detected.rank, detected.master_addr) == (1, "digits-sync-0.digits-sync")


@pytest.mark.parametrize("index", [0, 1])
def test_a_pod_of_a_command_job_has_torchrun_s_variables(index):
    env = pod_environment("command", index)
    assert {name: env[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                         "MASTER_PORT", "DPTRAIN_RUN_DIR")} == \
        {"RANK": str(index), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
         "MASTER_ADDR": "digits-sync-0.digits-sync", "MASTER_PORT": "29500",
         "DPTRAIN_RUN_DIR": "/runs/mine"}
    detected = detect(env)
    assert (detected.rank, detected.world_size, detected.scheduler) == (index, 2, "kubernetes")


def test_outside_a_pod_of_the_manifest_kubernetes_answers_nothing():
    # Any pod of an Indexed Job has JOB_COMPLETION_INDEX; only the manifest's pods have dptrain's variables.
    assert kubernetes.ranks({"JOB_COMPLETION_INDEX": "3"}) is None
    assert kubernetes.job({"JOB_COMPLETION_INDEX": "3"}) is None


def test_a_job_without_time_queue_gpus_or_volume_leaves_those_fields_out_and_warns_in_a_comment():
    spec = JobSpec(scheduler="kubernetes", workdir="/p", run_dir="/p/runs/x", nodes=3, image="img", stop_before=0)
    text = kubernetes.render(spec)
    service, job = documents(text)
    assert through_the_api_models(job) == job
    pod = job["spec"]["template"]["spec"]
    assert "activeDeadlineSeconds" not in job["spec"] and "terminationGracePeriodSeconds" not in pod
    assert job["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "dptrain"}
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1"}} and "volumes" not in pod
    assert "# The run directory is on no --volume: each pod writes it into its own file system" in text
    assert text.startswith("# Kubernetes job: 3 ranks, one pod each.\n# Written by dptrain launch;")


@pytest.mark.parametrize("time, seconds", [("00:00:59", 59), ("02:00:00", 7200), ("1-00:00:01", 86401)])
def test_time_is_the_job_s_active_deadline_in_seconds(time, seconds):
    assert kubernetes.seconds(time) == seconds


@pytest.mark.parametrize("mem, quantity", [("16G", "16Gi"), ("4000", "4000Mi"), ("512M", "512Mi"), ("1T", "1Ti")])
def test_mem_is_each_pod_s_memory_request_and_limit_in_slurm_s_binary_units(mem, quantity):
    spec = JobSpec(**{**example_spec("train").__dict__, "mem": mem})
    service, job = documents(kubernetes.render(spec))
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": quantity},
                                      "limits": {"memory": quantity, "nvidia.com/gpu": "1"}}
    assert through_the_api_models(job) == job


def test_mem_0_all_of_a_node_s_memory_is_refused_for_a_pod():
    with pytest.raises(UserError, match=r"^--mem 0 \(all of a node's memory\) is SLURM's; under Kubernetes give an "
                                        r"amount, e.g. --mem 64G$"):
        JobSpec(**{**example_spec("train").__dict__, "mem": "0"})


@pytest.mark.parametrize("changes, message", [
    (dict(image=None), "--scheduler kubernetes needs --image IMAGE: the container image every pod runs (with "
                       "dptrain, or the command's program, installed)"),
    (dict(tasks_per_node=2, gpus_per_node=0), "--tasks-per-node 2: a Kubernetes job runs one rank per pod; ask for --nodes 4 pods "
                             "(e.g. with --gpus-per-node 1) and --tasks-per-node 1"),
    (dict(container=ContainerSpec("udocker", "dptrain")), "--container udocker:dptrain is for SLURM, PBS and local "
                                                          "jobs; a Kubernetes pod runs its --image itself"),
    (dict(binds=("/data",)), "--bind /data binds a path into --container; a Kubernetes pod mounts a "
                             "PersistentVolumeClaim with --volume CLAIM:PATH"),
    (dict(account="proj42"), "--account proj42 has no meaning for a Kubernetes job; its namespace is kubectl's "
                             "(kubectl config set-context --current --namespace NAME)"),
    (dict(job_name="My_Job"), "--job-name 'My_Job' is not a Kubernetes name: lowercase letters, digits and '-', "
                              "starting with a letter and ending with a letter or digit, at most 50 characters"),
    (dict(volumes=("runs",)), "--volume 'runs' is not CLAIM:PATH, a PersistentVolumeClaim's name and the absolute "
                              "path every pod mounts it at, e.g. runs-claim:/home/ada/project/runs"),
    (dict(volumes=("runs:relative",)), "--volume 'runs:relative' is not CLAIM:PATH"),
])
def test_what_a_kubernetes_job_cannot_take_is_one_sentence(changes, message):
    spec = JobSpec(**{**example_spec("train").__dict__, **changes})
    with pytest.raises(UserError) as raised:
        kubernetes.render(spec)
    assert str(raised.value).startswith(message)


def test_image_and_volume_are_refused_for_other_schedulers():
    with pytest.raises(UserError, match=r"^--image img is for --scheduler kubernetes; under slurm the ranks run on "
                                        r"the host, or in --container RUNTIME:IMAGE$"):
        JobSpec(scheduler="slurm", workdir="/p", run_dir="/p/r", image="img")


LAUNCH = ["launch", "--scheduler", "kubernetes", "--nodes", "2", "--image", "img", "--out", "run"]


def test_launch_refuses_a_bad_kubernetes_setting_with_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = dptrain([*LAUNCH, "--tasks-per-node", "2", "--", "--dataset", "digits"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "dptrain: error: --tasks-per-node 2: a Kubernetes job runs one rank per pod; ask for --nodes 4 pods (e.g. "
        "with --gpus-per-node 1) and --tasks-per-node 1"]
    assert not (tmp_path / "run").exists()


def test_a_command_job_s_program_is_the_image_s_not_looked_for_here(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no train.py here: it is in the image
    code = dptrain([*LAUNCH, "--dry-run", "--", "python", "train.py", "--epochs", "3"])
    out = capsys.readouterr().out
    assert code == 0
    _, job = documents(out)
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["python", "train.py", "--epochs", "3"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("launch, program", [(LAUNCH, "kubectl"),
                                             (["launch", "--scheduler", "slurm", "--out", "run"], "sbatch")])
def test_submit_without_its_program_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, launch,
                                                                          program):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code = dptrain([*launch, "--submit", "--", "--dataset", "digits"])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dptrain: error: {program} is not on the PATH; --submit needs it to submit the job: run this where {program} "
        "works, or leave --submit out to only write the job script"]
    assert not (tmp_path / "run").exists()


FAKE_KUBECTL = """#!/bin/bash
echo "$*" >> "$KUBECTL_LOG"
case "$1" in
    apply) echo "service/dptrain $APPLIED"; echo "job.batch/dptrain $APPLIED";;
    get) echo '{"status": {"succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}}';;
esac
"""


@pytest.fixture
def fake_kubectl(tmp_path, monkeypatch):
    """A kubectl on the PATH that logs its arguments, applies and reports the job complete."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KUBECTL_LOG", str(tmp_path / "kubectl.log"))
    monkeypatch.setenv("APPLIED", "created")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "kubectl.log"


def test_submit_applies_the_manifest_with_kubectl_and_wait_follows_the_job(fake_kubectl, tmp_path, capsys):
    code = dptrain([*LAUNCH, "--submit", "--wait", "--", "--dataset", "digits"])
    out = capsys.readouterr().out
    assert code == 0, out
    manifest = tmp_path / "run" / "job.yaml"
    assert fake_kubectl.read_text().splitlines() == [f"apply -f {manifest}", "get job dptrain -o json"]
    assert f"dptrain: wrote {manifest}\n" in out
    assert ("dptrain: submitted job dptrain; output 'kubectl logs -f -l batch.kubernetes.io/job-name=dptrain,"
            "batch.kubernetes.io/job-completion-index=0' (rank 0)\n") in out
    assert out.endswith("dptrain: job dptrain COMPLETED with exit code 0\n")
    assert [d["kind"] for d in documents(manifest.read_text())] == ["Service", "Job"]


def test_submitting_a_job_kubernetes_already_has_says_how_to_run_it_again(fake_kubectl, monkeypatch, capsys):
    monkeypatch.setenv("APPLIED", "unchanged")
    code = dptrain([*LAUNCH, "--submit", "--", "--dataset", "digits"])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "dptrain: error: job dptrain already exists with this manifest, so kubectl started nothing; to run it "
        "again, first 'kubectl delete job,service dptrain'")


@pytest.mark.parametrize("status, expected", [
    ({}, ("PENDING", False, 0)),
    ({"active": 2}, ("RUNNING", False, 0)),
    ({"conditions": [{"type": "Suspended", "status": "True"}]}, ("SUSPENDED", False, 0)),
    ({"conditions": [{"type": "Suspended", "status": "False"}], "active": 1}, ("RUNNING", False, 0)),
    ({"conditions": [{"type": "Complete", "status": "True"}]}, ("COMPLETED", True, 0)),
    ({"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]},
     ("FAILED (BackoffLimitExceeded)", True, 1)),
])
def test_the_job_s_state_comes_from_its_conditions(status, expected):
    result = kubernetes.parse_status(json.dumps({"kind": "Job", "status": status}))
    assert (result.state, result.finished, result.exit_code) == expected


def test_two_pods_train_together_from_the_manifest_s_variables_alone(tmp_path):
    # Each "pod" a process with its pod's variables (and the image's PATH); only the rendezvous address is
    # this machine's, since the Service's DNS name resolves inside the cluster.
    port = str(free_port())
    spec = JobSpec(**{**example_spec("train").__dict__, "run_dir": str(tmp_path / "run"), "pod_run_dir": "run",
                      "train_args": ("--dataset", "digits", "--epochs", "1", "--strategy", "allreduce")})
    _, job = documents(kubernetes.render(spec))
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["dptrain", "train"]
    pods = []
    for index in (0, 1):
        host = {name: value for name, value in os.environ.items()
                if not name.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM", "OMPI", "PMI", "DPTRAIN"))}
        env = {**host, **pod_environment("train", index), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        pods.append(subprocess.Popen([sys.executable, "-m", "dptrain", *command[1:]], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [pod.communicate(timeout=120)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], outputs
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["workers"], summary["launcher"]) == (2, "kubernetes"), summary


def test_the_manifest_carries_none_of_the_launching_machine_s_paths():
    for mode in ("train", "command"):
        text = kubernetes.render(example_spec(mode))
        assert "/home/ada/project" not in text and "workingDir" not in text, text


def test_launch_says_where_the_pods_expect_each_file_and_checks_none_here(tmp_path):
    # Neither file exists on this machine: the pods read them from the image and the volume.
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "kubernetes", "--image", "img",
                             "--volume", "runs:/mnt/runs", "--", "--data", "./mydata.py:make", "--model",
                             "/mnt/runs/net.py:Net", "--out", "runs/one"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == [
        "dptrain: the pods expect ./mydata.py (--data) in the image's working directory",
        "dptrain: the pods expect /mnt/runs/net.py (--model) on volume runs (mounted at /mnt/runs)"]
    _, job = documents((tmp_path / "runs" / "one" / "job.yaml").read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert "workingDir" not in container
    assert container["command"][-2:] == ["--out", "runs/one"]  # relative to the image's working directory
    assert str(tmp_path) not in (tmp_path / "runs" / "one" / "job.yaml").read_text()
