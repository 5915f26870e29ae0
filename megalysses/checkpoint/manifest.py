"""Checkpoint integrity and the checkpoint directory: checksums, choosing what to resume, pruning.

Every file of a checkpoint is listed in its `manifest.json` with its size and CRC-32, computed at save
(each rank reads back the files it wrote while they are still in the page cache) and written before
the directory is renamed into place. Loading verifies every file against it, split over the ranks, so
a truncated, empty, missing or bit-flipped file is named before any tensor is read.

Resuming (`checkpoint.load: auto` or a directory) starts from the checkpoint `latest` names. When it
does not verify, or `latest` is missing or unreadable, `checkpoint.fallback: true` resumes from the
newest older checkpoint that verifies and says so; with `fallback: false` the run stops, naming the
file. A path to one checkpoint is used as given, never replaced by another.

Timelines. A checkpoint directory holds one timeline and `latest` names its head. A run that resumes
from an earlier checkpoint (an explicit `checkpoint.load`, or a fallback) starts a new timeline: at its
first save, checkpoints with a higher step than the one just saved belong to the abandoned timeline
and are moved to `<dir>/abandoned/` (kept, never deleted, never resumed from automatically). Pruning
(`keep_last`) then counts back from the checkpoint just saved, which `latest` names and which is
therefore never deleted. Nor is a checkpoint holding a `KEEP` file: the weights a `checkpoint.init_from`
names (tools/convert_checkpoint.py --from-hf writes one into the step-0 weights it converts, and a run that
starts from one checkpoint folder writes one there), each line of it saying who needs it; delete the file to
let pruning remove the checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megalysses.distributed import print0

MANIFEST = "manifest.json"
LATEST = "latest"
KEEP = "KEEP"
"""A file in a checkpoint that pruning respects: the checkpoint stays (each line says which run needs it)."""
ABANDONED = "abandoned"
FORMAT = 1
_CHUNK = 1 << 24


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or for another model shape."""


# ----------------------------------------------------------------------------- checksums

