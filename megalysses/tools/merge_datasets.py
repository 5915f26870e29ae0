"""Merge Megatron-format .bin/.idx datasets (the shards of a corpus tokenized on many machines) into one.

    python tools/merge_datasets.py --input data/shards --output-prefix data/corpus_text_document
    # -> data/corpus_text_document.bin / .idx

Megatron-LM's tools/merge_datasets.py command lines run unchanged. Every .bin/.idx pair in --input (not
its subfolders; other files are ignored) is appended in the sorted order of the names, as Megatron-LM
merges them, which is what preprocessing the shards' inputs one after another in one run writes, byte
for byte: number shards with zero-padded numbers (shard_007) so that name order is number order.
Before anything is written every pair is checked as training checks it when it opens it (structure and
sizes), and all must hold one dtype. Progress is reported per dataset (its documents and tokens, then
those merged so far, documents/s, MB/s, ETA); the output is written under temporary names and renamed
when complete, the .idx last, so an interrupted merge leaves nothing behind. --multimodal (indices with
sequence modes) is refused.

The tokenizer recorded beside each shard (`{shard}.tokenizer.json`, tools/preprocess_data.py) goes beside the
merged dataset when every shard has it; shards that record different tokenizers are refused.

Shards of conversations (tools/preprocess_data.py --chat) have their loss mask beside them
(`{shard}_loss_mask`): the masks are merged alike into `{output_prefix}_loss_mask`, so the merged tokens and
mask stay aligned; shards with a mask and shards without cannot be merged (blend them with data.paths).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from megalysses.data.indexed import (DatasetError, IndexedDataset, IndexedDatasetBuilder, bin_path, idx_path,
                                     loss_mask_prefix)
from megalysses.data.progress import Progress
from megalysses.data.tokenizer_identity import (SUFFIX, describe, read_identity, same_tokenizer, sidecar_path,
                                                write_identity)
from megalysses.tools.preprocess_data import Stopped, check_output_prefix, raise_stopped


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def find_pairs(folder: Path) -> tuple[list[str], list[str]]:
    """(the dataset prefixes in --input, in merge order; the other files, which are not merged). Raises
    DatasetError for a .bin without its .idx or the reverse."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    stems = {os.path.splitext(n)[0] for n in names if n.endswith((".bin", ".idx"))}
    for stem in sorted(stems):
        for have, need in ((".bin", ".idx"), (".idx", ".bin")):
            if stem + have in names and stem + need not in names:
                raise DatasetError(f"{folder / (stem + have)} has no {stem + need} beside it (a shard whose "
                                   f"preprocessing did not finish?): re-create the pair, or move {stem + have} out "
                                   f"of --input")
    others = [n for n in names if not n.endswith((".bin", ".idx"))
              and not (n.endswith(SUFFIX) and n[:-len(SUFFIX)] in stems)]      # the shards' tokenizers
    return [str(folder / stem) for stem in sorted(stems)], others


def _check_inputs(prefixes: list[str]) -> tuple[list[dict], Any]:
    """Every dataset opened (and so checked, then closed again: a merge may have thousands) with what the
    merge reports of it, and their common dtype; DatasetError for a mismatch."""
    found, first = [], None
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        first = first or ds
        if ds.dtype != first.dtype:
            raise DatasetError(f"{ds.idx_file} holds {ds.dtype} tokens but {first.idx_file} holds {first.dtype}: "
                               f"datasets of different dtypes (tokenized with different vocabularies: uint16 below "
                               f"65,500 ids, int32 above) cannot be merged; tokenize every shard with one tokenizer")
        found.append({"prefix": prefix, "documents": ds.num_documents, "tokens": ds.num_tokens,
                      "bytes": os.path.getsize(ds.bin_file) + os.path.getsize(ds.idx_file),
                      "bin_bytes": os.path.getsize(ds.bin_file)})
        del ds
    return found, first.dtype


def split_masks(prefixes: list[str]) -> tuple[list[str], list[str]]:
    """(the datasets, their loss masks in the same order, or none); DatasetError when only some have one."""
    masks = {loss_mask_prefix(p) for p in prefixes} & set(prefixes)
    datasets = [p for p in prefixes if p not in masks]
    have = [p for p in datasets if loss_mask_prefix(p) in masks]
    if have and len(have) != len(datasets):
        lacks = next(p for p in datasets if loss_mask_prefix(p) not in masks)
        raise DatasetError(f"{have[0]} has a loss mask beside it (conversations) but {lacks} has none: merge "
                           f"conversations and plain documents separately and blend them with data.paths")
    return datasets, [loss_mask_prefix(p) for p in have]


def common_identity(prefixes: list[str]) -> Optional[dict]:
    """The tokenizer every dataset records (None when some record none, said in a note); DatasetError when two
    record different ones."""
    records = []
    for prefix in prefixes:
        try:
            records.append(read_identity(prefix))
        except ValueError as e:
            raise DatasetError(f"{e}: remove it, or write {prefix} again with tools/preprocess_data.py") from None
    known = [(p, r) for p, r in zip(prefixes, records) if r is not None]
    for prefix, record in known[1:]:
        if not same_tokenizer(known[0][1], record):
            raise DatasetError(f"{prefix} was tokenized with {describe(record)} but {known[0][0]} with "
                               f"{describe(known[0][1])}: the shards of one dataset need one tokenizer; tokenize "
                               f"them again with one")
    if known and len(known) < len(prefixes):
        lacks = next(p for p, r in zip(prefixes, records) if r is None)
        print(f"note: {lacks} records no tokenizer ({sidecar_path(lacks)}): the merged dataset records none",
              file=sys.stderr)
        return None
    return known[0][1] if known else None


