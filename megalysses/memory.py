"""The memory model: predicted peak bytes per rank for a model, a layout and its memory options.

    est = estimate_config(cfg, world_size=8)                  # a Config (+ world size) -> Estimate
    est.peak_gib, est.phase, est.terms                        # the peak and its breakdown, term by term
    per_token = layer_terms(cfg.model, Layout(sp=8), Options(activation_checkpointing=True), PRECISIONS["bf16"])

Everything is counted per rank. Activations are counted per token of the rank's sequence shard inside
the tensor-parallel region (S/sp tokens; the residual stream holds S/(sp*tp) of them under TP sequence
sharding), per layer, as named terms (elements per token, bytes per element). Two tables say what the
code keeps, and are the places to update when it changes:
    PRECISIONS  the compute dtype: the model's weights and activations (bf16 on GPUs, fp32 on CPU); the
                optimizer alone holds fp32 masters and moments; gradients accumulate in the compute dtype
                with one micro-batch per step and in fp32 (ZeRO-1's main_grad) with more
    KERNELS     what model.kernels keeps: the torch references (RMSNorm keeps an fp32 copy of its input
                and the normalised x; RoPE keeps cos/sin cast to the compute dtype; SwiGLU keeps the
                gate-up output and silu(gate)) or the fused kernels (input + 1/rms; the gate-up output)

What a layer keeps for the backward (megalysses/model/layers.py, no checkpointing):
    each norm         its input and 1/rms (the torch reference: an fp32 copy of the input and the
                      normalised x in the compute dtype)
    QKV, gate-up      the norm output (under TP sequence sharding the all-gathered copy)
    RoPE              the torch reference in bf16: cos and sin cast to bf16 for q and for k
    core attention    q, k, v (with Ulysses the all-to-all buffer they are views of; k and v repeated to
                      the query heads when the kernel has no native grouped-query attention; without either,
                      v is a view that keeps the whole QKV output), the output and the fp32 log-sum-exp;
                      the reference backend keeps fp32 S x S probabilities and an S x S mask instead
    ring attention    (sp = ulysses x ring, Layout.ring > 1) q (or the all-to-all buffer), its own stack of
                      k and v, the output and the log-sum-exp; its backward adds fp32 dQ and dK/dV buffers
                      travelling the ring. The reference backend on a ring is refused (not modelled)
    o_proj            its input (the inverse all-to-all's output when sp>1, else the attention output)
    SwiGLU MLP        gate-up output (2 x ffn/tp), silu(gate) (torch), the down projection's input
With training.mlp_chunk_tokens the MLP keeps only its norm output (tiles are recomputed); with activation
checkpointing a layer keeps only its input, and with activation offload not even that: the inputs go to
host memory and a window of `offload_prefetch` layers comes back ahead of the backward. Per stage: rotary
cos/sin (fp32, when something saves them), tp-local token ids; on the last, the final norm and the LM head +
loss, which computes its gradients in the forward and keeps them: the head input's (tokens x h) and the
head weight's (V/tp x h).

The peak is the largest of four phases, each on top of the weights, the gradients that exist by then,
the optimizer state and the activations of the micro-batches in flight (1F1B: pp - stage; interleaved:
Megatron's warm-up count + 1 model chunks):
    loss        the LM head + loss forward: its input, one tile of fp32 logits, the head gradients
    final norm  the backward's first step on the last stage, under every layer's activations
    backward    one layer's backward (the first one, with every layer's activations, or the last one,
                with every layer's gradients): its recomputed activations under checkpointing, the
                residual-stream gradients, then the largest of the attention kernel's buffers (or ring
                attention's), the QKV gradient assembly, the all-to-all's, the MLP's
    optimizer   the AdamW step: reduced fp32 gradient shards and the sqrt of v (activations are gone)
Optimizer offload (ZeRO-1) keeps masters, moments and the reduced gradients in host memory and updates
there. Parameter offload (FSDP) is modelled for other systems' published points (tests/test_plan.py).

Checked on CPU against the bytes a forward retains and the peak a training step reaches
(tests/test_memory_model.py, within 10%); benchmarks/bench_memory.py compares the peak with
torch.cuda.max_memory_allocated on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from megalysses.config import Config, ModelConfig
from megalysses.config_checks import ulysses_ring
from megalysses.parallel.sequence_layout import SequenceLayout

GIB = 1024 ** 3


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the compute dtype (weights and activations) and of the optimizer state."""

    name: str
    weight: int        # the model's parameters: the compute dtype (no autocast anywhere)
    act: int           # activations, in the compute dtype
    master: int = 4    # the optimizer's fp32 master copy (ZeRO-1: sharded over dp x sp; FSDP: the sharded parameter)
    moments: int = 8   # AdamW exp_avg + exp_avg_sq, fp32

    def grad(self, micro_batches: int) -> int:
        """Bytes per parameter of a step's accumulated gradient: the compute dtype's .grad with one
        micro-batch; fp32 with more (ZeRO-1's main_grad; fp32 weights accumulate in .grad)."""
        return self.weight if micro_batches == 1 else 4


PRECISIONS: dict[str, Precision] = {"fp32": Precision("fp32", weight=4, act=4),
                                    "bf16": Precision("bf16", weight=2, act=2)}


