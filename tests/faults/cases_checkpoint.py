"""Damaged checkpoints resumed by pretrain (in-process, a world of one): every file of a checkpoint
missing, empty, truncated, flipped or replaced; `latest` missing or wrong; checkpoint.load pointing
at the wrong thing; checkpoints of another model."""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

from tests.faults.cases_config import TINY, pretrain
from tests.faults.corpus import Case

STEP = "step_0000002"
_saved: Optional[Path] = None


def saved_run() -> Path:
    """A run of the tiny model with checkpoints at steps 1 and 2 (`latest` = step 2), made once per process."""
    global _saved
    if _saved is None:
        from megalysses.tools.pretrain import main

        root = Path(tempfile.mkdtemp(prefix="corpus-ckpt-"))
        atexit.register(shutil.rmtree, root, True)
        sets = TINY + [f"logging.run_dir={root}/run", "training.train_steps=2", "checkpoint.save_interval=1"]
        with contextlib.redirect_stdout(io.StringIO()):
            status = main([a for o in sets for a in ("--set", o)])
        if status != 0:
            raise RuntimeError("could not save the corpus's checkpoint")
        _saved = root / "run"
    return _saved


def resume(damage: Callable[[Path], None], *overrides: str, fallback: bool = False) -> Callable[[Path], int]:
    """A case body: copy the saved run, damage its checkpoint directory, resume it to step 4."""
    def prepare(tmp: Path) -> None:
        shutil.copytree(saved_run(), tmp / "run")
        damage(tmp / "run" / "checkpoints")
    extra = ["training.train_steps=4"] + ([] if fallback else ["checkpoint.fallback=false"])
    return pretrain(*extra, *overrides, prepare=prepare)


# ----------------------------------------------------------------------------- damage


def _file(name: str, step: str = STEP) -> Callable[[Path], Path]:
    return lambda ckpts: ckpts / step / name


def truncate(name: str, keep: float = 0.5) -> Callable[[Path], None]:
    def go(ckpts: Path) -> None:
        p = _file(name)(ckpts)
        p.write_bytes(p.read_bytes()[:int(p.stat().st_size * keep)])
    return go


def write(name: str, data: bytes, step: str = STEP) -> Callable[[Path], None]:
    return lambda ckpts: _file(name, step)(ckpts).write_bytes(data)


def remove(name: str) -> Callable[[Path], None]:
    return lambda ckpts: _file(name)(ckpts).unlink()


def flip(name: str, at: float = 0.5, step: str = STEP) -> Callable[[Path], None]:
    def go(ckpts: Path) -> None:
        p = _file(name, step)(ckpts)
        data = bytearray(p.read_bytes())
        data[int(len(data) * at)] ^= 0x01
        p.write_bytes(bytes(data))
    return go


def zero_block(name: str) -> Callable[[Path], None]:
    def go(ckpts: Path) -> None:
        p = _file(name)(ckpts)
        data = bytearray(p.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4096] = bytes(len(data[middle:middle + 4096]))
        p.write_bytes(bytes(data))
    return go


def append(name: str) -> Callable[[Path], None]:
    def go(ckpts: Path) -> None:
        with open(_file(name)(ckpts), "ab") as f:
            f.write(b"\0" * 100)
    return go


def both(*damages: Callable[[Path], None]) -> Callable[[Path], None]:
    def go(ckpts: Path) -> None:
        for d in damages:
            d(ckpts)
    return go


def _from_older_step(ckpts: Path) -> None:
    shutil.copyfile(ckpts / "step_0000001" / "__0_0.distcp", ckpts / STEP / "__0_0.distcp")


def _only_step_2(ckpts: Path) -> None:
    shutil.rmtree(ckpts / "step_0000001")


def _step_file(ckpts: Path) -> None:
    (ckpts / "step_0000009").write_text("not a directory")
    (ckpts / "latest").write_text("step_0000009\n")


def _empty_step(ckpts: Path) -> None:
    (ckpts / "step_0000005").mkdir()
    (ckpts / "latest").write_text("step_0000005\n")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def _killed_background_write(ckpts: Path) -> None:
    """What a rank killed while step 3 was written in the background leaves: its .tmp directory (here with every
    file already there, the rename not yet done) beside `latest`, which still names step 2."""
    shutil.copytree(ckpts / STEP, ckpts / "step_0000003.tmp")


def _evil_metadata(ckpts: Path) -> None:
    """.metadata replaced by a pickle that runs a command, and the manifest updated to match."""
    from megalysses.checkpoint.manifest import write_manifest

    step = ckpts / STEP
    (step / ".metadata").write_bytes(pickle.dumps(_Evil()))
    (step / "manifest.json").unlink()
    write_manifest(step, {})


def _legacy_truncated(ckpts: Path) -> None:
    """A checkpoint from before manifests (no checksums) whose shard was cut short."""
    step = ckpts / STEP
    (step / "manifest.json").unlink()
    meta = json.loads((step / "meta.json").read_text())
    meta.pop("format")
    (step / "meta.json").write_text(json.dumps(meta))
    truncate("__0_0.distcp")(ckpts)


# ----------------------------------------------------------------------------- cases

