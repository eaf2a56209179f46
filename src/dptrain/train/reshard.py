"""Resharding: a checkpoint continued with replica groups of another size (--shard full, hybrid with another
--shard-size, or none; an unsharded one continued sharded), at an epoch end.

FSDP2 shards each parameter by dim 0 as torch.chunk does over the S ranks of a replica group: chunks of
ceil(n / S) rows, the last one shorter, and a rank past the last row an empty chunk (torch's
`_chunk_with_empty` in torch.distributed.fsdp._fully_shard). A checkpoint holds each rank's chunk of every
parameter and of its optimizer state as a plain tensor (dptrain.runtime.sharded's LocalShards). A rank of a new
replica group continues from ONE writing replica group (new group g from writing group g mod their number, as
`source_of` picks a rank): it opens only the files of that group's ranks whose chunks overlap its own rows,
memory-mapped (torch.load with mmap and weights_only), and copies out just those rows. An unsharded writer is a
group of one whose file holds whole tensors, so a sharded run continues an unsharded checkpoint alike (group g
from writing rank g mod their number). Nothing goes over the network and no rank holds a whole model it does not
train. The rest of its state (epoch, history, schedule, strategy, random state) is that of the writer of its
first rows.

The strategy's own shards are resharded alike: streaming's global model (a state dict of the model's keys),
--outer's anchor (a shard of each parameter, in the model's order) and its outer optimizer's momentum or moments,
and async's vectors (its merge base and, on the services' hosts, their shard of the global model and its server
momentum: each parameter's rows of the rank, then the floating buffers whole). Any other state of shards (async's
compression residual, which sharding refuses) is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

import math

import torch
from torch import nn

from dptrain.errors import UserError
from dptrain.train import checkpoint_files

# The parts of a rank's file that may hold shards of the model beside the model and optimizer themselves.
OTHER_PARTS = ("strategy", "lr_guard")
# What of a strategy's state `_strategy` reshards (the rest must hold no shards).
RESHARDED = ("global_model", "anchor", "outer", "base", "global")


class Layout(NamedTuple):
    """Where a rank stands now: the ranks of its replica group (1 unsharded), the group's index, its place in it."""

    size: int
    group: int
    place: int


def rows(n: int, size: int, place: int) -> tuple[int, int]:
    """The rows [first, end) of a dimension of `n` that FSDP2 gives the rank at `place` of `size` (torch.chunk's
    chunks of ceil(n / size), empty past the last row)."""
    chunk = -(-n // size)
    return min(place * chunk, n), min((place + 1) * chunk, n)


def writing_group(members: list[int], written: int, group: int) -> list[int]:
    """The job ranks of the writing replica group that replica group `group` continues from, in place order."""
    first = (group % (len(members) // written)) * written
    return members[first:first + written]


def load_resharded(run_dir: Path, at: checkpoint_files.At, members: list[int], written: int, layout: Layout,
                   model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[int]]:
    """This rank's state from a checkpoint written by replica groups of `written` ranks (1: unsharded, each file
    whole tensors): its rows of every parameter in the model's, the optimizer's and the strategy's state, the rest
    as the writer of its first rows left it; and the job ranks whose files it read (that writer first). `model`,
    `optimizer`: this rank's, sharded as `layout` says (a parameter of no dimension is never sharded: FSDP2 shards
    by rows)."""
    writers = writing_group(members, written, layout.group)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False) if p.dim()}
    ordered = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]]
    where = f"the checkpoint of {checkpoint_files.describe(at)} in '{run_dir}'"
    needed = [k for k in range(written) if any(_overlap(rows(shape[0], written, k), rows(shape[0], layout.size,
                                                                                         layout.place))
                                               for shape in shapes.values())] or [layout.place % written]
    base = needed[0]  # the writer of its first rows (of its place, when it has no rows at all)
    files = {k: checkpoint_files.load_mapped(run_dir, at, writers[k]) for k in needed}
    state = dict(files[base])
    strategy = state.get("strategy") or {}
    others = {"strategy": {key: value for key, value in strategy.items() if key not in RESHARDED},
              "lr_guard": state.get("lr_guard")}
    held = [name for name in OTHER_PARTS if _holds_rows(others[name])]
    if held:
        raise UserError(f"{where} was written by replica groups of {written} ranks, and its {held[0]} state holds "
                        f"their shards beyond those resharded (streaming's global model, --outer's anchor and "
                        f"momentum, async's merge vectors): continue it with replica groups of {written} ranks")
    state["strategy"] = _strategy(files, strategy, shapes, [tuple(p.shape) for p in model.parameters()], written,
                                  layout, where)  # (the outer step's anchor is of every parameter, in order)
    if isinstance(strategy.get("base"), torch.Tensor):  # async's vectors
        state["strategy"].update(_async(files, strategy, model, written, layout, where))
    state["model"] = {key: (_assemble(files, lambda f, key=key: f["model"][key], shapes[key], written, layout, where,
                                      key) if key in shapes else _own(value)) for key, value in state["model"].items()}
    state["optimizer"] = _optimizer(files, ordered, written, layout, where)
    for key, value in state["model"].items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise UserError(f"{where} holds non-finite weights (NaN or inf in {key!r}); remove that epoch's "
                            "directory to resume from an earlier checkpoint")
    return state, [writers[k] for k in needed]