@dataclass(frozen=True)
class Kernels:
    """What model.kernels keeps for the backward (kernels/norms.py, rope.py, swiglu.py, external.py)."""

    name: str
    norm_fp32_input: bool      # RMSNorm keeps an fp32 copy of its input (in fp32: the input itself) and the
                               # normalised x in the compute dtype; else its input as it is and 1/rms
    rope_casts: int            # cos/sin copies in the compute dtype kept per layer (bf16 only)
    rope_saves_cos_sin: bool   # the kernel keeps the stage's fp32 cos, sin themselves
    fresh_qkv: bool            # q, k, v come out as new tensors (else v is a view of the QKV output)
    swiglu_silu: bool          # SwiGLU keeps silu(gate) besides the gate-up output
    qkv_grad_buffers: int      # full-width QKV gradients alive while they are assembled in the backward


# torch and triton are measured (tests/test_memory_model.py; triton through its CPU interpreter); liger
# and apex are read off their sources: liger's RMSNorm and add+RMSNorm keep the input and 1/rms, its
# RoPE one bf16 cos and sin, its SwiGLU contiguous gate and up halves (the same 2 x ffn); apex's RMSNorm
# keeps input and 1/rms, with our Triton kernels for the rest.
KERNELS: dict[str, Kernels] = {
    "torch": Kernels("torch", norm_fp32_input=True, rope_casts=4, rope_saves_cos_sin=False, fresh_qkv=False,
                     swiglu_silu=True, qkv_grad_buffers=2),
    "triton": Kernels("triton", norm_fp32_input=False, rope_casts=0, rope_saves_cos_sin=True, fresh_qkv=True,
                      swiglu_silu=False, qkv_grad_buffers=1),
    "liger": Kernels("liger", norm_fp32_input=False, rope_casts=2, rope_saves_cos_sin=False, fresh_qkv=False,
                     swiglu_silu=False, qkv_grad_buffers=2),
    "apex": Kernels("apex", norm_fp32_input=False, rope_casts=0, rope_saves_cos_sin=True, fresh_qkv=True,
                    swiglu_silu=False, qkv_grad_buffers=1),
}


@dataclass(frozen=True)
class Layout:
    """The process grid: sp = ulysses x ring (parallel.sp, parallel.sp_ring as config_checks.check_heads resolves
    them)."""

    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1
    ring: int = 1

    def __post_init__(self) -> None:
        if self.ring < 1 or self.sp % self.ring:
            raise ValueError(f"memory model: the ring degree {self.ring} must divide sp={self.sp} "
                             f"(sp = ulysses x ring)")

    @property
    def ulysses(self) -> int:
        return self.sp // self.ring

    @property
    def world(self) -> int:
        return self.tp * self.sp * self.pp * self.dp


@dataclass(frozen=True)
class Options:
    """Memory options: the training.* and parallel.* switches, the kernels, and parameter offload (FSDP,
    other systems' only)."""

    activation_checkpointing: bool = False
    activation_offload: bool = False
    mlp_chunk_tokens: int = 0
    loss_chunk_tokens: int = 0         # LM head + loss tile (0: automatic, <= 512 MiB of fp32 logits)
    tp_sequence_parallel: bool = False
    fsdp: bool = False
    optimizer_offload: bool = False
    param_offload: bool = False
    kernels: str = "torch"             # model.kernels
    attention: str = "flash"           # the concrete backend: flash, sdpa, flex, reference
    native_gqa: bool = True            # the kernel reads grouped KV heads as they are (no repeat to Hq)
    dq_accumulator: bool = True        # the backward accumulates dq in fp32 (flash-attn, SDPA's CUDA kernels)
    documents: bool = False            # packed-document masks (sdpa then builds a dense S x S mask)
    offload_prefetch: int = 1          # offloaded layers copied back ahead of the one in backward
    bucket_bytes: float = 32_000_000 * 4       # one gradient bucket (ZeRO-1: parallel.grad_bucket_elements fp32)
    overlap_grad_reduce: bool = True   # ZeRO-1 reduces buckets during the backward (parallel.overlap_grad_reduce)


@dataclass(frozen=True)
class Workload:
    seq_len: int
    micro_batch_size: int = 1
    micro_batches: int = 1             # per optimizer step per dp rank


@dataclass(frozen=True)
class Term:
    """One named contribution: `bytes` on the device (or the host), and how it was computed."""

    name: str
    bytes: float
    formula: str = ""
    host: bool = False


@dataclass
class Estimate:
    peak: float                        # bytes on the device at the peak (the largest stage)
    stage: int                         # the pipeline stage holding the peak
    phase: str                         # backward, loss or optimizer
    terms: list[Term]                  # the breakdown: device terms add up to `peak`; host terms follow
    host: float = 0.0                  # host bytes per rank (offloaded activations and optimizer state)
    layer_bytes_per_token: float = 0.0  # retained bytes per layer per token of S/sp
    layout: Layout = field(default_factory=Layout)
    options: Options = field(default_factory=Options)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB


# ----------------------------------------------------------------------------- activations

PerToken = list[tuple[str, float, int]]      # (name, elements per S/sp token, bytes per element)


def kv_replication(kv_heads: int, sp: int) -> int:
    """Ulysses repeats each tp-local KV head this many times when there are fewer than sp (parallel/ulysses.py)."""
    return 1 if kv_heads >= sp else sp // kv_heads


