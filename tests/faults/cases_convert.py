"""Damaged Hugging Face models and output paths that cannot be written, given to tools/convert_checkpoint.py
(megalysses.tools.convert_checkpoint.main) in both directions."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from tests.faults.corpus import Case


def hf_model(damage: Optional[Callable[[Path], None]] = None, shards: bool = False) -> Callable[[Path], str]:
    """A tiny Llama saved by transformers (one file, or several shards and their index); damage(folder) last."""
    def build(tmp: Path) -> str:
        import torch
        import transformers
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        folder = tmp / "hf"
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="10KB" if shards else "1GB")
        if damage is not None:
            damage(folder)
        return str(folder)
    return build


def cut(name: str, keep: float) -> Callable[[Path], None]:
    def go(folder: Path) -> None:
        path = sorted(folder.glob(name))[-1]
        path.write_bytes(path.read_bytes()[:int(path.stat().st_size * keep)])
    return go


def garbage(name: str) -> Callable[[Path], None]:
    return lambda folder: sorted(folder.glob(name))[0].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")


def read_only(tmp: Path) -> Path:
    """A directory this process cannot write in: a read-only one, or for root (whom permissions do not stop)
    a place in /sys, where nothing can be created."""
    if os.geteuid() != 0:
        (tmp / "ro").mkdir()
        (tmp / "ro").chmod(0o555)
        return tmp / "ro"
    return Path("/sys/megalysses-read-only")


def from_hf(source: Callable[[Path], str] = hf_model(), to: Callable[[Path], Path] = lambda tmp: tmp / "run"
            ) -> Callable[[Path], int]:
    def run(tmp: Path) -> int:
        from megalysses.tools.convert_checkpoint import main
        folder = source(tmp)
        return main(["--from-hf", folder, "--to", str(to(tmp))])
    return run


def to_hf(to: Callable[[Path], Path]) -> Callable[[Path], int]:
    """--to-hf from a run imported from the tiny Llama, into to(tmp)."""
    def run(tmp: Path) -> int:
        from megalysses.tools.convert_checkpoint import main
        if from_hf()(tmp) != 0:
            raise RuntimeError("could not import the corpus's model")
        return main(["--from", str(tmp / "run"), "--to-hf", str(to(tmp))])
    return run


def a_file(tmp: Path) -> Path:
    (tmp / "taken").write_text("a file in the way")
    return tmp / "taken"


def a_folder_with_files(tmp: Path) -> Path:
    (tmp / "old").mkdir()
    (tmp / "old" / "model.safetensors").write_bytes(b"an earlier export")
    return tmp / "old"


CASES = [
    Case("convert/from_hf_safetensors_truncated", from_hf(hf_model(cut("*.safetensors", 0.5))),
         "not a readable safetensors file"),
    Case("convert/from_hf_safetensors_header_only", from_hf(hf_model(cut("*.safetensors", 0.01))),
         "not a readable safetensors file"),
    Case("convert/from_hf_safetensors_empty", from_hf(hf_model(cut("*.safetensors", 0))),
         "not a readable safetensors file"),
    Case("convert/from_hf_safetensors_garbage", from_hf(hf_model(garbage("*.safetensors"))),
         "not a readable safetensors file"),
    Case("convert/from_hf_last_shard_truncated", from_hf(hf_model(cut("model-*.safetensors", 0.5), shards=True)),
         "not a readable safetensors file"),
    Case("convert/from_hf_first_shard_garbage", from_hf(hf_model(garbage("model-*.safetensors"), shards=True)),
         "not a readable safetensors file"),
    Case("convert/to_is_a_file", from_hf(to=a_file), "is a file"),
    Case("convert/to_below_a_file", from_hf(to=lambda tmp: a_file(tmp) / "run"), "which is a file"),
    Case("convert/to_read_only", from_hf(to=lambda tmp: read_only(tmp) / "run"), "cannot be written"),
    Case("convert/to_hf_is_a_file", to_hf(a_file), "is a file"),
    Case("convert/to_hf_below_a_file", to_hf(lambda tmp: a_file(tmp) / "hf"), "which is a file"),
    Case("convert/to_hf_holds_files", to_hf(a_folder_with_files), "already holds files"),
    Case("convert/to_hf_read_only", to_hf(lambda tmp: read_only(tmp) / "out" / "hf"), "cannot be written"),
]
