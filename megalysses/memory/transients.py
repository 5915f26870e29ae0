"""Transient bytes on top of what is kept: one layer's backward (ring attention's included), the norm
backward's temporaries and the LM head + loss forward."""
from __future__ import annotations

from typing import Any, Callable, Optional

from megalysses.config import ModelConfig
from megalysses.kernels.linear_cross_entropy import default_chunk_tokens
from megalysses.kernels.norms import norm_tile_rows
from megalysses.memory.activations import (attention_half_terms, attention_terms, bytes_per_token, dims,
                                           kept_attention_terms, mlp_half_terms, tiled)
from megalysses.memory.states import head_norm_params, mlp_params, norm_params
from megalysses.degrees import Degrees
from megalysses.memory.types import GIB, KERNELS, Options, Precision, Term


def backward_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, tokens: float,
                   seq_len: int, grad_bytes: Optional[Callable[[float], float]] = None) -> list[Term]:
    """One layer's backward on one rank, on top of what the other layers keep: its own activations
    (retained or recomputed) and the gradients being computed, at the worst of its moments as the
    backward walks the layer from its end (each moment's activations are those not yet freed):
        MLP        every activation of the layer; the down input's gradient and its factors' (with MLP
                   tiles: the residual's gradient, written tile by tile, and one tile's recomputation)
        MLP norm   the attention half's activations and the norm's; its backward's temporaries (with
                   MLP tiles the norm runs inside them)
        attention  the attention half's activations; dout, dq, dk, dv (and flash's fp32 dq accumulator)
        QKV        the norm's and the QKV input; the QKV output's gradient being assembled (and, with
                   sp>1, the all-to-all's gradient buffers)
        attention norm  its input; the QKV input's gradient, dx and its backward's temporaries
    plus the residual stream's gradient throughout. With head chunks (model/tiled.py HeadChunks) the
    attention half keeps only the block input: its backward recomputes the norm output (the QKV input),
    and the attention and QKV moments are those of one chunk, recomputed, beside the QKV input's gradient
    that the chunks sum into; then the attention norm's backward writes the block input's gradient over
    that sum; and each chunk's forward (the recomputation) adds into one output."""
    d = dims(m, layout, opts)
    k, a, N = d["k"], prec.act, opts.head_chunks
    h, r, f = d["h"], d["r"], d["f"]
    attn_terms = attention_half_terms(m, layout, opts, prec, seq_len)
    full = attn_terms + mlp_half_terms(m, layout, opts, prec, seq_len)
    attn_half = bytes_per_token(attn_terms)
    before_core, at_core, chunk_name, summed = _attention_alive(m, layout, opts, prec, seq_len, attn_terms)
    if N > 1:
        d = dims(m, layout, opts, N)
    core, core_name = _core_backward(d, opts, a, seq_len)
    core, core_name = core + summed, core_name + chunk_name
    mlp_tiled = tiled(opts.mlp_chunk_tokens, layout, opts, seq_len)
    mlp, mlp_name = _mlp_backward(m, layout, opts, prec, tokens, h, r, f) if mlp_tiled else \
        (2 * f * a, "MLP: the down input's gradient and its factors'")
    assembly = (k.qkv_grad_buffers * d["qkv"] + (3 * (d["q"] + 2 * d["kv"]) if d["P"] > 1 else 0)) * a + summed
    # with the attention output and LSE kept, those of the moments past attention are retained, not recomputed
    kept = bytes_per_token(kept_attention_terms(m, layout, opts, prec))
    moments = {mlp_name: (bytes_per_token(full) - kept, mlp),
               core_name: (at_core - kept, core),
               "QKV: the output's gradient" + (", the all-to-all's buffers" if d["P"] > 1 else "") + chunk_name:
                   (before_core, assembly)}
    if not mlp_tiled:
        mlp_norm = bytes_per_token([t for t in full if t[0].startswith("MLP norm")])
        # the gradient of its output coming in (gathered over tp), its dx for every token, and one tile's
        # temporaries (tokens / r rows of the residual stream)
        norm_temps = h * a + norm_backward_bytes(m, opts, prec) * h / r \
            + norm_tile_bytes(m, opts, prec, tokens / r) / tokens
        moments["MLP norm: its backward's temporaries"] = (attn_half + mlp_norm - kept, norm_temps)
    # the attention norm's backward over row tiles: the QKV input's gradient coming in, and dx (head chunks write it
    # over that gradient, reduce-scattered over tp first)
    norm_in = attn_terms if N > 1 else [t for t in attn_terms if t[0].startswith("attention norm")]
    dx = (h / r * a if r > 1 else 0) if N > 1 else norm_backward_bytes(m, opts, prec) * h / r
    moments["attention norm: its backward's temporaries"] = (
        bytes_per_token(norm_in), h * a + dx + norm_tile_bytes(m, opts, prec, tokens / r) / tokens)
    if N > 1:   # a chunk's forward (recomputed under checkpointing): its activations and the running output sum
        moments["head chunk forward: its activations, o_proj's running sum"] = (at_core - kept, h * a)
    if d["P"] > 1 and (opts.checkpointing or N > 1):
        moments[f"all-to-all of the attention's recomputed forward{chunk_name}"] = (
            before_core, ulysses_forward_bytes(d, k, a) + (h * a if N > 1 else 0))
    own = own_weight_grads(m, layout, opts, mlp_tiled)
    weigh = grad_bytes or (lambda elements: elements * prec.weight)
    moments = {n: (al, g + weigh(own[_kind(n)]) / tokens) for n, (al, g) in moments.items()}
    return _worst_moment_terms(moments, opts, tokens, h / r, a, bytes_per_token(full))