def merge(folder: str, output_prefix: str) -> dict[str, Any]:
    """Merge the .bin/.idx pairs of `folder` into `{output_prefix}.bin/.idx` (and their loss masks into
    `{output_prefix}_loss_mask`); a summary of what was done."""
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"--input {folder}: {'not a directory' if root.exists() else 'no such directory'}: give "
                           f"the folder holding the .bin/.idx pairs to merge")
    out = Path(output_prefix)
    if out.resolve().parent == root.resolve():
        raise DatasetError(f"--output-prefix {output_prefix} is inside --input {folder}: write the merged dataset "
                           f"elsewhere, or a later merge of {folder} would take it for a shard")
    prefixes, others = find_pairs(root)
    if not prefixes:
        raise DatasetError(f"--input {folder} holds no .bin/.idx pairs: give the folder of the datasets to merge")
    prefixes, masks = split_masks(prefixes)
    datasets, dtype = _check_inputs(prefixes)
    if masks:
        _check_inputs(masks)
    identity = common_identity(prefixes)
    names = [Path(p).name for p in prefixes]
    if sorted(names, key=_natural) != names:
        a, b = next((x, y) for x, y in zip(names, sorted(names, key=_natural)) if x != y)
        print(f"note: merged in name order, as Megatron-LM merges, in which {a} comes before {b}: if the shards are "
              f"numbered, zero-pad the numbers to merge them in number order", file=sys.stderr)
    if others:
        print(f"note: {len(others)} files of {folder} are not .bin/.idx and are not merged (e.g. {others[0]})",
              file=sys.stderr)
    total = sum(ds["bytes"] for ds in datasets) * (2 if masks else 1)
    where = next(d for d in (out.parent, *out.parent.parents) if d.exists())
    free = shutil.disk_usage(where).free
    if free < total:
        raise DatasetError(f"--output-prefix {output_prefix}: the merged dataset needs {total / 1e9:,.2f} GB and "
                           f"{where} has {free / 1e9:,.2f} GB free: free space or write it elsewhere")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{output_prefix}.tmp-{os.getpid()}"
    progress = Progress(sum(ds["bin_bytes"] for ds in datasets))
    docs = tokens = copied = 0
    outputs = [(prefixes, dtype, tmp, output_prefix)]
    if masks:        # written first, renamed first: the tokens' .idx is the last file to appear
        outputs.insert(0, (masks, "uint8", f"{tmp}_loss_mask", loss_mask_prefix(output_prefix)))
    builders = [IndexedDatasetBuilder(bin_path(t), kind) for _, kind, t, _ in outputs]
    try:
        for (inputs, _, _, _), builder in zip(outputs, builders):
            for i, prefix in enumerate(inputs):
                builder.add_index(prefix)
                if inputs is prefixes:
                    ds = datasets[i]
                    docs, tokens, copied = docs + ds["documents"], tokens + ds["tokens"], copied + ds["bin_bytes"]
                    progress.report(docs, copied, copied, tokens, prefix=f"[{i + 1}/{len(datasets)}] {names[i]}: "
                                    f"{ds['documents']:,} docs, {ds['tokens']:,} tokens; merged so far: ")
        for (_, _, t, _), builder in zip(outputs, builders):
            builder.finalize(idx_path(t))
        for _, _, t, final in outputs:
            for old in (idx_path(final), sidecar_path(final)):
                if os.path.exists(old):
                    os.remove(old)
            os.replace(bin_path(t), bin_path(final))
            os.replace(idx_path(t), idx_path(final))
        if identity is not None:
            write_identity(output_prefix, identity)
    finally:
        for builder in builders:
            builder.close()
        for leftover in glob.glob(glob.escape(tmp) + "*"):
            os.remove(leftover)
    progress.report(docs, copied, copied, tokens, final=True)
    return {"datasets": len(datasets), "documents": docs, "tokens": tokens, "dtype": str(dtype),
            "inputs": prefixes, "masks": masks, "seconds": progress.elapsed}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="the folder holding the .bin/.idx pairs to merge")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}.bin and {prefix}.idx")
    p.add_argument("--multimodal", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = _parser()
    args = p.parse_args(argv)
    if args.multimodal:
        p.error("--multimodal: datasets with sequence modes (multimodal) are not supported: merge text datasets")
    check_output_prefix(p, args.output_prefix)
    if args.output_prefix.endswith((".bin", ".idx")):
        stem = os.path.splitext(args.output_prefix)[0]
        p.error(f"--output-prefix {args.output_prefix}: give the prefix without .bin/.idx ({stem}): the tool "
                f"adds them")
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        result = merge(args.input, args.output_prefix)
    except (DatasetError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    except (Stopped, KeyboardInterrupt) as e:
        raise SystemExit(f"error: {str(e) or 'interrupted'}: nothing was written (no temporary file is left; an "
                         f"earlier {args.output_prefix}.bin/.idx, if any, is as it was)") from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    out = args.output_prefix
    print(f"wrote {bin_path(out)} and {idx_path(out)}: {result['documents']:,} documents, {result['tokens']:,} "
          f"{result['dtype']} tokens from {result['datasets']} datasets", file=sys.stderr)
    return result


def cli() -> int:
    """Console entry point: exit status 0 once main() has written its output."""
    main()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
