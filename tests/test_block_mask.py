"""FlexAttention block masks built from the documents' boundaries per block (kernels/block_mask.py): the same
BlockMask as torch's create_block_mask (which evaluates the mask on every pair of tokens) element by element, for
core attention's whole-sequence mask and for every pair of blocks a ring step attends (the zigzag's half blocks,
the queries' and keys' offsets), over documents, causality and sliding windows; the dense mask they imply is
the attention's own; no pair of tokens is evaluated while building, so a 1M x 1M ring block builds here; and
the memory model counts the masks a ring keeps for the step."""
import pytest
import torch

from megalysses.config import ModelConfig
from megalysses.kernels import block_mask
from megalysses.kernels.attention import causal_block_mask, flex_available, prepare_attention_mask
from megalysses.kernels.block_attention import AttentionBlock
from megalysses.degrees import Degrees
from megalysses.memory import Options, Workload
from megalysses.memory.blocks import flex_index_tensor_bytes, flex_mask
from megalysses.parallel.ring import RingMask

pytestmark = pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention")
INDEX_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def packed_docs(batch: int, S: int, mean: int, seed: int = 0) -> torch.Tensor:
    """(batch, S) non-decreasing document ids of documents about `mean` tokens long, as the data loader makes."""
    starts = torch.rand(batch, S, generator=torch.Generator().manual_seed(seed)) < 1.0 / mean
    starts[:, 0] = True
    return starts.long().cumsum(1) - 1


def per_pair_mask(block: AttentionBlock, sq: int, sk: int):
    """torch's create_block_mask of the block's pairs, its mask evaluated on every (query, key) pair: how the
    masks were built before."""
    from torch.nn.attention.flex_attention import create_block_mask

    qd, kd, causal, window, qp, kp = block.q_docs, block.k_docs, block.causal, block.window, block.q_pos, block.k_pos

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = kv_idx <= q_idx if causal else q_idx >= 0
        if qd is not None:
            allowed = allowed & (qd[b, q_idx] == kd[b, kv_idx])
        if window:
            allowed = allowed & (qp[q_idx] - kp[kv_idx] < window)
        return allowed
    return create_block_mask(mask_mod, None if qd is None else qd.shape[0], None, sq, sk, device="cpu",
                             BLOCK_SIZE=block.block)


def assert_same(got, want, allowed: torch.Tensor) -> None:
    """Every index tensor equal, the block-level dense masks equal, and the token-level mask the kernel applies
    (full blocks whole, partial blocks through mask_mod) is `allowed` (B or 1, 1, Sq, Sk)."""
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in INDEX_TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert torch.equal(got.to_dense(), want.to_dense())
    sq, sk = got.seq_lengths
    bq, bk = got.BLOCK_SIZE

    def tokens(num, idx):                                                   # block level -> (B, 1, Sq, Sk) bool
        dense = torch.zeros(idx.shape[:2] + (idx.shape[2], idx.shape[3] + 1), dtype=torch.bool)
        taken = torch.arange(idx.shape[-1]) < num[..., None]
        dense.scatter_(-1, torch.where(taken, idx, idx.shape[-1]).long(), True)
        dense = dense[..., :-1].repeat_interleave(bq, 2).repeat_interleave(bk, 3)
        return dense[..., :sq, :sk]
    full, partial = tokens(got.full_kv_num_blocks, got.full_kv_indices), tokens(got.kv_num_blocks, got.kv_indices)
    b, q, k = torch.arange(full.shape[0])[:, None, None], torch.arange(sq)[:, None], torch.arange(sk)
    applied = full | (partial & got.mask_mod(b, 0, q, k).expand(full.shape[0], sq, sk)[:, None])
    assert torch.equal(applied, allowed.expand_as(applied))


@pytest.mark.parametrize("S, mean, window, block", [(4096, 700, 0, 128), (1000, 150, 300, 128), (768, 300, 0, 256)])
def test_core_attention_masks_equal_create_block_mask(S, mean, window, block):
    docs = packed_docs(1 if S >= 4096 else 2, S, mean)
    mask = prepare_attention_mask(docs, "flex", window=window, block=block)
    got = mask.block_mask(window)
    pattern = AttentionBlock(True, docs, docs, window, torch.arange(S), torch.arange(S), block=block)
    assert_same(got, per_pair_mask(pattern, S, S), mask.dense(window))
    plain = AttentionBlock(True, window=window, q_pos=torch.arange(S), k_pos=torch.arange(S))
    assert_same(causal_block_mask.__wrapped__(S, torch.device("cpu"), window), per_pair_mask(plain, S, S),
                plain.allowed(S, S, torch.device("cpu")))


