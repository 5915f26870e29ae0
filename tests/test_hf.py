"""Our GPT equals transformers' LlamaForCausalLM for the same weights; conversion round-trips."""
import pytest
import torch

from megalysses.model.gpt import GPTStage
from megalysses.model.hf import from_hf_state_dict, model_config_from_hf, to_hf_state_dict

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
