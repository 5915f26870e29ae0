"""Checkpoints with torch.distributed.checkpoint (DCP), under layout-independent names.

Every tensor is saved as a DTensor on the (tp, grad) mesh of its pipeline stage, so its full shape
and the coordinates of each rank's piece are recorded: parameters are Shard(tp_dim) over tp and
replicated over grad (Shard(0) over grad under FSDP); the optimizer state (fp32 master, exp_avg,
exp_avg_sq) is Shard(0) over grad under both ZeRO-1 and FSDP. Names are
global (`layers.7.attn.q_proj.weight`), so a checkpoint saved at one (tp, sp, dp, pp) loads at
another, with or without FSDP, and DCP reshards.

Layout on disk:
    <dir>/step_000100/            DCP files + meta.json (step, consumed samples, model shape)
    <dir>/latest                  text file naming the newest complete checkpoint, written last
A checkpoint is written to `step_000100.tmp` and renamed when every rank has finished, so it is
complete or absent; its manifest.json records a CRC-32 of every file, verified before loading, and
`manifest.py` chooses the checkpoint to resume from and prunes old ones. Loading reads tensors with
weights_only and the DCP metadata through an allow-list unpickler: nothing arbitrary is ever unpickled.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from megalysses.distributed import collective_failure
from megalysses.grid import ParallelGrid
from megalysses.checkpoint.manifest import (FORMAT, LATEST, CheckpointError, checksums, own_files, prune, read_latest,
                                          write_manifest)


# ----------------------------------------------------------------------------- safe metadata

_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                 "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.storage",
                 "torch.distributed.checkpoint._extension", "collections", "builtins", "torch", "torch.serialization")
_SAFE_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice"}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name not in _SAFE_BUILTINS:
            raise CheckpointError(f"checkpoint metadata refers to builtins.{name}: refusing to unpickle it")
        if module == "torch" and not (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            raise CheckpointError(f"checkpoint metadata refers to torch.{name}: refusing to unpickle it")
        if module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)
        if module.startswith(_SAFE_MODULES) or module in _SAFE_MODULES:
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}: refusing to unpickle it")


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read with an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        if not path.is_file():
            raise CheckpointError(f"checkpoint {self.path} has no DCP metadata ({path.name}): it is incomplete")
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
        try:
            metadata = _AllowListUnpickler(io.BytesIO(path.read_bytes())).load()
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except Exception:  # noqa: BLE001 - whatever a damaged pickle raises
            metadata = None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not DCP metadata: the checkpoint is damaged")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ----------------------------------------------------------------------------- state as DTensors

def _tp_placement(p: torch.Tensor) -> Any:
    tp_dim = getattr(p, "tp_dim", None)
    return Replicate() if tp_dim is None else Shard(tp_dim)


def _full_shape(p: torch.Tensor, tp: int) -> list[int]:
    shape = list(p.shape)
    if getattr(p, "tp_dim", None) is not None:
        shape[p.tp_dim] *= tp
    return shape


def dtensor_view(local: torch.Tensor, mesh: DeviceMesh, placements: list, shape: list[int]) -> DTensor:
    """`local` as this rank's piece of a DTensor of `shape` on `mesh`, the tensor itself wherever it is (as
    FSDP builds its sharded parameters). DTensor.from_local would copy a tensor in host memory (optimizer or
    parameter offload) to the mesh's device: a save would allocate the whole state there, and a load would
    fill the copy, not the tensor."""
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def model_entry(p: torch.Tensor, sub: DeviceMesh, tp: int) -> DTensor:
    """A parameter as a DTensor over (tp, grad): whole on every grad rank, or its dim-0 chunk under FSDP."""
    full = _full_shape(p, tp)
    if isinstance(p.data, DTensor):
        return dtensor_view(p.data.to_local(), sub, [_tp_placement(p), Shard(0)], full)
    return dtensor_view(p.data, sub, [_tp_placement(p), Replicate()], full)


def training_state(model: torch.nn.Module, opt: Any, grid: ParallelGrid, mesh: DeviceMesh) -> dict:
    """Tensors to save / load in place, keyed by layout-independent names."""
    sub = mesh["tp", "grad"]   # this rank's pipeline stage
    state: dict[str, Any] = {f"model.{name}": model_entry(p, sub, grid.tp_size)
                             for name, p in model.named_parameters()}
    for name, param, chunks in opt.checkpoint_slots():
        full = _full_shape(param, grid.tp_size)
        placements = [_tp_placement(param), Shard(0)]
        for kind, local in chunks.items():
            state[f"{kind}.{name}"] = dtensor_view(local, sub, placements, full)
    return state


# ----------------------------------------------------------------------------- save / load

def save_checkpoint(ckpt_dir: str | Path, step: int, model: torch.nn.Module, opt: Any,
                    grid: ParallelGrid, mesh: DeviceMesh, meta: dict, keep_last: int = 2) -> Path:
    """Write <dir>/step_N atomically (tmp dir + manifest + rename), then update `latest`, then prune."""
    tmp, final = begin_checkpoint(ckpt_dir, step, grid.rank)
    dcp.save(training_state(model, opt, grid, mesh), storage_writer=dcp.FileSystemWriter(str(tmp)))
    complete_checkpoint(Written(tmp, final, step, meta, {"torch": torch.get_rng_state()}, keep_last), grid.rank)
    return final


def begin_checkpoint(ckpt_dir: str | Path, step: int, rank: int) -> tuple[Path, Path]:
    """(the empty temporary directory every rank writes step `step` into, where it goes once complete)."""
    root = Path(ckpt_dir)
    final = root / f"step_{step:07d}"
    tmp = root / f"step_{step:07d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    return tmp, final


@dataclass(frozen=True)
class Written:
    """A checkpoint whose DCP files every rank has written into `tmp`: what completing it needs."""

    tmp: Path
    final: Path
    step: int
    meta: dict
    rng: dict               # this rank's RNG state when the state was taken
    keep_last: int


def complete_checkpoint(w: Written, rank: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Once every rank's DCP files are in `w.tmp`: each rank adds its RNG state and checksums its files (read back
    from the page cache), rank 0 gathers them into the manifest, renames the directory into place, points `latest`
    at it and prunes; collective over `group` (default: the world)."""
    torch.save(w.rng, w.tmp / f"rng_rank{rank}.pt")
    mine = checksums(w.tmp, own_files(w.tmp, rank))
    every: Optional[list] = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(mine, every, dst=0, group=group)
    if rank == 0:
        root = w.final.parent
        (w.tmp / "meta.json").write_text(json.dumps({**w.meta, "step": w.step, "format": FORMAT}, indent=1))
        write_manifest(w.tmp, {name: v for part in every for name, v in part.items()})
        shutil.rmtree(w.final, ignore_errors=True)
        os.replace(w.tmp, w.final)
        pointer = root / f"{LATEST}.tmp"
        pointer.write_text(w.final.name + "\n")
        os.replace(pointer, root / LATEST)
        prune(root, w.final, w.keep_last)
    dist.barrier(group=group)


