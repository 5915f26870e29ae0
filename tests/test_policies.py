"""An activation policy applied to a plain model (megalysses/model/policies.py): the module tree, parameter names and
state dict stay the plain model's, the runners carry out the policy asked for (read back as check_built reads
it), the same loss and gradients, and a policy the model cannot run is refused when it is applied."""
import pytest
import torch

from megalysses.config import ModelConfig
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.model.kv_cache import KVCache
from megalysses.model.policies import activation_offload, applied_policy, apply_activation_policy
from megalysses.plan import ActivationPolicy

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                  attention_backend="sdpa", qk_layernorm=True, attention_bias=True)
POLICIES = {
    "checkpoints of 2 blocks, offloaded; head chunks, MLP and loss tiles":
        ActivationPolicy(checkpointing=True, offload=True, checkpoint_stride=2, head_chunks=2, mlp_chunk_tokens=5,
                         loss_chunk_tokens=7, mask_block=64),
    "checkpoints keeping attention": ActivationPolicy(checkpointing=True, keep_attention=True),
    "checkpoints of 3 blocks, MLP tiles": ActivationPolicy(checkpointing=True, checkpoint_stride=3, mlp_chunk_tokens=4),
}


def _model(policy: ActivationPolicy | None = None) -> GPTStage:
    model = GPTStage(CFG)
    init_weights(model, 3)
    return model if policy is None else apply_activation_policy(model, policy)


def _loss_and_grads(model: GPTStage) -> tuple[torch.Tensor, dict]:
    ids = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = model(ids, torch.arange(16)[None], labels=ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_policy_keeps_the_plain_models_names_and_numbers():
    plain = _model()
    assert applied_policy(plain) == ActivationPolicy() and activation_offload(plain) is None
    loss, grads = _loss_and_grads(plain)
    for name, policy in POLICIES.items():
        model = _model(policy)
        assert applied_policy(model) == policy, name
        assert (activation_offload(model) is not None) == policy.offload, name
        assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()], name
        assert list(model.state_dict()) == list(plain.state_dict()), name
        model.load_state_dict(plain.state_dict())                   # a plain model's checkpoint loads, strictly
        got_loss, got = _loss_and_grads(model)
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0, msg=name)
        for n, g in grads.items():
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=f"{name}: {n}")
        model.eval()
        with torch.no_grad():     # evaluation, and generation with its KV cache (all heads at once), run plainly
            ids, pos = torch.arange(16)[None] % CFG.vocab_size, torch.arange(16)[None]
            torch.testing.assert_close(model(ids, pos), plain(ids, pos))
            caches = [KVCache(CFG, 1, 16, torch.device("cpu"), torch.float32) for _ in range(2)]
            for lo, hi in ((0, 12), (12, 13)):                      # a prompt, then one token
                torch.testing.assert_close(model(ids[:, lo:hi], pos[:, lo:hi], cache=caches[0]),
                                           plain(ids[:, lo:hi], pos[:, lo:hi], cache=caches[1]))


def test_a_policy_the_model_cannot_run_is_refused_when_applied():
    with pytest.raises(ValueError, match="3 head chunks do not split the 2 KV heads"):
        _model(ActivationPolicy(head_chunks=3))
    for needs_checkpointing in ({"offload": True}, {"keep_attention": True}, {"checkpoint_stride": 2}):
        with pytest.raises(ValueError, match="they need checkpointing"):
            _model(ActivationPolicy(**needs_checkpointing))


def test_the_run_checks_the_policy_its_model_carries_out():
    """training/runtime.py check_built reads the policy back from the built model: as build_model applies it, it
    holds; a plain model for the same plan is a bug it names."""
    from megalysses.config.io import load_config
    from megalysses.grid import ParallelGrid
    from megalysses.training.build import build_model
    from megalysses.training.runtime import check_built, model_config
    from megalysses.testing import resolve_run

    cfg = load_config(overrides=["data.mock=true", "data.seq_len=32", "model.vocab_size=128", "model.hidden_size=32",
                                 "model.num_layers=2", "model.num_heads=4", "training.global_batch_size=1",
                                 "training.activation_checkpointing=true", "training.mlp_chunk_tokens=8"])
    grid, cpu = ParallelGrid.single(), torch.device("cpu")
    run = resolve_run(cfg, cpu, grid)
    check_built(build_model(cfg, grid, cpu, None, run), grid, run)
    with pytest.raises(RuntimeError, match=r"stage activation policy ActivationPolicy\(checkpointing=False"):
        check_built(GPTStage(model_config(cfg, run)), grid, run)


@pytest.mark.parametrize("policy", [ActivationPolicy(), ActivationPolicy(mlp_chunk_tokens=4),
                                    ActivationPolicy(head_chunks=2, mlp_chunk_tokens=4)],
                         ids=["plain", "MLP tiles", "head chunks, MLP tiles"])
def test_the_attention_output_is_let_go_before_the_mlp_runs(policy):
    """While a block's MLP runs nothing holds the attention half's output (x + a and the MLP's own tensors are
    what autograd keeps): held through the MLP, it is one more residual-stream tensor at the MLP's peak (8 GiB a
    layer of Llama-3.1-8B at 1M tokens)."""
    import weakref

    model = _model(policy)
    block = model.layers["0"]
    outputs, alive = [], []
    attend = block.attention_half.run

    def run(*args, **kwargs):
        a = attend(*args, **kwargs)
        outputs.append(weakref.ref(a))
        return a

    block.attention_half.run = run
    block.mlp.register_forward_pre_hook(lambda module, args: alive.append(outputs[-1]() is not None))
    _loss_and_grads(model)
    assert alive and not any(alive), alive
