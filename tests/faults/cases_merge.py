"""Bad folders and arguments given to tools/merge_datasets.py (megalysses.tools.merge_datasets.main)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from tests.faults.corpus import Case


def shards(*specs: tuple[str, str], damage: Optional[Callable[[Path], None]] = None) -> Callable[[Path], str]:
    """A folder of datasets named and typed by specs [(name, dtype)], each of two documents; `damage(folder)`
    runs last."""
    def build(tmp: Path) -> str:
        import numpy as np

        from megalysses.data.indexed import IndexedDatasetBuilder
        folder = tmp / "shards"
        folder.mkdir(exist_ok=True)
        for name, dtype in specs:
            builder = IndexedDatasetBuilder(folder / f"{name}.bin", np.dtype(dtype))
            builder.add_document([1, 2, 3])
            builder.add_document([4, 5])
            builder.finalize(folder / f"{name}.idx")
        if damage is not None:
            damage(folder)
        return str(folder)
    return build


GOOD = (("a", "uint16"), ("b", "uint16"))


def merge(source: Callable[[Path], str] = shards(*GOOD), *extra: str, output: str = "{tmp}/out/merged"
          ) -> Callable[[Path], int]:
    def run(tmp: Path) -> int:
        from megalysses.tools.merge_datasets import main
        main(["--input", source(tmp), "--output-prefix", output.format(tmp=tmp), *[a.format(tmp=tmp) for a in extra]])
        return 0
    return run


def remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def cut(name: str, keep: int) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:keep])


def identities(**kinds: str) -> Callable[[Path], None]:
    """The identity of a tokenizer of each kind (byte, null, ...) recorded beside shard NAME, as preprocessing
    records it."""
    def damage(folder: Path) -> None:
        from megalysses.data.tokenizer import build_tokenizer
        from megalysses.data.tokenizer_identity import tokenizer_identity, write_identity
        for name, kind in kinds.items():
            write_identity(folder / name, tokenizer_identity(build_tokenizer(kind, vocab_size=300)))
    return damage


def below_a_file(tmp: Path) -> int:
    (tmp / "afile").write_text("x")
    return merge(output="{tmp}/afile/merged")(tmp)


CASES = [
    Case("merge/input_missing", merge(lambda tmp: str(tmp / "nowhere")), "no such directory"),
    Case("merge/input_is_a_file", merge(lambda tmp: (tmp / "f.bin").write_text("x") and str(tmp / "f.bin")),
         "not a directory"),
    Case("merge/input_empty", merge(lambda tmp: (tmp / "empty").mkdir() or str(tmp / "empty")), "no .bin/.idx pairs"),
    Case("merge/input_has_only_other_files", merge(lambda tmp: (tmp / "d").mkdir() or (tmp / "d" / "x.txt").write_text(
        "x") and str(tmp / "d")), "no .bin/.idx pairs"),
    Case("merge/idx_missing", merge(shards(*GOOD, damage=remove("b.idx"))), "b.bin has no b.idx"),
    Case("merge/bin_missing", merge(shards(*GOOD, damage=remove("a.bin"))), "a.idx has no a.bin"),
    Case("merge/mixed_dtypes", merge(shards(("a", "uint16"), ("b", "int32"))), "different dtypes"),
    Case("merge/idx_truncated", merge(shards(*GOOD, damage=cut("b.idx", 40))), "truncated index"),
    Case("merge/bin_truncated", merge(shards(*GOOD, damage=cut("a.bin", 4))), "truncated .bin"),
    Case("merge/idx_garbage", merge(shards(*GOOD, damage=lambda f: (f / "a.idx").write_bytes(b"x" * 64))),
         "bad magic"),
    Case("merge/shards_of_different_tokenizers", merge(shards(*GOOD, damage=identities(a="byte", b="null"))),
         "the shards of one dataset need one tokenizer"),
    Case("merge/shard_tokenizer_record_garbage", merge(shards(*GOOD, damage=lambda f: (
        f / "b.tokenizer.json").write_text("{not json"))), "b.tokenizer.json: cannot be read"),
    Case("merge/output_is_a_directory", merge(output="{tmp}"), "is a directory"),
    Case("merge/output_below_a_file", below_a_file, "is a file"),
    Case("merge/output_inside_input", merge(output="{tmp}/shards/merged"), "inside --input"),
    Case("merge/output_with_bin_suffix", merge(shards(*GOOD), "--output-prefix", "{tmp}/merged.bin"),
         "without .bin/.idx"),
    Case("merge/multimodal", merge(shards(*GOOD), "--multimodal"), "--multimodal"),
    Case("merge/input_flag_missing", lambda tmp: __import__("megalysses.tools.merge_datasets", fromlist=["main"]).main(
        ["--output-prefix", str(tmp / "x")]), "--input"),
]
