"""The memory model: predicted peak bytes per rank for a model, a layout and its memory options.

    est = estimate_config(cfg, world_size=8)                  # a Config (+ world size) -> Estimate
    est.peak_gib, est.phase, est.terms                        # the peak and its breakdown, term by term
    per_token = layer_terms(cfg.model, Layout(sp=8), Options(activation_checkpointing=True))

Everything is counted per rank. Activations are counted per token of the rank's sequence shard inside
the tensor-parallel region (S/sp tokens; the residual stream holds S/(sp*tp) of them under TP sequence
sharding), per layer, as named terms (elements per token, element class). Two small tables say how many
bytes that is, and are the places to update when the code changes:
    PRECISIONS       bytes per parameter of each training state and per activation element of each class
    IMPLEMENTATIONS  what the kernels keep: "megalysses" is the code as it is; "fused" is fused
                     add+RMSNorm, fused q/k/v and gate/up projections and a fused linear + cross-entropy
                     (the GPU work in progress; also what HF + Liger kernels keep)

What a layer keeps for the backward (megalysses/model/layers.py, no checkpointing):
    each norm         its input (upcast to fp32 by the reference), the fp32 1/rms and the normalised x
    q/k/v, gate/up    their input, the norm output (under TP sequence sharding each separate projection
                      all-gathers and keeps its own full-sequence copy)
    core attention    q, k, v (with sp>1 the all-to-all buffer they are views of; k and v repeated to the
                      query heads when the kernel has no native grouped-query attention), the output and
                      the fp32 log-sum-exp; the reference backend keeps S x S probabilities instead
    o_proj            its input (the inverse all-to-all's output when sp>1, else the attention output)
    SwiGLU MLP        gate, up, silu(gate) and their product (4 x ffn/tp); GELU 2 x ffn/tp
With training.mlp_chunk_tokens the MLP keeps only its norm output (tiles are recomputed); with activation
checkpointing a layer keeps only its input. Per stage: rotary cos/sin (fp32), token ids, the final norm
and the loss (the fp32 softmax over V/tp; with loss tiles only the final norm output).

The peak is the largest of three phases, each on top of the fixed bytes (weights, gradients, optimizer
state, gradient buckets) and the activations of the micro-batches in flight (1F1B: pp - stage;
interleaved: Megatron's warm-up count + 1 model chunks):
    backward    one layer's backward: its recomputed activations under checkpointing, then the larger of
                the attention kernel's buffers (dout, dq/dk/dv, flash's fp32 dq accumulator) and the
                all-to-all's (sp>1), or the MLP's gradients; plus the residual-stream gradients
    loss        logits, their fp32 softmax and gradient over the local sequence or one tile
    optimizer   the AdamW step's temporaries (activations are gone by then)
Activation offload keeps the retained activations in host memory and a window of two layers on the
device. Optimizer offload keeps master weights and moments in host memory (with FSDP the device keeps
compute-dtype parameter and gradient shards); parameter offload (FSDP) keeps all sharded state there.

Checked on CPU against the bytes a forward actually retains (tests/test_memory_model.py, within 10% in
fp32); benchmarks/bench_memory.py compares the peak with torch.cuda.max_memory_allocated on a GPU.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megalysses.config import Config, ModelConfig

GIB = 1024 ** 3


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each training state and per activation element of each class."""

    name: str
    weight: int       # the model's own weights (the compute copy; ZeRO-1: the full tp shard)
    grad: int         # the gradient accumulation buffer (ZeRO-1: full tp shard; FSDP: the sharded gradient)
    master: int       # the optimizer's master copy, sharded over dp x sp (FSDP: the sharded parameter itself)
    moments: int      # AdamW exp_avg + exp_avg_sq, sharded over dp x sp
    act: int          # activations in the compute dtype (matmul inputs and outputs)
    residual: int     # the residual stream and the normalised x of each norm
    cast_cache: int   # per-step compute-dtype copies of the weights (torch.autocast's cache)


