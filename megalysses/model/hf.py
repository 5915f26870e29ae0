"""Conversion between Hugging Face `LlamaForCausalLM` and megalysses (full, unsharded state dicts).

    cfg = model_config_from_hf(hf_model.config)
    ours = GPTStage(cfg); ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg))
    hf_sd = to_hf_state_dict(ours.state_dict(), cfg)

The names map one to one and no tensor is permuted: our rotary embedding uses the same
rotate-half convention as transformers' Llama.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from megalysses.config import ModelConfig

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _name_map(cfg: ModelConfig) -> dict[str, str]:
    """HF name -> our name for every tensor of the model."""
    names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.num_layers):
        for hf, ours in _LAYER.items():
            names[f"model.layers.{i}.{hf}"] = f"layers.{i}.{ours}"
        if cfg.bias:
            for hf in _BIASES:
                ours = _LAYER[hf + ".weight"].removesuffix(".weight")
                names[f"model.layers.{i}.{hf}.bias"] = f"layers.{i}.{ours}.bias"
    return names


def model_config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig with the same architecture as a transformers LlamaConfig."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU (SwiGLU) Llama models convert; this one uses {hf_config.hidden_act}")
    rope_theta = getattr(hf_config, "rope_theta", None)
    if rope_theta is None:  # newer transformers keep it in rope_parameters
        rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope scaling {scaling} is not supported: convert a model with plain RoPE")
    fields = dict(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size, rope_theta=float(rope_theta), norm="rmsnorm",
        norm_eps=hf_config.rms_norm_eps, mlp="swiglu", tie_embeddings=bool(hf_config.tie_word_embeddings),
        bias=bool(getattr(hf_config, "attention_bias", False)))
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim != hf_config.hidden_size // hf_config.num_attention_heads:
        raise ValueError(f"head_dim={head_dim} differs from hidden_size/num_heads: not supported")
    fields.update(overrides)
    return ModelConfig(**fields)


def from_hf_state_dict(hf_sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    names = _name_map(cfg)
    missing = [k for k in names if k not in hf_sd]
    if missing:
        raise KeyError(f"the Hugging Face state dict lacks {len(missing)} tensors, e.g. {missing[:3]}")
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unknown = [k for k in hf_sd if k not in names and k not in ignored and "rotary_emb" not in k]
    if unknown:
        raise KeyError(f"unexpected Hugging Face tensors {unknown[:3]}: the model is not a plain Llama")
    return {ours: hf_sd[hf] for hf, ours in names.items()}


def to_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    out = {hf: sd[ours] for hf, ours in _name_map(cfg).items()}
    if cfg.tie_embeddings:
        out["lm_head.weight"] = sd["embed.weight"]
    return out
