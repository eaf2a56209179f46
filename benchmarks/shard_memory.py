"""Memory per rank of a sharded model (--shard, FSDP2) against the unsharded replica: S = 1, 2, 4 of 4 ranks.

    python benchmarks/shard_memory.py benchmarks/results/shard_memory.json

For each S, starts `dptrain run --workers 4` on this file (S = 1: --shard none, allreduce with DDP; S = 2:
--shard hybrid --shard-size 2; S = 4: --shard full), each rank training a 6-layer transformer encoder of
about 23 M parameters with Adam for one short epoch through dptrain.Trainer, then one more forward and
backward (so that its gradients exist). Each rank then counts the bytes it holds of parameters, gradients
and optimizer state (this rank's shards: dptrain.runtime.sharded.local) and reads its peak resident
memory (VmHWM) and its resident memory at the end
(VmRSS, after malloc_trim hands back what glibc kept after frees). The goal: params + grads + optimizer state per rank within 1.1 x (the unsharded
replica's / S) plus the unsharded buffers (none here). Writes OUT (one row per rank and S) and prints
the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

VOCAB, WIDTH, LAYERS, LENGTH, CLASSES = 8000, 512, 6, 32, 4


class Encoder(nn.Module):
    """Token embedding, learned positions, LAYERS transformer layers, a mean-pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(LENGTH, WIDTH))
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(WIDTH, 8, 4 * WIDTH, dropout=0.0, batch_first=True)
                                     for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.long()) + self.position
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def _resident(key: str) -> int:
    """VmHWM (the peak resident memory) or VmRSS (now) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _trim() -> None:
    """Hand the memory glibc keeps after frees back to the system (malloc_trim), so that VmRSS is what is held."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The bytes this rank holds of `module`'s parameters, gradients and buffers and of `optimizer`'s state (its
    shards, where they are sharded)."""
    from dptrain.runtime.sharded import local

    return {"params": sum(local(p).numel() * p.element_size() for p in module.parameters()),
            "grads": sum(local(p.grad).numel() * p.grad.element_size() for p in module.parameters()
                         if p.grad is not None),
            "optimizer": sum(local(v).numel() * v.element_size() for state in optimizer.state.values()
                             for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0),
            "buffers": sum(b.numel() * b.element_size() for b in module.buffers())}


def worker(size: int, out: str) -> None:
    """One rank: train, one more backward, count what it holds; rank by rank into OUT.rank-R.json."""
    import dptrain

    torch.manual_seed(0)
    model = Encoder()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    shard = {} if size == 1 else ({"shard": "full"} if size == 4 else {"shard": "hybrid", "shard_size": 2})
    strategy = dptrain.AllReduce()
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (64, LENGTH), generator=generator)
    y = torch.randint(0, CLASSES, (64,), generator=generator)
    trainer = dptrain.Trainer(model, optimizer, "cross-entropy", strategy, batch_size=4, verbose=False,
                              progress=False, **shard)
    trainer.fit((x, y), epochs=1)
    module = strategy.model  # the user's module, sharded in place when S > 1
    # One more backward, so that the gradients exist (the loop frees them after each step). Unsharded, without
    # DDP: the same full-size gradients (DDP's buckets, another copy, are not counted).
    nn.functional.cross_entropy(module(x[:4]), y[:4]).backward()
    held = held_bytes(module, optimizer)
    _trim()
    rank = int(os.environ["RANK"])
    Path(f"{out}.rank-{rank}.json").write_text(json.dumps(
        {"S": size, "rank": rank, "parameters": parameters, **held, "peak_rss": _resident("VmHWM"),
         "rss_now": _resident("VmRSS")}))


def main(out: Path) -> None:
    rows = []
    for size in (1, 2, 4):
        prefix = str(out.with_suffix("")) + f"-S{size}"
        subprocess.run([sys.executable, "-m", "dptrain", "run", "--workers", "4", __file__, "--worker", str(size),
                        prefix], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for rank in range(4):
            path = Path(f"{prefix}.rank-{rank}.json")
            rows.append(json.loads(path.read_text()))
            path.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    unsharded = next(r for r in rows if r["S"] == 1 and r["rank"] == 0)
    whole = unsharded["params"] + unsharded["grads"] + unsharded["optimizer"]
    print(f"{unsharded['parameters']:,} parameters; unsharded replica: {whole / 2**20:.1f} MiB of params + grads + "
          "Adam state")
    print("| S | rank | params MiB | grads MiB | optimizer MiB | total MiB | bound 1.1 x whole/S + buffers MiB | "
          "within | peak RSS MiB | RSS at the end MiB |")
    print("|--:|--:|--:|--:|--:|--:|--:|:--:|--:|--:|")
    for row in rows:
        total = row["params"] + row["grads"] + row["optimizer"]
        bound = 1.1 * whole / row["S"] + row["buffers"]
        print(f"| {row['S']} | {row['rank']} | {row['params'] / 2**20:.1f} | {row['grads'] / 2**20:.1f} | "
              f"{row['optimizer'] / 2**20:.1f} | {total / 2**20:.1f} | {bound / 2**20:.1f} | "
              f"{'yes' if total <= bound else 'NO'} | {row['peak_rss'] / 2**20:.0f} | "
              f"{row['rss_now'] / 2**20:.0f} |")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3])
    else:
        main(Path(sys.argv[1]))
