"""What a forward keeps for the backward: per-layer and per-stage terms in elements per S/sp token, and
the bytes one micro-batch retains on a rank of a stage."""
from __future__ import annotations

from dataclasses import dataclass

from typing import Any, Optional

from megalysses.config import ModelConfig
from megalysses.degrees import Degrees
from megalysses.memory.types import KERNELS, Kernels, Options, Precision

PerToken = list[tuple[str, float, int]]      # (name, elements per S/sp token, bytes per element)


def kv_replication(kv_heads: int, sp: int) -> int:
    """Ulysses repeats each tp-local KV head this many times when there are fewer than sp (parallel/ulysses.py)."""
    return 1 if kv_heads >= sp else sp // kv_heads


def flash_kernel(opts: Options, ring: int) -> bool:
    """Whether the attention backward runs a flash kernel (FlashAttention-2's mha_bwd or mha_varlen_bwd, in
    flash-attn's build or torch's): backends flash and varlen, and torch's SDPA on CUDA where it picks its flash
    kernel (ring blocks; no mask in half precision, where it reads grouped KV heads as they are)."""
    sdpa_flash = opts.attention == "sdpa" and opts.dq_accumulator and (ring > 1 or opts.native_gqa)
    return opts.attention in ("flash", "varlen") or sdpa_flash


def accumulator_head_size(head_size: int, flash: bool) -> int:
    """The head size of the attention backward's fp32 dq accumulator: a flash kernel's (`flash`) is the head size
    padded to a multiple of 8, then rounded up to 32 up to 128 and to 64 above (round_multiple(head_size,
    head_size <= 128 ? 32 : 64)); another kernel's the head size."""
    if not flash:
        return head_size
    padded = -(-head_size // 8) * 8
    step = 32 if padded <= 128 else 64
    return -(-padded // step) * step


def dims(m: ModelConfig, layout: Degrees, opts: Options, chunks: int = 1) -> dict[str, Any]:
    """Sizes per S/sp token on one rank. P: the Ulysses degree (all-to-alls, KV replication); ring: the
    ring degree (ring attention keeps its own copies and expands KV heads inside its kernels only).
    `chunks`: the attention sizes (q, kv, hq, qkv) of one of that many head chunks (each replicating its
    own KV heads to the Ulysses degree when it has fewer); q_acc: the query width of the attention backward's
    fp32 dq accumulator (accumulator_head_size)."""
    t, P, ring = layout.tp, layout.ulysses, layout.ring
    if ring > 1 and opts.attention == "reference":
        raise ValueError(f"memory model: ring attention (sp={layout.sp} = ulysses {P} x ring {ring}) with the "
                         f"reference backend keeps dense S/ring x S/ring masks and fp32 scores per block, which "
                         f"the model does not count; plan with sdpa, flash or flex")
    hq, hk = m.num_heads // t // chunks, m.kv_heads // t // chunks
    rep = kv_replication(hk, P)
    q, kv = hq * m.head_size, hk * rep * m.head_size           # per S/sp token on one tp rank
    expand = ring == 1 and (opts.attention == "reference" or not opts.native_gqa) and hq != hk * rep
    return {"h": m.hidden_size, "r": t if opts.tp_sequence_parallel else 1, "q": q, "kv": kv, "hq": hq, "hk": hk,
            "qkv": q + 2 * hk * m.head_size, "q_acc": hq * accumulator_head_size(m.head_size, flash_kernel(opts, ring)),
            "f": m.ffn_size / t, "expand": expand, "P": P, "ring": ring,
            "k": KERNELS[opts.kernels]}


def tiled(chunk: int, layout: Degrees, opts: Options, seq_len: int) -> bool:
    """Whether MLP tiles split the local residual sequence (S/(sp*r) tokens): model/layers.py runs one
    tile of the whole sequence when they do not (seq_len 0: unknown, assume they do)."""
    r = layout.tp if opts.tp_sequence_parallel else 1
    return bool(chunk) and (not seq_len or chunk < seq_len // (layout.sp * r))


def norm_terms(name: str, h: float, r: float, a: int, k: Kernels, kind: str) -> PerToken:
    """What a norm keeps: its input as it is (the attention norm's is the block input itself), and 1/rms for
    the fused RMSNorm kernels; the tiled torch norms (LayerNorm always) recompute the rest."""
    if kind == "layernorm" or k.norm_tiled:
        return [(f"{name} input", h / r, a)]
    return [(f"{name} input", h / r, a), (f"{name} 1/rms", 1 / r, 4)]


def layer_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, seq_len: int = 0,
                checkpointed: Optional[bool] = None) -> PerToken:
    """(name, elements per S/sp token, bytes each) that one layer keeps for its backward. `seq_len` decides
    whether MLP tiles split the sequence, and sizes the reference backend's S x S probabilities."""
    d = dims(m, layout, opts)
    h, r, a = d["h"], d["r"], prec.act
    if opts.checkpointing if checkpointed is None else checkpointed:
        return [("block input (checkpoint)", h / r, a)] + kept_attention_terms(m, layout, opts, prec)
    return attention_half_terms(m, layout, opts, prec, seq_len) + mlp_half_terms(m, layout, opts, prec, seq_len)


def attention_half_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, seq_len: int = 0) -> PerToken:
    """What the norm, the QKV projection, attention and o_proj keep (not checkpointed). Head chunks keep the
    block input alone (model/tiled.py HeadChunks recomputes the rest)."""
    d = dims(m, layout, opts)
    h, r, k, a = d["h"], d["r"], d["k"], prec.act
    if opts.head_chunks > 1:
        return [(HEAD_CHUNKS_INPUT, h / r, a)]
    gathered = " (all-gathered over tp)" if opts.tp_sequence_parallel and layout.tp > 1 else ""
    terms = norm_terms("attention norm", h, r, a, k, m.norm)
    terms.append(("QKV input (norm output" + gathered + ")", h, a))
    return terms + attention_terms(m, layout, opts, prec, seq_len)


HEAD_CHUNKS_INPUT = "block input (the head chunks' input)"


def mlp_half_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, seq_len: int = 0) -> PerToken:
    """What the MLP norm and the MLP keep (not checkpointed). MLP tiles keep their input alone, the residual
    after attention (model/tiled.py MLPTiles recomputes the norm and the MLP tile by tile)."""
    d = dims(m, layout, opts)
    h, r, k, a = d["h"], d["r"], d["k"], prec.act
    if tiled(opts.mlp_chunk_tokens, layout, opts, seq_len):
        return [("MLP tiles' input (the residual after attention)", h / r, a)]
    gathered = " (all-gathered over tp)" if opts.tp_sequence_parallel and layout.tp > 1 else ""
    terms = norm_terms("MLP norm", h, r, a, k, m.norm)
    terms.append(("gate-up input (norm output" + gathered + ")", h, a))
    if m.mlp == "swiglu":
        terms.append(("gate-up output (2 x ffn/tp)", 2 * d["f"], a))
        if k.swiglu_silu:
            terms.append(("silu(gate)", d["f"], a))
    else:
        terms += [("up output", d["f"], a)]
    terms.append(("down input (ffn/tp)", d["f"], a))
    return terms


