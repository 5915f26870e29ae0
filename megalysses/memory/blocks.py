"""The largest single tensor a rank allocates in a step: the device budget holds back at least one such
block for the caching allocator's fragmentation (plan/step_time.py Hardware.usable_bytes), since a free
range split among smaller blocks cannot take it."""
from __future__ import annotations

from megalysses.config import ModelConfig
from megalysses.memory.activations import dims, tiled
from megalysses.memory.transients import loss_tile_tokens
from megalysses.degrees import Degrees
from megalysses.memory.types import Options, Precision, Term, Workload

FLEX_INDEX_TENSORS = 4      # a BlockMask's kv_indices, full_kv_indices and their transposes q_indices, full_q_indices


def flex_mask_bytes(batch: int, seq_q: float, seq_k: float, block: int) -> float:
    """FlexAttention's BlockMask over seq_q x seq_k positions in `block`-token blocks: four int32 index tensors
    of (seq_q / block) x (seq_k / block) entries per sample (no head dimension), and its block counts."""
    rows, cols = -(-seq_q // block), -(-seq_k // block)
    return batch * 4 * (FLEX_INDEX_TENSORS * rows * cols + 2 * (rows + cols))


def _flex_masks(m: ModelConfig, layout: Degrees, opts: Options, work: Workload) -> list[tuple[int, float, float, int]]:
    """(batch, query and key positions, block) of each BlockMask FlexAttention holds on a rank at once, the
    largest first. With a ring and documents or a window, one per ring step's pair of blocks (the rank's own
    block whole, the r-1 others half: kernels/block_attention.py AttentionBlock builds each on first use and
    keeps it for the step, shared by the layers, the head chunks and the backward); plain causal on a ring, the
    cached mask of the diagonal block; without a ring, the step's mask over the whole sequence that every
    Ulysses rank attends to. Documents in blocks of opts.mask_block tokens, a plain causal (window) mask in
    128-token ones; a batch of micro_batch_size with documents, else 1."""
    if opts.attention != "flex":
        return []
    block = opts.mask_block if opts.documents else 128
    batch = work.micro_batch_size if opts.documents else 1
    if layout.ring == 1:
        return [(batch, work.seq_len, work.seq_len, block)]
    side = work.seq_len / layout.ring
    if not (opts.documents or m.sliding_window > 0):
        return [(1, side, side, 128)]
    return [(batch, side, side, block)] + [(batch, side / 2, side, block)] * (layout.ring - 1)


def flex_mask(m: ModelConfig, layout: Degrees, opts: Options, work: Workload) -> Term | None:
    """The block masks FlexAttention holds on a rank (_flex_masks), or None where it builds none."""
    masks = _flex_masks(m, layout, opts, work)
    if not masks:
        return None
    batch, _, _, block = masks[0]
    total = sum(flex_mask_bytes(*mask) for mask in masks)
    if layout.ring == 1:
        return Term(f"FlexAttention's block mask ({block}-token blocks)", total,
                    f"B x (S / {block})^2 x {4 * FLEX_INDEX_TENSORS} B")
    if len(masks) == 1:
        return Term("FlexAttention's causal block mask (the diagonal ring block)", total,
                    f"(S/r / 128)^2 x {4 * FLEX_INDEX_TENSORS} B")
    return Term(f"FlexAttention's block masks of the {layout.ring} ring steps ({block}-token blocks, kept for the "
                f"step)", total, f"B x ((S/r / {block})^2 + (r - 1) (S/2r / {block}) (S/r / {block})) x "
                f"{4 * FLEX_INDEX_TENSORS} B, r = {layout.ring}")


def flex_index_tensor_bytes(m: ModelConfig, layout: Degrees, opts: Options, work: Workload) -> float:
    """The largest single index tensor of FlexAttention's block masks on a rank (0 where it builds none)."""
    masks = _flex_masks(m, layout, opts, work)
    if not masks:
        return 0.0
    batch, seq_q, seq_k, block = masks[0]
    return batch * 4 * -(-seq_q // block) * -(-seq_k // block)


def largest_block(m: ModelConfig, layout: Degrees, opts: Options, prec: Precision, work: Workload,
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
        rows = 1 + 128 * opts.varlen_sequences / work.seq_len      # a varlen kernel's 128 more rows per sequence
        blocks["the fp32 dq of attention's backward"] = tokens * d["q_acc"] * 4 * rows
    if d["ring"] > 1:
        blocks["the fp32 dK/dV accumulator travelling the ring"] = tokens * 2 * d["kv"] * 4
    if last:
        tile = loss_tile_tokens(m, layout, opts, tokens)
        blocks["a tile of fp32 logits"] = tile * vocab * 4
        if tile < tokens:
            blocks["the head weight's fp32 gradient sum"] = vocab * d["h"] * 4
    if opts.attention == "flex":
        blocks["one index tensor of FlexAttention's block mask"] = flex_index_tensor_bytes(m, layout, opts, work)
    name = max(blocks, key=blocks.get)
    return Term(f"largest block: {name}", blocks[name])
