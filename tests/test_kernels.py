"""RMSNorm (alone and fused with the residual add), RoPE (alone and on a fused QKV output), SwiGLU and the
fused LM head + cross-entropy: each implementation behind the dispatch point equals the pure-torch
reference (forward and backward), and the references equal independent formulas (float64 RMS, complex
rotation, Hugging Face Llama, separate ops). Triton kernels run through Triton's CPU interpreter when
there is no GPU."""
import pytest
import torch

from megalysses.config import RopeScalingConfig
from megalysses.kernels.linear_cross_entropy import linear_cross_entropy
from megalysses.kernels.norms import add_rms_norm, rms_norm, rms_norm_torch
from megalysses.kernels.rope import apply_rope, apply_rope_torch, rope_cos_sin, rope_qkv
from megalysses.kernels.swiglu import swiglu
from megalysses.parallel.tensor_parallel import vocab_parallel_cross_entropy
from megalysses.kernels.triton_support import triton_importable
from megalysses.testing import triton_interpreter_runs_our_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []     # on a GPU, every kernel test is the GPU tier's


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter_on_cpu():
    """Triton reads TRITON_INTERPRET when a kernel module is first imported (lazily, by the dispatch)."""
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        yield


def require_triton():
    if not triton_importable():
        pytest.skip("triton is not installed (pip install triton; on CPU its interpreter runs the kernels)")
    if DEVICE == "cpu" and not triton_interpreter_runs_our_kernels():
        pytest.skip("this Triton's CPU interpreter cannot run loops bounded by the program id with this numpy "
                    "(Triton 3.6 and older with numpy 2.4: pip install 'numpy<2.4'); compiled kernels are unaffected")


def randn(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_(grad)


def backward(out, *inputs, seed=1):
    return torch.autograd.grad(out, inputs, randn(*out.shape, dtype=out.dtype, seed=seed))


# ---------------------------------------------------------------------------------------------- RMSNorm

def test_rms_norm_reference_formula():
    x, w = randn(3, 5, 24, dtype=torch.float64), randn(24, dtype=torch.float64, seed=2)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 24 + 1e-5) * w
    torch.testing.assert_close(rms_norm_torch(x, w, 1e-5), want)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, impl="torch"), want)


