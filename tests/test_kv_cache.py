"""Generation with the KV cache computes what the full forward computes: prefill then token-by-token
decode equal the logits of the whole sequence, and left-padded batched prompts equal each prompt alone (with a
sliding window and q/k head norms too)."""
from dataclasses import replace

import pytest
import torch

from megalysses.config import ModelConfig, RopeScalingConfig
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.model.kv_cache import KVCache

CFG = ModelConfig(vocab_size=90, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, attention_backend="sdpa",
                  rope_scaling=RopeScalingConfig(type="llama3", factor=4.0, original_max_position_embeddings=8))
CONFIGS = [CFG, replace(CFG, sliding_window=5, qk_layernorm=True, head_dim=12)]


def model(cfg=CFG):
    m = GPTStage(cfg).eval()
    init_weights(m, seed=3)
    return m


@torch.no_grad()
@pytest.mark.parametrize("cfg", CONFIGS, ids=["llama", "window"])
def test_prefill_then_decode_equals_full_forward(cfg):
    m = model(cfg)
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    full = m(ids, torch.arange(20).expand(2, 20))
    cache = KVCache(cfg, batch=2, max_len=20, device=torch.device("cpu"), dtype=torch.float32)
    got = [m(ids[:, :12], torch.arange(12).expand(2, 12), cache=cache)]
    for t in range(12, 20):
        got.append(m(ids[:, t:t + 1], torch.full((2, 1), t), cache=cache))
    torch.testing.assert_close(torch.cat(got, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 20


@torch.no_grad()
@pytest.mark.parametrize("cfg", CONFIGS, ids=["llama", "window"])
def test_left_padded_batch_equals_each_prompt_alone(cfg):
    m = model(cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (n,), generator=g) for n in (7, 3)]
    P, new = 7, 4
    ids = torch.zeros(2, P, dtype=torch.long)
    valid = torch.zeros(2, P, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], valid[b, P - len(p):] = p, True
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    cache = KVCache(cfg, batch=2, max_len=P + new, device=torch.device("cpu"), dtype=torch.float32, key_valid=valid)
    last = m(ids, pos, cache=cache)[:, -1]
    steps = [last]
    follow = torch.randint(0, 90, (2, new), generator=g)
    for t in range(new):
        steps.append(m(follow[:, t:t + 1], pos[:, -1:] + 1 + t, cache=cache)[:, -1])
    for b, p in enumerate(prompts):
        alone = torch.cat([p, follow[b]])[None]
        want = m(alone, torch.arange(alone.shape[1])[None])[0, len(p) - 1:]
        torch.testing.assert_close(torch.stack([s[b] for s in steps]), want, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers():
    """Batched, left-padded greedy decoding with the cache picks the tokens transformers' generate picks."""
    transformers = pytest.importorskip("transformers")
    from megalysses.model.hf import from_hf_state_dict, model_config_from_hf
    from megalysses.tools.generate import Sampling, generate

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=90, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = model_config_from_hf(hf_cfg, attention_backend="sdpa")
    ours = GPTStage(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    prompts = [[5, 17, 3, 60, 2], [40, 41]]
    got = generate(ours, prompts, 6, Sampling(temperature=0.0, top_k=0, top_p=1.0, generator=torch.Generator()),
                   eod=None, vocab=90, device=torch.device("cpu"), dtype=torch.float32)
    for prompt, row in zip(prompts, got):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0].tolist()
        assert row == want


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    from megalysses.tools.generate import _filter

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)      # any logits; probabilities below
    probs = logits.softmax(-1)[0]
    kept = _filter(logits, 0, float(probs[0] + probs[1]) - 1e-6)[0] > float("-inf")
    assert kept.tolist() == [True, True, False, False]
    assert (_filter(logits, 0, 1.0) > float("-inf")).all()
    assert (_filter(logits, 1, 1.0)[0] > float("-inf")).tolist() == [True, False, False, False]


def test_generation_builds_through_the_run_builder_under_a_forward_only_plan(tmp_path):
    """A run trained at a layout one process cannot hold, with every memory option, is sampled from by one process
    whose plan keeps nothing for a backward: the run builder makes the model on this machine's device, plain,
    in the plan's dtype, holding the weights its source read in."""
    from fixtures import TINY
    from megalysses.config.io import load_config, save_config
    from megalysses.model.policies import applied_policy
    from megalysses.plan.machine import local_device
    from megalysses.tools import generate

    options = ["model.num_layers=4", "model.vocab_size=300", "parallel.tp=2", "parallel.pp=2",
               "parallel.virtual_stages=2", "parallel.fsdp=true", "training.param_offload=true",
               "training.activation_checkpointing=true", "training.checkpoint_stride=2",
               "training.activation_offload=true", "training.mlp_chunk_tokens=8", "training.attention_head_chunks=2",
               "training.global_batch_size=4"]
    save_config(load_config(overrides=TINY + options), tmp_path / "config.yaml")
    cfg, tok = generate.load_run(tmp_path)
    plan = generate.generation_plan(cfg)
    d = plan.degrees
    assert (d.world, d.tp, d.sp, d.pp, d.virtual_stages, plan.fsdp) == (1, 1, 1, 1, 1, False)
    assert plan.weights == plan.gradients == "device" and plan.optimizer == "zero1"
    forward_only = replace(plan.activation, checkpointing=False, keep_attention=False, offload=False,
                           checkpoint_stride=1, mlp_chunk_tokens=0, head_chunks=1)
    assert plan.activation == forward_only

    def weights(model, grid, mesh):        # what a source reads in: the builder's fp32 model, filled
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                assert p.dtype == torch.float32
                p.fill_(i / 100)

    run = generate.build(generate.Source(cfg, weights, tok, None, str(tmp_path), cfg.data.seq_len))
    assert run.opt is None and run.data is None and not run.model.training
    assert applied_policy(run.model) == replace(forward_only, loss_chunk_tokens=forward_only.loss_tile)
    for i, p in enumerate(run.model.parameters()):
        assert p.device.type == local_device().type and p.dtype == plan.torch_dtype
        assert (p == torch.tensor(i / 100, dtype=plan.torch_dtype)).all()