def _strategy(files: dict, saved: dict, shapes: dict, params: list[tuple], written: int, layout: Layout,
              where: str) -> dict:
    """The strategy's state with its shards made of this rank's rows: streaming's global model (the model's keys),
    --outer's anchor (one per parameter, in the model's order) and its outer optimizer's state (SGD's state dict
    over the anchors, or Adam's moments `m` and `v`, one per parameter)."""
    def of(*path):
        return lambda file: _at(file, path)

    state = dict(saved)
    if saved.get("global_model"):
        state["global_model"] = {key: (_assemble(files, of("global_model", key), shapes[key], written, layout, where,
                                                 f"the global model's {key}") if key in shapes else _own(value))
                                 for key, value in saved["global_model"].items()}
    if saved.get("anchor"):
        state["anchor"] = [_assemble(files, of("anchor", i), params[i], written, layout, where, f"anchor {i}")
                           for i in range(len(saved["anchor"]))]
    outer = saved.get("outer") or {}
    if "state" in outer:  # SGD's (sgd, nesterov) over the anchors
        state["outer"] = _optimizer(files, params, written, layout, where, of("outer"))
    elif outer.get("m"):  # Adam's moments
        state["outer"] = {name: [_assemble(files, of("outer", name, i), params[i], written, layout, where,
                                           f"the outer {name} {i}") for i in range(len(outer[name]))]
                          for name in ("m", "v")}
    return state


def _async(files: dict, saved: dict, model: nn.Module, written: int, layout: Layout, where: str) -> dict:
    """async's merge base and (on a service's host) its global model and server momentum, each a vector of this
    rank's rows (dptrain.strategies.merge_service.flat_state), made of the writers' vectors."""
    params = [tuple(p.shape) for p in model.parameters()]
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point() or b.is_complex())

    def flat(path: tuple, name: str) -> torch.Tensor:
        def split(k: int) -> list[torch.Tensor]:  # writer k's vector as its rows of each parameter, then the buffers
            vector, pieces, offset = _at(files[k], path), [], 0
            for shape in params:
                first, end = rows(shape[0], written, k) if shape else (0, 1)
                count = (end - first) * math.prod(shape[1:])
                pieces.append(vector[offset:offset + count].reshape((end - first, *shape[1:]) if shape else ()))
                offset += count
            if offset + buffers != vector.numel():
                raise UserError(f"{where} does not fit this model: {name} of the rank at place {k} holds "
                                f"{vector.numel()} values, and this model's rows there are {offset + buffers}")
            return pieces + [vector[offset:]]

        views = {k: split(k) for k in files}
        first = views[next(iter(views))]
        mine = [_assemble(views, lambda view, i=i: view[i], shape, written, layout, where, f"{name}'s parameter {i}")
                if shape else first[i] for i, shape in enumerate(params)]
        return torch.cat([piece.reshape(-1) for piece in mine] + [first[-1]])

    state = {"base": flat(("base",), "the merge base")}
    if saved.get("global"):
        state["global"] = {key: (flat(("global", key), f"the global model's {key}") if isinstance(value, torch.Tensor)
                                 else value) for key, value in saved["global"].items()}
    return state


