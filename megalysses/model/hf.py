"""Conversion between Hugging Face Llama, Qwen2/2.5, Qwen3 and Mistral models and megalysses, tensor by tensor.

    cfg = model_config_from_hf(hf_model.config)             # or the dict of a config.json
    ours = GPTStage(cfg); ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg))
    hf_sd = to_hf_state_dict(ours.state_dict(), cfg)
    config_json = hf_config_dict(cfg, "bfloat16", max_positions=8192, eos_token_id=2)

Norms, o_proj and down_proj map one to one; embeddings and the LM head gain zero rows up to our padded
vocabulary (model.vocab_pad_multiple) and lose them on the way back. Our fused projections are
assembled from Hugging Face's separate ones without changing any value: `attn.qkv_proj` stacks, for
each KV head g, the query heads that read it, then k_g, then v_g; `mlp.gate_up_proj` interleaves the
rows of gate_proj and up_proj. Our rotary embedding uses the same rotate-half convention as
transformers' Llama, so no head is permuted. The families differ by settings, not tensors' layout: Qwen2's
q, k and v biases (model.add_qkv_bias), Qwen3's q_norm and k_norm (model.qk_layernorm) and its head_dim,
Mistral's head_dim and sliding window (model.sliding_window, read with Qwen's use_sliding_window and
layer_types); Llama's attention_bias and mlp_bias map as they are. RoPE scaling (llama3, linear, yarn) is
read from `rope_scaling` or (transformers 5) `rope_parameters`. Mixture-of-experts models, other
model_types and other RoPE types are refused, naming what does not convert.
`our_tensor` / `hf_tensors` convert one parameter at a time, so a loader never needs the whole model;
`check_hf_names` and `check_hf_shapes` compare a model's tensors with what its config predicts before any is read.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from megalysses.config import ModelConfig, RopeScalingConfig

_ONE_TO_ONE = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
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

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""The Hugging Face model_types that convert, both ways."""
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM"}
_MIXTURES = {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "llama4", "deepseek_v2", "deepseek_v3", "dbrx",
             "jamba", "olmoe", "granitemoe", "phimoe", "minimax", "gpt_oss", "qwen3_5_moe", "mistral4"}
_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
_ROPE_KEYS = {"factor": "context extension factor, the new context over the original, e.g. 4.0",
              "low_freq_factor": "llama3 low-frequency factor, Llama 3.1's is 1.0",
              "high_freq_factor": "llama3 high-frequency factor, Llama 3.1's is 4.0"}