# fp32: CPU (ZeRO-1 keeps a master chunk even in fp32). bf16: weights in bf16, fp32 gradient
# accumulation, fp32 master + moments in the optimizer only. autocast: fp32 weights under
# torch.autocast(bf16), each weight cast in every forward.
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", weight=4, grad=4, master=4, moments=8, act=4, residual=4, cast_cache=0),
    "bf16": Precision("bf16", weight=2, grad=4, master=4, moments=8, act=2, residual=2, cast_cache=0),
    "autocast": Precision("autocast", weight=4, grad=4, master=4, moments=8, act=2, residual=4, cast_cache=2),
}


@dataclass(frozen=True)
class Implementation:
    """What the kernels keep and allocate."""

    name: str
    norm_input_fp32: bool      # the norm keeps an fp32 upcast of its input (the torch reference)
    norm_keeps_x_hat: bool     # the norm keeps the normalised x (a fused kernel recomputes it)
    qkv_projections: int       # separate column-parallel projections reading the attention norm output
    mlp_projections: int       # ... reading the MLP norm output (SwiGLU; GELU has one)
    packed_all_to_all: bool    # q, k, v travel in one all-to-all buffer (else one tensor at a time)
    fused_loss: bool           # linear + cross-entropy fused: a tile's logits and their gradient only


IMPLEMENTATIONS: dict[str, Implementation] = {
    "megalysses": Implementation("megalysses", norm_input_fp32=True, norm_keeps_x_hat=True, qkv_projections=3,
                                 mlp_projections=2, packed_all_to_all=True, fused_loss=False),
    "fused": Implementation("fused", norm_input_fp32=False, norm_keeps_x_hat=False, qkv_projections=1,
                            mlp_projections=1, packed_all_to_all=False, fused_loss=True),
}


def class_bytes(prec: Precision, impl: Implementation, cls: str) -> int:
    """Bytes of one element of an activation class: act, res, norm, f32, i64, bool."""
    norm = 4 if impl.norm_input_fp32 else prec.residual
    return {"act": prec.act, "res": prec.residual, "norm": norm, "f32": 4, "i64": 8, "bool": 1}[cls]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.sp * self.pp * self.dp


@dataclass(frozen=True)
class Options:
    """Memory options: the training.* and parallel.* switches, and what the model predicts ahead of its
    implementation (activation, optimizer and parameter offload)."""

    activation_checkpointing: bool = False
    activation_offload: bool = False
    mlp_chunk_tokens: int = 0
    loss_chunk_tokens: int = 0
    tp_sequence_parallel: bool = False
    fsdp: bool = False
    optimizer_offload: bool = False
    param_offload: bool = False
    attention: str = "flash"           # the concrete backend: flash, sdpa, flex, reference
    native_gqa: bool = True            # the kernel reads grouped KV heads as they are (no repeat to Hq)
    dq_accumulator: bool = True        # the backward accumulates dq in fp32 (flash-attn, SDPA's CUDA kernels)
    documents: bool = False            # packed-document masks (sdpa then builds a dense S x S mask)
    offload_prefetch: int = 1          # offloaded layers copied back ahead of the one in backward
    bucket_bytes: float = 2 * 32_000_000 * 4   # gradient buckets in flight (ZeRO-1: 2 x 32M fp32)
    implementation: str = "megalysses"


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
    host: float = 0.0                  # host bytes per rank (offloaded activations and states)
    layer_bytes_per_token: float = 0.0  # retained bytes per layer per token of S/sp
    layout: Layout = field(default_factory=Layout)
    options: Options = field(default_factory=Options)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB


# ----------------------------------------------------------------------------- activations

def kv_replication(kv_heads: int, sp: int) -> int:
    """Ulysses repeats each tp-local KV head this many times when there are fewer than sp (parallel/ulysses.py)."""
    return 1 if kv_heads >= sp else sp // kv_heads


def _dims(m: ModelConfig, layout: Layout, opts: Options) -> dict[str, Any]:
    t, P = layout.tp, layout.sp
    hq, hk = m.num_heads // t, m.kv_heads // t
    rep = kv_replication(hk, P)
    q, kv = hq * m.head_dim, hk * rep * m.head_dim           # per S/sp token on one tp rank
    expand = (opts.attention == "reference" or not opts.native_gqa) and hq != hk * rep
    return {"h": m.hidden_size, "r": t if opts.tp_sequence_parallel else 1, "q": q, "kv": kv, "hq": hq,
            "f": m.ffn_size / t, "V": m.vocab_size / t, "expand": expand, "P": P,
            "impl": IMPLEMENTATIONS[opts.implementation]}


