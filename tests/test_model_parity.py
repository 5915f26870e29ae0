"""The parallel GPT equals one process: loss and every parameter gradient, layout by layout.

Each spawned group runs several layouts (tp, sp = ulysses x ring, dp) and variants (packed documents, TP
sequence sharding, tied embeddings, GQA / MQA, sequence lengths the layout does not divide, the Qwen and
Mistral settings: q/k head norms, q/k/v-only biases, a head width other than hidden / heads, YaRN, a sliding
window); every rank also builds the single-process reference from the same seed. A case may use fewer ranks
than the group (sp = 3, 5, 6, 7 inside test_ring.py's group of 8 ranks): the others only take part in creating
the process groups. The runner, its reference and the model variants are tests/parity.py's.
"""
import pytest
import torch

from megalysses.config import ModelConfig
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.testing import run_distributed
from tests.parity import (B, BIASES, CFG, GQA_2_PER_RANK, LAYERNORM, MHA_2_PER_RANK, MISTRAL, MQA, ONE_HEAD, QWEN, S,
                          WINDOW, case, check_model_parity, make_batch, model_parity_worker, reference)

# dp = world / (tp * sp); sp = ulysses x ring, the ring automatic (sp_ring=0) unless given
CASES = {
    2: [case(2, 1, model=QWEN),                                          # tp shards the head norms' inputs
        case(2, 1, True, True, True, 4), case(1, 2, model=QWEN),         # Ulysses moves whole normed heads
        case(1, 2, True, tied=True), case(1, 1, True, model=MISTRAL),
        # ring alone, a length sp does not divide; its blocks see normed keys and mask the window
        case(1, 2, True, sp_ring=2, seq_len=31, model={**QWEN, **WINDOW}),
        case(1, 2, True, model=ONE_HEAD, seq_len=29),                     # one head: a ring is the only way
        # several KV heads a Ulysses rank: their order over ranks must be the query heads' order
        case(1, 2, True, model=GQA_2_PER_RANK), case(1, 2, model=MHA_2_PER_RANK),
        # biases and LayerNorm's shift under TP sequence sharding: their gradients are summed over tp
        case(2, 1, True, True, model=BIASES), case(2, 1, True, True, model=LAYERNORM),
        case(2, 1, True, True, model={"layernorm_1p": True}),            # zero-centred norm weights
        # head chunks: tp with TP sequence sharding and biases (one gather, one reduce-scatter, the bias once);
        # Ulysses with each chunk's one KV head replicated; a ring, under activation checkpointing
        case(2, 1, True, True, model={**GQA_2_PER_RANK, **BIASES}, chunks=2),
        case(1, 2, True, chunks=2, model=QWEN),                            # the chunks sum the head norms' grads
        case(1, 2, True, sp_ring=2, seq_len=31, chunks=2, ckpt=True, model=MISTRAL),
        case(1, 1, True, model=MHA_2_PER_RANK, chunks=4, ckpt=True)],   # dp2, one KV head a chunk
    4: [case(1, 4), case(1, 4, True),                                    # sp=4 with 2 KV heads: KV replication
        case(2, 2, tied=True), case(2, 2, True, True, model=QWEN), case(2, 2, True, tied=True, tile=3),
        case(2, 1, True, True),
        case(1, 4, True, model={**MQA, "sliding_window": 40}, seq_len=250),   # ulysses 2 x ring 2, 250 tokens
        case(1, 4, True, model=ONE_HEAD, seq_len=30),                     # ring 4
        case(2, 2, True, True, sp_ring=2, seq_len=29, model={**QWEN, **WINDOW}),   # tp x ring, TP sequence sharding
        case(1, 2, False, sp_ring=2, model=MQA, seq_len=33),              # ring 2 x dp 2, plain causal
        # head chunks: tp x Ulysses with TP sequence sharding (KV replicated in each chunk); Ulysses 4; ulysses
        # 2 x ring 2 under activation checkpointing
        case(2, 2, True, True, tied=True, model=GQA_2_PER_RANK, chunks=2), case(1, 4, True, chunks=2),
        case(1, 4, True, sp_ring=2, model={**GQA_2_PER_RANK, **QWEN}, seq_len=30, chunks=2, ckpt=True)],
}


@pytest.mark.parametrize("world", [2, 4])
def test_parity_matrix(tmp_path, world):
    # the 8-rank matrix (sp = 3, 5, 6, 7, 8) runs in test_ring.py's group of 8 ranks
    results = run_distributed(model_parity_worker, world, tmp_path, args=(CASES[world],), timeout=400)
    check_model_parity(results, CASES[world])


def test_document_mask_changes_the_loss():
    """Guard against a mask that silently does nothing: packed documents, the sliding window and the q/k
    head norms must change the result."""
    cfg = ModelConfig(**CFG)
    batch = make_batch(B)
    assert abs(reference(cfg, batch, True)[0] - reference(cfg, batch, False)[0]) > 1e-4
    window = reference(ModelConfig(**CFG, **MISTRAL), batch, True)[0]
    assert abs(window - reference(ModelConfig(**CFG, head_dim=12), batch, True)[0]) > 1e-4
    model = GPTStage(ModelConfig(**CFG, **QWEN))
    init_weights(model, seed=7)
    with torch.no_grad():
        pos = torch.arange(S).expand(B, S)
        logits = model(batch[0][:B], pos)[..., :CFG["vocab_size"]]
        for layer in model.layers.values():      # a norm weight the init leaves at 1 must reach the output
            layer.attn.k_norm.weight.mul_(2.0)
        assert (model(batch[0][:B], pos)[..., :CFG["vocab_size"]] - logits).abs().max() > 1e-4


def test_same_seed_same_full_model():
    """Initialisation is by name and full tensor: two builds give identical weights; another seed does not."""
    cfg = ModelConfig(**CFG)
    a, b, c = GPTStage(cfg), GPTStage(cfg), GPTStage(cfg)
    init_weights(a, 7), init_weights(b, 7), init_weights(c, 8)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "norm" not in n:
            assert not torch.equal(pa, pc), n
