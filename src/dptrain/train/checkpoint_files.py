"""Checkpoints: each rank's full state at an epoch end (or within an epoch), written atomically, verified on load.

Layout in the run directory:

    checkpoints/epoch-000004/checkpoint.json   the manifest: who wrote it (members, job ranks), world size,
                                               strategy, the run's id, the training data's fingerprint
    checkpoints/epoch-000004/rank-00000.pt     model, optimizer, scheduler, strategy, RNG, history
    checkpoints/epoch-000004/rank-00000.pt.sha256
    ...one pair per member, named by its rank of the job (a run that went on without rank 1 writes
    rank-00000 and rank-00002, never a renumbered rank-00001)
    checkpoints/epoch-000004-step-000017/...   17 steps into epoch 5 (--checkpoint-every-steps): also
                                               the position in the epoch ("position")

A checkpoint is named by where it was taken: an epoch end as the int E (epochs complete), a point
within an epoch as the pair (E, K): K steps into epoch E + 1. Pairs sort after E and before E + 1.

A checkpoint is complete when its manifest is there and every member it names wrote its file,
matching its checksum (a checkpoint written before manifests: every rank of the run's world). Files
are written to a temporary name, fsynced and renamed, so a crash never leaves a half file
under the real name; a truncated or altered file fails its checksum and resuming falls back
to the previous complete checkpoint. Everything is loaded with torch.load(weights_only=True):
tensors, numbers, strings, lists and dicts only, never arbitrary pickled objects (which is also why
torch.distributed.checkpoint's FileSystemReader is not used: it reads its .metadata with pickle.load).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from dptrain.errors import UserError
from dptrain.data.fingerprint import difference
from dptrain.io import atomic_write_bytes, make_dirs, write_json

DIRECTORY = "checkpoints"
MANIFEST = "checkpoint.json"
EPOCH_DIR = re.compile(r"^epoch-(\d{6})(?:-step-(\d{6,}))?$")
At = Union[int, tuple[int, int]]  # an epoch end E, or (E, K): K steps into epoch E + 1


def _key(at: At) -> tuple[int, int]:
    """(epochs complete, steps into the next): the order of checkpoints."""
    return (at[0], at[1]) if isinstance(at, tuple) else (at, 0)


def named(epoch: int, steps: int) -> At:
    """The name of a checkpoint `steps` into epoch `epoch + 1` (0 steps: the end of epoch `epoch`)."""
    return (epoch, steps) if steps else epoch


def describe(at: At) -> str:
    """'epoch 4', or 'step 17 of epoch 5' for a checkpoint within an epoch."""
    epoch, steps = _key(at)
    return f"step {steps} of epoch {epoch + 1}" if steps else f"epoch {epoch}"


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.pt"


def save(run_dir: Path, epoch: At, rank: int, state: dict[str, Any]) -> Path:
    """Write the state of `rank` (of the job) for `epoch` (counted from 1, or a point within an epoch) atomically,
    with its checksum."""
    directory = _epoch_dir(run_dir, epoch)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = _rank_file(directory, rank)
    for attempt in range(3):
        make_dirs(directory)
        try:
            # Checksum first: a file without a valid checksum beside it is never trusted.
            atomic_write_bytes(_checksum_file(path), hashlib.sha256(data).hexdigest().encode())
            atomic_write_bytes(path, data)
            return path
        except (OSError, UserError):
            # async's workers save alone at their own epoch ends, and rank 0 may prune a checkpoint older than
            # the newest complete ones while a slower worker writes into it: made again, it stays incomplete
            # (no manifest) and is pruned again later. Any other failure is the disk's, said as it was.
            if directory.is_dir() or attempt == 2:
                raise
    return path


def write_manifest(run_dir: Path, epoch: At, members, strategy: str, run_id: Optional[str],
                   data: Optional[dict], alone: bool = False, shard_size: Optional[int] = None) -> None:
    """The manifest of the checkpoint of `epoch`: its members (ranks of the job, in the order of their ranks in
    the group that wrote it), so that it is complete once each of them wrote its file, whatever the world.

    `alone`: its workers save alone, each at its own epoch end (async), and the first member (rank 0, the merge
    service's host) holds the global model: the checkpoint is complete with the first member's file, and a
    member whose file is missing was lost before it saved (`manifest` leaves it out; `lost_before_saving`).
    `shard_size`: the ranks of each replica group of a sharded run (each member's file holds its shards), so
    that a run of another shard size reshards it (dptrain.train.reshard); absent for an unsharded run."""
    directory = _epoch_dir(run_dir, epoch)
    make_dirs(directory)
    write_json(directory / MANIFEST, {"members": [int(member) for member in members], "world_size": len(members),
                                      "strategy": strategy, "run_id": run_id, "data": data,
                                      **({"alone": True} if alone else {}),
                                      **({"shard_size": int(shard_size)} if shard_size else {})})


def manifest(run_dir: Path, epoch: At, world_size: int) -> dict:
    """The manifest of the checkpoint of `epoch`; for one written before manifests, the run's `world_size`
    ranks as members and nothing else known."""
    path = _epoch_dir(run_dir, epoch) / MANIFEST
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict) or not isinstance(found.get("members"), list):
        if path.exists():  # being written, or cut short: nobody is known to have written this checkpoint
            return {"members": None, "world_size": None}
        return {"members": list(range(world_size)), "world_size": world_size, "legacy": True}
    if found.get("alone") and found["members"]:  # (write_manifest) the members that saved, the first one always
        first, *others = found["members"]
        directory = path.parent
        lost = [rank for rank in others if not _complete_pair(_rank_file(directory, rank))]
        if lost and _complete_pair(_rank_file(directory, first)):
            found = {**found, "members": [first, *(rank for rank in others if rank not in lost)],
                     "lost_before_saving": lost}
            found["world_size"] = len(found["members"])
    return found


def prune(run_dir: Path, keep: int, world_size: int) -> None:
    """Keep the newest `keep` complete checkpoints and every epoch directory newer than them.

    Rank 0 calls this right after its own save, when other ranks may still be writing that
    epoch (or, under async, an older one), and again once every rank's last save is done (the end
    of the run, a stop): a directory is counted only once every member's file and checksum are in
    it, and nothing newer than the oldest kept checkpoint is touched, so a rank killed mid-write or
    a slow worker never costs the last complete checkpoint. Presence is enough: both files are
    renamed into place whole, and load() verifies them.
    """
    if keep <= 0:
        return
    epochs = _epochs(Path(run_dir))
    complete = [epoch for epoch in epochs if _has_every_member(run_dir, epoch, world_size)]
    if len(complete) < keep:
        return  # fewer complete checkpoints than asked for: every one, and all newer partial ones, stay
    oldest_kept = _key(complete[-keep])
    for epoch in epochs:
        if _key(epoch) < oldest_kept:
            shutil.rmtree(_epoch_dir(run_dir, epoch), ignore_errors=True)


def _epoch_dir(run_dir: Path, at: At) -> Path:
    epoch, steps = _key(at)
    return Path(run_dir) / DIRECTORY / (f"epoch-{epoch:06d}-step-{steps:06d}" if steps else f"epoch-{epoch:06d}")


def _has_every_member(run_dir: Path, epoch: At, world_size: int) -> bool:
    members = manifest(run_dir, epoch, world_size)["members"]
    directory = _epoch_dir(run_dir, epoch)
    return members is not None and all(_complete_pair(_rank_file(directory, rank)) for rank in members)


def _checksum_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _epochs(run_dir: Path) -> list[At]:
    """The checkpoints in the run directory, oldest first (epoch ends and points within epochs)."""
    root = run_dir / DIRECTORY
    if not root.is_dir():
        return []
    found = (EPOCH_DIR.match(p.name) for p in root.iterdir())
    return sorted((named(int(m.group(1)), int(m.group(2) or 0)) for m in found if m), key=_key)


def _verified_bytes(path: Path) -> Optional[bytes]:
    checksum = _checksum_file(path)
    if not path.is_file() or not checksum.is_file():
        return None
    data = path.read_bytes()
    return data if hashlib.sha256(data).hexdigest() == checksum.read_text().strip() else None


def _verified(path: Path) -> bool:
    """Whether `path` and its checksum are there and agree, read in blocks (never the whole file in memory)."""
    checksum = _checksum_file(path)
    if not path.is_file() or not checksum.is_file():
        return False
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest() == checksum.read_text().strip()


def latest_complete(run_dir: Path, world_size: int) -> tuple[Optional[At], list[str]]:
    """(newest checkpoint whose manifest is there and whose members' files all verify, or None; a note for
    each newer one skipped, and for members an async checkpoint lost before they saved). `world_size`: the
    members of a checkpoint written before manifests.

    A checkpoint with member files missing was being written when the run stopped (Ctrl-C, a kill):
    expected, and said calmly. One whose files are there but fail their checksum is corrupt."""
    skipped: list[tuple[At, list[int], list[int]]] = []  # (epoch, missing ranks, corrupt ranks)
    found, lost = None, []
    for epoch in reversed(_epochs(Path(run_dir))):
        directory = _epoch_dir(run_dir, epoch)
        saved = manifest(run_dir, epoch, world_size)
        members = saved["members"]
        if members is None:
            skipped.append((epoch, [], []))
            continue
        bad = [rank for rank in members if not _verified(_rank_file(directory, rank))]
        if not bad:
            found, lost = epoch, saved.get("lost_before_saving", [])
            break
        missing = [rank for rank in bad if not _complete_pair(_rank_file(directory, rank))]
        skipped.append((epoch, missing, [rank for rank in bad if rank not in missing]))
    then = f"continuing from {describe(found)}" if found is not None else "starting the run over"
    notes = []
    for epoch, missing, corrupt in skipped:
        if corrupt:
            notes.append(f"the checkpoint of {describe(epoch)} is corrupt (rank file(s) {corrupt[:4]} fail their "
                         f"checksum); {then}")
        else:
            notes.append(f"the checkpoint of {describe(epoch)} was not finished; {then}")
    if lost:
        ranks = ", ".join(map(str, lost))
        notes.append(f"the checkpoint of {describe(found)} has no file of job rank{'s' if len(lost) > 1 else ''} "
                     f"{ranks} (lost before saving; its workers save alone): it is continued without "
                     f"{'them' if len(lost) > 1 else 'it'}")
    return found, notes


def foreign(saved: dict, run_id: Optional[str], data: Optional[dict], changed_data_ok: bool) -> Optional[str]:
    """Why a checkpoint (its manifest `saved`) does not belong to this run, or None: another run's id (a
    checkpoint copied in from elsewhere), or training data whose fingerprint differs (unless the user said
    --resume-with-changed-data). A checkpoint written before manifests is taken as it is."""
    if saved.get("legacy"):
        return None
    if saved.get("run_id") and run_id and saved["run_id"] != run_id:
        return (f"it belongs to another run (run id {saved['run_id']}, this run's is {run_id}); give --out a new "
                "directory, or copy no checkpoints between runs")
    changed = difference(saved.get("data"), data) if data is not None else None
    if changed and not changed_data_ok:
        return (f"it was trained on other data ({changed}); give the same data to continue it, "
                "--resume-with-changed-data to go on with this data, or --out a new directory")
    return None


def who_wrote(saved: dict) -> str:
    """"2: job ranks 0, 2" for a manifest naming members 0 and 2."""
    members = saved["members"]
    return f"{len(members)}: job rank{'s' if len(members) != 1 else ''} {', '.join(map(str, members))}"


def _complete_pair(path: Path) -> bool:
    """Whether a rank file and its checksum were both written (else the save was cut short)."""
    return path.is_file() and _checksum_file(path).is_file()


def load(run_dir: Path, epoch: At, rank: int) -> dict[str, Any]:
    """The verified state `rank` (of the job) wrote for `epoch`, loaded without unpickling arbitrary objects."""
    path = _rank_file(_epoch_dir(run_dir, epoch), rank)
    data = _verified_bytes(path)
    if data is None:
        raise UserError(f"checkpoint '{path}' is missing or does not match its checksum")
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise UserError(f"checkpoint '{path}' cannot be read: {str(exc).splitlines()[0]}") from None
    validate(state, path)
    return state


def load_mapped(run_dir: Path, epoch: At, rank: int) -> dict[str, Any]:
    """What `rank` wrote for `epoch`, its tensors memory-mapped from the file (torch.load with mmap and
    weights_only): what is read of them is only what is used (a reshard's rows). The checksum is verified first,
    the file read in blocks; its structure is checked as `load` checks it, its weights' values where used."""
    path = _rank_file(_epoch_dir(run_dir, epoch), rank)
    if not _verified(path):
        raise UserError(f"checkpoint '{path}' is missing or does not match its checksum")
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        raise UserError(f"checkpoint '{path}' cannot be read: {str(exc).splitlines()[0]}") from None
    validate(state, path, values=False)
    return state


# What a rank file must hold, as Trainer._checkpoint writes it (the type each entry must have).
STRUCTURE: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "step": (int,), "wall_seconds": (int, float), "model": (dict,), "optimizer": (dict,),
    "scheduler": (dict,), "scaler": (dict,), "strategy": (dict,), "rng": (dict,), "history": (list,),
}


