"""Transformer block pieces: norm, attention (tensor-parallel projections around Ulysses), MLP.

Shapes: B batch, s local sequence length in the residual stream (S/sp, or S/(sp*tp) with TP
sequence sharding), S/sp the sequence inside the tensor-parallel region, h hidden, D head dim,
hq = Hq/tp and hk = Hkv/tp the tp-local head counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalysses import comm
from megalysses.comm import Group
from megalysses.config import ModelConfig
from megalysses.kernels.attention import core_attention
from megalysses.kernels.norms import add_rms_norm, layer_norm, rms_norm
from megalysses.kernels.rope import rope_qkv
from megalysses.kernels.swiglu import swiglu
from megalysses.model.kv_cache import LayerKV
from megalysses.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, column_parallel_input,
                                                 column_parallel_input_grad, mark_tp)
from megalysses.parallel.ring import ring_attention
from megalysses.parallel.ulysses import ulysses_attention


@dataclass
class ParallelGroups:
    """The groups a model stage needs (None = a group of one). Sequence parallelism is ulysses x ring."""

    tp: Group = None
    ulysses: Group = None
    ring: Group = None
    sequence_parallel: bool = False  # TP sequence sharding of the residual stream

    @property
    def tp_size(self) -> int:
        return comm.group_size(self.tp)

    @property
    def sp_size(self) -> int:
        return comm.group_size(self.ulysses) * comm.group_size(self.ring)


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim. With TP sequence sharding each tp rank normalises other
    tokens, so the weight's gradient is summed over tp (copy_to_tp on the weight). With model.layernorm_1p
    the parameter is the offset from 1 (zero-centred), the norm scaling by 1 + weight."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        self.kind, self.eps, self.impl, self.one_plus = cfg.norm, cfg.norm_eps, cfg.kernels, cfg.layernorm_1p
        self.tp, self.sequence_parallel = groups.tp, groups.sequence_parallel
        self.weight = mark_tp(nn.Parameter(torch.full((cfg.hidden_size,), 0.0 if self.one_plus else 1.0)), None)
        self.bias = mark_tp(nn.Parameter(torch.zeros(cfg.hidden_size)), None) if cfg.norm == "layernorm" else None

    def _params(self) -> tuple[Tensor, Optional[Tensor]]:
        weight, bias = self.weight, self.bias
        if self.one_plus:
            weight = weight + 1.0
        if self.sequence_parallel:
            weight = comm.copy_to_tp(weight, self.tp)
            bias = comm.copy_to_tp(bias, self.tp) if bias is not None else None
        return weight, bias

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self._params()
        if self.kind == "rmsnorm":
            return rms_norm(x, weight, self.eps, impl=self.impl)
        return layer_norm(x, weight, bias, self.eps)

    def add_forward(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, norm(x + delta)): the residual add fused with the norm (one kernel for RMSNorm)."""
        if self.kind != "rmsnorm":
            x = x + delta
            return x, self(x)
        weight, _ = self._params()
        return add_rms_norm(x, delta, weight, self.eps, impl=self.impl)


class HeadNorm(nn.Module):
    """RMSNorm over each head (model.qk_layernorm, Qwen3's q_norm and k_norm): one weight of head_dim for all
    the query (or key) heads. Each tp rank normalises its own heads, so the weight's gradient is summed over
    tp (copy_to_tp on the weight); over sp and dp the gradient reduction sums it as any weight's. With
    model.layernorm_1p the weight is the offset from 1, as Norm's."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        self.eps, self.impl, self.tp, self.one_plus = cfg.norm_eps, cfg.kernels, groups.tp, cfg.layernorm_1p
        self.weight = mark_tp(nn.Parameter(torch.full((cfg.head_size,), 0.0 if self.one_plus else 1.0)), None)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., D) -> (..., D)."""
        weight = self.weight + 1.0 if self.one_plus else self.weight
        return rms_norm(x, comm.copy_to_tp(weight, self.tp), self.eps, impl=self.impl)