def tiled(chunk: int, m: ModelConfig, layout: Layout, opts: Options, seq_len: int) -> bool:
    """Whether a tile size splits the local residual sequence (S/(sp*r) tokens): model/layers.py and
    model/gpt.py run one tile of the whole sequence when it does not (seq_len 0: unknown, assume it does)."""
    r = layout.tp if opts.tp_sequence_parallel else 1
    return bool(chunk) and (not seq_len or chunk < seq_len // (layout.sp * r))


def layer_terms(m: ModelConfig, layout: Layout, opts: Options, seq_len: int = 0,
                checkpointed: Optional[bool] = None) -> list[tuple[str, float, str]]:
    """(name, elements per S/sp token, class) that one layer keeps for its backward. `seq_len` decides
    whether MLP tiles split the sequence, and sizes the reference backend's S x S probabilities."""
    d = _dims(m, layout, opts)
    h, r, impl = d["h"], d["r"], d["impl"]
    if opts.activation_checkpointing if checkpointed is None else checkpointed:
        return [("block input (checkpoint)", h / r, "res")]
    gathered = opts.tp_sequence_parallel and layout.tp > 1
    qkv = impl.qkv_projections if gathered else 1
    terms = _norm_terms("attention norm", h, r, impl)
    terms.append(("q/k/v input (norm output" + (f", {qkv} all-gathered copies)" if qkv > 1 else ")"), h * qkv, "act"))
    terms += _attention_core_terms(d, opts, seq_len)
    terms += _norm_terms("MLP norm", h, r, impl)
    if tiled(opts.mlp_chunk_tokens, m, layout, opts, seq_len):
        terms.append(("MLP norm output (tile inputs)", h / r, "res"))
    else:
        up = (impl.mlp_projections if m.mlp == "swiglu" else 1) if gathered else 1
        terms.append(("MLP input (norm output" + (f", {up} all-gathered copies)" if up > 1 else ")"), h * up, "act"))
        n = 4 if m.mlp == "swiglu" else 2
        terms.append((f"MLP intermediates ({n} x ffn/tp)", n * d["f"], "act"))
    return terms


def _norm_terms(name: str, h: float, r: float, impl: Implementation) -> list[tuple[str, float, str]]:
    terms = [(f"{name} input", h / r, "norm"), (f"{name} 1/rms", 1 / r, "f32")]
    if impl.norm_keeps_x_hat:
        terms.append((f"{name} normalised x", h / r, "res"))
    return terms


def _attention_core_terms(d: dict, opts: Options, seq_len: int) -> list[tuple[str, float, str]]:
    q, kv, P = d["q"], d["kv"], d["P"]
    if P == 1:
        terms = [("q (rotated)", q, "act"), ("k, v" + (" (repeated to the query heads)" if d["expand"] else ""),
                                              2 * (q if d["expand"] else kv), "act")]
    else:
        terms = [("q, k, v (after the all-to-all)", q + 2 * kv, "act")]
        if d["expand"]:
            terms.append(("k, v repeated to the query heads", 2 * q, "act"))
    terms.append(("attention output", q, "act"))
    if P > 1:
        terms.append(("o_proj input (inverse all-to-all)", q, "act"))
    if opts.attention == "reference":
        terms += [("attention probabilities (S x S)", d["hq"] * seq_len, "f32"),
                  ("causal mask (S x S)", seq_len * P, "bool")]
    else:
        terms.append(("log-sum-exp", d["hq"], "f32"))
    return terms


def stage_terms(m: ModelConfig, layout: Layout, opts: Options, first: bool, last: bool,
                seq_len: int = 0) -> list[tuple[str, float, str]]:
    """Per micro-batch terms of a pipeline stage outside its layers (per S/sp token)."""
    d = _dims(m, layout, opts)
    h, r = d["h"], d["r"]
    terms = [("rotary cos, sin", 2 * m.head_dim, "f32")]
    if first:
        terms.append(("token ids (embedding)", 1, "i64"))
        if layout.tp > 1:
            terms += [("local token ids", 1, "i64"), ("vocabulary mask", 1, "bool")]
    if last:
        terms += _norm_terms("final norm", h, r, d["impl"])
        if tiled(opts.loss_chunk_tokens, m, layout, opts, seq_len) or d["impl"].fused_loss:
            terms.append(("final norm output (loss tiles)", h / r, "res"))
        else:
            terms += [("LM head input", h, "act"), ("softmax over V/tp (loss)", d["V"], "f32"),
                      ("targets (loss)", 1, "i64"), ("target masks (loss)", 2, "bool")]
    return terms


def bytes_per_token(terms: list[tuple[str, float, str]], prec: Precision, impl: Implementation) -> float:
    return sum(n * class_bytes(prec, impl, cls) for _, n, cls in terms)


def stage_layers(m: ModelConfig, layout: Layout) -> int:
    return m.num_layers // layout.pp


def retained_activation_bytes(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, seq_len: int,
                              micro_batch_size: int = 1, first: bool = True, last: bool = True,
                              layers: Optional[int] = None) -> float:
    """Bytes one micro-batch's forward leaves for its backward on one rank of a stage (what the CPU test
    measures): layers x the per-layer terms + the stage's own terms."""
    impl = IMPLEMENTATIONS[opts.implementation]
    n = stage_layers(m, layout) if layers is None else layers
    tokens = micro_batch_size * seq_len / layout.sp
    per_layer = bytes_per_token(layer_terms(m, layout, opts, seq_len), prec, impl)
    return tokens * (n * per_layer + bytes_per_token(stage_terms(m, layout, opts, first, last, seq_len), prec, impl))


# ----------------------------------------------------------------------------- parameters and pipeline

def layer_params(m: ModelConfig, tp: int = 1) -> float:
    """Parameters of one block on one tp rank."""
    h, D = m.hidden_size, m.head_dim
    attn = h * D * (2 * m.num_heads + 2 * m.kv_heads) / tp
    mlp = (3 if m.mlp == "swiglu" else 2) * h * m.ffn_size / tp
    return attn + mlp + 2 * h * (2 if m.norm == "layernorm" else 1)


def stage_params(m: ModelConfig, layout: Layout, first: bool, last: bool) -> tuple[float, float]:
    """(block parameters, the rest: embedding, final norm, LM head) on one rank of a stage."""
    emb = m.vocab_size * m.hidden_size / layout.tp
    other = (emb if first else 0.0) + (m.hidden_size + emb if last else 0.0)
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


# ----------------------------------------------------------------------------- the estimate

def _fixed_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, first: bool,
                 last: bool) -> list[Term]:
    blocks, other = stage_params(m, layout, first, last)
    n, G = blocks + other, layout.dp * layout.sp
    if not opts.fsdp:
        states = prec.master + prec.moments
        terms = [Term("weights", n * prec.weight, f"{n:.4g} params x {prec.weight} B"),
                 Term("gradient buffer", n * prec.grad, f"{n:.4g} params x {prec.grad} B"),
                 Term("master + moments (ZeRO-1)", n * states / G, f"{n:.4g} params x {states} B / {G}",
                      host=opts.optimizer_offload)]
        if prec.cast_cache:
            terms.append(Term("autocast weight copies", n * prec.cast_cache, f"{n:.4g} params x {prec.cast_cache} B"))
    else:
        block = layer_params(m, layout.tp)
        if opts.param_offload or opts.optimizer_offload:
            shard = prec.master + prec.moments + prec.grad
            terms = [Term("master, moments, gradients (FSDP shards)", n * shard / G, f"{n:.4g} x {shard} B / {G}",
                          host=True)]
            if not opts.param_offload:
                terms.append(Term("compute-dtype parameter + gradient shards", n * 2 * prec.act / G,
                                  f"{n:.4g} x 2 x {prec.act} B / {G}"))
        else:
            terms = [Term("sharded parameters (master)", n * prec.master / G, f"{n:.4g} x {prec.master} B / {G}"),
                     Term("sharded gradients", n * prec.grad / G, f"{n:.4g} x {prec.grad} B / {G}"),
                     Term("sharded moments", n * prec.moments / G, f"{n:.4g} x {prec.moments} B / {G}")]
        terms += [Term("gathered blocks (in flight + prefetched)", 2 * block * prec.act, f"2 x {block:.4g} x {prec.act} B"),
                  Term("unsharded gradient of one block", block * prec.act, f"{block:.4g} x {prec.act} B")]
        if other:
            terms.append(Term("gathered embedding / head", other * prec.act, f"{other:.4g} x {prec.act} B"))
    terms.append(Term("gradient buckets", opts.bucket_bytes, "stated"))
    return terms