def validate(state: Any, path: Path, values: bool = True) -> None:
    """Refuse a checkpoint with the right checksum but the wrong content, in one sentence.

    The checksum only proves the file is the one written; a file copied in from elsewhere, or
    written by a diverged run, could still lack entries (a KeyError deep in the restore) or
    carry NaN/inf weights, which would load silently and train on garbage. `values=False`: the weights' values
    are left unread here (a memory-mapped file's: the caller checks the rows it takes).
    """
    if not isinstance(state, dict):
        raise UserError(f"checkpoint '{path}' holds a {type(state).__name__}, not a dptrain checkpoint "
                        f"(a dict with {', '.join(STRUCTURE)})")
    missing = [key for key in STRUCTURE if key not in state]
    if missing:
        raise UserError(f"checkpoint '{path}' is not a dptrain checkpoint: it lacks {', '.join(map(repr, missing))} "
                        f"(a dptrain checkpoint holds {', '.join(STRUCTURE)})")
    for key, types in STRUCTURE.items():
        if not isinstance(state[key], types) or isinstance(state[key], bool):
            raise UserError(f"checkpoint '{path}' is not a dptrain checkpoint: its {key!r} is a "
                            f"{type(state[key]).__name__}, not a {' or '.join(t.__name__ for t in types)}")
    if not isinstance(state.get("position", {}), dict):
        raise UserError(f"checkpoint '{path}' is not a dptrain checkpoint: its 'position' is a "
                        f"{type(state['position']).__name__}, not a dict")
    for name, value in state["model"].items():
        if not isinstance(value, torch.Tensor):
            raise UserError(f"checkpoint '{path}' is not a dptrain checkpoint: model entry {name!r} is a "
                            f"{type(value).__name__}, not a tensor")
        if values and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise UserError(f"checkpoint '{path}' holds non-finite weights (NaN or inf in {name!r}); "
                            "remove that epoch's directory to resume from an earlier checkpoint")