def resolve_checkpoint(path: str | Path) -> Optional[Path]:
    """A checkpoint directory from a path that is either the checkpoint or a directory with `latest`."""
    p = Path(path)
    if (p / LATEST).exists():
        target, problem = read_latest(p)
        if problem:
            raise CheckpointError(problem)
        return target
    if (p / "meta.json").is_file():
        return p
    return None


def _load(state: dict, path: Path) -> None:
    """dcp.load that fails with one CheckpointError naming the checkpoint and the first cause."""
    SafeFileSystemReader(str(path)).read_metadata()      # its own message, not DCP's fallback tracebacks
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else e
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from None
        if collective_failure(cause):       # a stuck or lost rank, not a damaged checkpoint: the watchdog's case
            raise cause from None
        first = (str(cause).strip().splitlines() or [""])[0][:300]
        what = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
        raise CheckpointError(f"checkpoint {path} cannot be loaded ({what}): it is damaged or was not written "
                              f"by megalysses") from None


def load_model_weights(path: Path, model: torch.nn.Module, grid: ParallelGrid, mesh: DeviceMesh) -> None:
    """Load only the model weights (inference, conversion), resharding to this layout."""
    sub = mesh["tp", "grad"]
    state = {f"model.{n}": model_entry(p, sub, grid.tp_size) for n, p in model.named_parameters()}
    _load(state, path)


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json; CheckpointError naming it when it is missing, empty or not what we wrote."""
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from None
    except (OSError, ValueError):
        raise CheckpointError(f"{file} is not valid JSON: the checkpoint is damaged") from None
    if not isinstance(meta, dict) or type(meta.get("step")) is not int or meta["step"] < 0:
        raise CheckpointError(f"{file} does not record the step: the checkpoint is damaged or incomplete")
    return meta


def check_model_shape(path: Path, expect_model: dict) -> dict:
    """The checkpoint's meta.json, after checking that it holds the model `expect_model` describes."""
    meta = read_meta(path)
    saved = meta.get("model_shape", {})
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path / 'meta.json'} does not record the model shape: the checkpoint is damaged")
    detail = model_differences(saved, expect_model)
    if detail:
        raise CheckpointError(f"checkpoint {path} is for a different model shape ({detail}): "
                              f"use a matching model config or another checkpoint.load / checkpoint.dir")
    return meta


def model_differences(saved: dict, expect_model: dict) -> str:
    """'key: checkpoint a vs config b, ...' for each key of `expect_model` that the checkpoint's recorded
    model shape `saved` holds otherwise; '' when they agree."""
    return ", ".join(f"{k}: checkpoint {saved.get(k)} vs config {v}" for k, v in expect_model.items()
                     if saved.get(k) != v)


def load_checkpoint(path: Path, model: torch.nn.Module, opt: Any, grid: ParallelGrid, mesh: DeviceMesh,
                    expect_model: dict) -> dict:
    """Load model + optimizer (resharding to this layout) and return meta (step, consumed samples, ...)."""
    meta = check_model_shape(path, expect_model)
    state = training_state(model, opt, grid, mesh)
    _load(state, path)
    opt.set_step(meta.get("optimizer_steps", meta["step"]))    # AdamW's count: skipped steps excluded
    rng_file = path / f"rng_rank{grid.rank}.pt"
    if rng_file.is_file():
        try:
            rng = torch.load(rng_file, weights_only=True)["torch"]
            torch.set_rng_state(rng)
        except Exception:  # noqa: BLE001 - any failure to read it means the file is damaged
            raise CheckpointError(f"{rng_file} is not a saved RNG state: the checkpoint is damaged") from None
    return meta
