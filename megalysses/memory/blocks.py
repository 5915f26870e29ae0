"""The largest single tensor a rank allocates in a step: the device budget holds back at least one such
block for the caching allocator's fragmentation (plan/step_time.py Hardware.usable_bytes), since a free
range split among smaller blocks cannot take it."""
from __future__ import annotations

from megalysses.config import ModelConfig
from megalysses.memory.activations import dims, tiled
from megalysses.memory.transients import loss_tile_tokens
from megalysses.memory.types import Layout, Options, Precision, Term, Workload

FLEX_INDEX_TENSORS = 4      # a BlockMask's kv_indices, full_kv_indices and their transposes q_indices, full_q_indices


def flex_mask_bytes(batch: int, seq_q: float, seq_k: float, block: int) -> float:
    """FlexAttention's BlockMask over seq_q x seq_k positions in `block`-token blocks: four int32 index tensors
    of (seq_q / block) x (seq_k / block) entries per sample (no head dimension), and its block counts."""
    rows, cols = -(-seq_q // block), -(-seq_k // block)
    return batch * 4 * (FLEX_INDEX_TENSORS * rows * cols + 2 * (rows + cols))


def flex_mask(m: ModelConfig, layout: Layout, opts: Options, work: Workload) -> Term | None:
    """The block mask FlexAttention holds on a rank, or None where it builds none: with a ring, one ring step's
    pair of blocks (built for the step and freed after it, kernels/block_attention.py); without, the step's
    mask over the whole sequence that every Ulysses rank attends to (kernels/attention.py), with documents in
    blocks of opts.mask_block tokens, plain causal in 128-token ones."""
    if opts.attention != "flex":
        return None
    block = opts.mask_block if opts.documents else 128
    if layout.ring > 1:
        if not opts.documents:           # the cached causal mask of the diagonal block
            side = work.seq_len / layout.ring
            return Term("FlexAttention's causal block mask (the diagonal ring block)",
                        flex_mask_bytes(1, side, side, 128), f"(S/r / 128)^2 x {4 * FLEX_INDEX_TENSORS} B")
        side = work.seq_len / layout.ring
        return Term(f"FlexAttention's block mask of one ring step ({block}-token blocks)",
                    flex_mask_bytes(work.micro_batch_size, side, side, block),
                    f"B x (S/r / {block})^2 x {4 * FLEX_INDEX_TENSORS} B")
    batch = work.micro_batch_size if opts.documents else 1
    return Term(f"FlexAttention's block mask ({block}-token blocks)",
                flex_mask_bytes(batch, work.seq_len, work.seq_len, block),
                f"B x (S / {block})^2 x {4 * FLEX_INDEX_TENSORS} B")


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
    mask = flex_mask(m, layout, opts, work)
    if mask is not None:
        blocks["one index tensor of FlexAttention's block mask"] = mask.bytes / FLEX_INDEX_TENSORS
    name = max(blocks, key=blocks.get)
    return Term(f"largest block: {name}", blocks[name])
