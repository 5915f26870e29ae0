"""The torch norms over row tiles (kernels/norms.py TiledNorm): RMSNorm, the residual add fused with it and
LayerNorm give the untiled reference's output and input gradient bit for bit, and its weight (and bias)
gradients within fp32 rounding (summed over tiles in fp32; in bf16 each tile's sum is rounded first); and
their backward holds one tile's temporaries, not fp32 copies of the whole activation: the measured peak of
the backward (megalysses.measure) is the memory model's (norm_backward_bytes, norm_tile_bytes) within 10%,
which the untiled reference is not."""
import pytest
import torch
import torch.nn.functional as F

from megalysses.config import ModelConfig
from megalysses.kernels import norms
from megalysses.kernels.norms import add_rms_norm, add_rms_norm_torch, layer_norm, rms_norm, rms_norm_torch
from megalysses.measure import measure_peak
from megalysses.memory import PRECISIONS, Options, norm_backward_bytes, norm_tile_bytes

H = 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture
def tile_rows(monkeypatch):
    """Tiles of 32 rows (the default is 2^24 elements), so a few hundred tokens make several."""
    monkeypatch.setattr(norms, "NORM_TILE_ELEMENTS", 32 * H)
    return 32


def _tensors(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _params(dtype):
    g = torch.Generator().manual_seed(1)
    return [(1 + 0.5 * torch.randn(H, generator=g)).to(dtype).requires_grad_(),
            (0.1 * torch.randn(H, generator=g)).to(dtype).requires_grad_()]


KINDS = {   # name: (tiled, untiled reference), each (x, delta, weight, bias) -> a tuple of outputs
    "rms_norm": (lambda x, d, w, b: (rms_norm(x, w, 1e-6, impl="torch"),),
                 lambda x, d, w, b: (rms_norm_torch(x, w, 1e-6),)),
    "add_rms_norm": (lambda x, d, w, b: add_rms_norm(x, d, w, 1e-6, impl="torch"),
                     lambda x, d, w, b: add_rms_norm_torch(x, d, w, 1e-6)),
    "layer_norm": (lambda x, d, w, b: (layer_norm(x, w, b, 1e-5),),
                   lambda x, d, w, b: (F.layer_norm(x, (H,), w, b, 1e-5),)),
}


def _summation_bound(kind: str, x, delta, w, dy, tiles: int) -> list:
    """For the weight's (and bias's) gradient, sum over rows of dy * x_hat (of dy): the rounding error bound of
    `tiles` partial sums and their total in the parameters' dtype, (tiles + 1) eps sum |dy x_hat|."""
    n = x.shape[-1]
    r = (x + delta) if kind == "add_rms_norm" else x
    r, dy = r.detach().double().reshape(-1, n), dy.double().reshape(-1, n)
    x_hat = F.layer_norm(r, (n,)) if kind == "layer_norm" else r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True))
    eps = torch.finfo(w.dtype).eps
    sums = [(dy * x_hat).abs().sum(0)] + ([dy.abs().sum(0)] if kind == "layer_norm" else [])
    return [(tiles + 1) * eps * s for s in sums]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", [(3, 70, H), (1, 32, H), (5, H)])      # tiles of 32 rows: 7, 1, 1
