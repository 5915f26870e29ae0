"""Our GPT equals transformers' LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM for the
same weights; conversion round-trips; what does not convert is refused."""
from dataclasses import replace

import pytest
import torch

from megalysses.config import ModelConfig
from megalysses.model.gpt import GPTStage
from megalysses.model.hf import from_hf_state_dict, hf_config_dict, hf_shapes, model_config_from_hf, to_hf_state_dict

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied,kv,attn_bias,mlp_bias", [(False, 2, False, False), (True, 1, True, False),
                                                      (False, 4, False, True)])
def test_logits_match_transformers(tied, kv, attn_bias, mlp_bias):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64,
                                      rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                                      attention_bias=attn_bias, mlp_bias=mlp_bias)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():   # non-trivial norm weights and biases, so that a dropped or swapped one shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    cfg = model_config_from_hf(hf_cfg, attention_backend="reference")
    ours = GPTStage(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    ids = torch.randint(0, 96, (2, 24))
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(ids, pos)
    assert got.shape[-1] == cfg.padded_vocab_size() == 128 and bool((got[..., 96:] == float("-inf")).all())
    torch.testing.assert_close(got[..., :96], want, rtol=1e-5, atol=1e-5)

    back = to_hf_state_dict(ours.state_dict(), cfg)
    ref = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
    # the loss over the padded vocabulary is the loss over the true one
    labels = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        want_loss = torch.nn.functional.cross_entropy(want.flatten(0, 1), labels.flatten(), reduction="sum")
        torch.testing.assert_close(ours(ids, pos, labels=labels), want_loss, rtol=1e-5, atol=1e-4)


def test_unsupported_models_are_refused():
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, hidden_act="gelu")
    with pytest.raises(ValueError, match="SiLU"):
        model_config_from_hf(cfg)


def family_model(family: str):
    """A tiny transformers model of `family` with random weights (non-trivial norms and biases): Qwen2 (q, k, v
    biases, YaRN), Qwen3 (q/k norms, heads of 24 at hidden 64, biases on all four projections, linear RoPE
    scaling), Mistral (heads of 12, a sliding window of 5 over 24 tokens)."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if family == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False, sliding_window=4, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5000.0})
        model = transformers.Qwen2ForCausalLM(config)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=24, attention_bias=True, rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**common, head_dim=12, sliding_window=5, rope_theta=5000.0)
        model = transformers.MistralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_families_match_transformers(family):
    """Qwen2/2.5 (Qwen2.5's unused window is not refused), Qwen3 and Mistral: logits equal transformers' and
    the tensors convert back exactly; the config comes back as the family's."""
    torch.manual_seed(0)
    hf = family_model(family)
    cfg = model_config_from_hf(hf.config.to_dict(), attention_backend="sdpa")
    want_settings = {"qwen2": (None, True, False, False, 0, "yarn"), "qwen3": (24, False, True, True, 0, "linear"),
                     "mistral": (12, False, False, False, 5, "none")}[family]
    assert (cfg.head_dim, cfg.add_qkv_bias, cfg.qk_layernorm, cfg.attention_bias, cfg.sliding_window,
            cfg.rope_scaling.type) == want_settings
    ours = GPTStage(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    ids = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits, ours(ids, torch.arange(24).expand(2, 24))[..., :96]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    back = to_hf_state_dict(ours.state_dict(), cfg)
    ref = {k: v for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    assert set(back) == set(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
    assert hf_shapes(cfg) == {k: tuple(v.shape) for k, v in ref.items()}        # what the import checks against
    exported = hf_config_dict(cfg, "float32", 64, eos_token_id=2, bos_token_id=1)
    config = transformers.AutoConfig.for_model(**exported)
    assert type(config) is type(hf.config) and model_config_from_hf(exported, attention_backend="sdpa") == cfg
    again = type(hf)(config).eval()
    again.load_state_dict(back, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "qwen2_moe"}, "qwen2_moe is a mixture-of-experts model"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "mixtral is a mixture-of-experts model"),
    ({"model_type": "qwen3_moe", "num_experts": 8}, "qwen3_moe is a mixture-of-experts model"),
    ({"model_type": "gemma"}, "model_type 'gemma' does not convert: the families that do are llama, qwen2, qwen3"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "RoPE scaling of type 'longrope' is not supported"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     "a sliding window in 1 of the 2 layers"),
    ({"model_type": "mistral", "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
     "a sliding window in 1 of the 2 layers"),
])
def test_what_does_not_convert_is_refused_in_one_line(change, message):
    config = {"model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64, **change}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        model_config_from_hf(config)
    assert "\n" not in str(e.value)


def test_export_picks_the_family_the_settings_need():
    base = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2)
    pick = {"llama": base, "qwen3": replace(base, qk_layernorm=True), "qwen2": replace(base, add_qkv_bias=True),
            "mistral": replace(base, sliding_window=16)}
    for family, cfg in pick.items():
        assert hf_config_dict(cfg, "bfloat16", 64)["model_type"] == family
        assert hf_config_dict(cfg, "bfloat16", 64, model_type="mistral")["model_type"] == (
            "mistral" if family in ("llama", "mistral") else family)      # the imported family when it holds it
    with pytest.raises(ValueError, match=r"no Hugging Face family holds this model: llama holds none with a sliding "
                                         r"window \(model.sliding_window\); .* mistral holds none with MLP biases"):
        hf_config_dict(replace(base, mlp_bias=True, sliding_window=8), "bfloat16", 64)


def test_qwen25_config_as_published():
    """Qwen2.5's config.json with the YaRN block its model card adds (transformers 4's rope_scaling key, `type`):
    the window it sets but does not use is not one, and the frequencies and attention factor are transformers'."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from megalysses.kernels.rope import rope_cos_sin

    published = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
                 "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                 "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 21,
                 "tie_word_embeddings": True, "hidden_act": "silu",
                 "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
    cfg = model_config_from_hf(published)
    assert (cfg.sliding_window, cfg.add_qkv_bias, cfg.rope_scaling.type, cfg.rope_scaling.factor,
            cfg.rope_scaling.original_max_position_embeddings) == (0, True, "yarn", 4.0, 32768)
    pos = torch.tensor([[0, 1, 5000, 60000, 131071]])
    x = torch.zeros(1, 5, 16)
    want = Qwen2RotaryEmbedding(transformers.Qwen2Config(**published))(x, pos)
    got = rope_cos_sin(pos, cfg.head_size, cfg.rope_theta, scaling=cfg.rope_scaling)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
