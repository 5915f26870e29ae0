"""Conversion between Hugging Face `LlamaForCausalLM` and megalysses (full, unsharded state dicts).

    cfg = model_config_from_hf(hf_model.config)
    ours = GPTStage(cfg); ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg))
    hf_sd = to_hf_state_dict(ours.state_dict(), cfg)

Norms, o_proj and down_proj map one to one; embeddings and the LM head gain zero rows up to our padded
vocabulary (model.vocab_pad_multiple) and lose them on the way back. Our fused projections are assembled from
Hugging Face's separate ones without changing any value: `attn.qkv_proj` stacks, for each KV head g,
the query heads that read it, then k_g, then v_g; `mlp.gate_up_proj` interleaves the rows of
gate_proj and up_proj. Our rotary embedding uses the same rotate-half convention as transformers'
Llama, so no head is permuted.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megalysses.config import ModelConfig

_ONE_TO_ONE = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, kv_heads: int) -> Tensor:
    """Separate q (Hq*D, ...), k, v (Hkv*D, ...) weights or biases -> the fused ((Hq + 2 Hkv) * D, ...),
    grouped by KV head: [q heads of group g, k_g, v_g] for g = 0 .. Hkv-1."""
    rest = tuple(q.shape[1:])
    D = k.shape[0] // kv_heads
    groups = [q.reshape(kv_heads, -1, D, *rest), k.reshape(kv_heads, 1, D, *rest), v.reshape(kv_heads, 1, D, *rest)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def unfuse_qkv(qkv: Tensor, num_heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of fuse_qkv: q (Hq*D, ...), k, v (Hkv*D, ...)."""
    rest = tuple(qkv.shape[1:])
    rep = num_heads // kv_heads
    g = qkv.reshape(kv_heads, rep + 2, -1, *rest)                       # (Hkv, rep + 2, D, ...)
    D = g.shape[2]
    return (g[:, :rep].reshape(num_heads * D, *rest).contiguous(), g[:, rep].reshape(kv_heads * D, *rest).contiguous(),
            g[:, rep + 1].reshape(kv_heads * D, *rest).contiguous())


def interleave_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up (f, ...) -> (2f, ...) with row 2i = gate row i, row 2i + 1 = up row i."""
    return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])


def split_gate_up(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of interleave_gate_up."""
    pairs = gate_up.reshape(-1, 2, *gate_up.shape[1:])
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """t (V, h) with zero rows appended up to `rows` (our padded vocabulary)."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _hf_rope_theta(hf_config: Any) -> float:
    rope_theta = getattr(hf_config, "rope_theta", None)
    if rope_theta is None:  # newer transformers keep it in rope_parameters
        rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(rope_theta)


def model_config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig with the same architecture as a transformers LlamaConfig."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU (SwiGLU) Llama models convert; this one uses {hf_config.hidden_act}")
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope scaling {scaling} is not supported: convert a model with plain RoPE")
    fields = dict(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size, rope_theta=_hf_rope_theta(hf_config), norm="rmsnorm",
        norm_eps=hf_config.rms_norm_eps, mlp="swiglu", tie_embeddings=bool(hf_config.tie_word_embeddings),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim != hf_config.hidden_size // hf_config.num_attention_heads:
        raise ValueError(f"head_dim={head_dim} differs from hidden_size/num_heads: not supported")
    fields.update(overrides)
    return ModelConfig(**fields)


def _hf_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name of the Hugging Face model (lm_head only when untied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    kinds = ["weight"] + (["bias"] if cfg.attention_bias else [])
    mlp_kinds = ["weight"] + (["bias"] if cfg.mlp_bias else [])
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        names += [pre + hf for hf in _ONE_TO_ONE if hf.endswith("layernorm.weight")]
        names += [f"{pre}self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj", "o_proj") for kind in kinds]
        names += [f"{pre}mlp.{p}.{kind}" for p in ("gate_proj", "up_proj", "down_proj") for kind in mlp_kinds]
    return names


def from_hf_state_dict(hf_sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A Hugging Face Llama state dict -> ours (full tensors)."""
    expected = _hf_names(cfg)
    missing = [k for k in expected if k not in hf_sd]
    if missing:
        raise KeyError(f"the Hugging Face state dict lacks {len(missing)} tensors, e.g. {missing[:3]}")
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unknown = [k for k in hf_sd if k not in set(expected) and k not in ignored and "rotary_emb" not in k]
    if unknown:
        raise KeyError(f"unexpected Hugging Face tensors {unknown[:3]}: the model is not a plain Llama")
    out = {"embed.weight": _pad_rows(hf_sd["model.embed_tokens.weight"], cfg.padded_vocab_size()),
           "final_norm.weight": hf_sd["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _pad_rows(hf_sd["lm_head.weight"], cfg.padded_vocab_size())
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for a, b in _ONE_TO_ONE.items():
            out[ours + b] = hf_sd[hf + a]
        attn = hf + "self_attn."
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            out[f"{ours}attn.qkv_proj.{kind}"] = fuse_qkv(hf_sd[f"{attn}q_proj.{kind}"], hf_sd[f"{attn}k_proj.{kind}"],
                                                          hf_sd[f"{attn}v_proj.{kind}"], cfg.kv_heads)
        if cfg.attention_bias:
            out[f"{ours}attn.o_proj.bias"] = hf_sd[f"{attn}o_proj.bias"]
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            out[f"{ours}mlp.gate_up_proj.{kind}"] = interleave_gate_up(hf_sd[f"{hf}mlp.gate_proj.{kind}"],
                                                                       hf_sd[f"{hf}mlp.up_proj.{kind}"])
        if cfg.mlp_bias:
            out[f"{ours}mlp.down_proj.bias"] = hf_sd[f"{hf}mlp.down_proj.bias"]
    return out


def to_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Ours (full tensors) -> a Hugging Face Llama state dict."""
    V = cfg.vocab_size
    out = {"model.embed_tokens.weight": sd["embed.weight"][:V], "model.norm.weight": sd["final_norm.weight"],
           "lm_head.weight": (sd["embed.weight"] if cfg.tie_embeddings else sd["lm_head.weight"])[:V]}
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for a, b in _ONE_TO_ONE.items():
            out[hf + a] = sd[ours + b]
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            q, k, v = unfuse_qkv(sd[f"{ours}attn.qkv_proj.{kind}"], cfg.num_heads, cfg.kv_heads)
            out.update({f"{hf}self_attn.q_proj.{kind}": q, f"{hf}self_attn.k_proj.{kind}": k,
                        f"{hf}self_attn.v_proj.{kind}": v})
        if cfg.attention_bias:
            out[f"{hf}self_attn.o_proj.bias"] = sd[f"{ours}attn.o_proj.bias"]
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            gate, up = split_gate_up(sd[f"{ours}mlp.gate_up_proj.{kind}"])
            out.update({f"{hf}mlp.gate_proj.{kind}": gate, f"{hf}mlp.up_proj.{kind}": up})
        if cfg.mlp_bias:
            out[f"{hf}mlp.down_proj.bias"] = sd[f"{ours}mlp.down_proj.bias"]
    return out
