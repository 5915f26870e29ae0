"""Our Triton kernels built for CUDA GPUs at the launches a training step makes: registers, spills and shared
memory per kernel, on any machine (no GPU needed).

    python benchmarks/kernel_build.py                       # 1B and 8B configs, sm_90 (H100/H200) and sm_80 (A100)
    python benchmarks/kernel_build.py --config configs/gpt_1b_32k.yaml --arch 90 --dtype float32
    python benchmarks/kernel_build.py --record           # benchmarks/results/kernel_build_triton<version>.json

For each config, megalysses.tools.triton_build records the Triton launches of one forward and backward of
one block (on the meta device, planned as on an H100: nothing runs), then compiles each distinct launch
with the installed Triton for each compute capability and reads the binary's resources back with the
cuobjdump that Triton ships. Columns: the kernel, its block sizes, warps, pointer dtypes, the target, the
registers per thread, the bytes spilled per thread (stack) and the shared memory. A kernel that does not
compile is a row with the error. With --out-dir (or --record: benchmarks/results/) the rows and versions are
also written as kernel_build_triton<major><minor>.json. Exit status 1 when any kernel failed to compile,
spilled, or needs more shared memory than a block may have; tests/test_kernel_build.py runs this.

What this does not measure: time on a GPU. It shows that the kernels compile for the target with the
block sizes a step asks for and whether they spill, which the CPU interpreter tests cannot.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402

DEFAULT_CONFIGS = ("configs/gpt_1b_1m_offload.yaml", "configs/llama3_8b_128k.yaml")


def build_rows(config: str, dtype: str, archs: list[int]) -> list[dict]:
    import torch

    from megalysses.config.io import load_config
    from megalysses.tools.triton_build import build, record_step, unique

    model = load_config(ROOT / config if not Path(config).exists() else config).model
    rows = []
    for launch in unique(record_step(model, getattr(torch, dtype))):
        for arch in archs:
            row = {"config": Path(config).name, "kernel": launch.name, "arch": arch,
                   "blocks": {k: v for k, v in launch.constexprs.items() if k.startswith("BLOCK")}}
            try:
                b = build(launch, arch)
            except Exception as e:  # noqa: BLE001 - Triton's and ptxas's own error types; the row says which
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            else:
                row.update(num_warps=b.num_warps, pointers=b.pointers, registers=b.registers,
                           spill_bytes=b.spill_bytes, shared_bytes=b.shared_bytes, shared_fits=b.shared_fits)
            row["modes"] = {k: v for k, v in launch.constexprs.items() if not k.startswith("BLOCK")}
            rows.append(row)
    return rows


def failed(row: dict) -> bool:
    return "error" in row or row["spill_bytes"] > 0 or not row["shared_fits"]


def table(rows: list[dict]) -> str:
    lines = ["| config | kernel | modes | blocks | warps | pointers | sm | registers | spill B | shared B |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        modes = " ".join(f"{k}={int(v)}" for k, v in r["modes"].items())
        blocks = " ".join(f"{k}={v}" for k, v in r["blocks"].items())
        head = f"| {r['config']} | {r['kernel']} | {modes} | {blocks} |"
        if "error" in r:
            lines.append(f"{head} | | {r['arch']} | did not compile: {r['error']} | | |")
        else:
            lines.append(f"{head} {r['num_warps']} | {r['pointers']} | {r['arch']} | {r['registers']} | "
                         f"{r['spill_bytes']} | {r['shared_bytes']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", default=list(DEFAULT_CONFIGS), help="model shapes to record (YAML configs)")
    p.add_argument("--arch", nargs="+", type=int, default=[90, 80],
                   help="compute capabilities: 90 = H100/H200, 80 = A100")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype of the step")
    add_output_args(p, name="kernel_build_triton<major><minor>")
    args = p.parse_args(argv)
    folder = output_dir(p, args)
    import importlib

    import torch
    import triton

    from megalysses.tools.triton_build import KERNEL_MODULES
    from benchmarks.harness import source_commit

    rows = [r for c in args.config for r in build_rows(c, args.dtype, args.arch)]
    info = {"commit": source_commit() or "unknown", "triton": triton.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "dtype": args.dtype,
            "launched": sorted(k for m in KERNEL_MODULES for k in importlib.import_module(m).LAUNCHED)}
    print(f"Triton {info['triton']}, torch {info['torch']}, {args.dtype}, commit {info['commit']}")
    print(table(rows))
    bad = [r for r in rows if failed(r)]
    for r in bad:
        why = r.get("error") or (f"spills {r['spill_bytes']} B" if r["spill_bytes"] else "shared memory over the limit")
        print(f"FAIL {r['config']} {r['kernel']} sm_{r['arch']}: {why}")
    if folder is not None:
        name = args.name or "kernel_build_triton" + "".join(triton.__version__.split(".")[:2])
        print(f"wrote {write_text(folder, name + '.json', json.dumps({'info': info, 'rows': rows}, indent=1))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