def _dims(m: ModelConfig, layout: Layout, opts: Options) -> dict[str, Any]:
    """Sizes per S/sp token on one rank. P: the Ulysses degree (all-to-alls, KV replication); ring: the
    ring degree (ring attention keeps its own copies and expands KV heads inside its kernels only)."""
    t, P, ring = layout.tp, layout.ulysses, layout.ring
    if ring > 1 and opts.attention == "reference":
        raise ValueError(f"memory model: ring attention (sp={layout.sp} = ulysses {P} x ring {ring}) with the "
                         f"reference backend keeps dense S/ring x S/ring masks and fp32 scores per block, which "
                         f"the model does not count; plan with sdpa, flash or flex")
    hq, hk = m.num_heads // t, m.kv_heads // t
    rep = kv_replication(hk, P)
    q, kv = hq * m.head_dim, hk * rep * m.head_dim           # per S/sp token on one tp rank
    expand = ring == 1 and (opts.attention == "reference" or not opts.native_gqa) and hq != hk * rep
    return {"h": m.hidden_size, "r": t if opts.tp_sequence_parallel else 1, "q": q, "kv": kv, "hq": hq,
            "qkv": q + 2 * hk * m.head_dim, "f": m.ffn_size / t, "expand": expand, "P": P, "ring": ring,
            "k": KERNELS[opts.kernels]}


def tiled(chunk: int, layout: Layout, opts: Options, seq_len: int) -> bool:
    """Whether MLP tiles split the local residual sequence (S/(sp*r) tokens): model/layers.py runs one
    tile of the whole sequence when they do not (seq_len 0: unknown, assume they do)."""
    r = layout.tp if opts.tp_sequence_parallel else 1
    return bool(chunk) and (not seq_len or chunk < seq_len // (layout.sp * r))


def _norm_terms(name: str, h: float, r: float, a: int, k: Kernels, kind: str) -> PerToken:
    if kind == "layernorm":
        return [(f"{name} input", h / r, a), (f"{name} mean, 1/std", 2 / r, 4)]
    if k.norm_fp32_input:
        return [(f"{name} input (fp32)", h / r, 4), (f"{name} 1/rms", 1 / r, 4), (f"{name} normalised x", h / r, a)]
    return [(f"{name} input", h / r, a), (f"{name} 1/rms", 1 / r, 4)]


def norm_keeps_block_input(m: ModelConfig, opts: Options, prec: Precision) -> bool:
    """The attention norm keeps the block input tensor itself (not an fp32 copy of it)."""
    return m.norm == "layernorm" or not KERNELS[opts.kernels].norm_fp32_input or prec.act == 4


def layer_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, seq_len: int = 0,
                checkpointed: Optional[bool] = None) -> PerToken:
    """(name, elements per S/sp token, bytes each) that one layer keeps for its backward. `seq_len` decides
    whether MLP tiles split the sequence, and sizes the reference backend's S x S probabilities."""
    d = _dims(m, layout, opts)
    h, r, k, a = d["h"], d["r"], d["k"], prec.act
    if opts.activation_checkpointing if checkpointed is None else checkpointed:
        return [("block input (checkpoint)", h / r, a)]
    gathered = " (all-gathered over tp)" if opts.tp_sequence_parallel and layout.tp > 1 else ""
    terms = _norm_terms("attention norm", h, r, a, k, m.norm)
    terms.append(("QKV input (norm output" + gathered + ")", h, a))
    if k.rope_casts and a != 4:
        terms.append((f"cos, sin cast to the compute dtype ({k.rope_casts} copies)", k.rope_casts * m.head_dim, a))
    terms += _attention_terms(d, opts, a, seq_len)
    terms += _norm_terms("MLP norm", h, r, a, k, m.norm)
    if tiled(opts.mlp_chunk_tokens, layout, opts, seq_len):
        terms.append(("MLP norm output (tile inputs)", h / r, a))
        return terms
    terms.append(("gate-up input (norm output" + gathered + ")", h, a))
    if m.mlp == "swiglu":
        terms.append(("gate-up output (2 x ffn/tp)", 2 * d["f"], a))
        if k.swiglu_silu:
            terms.append(("silu(gate)", d["f"], a))
    else:
        terms += [("up output", d["f"], a)]
    terms.append(("down input (ffn/tp)", d["f"], a))
    return terms


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


def sp_buffer_bytes_per_token(m: ModelConfig, layout: Layout, opts: Options, prec: Precision) -> float:
    """Bytes per S/sp token per layer that a layer keeps only because of sequence parallelism: the Ulysses
    all-to-all buffers (q, k, v going, o coming back) and the ring's copy of k and v. What a rank keeps
    beyond 1/sp of one process's activations is at most these (tests/test_memory_model.py)."""
    terms = layer_terms(m, layout, opts, prec)
    return bytes_per_token([t for t in terms if any(b in t[0] for b in SP_BUFFERS)])


def cos_sin_kept(opts: Options, prec: Precision) -> bool:
    """Whether the stage's fp32 rotary cos, sin stay for the backward: checkpoint inputs, the fused RoPE's
    saved tensors, or (fp32) the torch reference's."""
    return opts.activation_checkpointing or KERNELS[opts.kernels].rope_saves_cos_sin or prec.act == 4


