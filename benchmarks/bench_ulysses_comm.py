"""Communication volume of sequence parallelism, sp = ulysses x ring, for every factorisation of sp.

    python benchmarks/bench_ulysses_comm.py [--seq-len 4096] [--hidden 1024] [--heads 16] [--kv-heads 4]
                                            [--sp 2 4 8] [--out-dir DIR | --record] [--name ulysses_comm]

For each sequence-parallel degree sp the script spawns sp gloo ranks on this machine and, for every
split sp = u x r that the heads allow (u: Ulysses degree, r: ring degree), runs one attention layer of
megalysses (fused QKV projection, RoPE, the packed q/k/v all-to-all over the Ulysses group, ring
attention over the ring group, the inverse all-to-all, output projection), forward and backward through
autograd, on the grid's real `ulysses` and `ring` groups. On every rank it counts the bytes that leave
the rank: the all-to-alls by wrapping torch.distributed.all_to_all_single, the ring's K/V blocks and
dK/dV accumulators by wrapping torch.distributed.batch_isend_irecv. Both columns are measured.

Beside each measurement the closed forms per rank per layer, in elements (times the element size),
with h_q = Hq*D, h_kv = Hkv'*D (Hkv' = Hkv times its replication up to u) and S/sp local tokens:
    Ulysses fwd  (u-1)/u * S/sp * (2*h_q + 2*h_kv)     q, k, v out, the output back
    Ulysses bwd  the same                               the two inverse all-to-alls
    Ring fwd     (r-1) * S/r * 2*h_kv/u                 the K and V block, r-1 hops
    Ring bwd     (2r-1) * S/r * 2*h_kv/u  (r > 1)       K and V again (r-1 hops), dK/dV (r hops, fp32)
Ulysses volume falls as 1/u; the ring's stays near 2*S*h_kv/u whatever r is, and it travels to one
neighbour, overlapped with the block computation. Prints a markdown table; with --out-dir (or --record:
benchmarks/results/) writes the numbers as <name>.json. Exits non-zero if a count differs from its closed form.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402
from megalysses.config import ConfigError, ModelConfig  # noqa: E402
from megalysses.config.checks import check_heads  # noqa: E402
from megalysses.grid import ParallelGrid  # noqa: E402
from megalysses.degrees import Degrees  # noqa: E402
from megalysses.kernels.rope import rope_cos_sin  # noqa: E402
from megalysses.model.layers import Attention, ParallelGroups  # noqa: E402
from megalysses.parallel.sequence_layout import SequenceLayout  # noqa: E402
from megalysses.parallel.ulysses import kv_replication, prepare_sequence_mask  # noqa: E402
from megalysses.testing import run_distributed  # noqa: E402

KEYS = ("ulysses_fwd", "ring_fwd", "ulysses_bwd", "ring_bwd")   # the table's column order


class ByteCounter:
    """Wraps the all-to-all and the batched p2p and adds up the bytes this rank sends to other ranks."""

    def __init__(self) -> None:
        self.a2a = self.p2p = 0
        self._a2a, self._p2p = dist.all_to_all_single, dist.batch_isend_irecv

    def __enter__(self) -> "ByteCounter":
        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            world, me = dist.get_world_size(group), dist.get_rank(group)
            rows = input_split_sizes or [input.shape[0] // world] * world
            row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
            self.a2a += sum(r for i, r in enumerate(rows) if i != me) * row_bytes
            return self._a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def p2p(ops):
            self.p2p += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                            if op.op in (dist.isend, dist.send))
            return self._p2p(ops)

        dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single, dist.batch_isend_irecv = self._a2a, self._p2p

    def take(self) -> tuple[int, int]:
        """(all-to-all bytes, p2p bytes) since the last take."""
        out = (self.a2a, self.p2p)
        self.a2a = self.p2p = 0
        return out


def factorisations(shape: dict, sp: int) -> list[tuple[int, int]]:
    """Every (ulysses, ring) with ulysses * ring = sp that the heads allow, Ulysses-heaviest first."""
    out = []
    for ring in range(1, sp + 1):
        if sp % ring == 0:
            try:
                out.append(check_heads(shape["heads"], shape["kv_heads"], 1, sp, ring))
            except ConfigError:
                pass
    return out


def count_layer(rank: int, world: int, shape: dict, ring: int) -> dict:
    """Bytes this rank sends for one attention layer, forward and backward, at sp = world = (world/ring) x ring."""
    torch.manual_seed(rank)
    grid = ParallelGrid(Degrees(sp=world, ring=ring))
    cfg = ModelConfig(hidden_size=shape["hidden"], num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                      attention_backend="sdpa")
    attn = Attention(cfg, ParallelGroups(ulysses=grid.ulysses_group, ring=grid.ring_group))
    layout = grid.sequence_layout(False)
    S = layout.padded_len(shape["seq_len"])
    pos = torch.from_numpy(layout.positions(S, grid.sp_rank)).expand(shape["batch"], -1)   # this rank's positions
    x = torch.randn(shape["batch"], pos.shape[1], cfg.hidden_size, requires_grad=True)     # (B, S/sp, h)
    cos, sin = rope_cos_sin(pos, cfg.head_size, cfg.rope_theta)
    mask = prepare_sequence_mask(None, "sdpa", grid.ulysses_group, grid.ring_group, pos.shape[1])
    with ByteCounter() as counter:
        start = time.perf_counter()
        out = attn(x, cos, sin, mask)
        ulysses_fwd, ring_fwd = counter.take()
        out.square().mean().backward()
        ulysses_bwd, ring_bwd = counter.take()
        seconds = time.perf_counter() - start
    return {"ulysses_fwd": ulysses_fwd, "ulysses_bwd": ulysses_bwd, "ring_fwd": ring_fwd, "ring_bwd": ring_bwd,
            "seconds": seconds}


def _measure(rank: int, world: int, shape: dict, splits: list[tuple[int, int]]) -> list[dict]:
    return [count_layer(rank, world, shape, ring) for _, ring in splits]


def closed_form(shape: dict, sp: int, ulysses: int, ring: int, elem: int = 4) -> dict:
    """The per-rank bytes of the module docstring's formulas."""
    B, S, Hq, Hkv = shape["batch"], shape["seq_len"], shape["heads"], shape["kv_heads"]
    D = shape["hidden"] // Hq
    rep = kv_replication(Hkv, ulysses)
    h_q, h_kv = Hq * D, Hkv * rep * D
    uly = (ulysses - 1) / ulysses * B * S / sp * (2 * h_q + 2 * h_kv) * elem
    block = B * S / ring * 2 * h_kv / ulysses * elem
    return {"ulysses_fwd": uly, "ulysses_bwd": uly, "ring_fwd": (ring - 1) * block,
            "ring_bwd": (2 * ring - 1) * block if ring > 1 else 0, "kv_replication": rep}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8])
    add_output_args(p, name="ulysses_comm")
    args = p.parse_args(argv)
    folder = output_dir(p, args)
    shape = {"seq_len": args.seq_len, "batch": args.batch, "hidden": args.hidden, "heads": args.heads,
             "kv_heads": args.kv_heads}
    rows = []
    for sp in args.sp:
        splits = factorisations(shape, sp)
        multiple = math.lcm(*(SequenceLayout(Degrees(sp=sp, ring=r)).multiple for _, r in splits))
        if args.seq_len % multiple:
            raise SystemExit(f"error: --seq-len {args.seq_len} is not a multiple of {multiple}: every split of sp={sp} "
                             f"must run unpadded for the closed forms to apply")
        with tempfile.TemporaryDirectory() as tmp:
            per_rank = run_distributed(_measure, world=sp, tmp_dir=tmp, args=(shape, splits), timeout=1800,
                                       pg_timeout=900)
        for i, (u, r) in enumerate(splits):
            worst = {key: max(ranks[i][key] for ranks in per_rank) for key in KEYS + ("seconds",)}
            theory = closed_form(shape, sp, u, r)
            rows.append({"sp": sp, "ulysses": u, "ring": r, **worst,
                         **{f"closed_form_{k}": theory[k] for k in KEYS}, "kv_replication": theory["kv_replication"]})
    mib = 2 ** 20
    S, h = args.seq_len, args.hidden
    print(f"\nPer-rank bytes sent by one attention layer, fp32, B={args.batch} S={S} h={h} heads={args.heads} "
          f"kv_heads={args.kv_heads} (S*h*4 = {S * h * 4 / mib:.1f} MiB); closed forms in parentheses\n")
    print("| sp | u x r | KV repl | Ulysses fwd MiB | Ring fwd MiB | Ulysses bwd MiB | Ring bwd MiB | fwd+bwd MiB |")
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|")
    mismatches = []
    for r in rows:
        cells = []
        for key in KEYS:
            cells.append(f"{r[key] / mib:.2f} ({r['closed_form_' + key] / mib:.2f})")
            if r[key] != r["closed_form_" + key]:
                mismatches.append(f"sp={r['sp']} {r['ulysses']}x{r['ring']} {key}: {r[key]} != "
                                  f"{r['closed_form_' + key]}")
        total = sum(r[key] for key in KEYS)
        print(f"| {r['sp']} | {r['ulysses']} x {r['ring']} | {r['kv_replication']} | {' | '.join(cells)} "
              f"| {total / mib:.2f} |")
    if folder is not None:
        out = write_text(folder, f"{args.name or 'ulysses_comm'}.json",
                         json.dumps({"shape": shape, "rows": rows, "machine": platform.platform(),
                                     "torch": torch.__version__}, indent=2) + "\n")
        print(f"\nwrote {out}")
    if mismatches:
        print("error: counted bytes differ from the closed form: " + "; ".join(mismatches), file=sys.stderr)
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