def _field(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def _rope(hf_config: Any) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, scaling) from rope_theta + rope_scaling (transformers 4) or rope_parameters (5), read as
    transformers reads them (yarn's original_max_position_embeddings defaults to max_position_embeddings, its
    factor to their ratio)."""
    params = _field(hf_config, "rope_parameters") or {}
    scaling = _field(hf_config, "rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError("RoPE parameters per layer type are not supported (one RoPE for every layer is)")
    theta = _field(hf_config, "rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    spec = scaling or params
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), RopeScalingConfig()
    if kind not in _ROPE_TYPES:
        raise ValueError(f"RoPE scaling of type {kind!r} is not supported (plain RoPE, llama3, linear and yarn are)")
    key = "rope_scaling" if scaling else "rope_parameters"

    def required(name: str) -> float:
        if spec.get(name) is None:
            raise ValueError(f"config.json's {key} (rope_type {kind}) has no {name}: add it (the {_ROPE_KEYS[name]}), "
                             f"or remove {key} for plain RoPE")
        return float(spec[name])

    if kind == "linear":
        return float(theta), RopeScalingConfig(type="linear", factor=required("factor"))
    positions = _field(hf_config, "max_position_embeddings")
    original = (_field(hf_config, "original_max_position_embeddings") or spec.get("original_max_position_embeddings")
                or positions)
    if original is None:
        raise ValueError(f"config.json's {key} (rope_type {kind}) has no original_max_position_embeddings and "
                         f"config.json no max_position_embeddings: add one (the context the model was trained at)")
    original = int(original)
    if kind == "llama3":
        return float(theta), RopeScalingConfig(
            type="llama3", factor=required("factor"), low_freq_factor=required("low_freq_factor"),
            high_freq_factor=required("high_freq_factor"), original_max_position_embeddings=original)
    factor = spec.get("factor") or (required("factor") if positions is None else positions / original)
    attention = spec.get("attention_factor")
    return float(theta), RopeScalingConfig(
        type="yarn", factor=float(factor), original_max_position_embeddings=original,
        beta_fast=float(spec.get("beta_fast") or 32.0), beta_slow=float(spec.get("beta_slow") or 1.0),
        mscale=float(spec.get("mscale") or 0.0), mscale_all_dim=float(spec.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention is None else float(attention), truncate=bool(spec.get("truncate", True)))


def _sliding_window(hf_config: Any, model_type: str, layers: int) -> int:
    """The window every layer attends in (0: none), read as transformers reads it: Qwen's sliding_window only
    with use_sliding_window (Qwen2.5 sets a window it does not use), in the layers that layer_types (or, without
    it, max_window_layers) marks sliding; Mistral's in every layer. Different windows per layer are refused."""
    if model_type == "llama":
        return 0
    window = _field(hf_config, "sliding_window")
    if model_type in ("qwen2", "qwen3") and not _field(hf_config, "use_sliding_window", False):
        window = None
    if not window:
        return 0
    types = _field(hf_config, "layer_types")
    if types is None and model_type in ("qwen2", "qwen3"):
        first = _field(hf_config, "max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    sliding = [t == "sliding_attention" for t in types or ["sliding_attention"] * layers]
    if all(sliding):
        return int(window)
    if not any(sliding):
        return 0
    raise ValueError(f"a sliding window in {sum(sliding)} of the {len(sliding)} layers (layer_types / "
                     f"max_window_layers) is not supported: megalysses gives every layer the same attention")


def model_type_of(hf_config: Any) -> str:
    """The model_type of a Hugging Face config, refused unless it is one of FAMILIES."""
    model_type = _field(hf_config, "model_type", "llama") or "llama"
    if model_type in _MIXTURES or _field(hf_config, "num_experts") or _field(hf_config, "num_local_experts"):
        raise ValueError(f"{model_type} is a mixture-of-experts model: megalysses trains dense models; the dense "
                         f"families that convert are {', '.join(FAMILIES)}")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} does not convert: the families that do are "
                         f"{', '.join(FAMILIES)}")
    return model_type


