"""Block-mask build benchmark: FlexAttention's BlockMask of a ring block with packed documents, built from the
documents' boundaries per block (megalysses/kernels/block_mask.py) on a CPU, beside torch's create_block_mask
(the mask evaluated on every pair of tokens) where that finishes.

    python benchmarks/bench_block_mask.py [--tokens 1048576] [--blocks 128 256 512] [--mean-doc 8192]
                                          [--per-pair 2048 4096 8192] [--threads N] [--out-dir DIR | --record]

Each case runs in a fresh process: its inputs are made, then the build is timed (wall and CPU seconds) and its
peak memory is the process's peak resident set growth over the build (the result included), beside the bytes
of the BlockMask it returns (its eight int32 index and count tensors). Cases, for a ring block of --tokens
queries and keys with documents of random lengths (mean --mean-doc tokens):
    diagonal   the rank's own block: causal, the same documents
    earlier    the block of an earlier rank: no causality, the queries' documents after the keys'
    window     the diagonal block with a 64K-token sliding window
and the per-pair rows: torch's create_block_mask of the diagonal block at the --per-pair sizes (eager on a
CPU, as a test runs it; compiled on CUDA it is fused but evaluates the same pairs), beside ours at that size.
Prints a markdown table; with --out-dir (or --record: benchmarks/results/) writes the rows as block_mask.json
(benchmarks/results/block_mask.md reads them).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, child_env, output_dir, write_text  # noqa: E402

WINDOW = 1 << 16


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024            # Linux reports KiB


def run_case(case: str, tokens: int, block: int, mean_doc: int, per_pair: bool) -> dict:
    """One build in this process: seconds, CPU seconds, peak resident growth and the result's bytes."""
    import torch

    from megalysses.kernels.block_mask import MaskPattern, build_block_mask

    starts = torch.rand(1, 2 * tokens, generator=torch.Generator().manual_seed(0)) < 1.0 / mean_doc
    starts[:, 0] = True
    docs = starts.long().cumsum(1) - 1                                     # two blocks' worth of a sequence
    positions = torch.arange(2 * tokens)
    mine, earlier = slice(tokens, None), slice(None, tokens)
    pattern = {"diagonal": MaskPattern(True, docs[:, mine], docs[:, mine]),
               "earlier": MaskPattern(False, docs[:, mine], docs[:, earlier]),
               "window": MaskPattern(True, docs[:, mine], docs[:, mine], WINDOW, positions[mine],
                                     positions[mine])}[case]
    base = _peak_rss()
    wall, cpu = time.perf_counter(), time.process_time()
    if per_pair:
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(pattern.mask_mod(), pattern.batch, None, tokens, tokens, device="cpu",
                                 BLOCK_SIZE=block)
    else:
        mask = build_block_mask(pattern, tokens, tokens, block)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    result = sum(t.numel() * t.element_size() for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                                         mask.full_kv_indices, mask.q_num_blocks, mask.q_indices,
                                                         mask.full_q_num_blocks, mask.full_q_indices))
    return {"case": case, "tokens": tokens, "block": block, "method": "create_block_mask" if per_pair else "ours",
            "seconds": wall, "cpu_seconds": cpu, "peak_bytes": _peak_rss() - base, "result_bytes": result}


def _in_child(args: list[str], threads: int) -> dict:
    env = child_env(OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20, help="queries and keys of the ring block")
    parser.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--mean-doc", type=int, default=8192, help="mean document length in tokens")
    parser.add_argument("--per-pair", type=int, nargs="*", default=[2048, 4096, 8192],
                        help="sizes at which torch's create_block_mask is timed beside ours (block 128)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    add_output_args(parser, name="block_mask")
    args = parser.parse_args()
    folder = output_dir(parser, args)
    if args.child:
        case, tokens, block, mean_doc, per_pair = args.child
        print(json.dumps(run_case(case, int(tokens), int(block), int(mean_doc), per_pair == "1")))
        return
    rows = []
    for block in args.blocks:
        for case in ("diagonal", "earlier", "window"):
            rows.append(_in_child([case, str(args.tokens), str(block), str(args.mean_doc), "0"], args.threads))
    for tokens in args.per_pair:
        for per_pair in ("1", "0"):
            rows.append(_in_child(["diagonal", str(tokens), "128", str(args.mean_doc), per_pair], args.threads))
    load = os.getloadavg()[0]
    print(f"torch threads {args.threads}, mean document {args.mean_doc} tokens, load average {load:.2f} at the end\n")
    print("| size | case | block | method | seconds | CPU seconds | peak bytes | BlockMask bytes |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {_size(r['tokens'])} x {_size(r['tokens'])} | {r['case']} | {r['block']} | {r['method']} | "
              f"{r['seconds']:.3f} | {r['cpu_seconds']:.3f} | {r['peak_bytes']:,} | {r['result_bytes']:,} |")
    if folder is not None:
        import torch

        meta = {"threads": args.threads, "mean_doc": args.mean_doc, "load_average": load,
                "machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__}
        text = json.dumps({**meta, "rows": rows}, indent=2) + "\n"
        out = write_text(folder, f"{args.name or 'block_mask'}.json", text)
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
