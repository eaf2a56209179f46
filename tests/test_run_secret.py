"""Only the run's own processes take part: store values signed with the run's secret, private files, and a
store service that listens where it is told.

A plain TCPStore client (any process that reaches the port, torch's store has no authentication) writes
what dptrain's membership reads: a failure flag, a joiner, a decider. Unsigned, each is ignored with one
line naming the key, and the run goes on as if nothing was written.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cli_runner import ForkedDptrain
from dptrain.runtime import membership, signed
from dptrain.runtime.spawn import job_store
from test_store_address import listening

SECRET = "ab" * 32


@pytest.fixture
def with_secret(monkeypatch):
    monkeypatch.setenv(signed.SECRET_ENV, SECRET)
    signed._warned.clear()


def test_a_signed_value_reads_back_and_a_forged_one_is_ignored_with_one_line(with_secret, capsys):
    store = dist.HashStore()
    signed.put(store, "dptrain/membership/failed/0", "1")
    assert store.get("dptrain/membership/failed/0").decode().startswith("1|hmac=")
    assert signed.read(store, "dptrain/membership/failed/0") == "1"
    # the same signed value moved to another key, a changed value, a plain one: none is taken
    store.set("dptrain/membership/failed/1", store.get("dptrain/membership/failed/0"))
    store.set("dptrain/membership/failed/2", "2" + store.get("dptrain/membership/failed/0").decode()[1:])
    store.set("dptrain/membership/failed/3", "1")
    for key in ("dptrain/membership/failed/1", "dptrain/membership/failed/2", "dptrain/membership/failed/3"):
        assert signed.read(store, key) is None
        assert signed.read(store, key) is None  # said once per key
    assert signed.read(store, "dptrain/membership/failed/9") is None  # absent: nothing said
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"dptrain: ignored the value at 'dptrain/membership/failed/{n}' in the run's store: it is not "
                     "signed with the run's secret (another process wrote it)" for n in (1, 2, 3)]


def test_a_forged_decider_is_replaced_so_a_forger_cannot_choose_who_decides(with_secret):
    store = dist.HashStore()
    store.set("dptrain/membership/1/decider", "2")  # a forger names rank 2 the decider
    assert signed.claim(store, "dptrain/membership/1/decider", "0") == "0"
    assert signed.claim(store, "dptrain/membership/1/decider", "1") == "0"  # the first signed claim stays


def test_without_a_secret_values_are_plain_as_under_torchs_own_trust(monkeypatch):
    monkeypatch.delenv(signed.SECRET_ENV, raising=False)
    monkeypatch.setattr(signed, "_made", None)
    store = dist.HashStore()
    signed.put(store, "k", "v")
    assert store.get("k") == b"v" and signed.read(store, "k") == "v"


def test_a_joiner_without_the_runs_secret_is_never_admitted(with_secret):
    store = dist.HashStore()
    signed.put(store, membership.WORLD, "2")
    assert membership.take_rank(store) == 2
    store.set(f"{membership.PREFIX}join/2", "ready")  # what `dptrain join` without the secret writes
    assert membership.ready_joiners(store, 1) == ()
    membership.announce(store, 2)  # with it
    assert membership.ready_joiners(store, 1) == (2,)


def test_a_forged_world_is_refused_in_one_line(with_secret):
    store = dist.HashStore()
    store.set(membership.WORLD, "7")
    with pytest.raises(membership.PeerFailure, match=r"holds no world size signed with the run's secret"):
        membership.take_rank(store)


def _modes(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): oct(stat.S_IMODE(path.stat().st_mode))
            for path in sorted(root.rglob("*")) if not path.name.endswith(".lock")}


def test_forged_membership_writes_change_nothing_and_the_run_directory_is_private(tmp_path):
    """sync, 3 workers, --min-workers 2; rank 1 slowed so that the others wait at each epoch end (where a
    watched collective looks for the failure flag once it has waited half a second: --slow-worker's delay is
    a multiple of the rank's own compute, about 0.03 ms per digits sample, so 1:150 makes the others wait
    about 2 s per epoch). While it trains, a plain store client says rank 0 failed
    in generation 0, announces a joiner and names a decider and members for generation 1."""
    out = tmp_path / "run"
    proc = ForkedDptrain(["train", "--dataset", "digits", "--strategy", "sync", "--workers", "3", "--min-workers", "2",
                          "--max-workers", "4", "--epochs", "8", "--slow-worker", "1:150", "--lr", "0.05",
                          "--no-progress", "--out", str(out)], cwd=tmp_path)
    try:
        address = out / "join.address"
        deadline = time.monotonic() + 120
        while not (address.is_file() and address.read_text().count("\n") == 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never took joiners"
            time.sleep(0.1)
        assert oct(stat.S_IMODE(address.stat().st_mode)) == "0o600"
        where, secret = address.read_text().split()
        assert len(secret) == 64
        host, port = where.rsplit(":", 1)
        store = job_store(dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10)))
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").is_file():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        store.set("dptrain/membership/failed/0", "1")
        taken = store.add(membership.JOINERS, 1)
        store.set(f"{membership.PREFIX}join/{3 + taken - 1}", "ready")
        store.set(f"{membership.PREFIX}1/decider", "2")
        store.set(f"{membership.PREFIX}1/members", "2;0;0")
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "ignored the value at 'dptrain/membership/failed/0' in the run's store: it is not signed" in stderr
    assert f"ignored the value at 'dptrain/membership/join/3'" in stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in records] == list(range(1, 9))
    assert all("membership" not in record and len(record["workers"]) == 3 for record in records)
    assert json.loads((out / "summary.json").read_text())["workers"] == 3
    modes = _modes(out)
    assert oct(stat.S_IMODE(out.stat().st_mode)) == "0o700"
    assert {mode for name, mode in modes.items() if (out / name).is_dir()} == {"0o700"}
    assert {mode for name, mode in modes.items() if (out / name).is_file()} == {"0o600"}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "model.pt"} <= set(modes)


def _serve(host: str, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dptrain", "serve-store", "--host", host, "--port", str(port),
                             "--world", "2", "--lifetime", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_serve_store_listens_on_exactly_the_address_asked():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    service = _serve("127.0.0.2", port)
    try:
        deadline = time.monotonic() + 30
        while not listening(port):
            assert service.poll() is None and time.monotonic() < deadline, service.communicate()
            time.sleep(0.1)
        assert listening(port) == {"127.0.0.2"}
    finally:
        service.terminate()
        service.communicate(timeout=30)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_serve_store_refuses_a_wildcard_address(host):
    service = _serve(host, 29555)
    stdout, stderr = service.communicate(timeout=60)
    assert service.returncode == 2
    assert stderr.strip().splitlines() == [
        f"dptrain: error: --host {host!r} is the wildcard address {host} (every interface); give the address (or "
        "name) of the one interface the ranks reach, e.g. the batch host's on the cluster network"]
