"""The gradients on the device as a stage's backward walks its blocks: after `done` of them have finished
(the moments of estimate.py: the first block's backward, done = 0, and the last's, done = blocks - 1).

The LM head's gradient exists from the loss's forward on (the loss computes it there); the input embedding's
only after the last block's backward, so it is on none of these moments. Then, by where the gradients go:
    ZeRO-1          they accumulate in the parameters' .grad (one micro-batch) or in fp32 main_grad (from an
                    earlier micro-batch on), the buckets complete so far reduced into fp32 chunks
    streamed        (optimizer offload) a bucket's gradients leave the device as soon as the bucket completes:
                    those of the bucket being filled wait (buckets of parallel.grad_bucket_elements, made in
                    reverse parameter order: a parameter larger than a bucket is one bucket of its own)
    FSDP            each block's gradient is reduce-scattered in fp32 as its backward finishes: the sharded
                    fp32 gradients of the blocks done (kept in host memory with parameter offload) and the
                    newest reduce-scatter's fp32 input (FSDP2 holds it until the next one); the root unit (the
                    embedding, the final norm, the head) keeps its unsharded gradients until the end of the
                    backward, where they are reduce-scattered (`fsdp_end_terms`)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megalysses.config import ModelConfig
from megalysses.memory.activations import stage_layers
from megalysses.memory.states import earlier_backward, head_norm_params, layer_params, stage_params, streams_gradients
from megalysses.degrees import Degrees
from megalysses.memory.types import Options, Precision, Term


def embedding_params(m: ModelConfig, layout: Degrees, first: bool, last: bool) -> float:
    """The input embedding's parameters on a first stage (0 elsewhere, and when it is the tied LM head too)."""
    if not first or (last and m.tie_embeddings):
        return 0.0
    return m.padded_vocab_size(layout.tp) * m.hidden_size / layout.tp


def reverse_parameter_sizes(m: ModelConfig, layout: Degrees, last: bool) -> list[float]:
    """Element counts of a stage's parameters on one rank in reverse parameter order, the order the backward
    makes their gradients in: the head and the final norm (a last stage), then each block's from its end (the
    embedding, last of all, is left out)."""
    h, D, t = m.hidden_size, m.head_size, layout.tp
    gated = 2 if m.mlp == "swiglu" else 1
    norm = h * (2 if m.norm == "layernorm" else 1)
    block = [norm, h * D * (m.num_heads + 2 * m.kv_heads) / t, h * D * m.num_heads / t, norm,
             gated * h * m.ffn_size / t, h * m.ffn_size / t]
    if m.qkv_bias:
        block[1] += (m.num_heads + 2 * m.kv_heads) * D / t
    if m.attention_bias:
        block[2] += h
    block[2] += head_norm_params(m)         # q_norm and k_norm, registered after o_proj
    if m.mlp_bias:
        block[4] += gated * m.ffn_size / t
        block[5] += h
    head = ([] if m.tie_embeddings else [m.padded_vocab_size(t) * h / t]) + [norm] if last else []
    return head + list(reversed(block)) * stage_layers(m, layout)


def waiting_for_bucket(m: ModelConfig, layout: Degrees, opts: Options, last: bool, ready: float) -> float:
    """Of the first `ready` gradient elements of the backward (reverse_parameter_sizes), those in a bucket that
    is not complete yet (GradientReducer._make_buckets: a bucket closes once it holds
    parallel.grad_bucket_elements, so a parameter larger than that is a bucket of its own)."""
    limit, closed, filling, total = max(opts.bucket_bytes / 4, 1), 0.0, 0.0, 0.0
    for numel in reverse_parameter_sizes(m, layout, last):
        if total + numel > ready + 0.5:
            break
        total += numel
        filling += numel
        if filling >= limit:
            closed, filling = total, 0.0
    return ready - closed