def _attention_alive(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, seq_len: int,
                     attn_terms: list) -> tuple[float, float, str, float]:
    """Bytes per token alive before the attention kernel's backward and at it, the head chunks' name for the
    moments, and the QKV input's gradient the chunks sum into (0 without head chunks)."""
    d, a, N = dims(m, layout, opts), prec.act, opts.head_chunks
    attn_half = bytes_per_token(attn_terms)
    if N <= 1:
        before_core = bytes_per_token([t for t in attn_terms
                                       if t[0].startswith(("attention norm", "QKV input", "cos, sin"))])
        return before_core, attn_half, "", 0.0
    # the block input, the recomputed QKV input, one chunk's activations
    chunk = attention_terms(m, layout, opts, prec, seq_len, N)
    h = d["h"]
    d = dims(m, layout, opts, N)
    # the chunk's QKV output stays bound through its backward (model/tiled.py chunks_backward), as a view
    # of v keeps it anyway with some kernels
    qkv_out = 0 if any(t[0].startswith("the QKV output") for t in chunk) else d["qkv"] * a
    casts = bytes_per_token([t for t in chunk if t[0].startswith("cos, sin")])
    before_core = attn_half + h * a + casts + qkv_out
    at_core = attn_half + h * a + bytes_per_token(chunk) + qkv_out
    return before_core, at_core, f" (one of {N} head chunks, the QKV input's gradient summed)", h * a


def varlen_document_bytes(m: ModelConfig, layout: Degrees, opts: Options, micro_batch_size: int) -> float:
    """What a variable-length kernel's backward keeps for its sequences beyond their tokens: 128 rows per
    sequence of its cumulative lengths (opts.varlen_sequences a row of the micro-batch) of its fp32 dq
    accumulator and rowsum(dO * O), over the query heads of a head chunk on a rank (flash-attn's
    mha_varlen_bwd; the part of _core_backward's rows beyond the tokens)."""
    if not opts.dq_accumulator or not opts.varlen_sequences:
        return 0.0
    d = dims(m, layout, opts, opts.head_chunks)
    return 128 * opts.varlen_sequences * micro_batch_size * 4 * (d["q_acc"] + d["hq"]) / layout.ulysses