def _backward_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, tokens: float,
                    seq_len: int) -> list[Term]:
    """Transient bytes of one layer's backward on one rank, on top of what is retained."""
    d = _dims(m, layout, opts)
    impl, a = d["impl"], prec.act
    q, kv, h, r, f = d["q"], d["kv"], d["h"], d["r"], d["f"]
    terms = []
    if opts.activation_checkpointing:
        redo = bytes_per_token(layer_terms(m, layout, opts, seq_len, checkpointed=False), prec, impl)
        terms.append(Term("recomputed layer activations", tokens * redo, f"{tokens:.4g} tok x {redo:.4g} B"))
    # flash-attn's backward writes dk, dv at the query-head count when a rank has fewer KV heads (GQA)
    kv_grads = q if d["expand"] or (opts.attention == "flash" and q != kv) else kv
    accumulator = 4 * q if opts.dq_accumulator else 0
    kernel = tokens * ((2 * q + 2 * kv_grads) * a + accumulator)
    parts = {"attention kernel backward (dout, dq/dk/dv" + (", fp32 dq accumulator)" if accumulator else ")"): kernel}
    if d["P"] > 1:
        width = q + 2 * kv if impl.packed_all_to_all else max(q, kv)
        parts["all-to-all of dq/dk/dv (gradients, send, receive)"] = tokens * ((q + 2 * kv) + 2 * width) * a
    if tiled(opts.mlp_chunk_tokens, m, layout, opts, seq_len):
        tile = opts.mlp_chunk_tokens * r
        parts["MLP tile backward (recomputed tile + gradients)"] = tile * (2 * h + 7 * f) * a
    else:
        parts["MLP backward (gradients of ffn/tp intermediates)"] = tokens * (h + 3 * f) * a
    name, value = max(parts.items(), key=lambda kv_: kv_[1])
    terms.append(Term(name, value, "largest of: " + ", ".join(f"{k.split(' (')[0]} {v / GIB:.3g} GiB"
                                                             for k, v in parts.items())))
    terms.append(Term("residual-stream gradients", tokens * 2 * h / r * prec.residual,
                      f"{tokens:.4g} tok x 2 x {h / r:.4g} x {prec.residual} B"))
    return terms