def file_checksum(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of a file, read in 16 MiB chunks."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def own_files(directory: Path, rank: int) -> list[str]:
    """The files rank `rank` writes into a checkpoint: its DCP shards and its RNG state."""
    return sorted(p.name for p in directory.glob(f"__{rank}_*")) + [f"rng_rank{rank}.pt"]


def checksums(directory: Path, names: list[str]) -> dict[str, list[int]]:
    return {name: list(file_checksum(directory / name)) for name in names if (directory / name).is_file()}


def write_manifest(directory: Path, known: dict[str, list[int]]) -> None:
    """Record every file of `directory` (checksums in `known` are reused, the rest computed here) but a KEEP
    file, which runs that start from the checkpoint may add to."""
    files = dict(known)
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in (MANIFEST, KEEP) and p.name not in files:
            files[p.name] = list(file_checksum(p))
    text = json.dumps({"format": FORMAT, "files": dict(sorted(files.items()))}, separators=(",", ":"))
    (directory / MANIFEST).write_text(text)


def read_manifest(directory: Path) -> dict[str, tuple[int, int]]:
    """{file: (size, crc32)}; raises CheckpointError naming manifest.json when it is not one."""
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a valid manifest ({type(e).__name__})") from None
    files = data.get("files") if isinstance(data, dict) else None
    ok = (isinstance(data, dict) and set(data) == {"format", "files"} and data["format"] == FORMAT
          and isinstance(files, dict) and files and all(
              isinstance(v, list) and len(v) == 2 and all(type(x) is int and x >= 0 for x in v)
              for v in files.values()))
    if not ok:
        raise CheckpointError(f"{path} is not a valid manifest")
    return {name: (v[0], v[1]) for name, v in files.items()}


def check_files(directory: Path, manifest: dict[str, tuple[int, int]], names: list[str]) -> list[str]:
    """Problems with the listed files: missing, wrong size, or a checksum that does not match."""
    problems = []
    for name in names:
        size, crc = manifest[name]
        path = directory / name
        try:
            actual = path.stat().st_size
            if actual != size:
                what = "empty" if actual == 0 else f"{actual} bytes instead of {size}"
                problems.append(f"{path} is {what} (truncated or incomplete)")
            elif file_checksum(path)[1] != crc:
                problems.append(f"{path} does not match its checksum (corrupt)")
        except FileNotFoundError:
            problems.append(f"{path} is missing")
        except OSError as e:
            problems.append(f"{path} cannot be read: {e.strerror}")
    return problems


def _share(manifest: dict[str, tuple[int, int]], rank: int, world: int) -> list[str]:
    """This rank's part of the files, balanced by size (largest first to the least loaded rank)."""
    load = [0] * world
    mine = []
    for name in sorted(manifest, key=lambda n: (-manifest[n][0], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += manifest[name][0]
        if r == rank:
            mine.append(name)
    return mine


def _collective() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _from_rank0(value: Any) -> Any:
    if _collective():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def verify_checkpoint(directory: Path) -> list[str]:
    """Every problem found in one checkpoint (empty when it verifies). Collective when a process group of
    more than one rank exists: every rank calls it, the files are checked in parallel, and every rank
    gets the same answer."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _collective() else (0, 1)
    head: Any = None
    if rank == 0:
        try:
            head = read_manifest(directory)
        except CheckpointError as e:
            head = str(e) if (directory / MANIFEST).exists() or _has_format(directory) else _legacy(directory)
    head = _from_rank0(head)
    if isinstance(head, str):
        return [head]
    if head is None:                       # saved before checksums existed: nothing to verify against
        return []
    problems = check_files(directory, head, _share(head, rank, world))
    if _collective():
        every: list = [None] * world
        dist.all_gather_object(every, problems)
        problems = [p for part in every for p in part]
    return problems


def _has_format(directory: Path) -> bool:
    """meta.json says the checkpoint was saved with a manifest (or cannot be read at all)."""
    try:
        return "format" in json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError, TypeError):
        return True


def _legacy(directory: Path) -> Optional[str]:
    """A checkpoint from before manifests: usable when its meta.json and DCP metadata are there."""
    for name in ("meta.json", ".metadata"):
        if not (directory / name).is_file():
            return f"{directory / name} is missing"
    print0(f"warning: {directory} was saved without checksums; it is loaded unverified")
    return None


# ----------------------------------------------------------------------------- the checkpoint directory

def step_of(path: Path) -> Optional[int]:
    m = re.fullmatch(r"step_(\d+)", path.name)
    return int(m.group(1)) if m else None


def checkpoints_in(root: Path) -> list[Path]:
    """The complete checkpoints of a directory (renamed into place), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def read_latest(root: Path) -> tuple[Optional[Path], Optional[str]]:
    """(the checkpoint `latest` names, None) or (None, what is wrong with `latest`)."""
    path = root / LATEST
    try:
        name = path.read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return None, f"{path} is missing"
    except (OSError, UnicodeDecodeError):
        return None, f"{path} is not a text file naming a checkpoint"
    target = root / name
    if not name or "/" in name or step_of(target) is None:
        return None, f"{path} does not name a checkpoint (it holds {name[:40]!r})"
    if not target.is_dir():
        return None, f"{path} names {target}, which does not exist"
    return target, None


def is_checkpoint(path: Path) -> bool:
    return any((path / name).exists() for name in (MANIFEST, "meta.json", ".metadata")) or step_of(path) is not None


def _plan(source: Path, explicit: bool) -> tuple[list[str], Optional[str], bool]:
    """(candidates newest first, what is wrong with `latest`, whether the source is one checkpoint)."""
    if not source.exists():
        if explicit:
            raise CheckpointError(f"checkpoint.load={source} does not exist")
        return [], None, False
    if not source.is_dir():
        raise CheckpointError(f"{source} is a file, not a checkpoint directory: set checkpoint.load (or "
                              f"checkpoint.dir) to a directory")
    if is_checkpoint(source):
        return [str(source)], None, True
    steps = checkpoints_in(source)
    head, problem = read_latest(source)
    if head is not None:
        older = [p for p in steps if step_of(p) < step_of(head)]
        return [str(head)] + [str(p) for p in reversed(older)], None, False
    if not steps and not (source / LATEST).exists():
        if explicit:
            hint = f": did you mean {source / 'checkpoints'}?" if checkpoints_in(source / "checkpoints") else ""
            raise CheckpointError(f"checkpoint.load={source}: no checkpoint there (no step_* directory, no "
                                  f"latest){hint}")
        return [], None, False
    return [str(p) for p in reversed(steps)], problem, False


def choose_checkpoint(source: str | Path, explicit: bool, fallback: bool) -> Optional[Path]:
    """The checkpoint to resume from, verified (None: start from scratch). Collective; see the module doc."""
    plan: Any = None
    if not _collective() or dist.get_rank() == 0:
        try:
            plan = _plan(Path(source), explicit)
        except CheckpointError as e:
            plan = str(e)
    plan = _from_rank0(plan)
    if isinstance(plan, str):
        raise CheckpointError(plan)
    candidates, latest_problem, single = plan
    if not candidates and not latest_problem:
        return None
    if latest_problem and not fallback:
        listed = ", ".join(Path(c).name for c in candidates[:3])
        raise CheckpointError(f"{latest_problem} but {Path(source)} holds checkpoints ({listed}): set "
                              f"checkpoint.fallback=true to resume from the newest that verifies, or "
                              f"checkpoint.load=<one of them>")
    first = latest_problem
    if latest_problem:
        print0(f"warning: {latest_problem}")
    for cand in map(Path, candidates):
        problems = verify_checkpoint(cand)
        if not problems:
            if first:
                print0(f"resuming from {cand} instead, the newest checkpoint that verifies (checkpoint.fallback)")
            return cand
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        found = f"checkpoint {cand} is corrupt or incomplete: {problems[0]}{more}"
        if single or not fallback:
            fix = "" if single else "; set checkpoint.fallback=true to resume from an older checkpoint that verifies"
            raise CheckpointError(f"{found}{fix}")
        first = first or found
        print0(f"warning: {found}")
    raise CheckpointError(f"{first}, and no older checkpoint in {Path(source)} verifies: start afresh with "
                          f"checkpoint.load=none, or restore the checkpoint files")


def prune(root: Path, saved: Path, keep_last: int) -> None:
    """After `saved` became `latest`: move a later timeline aside, then keep the `keep_last` newest
    checkpoints up to `saved` (rank 0 only)."""
    step = step_of(saved)
    later = [p for p in checkpoints_in(root) if step_of(p) > step]
    if later:
        aside = root / ABANDONED
        aside.mkdir(exist_ok=True)
        for p in later:
            target = aside / p.name
            n = 1
            while target.exists():
                target, n = aside / f"{p.name}.{n}", n + 1
            os.replace(p, target)
        print0(f"moved {len(later)} checkpoint(s) of an abandoned later timeline "
               f"({', '.join(p.name for p in later)}) to {aside}: this run continued from an earlier step; "
               f"delete them when they are no longer needed")
    if keep_last > 0:
        older = [p for p in checkpoints_in(root) if step_of(p) < step and not (p / KEEP).exists()]
        for old in older[:max(0, len(older) - (keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def mark_kept(checkpoint: Path, why: str) -> None:
    """Keep `checkpoint` from pruning (a KEEP file), adding the line `why` unless it is there. OSError when the
    checkpoint cannot be written."""
    path = checkpoint / KEEP
    lines = path.read_text().splitlines() if path.is_file() else []
    if why not in lines:
        with open(path, "a") as f:
            f.write(why + "\n")
