"""Starting weights from elsewhere: a Hugging Face model directory, or the weights of a megalysses run or
checkpoint (full, or weights-only as tools/convert_checkpoint.py writes it), at any layout. A run directory
means the checkpoint its checkpoints/latest names; a checkpoint is verified against its manifest first.

    describe = load_initial_weights(cfg.checkpoint.init_from, model, cfg, grid, mesh)

Called on the freshly built fp32 model, before the optimizer takes its fp32 masters from it, so the
optimizer starts fresh from exactly these weights. A Hugging Face directory is read tensor by tensor
(mmapped safetensors): each rank converts one parameter at a time to our layout and keeps its own tp
shard (and, under FSDP, its own dim-0 chunk). A megalysses checkpoint is read with DCP, resharded to
this layout; from a full checkpoint the fp32 masters are taken, not the rounded compute weights. A
Hugging Face directory's tensors are checked against the shapes its config.json predicts before any is read;
one checkpoint folder named directly is kept from pruning (a KEEP file, checkpoint/manifest.py), so that the
run can start from it again.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megalysses.config import Config, ConfigError
from megalysses.distributed import on_rank0, print0
from megalysses.grid import ParallelGrid
from megalysses.model.gpt import architecture
from megalysses.model.hf import check_hf_names, check_hf_shapes, model_config_from_hf, our_tensor
from megalysses.model.hf_io import HFFormatError, is_hf_dir, open_hf_dir
from megalysses.checkpoint.dcp_io import (CheckpointError, SafeFileSystemReader, model_entry, check_model_shape,
                                            resolve_checkpoint)
from megalysses.checkpoint.manifest import mark_kept, verify_checkpoint

WEIGHTS_ONLY = "weights_only"


def is_weights_only(checkpoint: Path) -> bool:
    """A checkpoint holding model weights and no optimizer state (meta.json says so)."""
    try:
        return bool(json.loads((checkpoint / "meta.json").read_text()).get(WEIGHTS_ONLY, False))
    except (OSError, ValueError):
        return False


@torch.no_grad()
def _copy_full(p: nn.Parameter, full: torch.Tensor, grid: ParallelGrid) -> None:
    """Copy this rank's piece of the full tensor into p: its tp shard, and under FSDP its dim-0 chunk."""
    tp_dim = getattr(p, "tp_dim", None)
    piece = full if tp_dim is None else full.chunk(grid.tp_size, dim=tp_dim)[grid.tp_rank]
    local = p.data
    if hasattr(local, "to_local"):                              # FSDP2: Shard(0) over the grad group
        local = local.to_local()
        piece = piece.chunk(grid.grad_size, dim=0)[grid.grad_rank] if piece.shape[0] else piece
    if tuple(local.shape) != tuple(piece.shape):
        raise ConfigError(f"initial weights: {tuple(piece.shape)} where this model holds {tuple(local.shape)}")
    local.copy_(piece.to(local.dtype))


def _from_hf(folder: Path, model: nn.Module, cfg: Config, grid: ParallelGrid) -> str:
    config, tensors = open_hf_dir(folder)
    try:
        theirs = model_config_from_hf(config)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"checkpoint.init_from={folder}: {e}") from None
    ours_arch, their_arch = architecture(cfg.model), architecture(theirs)
    diff = {k: (their_arch.get(k), ours_arch.get(k)) for k in sorted({*ours_arch, *their_arch})
            if their_arch.get(k) != ours_arch.get(k)}
    if diff:
        detail = ", ".join(f"{k}: model {a} vs config {b}" for k, (a, b) in diff.items())
        raise ConfigError(f"checkpoint.init_from={folder} holds another model ({detail}): set the model section "
                          f"to the Hugging Face model's (tools/convert_checkpoint.py --from-hf writes one)")
    try:
        check_hf_names(tensors.keys(), cfg.model)
        check_hf_shapes(tensors.shape, cfg.model)           # each tensor's header, before any tensor is read
    except KeyError as e:
        raise ConfigError(f"checkpoint.init_from={folder}: {e.args[0]}") from None
    except HFFormatError:                                 # said by load_initial_weights
        raise
    except ValueError as e:
        raise ConfigError(f"checkpoint.init_from={folder}: {e}") from None
    for name, p in model.named_parameters():
        _copy_full(p, our_tensor(name, cfg.model, tensors.get).float(), grid)
    # positions and the window are the run's to choose (a context extension changes the RoPE scaling): said, not refused
    m, changed = cfg.model, []
    if (theirs.rope_theta, theirs.rope_scaling) != (m.rope_theta, m.rope_scaling):
        changed.append(f"RoPE theta {m.rope_theta:g}, scaling {m.rope_scaling.type} where the model has "
                       f"{theirs.rope_theta:g}, {theirs.rope_scaling.type}")
    if theirs.sliding_window != m.sliding_window:
        changed.append(f"sliding window {m.sliding_window} where the model has {theirs.sliding_window}")
    return f"initial weights: the Hugging Face model {folder}" + (f" (this run: {'; '.join(changed)})"
                                                                   if changed else "")


