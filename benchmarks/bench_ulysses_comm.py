"""Communication volume of Ulysses attention against a ring-attention pass over the same shapes.

    python benchmarks/bench_ulysses_comm.py [--seq-len 4096] [--hidden 1024] [--heads 16] [--kv-heads 4]
                                            [--sp 2 4 8] [--json benchmarks/results/ulysses_comm.json]

For each sequence-parallel degree P the script spawns P gloo ranks on this machine and, on every
rank, counts the bytes that actually leave the rank (payload sent to the other P-1 ranks):

* Ulysses: one attention layer of megalysses (q/k/v projections, RoPE, the packed q/k/v all-to-all,
  core attention, the inverse all-to-all, output projection), forward and backward through
  autograd. Counted by wrapping torch.distributed.all_to_all_single.
* Ring: the K/V traffic of ring attention over the same local shards, driven through the same
  point-to-point primitive the pipeline uses (batched isend/irecv). Forward: P-1 steps, each
  passing the (B, S/P, Hkv, D) K and V blocks to the next rank. Backward (as in the usual ring
  implementations): P-1 steps of K and V again plus P steps of the dK/dV accumulators (the last
  one brings them home). Counted by wrapping torch.distributed.batch_isend_irecv.

Beside each measurement the closed forms, per rank, in elements (times the element size):
    Ulysses fwd  (P-1)/P * B*S/P * (2*Hq + 2*Hkv') * D      Hkv' = max(Hkv, P) after KV replication
    Ring fwd     (P-1)   * B*S/P * 2*Hkv * D
so Ulysses sends O(S*h/P) per rank while ring sends O(S*h_kv), flat in P. The backward of each
doubles (Ulysses: the two inverse all-to-alls; ring: K/V plus dK/dV).
Prints a markdown table and writes the numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megalysses import comm
from megalysses.config import ModelConfig, check_heads
from megalysses.kernels.rope import rope_cos_sin
from megalysses.model.layers import Attention, ParallelGroups
from megalysses.parallel.ulysses import kv_replication
from megalysses.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]


class ByteCounter:
    """Wraps the two collectives and adds up the bytes this rank sends to other ranks."""

    def __init__(self) -> None:
        self.sent = 0
        self._a2a, self._p2p = dist.all_to_all_single, dist.batch_isend_irecv

    def __enter__(self) -> "ByteCounter":
        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            world, me = dist.get_world_size(group), dist.get_rank(group)
            rows = input_split_sizes or [input.shape[0] // world] * world
            row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
            self.sent += sum(r for i, r in enumerate(rows) if i != me) * row_bytes
            return self._a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def p2p(ops):
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                             if op.op in (dist.isend, dist.send))
            return self._p2p(ops)

        dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single, dist.batch_isend_irecv = self._a2a, self._p2p

    def take(self) -> int:
        sent, self.sent = self.sent, 0
        return sent


def ring_pass(blocks: list[torch.Tensor], steps: int, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Rotate `blocks` `steps` times around the ring (each rank sends to rank+1, receives from rank-1)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % world)
    prv = dist.get_global_rank(group, (me - 1) % world)
    for _ in range(steps):
        recv = [torch.empty_like(b) for b in blocks]
        comm.send_recv(sends=[(b, nxt) for b in blocks], recvs=[(r, prv) for r in recv])
        blocks = recv
    return blocks


def measure(rank: int, world: int, shape: dict) -> dict:
    torch.manual_seed(rank)
    group = dist.new_group(list(range(world)))
    cfg = ModelConfig(hidden_size=shape["hidden"], num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                      attention_backend="sdpa")
    attn = Attention(cfg, ParallelGroups(sp=group))
    B, s, D = shape["batch"], shape["seq_len"] // world, cfg.head_dim
    x = torch.randn(B, s, cfg.hidden_size, requires_grad=True)            # (B, S/P, h)
    pos = torch.arange(rank * s, (rank + 1) * s).expand(B, s)             # global positions of this chunk
    cos, sin = rope_cos_sin(pos, D, cfg.rope_theta)
    with ByteCounter() as counter:
        start = time.perf_counter()
        out = attn(x, cos, sin, None)                                     # (B, S/P, h)
        ulysses_fwd = counter.take()
        out.square().mean().backward()
        ulysses_bwd = counter.take()
        ulysses_s = time.perf_counter() - start
        k = torch.randn(B, s, cfg.kv_heads, D)                            # (B, S/P, Hkv, D)
        v = torch.randn_like(k)
        ring_pass([k, v], world - 1, group)
        ring_fwd = counter.take()
        ring_pass([k, v], world - 1, group)
        ring_pass([torch.zeros_like(k), torch.zeros_like(v)], world, group)  # dK, dV accumulators
        ring_bwd = counter.take()
    return {"ulysses_fwd": ulysses_fwd, "ulysses_bwd": ulysses_bwd, "ring_fwd": ring_fwd, "ring_bwd": ring_bwd,
            "ulysses_seconds": ulysses_s}


def theory(shape: dict, P: int, elem: int = 4) -> dict:
    B, S, Hq, Hkv = shape["batch"], shape["seq_len"], shape["heads"], shape["kv_heads"]
    D = shape["hidden"] // Hq
    Hkv_rep = Hkv * kv_replication(Hkv, P)
    ulysses = (P - 1) / P * B * S / P * (2 * Hq + 2 * Hkv_rep) * D * elem
    ring = (P - 1) * B * S / P * 2 * Hkv * D * elem
    return {"ulysses_fwd": ulysses, "ring_fwd": ring, "kv_replication": kv_replication(Hkv, P)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "ulysses_comm.json"))
    args = p.parse_args(argv)
    shape = {"seq_len": args.seq_len, "batch": args.batch, "hidden": args.hidden, "heads": args.heads,
             "kv_heads": args.kv_heads}
    rows = []
    for P in args.sp:
        check_heads(args.heads, args.kv_heads, 1, P)
        if args.seq_len % P:
            raise SystemExit(f"--seq-len {args.seq_len} is not divisible by sp={P}")
        with tempfile.TemporaryDirectory() as tmp:
            per_rank = run_distributed(measure, world=P, tmp_dir=tmp, args=(shape,), timeout=900, pg_timeout=600)
        th = theory(shape, P)
        worst = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
        rows.append({"sp": P, **worst, "theory_ulysses_fwd": th["ulysses_fwd"], "theory_ring_fwd": th["ring_fwd"],
                     "kv_replication": th["kv_replication"]})
    mib = 2 ** 20
    S, h = args.seq_len, args.hidden
    print(f"\nPer-rank bytes sent by one attention layer, fp32, B={args.batch} S={S} h={h} "
          f"heads={args.heads} kv_heads={args.kv_heads} (S*h*4 = {S * h * 4 / mib:.1f} MiB)\n")
    print("| sp | KV repl | Ulysses fwd MiB (theory) | Ring fwd MiB (theory) | Ulysses fwd+bwd MiB | Ring fwd+bwd MiB "
          "| ring / Ulysses |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        u, rg = r["ulysses_fwd"] + r["ulysses_bwd"], r["ring_fwd"] + r["ring_bwd"]
        print(f"| {r['sp']} | {r['kv_replication']} "
              f"| {r['ulysses_fwd'] / mib:.2f} ({r['theory_ulysses_fwd'] / mib:.2f}) "
              f"| {r['ring_fwd'] / mib:.2f} ({r['theory_ring_fwd'] / mib:.2f}) | {u / mib:.2f} | {rg / mib:.2f} "
              f"| {rg / u:.2f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"shape": shape, "rows": rows, "machine": platform.platform(),
                                           "torch": torch.__version__}, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
