"""The GPT model (Llama architecture; Qwen2/2.5, Qwen3 and Mistral by their settings) as pipeline stages.

A `GPTStage` holds a contiguous range of blocks under their GLOBAL layer index (`layers.7...`), plus
the embedding on the first stage and the final norm + LM head (+ loss) on the last. With pp=1 one
stage is the whole model. Parameter names therefore do not depend on the layout, and the
initialisation (seeded by name, full tensor, then sliced over tp) gives the same full model at
every (tp, sp, pp).

    model = GPTStage(cfg.model, groups)                     # whole model, this rank's tp shards
    apply_activation_policy(model, plan.activation)         # model/policies.py: checkpointing, offload, tiles
    loss_sum = model(input_ids, position_ids, doc_ids=doc_ids, labels=labels)   # sum over local tokens

The model is plain: its forward computes the architecture and its parallel layers (tp, Ulysses, the ring)
and nothing else. What the backward keeps and where (checkpointing, offload, head chunks, tiles) is applied
afterwards by model/policies.py, which puts other runners in place of the plain ones (RunBlocks here, a
Block's halves) and leaves the modules, and so the parameter names, as they are.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Optional

import torch
from torch import Tensor, nn

from megalysses import comm
from megalysses.config import ModelConfig
from megalysses.kernels.attention import Documents
from megalysses.kernels.rope import rope_cos_sin
from megalysses.model.kv_cache import KVCache
from megalysses.model.layers import Block, Norm, ParallelGroups
from megalysses.kernels.linear_cross_entropy import linear_cross_entropy, token_scores
from megalysses.parallel.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, column_parallel_linear
from megalysses.parallel.ulysses import prepare_sequence_mask
from megalysses.plan.types import ActivationPolicy


def architecture(m: ModelConfig, tp: int = 1) -> dict:
    """What the model's tensors depend on, as checkpoints record it (padded_vocab_size at this tp: the
    same for every tp that divides model.vocab_pad_multiple)."""
    return {"vocab_size": m.vocab_size, "padded_vocab_size": m.padded_vocab_size(tp), "hidden_size": m.hidden_size,
            "num_layers": m.num_layers, "num_heads": m.num_heads, "num_kv_heads": m.kv_heads, "ffn_size": m.ffn_size,
            "mlp": m.mlp, "norm": m.norm, "tie_embeddings": m.tie_embeddings, "attention_bias": m.attention_bias,
            "mlp_bias": m.mlp_bias, **({"layernorm_1p": True} if m.layernorm_1p else {}),
            **({"head_dim": m.head_size} if m.head_size * m.num_heads != m.hidden_size else {}),
            **({"add_qkv_bias": True} if m.add_qkv_bias and not m.attention_bias else {}),
            **({"qk_layernorm": True} if m.qk_layernorm else {})}


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the blocks on pipeline stage `pp_rank` (equal split)."""
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


class RunBlocks:
    """How a stage runs its blocks: each in turn, keeping what autograd keeps (with a KV cache, each block its
    layer's). model/policies.py puts others in its place (checkpointing, offload); a plain stage runs this."""

    def run(self, stage: "GPTStage", x: Tensor, cos: Tensor, sin: Tensor, mask: Any,
            cache: Optional[KVCache] = None) -> Tensor:
        for index, block in stage.layers.items():
            x = block(x, cos, sin, mask, cache.layer(int(index)) if cache is not None else None)
        return x


