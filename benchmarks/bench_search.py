"""The planner's search (megalysses.plan.search.plan, as tools/plan.py runs it: the top layouts wanted, the
candidates that cannot rank in them not weighed) at 8, 64, 1,024 and 8,192 GPUs, against the unpruned search.

    python benchmarks/bench_search.py                                 # llama3_8b_1m at 8, 64, 1024, 8192 GPUs
    python benchmarks/bench_search.py --gpus 64 1024 --unpruned       # also run the unpruned search, compare
    python benchmarks/bench_search.py --gpus 8192 --reference DIR     # compare with DIR/plan_8192.json

A row: the GPUs, the layouts considered (candidates that validate, as tools/plan.py counts them), the layouts
evaluated (memory and step time weighed, tiles and all: the work the search does; a count that does not depend
on the machine's load), the search's seconds, and whether its top layouts (--top, the same rows in the same
order) equal the unpruned search's: run here with --unpruned (Search(prune=False), its evaluated count and
seconds beside), or read from --reference DIR's plan_<GPUs>.json, the output of
`tools/plan.py --config C --gpus N --top 50 --json` from a search that weighs every candidate. Prints a
markdown table; with --out-dir (or --record: benchmarks/results/) writes its rows to search.json. Exits non-zero
when a comparison finds the top layouts differ.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402
from megalysses.config.io import load_config  # noqa: E402
from megalysses.plan.search import Search, plan  # noqa: E402


def timed(cfg, gpus: int, search: Search) -> tuple[list[dict], int, float]:
    """The rows of the top layouts, the layouts considered and the seconds of one search."""
    start = time.monotonic()
    fitting, considered = plan(cfg, gpus, cfg.data.seq_len, search=search)
    rows = json.loads(json.dumps([p.row() for p in fitting[:search.top]]))     # as tools/plan.py --json writes
    return rows, considered, time.monotonic() - start


def reference_rows(folder: Optional[Path], gpus: int, top: int) -> Optional[list[dict]]:
    """The top rows of DIR/plan_<gpus>.json, or None where there is none."""
    path = folder / f"plan_{gpus}.json" if folder else None
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())["layouts"][:top]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/llama3_8b_1m.yaml", help="relative to the repository's root")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 1024, 8192])
    p.add_argument("--top", type=int, default=50, help="top layouts compared (tools/plan.py --top)")
    p.add_argument("--unpruned", action="store_true", help="also run the unpruned search and compare with it")
    p.add_argument("--reference", type=Path, default=None,
                   help="a folder of plan_<GPUs>.json, tools/plan.py --json --top N of the unpruned search")
    add_output_args(p)
    args = p.parse_args()
    folder = output_dir(p, args)
    cfg = load_config(str(ROOT / args.config), [])
    print("| GPUs | layouts considered | layouts evaluated | seconds | top layouts equal to unpruned "
          "| unpruned: evaluated | unpruned: seconds |")
    print("|---:|---:|---:|---:|:---|---:|---:|")
    differ, record = False, []
    for gpus in args.gpus:
        pruned = Search(top=args.top)
        rows, considered, seconds = timed(cfg, gpus, pruned)
        unpruned, whole, whole_s = Search(top=args.top, prune=False), None, None
        if args.unpruned:
            whole, _, whole_s = timed(cfg, gpus, unpruned)
        else:
            whole = reference_rows(args.reference, gpus, args.top)
        same = "n/a" if whole is None else "yes" if rows == whole else "no"
        differ |= same == "no"
        print(f"| {gpus:,} | {considered:,} | {pruned.evaluated:,} | {seconds:.1f} | {same} "
              f"| {unpruned.evaluated if whole_s is not None else '-'} "
              f"| {f'{whole_s:.1f}' if whole_s is not None else '-'} |", flush=True)
        record.append({"gpus": gpus, "considered": considered, "evaluated": pruned.evaluated, "seconds": seconds,
                       "top_equal": same, "unpruned_evaluated": unpruned.evaluated if whole_s is not None else None,
                       "unpruned_seconds": whole_s})
    if folder is not None:
        write_text(folder, "search.json", json.dumps({"config": args.config, "top": args.top, "rows": record},
                                                     indent=1) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