def stage_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, first: bool, last: bool) -> PerToken:
    """Per micro-batch terms of a pipeline stage outside its layers (per S/sp token)."""
    d = _dims(m, layout, opts)
    h, r, a = d["h"], d["r"], prec.act
    terms = [("rotary cos, sin (fp32)", 2 * m.head_dim, 4)] if cos_sin_kept(opts, prec) else []
    if first and layout.tp > 1:     # (with tp=1 the embedding keeps the batch's own token ids)
        terms += [("local token ids (embedding)", 1, 8), ("vocabulary mask", 1, 1)]
    if last:
        terms += _norm_terms("final norm", h, r, a, d["k"], m.norm)
        terms.append(("head-input gradient (computed in the forward)", h, a))
    return terms


def head_weight_grad_bytes(m: ModelConfig, layout: Layout, prec: Precision) -> float:
    """The LM head weight's gradient the loss computes in the forward and keeps until the backward."""
    return m.padded_vocab_size(layout.tp) / layout.tp * m.hidden_size * prec.weight


def bytes_per_token(terms: PerToken) -> float:
    return sum(n * b for _, n, b in terms)


def stage_layers(m: ModelConfig, layout: Layout) -> int:
    return m.num_layers // layout.pp


def retained_activation_bytes(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, seq_len: int,
                              micro_batch_size: int = 1, first: bool = True, last: bool = True,
                              layers: Optional[int] = None) -> float:
    """Bytes one micro-batch's forward leaves for its backward on one rank of a stage (what the CPU test
    measures): layers x the per-layer terms + the stage's own terms (+ the head weight's gradient)."""
    n = stage_layers(m, layout) if layers is None else layers
    tokens = micro_batch_size * seq_len / layout.sp
    per_layer = bytes_per_token(layer_terms(m, layout, opts, prec, seq_len))
    stage = tokens * bytes_per_token(stage_terms(m, layout, opts, prec, first, last))
    if opts.activation_offload and opts.activation_checkpointing:
        # the block inputs are in host memory, except a received pipeline input (the schedule holds it)
        per_layer, n = (per_layer, 1) if not first else (0.0, 0)
    return tokens * n * per_layer + stage + (head_weight_grad_bytes(m, layout, prec) if last else 0.0)


# ----------------------------------------------------------------------------- parameters and pipeline

def layer_params(m: ModelConfig, tp: int = 1) -> float:
    """Parameters of one block on one tp rank (biases included)."""
    h, D = m.hidden_size, m.head_dim
    attn = h * D * (2 * m.num_heads + 2 * m.kv_heads) / tp
    if m.attention_bias:
        attn += (m.num_heads + 2 * m.kv_heads) * D / tp + h
    n_mlp = 3 if m.mlp == "swiglu" else 2
    mlp = n_mlp * h * m.ffn_size / tp + ((n_mlp - 1) * m.ffn_size / tp + h if m.mlp_bias else 0)
    return attn + mlp + 2 * h * (2 if m.norm == "layernorm" else 1)


def stage_params(m: ModelConfig, layout: Layout, first: bool, last: bool) -> tuple[float, float]:
    """(block parameters, the rest: embedding, final norm, LM head over the padded vocabulary) on one rank."""
    emb = m.padded_vocab_size(layout.tp) * m.hidden_size / layout.tp
    norm = m.hidden_size * (2 if m.norm == "layernorm" else 1)
    other = (emb if first else 0.0) + (norm + emb if last else 0.0)
    if first and last and m.tie_embeddings:
        other -= emb
    return stage_layers(m, layout) * layer_params(m, layout.tp), other