def _from_checkpoint(path: Path, model: nn.Module, cfg: Config, grid: ParallelGrid, mesh: DeviceMesh) -> str:
    check_model_shape(path, architecture(cfg.model, grid.tp_size))
    prefix = "model" if is_weights_only(path) else "master"     # the fp32 masters of a training checkpoint
    sub = mesh["tp", "grad"]
    state = {f"{prefix}.{n}": model_entry(p, sub, grid.tp_size) for n, p in model.named_parameters()}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    return f"initial weights: {path}" + (" (weights only)" if prefix == "model" else "")


def _keep(path: Path, run_dir: str) -> None:
    """Rank 0: keep the checkpoint a run starts from out of pruning (a KEEP file, manifest.py), so that the run
    can start again from it; a warning where it cannot be written."""
    try:
        mark_kept(path, f"the initial weights of the run {Path(run_dir).absolute()}")
    except OSError as e:
        print0(f"warning: {path} cannot be marked to keep ({e.strerror or e}): pruning in its own run directory "
               f"(checkpoint.keep_last) may remove it, and this run could not start from it again")


def find_initial_checkpoint(source: str | Path) -> Path:
    """The checkpoint that init_from names: a run directory (its checkpoints/ folder), a checkpoint folder
    with `latest`, or one step_N checkpoint; verified against its manifest (collective when a process group
    exists). ConfigError when there is none or it does not verify."""
    folder = Path(source)
    try:
        path = resolve_checkpoint(folder / "checkpoints") if (folder / "checkpoints").is_dir() else None
        path = path or resolve_checkpoint(folder)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.init_from={source}: {e}") from None
    if path is None:
        raise ConfigError(f"checkpoint.init_from={source} is neither a Hugging Face model directory (config.json "
                          f"and safetensors) nor a megalysses run or checkpoint (checkpoints/latest, latest or "
                          f"meta.json): point it at a run that has saved a checkpoint, or at one step_N folder")
    problems = verify_checkpoint(path)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ConfigError(f"checkpoint.init_from={source}: checkpoint {path} is corrupt or incomplete: "
                          f"{problems[0]}{more}")
    return path


def load_initial_weights(source: str | Path, model: nn.Module, cfg: Config, grid: ParallelGrid,
                         mesh: DeviceMesh) -> str:
    """Fill the (fp32, not yet optimised) model with the weights at `source`; returns a line for the log."""
    folder = Path(source)
    if not folder.exists():
        raise ConfigError(f"checkpoint.init_from={source} does not exist")
    try:
        if is_hf_dir(folder):
            return _from_hf(folder, model, cfg, grid)
    except HFFormatError as e:
        raise ConfigError(f"checkpoint.init_from={source}: {e}") from None
    path = find_initial_checkpoint(folder)
    try:
        line = _from_checkpoint(path, model, cfg, grid, mesh)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.init_from={source}: {e}") from None
    if path == folder:                 # one checkpoint named (a run directory's `latest` moves on as it trains)
        on_rank0(lambda: _keep(path, cfg.logging.run_dir))
    return line