def _core_backward(d: dict, opts: Options, a: int, seq_len: int) -> tuple[float, str]:
    """The attention kernel's backward buffers per token (or ring attention's), and their name."""
    q, kv = d["q"], d["kv"]
    # the kernel's dk, dv: at the query heads' width when K/V were repeated to them before it; a flash kernel
    # (FlashAttention-2's backward, torch's flash kernels) reading fewer KV heads as they are writes them at
    # that width inside too (dk_expanded, dv_expanded) before summing each group into dk, dv
    kv_grads = q if d["expand"] else kv
    # a variable-length kernel's fp32 workspaces have 128 rows more per sequence of its cumulative lengths
    # (flash-attn's mha_varlen_bwd: dq_accum and softmax_d of total_q + 128 x sequences rows), dq_accum's head
    # size rounded as the kernel rounds it
    rows = 1 + 128 * opts.varlen_sequences / seq_len if seq_len else 1
    accumulator = 4 * d["q_acc"] * rows if opts.dq_accumulator else 0
    inside = 2 * q * a if opts.dq_accumulator and not d["expand"] and q != kv else 0
    # the fp32 rowsum(dO * O) per query head (a flash kernel's softmax_d, FlexAttention's delta)
    rowsum = 4 * d["hq"] * rows if opts.dq_accumulator or opts.attention == "flex" else 0
    if d["ring"] > 1:
        return _ring_backward(q, kv, a, d["ring"], opts, accumulator,
                              recomputed=opts.checkpointing or opts.head_chunks > 1)
    core = (2 * q + 2 * kv_grads) * a + inside + accumulator + rowsum
    return core, ("attention: dout, dq, dk, dv" + (", dk and dv at the query heads" if inside else "")
                  + (", fp32 dq accumulator" if accumulator else "") + (", fp32 rowsum(dO O)" if rowsum else ""))


def _mlp_backward(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, tokens: float,
                  h: float, r: int, f: float) -> tuple[float, str]:
    """With MLP tiles: a tile's backward (model/tiled.py MLPTiles) at the worst of its MLP's (the norm output,
    gathered over tp, the gate-up output, silu, the down input and their gradients, the tile's output) and its
    norm's (the norm output's gradient, the tile's input gradient and output beside the norm's temporaries);
    the residual's gradient for every token, and the MLP's weights' gradients: their fp32 sums over the tiles,
    one tile's in the weights' dtype."""
    a = prec.act
    tile = opts.mlp_chunk_tokens * r / tokens      # a tile's share of the tokens
    weights = (mlp_params(m, layout.tp) + norm_params(m)) * (4 + prec.weight)
    tile_mlp = tile * (((4 if KERNELS[opts.kernels].swiglu_silu else 3) + 2) * f + 3 * h) * a
    tile_norm = tile * 3 * h * a + norm_tile_bytes(m, opts, prec, opts.mlp_chunk_tokens) / tokens
    return (max(tile_mlp, tile_norm) + h / r * a + weights / tokens,
            "MLP tile: its recomputation and gradients, the residual's gradient, the weights' fp32 sums")


def _worst_moment_terms(moments: dict, opts: Options, tokens: float, width: float, a: int,
                        full: float) -> list[Term]:
    """The layer's backward at its worst moment as terms: its recomputed activations (or, retained, those freed
    by then off), its transient bytes, a checkpoint group's other inputs and the residual stream's gradient;
    `width`: the residual stream's elements per token (h / r), `a` bytes each; `full`: the bytes per token a
    layer keeps."""
    residual = width * a
    name, (alive, grads) = max(moments.items(), key=lambda kv_: sum(kv_[1]))
    offloaded = opts.offload and opts.checkpointing
    if opts.checkpointing and not offloaded:
        alive -= residual                  # the norm's input is the retained block input itself
    what = "recomputed" if opts.checkpointing else "own"
    terms = [] if not opts.checkpointing else [
        Term(f"the layer's {what} activations (at its worst moment)", tokens * alive,
             f"{tokens:.4g} tok x {alive:.4g} B")]
    if not opts.checkpointing:      # retained already: what is freed by that moment comes off
        terms.append(Term("the layer's activations freed by then", -tokens * (full - alive),
                          f"-{tokens:.4g} tok x {full - alive:.4g} B"))
    each = ", ".join(f"{n.split(':')[0]} {(al + g) * tokens / GIB:.3g} GiB" for n, (al, g) in moments.items())
    terms.append(Term(f"backward of one layer, {name}", tokens * grads, f"{tokens:.4g} tok x {grads:.4g} B; {each}"))
    k = opts.checkpoint_stride if opts.checkpointing else 1
    if k > 1:   # a group recomputed from its input keeps every block input of the group (model/gpt.py)
        terms.append(Term(f"the group's other recomputed block inputs ({k - 1})", (k - 1) * tokens * residual,
                          f"{k - 1} x {tokens:.4g} tok x {width:.4g} x {a} B"))
    terms.append(Term("residual-stream gradient", tokens * residual, f"{tokens:.4g} tok x {width:.4g} x {a} B"))
    return terms