def in_flight(layout: Layout, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once, in units of its whole stage
    (interleaved: model chunks in flight / chunks per rank)."""
    P, v, M = layout.pp, layout.virtual_stages, micro_batches
    if P == 1:
        return 1.0
    if v == 1:
        return float(min(P - stage, M))
    warmup = min((P - stage - 1) * 2 + (v - 1) * P, M * v)     # parallel/interleaved.py rank_order
    return min(warmup + 1, M * v) / v


# ----------------------------------------------------------------------------- fixed bytes

def _reduced_bytes(prec: Precision, opts: Options, G: int, M: int) -> float:
    """Bytes per parameter of ZeRO-1's reduced fp32 gradient chunks on the device: the reduce-scatter's
    output (4/G), or with a group of one the fp32 copies of low-precision gradients the masters take
    (offload copies the gradients to host memory as they are)."""
    if G > 1:
        return 4 / G
    return 4 if prec.grad(M) != 4 and not opts.optimizer_offload else 0


def _state_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, first: bool, last: bool,
                 M: int) -> tuple[list[Term], list[Term]]:
    """(weights and optimizer state: always there; gradients: once a step's first backward has run,
    with ZeRO-1's reduced chunks of the buckets already reduced)."""
    blocks, other = stage_params(m, layout, first, last)
    n, G = blocks + other, layout.dp * layout.sp
    if not opts.fsdp:
        g = prec.grad(M)
        states = prec.master + prec.moments
        fixed = [Term("weights", n * prec.weight, f"{n:.4g} params x {prec.weight} B"),
                 Term("master + moments (ZeRO-1)", n * states / G, f"{n:.4g} params x {states} B / {G}",
                      host=opts.optimizer_offload)]
        grads = [Term("gradients" + (" (fp32 main_grad)" if g == 4 and prec.weight != 4 else ""), n * g,
                      f"{n:.4g} params x {g} B")]
        reduced = _reduced_bytes(prec, opts, G, M)
        if reduced and opts.overlap_grad_reduce:
            grads.append(Term("gradients: reduced fp32 chunks", n * reduced, f"{n:.4g} params x {reduced:.3g} B"))
        if G > 1:   # the fp32 gradients of one bucket and the buffer its reduce-scatter sends
            bucket = min(opts.bucket_bytes, n * 4) * (1 if prec.weight == 4 else 2)
            grads.append(Term("gradient bucket being reduced", bucket, f"{bucket / 4:.4g} x 4 B"))
        return fixed, grads
    block, a = layer_params(m, layout.tp), prec.act
    gathered = [Term("gathered blocks (in flight + prefetched)", 2 * block * a, f"2 x {block:.4g} x {a} B")]
    if other:
        gathered.append(Term("gathered embedding / head (kept through the step)", other * a, f"{other:.4g} x {a} B"))
    unsharded = [Term("unsharded gradient of one block (and its fp32 copy)", block * (a + 4),
                      f"{block:.4g} x ({a} + 4) B")]
    if opts.param_offload or opts.optimizer_offload:
        shard = prec.master + prec.moments + 4
        fixed = [Term("master, moments, gradients (FSDP shards)", n * shard / G, f"{n:.4g} x {shard} B / {G}",
                      host=True)]
        if not opts.param_offload:
            fixed.append(Term("compute-dtype parameter + gradient shards", n * 2 * a / G, f"{n:.4g} x 2 x {a} B / {G}"))
        return fixed + gathered, unsharded
    fixed = [Term("sharded parameters (fp32 master)", n * prec.master / G, f"{n:.4g} x {prec.master} B / {G}"),
             Term("sharded moments", n * prec.moments / G, f"{n:.4g} x {prec.moments} B / {G}")]
    grads = [Term("sharded gradients (fp32)", n * 4 / G, f"{n:.4g} x 4 B / {G}")]
    return fixed + gathered, grads + unsharded


def _optimizer_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, n: float, M: int) -> list[Term]:
    """The AdamW step's own bytes, on top of weights, gradients and state (host ones with offload)."""
    G = layout.dp * layout.sp
    terms = []
    if not opts.fsdp:
        if opts.optimizer_offload:
            terms.append(Term("reduced fp32 gradients", n * 4 / G, f"{n:.4g} x 4 B / {G}", host=True))
        elif not opts.overlap_grad_reduce and _reduced_bytes(prec, opts, G, M):
            reduced = _reduced_bytes(prec, opts, G, M)
            terms.append(Term("gradients: reduced fp32 chunks", n * reduced, f"{n:.4g} params x {reduced:.3g} B"))
    offloaded = opts.optimizer_offload or opts.param_offload
    terms.append(Term("AdamW sqrt(v)", n * 4 / G, f"{n:.4g} x 4 B / {G}", host=offloaded))
    return terms


# ----------------------------------------------------------------------------- transients

def _backward_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, tokens: float,
                    seq_len: int) -> list[Term]:
    """One layer's backward on one rank, on top of what the other layers keep: its own activations
    (retained or recomputed) and the gradients being computed, at the worst of four moments as the
    backward walks the layer from its end (each moment's activations are those not yet freed):
        MLP        every activation of the layer; the down input's gradient and its factors'
        MLP norm   the attention half's activations and the norm's; its backward's temporaries
        attention  the attention half's activations; dout, dq, dk, dv (and flash's fp32 dq accumulator)
        QKV        the norm's and the QKV input; the QKV output's gradient being assembled (and, with
                   sp>1, the all-to-all's gradient buffers)
    plus the residual stream's gradient throughout (four moments, then)."""
    d = _dims(m, layout, opts)
    k, a = d["k"], prec.act
    q, kv, h, r, f = d["q"], d["kv"], d["h"], d["r"], d["f"]
    full = layer_terms(m, layout, opts, prec, seq_len, checkpointed=False)
    cut = next(i for i, t in enumerate(full) if t[0].startswith("MLP norm"))
    attn_half = bytes_per_token(full[:cut])
    before_core = bytes_per_token([t for t in full[:cut]
                                   if t[0].startswith(("attention norm", "QKV input", "cos, sin"))])
    # flash-attn's backward writes dk, dv at the query-head count when a rank has fewer KV heads (GQA)
    kv_grads = q if d["expand"] or (opts.attention == "flash" and q != kv) else kv
    accumulator = 4 * q if opts.dq_accumulator else 0
    if tiled(opts.mlp_chunk_tokens, layout, opts, seq_len):
        tile = opts.mlp_chunk_tokens * r / tokens      # a tile's share of the tokens
        mlp = (tile * ((4 if k.swiglu_silu else 3) + 2) * f + 2 * h / r) * a
        mlp_name = "MLP tile: its recomputation and gradients, the full-length gradient of the tile inputs"
    else:
        mlp, mlp_name = 2 * f * a, "MLP: the down input's gradient and its factors'"
    core = (2 * q + 2 * kv_grads) * a + accumulator
    core_name = "attention: dout, dq, dk, dv" + (", fp32 dq accumulator" if accumulator else "")
    if d["ring"] > 1:
        core, core_name = _ring_backward(q, kv, a, d["ring"], opts, accumulator)
    mlp_norm = bytes_per_token([t for t in full
                                if t[0].startswith("MLP norm") and "input" in t[0] or t[0] == "MLP norm 1/rms"])
    norm_temps = norm_backward_bytes(m, opts, prec) * h / r
    assembly = (k.qkv_grad_buffers * d["qkv"] + (3 * (q + 2 * kv) if d["P"] > 1 else 0)) * a
    moments = {mlp_name: (bytes_per_token(full), mlp),
               core_name: (attn_half, core),
               "MLP norm: its backward's temporaries": (attn_half + mlp_norm, norm_temps),
               "QKV: the output's gradient" + (", the all-to-all's buffers" if d["P"] > 1 else ""):
                   (before_core, assembly)}
    name, (alive, grads) = max(moments.items(), key=lambda kv_: sum(kv_[1]))
    offloaded = opts.activation_offload and opts.activation_checkpointing
    if opts.activation_checkpointing and not offloaded and norm_keeps_block_input(m, opts, prec):
        alive -= h / r * a                 # the norm's input is the retained block input itself
    what = "recomputed" if opts.activation_checkpointing else "own"
    terms = [] if not opts.activation_checkpointing else [
        Term(f"the layer's {what} activations (at its worst moment)", tokens * alive,
             f"{tokens:.4g} tok x {alive:.4g} B")]
    if not opts.activation_checkpointing:      # retained already: what is freed by that moment comes off
        terms.append(Term("the layer's activations freed by then", -tokens * (bytes_per_token(full) - alive),
                          f"-{tokens:.4g} tok x {bytes_per_token(full) - alive:.4g} B"))
    each = ", ".join(f"{n.split(':')[0]} {(al + g) * tokens / GIB:.3g} GiB" for n, (al, g) in moments.items())
    terms.append(Term(f"backward of one layer, {name}", tokens * grads, f"{tokens:.4g} tok x {grads:.4g} B; {each}"))
    terms.append(Term("residual-stream gradient", tokens * h / r * a, f"{tokens:.4g} tok x {h / r:.4g} x {a} B"))
    return terms


