"""Rank 0's rendezvous store listens only where it must: 127.0.0.1 for a local run."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.runtime import distributed
from dptrain.runtime.env import free_port


def local_address() -> str:
    """A non-loopback IPv4 address of this host, or skip."""
    for address in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split():
        if "." in address and not address.startswith("127."):
            return address
    pytest.skip("this host has no non-loopback IPv4 address")


@pytest.mark.parametrize("master_addr, expected", [
    ("127.0.0.1", "127.0.0.1"),
    ("localhost", "127.0.0.1"),
    ("127.0.0.2", "127.0.0.2"),
    ("203.0.113.7", ""),  # not this host's (behind NAT, say): every interface, as torch does
    ("no-such-host.invalid", ""),
])
def test_the_store_listens_on_loopback_for_a_loopback_master_addr(master_addr, expected):
    assert distributed.listen_address(master_addr) == expected


def test_the_store_listens_on_the_interface_of_a_local_master_addr():
    address = local_address()
    assert distributed.listen_address(address) == address


def test_a_hostname_that_resolves_to_loopback_here_listens_everywhere():
    # Debian-style /etc/hosts maps the host's own name to 127.0.x.1, while the other nodes reach
    # it by its real address: binding loopback would lock them out.
    name = socket.gethostname()
    if not socket.gethostbyname(name).startswith("127."):
        pytest.skip(f"{name} does not resolve to loopback here")
    assert distributed.listen_address(name) == ""


def listening(port: int) -> set[str]:
    """Addresses with a TCP socket in LISTEN state on `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:
                continue
            if len(address) == 8:
                found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
            else:
                words = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 32, 8))
                found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


@pytest.mark.slow
def test_a_local_run_binds_its_store_to_127_0_0_1_only(tmp_path):
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dptrain", "train", "--dataset", "digits", "--workers", "2", "--epochs", "500",
         "--out", str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()
            time.sleep(0.1)
        pid = int(Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()[0])
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
        addresses = listening(int(environ["MASTER_PORT"]))
    finally:
        launcher.send_signal(signal.SIGTERM)  # checkpoint and stop
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
    assert addresses == {"127.0.0.1"}
    # Workers start with torch's C++ log quieted (a survivor of rank 0 would print 20-line stacks).
    assert environ.get("TORCH_CPP_LOG_LEVEL") == "ERROR"


@pytest.mark.parametrize("master_addr, bound", [("127.0.0.1", {"127.0.0.1"}), ("203.0.113.7", {"::", "0.0.0.0"})])
def test_rank_0_listens_where_listen_address_says(master_addr, bound):
    listener = distributed._listen(master_addr, free_port(), "rank 0: rendezvous")
    with listener:
        assert listener.getsockname()[0] in bound


def test_rank_0_listens_on_the_interface_of_a_local_address():
    address = local_address()
    with distributed._listen(address, free_port(), "rank 0: rendezvous") as listener:
        assert listener.getsockname()[0] == address


def test_a_taken_master_port_on_rank_0_is_named():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(distributed.PeerFailure, match=f"cannot serve the store on 127.0.0.1:{port}: "
                                                          "address already in use"):
            distributed._listen("127.0.0.1", port, "rank 0: rendezvous")
