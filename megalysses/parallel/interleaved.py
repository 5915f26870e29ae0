"""Interleaved 1F1B over virtual pipeline stages (Megatron's schedule), executed in lockstep slots.

With P pipeline ranks and v model chunks per rank there are V = v*P virtual stages; chunk k of rank
r is virtual stage k*P + r, so a micro-batch visits ranks 0..P-1 v times. Each rank's order of work
is Megatron's: forwards go through micro-batches in groups of P, chunk by chunk; backwards likewise
with the chunks reversed; (P - r - 1) * 2 + (v - 1) * P warm-up forwards, then one forward and one
backward alternately, then the remaining backwards. The pipeline bubble shrinks by a factor v.

Execution: `slot_schedule` simulates the ranks' orders in global time slots (a rank runs its next
action in a slot once what it needs was produced in an earlier slot). After each slot every rank
posts ONE batch of point-to-point operations: the sends of what it produced in the slot and the
receives of what its neighbours produced in it. Both ends of every message are in the same slot's
batch, so no ordering between separate sends and receives can deadlock, on gloo or NCCL.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from megalysses.comm import send_recv
from megalysses.parallel.pipeline import Batch, Pipe, release_output, stage_backward, stage_forward


@dataclass(frozen=True)
class Action:
    kind: str       # "F" or "B"
    mb: int         # micro-batch
    chunk: int      # local model chunk k (virtual stage k*P + rank)


class VirtualStages(nn.Module):
    """The v model chunks of one pipeline rank. Parameters keep their global names (`layers.7...`),
    as a single stage's do, so optimizers and checkpoints see one flat, layout-independent set."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.cfg, self.groups = chunks[0].cfg, chunks[0].groups

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)


def rank_order(P: int, v: int, M: int, rank: int, forward_only: bool = False) -> list[Action]:
    """This rank's sequence of actions for M micro-batches (M a multiple of P). Forward-only
    (validation): every micro-batch through chunk 0, then chunk 1, ... (any M)."""
    if forward_only:
        return [Action("F", m, k) for k in range(v) for m in range(M)]

    def chunk_of(i: int, backward: bool) -> Action:
        group, within = divmod(i, P * v)
        k = within // P
        return Action("B" if backward else "F", group * P + within % P, v - 1 - k if backward else k)

    total = M * v
    fwd = [chunk_of(i, False) for i in range(total)]
    bwd = [chunk_of(i, True) for i in range(total)]
    warmup = min((P - rank - 1) * 2 + (v - 1) * P, total)
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[total - warmup:]


def slot_schedule(P: int, v: int, M: int, forward_only: bool = False) -> list[list[Optional[Action]]]:
    """slots[t][rank]: the action rank runs in slot t (None = idle)."""
    V = P * v
    orders = [rank_order(P, v, M, r, forward_only) for r in range(P)]
    done: dict[tuple, int] = {}            # (kind, mb, virtual stage) -> slot it finished in
    pos = [0] * P
    slots: list[list[Optional[Action]]] = []
    while any(pos[r] < len(orders[r]) for r in range(P)):
        t = len(slots)
        row: list[Optional[Action]] = [None] * P
        for r in range(P):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            vs = a.chunk * P + r
            if a.kind == "F":
                need = None if vs == 0 else ("F", a.mb, vs - 1)
            else:
                need = ("F", a.mb, vs) if vs == V - 1 else ("B", a.mb, vs + 1)
            if need is None or done.get(need, t) < t:
                row[r] = a
        for r, a in enumerate(row):
            if a is not None:
                done[(a.kind, a.mb, a.chunk * P + r)] = t
                pos[r] += 1
        if not any(row):
            raise RuntimeError(f"interleaved schedule stalls (P={P}, v={v}, M={M})")
        slots.append(row)
    return slots


def _incoming(row: list[Optional[Action]], pipe: Pipe, V: int) -> list[tuple[str, int, int, int]]:
    """What the neighbours produce in this slot and this rank needs, in rank order: (kind, micro-batch, the
    chunk of this rank it is for, the stage rank sending it); "F" an activation, "B" an output gradient."""
    P, r, wanted = pipe.pp_size, pipe.pp_rank, []
    for src, b in enumerate(row):
        if b is None or src == r:
            continue
        vs = b.chunk * P + src
        if b.kind == "F" and vs < V - 1 and (vs + 1) % P == r:
            wanted.append(("F", b.mb, (vs + 1) // P, src))
        elif b.kind == "B" and vs > 0 and (vs - 1) % P == r:
            wanted.append(("B", b.mb, (vs - 1) // P, src))
    return wanted


def run_interleaved(model: VirtualStages, microbatches: list[Batch], scale: float | Tensor, pipe: Pipe,
                    forward_only: bool = False, scores: Optional[list] = None) -> Tensor:
    """One step (or, forward_only, one validation pass) on this rank. Returns the summed scaled loss
    (non-zero only on the rank holding the last virtual stage). With `scores` (a list; forward_only), that rank
    appends each micro-batch's per-token (losses, greedy hits) to it instead, in micro-batch order."""
    P, v, M, r = pipe.pp_size, len(model.chunks), len(microbatches), pipe.pp_rank
    V = P * v
    total = torch.zeros((), dtype=torch.float32, device=pipe.device)
    inputs: dict[tuple[int, int], Tensor] = {}      # (mb, chunk) -> received activation
    grads: dict[tuple[int, int], Tensor] = {}       # (mb, chunk) -> received output gradient
    saved: dict[tuple[int, int], tuple[Optional[Tensor], Tensor]] = {}

    for row in slot_schedule(P, v, M, forward_only):
        sends, recvs, released, received_inputs = [], [], [], []
        a = row[r]
        vs = None if a is None else a.chunk * P + r
        if a is not None and a.kind == "F":
            x = inputs.pop((a.mb, a.chunk)) if vs > 0 else None
            out = stage_forward(model.chunks[a.chunk], microbatches[a.mb], x, scale, scores is not None)
            if vs == V - 1 and scores is not None:
                scores.append(out)
            elif vs == V - 1:
                total += out.detach()
            else:
                sends.append((out, pipe.rank_of_stage((vs + 1) % P)))
                released.append(out)
            if not forward_only:
                saved[(a.mb, a.chunk)] = (x, out)
        elif a is not None:
            x, out = saved.pop((a.mb, a.chunk))
            stage_backward(out, None if vs == V - 1 else grads.pop((a.mb, a.chunk)))
            if vs > 0:
                sends.append((x.grad, pipe.rank_of_stage((vs - 1) % P)))
        for kind, mb, chunk, src in _incoming(row, pipe, V):
            buf = pipe.buffer()
            recvs.append((buf, pipe.rank_of_stage(src)))
            if kind == "F":
                inputs[(mb, chunk)] = buf
                received_inputs.append(buf)
            else:
                grads[(mb, chunk)] = buf
        if sends or recvs:
            send_recv(sends=sends, recvs=recvs)
        if not forward_only:
            for buf in received_inputs:
                buf.requires_grad_()
            for out in released:
                release_output(out)
    return total