def first_mismatch(exc: Exception) -> str:
    """The informative line of load_state_dict's error (which key or shape does not fit)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if any(word in line for word in ("size mismatch", "Missing key", "Unexpected key")):
            return line[:300]
    return lines[0] if lines else type(exc).__name__


def rng_state() -> dict[str, Any]:
    """Every global random generator: torch's (and CUDA's), numpy's and Python's, in types torch.load
    reads with weights_only (a user's augmentation may draw from any of them)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    version, python_state, python_gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": {"version": version, "state": list(python_state), "gauss": python_gauss}}
    if torch.cuda.is_available():  # this rank's GPU only: a resume may see other GPUs, or fewer (one per task)
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore rng_state() output (checkpoints written before numpy's and Python's were kept lack them)."""
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        if "cuda_device" in state:
            torch.cuda.set_rng_state(state["cuda_device"], device)
        elif "cuda" in state and device < len(state["cuda"]):  # written with every GPU's state: this one's
            torch.cuda.set_rng_state(state["cuda"][device], device)
    if "numpy" in state:
        saved = state["numpy"]
        np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["position"],
                             saved["has_gauss"], saved["gauss"]))
    if "python" in state:
        saved = state["python"]
        random.setstate((saved["version"], tuple(saved["state"]), saved["gauss"]))
