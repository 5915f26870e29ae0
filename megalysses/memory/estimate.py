"""The estimate: the peak over the pipeline stages and the parts of a step, and the longest sequence
that fits a budget."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megalysses.config import ModelConfig
from megalysses.memory.activations import (bytes_per_token, dims, kept_layers, layer_terms,
                                           norm_terms, stage_layers, stage_terms)
from megalysses.memory.blocks import flex_mask, largest_block
from megalysses.memory.gradients import backward_gradients, embedding_params, fsdp_end_terms, waiting_for_bucket
from megalysses.memory.states import (earlier_backward, in_flight, optimizer_terms, reduced_bytes, stage_params,
                                      state_terms, streams_gradients)
from megalysses.memory.transients import backward_terms, loss_terms, norm_backward_bytes, norm_tile_bytes
from megalysses.memory.host import pinned_requests, pinned_terms
from megalysses.degrees import Degrees
from megalysses.memory.types import Estimate, Options, Precision, Term, Workload


def estimate(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload) -> Estimate:
    """The peak over the pipeline stages (the first holds the most micro-batches, the last the loss), with the
    largest single block of any of them."""
    stages = [_Stage(m, layout, opts, prec, work, s).estimate() for s in sorted({0, layout.pp - 1})]
    est = max(stages, key=lambda e: e.peak)
    est.largest = max((e.largest for e in stages), key=lambda t: t.bytes)
    est.parts = {key: b for e in stages for key, b in e.parts.items()}
    return est


class _Stage:
    """One pipeline stage's step, part by part: each part's terms on top of what the stage holds throughout."""

    def __init__(self, m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload,
                 stage: int) -> None:
        self.m, self.layout, self.opts, self.prec, self.work, self.stage = m, layout, opts, prec, work, stage
        self.first, self.last = stage == 0, stage == layout.pp - 1
        self.S, self.M = work.seq_len, work.micro_batches
        self.tokens = work.micro_batch_size * self.S / layout.sp          # one micro-batch, S/sp tokens
        self.n_layers = stage_layers(m, layout)
        self.layer_tok = bytes_per_token(layer_terms(m, layout, opts, prec, self.S))
        self.flight = in_flight(layout, stage, self.M)
        self.offload = opts.offload and opts.checkpointing
        self.fixed, self.grads = state_terms(m, layout, opts, prec, self.first, self.last, self.M)
        # the step's micro-batches, loaded at its start: token ids, labels, positions (and document ids)
        batch = self.M * self.tokens * (3 * 8 + (8 * layout.sp if opts.documents else 0))
        self.fixed.append(Term("the step's batch (ids, labels, positions)", batch,
                               f"{self.M} mb x {self.tokens:.4g} tok x 24 B"))
        self.blocks, self.other = stage_params(m, layout, self.first, self.last)
        self.streamed = streams_gradients(opts)
        self.accumulated = earlier_backward(layout, stage, self.M)

    def activations(self, behind: float, current_layers: int) -> list[Term]:
        """The retained activations: `behind` whole micro-batches, the current one's first `current_layers`."""
        m, layout, opts, tokens, layer_tok = self.m, self.layout, self.opts, self.tokens, self.layer_tok
        mbs = behind + 1
        if not self.offload:
            every, now = kept_layers(self.n_layers, opts), kept_layers(current_layers, opts)
            count = behind * every + now
            terms = [Term("layer activations", count * tokens * layer_tok,
                          f"({behind:g} mb x {every} + {now}) layers x {tokens:.4g} tok x "
                          f"{layer_tok:.4g} B")]
        else:
            kept = 0 if self.first else 1           # a received pipeline input stays (the schedule holds it)
            ahead = min(opts.offload_prefetch, self.n_layers - kept, current_layers)
            terms = [Term(f"offload window ({ahead} block input{'' if ahead == 1 else 's'} copied back ahead)",
                          ahead * tokens * layer_tok, f"{ahead} x {tokens:.4g} tok x {layer_tok:.4g} B")]
            if kept:
                terms.append(Term("received stage inputs", mbs * tokens * layer_tok,
                                  f"{mbs:g} mb x {tokens:.4g} tok x {layer_tok:.4g} B"))
        stage_tok = bytes_per_token(stage_terms(m, layout, opts, self.prec, self.first, False))
        if stage_tok:
            terms.append(Term("stage activations (rotary cos/sin, tp-local ids)", mbs * tokens * stage_tok,
                              f"{mbs:g} mb x {tokens:.4g} tok x {stage_tok:.4g} B"))
        return terms + self.masks()

    def masks(self) -> list[Term]:
        """The attention masks a micro-batch's forward builds: SDPA's dense ones, FlexAttention's block mask."""
        m, layout, opts, work, S = self.m, self.layout, self.opts, self.work, self.S
        terms = []
        masked = opts.documents or m.sliding_window > 0              # sdpa builds dense masks for either
        if masked and opts.attention == "sdpa" and layout.ring > 1:
            # each block's allowed pairs (bool) and additive mask (compute dtype): the rank's own block
            # whole, the r-1 others half (kernels/block_attention.py AttentionBlock, on CPU)
            r, B = layout.ring, work.micro_batch_size
            masks = B * (S / r) ** 2 * (r + 1) / 2 * (1 + self.prec.act)
            terms.append(Term("dense document (window) masks of the ring's blocks (sdpa)", masks,
                              f"B x (S/r)^2 x (r+1)/2 x (1 + {self.prec.act}) B, r = {r}"))
        elif masked and opts.attention == "sdpa":
            terms.append(Term("dense document (window) mask (sdpa)", work.micro_batch_size * S ** 2,
                              f"B x S^2 = {work.micro_batch_size} x {S}^2 B"))
        mask = flex_mask(m, layout, opts, work)
        return terms + ([mask] if mask is not None else [])

    def grads_after(self, done: int) -> list[Term]:
        """The gradients after `done` blocks of the backward."""
        return backward_gradients(self.m, self.layout, self.opts, self.prec, self.stage, self.M, self.grads, done)

    def layer_backward(self, done: int) -> list[Term]:
        """The layer's backward after `done` blocks, its own new weight gradients weighed: in .grad (one
        micro-batch, FSDP's unsharded ones) and, as their buckets complete, their reduced fp32 chunks; in fp32
        main_grad the step's first backward makes; nothing where they add into an earlier micro-batch's."""
        m, layout, opts, prec, M = self.m, self.layout, self.opts, self.prec, self.M
        ready = self.other - embedding_params(m, layout, self.first, self.last) \
            + done * self.blocks / max(self.n_layers, 1)
        reduced = reduced_bytes(prec, opts, layout.dp * layout.sp, M) if opts.overlap_grad_reduce else 0.0
        direct = opts.fsdp or self.streamed

        def weigh(elements: float) -> float:
            if not (direct or M == 1):
                return 0.0 if self.accumulated else elements * 4.0
            own = elements * prec.weight
            if M == 1 and not direct and reduced:
                closed = [r - waiting_for_bucket(m, layout, opts, self.last, r) for r in (ready, ready + elements)]
                own += (closed[1] - closed[0]) * reduced
            return own
        return backward_terms(m, layout, opts, prec, self.tokens, self.S, weigh)

    def loss(self) -> list[Term]:
        """The LM head + loss forward on the last stage, under every layer's activations."""
        m, layout, opts, prec, tokens = self.m, self.layout, self.opts, self.prec, self.tokens
        head_tok = bytes_per_token(stage_terms(m, layout, opts, prec, False, True)) - \
            bytes_per_token(stage_terms(m, layout, opts, prec, False, False))
        # (the head weight's gradient is made at the end of the loss's forward, after its worst moment)
        head = [Term("final norm + head-input gradient", tokens * head_tok, f"{tokens:.4g} tok x {head_tok:.4g} B")]
        before = [t for t in self.grads if "reduced" not in t.name] if self.M > 1 and not self.streamed else []
        return (self.fixed + before + self.activations(self.flight - 1, self.n_layers) + head
                + loss_terms(m, layout, opts, prec, tokens))

    def final_norm(self) -> list[Term]:
        """The backward's first step, the final norm's, under every layer's activations: what the norm keeps,
        the gradient coming in, and the norm backward's temporaries (one tile's, for the torch norms)."""
        m, opts, prec, tokens = self.m, self.opts, self.prec, self.tokens
        d = dims(m, self.layout, opts)
        norm_tok = (bytes_per_token(norm_terms("final norm", d["h"], d["r"], prec.act, d["k"], m.norm))
                    + d["h"] / d["r"] * prec.act)
        temps = (norm_backward_bytes(m, opts, prec) * d["h"] / d["r"]
                 + norm_tile_bytes(m, opts, prec, tokens / d["r"]) / tokens)
        return (self.fixed + self.grads_after(0) + self.activations(self.flight - 1, self.n_layers)
                + [Term("final norm: its input, 1/rms and the gradient coming in", tokens * norm_tok,
                        f"{tokens:.4g} tok x {norm_tok:.4g} B"),
                   Term("final norm backward's temporaries", tokens * temps, f"{tokens:.4g} tok x {temps:.4g} B")])

    def parts(self) -> dict[str, list[Term]]:
        m, layout, opts, prec, n_layers = self.m, self.layout, self.opts, self.prec, self.n_layers
        # a stage's backward peaks at its first layer (every activation, few gradients), its second (FSDP: the first
        # block's reduce-scatter input and sharded gradient there by then) or its last (one layer's activations,
        # every gradient): the bytes are linear in between
        moments = [self.fixed + self.grads_after(done) + self.activations(self.flight - 1, n_layers - done)
                   + self.layer_backward(done) for done in sorted({0, min(1, n_layers - 1), n_layers - 1})]
        parts = {"backward": max(moments, key=_device),
                 "optimizer": [t for t in self.fixed if not t.name.startswith("gathered")]   # FSDP resharded
                              + [t for t in self.grads if not t.name.startswith("gradient bucket")
                                 and not (opts.optimizer_offload and "reduced" in t.name) and not self.streamed]
                              + optimizer_terms(m, layout, opts, prec, self.first, self.last, self.M)}
        end = fsdp_end_terms(m, layout, opts, prec, self.first, self.last, n_layers)
        if end is not None:
            parts["end of backward"] = self.fixed + end
        if self.last:
            parts["loss"] = self.loss()
            parts["final norm"] = self.final_norm()
        return parts

    def estimate(self) -> Estimate:
        m, layout, opts, prec, work = self.m, self.layout, self.opts, self.prec, self.work
        parts = self.parts()
        part = max(parts, key=lambda p: _device(parts[p]))
        terms = [t for t in parts[part] if not t.host and t.bytes]
        host = [t for t in self.fixed + optimizer_terms(m, layout, opts, prec, self.first, self.last, self.M)
                if t.host]
        host = pinned_terms(pinned_requests(m, layout, opts, prec, work, self.stage)) + host   # what the arena holds
        return Estimate(peak=_device(terms), stage=self.stage, part=part, terms=terms + host,
                        host=sum(t.bytes for t in host), layer_bytes_per_token=self.layer_tok, layout=layout,
                        options=opts, largest=largest_block(m, layout, opts, prec, work, self.last),
                        parts={(self.stage, p): _device(ts) for p, ts in parts.items()})


def _device(terms: list[Term]) -> float:
    return sum(t.bytes for t in terms if not t.host)


ONE_MICRO_BATCH = Workload(1 << 34)       # longest_sequence's default: one sample a step, at most 2**34 tokens


def longest_sequence(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, budget: float,
                     work: Workload = ONE_MICRO_BATCH, multiple: int = 1, max_elements: Optional[int] = None) -> int:
    """The longest sequence (a multiple of `multiple`, at most work.seq_len) whose predicted peak fits in
    `budget` bytes at work's micro-batch size and count; 0 if none. `max_elements`: kernels that index with
    32-bit offsets fail on a (tokens x hidden) activation of more elements than this, whatever the memory
    (2**31 for such kernels)."""
    limit, micro_batch_size = work.seq_len, work.micro_batch_size
    if max_elements is not None:
        limit = min(limit, max_elements * layout.sp // (micro_batch_size * m.hidden_size))

    def fits(units: int) -> bool:
        return estimate(m, layout, opts, prec, replace(work, seq_len=units * multiple)).peak <= budget

    hi = limit // multiple
    if hi < 1 or not fits(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * multiple
