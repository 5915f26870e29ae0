"""Every core-attention backend equals the fp32 reference (outputs and q/k/v gradients), causal and with
packed-document masks, for GQA, MQA and MHA; the reference itself equals per-document attention."""
import math
from dataclasses import replace

import pytest
import torch

from megalysses.config import ConfigError
from megalysses.kernels.attention import (AttentionMask, available_backends, core_attention, doc_ids_to_cu_seqlens,
                                          prepare_attention_mask)
from megalysses.plan import Machine
from megalysses.plan.run_plan import choose_attention

# the CUDA cases belong to the GPU tier (pytest -m gpu)
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
HEADS = [(8, 2), (4, 1), (4, 4)]          # GQA, MQA, MHA


def make_qkv(B=2, S=64, hq=8, hkv=2, D=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g).to(device, dtype).requires_grad_() for h in (hq, hkv, hkv))
    return q, k, v


def make_doc_ids(S=64, device="cpu"):
    """Row 0: documents of 20, 30 and 14 tokens plus single-token ones; row 1: one document (id 5)."""
    row0 = torch.tensor([0] * 20 + [1] * 30 + [2] * (S - 53) + [3, 4, 7])
    row1 = torch.full((S,), 5)
    return torch.stack([row0, row1]).to(device)


def grads(out, *inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


def tolerance(device, dtype):
    if dtype in (torch.float16, torch.bfloat16):
        return dict(rtol=2e-2, atol=2e-2)
    return dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=2e-3, atol=2e-3)   # TF32 on GPUs


def require(backend, device, dtype=torch.float32):
    if backend not in available_backends(device):
        pytest.skip(f"attention backend {backend!r} unavailable on {device} "
                    f"(available: {', '.join(available_backends(device))})")
    if backend in ("flash", "varlen") and dtype not in (torch.float16, torch.bfloat16):
        pytest.skip(f"{backend} takes float16/bfloat16 only")


def backend_matrix(test):
    """Every backend x head layout x mask x device."""
    for mark in (pytest.mark.parametrize("backend", ["sdpa", "flex", "flash", "varlen"]),
                 pytest.mark.parametrize("hq,hkv", HEADS),
                 pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"]),
                 pytest.mark.parametrize("device", DEVICES)):
        test = mark(test)
    return test


def backend_case(backend, hq, hkv, docs, device):
    """(dtype, q, k, v, mask) for one case; skips when the backend cannot run here."""
    dtype = torch.bfloat16 if backend in ("flash", "varlen") else torch.float32
    require(backend, device, dtype)
    # on CUDA a shape compiled FlexAttention's templates take (one 128-token block, head dim 64)
    S, D = (128, 64) if device == "cuda" else (64, 16)
    q, k, v = make_qkv(S=S, hq=hq, hkv=hkv, D=D, dtype=dtype, device=device)
    mask = prepare_attention_mask(make_doc_ids(S=S, device=device), backend) if docs else None
    return dtype, q, k, v, mask


@backend_matrix
def test_backend_output_matches_reference(backend, hq, hkv, docs, device):
    dtype, q, k, v, mask = backend_case(backend, hq, hkv, docs, device)
    with torch.no_grad():
        want = core_attention(q, k, v, mask=mask, backend="reference")
        got = core_attention(q, k, v, mask=mask, backend=backend)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, **tolerance(device, dtype))