def norm_backward_bytes(m: ModelConfig, opts: Options, prec: Precision) -> float:
    """Bytes per hidden element of a norm's backward temporaries: the torch RMSNorm's runs in fp32 (the
    mean's gradient, pow, two products: four at once; in bf16 a fifth, the gradient's fp32 copy); a fused
    kernel writes dx in one pass."""
    a = prec.act
    return (4 + (a != 4)) * 4 if KERNELS[opts.kernels].norm_fp32_input and m.norm == "rmsnorm" else a


def _ring_backward(q: float, kv: float, a: int, ring: int, opts: Options, accumulator: float) -> tuple[float, str]:
    """Bytes per S/sp token of ring attention's backward (parallel/ring.py) at its worst moment, beyond the
    layer's activations: the fp32 dQ, dout, the K/V block in hand (under checkpointing it takes the place
    of the saved one, which the recomputation hands over once) and D, this step's fp32 dK/dV (`kv`
    elements per token each), then the largest of
        kernel  a block's backward: D of the step before on its way out, the next D (and, with r > 2, the
                next K/V block) arriving, and dq, dk, dv (sdpa expands K/V to the query heads and writes
                their gradients at that width; flex re-runs the block in fp32 around it)
        merge   the arrived D, this block's and their sum, the one sent before still in its exchange
        end     the sum that came home, the exchange's buffers (five D in all) and the gradients' copies in
                the compute dtype."""
    base = 4 * q + q * a + (0 if opts.activation_checkpointing else 2 * kv * a)
    if opts.attention == "flex":
        grads = 8 * q + 2 * q * a + (q + 2 * kv) * a
    elif not opts.native_gqa and q != kv:
        grads = 2 * q * a + 3 * q * a + accumulator
    else:
        grads = (q + 2 * kv) * a + accumulator
    next_kv = 2 * kv * a if ring > 2 else 0
    moments = {"kernel": 2 * 8 * kv + next_kv + grads, "merge": next_kv + 4 * 8 * kv,
               "end": 5 * 8 * kv + (q + 2 * kv) * a}
    worst = max(moments, key=moments.get)
    return base + moments[worst], f"ring attention's backward ({worst}): fp32 dq and dK/dV, dout, K/V blocks"


def loss_tile_tokens(m: ModelConfig, layout: Layout, opts: Options, tokens: float) -> float:
    """Tokens per LM head + loss tile (kernels/linear_cross_entropy.py default_chunk_tokens)."""
    vocab = m.padded_vocab_size(layout.tp) / layout.tp
    chunk = opts.loss_chunk_tokens or max(128, (1 << 29) // (8 * vocab))
    return min(chunk, tokens)


def _loss_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, tokens: float) -> list[Term]:
    """The LM head + loss forward, beyond what it keeps (stage_terms): its input, one tile's fp32 logits
    (and their compute-dtype copy), and the head weight's gradient being accumulated."""
    a, h = prec.act, m.hidden_size
    V = m.padded_vocab_size(layout.tp) / layout.tp
    tile = loss_tile_tokens(m, layout, opts, tokens)
    per_logit = 4 + (a if a != 4 else 0)
    terms = [Term("LM head input (final norm output)", tokens * h * a, f"{tokens:.4g} tok x {h} x {a} B"),
             Term("one tile of logits (fp32 and the gradient's copy)", tile * V * per_logit,
                  f"{tile:.4g} tok x {V:.4g} x {per_logit} B")]
    if tile < tokens:
        acc = 4 + a + (4 if a != 4 else 0)
        terms.append(Term("head weight gradient: fp32 sum, a tile's and its fp32 copy", V * h * acc,
                          f"{V:.4g} x {h} x {acc} B"))
    return terms