def ulysses_forward_bytes(d: dict, k: Any, a: int) -> float:
    """Bytes per token of the Ulysses all-to-all of q, k, v in a (recomputed) forward at its worst, the QKV
    projection's output beside it (parallel/ulysses.py, comm._all_to_all): RoPE's q and k (and v, with kernels
    that make a new one), k and v repeated to the Ulysses degree when there are fewer KV heads, the packed
    q, k, v, and the all-to-all's stacked send buffer, its receive buffer and the concatenated result."""
    kv_local = d["qkv"] - d["q"]                 # k and v of the rank's own KV heads
    rotated = d["q"] + (kv_local if k.fresh_qkv else kv_local / 2)
    repeated = 2 * d["kv"] if d["kv"] * 2 != kv_local else 0
    packed = d["q"] + 2 * d["kv"]
    return (d["qkv"] + rotated + repeated + 4 * packed) * a


def _kind(moment: str) -> str:
    """The part of a layer a backward moment is in (own_weight_grads' keys)."""
    for kind in ("MLP norm", "MLP", "attention norm", "QKV", "head", "all-to-all"):
        if moment.startswith(kind):
            return kind
    return "attention"          # the attention kernel's, or ring attention's, backward


def own_weight_grads(m: ModelConfig, layout: Degrees, opts: Options, mlp_tiled: bool) -> dict:
    """How many of the layer's own weight-gradient elements exist at each moment of its backward (keyed by
    _kind: MLP, MLP norm, attention, QKV, attention norm, head, all-to-all); the caller weighs them in bytes
    (in .grad, fp32 main_grad, reduced chunks, ...): down_proj's with the down input's gradient, the whole
    MLP's and its norm's from then on (MLP tiles return theirs at once, their fp32 sums counted in the MLP
    tile's moment), o_proj's from attention on, the QKV weight's at the attention norm; head chunks allocate
    the QKV and o_proj gradients whole when their backward starts."""
    h, D, t = m.hidden_size, m.head_size, layout.tp
    mlp = mlp_params(m, t) + norm_params(m)
    down = h * m.ffn_size / t
    o_proj = h * m.num_heads * D / t + (h if m.attention_bias else 0) + head_norm_params(m)
    qkv = (h + m.qkv_bias) * D * (m.num_heads + 2 * m.kv_heads) / t
    chunks = opts.head_chunks > 1
    attention = mlp + o_proj + (qkv if chunks else 0)
    recomputing = 0.0 if opts.checkpointing else (mlp + o_proj + qkv) if chunks else 0.0
    return {"MLP": 0.0 if mlp_tiled else down, "MLP norm": mlp - norm_params(m), "attention": attention,
            "QKV": attention, "attention norm": mlp + o_proj + qkv, "head": recomputing, "all-to-all": recomputing}


def norm_backward_bytes(m: ModelConfig, opts: Options, prec: Precision) -> float:
    """Bytes per hidden element per token of a norm's backward beyond one tile: its input's gradient, dx (a
    fused kernel writes it in one pass; the tiled torch norms tile by tile into one tensor)."""
    return prec.act


def norm_tile_bytes(m: ModelConfig, opts: Options, prec: Precision, rows: float) -> float:
    """Bytes of the temporaries of a norm's backward over `rows` rows that exist for one tile at a time: the
    torch norms (kernels/norms.py TiledNorm, norm_tile_rows rows a tile) recompute a tile and take its
    gradients under autograd. RMSNorm's reference then holds six fp32 copies of the tile at its worst (x^2,
    x * 1/rms, the output, the gradients of the normalised x, of x and of the weight's product), and in bf16
    a compute-dtype one more; LayerNorm's the recomputed output and the tile's dx. Fused kernels: none."""
    if not KERNELS[opts.kernels].norm_tiled and m.norm == "rmsnorm":
        return 0.0
    a = prec.act
    per_element = (24 + (a if a != 4 else 0)) if m.norm == "rmsnorm" else 2 * a
    return per_element * min(rows, norm_tile_rows(m.hidden_size)) * m.hidden_size