@backend_matrix
def test_backend_gradients_match_reference(backend, hq, hkv, docs, device):
    if backend == "flex" and device == "cpu":
        pytest.skip("torch implements FlexAttention's backward for CUDA only (forward is checked on CPU)")
    dtype, q, k, v, mask = backend_case(backend, hq, hkv, docs, device)
    want = grads(core_attention(q, k, v, mask=mask, backend="reference"), q, k, v)
    got = grads(core_attention(q, k, v, mask=mask, backend=backend), q, k, v)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, **tolerance(device, dtype), msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_document_mask_equals_attention_per_document(backend):
    """Independent of any mask construction: attention over each document alone, plain causal."""
    q, k, v = make_qkv(hq=8, hkv=2)
    doc_ids = make_doc_ids()
    got = core_attention(q, k, v, doc_ids=doc_ids, backend=backend)
    dq, dk, dv = grads(got, q, k, v)
    want = torch.empty_like(got)
    cu = doc_ids_to_cu_seqlens(doc_ids).tolist()
    for lo, hi in zip(cu[:-1], cu[1:]):          # documents of the flattened (B*S) batch
        b, s0, s1 = lo // q.shape[1], lo % q.shape[1], lo % q.shape[1] + hi - lo
        part = [t[b:b + 1, s0:s1] for t in (q, k, v)]
        want[b:b + 1, s0:s1] = core_attention(*part, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip((dq, dk, dv), grads(want, q, k, v)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 4])