class Attention(nn.Module):
    """Grouped-query self-attention: one column-parallel QKV projection, (q/k head norms,) RoPE, Ulysses
    around core attention (or around ring attention, with a ring), row-parallel output.

    The fused QKV weight ((Hq + 2 Hkv) * D, h) is grouped by KV head: for each KV head g, the rep = Hq/Hkv
    query heads that read it, then k_g, then v_g. Splitting its rows over tp therefore gives every rank
    whole groups (its own query heads with their KV heads), and the full tensor does not depend on tp.

    The heads can also run in N chunks of whole KV groups, one after the other (training.attention_head_chunks:
    model/policies.py applies it, model/tiled.py HeadChunks runs it), through `attend`, `chunk_weights`,
    `projection_input` and `reduce`: the chunk's rows of the QKV weight (contiguous, by the grouping above) and
    its columns of o_proj, whose partial outputs add up to the projection of all heads.

    The attention width num_heads x D need not be the hidden size (model.head_dim). With model.qk_layernorm each
    query and key head is RMS-normalised over D before RoPE, on the rank's own heads before the all-to-all, so
    the Ulysses ranks, the ring's blocks and the head chunks all receive normalised heads. With
    model.sliding_window every attention kernel masks keys that many positions or more behind the query."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        h, D, tp = cfg.hidden_size, cfg.head_size, groups.tp_size
        self.groups, self.head_dim, self.backend, self.impl = groups, D, cfg.attention_backend, cfg.kernels
        self.window = cfg.sliding_window
        self.hq, self.hk = cfg.num_heads // tp, cfg.kv_heads // tp
        self.rep = cfg.num_heads // cfg.kv_heads
        sp_ = groups.sequence_parallel
        self.qkv_proj = ColumnParallelLinear(h, (cfg.num_heads + 2 * cfg.kv_heads) * D, groups.tp, cfg.qkv_bias, sp_)
        self.o_proj = RowParallelLinear(cfg.num_heads * D, h, groups.tp, cfg.attention_bias, sp_)
        self.q_norm = HeadNorm(cfg, groups) if cfg.qk_layernorm else None
        self.k_norm = HeadNorm(cfg, groups) if cfg.qk_layernorm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Any, cache: Optional[LayerKV] = None) -> Tensor:
        qkv = self.qkv_proj(x)                                                   # (B, S/sp, hk*(rep+2)*D)
        return self.o_proj(self.attend(qkv, cos, sin, mask, cache))             # (B, s, h)

    def attend(self, qkv: Tensor, cos: Tensor, sin: Tensor, mask: Any, cache: Optional[LayerKV] = None) -> Tensor:
        """The projection of some whole KV groups (B, S/sp, g*(rep+2)*D) -> their attention output
        (B, S/sp, g*rep*D): the q/k head norms, RoPE, then Ulysses around core or ring attention (or the
        generation cache)."""
        B, s = qkv.shape[:2]
        qkv = qkv.view(B, s, -1, self.rep + 2, self.head_dim)                   # (B, S/sp, g, rep+2, D)
        if self.q_norm is not None:
            q, k, v = qkv.split([self.rep, 1, 1], dim=3)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=3)
        q, k, v = rope_qkv(qkv, cos, sin, impl=self.impl)                        # global positions
        # q (B, S/sp, g*rep, D), k, v (B, S/sp, g, D)
        ring, window = self.groups.ring, self.window
        if cache is not None:                                                    # generation, one process
            out = cache.attend(q, k, v, window)
        else:
            if comm.group_size(ring) > 1:       # the Ulysses group's tokens are one block of the ring
                def attn(q_: Tensor, k_: Tensor, v_: Tensor) -> Tensor:
                    return ring_attention(q_, k_, v_, ring, mask, self.backend, window=window)
            else:                               # the Ulysses group's tokens are the whole sequence
                def attn(q_: Tensor, k_: Tensor, v_: Tensor) -> Tensor:
                    return core_attention(q_, k_, v_, mask=mask, backend=self.backend, window=window)
            out = ulysses_attention(q, k, v, self.groups.ulysses, attn)
        return out.reshape(B, s, -1)

    def check_head_chunks(self, chunks: int) -> None:
        """ValueError unless `chunks` splits this rank's KV heads into whole KV groups."""
        if chunks < 1 or self.hk % chunks:
            raise ValueError(f"Attention: {chunks} head chunks do not split the {self.hk} KV heads of a tp rank "
                             f"into whole KV groups (config.checks.check_head_chunks names the valid counts)")

    def chunk_slices(self, c: int, chunks: int) -> tuple[slice, slice]:
        """Head chunk c of `chunks`: its rows of the QKV weight (and bias) and its columns of o_proj's weight."""
        rows = self.qkv_proj.weight.shape[0] // chunks
        cols = self.o_proj.weight.shape[1] // chunks
        return slice(c * rows, (c + 1) * rows), slice(c * cols, (c + 1) * cols)

    def chunk_weights(self, c: int, chunks: int) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """Head chunk c of `chunks`: its QKV weight (and bias) and o_proj weight (views)."""
        rows, cols = self.chunk_slices(c, chunks)
        bias = self.qkv_proj.bias
        return self.qkv_proj.weight[rows], None if bias is None else bias[rows], self.o_proj.weight[:, cols]

    def head_norms(self) -> list[Tensor]:
        """The q and k head norms' weights (none without model.qk_layernorm)."""
        return [] if self.q_norm is None else [self.q_norm.weight, self.k_norm.weight]

    def projection_input(self, y: Tensor) -> Tensor:
        """What the QKV projection reads of its input y (B, s, h): (B, S/sp, h), all-gathered over tp under
        TP sequence sharding."""
        return column_parallel_input(y, self.groups.tp, self.groups.sequence_parallel)

    def projection_input_grad(self, dy: Tensor) -> Tensor:
        """projection_input's backward, for a caller that computes the gradient of what it read (B, S/sp, h)."""
        return column_parallel_input_grad(dy, self.groups.tp, self.groups.sequence_parallel)   # (B, s, h)

    def reduce(self, partial: Tensor) -> Tensor:
        """o_proj's partial output summed over some heads' chunks (B, S/sp, h) -> the layer's output (B, s, h):
        tp-reduced, o_proj's bias added once."""
        return self.o_proj.reduce(partial)


