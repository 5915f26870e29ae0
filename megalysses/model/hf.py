"""Conversion between Hugging Face `LlamaForCausalLM` and megalysses, tensor by tensor.

    cfg = model_config_from_hf(hf_model.config)             # or the dict of a config.json
    ours = GPTStage(cfg); ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg))
    hf_sd = to_hf_state_dict(ours.state_dict(), cfg)
    config_json = hf_config_dict(cfg, "bfloat16", max_positions=8192, eos_token_id=2)

Norms, o_proj and down_proj map one to one; embeddings and the LM head gain zero rows up to our padded
vocabulary (model.vocab_pad_multiple) and lose them on the way back. Our fused projections are
assembled from Hugging Face's separate ones without changing any value: `attn.qkv_proj` stacks, for
each KV head g, the query heads that read it, then k_g, then v_g; `mlp.gate_up_proj` interleaves the
rows of gate_proj and up_proj. Our rotary embedding uses the same rotate-half convention as
transformers' Llama, so no head is permuted. Biases follow attention_bias and mlp_bias separately;
RoPE scaling of type llama3 is read from `rope_scaling` or (transformers 5) `rope_parameters`.
`our_tensor` / `hf_tensors` convert one parameter at a time, so a loader never needs the whole model.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from megalysses.config import ModelConfig, RopeScalingConfig

_ONE_TO_ONE = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.o_proj.bias": "attn.o_proj.bias",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.down_proj.bias": "mlp.down_proj.bias",
}
_OURS_TO_HF = {v: k for k, v in _ONE_TO_ONE.items()}


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


# ----------------------------------------------------------------------------- configs

def _field(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def _rope(hf_config: Any) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, scaling) from rope_theta + rope_scaling (transformers 4) or rope_parameters (5)."""
    params = _field(hf_config, "rope_parameters") or {}
    scaling = _field(hf_config, "rope_scaling") or {}
    theta = _field(hf_config, "rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    spec = scaling or params
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), RopeScalingConfig()
    if kind != "llama3":
        raise ValueError(f"RoPE scaling of type {kind!r} is not supported (plain RoPE and 'llama3' are)")
    return float(theta), RopeScalingConfig(
        type="llama3", factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]))


def model_config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig with the same architecture as a transformers LlamaConfig (object or config.json dict)."""
    model_type = _field(hf_config, "model_type", "llama")
    if model_type not in ("llama", None):
        raise ValueError(f"only Llama models convert; this one is model_type={model_type!r}")
    act = _field(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only SiLU (SwiGLU) Llama models convert; this one uses {act}")
    heads, hidden = _field(hf_config, "num_attention_heads"), _field(hf_config, "hidden_size")
    head_dim = _field(hf_config, "head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise ValueError(f"head_dim={head_dim} differs from hidden_size/num_heads = {hidden // heads}: not supported")
    theta, scaling = _rope(hf_config)
    fields = dict(
        vocab_size=_field(hf_config, "vocab_size"), hidden_size=hidden,
        num_layers=_field(hf_config, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=_field(hf_config, "num_key_value_heads") or heads,
        ffn_hidden_size=_field(hf_config, "intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        norm="rmsnorm", norm_eps=float(_field(hf_config, "rms_norm_eps", 1e-6)), mlp="swiglu",
        tie_embeddings=bool(_field(hf_config, "tie_word_embeddings", False)),
        attention_bias=bool(_field(hf_config, "attention_bias", False)),
        mlp_bias=bool(_field(hf_config, "mlp_bias", False)))
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config_dict(cfg: ModelConfig, dtype: str, max_positions: int, eos_token_id: Any = None,
                   bos_token_id: Any = None) -> dict:
    """The config.json of a LlamaForCausalLM with cfg's architecture (read by transformers 4 and 5).
    max_positions is the context it declares (what serving stacks limit prompts to); the special token
    ids are an int (a list for several EOS) or None, written as null: a missing key would read as
    transformers' defaults, BOS 1 and EOS 2."""
    if cfg.mlp != "swiglu" or cfg.norm != "rmsnorm":
        raise ValueError(f"only SwiGLU + RMSNorm models export to Llama; this one has mlp={cfg.mlp}, norm={cfg.norm}")
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
           "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
           "max_position_embeddings": max_positions, "torch_dtype": dtype}
    out.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id)     # null, not transformers' defaults 1 and 2
    rs = cfg.rope_scaling
    if rs.type == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                               "high_freq_factor": rs.high_freq_factor,
                               "original_max_position_embeddings": rs.original_max_position_embeddings}
    return out


