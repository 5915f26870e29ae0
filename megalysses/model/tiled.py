"""A block's two halves over pieces, each keeping one (tokens x hidden) tensor for its backward.

    acc = HeadChunks.apply(HeadChunking(attn, norm, chunks), x, cos, sin, mask, *attention_params(attn, norm))
    out = MLPTiles.apply(block, h, tile, *mlp_params(block))    # h + mlp(mlp_norm(h)), tile by tile

HeadChunks keeps only the block input x; acc is the sum over head chunks of o_proj(attn(norm(x))). Its
forward computes the norm once, then each chunk of heads (the chunk's QKV rows, RoPE, the all-to-alls,
attention, the chunk's o_proj columns) adds its partial output into one sum. Its backward recomputes the
norm, runs each chunk again under autograd (the chunk's weights as leaves of their own, o_proj's part by
hand) and adds the chunk's QKV gradient into one gradient of the norm output, in place (dy += dqkv_c W_c).
The norm's backward then runs over row tiles into that same buffer, so the attention half holds x, the
norm output, its gradient and one chunk's tensors at most.

Both return their parameters' gradients from the backward, so autograd accumulates each once per
backward, as it does for any parameter (the data-parallel hooks count on it).

MLPTiles keeps only its input h (the residual after attention). Each tile runs the MLP norm and the MLP;
its backward recomputes a tile under autograd and writes the tile's rows of h's gradient, the residual's
included, so neither the norm output nor a full-length gradient per tile ever exists.

Both run their pieces in order and sum in the same order on every rank; with tensor parallelism every tp
rank has the same pieces, so the collectives inside pair up piece by piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalysses.kernels.norms import norm_tile_rows, tiled_backward


@dataclass(frozen=True, eq=False)
class HeadChunking:
    """What HeadChunks runs: a layer's Attention, its input norm, and the number of groups of heads."""

    attn: nn.Module
    norm: nn.Module
    chunks: int


class HeadChunks(torch.autograd.Function):
    """The attention half's o_proj partial sum over head chunks (before the tp reduction and o_proj's bias),
    keeping only x; `heads` holds the layer's Attention, its input norm and how many groups of heads (whole KV
    groups: Attention.check_head_chunks), `params` theirs (attention_params), whose gradients the backward
    returns (each reaches its .grad once per backward, as autograd's own)."""

    @staticmethod
    def forward(ctx, heads: HeadChunking, x: Tensor, cos: Tensor, sin: Tensor, mask: Any, *params: Tensor) -> Tensor:
        ctx.heads, ctx.mask = heads, mask
        ctx.save_for_backward(x, cos, sin)
        return chunks_forward(heads.attn, heads.norm, heads.chunks, x, cos, sin, mask)

    @staticmethod
    def backward(ctx, d_acc: Tensor):
        x, cos, sin = ctx.saved_tensors
        heads = ctx.heads
        dx, grads = chunks_backward(heads.attn, heads.norm, heads.chunks, x, cos, sin, ctx.mask, d_acc)
        return (None, dx, None, None, None, *grads)


def attention_params(attn: nn.Module, norm: nn.Module) -> list[Tensor]:
    """HeadChunks' parameters: the QKV weight (and bias), o_proj's weight, the q and k head norms' (with
    model.qk_layernorm), the norm's."""
    qkv = [p for p in (attn.qkv_proj.weight, attn.qkv_proj.bias) if p is not None]
    return qkv + [attn.o_proj.weight] + attn.head_norms() + list(norm.parameters())


def chunks_forward(attn: nn.Module, norm: nn.Module, chunks: int, x: Tensor, cos: Tensor, sin: Tensor,
                   mask: Any) -> Tensor:
    """sum_c o_proj_c(attend(qkv_c(norm(x)))) (B, S/sp, h), no autograd graph."""
    with torch.no_grad():
        y = attn.projection_input(norm(x))                                             # (B, S/sp, h)
        acc = None
        for c in range(chunks):
            qkv_w, qkv_b, o_w = attn.chunk_weights(c, chunks)
            o = attn.attend(F.linear(y, qkv_w, qkv_b), cos, sin, mask)                 # (B, S/sp, q/N)
            if acc is None:
                acc = F.linear(o, o_w)
            else:
                acc.view(-1, acc.shape[-1]).addmm_(o.reshape(-1, o.shape[-1]), o_w.t())
        return acc


