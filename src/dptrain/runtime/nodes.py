"""Several machines without a scheduler: torchrun's `--nnodes N --node-rank I --rdzv-endpoint HOST:PORT`.

The same command runs on each machine with its own `--node-rank`:

    dptrain train --nnodes 2 --node-rank 0 --master node0:29400 --workers 4 ...   (on node0)
    dptrain train --nnodes 2 --node-rank 1 --master node0:29400 --workers 4 ...   (on node1)

Each machine's launcher starts `--workers` ranks, ranks I*W .. I*W+W-1 of a job of N*W, local ranks
0..W-1 (their GPUs under NCCL), with torchrun's variables and DPTRAIN_LAUNCHER=nodes: they meet as
ranks of an outside launcher do (rank 0 opens the run directory and tells the others). Node 0's
launcher listens on HOST:PORT before its rank 0 starts and hands it the socket, so a port that is
taken, or an address that is not this machine's, is one line before anything runs; the other
machines' ranks wait for it up to `--timeout` and then name what they waited for.

The interface the ranks talk over: where GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) is not set,
the one this machine reaches HOST through, so that gloo does not take the address its host name
resolves to (often a loopback one, 127.0.1.1, in /etc/hosts).

Each launcher stops its ranks when one fails, and the other machines' ranks then fail to reach it and
end with one line naming the rank they waited for: no launcher restarts a world across machines
(`--max-restarts`), and no worker is lost and replaced (`--min-workers`): start the command again on
every machine to resume from the last checkpoint.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from dptrain.errors import Interrupted, UserError

LAUNCHER = "nodes"  # the ranks' DPTRAIN_LAUNCHER


@dataclass(frozen=True)
class Nodes:
    """Where this machine sits among the machines of a job started without a scheduler."""

    count: int
    rank: int
    host: str
    port: int

    def first_rank(self, per_node: int) -> int:
        return self.rank * per_node


def parse_master(text: Optional[str], flag: str = "--master") -> tuple[str, int]:
    """HOST:PORT ([IPv6]:PORT too) of node 0's rendezvous, or one sentence saying what is wrong with `text`."""
    if not text or ":" not in text:
        raise UserError(f"{flag} {text!r} must be HOST:PORT, where node 0 serves the rendezvous "
                        "(e.g. node0:29400)")
    host, _, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UserError(f"{flag} {text!r}: the port must be a number from 1 to 65535, e.g. {host or 'node0'}:29400")
    if not host or any(c.isspace() for c in host):
        raise UserError(f"{flag} {text!r}: the host must be node 0's name or address, e.g. node0:{port_text}")
    return host, int(port_text)


def nodes_from(count: int, rank: int, master: Optional[str]) -> Nodes:
    """The settings --nnodes, --node-rank and --master, checked together (one sentence for what is wrong)."""
    if count < 1:
        raise UserError(f"--nnodes {count} must be at least 1")
    if not 0 <= rank < count:
        raise UserError(f"--node-rank {rank} must be 0 to {count - 1} with --nnodes {count}")
    host, port = parse_master(master)
    return Nodes(count, rank, host, port)


def listen_for_node_zero(nodes: Nodes) -> socket.socket:
    """On node 0: the socket its rank 0 serves the rendezvous store on, listening now on HOST:PORT."""
    try:
        return socket.create_server((nodes.host, nodes.port), family=_family(nodes.host))
    except OSError as exc:
        raise UserError(f"--master {nodes.host}:{nodes.port}: node 0 cannot listen there ({exc.strerror or exc}); "
                        "give this machine's own name or address and a free port") from None


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def interface_towards(host: str, port: int) -> Optional[tuple[str, str]]:
    """(interface name, this machine's address on it) through which `host` is reached, or None where that is
    not found (no route, no `ip` tool): a UDP socket "connected" to it has the source address the kernel picks,
    and `ip -o addr` names the interface holding that address. Nothing is sent."""
    try:
        with socket.socket(_family(host), socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            mine = probe.getsockname()[0]
        listed = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listed.splitlines():
        words = line.split()
        if len(words) >= 4 and words[3].split("/")[0] == mine:
            return words[1].rstrip(":").split("@")[0], mine
    return None


def interface_env(nodes: Nodes, log=print) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the interface towards node 0, where the user set neither."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME"):
        return {}
    found = interface_towards(nodes.host, nodes.port)
    if found is None:
        return {}
    name, address = found
    if name == "lo":  # one machine playing every node: loopback is the way
        return {}
    log(f"dptrain: node {nodes.rank}: the ranks talk over {name} ({address}), the interface towards {nodes.host}; "
        "set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) to choose another")
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


def users_threads() -> Optional[int]:
    """Each rank's OMP_NUM_THREADS: the user's own setting if any, else None (the spawner's share of the cores)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def launch_node(command: Sequence[str], per_node: int, nodes: Nodes, *, timeout: float, grace: Optional[float],
                noun: str = "worker rank", of: str = "", others: str = "the other workers",
                threads: Optional[int] = None, hand_over: bool = True) -> int:
    """Run `command` as this machine's `per_node` ranks of the job; their exit code (see the module's docstring).
    One line names a rank of this machine that failed, as the local launcher's does. `threads`: each rank's
    OMP_NUM_THREADS (default: the user's OMP_NUM_THREADS, else this machine's cores over its ranks).
    `hand_over`: node 0's rank 0 is dptrain's and serves the store on the socket listening already; else (a
    user's script, which binds MASTER_PORT itself, as under torchrun) the address is only tried first."""
    from dptrain.runtime.launcher import say_how_ranks_ended
    from dptrain.runtime.spawn import start_ranks

    threads = threads if threads is not None else users_threads()
    listener = listen_for_node_zero(nodes) if nodes.rank == 0 else None
    if listener is not None and not hand_over:
        listener.close()  # free again for the script's own store; taken meanwhile, the script says so
        listener = None
    first, world = nodes.first_rank(per_node), nodes.count * per_node
    print(f"dptrain: node {nodes.rank} of {nodes.count}: starting ranks {first}-{first + per_node - 1} of {world}; "
          f"rendezvous at {nodes.host}:{nodes.port}", file=sys.stderr, flush=True)
    extra = interface_env(nodes, log=lambda line: print(line, file=sys.stderr, flush=True))
    try:
        ranks = start_ranks(list(command), per_node, port=nodes.port, master_addr=nodes.host, threads=threads,
                            extra_env=extra, listener=listener, launcher=LAUNCHER, first_rank=first, job_world=world)
        try:
            ended = ranks.wait(linger=timeout, grace=grace)
        finally:
            ranks.close()
    except KeyboardInterrupt:
        print(f"dptrain: interrupted; stopped ranks {first}-{first + per_node - 1} on node {nodes.rank}",
              file=sys.stderr, flush=True)
        return Interrupted.exit_code
    finally:
        if listener is not None:
            listener.close()

    def shift(rank):
        return None if rank is None else first + rank

    ended = replace(ended, failed_rank=shift(ended.failed_rank), first_done=shift(ended.first_done),
                    stuck_ranks=tuple(first + r for r in ended.stuck_ranks),
                    unstopped=tuple(first + r for r in ended.unstopped))
    say_how_ranks_ended(ended, timeout, noun=noun, of=of, others=others, grace=grace)
    return ended.code