@pytest.mark.parametrize("ring, S, window, block", [(2, 1000, 0, 128), (3, 1536, 200, 128), (4, 2048, 300, 256)])
def test_ring_step_masks_equal_create_block_mask(ring, S, window, block):
    """Every rank's every ring step: its whole diagonal block (causal), the half blocks against the ranks before
    and after it (the key or query offsets of the zigzag), with documents, and a window."""
    docs = packed_docs(2, S, S // 5, seed=ring)
    cpu = torch.device("cpu")
    for rank in range(ring):
        for docs_ in (docs, None) if window else (docs,):
            mask = RingMask(docs_, rank, ring, S, cpu, block=block)
            for j in range(ring):
                rows, cols = mask.rows(j), mask.cols(j)
                sq, sk = len(range(S // ring)[rows]), len(range(S // ring)[cols])
                attend = mask.block(j, window)
                if not attend.masked:
                    continue
                assert_same(attend.flex_mask(sq, sk, cpu), per_pair_mask(attend, sq, sk), attend.allowed(sq, sk, cpu))


def test_a_million_by_a_million_ring_block_builds_without_evaluating_pairs(monkeypatch):
    """A ring rank's diagonal block of 2^20 tokens with documents of two 16K-token blocks: torch's per-pair path
    (create_mask, 2^40 evaluations) is never entered and the mask's own mask_mod never called, yet the blocks
    are right: each query block's own block partial (causal), the one before it full when it is its document's."""
    from torch.nn.attention import flex_attention

    def refuse(*args, **kwargs):
        raise AssertionError("the mask was evaluated on pairs of tokens")
    monkeypatch.setattr(flex_attention, "create_mask", refuse)
    monkeypatch.setattr(flex_attention, "create_block_mask", refuse)
    monkeypatch.setattr(block_mask.MaskPattern, "mask_mod", lambda self: refuse)
    S, block = 1 << 20, 1 << 14
    docs = (torch.arange(S) // (2 * block))[None]
    attend = AttentionBlock(True, docs, docs, block=block)
    got = attend.flex_mask(S, S, torch.device("cpu"))
    n = S // block
    odd = torch.arange(n) % 2
    assert torch.equal(got.kv_num_blocks.flatten(), torch.ones(n, dtype=torch.int32))
    assert torch.equal(got.kv_indices[0, 0, :, 0], torch.arange(n, dtype=torch.int32))
    assert torch.equal(got.full_kv_num_blocks.flatten(), odd.int())
    assert torch.equal(got.full_kv_indices[0, 0, 1::2, 0], torch.arange(0, n, 2, dtype=torch.int32))
    assert attend.flex_mask(S, S, torch.device("cpu")) is got              # kept: built once for the step


def test_the_memory_model_counts_the_masks_a_ring_keeps():
    """A ring step builds each pair of blocks' mask once and keeps it for the step (the layers, the head chunks
    and the backward share it): the model's term is the bytes of all r masks, and its largest tensor one index
    tensor of the diagonal block's."""
    S, B, ring, block = 4096, 2, 4, 256
    cpu = torch.device("cpu")
    mask = RingMask(packed_docs(B, S, 600), 1, ring, S, cpu, block=block)
    kept = []
    for j in range(ring):
        sq, sk = len(range(S // ring)[mask.rows(j)]), len(range(S // ring)[mask.cols(j)])
        built = mask.block(j).flex_mask(sq, sk, cpu)
        assert mask.block(j).flex_mask(sq, sk, cpu) is built
        kept += [getattr(built, name) for name in INDEX_TENSORS]
    opts = Options(attention="flex", documents=True, mask_block=block)
    layout, work, m = Degrees(sp=ring, ring=ring), Workload(seq_len=S, micro_batch_size=B), ModelConfig()
    term = flex_mask(m, layout, opts, work)
    assert term.bytes == sum(t.numel() * t.element_size() for t in kept)
    assert flex_index_tensor_bytes(m, layout, opts, work) == max(t.numel() * t.element_size() for t in kept)


def test_a_ring_step_builds_each_mask_once_for_its_layers_and_head_chunks(monkeypatch):
    """The layers and head chunks of a step run the ring's blocks again and again with the step's RingMask: each
    pair of blocks' mask is built the first time only."""
    from dataclasses import replace

    from megalysses.kernels import attention, block_attention
    from megalysses.parallel.ring import BlockKernel, forward_blocks, ring_schedule

    built, real = [], attention.kernels().build_block_mask
    counting = replace(attention.kernels(), build_block_mask=lambda *args: built.append(args) or real(*args))
    monkeypatch.setattr(block_attention, "_flex_call", lambda q_, k_, v_, block_mask, scale:    # the kernel aside
                        (torch.zeros_like(q_), torch.zeros(q_.shape[:-1])))
    S, ring, rank, cpu = 1024, 4, 1, torch.device("cpu")
    mask = RingMask(packed_docs(1, S, 200), rank, ring, S, cpu)
    q, kv = torch.randn(1, S // ring, 2, 16), torch.randn(2, 1, S // ring, 1, 16)
    with torch.no_grad(), attention.use_kernels(counting):
        for _ in range(3):                                                # layers, or head chunks
            forward_blocks(q, [(j, kv) for j in ring_schedule(rank, ring)], mask, BlockKernel("flex", 0.25))
    assert len(built) == ring
