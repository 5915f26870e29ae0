"""Memory options change what is stored for the backward, never the numbers."""
import torch

from megalysses.config import ModelConfig
from megalysses.kernels.rope import rope_cos_sin
from megalysses.model.layers import Block, ParallelGroups
from megalysses.model.policies import TiledMLP

S, H, F = 128, 64, 256


def _saved_bytes_and_grads(mlp_chunk_tokens: int):
    """Run one block forward + backward; return the bytes autograd saved and every gradient."""
    cfg = ModelConfig(hidden_size=H, num_heads=4, ffn_hidden_size=F, attention_backend="sdpa")
    torch.manual_seed(0)
    block = Block(cfg, ParallelGroups())
    if mlp_chunk_tokens:
        block.mlp_half = TiledMLP(mlp_chunk_tokens)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(2, S, H, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(S).expand(2, S), cfg.head_size, cfg.rope_theta)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, cos, sin, None)
    out.square().sum().backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
    return sum(saved), out.detach(), grads


def test_tiled_mlp_same_numbers_fewer_saved_activations():
    plain_bytes, plain_out, plain_grads = _saved_bytes_and_grads(0)
    tiled_bytes, tiled_out, tiled_grads = _saved_bytes_and_grads(48)     # 48, 48, 32: a ragged last tile
    torch.testing.assert_close(tiled_out, plain_out, rtol=1e-6, atol=1e-6)
    for name, g in plain_grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    # untiled, the SwiGLU intermediates (gate, up, silu(gate): 2 x S x F floats each at least) are
    # stored; tiled, only the tile inputs are, and the intermediates are recomputed tile by tile
    assert plain_bytes - tiled_bytes >= 3 * 2 * S * F * 4, (plain_bytes, tiled_bytes)