# ----------------------------------------------------------------------------- the estimate

def estimate(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, work: Workload) -> Estimate:
    """The peak over the pipeline stages (the first holds the most micro-batches, the last the loss)."""
    return max((_stage_estimate(m, layout, opts, prec, work, s) for s in sorted({0, layout.pp - 1})),
               key=lambda e: e.peak)


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
            count = behind * n_layers + current_layers
            terms = [Term("layer activations", count * tokens * layer_tok,
                          f"({behind:g} mb x {n_layers} + {current_layers}) layers x {tokens:.4g} tok x "
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
        if opts.documents and opts.attention == "sdpa" and layout.ring > 1:
            # each block's allowed pairs (bool) and additive mask (compute dtype): the rank's own block
            # whole, the r-1 others half (kernels/block_attention.py AttentionBlock, on CPU)
            r, B = layout.ring, work.micro_batch_size
            masks = B * (S / r) ** 2 * (r + 1) / 2 * (1 + prec.act)
            terms.append(Term("dense document masks of the ring's blocks (sdpa)", masks,
                              f"B x (S/r)^2 x (r+1)/2 x (1 + {prec.act}) B, r = {r}"))
        elif opts.documents and opts.attention == "sdpa":
            terms.append(Term("dense document mask (sdpa)", work.micro_batch_size * S ** 2,
                              f"B x S^2 = {work.micro_batch_size} x {S}^2 B"))
        return terms

    fixed, grads = _state_terms(m, layout, opts, prec, first, last, M)
    # the step's micro-batches, loaded at its start: token ids, labels, positions (and document ids)
    batch = M * tokens * (3 * 8 + (8 * layout.sp if opts.documents else 0))
    fixed.append(Term("the step's batch (ids, labels, positions)", batch, f"{M} mb x {tokens:.4g} tok x 24 B"))
    blocks, other = stage_params(m, layout, first, last)
    n = blocks + other
    layer_bwd = _backward_terms(m, layout, opts, prec, tokens, S)
    # the input embedding's gradient comes last (the LM head's, when tied, is the same tensor)
    embedding = m.padded_vocab_size(layout.tp) * m.hidden_size / layout.tp if first and not (
        last and m.tie_embeddings) else 0.0
    if M == 1 and not opts.fsdp:    # one micro-batch: the gradients appear layer by layer in the backward
        def so_far(done: int, ready: Optional[float] = None) -> list[Term]:
            ready = other + done * blocks / max(n_layers, 1) if ready is None else ready
            # a bucket is reduced once all of its gradients are there (whole buckets only)
            bucket = max(opts.bucket_bytes / 4, 1)
            reduced = min(ready, ready // bucket * bucket)
            out = []
            for t in grads:
                share = (reduced if "reduced" in t.name else ready) / n
                if t.name.startswith("gradient bucket") and ready < bucket:
                    continue
                out.append(replace(t, name=f"{t.name} (the head's and {done} layers')", bytes=t.bytes * share,
                                   formula=f"{share:.3g} x {t.formula}") if t.name.startswith("gradients") else t)
            return out
        early, late, head_grads = so_far(0), so_far(n_layers - 1), so_far(0, other - embedding)
    else:                           # the reduced chunks appear during the last micro-batch's backward
        early, late = [t for t in grads if "reduced" not in t.name], grads
        head_grads = early
    # a stage's backward peaks at its first layer (every activation, few gradients) or its last (one
    # layer's activations, every gradient): the bytes are linear in between
    phases = {"backward": max(fixed + early + activations(flight - 1, n_layers) + layer_bwd,
                              fixed + late + activations(flight - 1, 1) + layer_bwd, key=_device),
              "optimizer": fixed + [t for t in grads if not t.name.startswith("gradient bucket")
                                    and not (opts.optimizer_offload and "reduced" in t.name)]
                           + _optimizer_terms(m, layout, opts, prec, n, M)}
    if last:
        head_tok = bytes_per_token(stage_terms(m, layout, opts, prec, False, True)) - \
            bytes_per_token(stage_terms(m, layout, opts, prec, False, False))
        head = [Term("final norm + head-input gradient", tokens * head_tok, f"{tokens:.4g} tok x {head_tok:.4g} B"),
                Term("head weight gradient (computed in the forward)", head_weight_grad_bytes(m, layout, prec),
                     f"{m.padded_vocab_size(layout.tp) / layout.tp:.4g} x {m.hidden_size} x {prec.weight} B")]
        before = [t for t in grads if "reduced" not in t.name] if M > 1 or opts.fsdp else []
        phases["loss"] = (fixed + before + activations(flight - 1, n_layers) + head
                          + _loss_terms(m, layout, opts, prec, tokens))
        # the backward's first step, the final norm's, under every layer's activations: what the norm keeps
        # but the normalised x (its product with the weight has run backward), the gradient coming in, and
        # the norm backward's temporaries
        d = _dims(m, layout, opts)
        norm_tok = bytes_per_token([t for t in _norm_terms("final norm", d["h"], d["r"], prec.act, d["k"], m.norm)
                                    if "normalised x" not in t[0]]) + d["h"] / d["r"] * prec.act
        temps = norm_backward_bytes(m, opts, prec) * d["h"] / d["r"]
        phases["final norm"] = (fixed + head_grads + activations(flight - 1, n_layers)
                                + [Term("final norm: its input, 1/rms and the gradient coming in", tokens * norm_tok,
                                        f"{tokens:.4g} tok x {norm_tok:.4g} B"),
                                   Term("final norm backward's temporaries", tokens * temps,
                                        f"{tokens:.4g} tok x {temps:.4g} B")])
    phase = max(phases, key=lambda p: _device(phases[p]))
    terms = [t for t in phases[phase] if not t.host and t.bytes]
    host = [t for t in fixed + _optimizer_terms(m, layout, opts, prec, n, M) if t.host]
    if offload:
        off = n_layers - (0 if first else 1)
        host.insert(0, Term("offloaded block inputs", flight * tokens * off * layer_tok,
                            f"{flight:g} mb x {off} layers x {tokens:.4g} tok x {layer_tok:.4g} B", host=True))
    return Estimate(peak=_device(terms), stage=stage, phase=phase, terms=terms + host,
                    host=sum(t.bytes for t in host), layer_bytes_per_token=layer_tok, layout=layout, options=opts)


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


# ----------------------------------------------------------------------------- from a Config

def precision_for(cfg: Config, device: str = "cuda") -> Precision:
    """The compute dtype of a run of `cfg` on `device`: training.dtype, auto = bf16 on CUDA, fp32 elsewhere."""
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return PRECISIONS["bf16" if dtype == "bfloat16" else "fp32"]


def attention_for(cfg: Config, device: str = "cuda", ring: int = 1) -> tuple[str, bool, bool]:
    """(concrete backend, native grouped-query attention, fp32 dq accumulator) that `cfg` runs on
    `device` with a ring of `ring` ranks (kernels/attention.py; auto assumes flash-attn is installed on
    GPUs). With a ring the blocks run on torch's SDPA flash kernel (K/V expanded to the query heads), or
    FlexAttention for documents on CUDA (kernels/block_attention.py)."""
    backend = cfg.model.attention_backend
    ring = ring > 1
    cuda = device == "cuda"
    if backend == "auto":
        if ring:
            backend = "flex" if cfg.data.document_mask and cuda else "sdpa"
        else:
            backend = ("flex" if cfg.data.document_mask else "flash") if cuda else "sdpa"
    if ring:
        return backend, backend == "flex", backend == "sdpa" and cuda
    bf16 = precision_for(cfg, device).act == 2
    cuda_sdpa = backend == "sdpa" and cuda
    native = backend in ("flash", "flex") or (cuda_sdpa and bf16 and not cfg.data.document_mask)
    return backend, native, backend == "flash" or cuda_sdpa


def layout_of(cfg: Config, world_size: int, ranks_per_node: Optional[int] = None) -> Layout:
    """The layout of a run of `cfg` on `world_size` ranks, sp split into ulysses x ring as the run splits
    it on nodes of `ranks_per_node` (config_checks.ulysses_ring; None: the launcher's, as a launched run sees it)."""
    p = cfg.parallel
    return Layout(tp=p.tp, sp=p.sp, pp=p.pp, dp=max(world_size // (p.tp * p.sp * p.pp), 1),
                  virtual_stages=p.virtual_stages, ring=ulysses_ring(cfg, ranks_per_node)[1])


def options_of(cfg: Config, device: str = "cuda", ring: int = 1) -> Options:
    t, p = cfg.training, cfg.parallel
    backend, native, accumulator = attention_for(cfg, device, ring)
    return Options(activation_checkpointing=t.activation_checkpointing, activation_offload=t.activation_offload,
                   mlp_chunk_tokens=t.mlp_chunk_tokens, loss_chunk_tokens=t.loss_chunk_tokens,
                   tp_sequence_parallel=p.tp_sequence_parallel, fsdp=p.fsdp,
                   optimizer_offload=t.optimizer_offload, kernels=cfg.model.kernels, attention=backend,
                   native_gqa=native, dq_accumulator=accumulator, documents=cfg.data.document_mask,
                   bucket_bytes=0 if p.fsdp else p.grad_bucket_elements * 4, overlap_grad_reduce=p.overlap_grad_reduce)


def workload_of(cfg: Config, layout: Layout) -> Workload:
    """The longest micro-batch of a run of `cfg` (data.seq_len, the last length of a curriculum), padded to
    the layout's multiple as the data loader pads it (parallel/sequence_layout.py)."""
    t = cfg.training
    shard = SequenceLayout(layout.sp, layout.ring, layout.tp if cfg.parallel.tp_sequence_parallel else 1)
    return Workload(seq_len=shard.padded_len(cfg.data.seq_len), micro_batch_size=t.micro_batch_size,
                    micro_batches=max(t.global_batch_size // (t.micro_batch_size * layout.dp), 1))


def estimate_config(cfg: Config, world_size: int, device: str = "cuda",
                    ranks_per_node: Optional[int] = None) -> Estimate:
    """The predicted peak per rank of a run of `cfg` on `world_size` ranks of `device` (cuda or cpu), on
    nodes of `ranks_per_node` (None: the launcher's)."""
    layout = layout_of(cfg, world_size, ranks_per_node)
    return estimate(cfg.model, layout, options_of(cfg, device, layout.ring), precision_for(cfg, device),
                    workload_of(cfg, layout))


def fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"