def attention_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, seq_len: int = 0,
                    chunks: int = 1) -> PerToken:
    """What the attention between the QKV projection and o_proj keeps (RoPE's casts, q, k, v, the output, the
    log-sum-exp, o_proj's input), for all heads or for one of `chunks` head chunks."""
    d, k, a = dims(m, layout, opts, chunks), KERNELS[opts.kernels], prec.act
    terms = []
    if opts.fsdp and a != 4:    # FSDP2 casts a block's floating inputs, cos and sin, to the compute dtype (RoPE's
        terms.append(("cos, sin cast to the compute dtype (FSDP2's cast of the block's inputs)",   # own casts of
                      2 * m.head_size, a))                                                          # them: none)
    elif k.rope_casts and a != 4:
        terms.append((f"cos, sin cast to the compute dtype ({k.rope_casts} copies)", k.rope_casts * m.head_size, a))
    if m.qk_layernorm:
        terms += head_norm_terms(d, k, a)
    return terms + _attention_terms(d, opts, a, seq_len)


def head_norm_terms(d: dict, k: Kernels, a: int) -> PerToken:
    """What the q and k head norms (model.qk_layernorm) keep: their input, which with the tiled torch norms is a
    view of the QKV output (so all of it stays), with fused kernels a copy of q and k and their 1/rms."""
    if k.norm_tiled:
        return [("the QKV output before the q/k head norms (their input)", d["qkv"], a)]
    k_width = (d["qkv"] - d["q"]) / 2
    return [("q, k before their head norms", d["q"] + k_width, a), ("q, k head norms' 1/rms", d["hq"] + d["hk"], 4)]


def kept_attention_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision) -> PerToken:
    """What checkpointing keeps per layer besides the block input with training.recompute_attention=false:
    SDPA's output and log-sum-exp (model/recompute.py; not combined with activation offload)."""
    if not (opts.checkpointing and opts.keep_attention):
        return []
    d = dims(m, layout, opts)
    return [("attention output (kept for the backward)", d["q"], prec.act), ("log-sum-exp (kept)", d["hq"], 4)]