class MLP(nn.Module):
    """SwiGLU (down(silu(gate(x)) * up(x))) or GELU (down(gelu(up(x)))), tensor-parallel.

    SwiGLU's gate and up projections are one weight (2f, h) with their rows interleaved (row 2i is gate
    row i, row 2i+1 is up row i), so any split of its rows over tp keeps matching gate/up pairs."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        h, f, sp_ = cfg.hidden_size, cfg.ffn_size, groups.sequence_parallel
        self.kind, self.impl = cfg.mlp, cfg.kernels
        if cfg.mlp == "swiglu":
            self.gate_up_proj = ColumnParallelLinear(h, 2 * f, groups.tp, cfg.mlp_bias, sp_)
        else:
            self.up_proj = ColumnParallelLinear(h, f, groups.tp, cfg.mlp_bias, sp_)
        self.down_proj = RowParallelLinear(f, h, groups.tp, cfg.mlp_bias, sp_)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "swiglu":
            inner = swiglu(self.gate_up_proj(x), impl=self.impl)         # (B, S/sp, f/tp)
        else:
            inner = F.gelu(self.up_proj(x), approximate="tanh")
        return self.down_proj(inner)                                   # (B, s, h)


class AttentionHalf:
    """How a Block runs its attention half: attn(attn_norm(x)), (B, s, h). model/policies.py puts others in its
    place (head chunks); a plain model runs this one."""

    def run(self, block: "Block", x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Any],
            cache: Optional[LayerKV] = None) -> Tensor:
        return block.attn(block.attn_norm(x), cos, sin, mask, cache)


class MLPHalf:
    """How a Block runs its MLP half: h + mlp(mlp_norm(h)) for h = x + a, the residual add fused with the norm
    (the attention output is not held while the MLP runs). model/policies.py puts others in its place (tiles);
    a plain model runs this one."""

    def run(self, block: "Block", x: Tensor, a: Tensor) -> Tensor:
        x, normed = block.mlp_norm.add_forward(x, a)
        del a                                          # the attention output is not held while the MLP runs
        return x + block.mlp(normed)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)).

    Each half runs through a plain object (AttentionHalf, MLPHalf) that the activation policy may replace
    (model/policies.py: head chunks, MLP tiles); the modules, and so the parameter names, stay."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        self.attn_norm = Norm(cfg, groups)
        self.attn = Attention(cfg, groups)
        self.mlp_norm = Norm(cfg, groups)
        self.mlp = MLP(cfg, groups)
        self.attention_half, self.mlp_half = AttentionHalf(), MLPHalf()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Any],
                cache: Optional[LayerKV] = None) -> Tensor:
        # the attention output (B, s, h) goes straight into the MLP half, whose method call holds the only
        # reference to it (a local here, or a callable object's __call__, would keep it alive through the MLP)
        return self.mlp_half.run(self, x, self.attention_half.run(self, x, cos, sin, mask, cache))