def _loss_terms(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, tokens: float,
                seq_len: int) -> list[Term]:
    impl = IMPLEMENTATIONS[opts.implementation]
    V, r = m.vocab_size / layout.tp, layout.tp if opts.tp_sequence_parallel else 1
    tile = opts.loss_chunk_tokens * r if tiled(opts.loss_chunk_tokens, m, layout, opts, seq_len) else tokens
    if impl.fused_loss:
        return [Term("loss tile (logits and their gradient)", tile * V * 2 * prec.act, f"{tile:.4g} tok x {V:.4g} x 2 x {prec.act} B"),
                Term("head-input gradient (computed in the forward)", tokens * m.hidden_size * prec.act,
                     f"{tokens:.4g} tok x {m.hidden_size} x {prec.act} B")]
    return [Term("logits, fp32 copy, shifted and exp", tile * V * (prec.act + 3 * 4),
                 f"{tile:.4g} tok x {V:.4g} x ({prec.act} + 3 x 4) B")]


def estimate(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, work: Workload) -> Estimate:
    """The peak over the pipeline stages (the first holds the most micro-batches, the last the loss)."""
    return max((_stage_estimate(m, layout, opts, prec, work, s) for s in sorted({0, layout.pp - 1})),
               key=lambda e: e.peak)