# ----------------------------------------------------------------------------- tensors

def our_names(cfg: ModelConfig) -> list[str]:
    """Every parameter name of the whole model (pp=1)."""
    names = ["embed.weight", "final_norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    attn = ["weight", "bias"] if cfg.attention_bias else ["weight"]
    mlp = ["weight", "bias"] if cfg.mlp_bias else ["weight"]
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        names += [pre + "attn_norm.weight", pre + "mlp_norm.weight"]
        names += [f"{pre}attn.{p}.{k}" for p in ("qkv_proj", "o_proj") for k in attn]
        names += [f"{pre}mlp.{p}.{k}" for p in ("gate_up_proj", "down_proj") for k in mlp]
    return names


def hf_sources(name: str, cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensors that our tensor `name` is built from (in the order the fusions take them)."""
    whole = {"embed.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
             "final_norm.weight": "model.norm.weight"}
    if name in whole:
        return [whole[name]]
    _, i, rest = name.split(".", 2)
    hf = f"model.layers.{i}."
    kind = rest.rsplit(".", 1)[-1]
    if rest in _OURS_TO_HF:
        return [hf + _OURS_TO_HF[rest]]
    if rest.startswith("attn.qkv_proj."):
        return [f"{hf}self_attn.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
    if rest.startswith("mlp.gate_up_proj."):
        return [f"{hf}mlp.{p}.{kind}" for p in ("gate_proj", "up_proj")]
    raise KeyError(f"no Hugging Face counterpart for {name}")


def our_tensor(name: str, cfg: ModelConfig, get: Callable[[str], Tensor]) -> Tensor:
    """Our full tensor `name`, built from Hugging Face tensors read by get(hf_name)."""
    parts = [get(n) for n in hf_sources(name, cfg)]
    if name in ("embed.weight", "lm_head.weight"):
        return _pad_rows(parts[0], cfg.padded_vocab_size())
    if ".qkv_proj." in name:
        return fuse_qkv(*parts, cfg.kv_heads)
    if ".gate_up_proj." in name:
        return interleave_gate_up(*parts)
    if cfg.layernorm_1p and name.endswith("norm.weight"):      # Hugging Face holds the scale, we its offset from 1
        return parts[0] - 1.0
    return parts[0]


def hf_tensors(name: str, t: Tensor, cfg: ModelConfig) -> dict[str, Tensor]:
    """The Hugging Face tensors that our full tensor `name` becomes."""
    sources = hf_sources(name, cfg)
    if name in ("embed.weight", "lm_head.weight"):
        out = {sources[0]: t[:cfg.vocab_size]}
        return {**out, "lm_head.weight": t[:cfg.vocab_size]} if cfg.tie_embeddings and name == "embed.weight" else out
    if ".qkv_proj." in name:
        return dict(zip(sources, unfuse_qkv(t, cfg.num_heads, cfg.kv_heads)))
    if ".gate_up_proj." in name:
        return dict(zip(sources, split_gate_up(t)))
    if cfg.layernorm_1p and name.endswith("norm.weight"):
        return {sources[0]: t + 1.0}
    return {sources[0]: t}


def check_hf_names(hf_names: set[str], cfg: ModelConfig) -> None:
    """Raise KeyError when the Hugging Face tensors are not exactly those of a Llama with cfg's shape."""
    expected = {k for n in our_names(cfg) for k in hf_sources(n, cfg)}
    missing = sorted(expected - hf_names)
    if missing:
        raise KeyError(f"the Hugging Face model lacks {len(missing)} tensors, e.g. {missing[:3]}")
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unknown = sorted(k for k in hf_names - expected - ignored if "rotary_emb" not in k)
    if unknown:
        raise KeyError(f"unexpected Hugging Face tensors {unknown[:3]}: the model is not a plain Llama of this shape")


def from_hf_state_dict(hf_sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A Hugging Face Llama state dict -> ours (full tensors)."""
    check_hf_names(set(hf_sd), cfg)
    return {name: our_tensor(name, cfg, hf_sd.__getitem__) for name in our_names(cfg)}


def to_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Ours (full tensors) -> a Hugging Face Llama state dict."""
    out: dict[str, Tensor] = {}
    for name in our_names(cfg):
        out.update(hf_tensors(name, sd[name], cfg))
    return out
