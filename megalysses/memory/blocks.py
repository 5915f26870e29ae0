"""The largest single tensor a rank allocates in a step: the device budget holds back at least one such
block for the caching allocator's fragmentation (plan/step_time.py Hardware.usable_bytes), since a free
range split among smaller blocks cannot take it."""
from __future__ import annotations

from megalysses.config import ModelConfig
from megalysses.memory.activations import dims, tiled
from megalysses.memory.transients import loss_tile_tokens
from megalysses.memory.types import Layout, Options, Precision, Term, Workload


def largest_block(m: ModelConfig, layout: Layout, opts: Options, prec: Precision, work: Workload,
                  last: bool) -> Term:
    """The largest single allocation of one micro-batch's step on a rank of a stage (`last`: it holds the LM
    head and loss), with its name: the candidates are the tensors whose size grows with the sequence or
    the vocabulary, each allocated whole."""
    a = prec.act
    tokens = work.micro_batch_size * work.seq_len / layout.sp
    d = dims(m, layout, opts, opts.head_chunks)
    vocab = m.padded_vocab_size(layout.tp) / layout.tp
    mlp_rows = opts.mlp_chunk_tokens if tiled(opts.mlp_chunk_tokens, layout, opts, work.seq_len) else tokens
    blocks = {"a block input (tokens x hidden)": tokens * d["h"] * a,
              "the QKV projection's output": tokens * d["qkv"] * a,
              "q, k and v of the attention (the all-to-all buffer)": tokens * (d["q"] + 2 * d["kv"]) * a,
              "the MLP's gate-up output": mlp_rows * 2 * d["f"] * a,
              "the embedding's weight gradient": vocab * d["h"] * prec.weight,
              "a gradient bucket": 0.0 if opts.fsdp else opts.bucket_bytes}
    if opts.dq_accumulator or d["ring"] > 1:
        blocks["the fp32 dq of attention's backward"] = tokens * d["q"] * 4
    if d["ring"] > 1:
        blocks["the fp32 dK/dV accumulator travelling the ring"] = tokens * 2 * d["kv"] * 4
    if last:
        tile = loss_tile_tokens(m, layout, opts, tokens)
        blocks["a tile of fp32 logits"] = tile * vocab * 4
        if tile < tokens:
            blocks["the head weight's fp32 gradient sum"] = vocab * d["h"] * 4
    name = max(blocks, key=blocks.get)
    return Term(f"largest block: {name}", blocks[name])
