"""Run a function on N real worker processes joined by a gloo process group on 127.0.0.1."""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import traceback

import torch

from dptrain.runtime.env import free_port


def _child(fn, rank, world, port, results, args, served=False):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        wait = datetime.timedelta(seconds=60)
        if served:  # the parent serves the store, as dptrain's launcher does with --min-workers
            os.environ["DPTRAIN_STORE_SERVED"] = "1"
            store = dist.PrefixStore("default_pg", dist.TCPStore("127.0.0.1", port, world, False, wait))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=wait)
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=wait)
        # Tensors go through torch.save bytes: torch's shared-memory pickling would hand the
        # parent file descriptors that vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fork_server():
    """The multiprocessing context of the test fork server: a process that has imported torch once starts
    each process forked from it in milliseconds rather than seconds, from a clean state (no threads, no
    process group). run_distributed's workers and cli_runner's `dptrain` commands come from it."""
    context = mp.get_context("forkserver")
    # torch._dynamo too: a torch.optim optimizer imports it (and sympy) when the first one is built, about
    # two CPU seconds in every worker otherwise. The data sets' libraries and the launcher's modules for
    # cli_runner (none of dptrain's modules reads the environment when imported).
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "sklearn.datasets", "dptrain",
                                    "dptrain.cli", "dptrain.train.command", "dptrain.train.trainer",
                                    "dptrain.strategies", "distributed"])
    return context


def run_distributed(fn, world: int = 2, *args, timeout: float = 120.0, lost: tuple[int, ...] = (),
                    served: bool = False) -> list:
    """fn(rank, world, *args) on `world` processes; returns the results in rank order. The ranks in `lost`
    are expected to die (live membership tests): none of theirs is waited for, and their results are None.
    `served`: this process serves the rendezvous store (DPTRAIN_STORE_SERVED), so that rank 0 may be lost."""
    import torch.distributed as dist

    context = fork_server()
    results = context.Queue()
    port = free_port()
    store = (dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
             if served else None)
    procs = [context.Process(target=_child, args=(fn, rank, world, port, results, args, served))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    collected: dict[int, object] = {}
    try:
        for _ in range(world - len(lost)):
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty:
        missing = sorted(set(range(world)) - set(collected) - set(lost))
        raise AssertionError(f"ranks {missing} gave no result within {timeout} s") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        del store  # (served: the store goes once every worker is done with it)
    return [collected.get(rank) for rank in range(world)]


def toy_data(n: int = 128):
    """(x, y): n samples of 6 standard-normal features and 3 classes, the same every call."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=n).astype(np.int64)
    return x, y


def toy_model():
    """A 6-8-3 tanh MLP with the same initial weights every call."""
    from torch import nn

    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
