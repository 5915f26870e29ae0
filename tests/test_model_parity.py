"""The parallel GPT equals one process: loss and every parameter gradient, layout by layout.

Each spawned group runs several layouts (tp, sp, dp) and variants (packed documents, TP sequence
sharding, tied embeddings); every rank also builds the single-process reference from the same seed.
"""
import pytest
import torch

from megalysses.config import ModelConfig
from megalysses.grid import ParallelGrid
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.model.layers import ParallelGroups
from megalysses.testing import run_distributed

S, B = 32, 2
CFG = dict(vocab_size=120, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, attention_backend="sdpa")


def make_batch(global_batch: int, seed: int = 0, eod: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, CFG["vocab_size"], (global_batch, S + 1), generator=g)
    ids[0, 9] = eod
    ids[0, 20] = eod
    ids[-1, 15] = eod
    inputs, labels = ids[:, :-1].clone(), ids[:, 1:].clone()
    labels[0, :3] = -100                                          # masked tokens are not counted
    doc = torch.cumsum((inputs == eod).long(), dim=1)
    doc_ids = torch.cat([torch.zeros(global_batch, 1, dtype=torch.long), doc[:, :-1]], dim=1)
    # positions restart after each EOD
    start = torch.zeros_like(inputs)
    idx = torch.arange(S).expand_as(inputs)
    start[:, 1:] = torch.where(inputs[:, :-1] == eod, idx[:, 1:], 0)
    start = torch.cummax(start, dim=1).values
    return inputs, labels, idx - start, doc_ids


def reference(cfg: ModelConfig, batch, docs: bool):
    model = GPTStage(cfg)
    init_weights(model, seed=7)
    inputs, labels, pos, doc_ids = batch
    if not docs:
        pos = torch.arange(S).expand_as(inputs)
    loss = model(inputs, pos, doc_ids=doc_ids if docs else None, labels=labels) / (labels != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def gather_full(grid: ParallelGrid, p: torch.nn.Parameter) -> torch.Tensor:
    g = p.grad.clone()
    torch.distributed.all_reduce(g, group=grid.grad_group) if grid.grad_group is not None else None
    tp_dim = getattr(p, "tp_dim", None)
    if tp_dim is None or grid.tp_size == 1:
        return g
    parts = [torch.empty_like(g) for _ in range(grid.tp_size)]
    torch.distributed.all_gather(parts, g.contiguous(), group=grid.tp_group)
    return torch.cat(parts, dim=tp_dim)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _parity_worker(rank, world, cases):
    import torch.distributed as dist

    results = []
    for tp, sp, docs, seq_par, tied, tile in cases:
        cfg = ModelConfig(**CFG, tie_embeddings=tied)
        grid = ParallelGrid(tp=tp, sp=sp)
        batch = make_batch(B * grid.dp_size)
        ref_loss, ref_grads = reference(cfg, batch, docs)

        groups = ParallelGroups(tp=grid.tp_group, sp=grid.sp_group, sequence_parallel=seq_par)
        model = GPTStage(cfg, groups, loss_chunk_tokens=tile, mlp_chunk_tokens=tile)
        init_weights(model, seed=7, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
        inputs, labels, pos, doc_ids = (t[grid.dp_rank * B:(grid.dp_rank + 1) * B] for t in batch)
        if not docs:
            pos = torch.arange(S).expand_as(inputs)
        chunk = slice(grid.sp_rank * S // sp, (grid.sp_rank + 1) * S // sp)
        count = (batch[1] != -100).sum()                              # the GLOBAL count of valid tokens
        loss = model(inputs[:, chunk], pos[:, chunk], doc_ids=doc_ids if docs else None,
                     labels=labels[:, chunk]) / count
        loss.backward()
        total = loss.detach().clone()
        if grid.grad_group is not None:
            dist.all_reduce(total, group=grid.grad_group)
        errs = {"loss": rel_err(total, ref_loss)}
        for name, p in model.named_parameters():
            errs[name] = rel_err(gather_full(grid, p), ref_grads[name])
        assert set(errs) - {"loss"} == set(ref_grads), "parameter names differ from the reference"
        results.append(((tp, sp, grid.dp_size, docs, seq_par, tied, tile), errs))
    return results


# (tp, sp, packed documents, TP sequence sharding, tied embeddings, loss and MLP tile tokens); dp = world / (tp * sp)
CASES = {
    2: [(2, 1, False, False, False, 0), (2, 1, True, True, True, 4), (1, 2, False, False, False, 0),
        (1, 2, True, False, True, 0), (1, 1, True, False, False, 0)],
    4: [(1, 4, False, False, False, 0), (1, 4, True, False, False, 0), (2, 2, False, False, True, 0),
        (2, 2, True, True, False, 0), (2, 2, True, False, True, 3), (2, 1, True, True, False, 0)],
}   # sp=4 with 2 KV heads forces KV replication


@pytest.mark.parametrize("world", [2, 4])
def test_parity_matrix(tmp_path, world):
    results = run_distributed(_parity_worker, world, tmp_path, args=(CASES[world],))
    for rank_results in results:
        for layout, errs in rank_results:
            bad = {k: v for k, v in errs.items() if v > 1e-5}
            assert not bad, f"(tp, sp, dp, docs, tp_seq, tied, tile)={layout}: relative errors {bad}"


def test_document_mask_changes_the_loss():
    """Guard against a mask that silently does nothing: packed documents must change the result."""
    cfg = ModelConfig(**CFG)
    batch = make_batch(B)
    assert abs(reference(cfg, batch, True)[0] - reference(cfg, batch, False)[0]) > 1e-4


def test_same_seed_same_full_model():
    """Initialisation is by name and full tensor: two builds give identical weights; another seed does not."""
    cfg = ModelConfig(**CFG)
    a, b, c = GPTStage(cfg), GPTStage(cfg), GPTStage(cfg)
    init_weights(a, 7), init_weights(b, 7), init_weights(c, 8)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "norm" not in n:
            assert not torch.equal(pa, pc), n