def backward_gradients(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, stage: int, M: int,
                       grads: list[Term], done: int) -> list[Term]:
    """The gradient terms on the device after `done` blocks of pipeline stage `stage`'s backward (see the module
    docstring), with M micro-batches a step; `grads` are the step's (state_terms). The micro-batch is the step's
    first backward on the stage unless an earlier one has left its gradients (states.earlier_backward)."""
    first, last = stage == 0, stage == layout.pp - 1
    n_layers, streamed = stage_layers(m, layout), streams_gradients(opts)
    accumulated = earlier_backward(layout, stage, M)
    blocks, other = stage_params(m, layout, first, last)
    per_block = blocks / max(n_layers, 1)
    root = other - embedding_params(m, layout, first, last)        # the head and the final norm
    ready = root + done * per_block
    # a tied embedding is one parameter used twice: autograd holds the head's gradient until the embedding's
    # arrives at the end of the backward, and only then accumulates (and, in fp32 or streamed, hands it on)
    tied = []
    if first and last and m.tie_embeddings:
        head = m.padded_vocab_size(layout.tp) * m.hidden_size / layout.tp
        tied = [Term("the tied LM head's gradient (held until the embedding's)", head * prec.weight,
                     f"{head:.4g} x {prec.weight} B")]
    if streamed:
        waiting = waiting_for_bucket(m, layout, opts, last, ready)
        return tied + [Term(f"gradients waiting for their bucket (the head's and {done} layers')",
                            waiting * prec.weight, f"{waiting:.4g} x {prec.weight} B")]
    if opts.fsdp:
        return _fsdp_gradients(m, layout, opts, prec, root, M > 1 and accumulated, done, n_layers)
    n = blocks + other
    closed = ready - waiting_for_bucket(m, layout, opts, last, ready)     # in buckets complete (and reduced)
    if M > 1 and accumulated:   # the reduced chunks appear as the last micro-batch's backward completes buckets
        return tied + [t for t in grads if "reduced" not in t.name and not t.name.startswith("gradient bucket")] \
            + [replace(t, bytes=t.bytes * closed / n, formula=f"{closed / n:.3g} x {t.formula}")
               for t in grads if "reduced" in t.name]
    if M > 1:                   # the step's first backward: fp32 main_grad layer by layer, nothing reduced yet
        grads = [t for t in grads if "reduced" not in t.name and not t.name.startswith("gradient bucket")]
    out = []
    for t in grads:
        if t.name.startswith("gradient bucket") and not closed:
            continue
        share = (closed if "reduced" in t.name else ready) / n
        out.append(replace(t, name=f"{t.name} (the head's and {done} layers')", bytes=t.bytes * share,
                           formula=f"{share:.3g} x {t.formula}") if t.name.startswith("gradients") else t)
    return out


def _fsdp_gradients(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, root: float,
                    accumulated: bool, done: int, n_layers: int) -> list[Term]:
    block, G = layer_params(m, layout.tp), layout.dp * layout.sp
    offloaded = opts.param_offload or opts.optimizer_offload
    terms = []
    if root:
        terms.append(Term("the root unit's unsharded gradients (the head's, kept to the end of the backward)",
                          root * prec.weight, f"{root:.4g} x {prec.weight} B"))
    sharded = n_layers if accumulated else done
    if sharded and not offloaded:
        terms.append(Term(f"sharded fp32 gradients ({sharded} blocks')", sharded * block * 4 / G,
                          f"{sharded} x {block:.4g} x 4 B / {G}"))
    if sharded:
        terms.append(Term("the newest reduce-scatter's fp32 input (one block's)", block * 4, f"{block:.4g} x 4 B"))
    return terms


def fsdp_end_terms(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, first: bool, last: bool,
                   n_layers: int) -> Optional[list[Term]]:
    """FSDP at the end of the backward, when the root unit reduce-scatters its gradients: every block's sharded
    fp32 gradient (on the device without parameter offload), the root's unsharded gradients and its
    reduce-scatter's fp32 input and output; None without FSDP or a root unit."""
    if not opts.fsdp:
        return None
    blocks, other = stage_params(m, layout, first, last)
    if not other:
        return None
    G = layout.dp * layout.sp
    terms = [Term("the root unit's unsharded gradients (embedding, head)", other * prec.weight,
                  f"{other:.4g} x {prec.weight} B"),
             Term("its reduce-scatter's fp32 input and output", other * 4 * (1 + 1 / G),
                  f"{other:.4g} x 4 B x (1 + 1/{G})")]
    if not (opts.param_offload or opts.optimizer_offload):
        terms.insert(0, Term("sharded fp32 gradients (every block's)", blocks * 4 / G, f"{blocks:.4g} x 4 B / {G}"))
    return terms
