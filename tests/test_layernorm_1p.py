"""model.layernorm_1p (Megatron-LM's --apply-layernorm-1p): zero-centred norm weights compute what weights of
1 + offset compute, forward and backward, and convert to and from Hugging Face as the scale itself."""
import pytest
import torch

from megalysses.config import ModelConfig
from megalysses.model.gpt import GPTStage, architecture, init_weights
from megalysses.model.hf import from_hf_state_dict, to_hf_state_dict

CFG = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, attention_backend="sdpa")


def _loss_and_grads(cfg: ModelConfig, shift_norms: float):
    torch.manual_seed(0)
    model = GPTStage(cfg)
    init_weights(model, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.linspace(-0.2, 0.3, p.numel()) + shift_norms)   # trained-looking scales
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).expand(2, 16)
    loss = model(ids[:, :-1], pos, labels=ids[:, 1:])
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_zero_centred_weights_compute_the_same(norm):
    plain, one_p = ModelConfig(**CFG, norm=norm), ModelConfig(**CFG, norm=norm, layernorm_1p=True)
    model_a, loss_a, grads_a = _loss_and_grads(plain, 0.0)
    model_b, loss_b, grads_b = _loss_and_grads(one_p, 0.0)
    norms = [n for n, _ in model_b.named_parameters() if n.endswith("norm.weight")]
    fresh = GPTStage(one_p)
    init_weights(fresh, seed=3)
    assert norms and all(torch.equal(dict(fresh.named_parameters())[n], torch.zeros(32)) for n in norms)
    for n in norms:                                   # the same scales: 1 + offset against the weight itself
        torch.testing.assert_close(dict(model_b.named_parameters())[n] + 1, dict(model_a.named_parameters())[n])
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=0)
    for n, g in grads_a.items():
        torch.testing.assert_close(grads_b[n], g, rtol=1e-5, atol=1e-7)
    assert architecture(one_p) != architecture(plain)     # a checkpoint of one is refused by the other


def test_hugging_face_holds_the_scale():
    cfg = ModelConfig(**CFG, layernorm_1p=True)
    model, _, _ = _loss_and_grads(cfg, 0.0)
    sd = {n: p.detach() for n, p in model.named_parameters()}
    hf = to_hf_state_dict(sd, cfg)
    assert torch.equal(hf["model.norm.weight"], sd["final_norm.weight"] + 1)
    assert torch.equal(hf["model.layers.0.input_layernorm.weight"], sd["layers.0.attn_norm.weight"] + 1)
    back = from_hf_state_dict(hf, cfg)
    for n, t in sd.items():                          # (the embedding's padding rows are not in Hugging Face's)
        t = t[:cfg.vocab_size] if n in ("embed.weight", "lm_head.weight") else t
        torch.testing.assert_close(back[n][:len(t)], t, rtol=0, atol=1e-7)
