"""The ring's block kernels on a CUDA device (the GPU tier: marked `gpu`, skipped without one).

    make test-gpu        # = pytest -m gpu tests

What only a GPU shows: torch's CUDA flash kernel and compiled FlexAttention running ring blocks with
their log-sum-exp (forward and backward, against the reference), and the cost of computing attention
block by block with the merge. The ring's algorithm itself (zigzag blocks, merge, dK/dV around the ring)
is checked on CPU by test_ring.py.
"""
import pytest
import torch

from megalysses.kernels.attention import core_attention
from megalysses.plan import Machine
from megalysses.plan.run_plan import choose_attention
from tests.ring_oracle import blockwise_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU tier)")]

BLOCKWISE_SLOWDOWN = 1.10     # the target: block-wise attention within 10% of single-pass attention


def _qkv(S, hq, hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, S, h, D, device="cuda", dtype=dtype, generator=g).requires_grad_() for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("backend,dtype,docs", [("sdpa", torch.bfloat16, False), ("flex", torch.bfloat16, True),
                                                ("flex", torch.float32, False), ("reference", torch.bfloat16, True)])
def test_ring_blocks_on_cuda_match_the_reference(backend, dtype, docs):
    S = 1024
    q, k, v = _qkv(S, 8, 2, 64, dtype)
    doc_ids = torch.cat([torch.zeros(300, dtype=torch.long), torch.ones(S - 300, dtype=torch.long)])[None].cuda() \
        if docs else None
    assert choose_attention(backend, Machine.current("cuda"), str(dtype).removeprefix("torch."), 64, has_docs=docs,
                            ring=True)[0] == backend
    upstream = torch.randn(1, S, 8, 64, device="cuda", dtype=dtype)
    want = core_attention(*(t.float() for t in (q, k, v)), doc_ids=doc_ids, backend="reference")
    want_grads = torch.autograd.grad(want, (q, k, v), upstream.float())
    got = blockwise_attention(q, k, v, 4, doc_ids=doc_ids, backend=backend)
    got_grads = torch.autograd.grad(got, (q, k, v), upstream)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)   # TF32
    torch.testing.assert_close(got.float(), want, **tol)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=lambda m, name=name: f"d{name}: {m}")


def _time_fwd_bwd(fn, q, k, v, upstream, repeats=5) -> float:
    """Median seconds of forward + backward."""
    times = []
    for i in range(repeats + 2):                          # two warm-up runs (compilation, allocator)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(fn(q, k, v), (q, k, v), upstream)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("ring", [2, 4])
def test_blockwise_attention_at_32k_within_10_percent_of_single_pass(ring):
    """Causal attention over 32K tokens (16 query heads, 4 KV heads, head dim 128: one rank's share after
    the Ulysses all-to-all), bf16, forward + backward: the ring's blocks with the LSE merge, run for every
    ring rank on this one device, against one pass of the same kernel family (torch SDPA)."""
    S = 32 * 1024
    q, k, v = _qkv(S, 16, 4, 128, torch.bfloat16)
    upstream = torch.randn(1, S, 16, 128, device="cuda", dtype=torch.bfloat16)
    single = _time_fwd_bwd(lambda q_, k_, v_: core_attention(q_, k_, v_, backend="sdpa"), q, k, v, upstream)
    blockwise = _time_fwd_bwd(lambda q_, k_, v_: blockwise_attention(q_, k_, v_, ring, backend="sdpa"), q, k, v,
                              upstream)
    assert blockwise <= BLOCKWISE_SLOWDOWN * single, \
        f"ring={ring}: block-wise {blockwise * 1e3:.1f} ms vs single pass {single * 1e3:.1f} ms"