def test_tiled_norms_equal_the_untiled_reference(tile_rows, kind, dtype, shape):
    """The output bit for bit; the input's gradient bit for bit (add_rms_norm: within fp32 rounding, the
    residual's gradient being added to the norm's in another order); the weight's and bias's within the
    rounding of a sum over tiles (bit for bit with one tile)."""
    tiled, reference = KINDS[kind]
    x, delta, _ = _tensors(shape, DTYPES[dtype])
    w, b = _params(DTYPES[dtype])
    inputs = (x, delta, w, b)
    got, want = tiled(*inputs), reference(*inputs)
    g = torch.Generator().manual_seed(2)
    grads_out = [torch.randn(t.shape, generator=g).to(t.dtype) for t in want]
    leaves = [x, w] + ([delta] if kind == "add_rms_norm" else []) + ([b] if kind == "layer_norm" else [])
    got_grads = torch.autograd.grad(got, leaves, grads_out)
    want_grads = torch.autograd.grad(want, leaves, grads_out)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and torch.equal(a, e), f"{kind}: the output differs"
    tiles = -(-x[..., 0].numel() // tile_rows)
    bounds = iter(_summation_bound(kind, x, delta, w, grads_out[-1], tiles))
    for leaf, a, e in zip(leaves, got_grads, want_grads):
        assert a.dtype == e.dtype
        if leaf is x or leaf is delta:
            if kind == "add_rms_norm" and dtype == "fp32":
                eps = torch.finfo(torch.float32).eps         # three terms added in another order
                torch.testing.assert_close(a, e, rtol=0, atol=2 * eps * e.abs().max().item())
            else:
                assert torch.equal(a, e), f"{kind}: the input's gradient differs"
        elif tiles == 1:
            assert torch.equal(a, e), f"{kind}: one tile, but a parameter's gradient differs"
        else:
            bound = next(bounds)
            err = (a.double() - e.double()).abs()
            assert (err <= bound).all(), f"{kind}: a parameter's gradient off by {(err / bound).max():.2f} x the bound"


def test_the_untiled_path_is_the_reference_where_one_tile_holds_every_row():
    x, _, _ = _tensors((2, 8, H), torch.float32)
    w, _ = _params(torch.float32)
    y = rms_norm(x, w, 1e-6, impl="torch")
    g = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    want = rms_norm_torch(x, w, 1e-6)
    assert torch.equal(y, want)
    assert all(torch.equal(a, e) for a, e in zip(g, torch.autograd.grad(want, (x, w), torch.ones_like(want))))


def _backward_peak(kind: str, dtype: torch.dtype, rows: int) -> int:
    """The live bytes the norm's backward adds at its peak, over its input, weight, output and incoming gradient."""
    x, _, _ = _tensors((rows, H), dtype)
    w, b = _params(dtype)
    y = rms_norm(x, w, 1e-6, impl="torch") if kind == "rmsnorm" else layer_norm(x, w, b, 1e-5)
    dy = torch.randn(y.shape).to(dtype)
    leaves = (x, w) if kind == "rmsnorm" else (x, w, b)
    base = [x, w, b, y, dy]
    _, peak = measure_peak(lambda: torch.autograd.grad(y, leaves, dy), baseline=base)
    return peak.bytes - sum(t.numel() * t.element_size() for t in base)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_the_backward_holds_one_tile_as_the_model_says(tile_rows, kind, dtype):
    rows = 16 * tile_rows
    m = ModelConfig(vocab_size=256, hidden_size=H, num_layers=1, num_heads=4, norm=kind)
    prec, opts = PRECISIONS[dtype], Options(kernels="torch")
    predicted = norm_backward_bytes(m, opts, prec) * rows * H + norm_tile_bytes(m, opts, prec, rows)
    measured = _backward_peak(kind, DTYPES[dtype], rows)
    assert abs(predicted - measured) <= 0.10 * measured, (kind, dtype, predicted, measured)
    # what the whole activation's fp32 temporaries would be: the untiled reference's backward
    if kind == "rmsnorm":
        x, _, _ = _tensors((rows, H), DTYPES[dtype])
        w, _ = _params(DTYPES[dtype])
        y = rms_norm_torch(x, w, 1e-6)
        dy = torch.randn(y.shape).to(y.dtype)
        base = [x, w, y, dy]
        _, untiled = measure_peak(lambda: torch.autograd.grad(y, (x, w), dy), baseline=base)
        assert untiled.bytes - sum(t.numel() * t.element_size() for t in base) > 3 * predicted