def _attention_terms(d: dict, opts: Options, a: int, seq_len: int) -> PerToken:
    q, kv, P = d["q"], d["kv"], d["P"]
    if d["ring"] > 1:      # parallel/ring.py keeps q, its own stack of k and v, the output and the LSE
        if P > 1:
            terms = [("q, k, v (the all-to-all buffer q is a view of)", q + 2 * kv, a)]
        else:
            terms = [("q (rotated)", q, a)]
        terms += [("k, v stacked (the ring's travelling block)", 2 * kv, a), ("attention output", q, a),
                  ("log-sum-exp", d["hq"], 4)]
        if P > 1:
            terms.append(("o_proj input (inverse all-to-all)", q, a))
        return terms
    if opts.attention == "reference":       # fp32 q and k, v repeated to the query heads; S x S probabilities
        return [("q, k, v in fp32 (k, v repeated to the query heads)", 3 * q, 4),
                ("attention probabilities (S x S)", d["hq"] * seq_len, 4), ("causal mask (S x S)", seq_len * P, 1),
                ("o_proj input (a copy of the transposed output)", q, a)]
    if P > 1:
        terms = [("q, k, v (the all-to-all buffer)", q + 2 * kv, a)]
    elif d["expand"]:
        terms = [("q (rotated)", q, a)]
    elif d["k"].fresh_qkv:
        terms = [("q, k (rotated), v", q + 2 * kv, a)]
    else:
        terms = [("q, k (rotated)", q + kv, a), ("the QKV output (v is a view of it)", d["qkv"], a)]
    if d["expand"]:
        terms.append(("k, v repeated to the query heads", 2 * q, a))
    terms += [("attention output", q, a), ("log-sum-exp", d["hq"], 4)]
    if P > 1:
        terms.append(("o_proj input (inverse all-to-all)", q, a))
    return terms


SP_BUFFERS = ("all-to-all buffer", "(inverse all-to-all)", "the ring's travelling block")


def sp_buffer_bytes_per_token(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision) -> float:
    """Bytes per S/sp token per layer that a layer keeps only because of sequence parallelism: the Ulysses
    all-to-all buffers (q, k, v going, o coming back) and the ring's copy of k and v. What a rank keeps
    beyond 1/sp of one process's activations is at most these (tests/test_memory_model.py)."""
    terms = layer_terms(m, layout, opts, prec)
    return bytes_per_token([t for t in terms if any(b in t[0] for b in SP_BUFFERS)])


def cos_sin_kept(opts: Options, prec: Precision) -> bool:
    """Whether the stage's fp32 rotary cos, sin stay for the backward: checkpoint inputs (of blocks or head
    chunks), the fused RoPE's saved tensors, or (fp32) the torch reference's."""
    return (opts.checkpointing or opts.head_chunks > 1 or KERNELS[opts.kernels].rope_saves_cos_sin
            or prec.act == 4)


def stage_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, first: bool, last: bool) -> PerToken:
    """Per micro-batch terms of a pipeline stage outside its layers (per S/sp token)."""
    d = dims(m, layout, opts)
    h, r, a = d["h"], d["r"], prec.act
    terms = [("rotary cos, sin (fp32)", 2 * m.head_size, 4)] if cos_sin_kept(opts, prec) else []
    if first and layout.tp > 1:     # (with tp=1 the embedding keeps the batch's own token ids)
        terms += [("local token ids (embedding)", 1, 8), ("vocabulary mask", 1, 1)]
    if last:
        terms += norm_terms("final norm", h, r, a, d["k"], m.norm)
        terms.append(("head-input gradient (computed in the forward)", h, a))
    return terms


def head_weight_grad_bytes(m: ModelConfig, layout: Degrees, prec: Precision) -> float:
    """The LM head weight's gradient the loss computes in the forward and keeps until the backward."""
    return m.padded_vocab_size(layout.tp) / layout.tp * m.hidden_size * prec.weight


def kept_layers(layers: int, opts: Options) -> int:
    """Of `layers` blocks, how many keep their input: every k-th under checkpointing with a stride."""
    k = opts.checkpoint_stride if opts.checkpointing else 1
    return -(-layers // k)


def bytes_per_token(terms: PerToken) -> float:
    return sum(n * b for _, n, b in terms)


def stage_layers(m: ModelConfig, layout: Degrees) -> int:
    return m.num_layers // layout.pp


@dataclass(frozen=True)
class StagePart:
    """Which part of the model a rank's stage holds (`layers`: default the layout's share), and the sequences of
    a micro-batch."""

    micro_batch_size: int = 1
    first: bool = True
    last: bool = True
    layers: Optional[int] = None


def retained_activation_bytes(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, seq_len: int,
                              part: StagePart = StagePart()) -> float:
    """Bytes one micro-batch's forward leaves for its backward on one rank of a stage (what the CPU test
    measures): layers x the per-layer terms + the stage's own terms (+ the head weight's gradient)."""
    micro_batch_size, first, last, layers = part.micro_batch_size, part.first, part.last, part.layers
    n = stage_layers(m, layout) if layers is None else layers
    tokens = micro_batch_size * seq_len / layout.sp
    per_layer = bytes_per_token(layer_terms(m, layout, opts, prec, seq_len))
    stage = tokens * bytes_per_token(stage_terms(m, layout, opts, prec, first, last))
    if opts.offload and opts.checkpointing:
        # the block inputs are in host memory, except a received pipeline input (the schedule holds it)
        per_layer, n = (per_layer, 1) if not first else (0.0, 0)
    head = head_weight_grad_bytes(m, layout, prec) if last else 0.0
    return tokens * kept_layers(n, opts) * per_layer + stage + head
