"""Nothing another process sends runs here: object collectives carry JSON, healing carries tensors.

A peer (or a process that took a peer's place in a group) sends a pickle whose `__reduce__` runs a shell
command, through each exchange dptrain makes: the summary/metrics gather, a broadcast, and the state that
heals a joiner. The receiver refuses it in one line naming the sender, and the command never runs.
"""

from __future__ import annotations

import ast
import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from dptrain.runtime.group import Group, UntrustedValue, decode_json

SRC = Path(__file__).resolve().parents[1] / "src" / "dptrain"


class RunsCode:
    """Unpickling this runs `touch MARKER` (what a malicious joiner sent in the adversarial test)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refused(rank: int, world: int, marker: str, exchange: str) -> str:
    group = Group.default(timeout=30)
    evil = pickle.dumps(RunsCode(marker))
    if exchange == "gather":
        if rank == 1:  # the wire under gather_objects, with a pickle in place of JSON
            group.gather_bytes("summary", evil)
            return ""
        try:
            group.gather_objects("summary", {"comm_bytes": 1})
        except UntrustedValue as exc:
            return str(exc)
        return "accepted"
    if rank == 0:
        group.broadcast_bytes("resume", evil)
        return ""
    try:
        group.broadcast_object("resume", None)
    except UntrustedValue as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("exchange", ["gather", "broadcast"])
def test_a_pickle_sent_through_an_object_collective_is_refused_and_never_runs(tmp_path, exchange):
    marker = tmp_path / "PWNED"
    results = run_distributed(_refused, 2, str(marker), exchange)
    said = results[0] if exchange == "gather" else results[1]
    sender = 1 if exchange == "gather" else 0
    what = "summary" if exchange == "gather" else "resume"
    assert said.startswith(f"rank {1 - sender}: {what}: rank {sender} sent {len(pickle.dumps(RunsCode(str(marker))))} "
                           "bytes that are not JSON"), said
    assert "nothing of it was run" in said and "\n" not in said
    assert not marker.exists()


def test_json_values_round_trip_and_tuples_come_back_as_lists():
    assert decode_json(b'{"a":[1,2.5,null,true]}', "x", 0) == {"a": [1, 2.5, None, True]}
    with pytest.raises(UntrustedValue, match=r"^x: rank 3 sent 3 bytes that are not JSON"):
        decode_json(b"\x80\x04.", "x", 3)


def _healed(rank: int, world: int, marker: str, forged: str):
    """Rank 0 heals rank 1 through the call a joiner's healing makes; with `forged`, rank 0 sends, in place of
    the structure, a pickle that runs code or a torch.save'd state holding such an object."""
    group = Group.default(timeout=30)
    if rank == 0 and forged:
        if forged == "pickle":
            evil = pickle.dumps(RunsCode(marker))
        else:
            buffer = io.BytesIO()
            torch.save({"tree": {"model": {"w": torch.ones(2)}, "extra": RunsCode(marker)}, "tensors": []}, buffer)
            evil = buffer.getvalue()
        group.broadcast_bytes("healing the workers that join", evil)
        return ""
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "flag": torch.tensor([True, False])},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
             "epoch": 3, "history": [{"epoch": 1}], "empty": torch.zeros(0, 4, dtype=torch.float16)}
    try:
        received, moved = group.broadcast_state("healing the workers that join", state if rank == 0 else None)
    except UntrustedValue as exc:
        return str(exc)
    return received, moved


@pytest.mark.parametrize("forged", ["pickle", "inside-a-state"])
def test_a_heal_state_that_would_run_code_is_refused(tmp_path, forged):
    marker = tmp_path / "PWNED"
    said = run_distributed(_healed, 2, str(marker), forged)[1]
    assert said.startswith("rank 1: healing the workers that join: rank 0 sent "), said
    assert "bytes that are not a dptrain state of tensors and plain values" in said and said.endswith(
        "nothing of it was run") and "\n" not in said
    assert not marker.exists()


