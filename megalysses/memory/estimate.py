"""The estimate: the peak over the pipeline stages and the phases of a step, and the longest sequence
that fits a budget."""
from __future__ import annotations

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
from megalysses.memory.types import Estimate, Layout, Options, Precision, Term, Workload


def estimate(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, work: Workload) -> Estimate:
    """The peak over the pipeline stages (the first holds the most micro-batches, the last the loss), with the
    largest single block of any of them."""
    stages = [_stage_estimate(m, layout, opts, prec, work, s) for s in sorted({0, layout.pp - 1})]
    est = max(stages, key=lambda e: e.peak)
    est.largest = max((e.largest for e in stages), key=lambda t: t.bytes)
    est.phases = {key: b for e in stages for key, b in e.phases.items()}
    return est


def _stage_estimate(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, work: Workload,
                    stage: int) -> Estimate:
    first, last = stage == 0, stage == layout.pp - 1
    S, M = work.seq_len, work.micro_batches
    tokens = work.micro_batch_size * S / layout.sp          # one micro-batch, S/sp tokens
    n_layers = stage_layers(m, layout)
    layer_tok = bytes_per_token(layer_terms(m, layout, opts, prec, S))
    flight = in_flight(layout, stage, M)
    offload = opts.activation_offload and opts.activation_checkpointing

    def activations(behind: float, current_layers: int) -> list[Term]:
        """The retained activations: `behind` whole micro-batches, the current one's first `current_layers`."""
        mbs = behind + 1
        if not offload:
            every, now = kept_layers(n_layers, opts), kept_layers(current_layers, opts)
            count = behind * every + now
            terms = [Term("layer activations", count * tokens * layer_tok,
                          f"({behind:g} mb x {every} + {now}) layers x {tokens:.4g} tok x "
                          f"{layer_tok:.4g} B")]
        else:
            kept = 0 if first else 1                # a received pipeline input stays (the schedule holds it)
            ahead = min(opts.offload_prefetch, n_layers - kept, current_layers)
            terms = [Term(f"offload window ({ahead} block input{'' if ahead == 1 else 's'} copied back ahead)",
                          ahead * tokens * layer_tok, f"{ahead} x {tokens:.4g} tok x {layer_tok:.4g} B")]
            if kept:
                terms.append(Term("received stage inputs", mbs * tokens * layer_tok,
                                  f"{mbs:g} mb x {tokens:.4g} tok x {layer_tok:.4g} B"))
        stage_tok = bytes_per_token(stage_terms(m, layout, opts, prec, first, False))
        if stage_tok:
            terms.append(Term("stage activations (rotary cos/sin, tp-local ids)", mbs * tokens * stage_tok,
                              f"{mbs:g} mb x {tokens:.4g} tok x {stage_tok:.4g} B"))
        masked = opts.documents or m.sliding_window > 0              # sdpa builds dense masks for either
        if masked and opts.attention == "sdpa" and layout.ring > 1:
            # each block's allowed pairs (bool) and additive mask (compute dtype): the rank's own block
            # whole, the r-1 others half (kernels/block_attention.py AttentionBlock, on CPU)
            r, B = layout.ring, work.micro_batch_size
            masks = B * (S / r) ** 2 * (r + 1) / 2 * (1 + prec.act)
            terms.append(Term("dense document (window) masks of the ring's blocks (sdpa)", masks,
                              f"B x (S/r)^2 x (r+1)/2 x (1 + {prec.act}) B, r = {r}"))
        elif masked and opts.attention == "sdpa":
            terms.append(Term("dense document (window) mask (sdpa)", work.micro_batch_size * S ** 2,
                              f"B x S^2 = {work.micro_batch_size} x {S}^2 B"))
        mask = flex_mask(m, layout, opts, work)
        if mask is not None:
            terms.append(mask)
        return terms

    fixed, grads = state_terms(m, layout, opts, prec, first, last, M)
    # the step's micro-batches, loaded at its start: token ids, labels, positions (and document ids)
    batch = M * tokens * (3 * 8 + (8 * layout.sp if opts.documents else 0))
    fixed.append(Term("the step's batch (ids, labels, positions)", batch, f"{M} mb x {tokens:.4g} tok x 24 B"))
    blocks, other = stage_params(m, layout, first, last)
    n = blocks + other
    streamed = streams_gradients(opts)
    accumulated = earlier_backward(layout, stage, M)

    def grads_after(done: int) -> list[Term]:      # the gradients after `done` blocks of the backward
        return backward_gradients(m, layout, opts, prec, first, last, M, grads, done, n_layers, streamed,
                                  accumulated)

    def layer_backward(done: int) -> list[Term]:
        """The layer's backward after `done` blocks, its own new weight gradients weighed: in .grad (one
        micro-batch, FSDP's unsharded ones) and, as their buckets complete, their reduced fp32 chunks; in fp32
        main_grad the step's first backward makes; nothing where they add into an earlier micro-batch's."""
        ready = other - embedding_params(m, layout, first, last) + done * blocks / max(n_layers, 1)
        reduced = reduced_bytes(prec, opts, layout.dp * layout.sp, M) if opts.overlap_grad_reduce else 0.0

        def weigh(elements: float) -> float:
            if opts.fsdp or streamed or M == 1:
                own = elements * prec.weight
            else:
                return 0.0 if accumulated else elements * 4.0
            if M == 1 and not (opts.fsdp or streamed) and reduced:
                closed = [r - waiting_for_bucket(m, layout, opts, last, r) for r in (ready, ready + elements)]
                own += (closed[1] - closed[0]) * reduced
            return own
        return backward_terms(m, layout, opts, prec, tokens, S, weigh)

    head_grads = grads_after(0)
    # a stage's backward peaks at its first layer (every activation, few gradients), its second (FSDP: the first
    # block's reduce-scatter input and sharded gradient there by then) or its last (one layer's activations,
    # every gradient): the bytes are linear in between
    moments = [fixed + grads_after(done) + activations(flight - 1, n_layers - done) + layer_backward(done)
               for done in sorted({0, min(1, n_layers - 1), n_layers - 1})]
    phases = {"backward": max(moments, key=_device),
              "optimizer": fixed + [t for t in grads if not t.name.startswith("gradient bucket")
                                    and not (opts.optimizer_offload and "reduced" in t.name) and not streamed]
                           + optimizer_terms(m, layout, opts, prec, n, M)}
    end = fsdp_end_terms(m, layout, opts, prec, first, last, n_layers)
    if end is not None:
        phases["end of backward"] = fixed + end
    if last:
        head_tok = bytes_per_token(stage_terms(m, layout, opts, prec, False, True)) - \
            bytes_per_token(stage_terms(m, layout, opts, prec, False, False))
        # (the head weight's gradient is made at the end of the loss's forward, after its worst moment)
        head = [Term("final norm + head-input gradient", tokens * head_tok, f"{tokens:.4g} tok x {head_tok:.4g} B")]
        before = [t for t in grads if "reduced" not in t.name] if M > 1 and not streamed else []
        phases["loss"] = (fixed + before + activations(flight - 1, n_layers) + head
                          + loss_terms(m, layout, opts, prec, tokens))
        # the backward's first step, the final norm's, under every layer's activations: what the norm keeps,
        # the gradient coming in, and the norm backward's temporaries (one tile's, for the torch norms)
        d = dims(m, layout, opts)
        norm_tok = (bytes_per_token(norm_terms("final norm", d["h"], d["r"], prec.act, d["k"], m.norm))
                    + d["h"] / d["r"] * prec.act)
        temps = (norm_backward_bytes(m, opts, prec) * d["h"] / d["r"]
                 + norm_tile_bytes(m, opts, prec, tokens / d["r"]) / tokens)
        phases["final norm"] = (fixed + head_grads + activations(flight - 1, n_layers)
                                + [Term("final norm: its input, 1/rms and the gradient coming in", tokens * norm_tok,
                                        f"{tokens:.4g} tok x {norm_tok:.4g} B"),
                                   Term("final norm backward's temporaries", tokens * temps,
                                        f"{tokens:.4g} tok x {temps:.4g} B")])
    phase = max(phases, key=lambda p: _device(phases[p]))
    terms = [t for t in phases[phase] if not t.host and t.bytes]
    host = [t for t in fixed + optimizer_terms(m, layout, opts, prec, n, M) if t.host]
    host = pinned_terms(pinned_requests(m, layout, opts, prec, work, stage)) + host     # what the arena holds
    return Estimate(peak=_device(terms), stage=stage, phase=phase, terms=terms + host,
                    host=sum(t.bytes for t in host), layer_bytes_per_token=layer_tok, layout=layout, options=opts,
                    largest=largest_block(m, layout, opts, prec, work, last),
                    phases={(stage, p): _device(ts) for p, ts in phases.items()})


def _device(terms: list[Term]) -> float:
    return sum(t.bytes for t in terms if not t.host)


def longest_sequence(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, budget: float,
                     micro_batch_size: int = 1, micro_batches: int = 1, multiple: int = 1,
                     limit: int = 1 << 34, max_elements: Optional[int] = None) -> int:
    """The longest sequence (a multiple of `multiple`) whose predicted peak fits in `budget` bytes; 0 if
    none. `max_elements`: kernels that index with 32-bit offsets fail on a (tokens x hidden) activation
    of more elements than this, whatever the memory (2**31 for such kernels)."""
    if max_elements is not None:
        limit = min(limit, max_elements * layout.sp // (micro_batch_size * m.hidden_size))

    def fits(units: int) -> bool:
        work = Workload(units * multiple, micro_batch_size, micro_batches)
        return estimate(m, layout, opts, prec, work).peak <= budget

    hi = limit // multiple
    if hi < 1 or not fits(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * multiple