SHARD = "__0_0.distcp"
FILES = [
    ("shard_truncated", truncate(SHARD), SHARD), ("shard_empty", write(SHARD, b""), SHARD),
    ("shard_missing", remove(SHARD), SHARD), ("shard_flipped_byte", flip(SHARD), SHARD),
    ("shard_flipped_first_byte", flip(SHARD, 0.0), SHARD), ("shard_flipped_last_byte", flip(SHARD, 0.9999), SHARD),
    ("shard_zeroed_block", zero_block(SHARD), SHARD), ("shard_from_older_step", _from_older_step, SHARD),
    ("shard_with_trailing_bytes", append(SHARD), SHARD),
    ("metadata_missing", remove(".metadata"), ".metadata"), ("metadata_garbage", write(".metadata", b"\x80garbage"),
                                                                ".metadata"),
    ("metadata_truncated", truncate(".metadata"), ".metadata"),
    ("metadata_empty", write(".metadata", b""), ".metadata"),
    ("metadata_flipped_byte", flip(".metadata"), ".metadata"),
    ("meta_json_garbage", write("meta.json", b"{step: two"), "meta.json"),
    ("meta_json_empty", write("meta.json", b""), "meta.json"),
    ("meta_json_incomplete", write("meta.json", b'{"step": 2}'), "meta.json"),
    ("meta_json_missing", remove("meta.json"), "meta.json"),
    ("rng_garbage", write("rng_rank0.pt", b"not a tensor file"), "rng_rank0.pt"),
    ("rng_missing", remove("rng_rank0.pt"), "rng_rank0.pt"), ("rng_empty", write("rng_rank0.pt", b""), "rng_rank0.pt"),
    ("manifest_missing", remove("manifest.json"), "manifest.json"),
    ("manifest_garbage", write("manifest.json", b"\x00\x01garbage"), "manifest.json"),
    ("manifest_empty", write("manifest.json", b""), "manifest.json"),
    ("manifest_newer_format", write("manifest.json", b'{"format":2,"files":{"x":[1,2]}}'), "manifest.json"),
    ("manifest_flipped_byte", flip("manifest.json"), STEP),
]

LATEST = [
    ("latest_binary", write("latest", bytes(range(200, 256)), step=""), "latest"),
    ("latest_empty", write("latest", b"", step=""), "latest"),
    ("latest_names_a_missing_step", write("latest", b"step_0000007\n", step=""), "step_0000007"),
    ("latest_unpadded_name", write("latest", b"step_2\n", step=""), "latest"),
    ("latest_path_traversal", write("latest", b"../../../etc\n", step=""), "latest"),
    ("latest_names_a_file", _step_file, "latest"),
    ("latest_missing", lambda ckpts: (ckpts / "latest").unlink(), "latest is missing"),
    ("latest_names_an_empty_step", _empty_step, "manifest.json is missing"),
]

CASES = [Case(f"checkpoint/{name}", resume(damage), expect) for name, damage, expect in FILES + LATEST] + [
    Case("checkpoint/every_checkpoint_corrupt_with_fallback",
         resume(both(flip(SHARD), flip(SHARD, step="step_0000001")), fallback=True), "no older checkpoint"),
    Case("checkpoint/only_checkpoint_corrupt_with_fallback", resume(both(_only_step_2, truncate(SHARD)), fallback=True),
         SHARD),
    Case("checkpoint/metadata_unpickles_a_command", resume(_evil_metadata), "refusing to unpickle"),
    Case("checkpoint/killed_background_write_never_resumed",
         resume(both(_killed_background_write, flip(SHARD), flip(SHARD, step="step_0000001")), fallback=True),
         "no older checkpoint"),
    Case("checkpoint/legacy_checkpoint_truncated", resume(_legacy_truncated), "cannot be loaded"),
    Case("checkpoint/load_missing_path", pretrain("checkpoint.load={tmp}/nowhere"), "does not exist"),
    Case("checkpoint/load_a_file", pretrain("checkpoint.load={tmp}/file.pt",
                                            prepare=lambda tmp: (tmp / "file.pt").write_bytes(b"x")), "is a file"),
    Case("checkpoint/load_an_empty_directory", pretrain("checkpoint.load={tmp}/empty",
                                                        prepare=lambda tmp: (tmp / "empty").mkdir()),
         "no checkpoint there"),
    Case("checkpoint/load_a_corrupt_step", resume(flip(SHARD), "checkpoint.load={tmp}/run/checkpoints/" + STEP,
                                                  fallback=True), SHARD),
    Case("checkpoint/other_model_width", resume(lambda ckpts: None, "model.hidden_size=64"), "different model shape"),
    Case("checkpoint/other_vocabulary", resume(lambda ckpts: None, "model.vocab_size=256"), "vocab_size"),
    Case("checkpoint/other_depth", resume(lambda ckpts: None, "model.num_layers=4"), "num_layers"),
    Case("checkpoint/other_tied_embeddings", resume(lambda ckpts: None, "model.tie_embeddings=true"), "tie_embeddings"),
    Case("checkpoint/other_mlp", resume(lambda ckpts: None, "model.mlp=gelu"), "mlp"),
    Case("checkpoint/other_kv_heads", resume(lambda ckpts: None, "model.num_kv_heads=2"), "num_kv_heads"),
    Case("checkpoint/load_the_run_directory", resume(lambda ckpts: None, "checkpoint.load={tmp}/run"),
         "checkpoints"),
    Case("checkpoint/exit_at_step_already_passed", resume(lambda ckpts: None, "training.exit_at_step=1"),
         "exit_at_step=1"),
]
