"""Parameters per rank and stage, micro-batches in flight, and the fixed bytes: weights, gradients,
optimizer state (ZeRO-1 or FSDP, on the device or offloaded) and the AdamW step's own."""
from __future__ import annotations

from megalysses.config import ModelConfig
from megalysses.memory.activations import stage_layers
from megalysses.degrees import Degrees
from megalysses.memory.types import Options, Precision, Term, torch_pinned


def layer_params(m: ModelConfig, tp: int = 1) -> float:
    """Parameters of one block on one tp rank (biases included)."""
    h, D = m.hidden_size, m.head_size
    attn = h * D * (2 * m.num_heads + 2 * m.kv_heads) / tp
    if m.qkv_bias:
        attn += (m.num_heads + 2 * m.kv_heads) * D / tp
    if m.attention_bias:
        attn += h
    return attn + head_norm_params(m) + mlp_params(m, tp) + 2 * norm_params(m)


def head_norm_params(m: ModelConfig) -> float:
    """Parameters of one block's q and k head norms (model.qk_layernorm; replicated over tp)."""
    return 2 * m.head_size if m.qk_layernorm else 0


def mlp_params(m: ModelConfig, tp: int = 1) -> float:
    """Parameters of one block's MLP on one tp rank (biases included)."""
    n = 3 if m.mlp == "swiglu" else 2
    return n * m.hidden_size * m.ffn_size / tp + ((n - 1) * m.ffn_size / tp + m.hidden_size if m.mlp_bias else 0)


def norm_params(m: ModelConfig) -> float:
    """Parameters of one norm (replicated over tp)."""
    return m.hidden_size * (2 if m.norm == "layernorm" else 1)