def model_config_from_hf(hf_config: Any, **overrides: Any) -> ModelConfig:
    """A ModelConfig with the architecture of a transformers Llama, Qwen2/2.5, Qwen3 or Mistral config (object or
    config.json dict). Raises ValueError naming what does not convert: another model_type, a mixture of
    experts, an activation other than SiLU, a RoPE type other than llama3, linear and yarn, different windows
    per layer."""
    model_type = model_type_of(hf_config)
    act = _field(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only SiLU (SwiGLU) models convert; this {model_type} uses {act}")
    heads, hidden = _field(hf_config, "num_attention_heads"), _field(hf_config, "hidden_size")
    head_dim = _field(hf_config, "head_dim")
    theta, scaling = _rope(hf_config)
    layers = _field(hf_config, "num_hidden_layers")
    qwen2 = model_type == "qwen2"                         # q, k and v biases, none on o_proj
    biases = model_type in ("llama", "qwen3") and bool(_field(hf_config, "attention_bias", False))
    fields = dict(
        vocab_size=_field(hf_config, "vocab_size"), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=_field(hf_config, "num_key_value_heads") or heads,
        head_dim=None if head_dim is None or head_dim * heads == hidden else int(head_dim),
        ffn_hidden_size=_field(hf_config, "intermediate_size"), rope_theta=theta, rope_scaling=scaling,
        norm="rmsnorm", norm_eps=float(_field(hf_config, "rms_norm_eps", 1e-6)), mlp="swiglu",
        tie_embeddings=bool(_field(hf_config, "tie_word_embeddings", False)),
        attention_bias=biases, add_qkv_bias=qwen2, qk_layernorm=model_type == "qwen3",
        sliding_window=_sliding_window(hf_config, model_type, layers),
        mlp_bias=model_type == "llama" and bool(_field(hf_config, "mlp_bias", False)))
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_model_type(cfg: ModelConfig, preferred: Optional[str] = None) -> str:
    """The Hugging Face family that holds cfg's architecture: `preferred` (the family it was imported from) when
    it does, else the first that does of qwen3 (q/k norms), qwen2 (q, k, v biases alone), llama and mistral (a
    sliding window). ValueError names, for each family, what it cannot hold."""
    if cfg.mlp != "swiglu" or cfg.norm != "rmsnorm":
        raise ValueError(f"only SwiGLU + RMSNorm models export to Hugging Face; this one has mlp={cfg.mlp}, "
                         f"norm={cfg.norm}")
    has = {"qk": cfg.qk_layernorm, "no qk": not cfg.qk_layernorm, "qkv bias": cfg.add_qkv_bias and not
           cfg.attention_bias, "no qkv bias": not cfg.add_qkv_bias, "o bias": cfg.attention_bias,
           "bias": cfg.qkv_bias, "mlp bias": cfg.mlp_bias, "window": bool(cfg.sliding_window)}
    words = {"qk": "q/k norms (model.qk_layernorm)", "no qk": "no q/k norms", "qkv bias": "biases on q, k and v alone "
             "(model.add_qkv_bias)", "no qkv bias": "no q, k, v biases", "o bias": "an output-projection bias "
             "(model.attention_bias)", "bias": "attention biases", "mlp bias": "MLP biases (model.mlp_bias)",
             "window": "a sliding window (model.sliding_window)"}
    refuses = {"qwen3": ("no qk", "qkv bias", "mlp bias"), "qwen2": ("qk", "no qkv bias", "o bias", "mlp bias"),
               "llama": ("qk", "qkv bias", "window"), "mistral": ("qk", "bias", "mlp bias")}
    order = ((preferred,) if preferred in FAMILIES else ()) + ("qwen3", "qwen2", "llama", "mistral")
    fits = [f for f in order if not any(has[what] for what in refuses[f])]
    if not fits:
        raise ValueError("no Hugging Face family holds this model: " + "; ".join(
            f"{f} holds none with {' or '.join(words[w] for w in refuses[f] if has[w])}" for f in FAMILIES))
    return fits[0]


def _rope_scaling_dict(rs: RopeScalingConfig) -> Optional[dict]:
    if rs.type == "llama3":
        return {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings}
    if rs.type == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    if rs.type == "yarn":
        out = {"rope_type": "yarn", "factor": rs.factor,
               "original_max_position_embeddings": rs.original_max_position_embeddings}
        # the rest only where it is not what transformers takes a missing key for
        out.update({k: v for k, v, default in (("beta_fast", rs.beta_fast, 32.0), ("beta_slow", rs.beta_slow, 1.0),
                                               ("mscale", rs.mscale, 0.0), ("mscale_all_dim", rs.mscale_all_dim, 0.0))
                    if v != default})
        if rs.attention_factor is not None:
            out["attention_factor"] = rs.attention_factor
        if not rs.truncate:
            out["truncate"] = False
        return out
    return None


def hf_config_dict(cfg: ModelConfig, dtype: str, max_positions: int, eos_token_id: Any = None,
                   bos_token_id: Any = None, model_type: Optional[str] = None) -> dict:
    """The config.json of a transformers model with cfg's architecture (read by transformers 4 and 5), of the
    family `model_type` names when it holds the architecture, else the one hf_model_type picks.
    max_positions is the context it declares (what serving stacks limit prompts to); the special token
    ids are an int (a list for several EOS) or None, written as null: a missing key would read as
    transformers' defaults, BOS 1 and EOS 2."""
    family = hf_model_type(cfg, model_type)
    out = {"architectures": [_ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
           "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": max_positions, "torch_dtype": dtype}
    if family in ("llama", "qwen3"):
        out["attention_bias"] = cfg.attention_bias
    if family == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    window = cfg.sliding_window or None
    if family in ("qwen2", "qwen3"):
        # written both ways: layer_types (transformers >= 4.53) and use_sliding_window with max_window_layers
        out.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0 if window
                   else cfg.num_layers, layer_types=["sliding_attention" if window else "full_attention"] *
                   cfg.num_layers)
    elif family == "mistral":
        out["sliding_window"] = window
    out.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id)     # null, not transformers' defaults 1 and 2
    scaling = _rope_scaling_dict(cfg.rope_scaling)
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


