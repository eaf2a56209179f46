"""Emulated slow networks: one network namespace per worker host, joined by a switch namespace, rate-limited by tc tbf.

    with EmulatedNetwork(hosts=2, rate="100mbit") as net:
        subprocess.run(net.exec_prefix(0) + ["python", ...], env={..., "MASTER_ADDR": net.address(0)})

Everything lives in namespaces this module creates and removes: each host namespace holds an
`eth0` (a veth) with address 10.77.0.<rank+1>/24; the other end of each veth sits in a switch
namespace on a bridge. A tbf qdisc on both ends limits each host's link to `rate` in each
direction (there is no netem here, so no added latency). Nothing is configured in the caller's
namespace. Needs root (or CAP_NET_ADMIN) and the `ip` and `tc` tools of iproute2.

`measure_link` measures what the emulated link really gives (dptrain/bench/probe.py at both ends).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from dptrain.errors import UserError

SUBNET = "10.77.0"
INTERFACE = "eth0"
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str) -> float:
    """A tc rate such as '100mbit' or '1gbit' in bits per second."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", text.lower())
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"bandwidth {text!r} is not a rate like 100mbit, 1gbit or 500kbit")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def tbf_arguments(rate_bits: float) -> list[str]:
    """The tbf parameters for a link of `rate_bits`: a 10 ms bucket (at least 64 KiB, so a
    veth's segmentation-offloaded packets fit) and a queue of 200 ms."""
    burst = max(65536, int(rate_bits / 8 * 0.010))
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "200ms"]


def namespaces_unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (one sentence), or None when they can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"--bandwidth needs the {' and '.join(missing)} command (Debian package iproute2)"
    if os.geteuid() != 0:
        return "--bandwidth needs root (or CAP_NET_ADMIN) to create network namespaces; run as root or leave out --bandwidth"
    return None


class EmulatedNetwork:
    """`hosts` network namespaces on one rate-limited switch; removed on exit, whatever happened."""

    def __init__(self, hosts: int, rate: str, tag: Optional[str] = None) -> None:
        if hosts < 1 or hosts > 250:
            raise UserError(f"an emulated network holds 1 to 250 hosts, not {hosts}")
        self.hosts = hosts
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        tag = tag or str(os.getpid())
        self.switch = f"dpb{tag}-sw"
        self.names = [f"dpb{tag}-h{rank}" for rank in range(hosts)]
        self._created: list[str] = []

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Prefix of a command that runs it in host `rank`'s namespace."""
        return ["ip", "netns", "exec", self.names[rank]]

    def __enter__(self) -> "EmulatedNetwork":
        reason = namespaces_unavailable()
        if reason:
            raise UserError(reason)
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _create(self) -> None:
        self._netns("add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        tbf = tbf_arguments(self.rate_bits)
        for rank, name in enumerate(self.names):
            self._netns("add", name)
            port = f"p{rank}"
            # Created inside the host namespace, its peer inside the switch: never in ours.
            _ip("-n", name, "link", "add", INTERFACE, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", name, "addr", "add", f"{self.address(rank)}/24", "dev", INTERFACE)
            _ip("-n", name, "link", "set", INTERFACE, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _run(["tc", "-n", name, "qdisc", "add", "dev", INTERFACE, "root", *tbf])
            _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *tbf])

    def _netns(self, action: str, name: str) -> None:
        try:
            _ip("netns", action, name)
        except subprocess.CalledProcessError as exc:
            detail = (exc.stderr or "").strip().splitlines()
            raise UserError(f"cannot create network namespace {name}: {detail[0] if detail else exc}; "
                            "--bandwidth needs root and a kernel that allows network namespaces") from None
        self._created.append(name)

    def remove(self) -> None:
        """Delete every namespace this network made (their veths and qdiscs go with them)."""
        while self._created:
            name = self._created.pop()
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)

    def exists(self) -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        present = {line.split()[0] for line in listed.splitlines() if line.strip()}
        return any(name in present for name in [self.switch, *self.names])


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def measure_link(network: EmulatedNetwork, payload: int = 4_000_000, port: int = 29400) -> dict:
    """Bandwidth (bytes/s, one TCP stream host 0 -> host 1) and round trip (s) as measured, not as configured."""
    script = str(Path(__file__).with_name("probe.py"))  # run by path: stdlib only, starts in milliseconds
    server = subprocess.Popen(network.exec_prefix(1) + [sys.executable, script, "serve", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "ready"
        result = subprocess.run(
            network.exec_prefix(0) + [sys.executable, script, "probe", network.address(1), str(port), str(payload)],
            capture_output=True, text=True, check=True, timeout=300)
        return json.loads(result.stdout)
    finally:
        server.kill()
        server.wait()