def _ring_backward(q: float, kv: float, a: int, ring: int, opts: Options, accumulator: float,
                   recomputed: bool) -> tuple[float, str]:
    """Bytes per S/sp token of ring attention's backward (parallel/ring.py) at its worst moment, beyond the
    layer's activations: the fp32 dQ, dout, the K/V block in hand (a received one from the second step on,
    beside the saved one) and D, this step's fp32 dK/dV (`kv` elements per token each), then the largest of
        kernel  a block's backward: D of the step before on its way out, the next D (and, with r > 2, the
                next K/V block) arriving, and dq, dk, dv (sdpa expands K/V to the query heads and writes
                their gradients at that width; flex re-runs the block in fp32 around it)
        merge   the arrived D that this block's dK, dV (in the compute dtype) are added into, the one sent
                before still held by its exchange
        end     the last D, the one before it still held by its exchange, the sum that came home, and the
                gradients' copies in the compute dtype
        exchange a step's exchange posted (with r > 2): the K/V block and D sent the step before, still held
                by that exchange until the new one replaces it, those sent now, and the receive buffers of
                both (comm.ring_exchange)
        dq added the block's dq, dk, dv, dq made fp32 to be added into the running dQ (a low-precision run).
    `recomputed`: the attention ran again for this backward (checkpointing, head chunks)."""
    base = 4 * q + q * a + 2 * kv * a       # from the second step on the block in hand is a received one
    if opts.attention == "flex":
        grads = 8 * q + 2 * q * a + (q + 2 * kv) * a
    elif not opts.native_gqa and q != kv:
        grads = 2 * q * a + 3 * q * a + accumulator
    else:
        grads = (q + 2 * kv) * a + accumulator
    next_kv = 2 * kv * a if ring > 2 else 0
    moments = {"kernel": 2 * 8 * kv + next_kv + grads, "merge": next_kv + 2 * 8 * kv + 2 * kv * a,
               "end": 3 * 8 * kv + (q + 2 * kv) * a}
    if ring > 2:
        moments["exchange"] = 3 * 8 * kv + 2 * next_kv
    if a != 4:      # the block's dq, dk, dv returned, dq made fp32 to be added into the running dQ
        moments["dq added"] = 2 * 8 * kv + next_kv + (q + 2 * kv) * a + 4 * q
    worst = max(moments, key=moments.get)
    return base + moments[worst], f"ring attention's backward ({worst}): fp32 dq and dK/dV, dout, K/V blocks"


def loss_tile_tokens(m: ModelConfig, layout: Degrees, opts: Options, tokens: float) -> float:
    """Tokens per LM head + loss tile (kernels/linear_cross_entropy.py default_chunk_tokens)."""
    chunk = opts.loss_chunk_tokens or default_chunk_tokens(m.padded_vocab_size(layout.tp) // layout.tp)
    return min(chunk, tokens)


def loss_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, tokens: float) -> list[Term]:
    """The LM head + loss forward, beyond what it keeps (stage_terms): its input, and the worst of its moments
    (kernels/linear_cross_entropy.py). One tile: the fp32 logits and the gradient's compute-dtype copy. More:
    either a tile's logits made fp32 (beside the matmul's output in the compute dtype) while the previous tile's
    logit gradient and weight gradient are still bound, over the fp32 sum of the head weight's gradient; or a
    tile's weight gradient added into that sum (its fp32 copy beside it), the tile's logit gradient alive."""
    a, h = prec.act, m.hidden_size
    V = m.padded_vocab_size(layout.tp) / layout.tp
    tile = loss_tile_tokens(m, layout, opts, tokens)
    low = a if a != 4 else 0                # a copy in the compute dtype (none in fp32: .float() is the tensor)
    terms = [Term("LM head input (final norm output)", tokens * h * a, f"{tokens:.4g} tok x {h} x {a} B")]
    if tile >= tokens:
        return terms + [Term("one tile of logits (fp32 and the gradient's copy)", tile * V * (4 + low),
                             f"{tile:.4g} tok x {V:.4g} x {4 + low} B")]
    logits = {"a tile's logits made fp32, the previous tile's gradients still bound": (4 + low + a, 4 + a),
              "a tile's weight gradient added into the fp32 sum": (a, 4 + a + (4 if low else 0))}
    name, (per_logit, per_weight) = max(logits.items(), key=lambda kv: tile * V * kv[1][0] + V * h * kv[1][1])
    return terms + [Term(f"loss tile: {name}", tile * V * per_logit, f"{tile:.4g} tok x {V:.4g} x {per_logit} B"),
                    Term("head weight gradient: its fp32 sum and a tile's", V * h * per_weight,
                         f"{V:.4g} x {h} x {per_weight} B")]