# ----------------------------------------------------------------------------- tensors

def our_names(cfg: ModelConfig) -> list[str]:
    """Every parameter name of the whole model (pp=1)."""
    names = ["embed.weight", "final_norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    def kinds(bias: bool) -> list[str]:
        return ["weight", "bias"] if bias else ["weight"]

    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        names += [pre + "attn_norm.weight", pre + "mlp_norm.weight"]
        names += [f"{pre}attn.qkv_proj.{k}" for k in kinds(cfg.qkv_bias)]
        names += [f"{pre}attn.o_proj.{k}" for k in kinds(cfg.attention_bias)]
        names += [f"{pre}attn.{p}.weight" for p in ("q_norm", "k_norm") if cfg.qk_layernorm]
        names += [f"{pre}mlp.{p}.{k}" for p in ("gate_up_proj", "down_proj") for k in kinds(cfg.mlp_bias)]
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


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of a model with cfg's architecture: our model built on the meta
    device, its tensors converted by hf_tensors, so the prediction is what the conversion itself reads."""
    from megalysses.model.gpt import GPTStage

    with torch.device("meta"):
        model = GPTStage(cfg)
    return {k: tuple(t.shape) for n, p in model.named_parameters() for k, t in hf_tensors(n, p, cfg).items()}


def _shape_words(hf_name: str, cfg: ModelConfig) -> str:
    """The config.json fields a Hugging Face tensor's shape follows from, with their values."""
    heads = f"num_attention_heads {cfg.num_heads} x head_dim {cfg.head_size}"
    kv = f"num_key_value_heads {cfg.kv_heads} x head_dim {cfg.head_size}"
    hidden, ffn = f"hidden_size {cfg.hidden_size}", f"intermediate_size {cfg.ffn_size}"
    head, vocab = f"head_dim {cfg.head_size}", f"vocab_size {cfg.vocab_size}"
    dims = {"q_proj": (heads, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, heads),
            "q_norm": (head,), "k_norm": (head,), "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden),
            "down_proj": (hidden, ffn), "embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden)}
    parts = hf_name.split(".")
    kind = next((k for k in parts if k in dims), None)
    words = dims[kind] if kind is not None else (hidden,)
    return ", ".join(words[:1] if parts[-1] == "bias" else words)


def check_hf_shapes(shape_of: Callable[[str], tuple[int, ...]], cfg: ModelConfig) -> None:
    """Raise ValueError naming the first Hugging Face tensor whose shape (read by shape_of(name), without reading
    the tensor) is not the one cfg predicts (hf_shapes): a config.json that does not describe its weights."""
    for name, want in hf_shapes(cfg).items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue                                         # tied: transformers does not save it
        have = tuple(shape_of(name))
        if have != want:
            raise ValueError(f"the tensor {name} has shape {have} where config.json ({_shape_words(name, cfg)}) "
                             f"predicts {want}: config.json does not describe these weights; correct it to the "
                             f"model's own")


def from_hf_state_dict(hf_sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A Hugging Face Llama state dict -> ours (full tensors)."""
    check_hf_names(set(hf_sd), cfg)
    check_hf_shapes(lambda name: hf_sd[name].shape, cfg)
    return {name: our_tensor(name, cfg, hf_sd.__getitem__) for name in our_names(cfg)}


def to_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Ours (full tensors) -> a Hugging Face Llama state dict."""
    out: dict[str, Tensor] = {}
    for name in our_names(cfg):
        out.update(hf_tensors(name, sd[name], cfg))
    return out