@pytest.mark.parametrize("shape", [(2, 7, 48), (5, 100), (3, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_triton_matches_torch(shape, dtype):
    require_triton()
    # in fp32 every other row at rms ~1e-3, where eps counts (bf16 rounds their ~1e3 gradients past its tolerance)
    rows = torch.ones(*shape[:-1], 1, device=DEVICE)
    if dtype == torch.float32:
        rows.view(-1)[::2] = 1e-3
    x = (randn(*shape) * rows).to(dtype).detach().requires_grad_()
    w = (1 + 0.5 * randn(shape[-1], seed=2)).requires_grad_()            # fp32 weight, like the model's
    got, want = rms_norm(x, w, 1e-6, impl="triton"), rms_norm_torch(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    for g, r in zip(backward(got, x, w), backward(want, x, w)):
        torch.testing.assert_close(g, r, **tol)


def test_rms_norm_triton_noncontiguous_input():
    require_triton()
    x = randn(40, 6, grad=True)
    w = (1 + randn(40, seed=2)).requires_grad_()
    xt = x.t()                                                             # (6, 40), not contiguous
    got, want = rms_norm(xt, w, 1e-6, impl="triton"), rms_norm_torch(xt, w, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, r in zip(backward(got, x, w), backward(want, x, w)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_rms_norm_dispatch(monkeypatch):
    x, w = randn(4, 16), 1 + randn(16, seed=2)
    if DEVICE == "cpu":   # auto never takes Triton on CPU, even with the interpreter on
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="rms_norm impl 'triton' is unavailable"):
            rms_norm(x, w, 1e-6, impl="triton")
    with pytest.raises(ValueError, match="unknown rms_norm impl 'fused'"):
        rms_norm(x, w, 1e-6, impl="fused")
    with pytest.raises(ValueError, match="does not match"):
        rms_norm(x, w[:8], 1e-6)


# ---------------------------------------------------------------------------------------------- RoPE

def angles64(pos, D, theta):
    """pos * theta^(-2i/D) in float64, (B, S, D/2): the textbook RoPE angles."""
    i = torch.arange(D // 2, dtype=torch.float64, device=pos.device)
    return pos.double()[..., None] * theta ** (-2 * i / D)


def test_rope_cos_sin_angles():
    """HF computes the angles in fp32 (so do we, for identical logits): close to float64, not equal."""
    pos = torch.randint(0, 5000, (2, 10), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cos, sin = rope_cos_sin(pos, 16, 10000.0, dtype=torch.float64)
    assert cos.shape == sin.shape == (2, 10, 16)
    angle = angles64(pos, 16, 10000.0).repeat(1, 1, 2)                    # second half repeats the first
    torch.testing.assert_close(cos, angle.cos(), rtol=0, atol=1e-3)      # fp32 angle error grows with pos
    torch.testing.assert_close(sin, angle.sin(), rtol=0, atol=1e-3)
    small = torch.arange(8, device=DEVICE)[None]
    torch.testing.assert_close(rope_cos_sin(small, 16, 10000.0)[1],
                               angles64(small, 16, 10000.0).repeat(1, 1, 2).sin().float())


def test_rope_equals_complex_rotation(impl="torch"):
    """HF's half-split rotation = multiplying (x[i] + j x[i + D/2]) by exp(j angle_i)."""
    B, S, H, D = 2, 10, 3, 16
    x = randn(B, S, H, D, dtype=torch.float64)
    pos = torch.randint(0, 5000, (B, S), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    angle = angles64(pos, D, 10000.0)                                      # (B, S, D/2)
    cos, sin = angle.cos().repeat(1, 1, 2), angle.sin().repeat(1, 1, 2)    # (B, S, D)
    z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * torch.polar(torch.ones_like(angle), angle)[:, :, None]
    want = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin, impl=impl), want, rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_on_relative_position_only():
    D = 32
    q, k = randn(1, 1, 1, D, dtype=torch.float64), randn(1, 1, 1, D, dtype=torch.float64, seed=2)

    def rotated(x, p):
        angle = angles64(torch.tensor([[p]], device=DEVICE), D, 500000.0).repeat(1, 1, 2)
        return apply_rope(x, angle.cos(), angle.sin())

    def score(m, n):
        return (rotated(q, m) * rotated(k, n)).sum()
    torch.testing.assert_close(score(7, 3), score(1004, 1000))
    torch.testing.assert_close(score(0, 0), (q * k).sum())


YARN = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,H,D,scaling", [(2, 12, 4, 16, None), (1, 9, 3, 24, YARN)])
def test_rope_triton_matches_torch(B, S, H, D, scaling, dtype):
    """(YaRN's attention factor scales cos and sin, which the kernels read: with it they still agree.)"""
    require_triton()
    x = randn(B, S, H, D, dtype=dtype, grad=True)
    pos = torch.randint(0, 4000, (B, S), generator=torch.Generator().manual_seed(4)).to(DEVICE)   # a row its own
    cos, sin = rope_cos_sin(pos, D, 10000.0, scaling=scaling)
    got, want = apply_rope(x, cos, sin, impl="triton"), apply_rope_torch(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(backward(got, x)[0], backward(want, x)[0], **tol)


def test_rope_backward_is_inverse_rotation():
    x = randn(2, 6, 2, 8, dtype=torch.float64, grad=True)
    cos, sin = rope_cos_sin(torch.arange(12, device=DEVICE).view(2, 6), 8, 10000.0, torch.float64)
    dy = randn(2, 6, 2, 8, dtype=torch.float64, seed=5)
    (dx,) = torch.autograd.grad(apply_rope(x, cos, sin, impl="torch"), x, dy)
    torch.testing.assert_close(dx, apply_rope_torch(dy, cos, -sin))


@pytest.mark.parametrize("scaling", [
    {}, {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0,
     "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}], ids=["plain", "linear", "yarn", "yarn_mscale"])
def test_rope_matches_hugging_face(scaling):
    """cos and sin are transformers' bit for bit, with its frequencies and YaRN's attention factor."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    B, S, H, D, theta = 2, 40, 4, 16, 5000.0
    cfg = transformers.LlamaConfig(hidden_size=H * D, num_attention_heads=H, max_position_embeddings=128,
                                   rope_parameters={"rope_type": "default", **scaling, "rope_theta": theta})
    ours = RopeScalingConfig(type=scaling.get("rope_type", "none"),
                             **{k: v for k, v in scaling.items() if k != "rope_type"})
    pos = torch.arange(S).expand(B, S) + torch.tensor([[0], [70]])
    q, k = randn(B, S, H, D).cpu(), randn(B, S, H, D, seed=2).cpu()
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(q, pos)
    cos, sin = rope_cos_sin(pos, D, theta, scaling=ours)
    if scaling:
        assert not torch.equal(cos, rope_cos_sin(pos, D, theta)[0])      # the scaling changes them
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=0)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), hf_cos, hf_sin)   # HF: (B, H, S, D)
    torch.testing.assert_close(apply_rope_torch(q, cos, sin), hf_q.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(apply_rope_torch(k, cos, sin), hf_k.transpose(1, 2), rtol=0, atol=0)


def test_rope_dispatch_errors(monkeypatch):
    x = randn(1, 4, 2, 8)
    cos, sin = rope_cos_sin(torch.arange(4, device=DEVICE)[None], 8, 10000.0)
    with pytest.raises(ValueError, match="unknown apply_rope impl"):
        apply_rope(x, cos, sin, impl="cuda")
    with pytest.raises(ValueError, match="cos, sin must be"):
        apply_rope(x, cos[..., :4], sin[..., :4])
    with pytest.raises(ValueError, match="even head dim"):
        rope_cos_sin(torch.arange(4)[None], 7, 10000.0)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="apply_rope impl 'triton' is unavailable"):
            apply_rope(x, cos, sin, impl="triton")


# ---------------------------------------------------------------------------------------------- in the model

def test_model_with_triton_kernels_equals_torch(monkeypatch):
    """model.kernels=triton routes every RMSNorm and RoPE of the GPT through the Triton kernels; the
    loss and every gradient equal the torch reference model."""
    require_triton()
    from megalysses.config import ModelConfig
    from megalysses.kernels import rms_norm_triton, rope_triton, swiglu_triton
    from megalysses.model.gpt import GPTStage, init_weights

    calls = {"rms_norm": 0, "add_rms_norm": 0, "rope_qkv": 0, "swiglu": 0}
    for key, fn in (("rms_norm", rms_norm_triton.RMSNormTriton), ("add_rms_norm", rms_norm_triton.AddRMSNormTriton),
                    ("rope_qkv", rope_triton.RoPEQKVTriton), ("swiglu", swiglu_triton.SwiGLUTriton)):
        def counted(*args, _apply=fn.apply, _key=key):
            calls[_key] += 1
            return _apply(*args)
        monkeypatch.setattr(fn, "apply", counted)

    grads, losses = {}, {}
    for kernels in ("torch", "triton"):
        cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                          attention_backend="sdpa", kernels=kernels)
        model = GPTStage(cfg).to(DEVICE)
        init_weights(model, seed=3)
        ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
        pos = torch.arange(8, device=DEVICE).expand(1, 8)
        loss = model(ids, pos, labels=ids.roll(-1, dims=1))
        loss.backward()
        losses[kernels] = loss.detach()
        grads[kernels] = {n: p.grad for n, p in model.named_parameters()}
    # per block: the attention norm, the residual add fused with the MLP norm, q/k/v, SwiGLU; the final norm
    assert calls == {"rms_norm": 2, "add_rms_norm": 1, "rope_qkv": 1, "swiglu": 1}
    torch.testing.assert_close(losses["triton"], losses["torch"], rtol=1e-5, atol=1e-5)
    for name, g in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][name], g, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- fused ops

def upstream(*outs, seed=1):
    return [randn(*o.shape, dtype=o.dtype, seed=seed + i) for i, o in enumerate(outs)]


def test_fused_references_equal_separate_ops():
    """The references of the fused ops are the unfused model's ops, exactly."""
    x, d, w = randn(3, 5, 24), randn(3, 5, 24, seed=2), 1 + randn(24, seed=3)
    r, y = add_rms_norm(x, d, w, 1e-6, impl="torch")
    assert torch.equal(r, x + d) and torch.equal(y, rms_norm_torch(x + d, w, 1e-6))
    gu = randn(3, 5, 2 * 12)
    gate, up = gu[..., 0::2], gu[..., 1::2]
    assert torch.equal(swiglu(gu, impl="torch"), torch.nn.functional.silu(gate) * up)
    B, S, hk, rep, D = 2, 6, 2, 3, 8
    qkv = randn(B, S, hk, rep + 2, D)
    cos, sin = rope_cos_sin(torch.arange(S, device=DEVICE).expand(B, S), D, 10000.0)
    q, k, v = rope_qkv(qkv, cos, sin, impl="torch")
    assert q.shape == (B, S, hk * rep, D) and k.shape == v.shape == (B, S, hk, D)
    for h in range(hk * rep):     # query head h belongs to KV group h // rep
        assert torch.equal(q[:, :, h], apply_rope_torch(qkv[:, :, h // rep, h % rep][:, :, None], cos, sin)[:, :, 0])
    assert torch.equal(k, apply_rope_torch(qkv[:, :, :, rep], cos, sin)) and torch.equal(v, qkv[:, :, :, rep + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_triton_matches_torch(dtype):
    require_triton()
    x, d = randn(4, 9, 40, dtype=dtype, grad=True), randn(4, 9, 40, dtype=dtype, seed=2, grad=True)
    w = (1 + 0.5 * randn(40, seed=3)).to(dtype).requires_grad_()
    got, want = add_rms_norm(x, d, w, 1e-6, impl="triton"), add_rms_norm(x, d, w, 1e-6, impl="torch")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, **tol)
    ups = upstream(*want)
    for g, r in zip(torch.autograd.grad(got, (x, d, w), ups), torch.autograd.grad(want, (x, d, w), ups)):
        torch.testing.assert_close(g, r, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_triton_matches_torch(dtype):
    require_triton()
    gu = (2 * randn(3, 7, 2 * 50, dtype=torch.float32)).to(dtype).requires_grad_()
    got, want = swiglu(gu, impl="triton"), swiglu(gu, impl="torch")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.dtype == want.dtype and got.shape == want.shape == (3, 7, 50)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(backward(got, gu)[0], backward(want, gu)[0], **tol)


@pytest.mark.parametrize("hk,rep,D", [(2, 3, 16), (1, 4, 12), (4, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qkv_triton_matches_torch(hk, rep, D, dtype):
    require_triton()
    B, S = 2, 5
    qkv = randn(B, S, hk, rep + 2, D, dtype=dtype, grad=True)
    pos = torch.randint(0, 4000, (B, S), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cos, sin = rope_cos_sin(pos, D, 10000.0)
    got, want = rope_qkv(qkv, cos, sin, impl="triton"), rope_qkv(qkv, cos, sin, impl="torch")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype and g.is_contiguous()
        torch.testing.assert_close(g, r, **tol)
    ups = upstream(*want)
    torch.testing.assert_close(torch.autograd.grad(got, qkv, ups)[0], torch.autograd.grad(want, qkv, ups)[0], **tol)


@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_logits_then_loss(chunk, dtype):
    """The fused, tiled LM head + loss against materialised logits and the vocab-parallel cross-entropy;
    rows from vocab_size on are padding (never in the softmax), label -100 is ignored."""
    N, h, V, V_pad = 13, 16, 45, 48
    x = randn(N, h, dtype=dtype, grad=True)
    w = randn(V_pad, h, dtype=dtype, seed=2, grad=True)
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    labels[[2, 7]] = -100
    got = linear_cross_entropy(x, w, labels, vocab_size=V, chunk_tokens=chunk)
    want = torch.nn.functional.cross_entropy((x @ w[:V].t()).float(), labels, reduction="sum")
    same_math = vocab_parallel_cross_entropy(torch.cat([(x @ w[:V].t()).float(), torch.full((N, V_pad - V),
                                             float("-inf"), device=DEVICE)], 1), labels, None).sum()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got, same_math, **tol)
    g_got, g_want = torch.autograd.grad(2.5 * got, (x, w)), torch.autograd.grad(2.5 * want, (x, w))
    for a, b in zip(g_got, g_want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(g_got[1][V:], torch.zeros_like(g_got[1][V:]))        # padding rows learn nothing
    with torch.no_grad():                                                    # evaluation: no gradients kept
        torch.testing.assert_close(linear_cross_entropy(x, w, labels, vocab_size=V, chunk_tokens=chunk), got)
    # per-token weights (data.loss_average: document): the weighted sum, its gradients
    weights = torch.rand(N, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got = linear_cross_entropy(x, w, labels, vocab_size=V, chunk_tokens=chunk, weights=weights)
    each = torch.nn.functional.cross_entropy((x @ w[:V].t()).float(), labels, reduction="none")
    want = (weights * each).sum()
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x, w))):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["liger", "apex"])
def test_library_kernels_match_torch(impl, dtype):
    """model.kernels=liger / apex: each op the library provides (apex: RMSNorm and the add before it; the
    rest falls to our Triton kernels) against the torch reference, forward and backward, in fp32 and bf16."""
    from megalysses.kernels.triton_support import LIBRARY_OPS, library_importable
    if DEVICE != "cuda" or not library_importable(impl):
        pytest.skip(f"{impl} needs its package and a CUDA device")
    tol = dict(rtol=2e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    x, d = randn(4, 9, 64, dtype=dtype, grad=True), randn(4, 9, 64, dtype=dtype, seed=2, grad=True)
    w = (1 + 0.5 * randn(64, seed=3)).to(dtype).requires_grad_()
    gu = randn(4, 9, 2 * 96, dtype=dtype, seed=4, grad=True)
    qkv = randn(2, 8, 2, 5, 64, dtype=dtype, seed=5, grad=True)
    cos, sin = rope_cos_sin(torch.arange(8, device=DEVICE).expand(2, 8), 64, 10000.0)
    ops = {"rms_norm": (lambda i: (rms_norm(x, w, 1e-6, impl=i),), (x, w)),
           "add_rms_norm": (lambda i: add_rms_norm(x, d, w, 1e-6, impl=i), (x, d, w)),
           "swiglu": (lambda i: (swiglu(gu, impl=i),), (gu,)),
           "rope_qkv": (lambda i: rope_qkv(qkv, cos, sin, impl=i), (qkv,))}
    for name, (op, inputs) in ops.items():
        got, want = op(impl), op("torch")
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, **tol, msg=lambda m, name=name: f"{impl} {name}: {m}")
        ups = upstream(*want)     # cloned for the library: liger's RoPE backward rotates its incoming gradient in place
        for g, r in zip(torch.autograd.grad(got, inputs, [u.clone() for u in ups]),
                        torch.autograd.grad(want, inputs, ups)):
            torch.testing.assert_close(g, r, **tol, msg=lambda m, name=name: f"{impl} {name} backward: {m}")
    assert set(LIBRARY_OPS[impl]) <= set(ops)