class GPTStage(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: Optional[ParallelGroups] = None,
                 layers: Optional[range] = None, first: bool = True, last: bool = True) -> None:
        """`cfg` names concrete kernels and attention (the run's plan: training.runtime.model_config). The
        stage is plain: every activation kept on the device, until model/policies.py applies a policy."""
        super().__init__()
        groups = groups or ParallelGroups()
        self.cfg, self.groups = cfg, groups
        self.first, self.last = first, last
        self.run_blocks = RunBlocks()
        self.loss_tile = 0                          # the LM head + loss tile (0: the kernel's own default)
        self.mask_block = ActivationPolicy().mask_block
        layers = range(cfg.num_layers) if layers is None else layers
        sp_ = groups.sequence_parallel
        self.vocab_padded = cfg.padded_vocab_size(groups.tp_size)
        if first or (last and cfg.tie_embeddings):
            # on a last stage without the first, this copy is the tied LM head (grads synced over `embed`)
            self.embed = VocabParallelEmbedding(self.vocab_padded, cfg.hidden_size, groups.tp, sp_)
        self.layers = nn.ModuleDict({str(i): Block(cfg, groups) for i in layers})
        if last:
            self.final_norm = Norm(cfg, groups)
            if not cfg.tie_embeddings:
                self.lm_head = ColumnParallelLinear(cfg.hidden_size, self.vocab_padded, groups.tp, False, sp_)

    @property
    def vocab_start(self) -> int:
        """First vocabulary row of this tp rank's shard of the (padded) embedding / LM head."""
        return comm.group_rank(self.groups.tp) * self.vocab_padded // self.groups.tp_size

    def forward(self, inputs: Tensor, position_ids: Tensor, doc_ids: Optional[Tensor | Documents] = None,
                labels: Optional[Tensor] = None, cache: Optional[KVCache] = None,
                loss_weights: Optional[Tensor] = None, scores: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """inputs: token ids (B, S/sp) on the first stage, else the hidden states from the previous stage.
        position_ids: (B, S/sp) global positions of this sp rank's tokens (SequenceLayout.positions);
        doc_ids: (B, S) full-sequence document index for packed-document masks (None = plain causal), or the
        data loader's Documents of them (kernels/attention.py: their boundaries, computed on the host).

        Returns the hidden states (B, s, h) on a non-last stage; on the last, the local sum of token
        losses (fp32 scalar) when labels are given (each times its loss_weights, when given; with `scores`, per
        token: each label's loss and whether it is the argmax, kernels/linear_cross_entropy.token_scores, (B, S/sp)
        each), else this rank's logits (B, S/sp, V/tp) over the padded vocabulary (padding columns -inf). With a
        KV cache (generation, one process), inputs are the next tokens after those already cached."""
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_size, self.cfg.rope_theta,
                                scaling=self.cfg.rope_scaling)                  # (B, S/sp, D), once
        mask = prepare_sequence_mask(doc_ids, self.cfg.attention_backend, self.groups.ulysses, self.groups.ring,
                                     position_ids.shape[1], self.cfg.sliding_window,
                                     self.mask_block)                                 # once per step
        # the first block's input (B, s, h) goes straight to the runner, which lets it go after that block (so
        # activation offload can take it off the device): no local here holds it
        x = self.run_blocks.run(self, self.embed(inputs) if self.first else inputs, cos, sin, mask, cache)
        if cache is not None:
            cache.advance(x.shape[1])
        if not self.last:
            return x
        x = self.final_norm(x)
        head = self.embed.weight if self.cfg.tie_embeddings else self.lm_head.weight
        if labels is None:
            logits = column_parallel_linear(x, head, None, self.groups.tp, self.groups.sequence_parallel)
            padding = self.cfg.vocab_size - self.vocab_start
            if padding < logits.shape[-1]:
                logits[..., max(padding, 0):] = float("-inf")
            return logits                                                              # (B, S/sp, V/tp)
        if self.groups.sequence_parallel:
            x = comm.all_gather_from_tp(x, self.groups.tp, dim=1)                    # (B, S/sp, h)
        else:
            x = comm.copy_to_tp(x, self.groups.tp)
        if scores:
            return token_scores(x, head, labels, self.groups.tp, self.vocab_start, self.cfg.vocab_size,
                                self.loss_tile)
        return linear_cross_entropy(x, head, labels, self.groups.tp, self.vocab_start, self.cfg.vocab_size,
                                    self.loss_tile, loss_weights)


def _init_kind(name: str, cfg: ModelConfig) -> tuple[str, float]:
    if name.endswith("bias") or "norm" in name:     # norm weights start at 1 (with layernorm_1p, their offset at 0)
        return ("ones", 0.0) if name.endswith("norm.weight") and not cfg.layernorm_1p else ("zeros", 0.0)
    std = cfg.init_std
    if cfg.scaled_residual_init and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
        std /= math.sqrt(2 * cfg.num_layers)
    return "normal", std


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Initialise every parameter as the tp shard of a full tensor drawn from a generator seeded by
    (seed, parameter name): the same seed gives the same full model at every layout."""
    cfg: ModelConfig = model.cfg
    for name, p in model.named_parameters():
        kind, std = _init_kind(name, cfg)
        tp_dim = getattr(p, "tp_dim", None)
        full_shape = list(p.shape)
        if tp_dim is not None:
            full_shape[tp_dim] *= tp_size
        if kind == "normal":
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            full = torch.randn(full_shape, generator=g, device="cpu") * std   # the same numbers on any device
        else:
            full = torch.full(full_shape, 1.0 if kind == "ones" else 0.0, device="cpu")
        if tp_dim is not None:
            full = full.chunk(tp_size, dim=tp_dim)[tp_rank]
        p.copy_(full)