def test_reference_matches_naive_loop(window):
    """The reference against a per-position loop over allowed keys (GQA head mapping h -> h // rep); with a
    sliding window, the key itself and the window - 1 before it, as Hugging Face's sliding_window."""
    q, k, v = make_qkv(B=1, S=12, hq=4, hkv=2, D=8)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    got = core_attention(q, k, v, doc_ids=doc_ids, backend="reference", scale=0.3, window=window)
    want = torch.zeros_like(got)
    for h in range(4):
        for i in range(12):
            js = [j for j in range(i - window + 1 if window else 0, i + 1) if doc_ids[0, j] == doc_ids[0, i]]
            w = torch.softmax(torch.stack([q[0, i, h] @ k[0, j, h // 2] * 0.3 for j in js]), 0)
            want[0, i, h] = sum(wj * v[0, j, h // 2] for wj, j in zip(w, js))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash"])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("device", DEVICES)
def test_sliding_window_matches_reference(backend, docs, device):
    """Each backend masks a sliding window as the reference does (outputs; gradients where it has a backward)."""
    dtype, q, k, v, _ = backend_case(backend, 8, 2, False, device)
    mask = prepare_attention_mask(make_doc_ids(S=q.shape[1], device=device), backend, window=9) if docs else None
    forward_only = backend == "flex" and device == "cpu"     # torch implements its backward for CUDA only
    with torch.set_grad_enabled(not forward_only):
        want = core_attention(q, k, v, mask=mask, backend="reference", window=9)
        got = core_attention(q, k, v, mask=mask, backend=backend, window=9)
        assert not torch.allclose(want, core_attention(q, k, v, mask=mask, backend="reference"))   # it matters
    torch.testing.assert_close(got, want, **tolerance(device, dtype))
    if forward_only:
        return
    for g, w in zip(grads(got, q, k, v), grads(want, q, k, v)):
        torch.testing.assert_close(g, w, **tolerance(device, dtype))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_explicit_scale_and_doc_ids_argument(backend):
    require(backend, "cpu")
    q, k, v = make_qkv(hq=4, hkv=1)
    doc_ids = make_doc_ids()
    with torch.no_grad():
        want = core_attention(q, k, v, doc_ids=doc_ids, backend="reference", scale=0.5)
        got = core_attention(q, k, v, doc_ids=doc_ids, backend=backend, scale=0.5)
        default = core_attention(q, k, v, doc_ids=doc_ids, backend=backend)
        explicit = core_attention(q, k, v, doc_ids=doc_ids, backend=backend, scale=1 / math.sqrt(16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


def test_sdpa_bfloat16_close_to_reference():
    q, k, v = make_qkv(hq=8, hkv=2, dtype=torch.bfloat16)
    mask = prepare_attention_mask(make_doc_ids(), "sdpa")
    got = core_attention(q, k, v, mask=mask, backend="sdpa")
    want = core_attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for g, w in zip(grads(got, q, k, v), grads(want, q, k, v)):
        torch.testing.assert_close(g, w, rtol=3e-2, atol=3e-2)


def test_mask_is_built_once_and_reused():
    doc_ids = make_doc_ids()
    mask = prepare_attention_mask(doc_ids, "sdpa", seq_len=64, device="cpu")
    assert isinstance(mask, AttentionMask) and mask.shape == (2, 64)
    assert "dense" in mask._forms                   # built eagerly for the requested backend
    dense = mask.dense()
    assert dense is mask.dense() and dense.shape == (2, 1, 64, 64) and dense.dtype == torch.bool
    assert not dense.requires_grad
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    assert torch.equal(dense[1, 0], causal)         # a single-document row is plain causal
    assert dense[0, 0, 20, 19].item() is False and dense[0, 0, 21, 20].item() is True
    if "flex" in available_backends("cpu"):
        assert mask.block_mask() is mask.block_mask()
    assert mask.varlen()[0] is mask.varlen()[0]
    assert prepare_attention_mask(None, "sdpa") is None


def test_doc_ids_to_cu_seqlens():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [4, 4, 4, 4, 4, 4]])
    cu = doc_ids_to_cu_seqlens(doc_ids)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 12]
    assert doc_ids_to_cu_seqlens(torch.tensor([7, 7, 8])).tolist() == [0, 2, 3]
    assert prepare_attention_mask(doc_ids, "flash").varlen()[1] == 6


def test_selection_follows_the_shape():
    """auto never picks a backend that cannot run the shape on the machine; an explicit one that cannot is
    refused, saying why. Machines are described, so CUDA rules are checked without a GPU."""
    with_flash = Machine.described("H100", packages=("flash_attn", "triton"))
    plain = Machine.described("H100")                       # a plain torch install: no flash-attn
    cpu = Machine.described(None)

    def select(requested, machine, dtype="bfloat16", **kw):
        return choose_attention(requested, machine, dtype, **kw)[0]

    assert select("auto", with_flash, head_dim=128, has_docs=True) == "flash"
    assert select("auto", with_flash, head_dim=12) == "sdpa"             # 12 % 8 != 0
    assert select("auto", with_flash, head_dim=512) == "sdpa"            # above 256
    assert select("auto", with_flash, "float32", head_dim=64) == "sdpa"
    with pytest.raises(ConfigError, match="'flash' needs a head dim that is a multiple of 8"):
        select("flash", with_flash, head_dim=12)
    with pytest.raises(ConfigError, match="'flash' is unavailable on cuda: it needs CUDA and an importable flash_attn"):
        select("flash", plain, head_dim=64)
    # documents on a plain torch: its variable-length attention (cumulative lengths), FlexAttention where it
    # has none (torch < 2.9) or cannot run (fp32), else SDPA
    assert select("auto", plain, head_dim=64, has_docs=True) == "varlen"
    no_varlen = replace(plain, packages=plain.packages - {"varlen"})
    assert select("auto", no_varlen, head_dim=64, has_docs=True) == "flex"
    assert select("auto", plain, "float32", head_dim=64, has_docs=True) == "flex"
    with pytest.raises(ConfigError, match="'varlen' needs float16 or bfloat16"):
        select("varlen", plain, "float32", head_dim=64)
    with pytest.raises(ConfigError, match="'varlen' is unavailable on cpu: it needs CUDA"):
        select("varlen", cpu, "float32", head_dim=64)
    with pytest.raises(ConfigError, match="'varlen' cannot run the blocks of ring attention"):
        select("varlen", plain, head_dim=64, ring=True)
    assert select("auto", plain, head_dim=64) == "sdpa"
    for head_dim in (8, 48):                                             # Inductor's flex template refuses these
        assert select("auto", no_varlen, head_dim=head_dim, has_docs=True) == "sdpa"
        with pytest.raises(ConfigError, match="'flex' needs a head dim that is a power of two >= 16"):
            select("flex", plain, head_dim=head_dim)
    with pytest.raises(ConfigError, match="'flex' has no backward on CPU"):
        select("flex", cpu, "float32", head_dim=64, training=True)
    assert select("flex", cpu, "float32", head_dim=64, training=False) == "flex"
    assert select("auto", cpu, head_dim=64, has_docs=True) == "sdpa"
    assert select("auto", cpu, "float32", head_dim=64) == "sdpa"
    assert "flash" not in available_backends("cpu", with_flash.packages)


def test_auto_on_this_machine_equals_sdpa_on_cpu():
    q, k, v = make_qkv(hq=8, hkv=2)
    backend = choose_attention("auto", Machine.current("cpu"), "float32", 16, has_docs=True)[0]
    mask = prepare_attention_mask(make_doc_ids(), backend)
    with torch.no_grad():
        torch.testing.assert_close(core_attention(q, k, v, mask=mask, backend=backend),
                                   core_attention(q, k, v, mask=mask, backend="sdpa"), rtol=0, atol=0)


def test_clear_errors():
    q, k, v = make_qkv(hq=8, hkv=2)
    with pytest.raises(ValueError, match="unknown attention backend 'flashy'.*reference"):
        core_attention(q, k, v, backend="flashy")
    with pytest.raises(ValueError, match="unknown attention backend 'auto'.*plan.resolve decides what auto is"):
        core_attention(q, k, v, backend="auto")
    if "flash" not in available_backends("cpu"):
        with pytest.raises(RuntimeError, match="'flash' is unavailable on cpu.*available here: reference, sdpa"):
            core_attention(q, k, v, backend="flash")
    if "flex" in available_backends("cpu"):
        with pytest.raises(RuntimeError, match="'flex' has no backward on CPU"):
            core_attention(q, k, v, backend="flex")
    with pytest.raises(ValueError, match="non-decreasing"):
        prepare_attention_mask(torch.tensor([[0, 1, 0, 1]]), "sdpa")
    with pytest.raises(ValueError, match="sequence has 32"):
        prepare_attention_mask(make_doc_ids(), "sdpa", seq_len=32)
    with pytest.raises(ValueError, match="mask is for"):
        core_attention(q[:, :32], k[:, :32], v[:, :32], mask=prepare_attention_mask(make_doc_ids(), "sdpa"))
    with pytest.raises(ValueError, match="not both"):
        core_attention(q, k, v, doc_ids=make_doc_ids(), mask=prepare_attention_mask(make_doc_ids(), "sdpa"))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        core_attention(q[:, :, :3], k, v)


def test_flex_block_masks_at_a_coarse_block_equal_the_reference():
    """FlexAttention with documents in blocks of 256 tokens (the plan coarsens them at long lengths to keep the
    block mask within 1% of the peak) equals the reference, forward on CPU (torch has no CPU backward; the
    GPU tier checks it), for core attention and for a ring step's pair of blocks (built once, kept for the step)."""
    from megalysses.kernels.block_attention import AttentionBlock, block_attention

    require("flex", "cpu")
    S = 512
    doc_ids = torch.tensor([[0] * 100 + [1] * 300 + [2] * 112, [3] * 200 + [4] * 312])
    q, k, v = make_qkv(S=S, hq=4, hkv=2)
    mask = prepare_attention_mask(doc_ids, "flex", block=256)
    assert mask.block_mask().BLOCK_SIZE == (256, 256)
    with torch.no_grad():
        torch.testing.assert_close(core_attention(q, k, v, mask=mask, backend="flex"),
                                   core_attention(q, k, v, mask=mask, backend="reference"), rtol=1e-5, atol=1e-5)
        # a ring step: the second half of the sequence's queries against the first half's keys
        half = S // 2
        block = AttentionBlock(False, doc_ids[:, half:], doc_ids[:, :half], block=256)
        args = (q[:, half:].detach(), k[:, :half].detach(), v[:, :half].detach(), block)
        out, lse, _ = block_attention(*args, "flex", 0.25)
        want, want_lse, _ = block_attention(*args, "reference", 0.25)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert block.flex_mask(half, half, q.device) is block._forms[("flex", half, half)]   # kept: the step shares it