def test_a_heal_state_arrives_as_tensors_with_its_structure_dtypes_and_devices():
    (sent, sent_bytes), (received, moved) = run_distributed(_healed, 2, "", "")
    assert received["epoch"] == 3 and received["history"] == [{"epoch": 1}]
    assert received["optimizer"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]  # tuples stay tuples
    assert list(received["optimizer"]["state"]) == [0]  # int keys stay ints
    for path in (("model", "w"), ("model", "flag"), ("optimizer", "state", 0, "step"), ("empty",)):
        a, b = sent, received
        for key in path:
            a, b = a[key], b[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    # one bucket, each tensor at a multiple of 16: w's 24 bytes at 0, flag's 2 at 32, step's 4 at 48, empty at 64
    assert moved == sent_bytes and moved - len(_header_of(sent)) == 64


def _header_of(state):
    from dptrain.runtime import state_wire

    return state_wire.header(*state_wire.split(state))


def test_no_source_file_unpickles_what_it_receives():
    """Every way to unpickle arbitrary objects is absent from dptrain's own code: torch's object collectives
    (pickle underneath), pickle itself, and torch.load without weights_only=True."""
    found = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in {
                    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                    "send_object_list", "recv_object_list", "loads", "load"}:
                base = node.value.id if isinstance(node.value, ast.Name) else ""
                if node.attr in {"loads", "load"} and base not in {"pickle", "cPickle", "dill", "cloudpickle"}:
                    continue
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {base}.{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                if any(name.split(".")[0] in {"pickle", "dill", "cloudpickle"} for name in names):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} imports pickle")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                    safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                               for k in node.keywords)
                    if not safe:
                        found.append(f"{path.relative_to(SRC)}:{node.lineno} torch.load without weights_only=True")
    assert found == []


def test_a_member_that_sent_what_is_not_json_is_left_out_of_the_next_agreement_and_never_admitted(monkeypatch):
    """The adversarial benchmark's joiner (with the secret) sent a pickle at every epoch end: each time the others
    refused it, regrouped, and kept it, for minutes. Refused once, it is in no later generation."""
    import torch.distributed as dist

    from dptrain.runtime import membership, signed

    monkeypatch.setenv(signed.SECRET_ENV, signed.new_secret())
    store = dist.HashStore()
    group = Group(0, 3, torch.device("cpu"), "gloo", 30.0, store=store, members=[0, 2, 3])
    with pytest.raises(UntrustedValue, match=r"^rank 0: summary: rank 3 sent 3 bytes that are not JSON"):
        group._decoded(b"\x80\x04.", "summary", 2)  # from rank 2 of the group: job rank 3
    assert membership.refused(store, 3) and not membership.refused(store, 2)
    key = "dptrain/membership/gen5/"
    for rank in (0, 2, 3):  # all three say they are alive, the refused one too
        signed.put(store, f"{key}alive/{rank}", "4 0")
    assert membership._decide(group, store, key, [0, 2, 3], timeout=5.0, stall=1.0) == "0,2;4;0"
    assert membership.gone(store, None, [2, 3], 1.0) == {3: "it sent what is not JSON"}


def test_buckets_hold_at_most_their_limit_and_a_larger_tensor_alone():
    from dptrain.runtime import state_wire

    specs = [state_wire.Spec(torch.float32, shape, False) for shape in ((10,), (3,), (40,), (2,))]  # 40, 12, 160, 8 B
    layout = state_wire.buckets(specs, limit=64)
    assert [(b.size, b.parts) for b in layout] == [(60, ((0, 0), (1, 48))), (160, ((2, 0),)), (8, ((3, 0),))]
    tensors = [torch.randn(s.shape) for s in specs]
    into: dict = {}
    for bucket in layout:
        state_wire.unpack(bucket, state_wire.pack(bucket, tensors, torch.device("cpu")), specs, None, into)
    assert all(torch.equal(into[i], t) for i, t in enumerate(tensors))