def _at(file: dict, path: tuple) -> torch.Tensor:
    """The strategy state's value at `path` in a writer's file."""
    value = file["strategy"]
    for step in path:
        value = value[step]
    return value


def _optimizer(files: dict, ordered: list[tuple], written: int, layout: Layout, where: str,
               of: Callable[[dict], dict] = lambda file: file["optimizer"]) -> dict:
    """The optimizer's state (`of` a file) with each tensor that is a shard of its parameter (a momentum, Adam's
    moments) made of this rank's rows; numbers and step counts as the base file holds them."""
    base = next(iter(files))
    saved = of(files[base])
    state = {}
    for index, entry in saved.get("state", {}).items():
        if int(index) >= len(ordered):
            raise UserError(f"{where} does not fit this optimizer: it holds state for parameter {index}, and the "
                            f"optimizer has {len(ordered)} parameters")
        shape = ordered[int(index)]
        first, end = rows(shape[0], written, base) if shape else (0, 0)
        state[index] = {key: (_assemble(files, lambda f, index=index, key=key: of(f)["state"][index][key],
                                        shape, written, layout, where, f"optimizer state {key} of parameter {index}")
                              if shape and isinstance(value, torch.Tensor) and value.dim() > 0
                              and tuple(value.shape) == (end - first, *shape[1:]) else _own(value))
                        for key, value in entry.items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def _assemble(files: dict, part: Callable[[dict], torch.Tensor], shape: tuple, written: int, layout: Layout,
              where: str, name: str) -> torch.Tensor:
    """This rank's rows of a tensor of `shape` (the parameter's) from the writers' chunks of it (`part` of a
    file: the chunk), copied out of the mapped files."""
    first, end = rows(shape[0], layout.size, layout.place)
    pieces = []
    for k in range(written):
        start, stop = rows(shape[0], written, k)
        if not _overlap((start, stop), (first, end)):
            continue
        chunk = part(files[k])
        if tuple(chunk.shape) != (stop - start, *shape[1:]):
            given = (f"replica groups of {written} ranks give the rank at place {k}" if written > 1 else
                     "an unsharded writer holds it whole,")  # (or a sharded run that did not record its shard size)
            raise UserError(f"{where} does not fit this model: its shard of {name} has shape {tuple(chunk.shape)}, "
                            f"and {given} {(stop - start, *shape[1:])}")
        pieces.append(chunk[max(first, start) - start:min(end, stop) - start])
    if not pieces:
        return part(files[next(iter(files))]).new_empty((0, *shape[1:]))
    return torch.cat(pieces)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _own(value: Any) -> Any:
    """A tensor copied out of its mapped file (so that the file is not held open by it); anything else as it is."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _holds_rows(value: Any) -> bool:
    """Whether a part's saved state holds a tensor of one dimension or more (a shard, when the model is sharded)."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    if isinstance(value, dict):
        return any(_holds_rows(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_rows(item) for item in value)
    return False


def check_fits(model: nn.Module, saved: dict, written: int, where: str) -> None:
    """Whether the model state the first rank of a replica group of `written` ranks wrote (`saved`) fits `model`
    (whole, before the workers start): the same keys, each parameter's chunk the rows replica groups of `written`
    give that rank, each buffer whole; else a UserError naming the first key that does not fit (nothing is loaded)."""
    current = model.state_dict()
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise UserError(f"{where} does not fit this model: Missing key(s) in state_dict: {missing[:3]}; "
                        f"Unexpected key(s): {unexpected[:3]}")
    for key, value in current.items():
        shape = tuple(value.shape)
        if key in parameters and shape:
            shape = (len(range(*rows(shape[0], written, 0))), *shape[1:])
        if tuple(saved[key].shape) != shape:
            raise UserError(f"{where} does not fit this model: size mismatch for {key}: the checkpoint's first shard "
                            f"has shape {tuple(saved[key].shape)}, and this model's gives {shape} (replica groups "
                            f"of {written} ranks)")