def _stage_estimate(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, work: Workload,
                    stage: int) -> Estimate:
    impl = IMPLEMENTATIONS[opts.implementation]
    first, last = stage == 0, stage == layout.pp - 1
    tokens = work.micro_batch_size * work.seq_len / layout.sp          # one micro-batch, S/sp tokens
    n_layers = stage_layers(m, layout)
    layer_tok = bytes_per_token(layer_terms(m, layout, opts, work.seq_len), prec, impl)
    S = work.seq_len
    stage_tok = bytes_per_token(stage_terms(m, layout, opts, first, False, S), prec, impl)
    head_tok = (bytes_per_token(stage_terms(m, layout, opts, False, True, S), prec, impl)
                - bytes_per_token(stage_terms(m, layout, opts, False, False, S), prec, impl)) if last else 0.0
    flight = in_flight(layout, stage, work.micro_batches)
    layers = flight * tokens * n_layers * layer_tok
    what = f"{flight:g} mb x {n_layers} layers x {tokens:.4g} tok x {layer_tok:.4g} B"
    act = []
    if opts.activation_offload:
        # the layers copied back ahead of the one in backward (which its recomputation counts under
        # checkpointing; without, its own saved activations are on the device too)
        ahead = min(opts.offload_prefetch + (0 if opts.activation_checkpointing else 1), n_layers)
        window = ahead * tokens * layer_tok
        act += [Term(f"offload window ({ahead} layer{'' if ahead == 1 else 's'} on the device)", window,
                     f"{ahead} x {tokens:.4g} tok x {layer_tok:.4g} B"),
                Term("offloaded layer activations", layers, what, host=True)]
    else:
        act.append(Term("layer activations", layers, what))
    act.append(Term("stage activations (cos/sin, ids)", flight * tokens * stage_tok,
                    f"{flight:g} mb x {tokens:.4g} tok x {stage_tok:.4g} B"))
    if last:
        act.append(Term("final norm + loss inputs", tokens * head_tok, f"{tokens:.4g} tok x {head_tok:.4g} B"))
    if opts.documents and opts.attention == "sdpa":
        act.append(Term("dense document mask (sdpa)", work.micro_batch_size * work.seq_len ** 2,
                        f"B x S^2 = {work.micro_batch_size} x {work.seq_len}^2 B"))
    fixed = _fixed_terms(m, layout, opts, prec, first, last)
    n = sum(stage_params(m, layout, first, last))
    G = layout.dp * layout.sp
    states_on_device = not (opts.optimizer_offload or opts.param_offload)
    phases = {"backward": _backward_terms(m, layout, opts, prec, tokens, work.seq_len),
              "optimizer": [Term("AdamW temporaries (gradient shard, sqrt of v)", n * 2 * 4 / G if states_on_device else 0.0,
                                 f"{n:.4g} x 2 x 4 B / {G}")]}
    if last:
        phases["loss"] = _loss_terms(m, layout, opts, prec, tokens, S)
    # what each phase sees besides its own transients: the loss all activations; a layer's backward
    # those of the layers (the head's were freed first); the optimizer step none
    seen = {"loss": fixed + act, "backward": fixed + [t for t in act if not t.name.startswith("final norm")],
            "optimizer": fixed}
    totals = {name: sum(t.bytes for t in extra) + sum(t.bytes for t in seen[name] if not t.host)
              for name, extra in phases.items()}
    phase = max(totals, key=totals.get)
    kept = [t for t in seen[phase] if not t.host]
    host = [t for t in fixed + act if t.host]
    return Estimate(peak=totals[phase], stage=stage, phase=phase, terms=kept + phases[phase] + host,
                    host=sum(t.bytes for t in host), layer_bytes_per_token=layer_tok, layout=layout, options=opts)


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
    """The scheme a run of `cfg` uses on `device`: bf16 weights with fp32 optimizer state for bfloat16
    compute, fp32 otherwise."""
    dtype = cfg.training.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return PRECISIONS["bf16" if dtype == "bfloat16" else "fp32"]


