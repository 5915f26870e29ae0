"""Hugging Face model directories on disk: config.json plus safetensors (one file, or shards with
model.safetensors.index.json), read lazily tensor by tensor and written in shards.

    config, tensors = open_hf_dir("meta-llama/Llama-3.2-1B")   # a local folder
    t = tensors.get("model.embed_tokens.weight")                # mmapped read of one tensor
    write_hf_dir(out, named_tensors, config_dict, max_shard_bytes=5 * 2**30)

Needs the `safetensors` package (a dependency of transformers; `pip install safetensors`).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import Tensor

INDEX = "model.safetensors.index.json"


class HFFormatError(ValueError):
    """A folder that is not a Hugging Face model directory we can read."""


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open
    except ImportError:
        raise HFFormatError("reading or writing Hugging Face models needs safetensors: "
                            "pip install safetensors") from None
    return safe_open


def _damaged(path: Path, err: Exception) -> HFFormatError:
    return HFFormatError(f"{path} is not a readable safetensors file ({' '.join(str(err).split())[:200]}): it is "
                         f"damaged or incomplete; download or copy it again")


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and ((p / INDEX).is_file() or any(p.glob("*.safetensors")))


class HFTensors:
    """Lazy access to the tensors of a Hugging Face model directory (safetensors, mmapped)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self._open, self._files = folder, _safetensors(), {}
        index = folder / INDEX
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise HFFormatError(f"{index} is not a safetensors index (no weight_map): {e}") from None
            return
        files = sorted(folder.glob("*.safetensors"))
        if len(files) != 1:
            raise HFFormatError(f"{folder} has {len(files)} .safetensors files and no {INDEX}")
        handle = self._open_file(files[0])
        self._files[files[0].name] = handle
        self.weight_map = {k: files[0].name for k in handle.keys()}

    def _open_file(self, path: Path):
        try:
            return self._open(str(path), framework="pt")
        except Exception as e:   # safetensors' SafetensorError, which has no public base besides Exception
            raise _damaged(path, e) from None

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"{self.folder} has no tensor {name}")
        file = self.weight_map[name]
        if file not in self._files:
            path = self.folder / file
            if not path.is_file():
                raise HFFormatError(f"{self.folder}: the index names {file}, which is missing")
            self._files[file] = self._open_file(path)
        return self._files[file], self.folder / file

    def get(self, name: str) -> Tensor:
        handle, path = self._handle(name)
        try:
            return handle.get_tensor(name)
        except Exception as e:   # as above
            raise _damaged(path, e) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from its file's header (nothing read)."""
        handle, path = self._handle(name)
        try:
            return tuple(handle.get_slice(name).get_shape())
        except Exception as e:   # as above
            raise _damaged(path, e) from None


def open_hf_dir(path: str | Path) -> tuple[dict, HFTensors]:
    """(config.json as a dict, lazy tensors) of a Hugging Face model directory."""
    folder = Path(path)
    if not folder.is_dir():
        raise HFFormatError(f"{folder} is not a directory")
    if not (folder / "config.json").is_file():
        raise HFFormatError(f"{folder} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{folder / 'config.json'} is not valid JSON: {e}") from None
    if not is_hf_dir(folder):
        raise HFFormatError(f"{folder} has no .safetensors weights (pytorch_model.bin is not read: convert it "
                            f"to safetensors first)")
    return config, HFTensors(folder)


def check_new_dir(path: str | Path) -> None:
    """Raise HFFormatError unless `path` can become a new model directory: absent (below directories, not
    below a file) or an empty directory."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise HFFormatError(f"{folder} is a file: give the path of a new directory")
    if folder.is_dir() and any(folder.iterdir()):
        raise HFFormatError(f"{folder} already holds files (e.g. {next(folder.iterdir()).name}): give a new or "
                            f"empty directory, or remove this one first")
    for parent in folder.parents:
        if parent.exists():
            if not parent.is_dir():
                raise HFFormatError(f"{folder} lies below {parent}, which is a file: give a path below a directory")
            break


def write_hf_dir(path: str | Path, tensors: Iterable[tuple[str, Tensor]], config: dict,
                 max_shard_bytes: int = 5 * 2**30, extra: Optional[dict[str, bytes]] = None) -> list[Path]:
    """Write config.json, the tensors as safetensors shards of at most max_shard_bytes (one file,
    model.safetensors, when they fit; else model-0000i-of-0000n.safetensors and the index) and the `extra`
    files (name -> bytes: generation_config.json, tokenizer files), every file with the mode the umask gives.
    The folder is written under a temporary name beside it and renamed when complete, so it is complete or
    absent; it must be new or empty (check_new_dir). Returns the weight files. Raises HFFormatError when it
    cannot be written."""
    _safetensors()
    from safetensors.torch import save_file

    folder = Path(path)
    check_new_dir(folder)
    created = next((p for p in reversed([folder, *folder.parents]) if not p.exists()), None)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    try:
        tmp.mkdir(parents=True)
        for shard, name in zip(shards, names):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
        if n > 1:
            total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: name for shard, name in zip(shards, names) for k in shard}}
            (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        # safetensors writes through a temporary file of mode 0600: give the weights the mode the umask gives,
        # as config.json has it
        mode = stat.S_IMODE((tmp / "config.json").stat().st_mode)
        for name in names:
            os.chmod(tmp / name, mode)
        os.replace(tmp, folder)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None and created != folder:
            shutil.rmtree(created, ignore_errors=True)
        if isinstance(e, OSError):
            raise HFFormatError(f"{folder} cannot be written ({e.strerror or e}): choose a place this user can "
                                f"write to, with room for the model") from None
        raise
    return [folder / name for name in names]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