def chunks_backward(attn: nn.Module, norm: nn.Module, chunks: int, x: Tensor, cos: Tensor, sin: Tensor, mask: Any,
                    d_acc: Tensor) -> tuple[Tensor, list[Tensor]]:
    """(x's gradient, the gradients of attention_params). Each chunk's weights are leaves of their own, so
    its gradients are the chunk's rows (columns) alone, written into one gradient per weight; the head norms,
    which every chunk uses whole, sum theirs over the chunks in fp32."""
    with torch.no_grad():
        y = attn.projection_input(norm(x))
    dy = torch.zeros(y.shape, dtype=y.dtype, device=y.device)
    dy2 = dy.view(-1, dy.shape[-1])
    bias = attn.qkv_proj.bias
    d_qkv_w, d_o_w = torch.zeros_like(attn.qkv_proj.weight), torch.zeros_like(attn.o_proj.weight)
    d_qkv_b = torch.zeros_like(bias) if bias is not None else None
    d_acc2 = d_acc.reshape(-1, d_acc.shape[-1])
    head_norms = attn.head_norms()
    d_head_norms = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in head_norms]
    for c in range(chunks):
        rows, cols = attn.chunk_slices(c, chunks)
        qkv_w, qkv_b, o_w = attn.chunk_weights(c, chunks)
        with torch.enable_grad():
            qkv_w, qkv_b = qkv_w.detach().requires_grad_(), None if qkv_b is None else qkv_b.detach().requires_grad_()
            qkv = F.linear(y, qkv_w, qkv_b)                                            # y: no graph

            def into_dy(g: Tensor, w: Tensor = qkv_w) -> None:
                dy2.addmm_(g.reshape(-1, g.shape[-1]), w.detach())

            qkv.register_hook(into_dy)
            o = attn.attend(qkv, cos, sin, mask)                                     # (B, S/sp, q/N)
        # o_proj's part by hand, so that the chunk's (B, S/sp, h) output is never made again
        o2 = o.detach().reshape(-1, o.shape[-1])
        d_o_w[:, cols] = d_acc2.t() @ o2
        d_o = (d_acc2 @ o_w).view(o.shape)
        grads = list(torch.autograd.grad(o, [qkv_w] + ([qkv_b] if qkv_b is not None else []) + head_norms, d_o))
        d_qkv_w[rows] = grads.pop(0)
        if qkv_b is not None:
            d_qkv_b[rows] = grads.pop(0)
        for total, g in zip(d_head_norms, grads):
            total += g
        del qkv, o, o2, d_o, grads
    del y
    dy = attn.projection_input_grad(dy)                                                 # (B, s, h)
    dx, d_norm = norm_backward_into(norm, x, dy)
    d_head_norms = [total.to(p.dtype) for total, p in zip(d_head_norms, head_norms)]
    return dx, [g for g in (d_qkv_w, d_qkv_b) if g is not None] + [d_o_w] + d_head_norms + d_norm


def norm_backward_into(norm: nn.Module, x: Tensor, dy: Tensor) -> tuple[Tensor, list[Tensor]]:
    """(x's gradient through norm, written over dy, and the norm parameters' gradients), over row tiles (the
    parameters' summed in fp32)."""
    dy = dy.contiguous()
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.view(-1, dy.shape[-1])
    params = list(norm.parameters())
    sums = tiled_backward(norm, norm_tile_rows(x.shape[-1]), x2, dy2, params, dy2)
    return dy, [total.to(p.dtype) for total, p in zip(sums, params)]


def mlp_params(block: nn.Module) -> list[Tensor]:
    """MLPTiles' parameters: the MLP norm's and the MLP's."""
    return list(block.mlp_norm.parameters()) + list(block.mlp.parameters())


class MLPTiles(torch.autograd.Function):
    """h + mlp(mlp_norm(h)) over sequence tiles of `tile` tokens, keeping only h; `block` has mlp_norm and
    mlp, `params` are theirs (mlp_params), whose gradients are summed over the tiles in fp32."""

    @staticmethod
    def forward(ctx, block: nn.Module, h: Tensor, tile: int, *params: Tensor) -> Tensor:
        ctx.block, ctx.tile = block, tile
        ctx.save_for_backward(h)
        out = torch.empty_like(h)
        for lo in range(0, h.shape[1], tile):
            ht = h[:, lo:lo + tile]
            out[:, lo:lo + tile] = ht + block.mlp(block.mlp_norm(ht))
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        (h,) = ctx.saved_tensors
        block, tile = ctx.block, ctx.tile
        params = mlp_params(block)
        sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        dh = torch.empty_like(h)
        for lo in range(0, h.shape[1], tile):
            with torch.enable_grad():
                ht = h[:, lo:lo + tile].detach().requires_grad_()
                o = block.mlp(block.mlp_norm(ht))
            g = dout[:, lo:lo + tile]
            dht, *grads = torch.autograd.grad(o, [ht] + params, g)
            dh[:, lo:lo + tile] = g + dht
            for total, gp in zip(sums, grads):
                total += gp
            del o, dht, grads
        return (None, dh, None, *(total.to(p.dtype) for total, p in zip(sums, params)))