def param_shapes(m: ModelConfig, layout: Degrees, first: bool, last: bool) -> list[tuple[int, int, int]]:
    """(rows, elements per row, count on the stage) of each parameter tensor on one tp rank, as model/layers.py
    and parallel/tensor_parallel.py make them (one QKV and one gate-up projection; column-parallel weights
    (out/tp, in), row-parallel ones (out, in/tp)): what ZeRO-1 and FSDP split along dim 0, one by one."""
    h, D, t, n = m.hidden_size, m.head_size, layout.tp, stage_layers(m, layout)
    f, qkv = m.ffn_size, D * (m.num_heads + 2 * m.kv_heads)
    gated = 2 if m.mlp == "swiglu" else 1
    norms = 2 if m.norm == "layernorm" else 1                # weight (and bias) of each norm
    shapes = [(qkv // t, h, n), (h, D * m.num_heads // t, n), (gated * f // t, h, n), (h, f // t, n),
              (h, 1, 2 * n * norms)]
    if m.qkv_bias:
        shapes += [(qkv // t, 1, n)]
    if m.attention_bias:
        shapes += [(h, 1, n)]
    if m.qk_layernorm:                                       # q_norm and k_norm: one weight of D each
        shapes += [(D, 1, 2 * n)]
    if m.mlp_bias:
        shapes += [(gated * f // t, 1, n), (h, 1, n)]
    vocab = m.padded_vocab_size(t) // t
    shapes += [(vocab, h, int(first) + int(last) - int(first and last and m.tie_embeddings)), (h, 1, norms * last)]
    return [(rows, row, count) for rows, row, count in shapes if count]


def shard_elements(m: ModelConfig, layout: Degrees, first: bool, last: bool) -> list[tuple[int, int]]:
    """(elements, count) of each parameter's largest dim-0 chunk over the grad group's G = dp x sp ranks (rank
    0's: ceil(rows / G) rows, torch.chunk's split, which ZeRO-1 and FSDP2 both use)."""
    G = layout.dp * layout.sp
    return [(-(-rows // G) * row, count) for rows, row, count in param_shapes(m, layout, first, last)]


def stage_params(m: ModelConfig, layout: Degrees, first: bool, last: bool) -> tuple[float, float]:
    """(block parameters, the rest: embedding, final norm, LM head over the padded vocabulary) on one rank."""
    emb = m.padded_vocab_size(layout.tp) * m.hidden_size / layout.tp
    other = (emb if first else 0.0) + (norm_params(m) + emb if last else 0.0)
    if first and last and m.tie_embeddings:
        other -= emb
    return stage_layers(m, layout) * layer_params(m, layout.tp), other


def in_flight(layout: Degrees, stage: int, micro_batches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once, in units of its whole stage
    (interleaved: model chunks in flight / chunks per rank)."""
    P, v, M = layout.pp, layout.virtual_stages, micro_batches
    if P == 1:
        return 1.0
    if v == 1:
        return float(min(P - stage, M))
    warmup = min((P - stage - 1) * 2 + (v - 1) * P, M * v)     # parallel/interleaved.py rank_order
    return min(warmup + 1, M * v) / v


def earlier_backward(layout: Degrees, stage: int, micro_batches: int) -> bool:
    """Whether a backward of the step has finished when the stage last holds its most micro-batches (the
    moment of its activation peak): its gradients are there then. One after another without a pipeline, from
    the second micro-batch on; 1F1B and interleaved only when the steady state runs a backward before the
    last one that starts with the schedule full (the warm-up's forwards of parallel/interleaved.py)."""
    P, v, M = layout.pp, layout.virtual_stages, micro_batches
    if P == 1:
        return M > 1
    warmup = min(P - stage - 1, M) if v == 1 else min((P - stage - 1) * 2 + (v - 1) * P, M * v)
    return M * v - warmup >= 2


# ----------------------------------------------------------------------------- fixed bytes

def reduced_bytes(prec: Precision, opts: Options, G: int, M: int) -> float:
    """Bytes per parameter of ZeRO-1's reduced fp32 gradient chunks on the device: the reduce-scatter's
    output (4/G), or with a group of one the fp32 copies of low-precision gradients the masters take
    (offload copies the gradients to host memory as they are)."""
    if G > 1:
        return 4 / G
    return 4 if prec.grad(M) != 4 and not opts.optimizer_offload else 0


def streams_gradients(opts: Options) -> bool:
    """ZeRO-1 with optimizer offload: each bucket leaves the device as soon as its gradients are in, in every
    micro-batch (parallel/zero.py), so a step's gradients never accumulate there."""
    return opts.optimizer_offload and not opts.fsdp


def _streamed_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, n: float) -> list[Term]:
    """The gradients on the device when they stream to host memory: those waiting for their bucket to
    complete (at most a bucket's or a layer's, the larger) in the compute dtype, and with a grad group of
    more than one rank the bucket being reduced while the next one fills (its fp32 reduce-scatter input and
    this rank's output)."""
    G = layout.dp * layout.sp
    bucket = min(n, opts.bucket_bytes / 4)
    waiting = min(n, max(layer_params(m, layout.tp), bucket))
    terms = [Term("gradients waiting for their bucket (then streamed to the host)", waiting * prec.weight,
                  f"max(a layer, a bucket) {waiting:.4g} x {prec.weight} B")]
    if G > 1:
        terms.append(Term("gradient bucket being reduced", bucket * 4 * (1 + 1 / G),
                          f"{bucket:.4g} x 4 B x (1 + 1/{G})"))
    return terms


def state_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, first: bool, last: bool,
                M: int) -> tuple[list[Term], list[Term]]:
    """(weights and optimizer state: always there; gradients: once a step's first backward has run,
    with ZeRO-1's reduced chunks of the buckets already reduced)."""
    blocks, other = stage_params(m, layout, first, last)
    n, G = blocks + other, layout.dp * layout.sp
    if streams_gradients(opts):
        # the masters are pinned: memory/host.py counts them
        fixed = [Term("weights", n * prec.weight, f"{n:.4g} params x {prec.weight} B"),
                 Term("AdamW moments (ZeRO-1)", n * prec.moments / G, f"{n:.4g} params x {prec.moments} B / {G}",
                      host=True)]
        return fixed, _streamed_terms(m, layout, opts, prec, n)
    if not opts.fsdp:
        g = prec.grad(M)
        states = prec.master + prec.moments
        fixed = [Term("weights", n * prec.weight, f"{n:.4g} params x {prec.weight} B"),
                 Term("master + moments (ZeRO-1)", n * states / G, f"{n:.4g} params x {states} B / {G}",
                      host=opts.optimizer_offload)]
        grads = [Term("gradients" + (" (fp32 main_grad)" if g == 4 and prec.weight != 4 else ""), n * g,
                      f"{n:.4g} params x {g} B")]
        reduced = reduced_bytes(prec, opts, G, M)
        if reduced and opts.overlap_grad_reduce:
            grads.append(Term("gradients: reduced fp32 chunks", n * reduced, f"{n:.4g} params x {reduced:.3g} B"))
        if G > 1:   # the fp32 gradients of one bucket and the buffer its reduce-scatter sends
            bucket = min(opts.bucket_bytes, n * 4) * (1 if prec.weight == 4 else 2)
            grads.append(Term("gradient bucket being reduced", bucket, f"{bucket / 4:.4g} x 4 B"))
        return fixed, grads
    block, a = layer_params(m, layout.tp), prec.act
    gathered = [Term("gathered block (the one running)", block * a, f"{block:.4g} x {a} B")]
    if other:
        gathered.append(Term("gathered embedding / head (kept through the step)", other * a, f"{other:.4g} x {a} B"))
    if opts.param_offload or opts.optimizer_offload:
        shard = prec.master + prec.moments + 4
        # parameter offload: torch pins the fp32 shards and their gradients (FSDP2's CPUOffloadPolicy) through its
        # caching host allocator, a request per parameter (the largest rank's), not the moments
        pinned = sum(count * torch_pinned(numel * 4, not opts.pinned_rounding)
                     for numel, count in shard_elements(m, layout, first, last))
        host = 2 * pinned + n * prec.moments / G if opts.param_offload else n * shard / G
        fixed = [Term("master, moments, gradients (FSDP shards)", host, f"{n:.4g} x {shard} B / {G}", host=True)]
        if not opts.param_offload:
            fixed.append(Term("compute-dtype parameter + gradient shards", n * 2 * a / G, f"{n:.4g} x 2 x {a} B / {G}"))
        return fixed + gathered, []
    fixed = [Term("sharded parameters (fp32 master)", n * prec.master / G, f"{n:.4g} x {prec.master} B / {G}"),
             Term("sharded moments", n * prec.moments / G, f"{n:.4g} x {prec.moments} B / {G}")]
    return fixed + gathered, [Term("sharded gradients (fp32)", n * 4 / G, f"{n:.4g} x 4 B / {G}")]


def guarded_run(m: ModelConfig, layout: Degrees, opts: Options, first: bool, last: bool) -> float:
    """Elements of the largest run a guarded update (training.nan_policy=skip) steps at once, 0 unguarded: runs
    of at most opts.guard_elements elements, a larger tensor alone, never more than the rank's shards hold (its
    largest dim-0 chunks)."""
    if not opts.guard_elements:
        return 0.0
    shards = shard_elements(m, layout, first, last)
    return float(min(sum(e * count for e, count in shards), max(opts.guard_elements, max(e for e, _ in shards))))


def optimizer_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, first: bool, last: bool,
                    M: int) -> list[Term]:
    """The AdamW step's own bytes, on top of weights, gradients and state (host ones with offload): its sqrt(v)
    over what it steps at once, all of the rank's state or, guarded, one run, whose fp32 weights and moments are
    kept aside while it is stepped (12 B per element)."""
    G, n = layout.dp * layout.sp, sum(stage_params(m, layout, first, last))
    run = guarded_run(m, layout, opts, first, last)
    terms = []
    # optimizer offload's reduced gradients and staging buffers are pinned: memory/host.py counts them
    if not opts.fsdp and not opts.optimizer_offload:
        if not opts.overlap_grad_reduce and reduced_bytes(prec, opts, G, M):
            reduced = reduced_bytes(prec, opts, G, M)
            terms.append(Term("gradients: reduced fp32 chunks", n * reduced, f"{n:.4g} params x {reduced:.3g} B"))
    offloaded = opts.optimizer_offload or opts.param_offload
    if not run:
        return terms + [Term("AdamW sqrt(v)", n * 4 / G, f"{n:.4g} x 4 B / {G}", host=offloaded)]
    return terms + [Term("AdamW sqrt(v) of a guarded run", run * 4, f"{run:.4g} x 4 B", host=offloaded),
                    Term("guarded run's weights and moments kept aside", run * 12, f"{run:.4g} x 12 B", host=offloaded)]