def attention_for(cfg: Config, device: str = "cuda") -> tuple[str, bool, bool]:
    """(concrete backend, native grouped-query attention, fp32 dq accumulator) that `cfg` runs on
    `device` (kernels/attention.py; auto assumes flash-attn is installed on GPUs)."""
    backend = cfg.model.attention_backend
    if backend == "auto":
        backend = ("flex" if cfg.data.document_mask else "flash") if device == "cuda" else "sdpa"
    cuda_sdpa = backend == "sdpa" and device == "cuda"
    native = backend in ("flash", "flex") or (cuda_sdpa and not cfg.data.document_mask)
    return backend, native, backend == "flash" or cuda_sdpa


def layout_of(cfg: Config, world_size: int) -> Layout:
    p = cfg.parallel
    return Layout(tp=p.tp, sp=p.sp, pp=p.pp, dp=max(world_size // (p.tp * p.sp * p.pp), 1),
                  virtual_stages=p.virtual_stages)


def options_of(cfg: Config, device: str = "cuda") -> Options:
    t, p = cfg.training, cfg.parallel
    backend, native, accumulator = attention_for(cfg, device)
    return Options(activation_checkpointing=t.activation_checkpointing, activation_offload=t.activation_offload,
                   mlp_chunk_tokens=t.mlp_chunk_tokens, loss_chunk_tokens=t.loss_chunk_tokens,
                   tp_sequence_parallel=p.tp_sequence_parallel, fsdp=p.fsdp, attention=backend, native_gqa=native,
                   dq_accumulator=accumulator,
                   documents=cfg.data.document_mask, bucket_bytes=0 if p.fsdp else 2 * p.grad_bucket_elements * 4)


def workload_of(cfg: Config, layout: Layout) -> Workload:
    t = cfg.training
    return Workload(seq_len=cfg.data.seq_len, micro_batch_size=t.micro_batch_size,
                    micro_batches=max(t.global_batch_size // (t.micro_batch_size * layout.dp), 1))


def estimate_config(cfg: Config, world_size: int, device: str = "cuda") -> Estimate:
    """The predicted peak per rank of a run of `cfg` on `world_size` ranks of `device` (cuda or cpu)."""
    layout = layout_of(cfg, world_size)
    return estimate(cfg.model, layout, options_of(cfg, device), precision_for(cfg, device), workload_of(cfg, layout))


# ----------------------------------------------------------------------------- measurement (CPU and GPU)

@dataclass
class Retained:
    """What one forward left alive for its backward: storages autograd saved (deduplicated) plus those
    created during the forward that are still referenced (checkpoint inputs are kept by closures, not
    saved tensors). Parameters and the forward's inputs and outputs are not counted."""

    bytes: int
    saved_bytes: int
    storages: list[tuple[int, tuple, str]]    # (bytes, shape, op) per retained storage, largest first


def measure_retained(forward: Callable[[], Any], exclude: tuple = ()) -> tuple[Any, Retained]:
    """Run `forward()` and measure the activation bytes it retains; `exclude`: tensors whose storage is
    not counted (parameters, inputs). Returns (forward's output, Retained)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    skip = {t.untyped_storage()._cdata for t in exclude}
    created: dict[int, tuple] = {}
    saved: dict[int, tuple] = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    seen = created.get(st._cdata)
                    if seen is None or seen[0].expired():     # first sight of this storage: who made it
                        created[st._cdata] = (StorageWeakRef(st), st.nbytes(), tuple(t.shape), str(func))
            return out

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes(), tuple(t.shape), "saved"))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Track():
        out = forward()
    gc.collect(0)          # the young generation holds any cycle the forward made; a full pass is slow
    skip |= {t.untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    alive = {k: v for k, v in {**saved, **created}.items() if k not in skip and not v[0].expired()}
    saved_bytes = sum(v[1] for k, v in saved.items() if k not in skip)
    rows = sorted(((v[1], v[2], v[3]) for v in alive.values()), reverse=True)
    return out, Retained(bytes=sum(r[0] for r in rows), saved_bytes=saved_bytes, storages=rows)


def gib(x: float) -> float:
    return x / GIB


def fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"

