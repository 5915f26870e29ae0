"""The parity runners: a layout against one process, at two depths.

The model: one forward and backward of `GPTStage` at a layout (tp, sp = ulysses x ring, dp) and policy, its
loss and every parameter's full gradient against the single-process reference built from the same seed
(`model_parity_worker`, `check_model_parity`; a case is made by `case`).

The run: each layout trained through the real training loop (`run_layouts`, ranks running `train_worker`),
or one step of a layout's model and optimizer (`step_worker`); losses, gradient norms, validation losses
and final weights against a reference run (`check_run`).

The test files hold their own layouts and run them through these.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from megalysses.config import ModelConfig, RopeScalingConfig
from megalysses.config.checks import check_heads
from megalysses.config.io import load_config
from megalysses.degrees import Degrees
from megalysses.grid import ParallelGrid
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.model.layers import ParallelGroups
from megalysses.model.policies import apply_activation_policy
from megalysses.parallel.sequence_layout import shard_sample
from megalysses.plan import ActivationPolicy
from megalysses.testing import run_distributed
from tests.fixtures import TRAIN_PARITY, full_gradient, full_weights, rank_weights, rel_max, rel_norm, series

# ----------------------------------------------------------------------------- the model at a layout

S, B = 32, 2
CFG = dict(vocab_size=120, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, attention_backend="sdpa")


def make_batch(global_batch: int, seq_len: int = S, seed: int = 0, eod: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, CFG["vocab_size"], (global_batch, seq_len + 1), generator=g)
    ids[0, seq_len * 9 // 32] = eod
    ids[0, seq_len * 20 // 32] = eod
    ids[-1, seq_len * 15 // 32] = eod
    inputs, labels = ids[:, :-1].clone(), ids[:, 1:].clone()
    labels[0, :3] = -100                                          # masked tokens are not counted
    doc = torch.cumsum((inputs == eod).long(), dim=1)
    doc_ids = torch.cat([torch.zeros(global_batch, 1, dtype=torch.long), doc[:, :-1]], dim=1)
    # positions restart after each EOD
    start = torch.zeros_like(inputs)
    idx = torch.arange(seq_len).expand_as(inputs)
    start[:, 1:] = torch.where(inputs[:, :-1] == eod, idx[:, 1:], 0)
    start = torch.cummax(start, dim=1).values
    return inputs, labels, idx - start, doc_ids


def reference(cfg: ModelConfig, batch, docs: bool):
    model = GPTStage(cfg)
    init_weights(model, seed=7)
    inputs, labels, pos, doc_ids = batch
    if not docs:
        pos = torch.arange(inputs.shape[1]).expand_as(inputs)
    loss = model(inputs, pos, doc_ids=doc_ids if docs else None, labels=labels) / (labels != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def local_batch(batch, grid: ParallelGrid, seq_par: bool, docs: bool):
    """This rank's rows (dp) and positions (sp, padded to the layout's multiple) of the global batch."""
    inputs, labels, pos, doc_ids = (t[grid.dp_rank * B:(grid.dp_rank + 1) * B] for t in batch)
    if not docs:
        pos = torch.arange(inputs.shape[1]).expand_as(inputs)
    shard = shard_sample(grid.sequence_layout(seq_par), grid.sp_rank, inputs.numpy(), labels.numpy(),
                         pos.numpy(), doc_ids.numpy() if docs else None, pad_id=0)
    return {k: torch.from_numpy(v) for k, v in shard.items()}


def model_parity_worker(rank, world, cases):
    """Each case's relative errors against the single-process reference on this rank (run with run_distributed)."""
    results = []
    for case in cases:
        tp, sp, docs, seq_par, tied, tile = (case[k] for k in ("tp", "sp", "docs", "seq_par", "tied", "tile"))
        cfg = ModelConfig(**{**CFG, **case.get("model", {})}, tie_embeddings=tied)
        seq_len, used = case.get("seq_len", S), case.get("world", world)
        ring = check_heads(cfg.num_heads, cfg.kv_heads, tp, sp, case.get("sp_ring", 0))[1]
        # ranks past `used` create the same process groups (as rank 0 would) and sit the case out
        grid = ParallelGrid(Degrees.of_world(used, tp=tp, sp=sp, ring=ring), rank=rank if rank < used else 0)
        if rank >= used:
            continue
        batch = make_batch(B * grid.dp_size, seq_len)
        ref_loss, ref_grads = reference(cfg, batch, docs)

        groups = ParallelGroups(tp=grid.tp_group, ulysses=grid.ulysses_group, ring=grid.ring_group,
                                sequence_parallel=seq_par)
        mb = local_batch(batch, grid, seq_par, docs)
        count = (batch[1] != -100).sum()                              # the GLOBAL count of valid tokens

        policy = ActivationPolicy(loss_chunk_tokens=tile, mlp_chunk_tokens=tile, checkpointing=case.get("ckpt", False))
        chunks = case.get("chunks", 1)
        total, grads, logits = _run_layout(cfg, grid, groups, replace(policy, head_chunks=chunks), mb, count)
        errs = {"loss": rel_max(total, ref_loss)}
        for name, g in grads.items():
            errs[name] = rel_max(g, ref_grads[name])
        assert set(errs) - {"loss"} == set(ref_grads), "parameter names differ from the reference"
        if chunks > 1:       # the same layout with all heads at once: within CHUNKED_TOLERANCE
            total1, grads1, logits1 = _run_layout(cfg, grid, groups, policy, mb, count)
            errs[f"{CHUNKED}loss"] = rel_max(total, total1)
            errs[f"{CHUNKED}logits"] = rel_max(logits[logits.isfinite()], logits1[logits1.isfinite()])
            errs.update({f"{CHUNKED}{name}": rel_max(g, grads1[name]) for name, g in grads.items()})
        results.append(({**case, "dp": grid.dp_size, "ulysses": grid.ulysses_size, "ring": ring}, errs))
    return results


CHUNKED, CHUNKED_TOLERANCE = "head chunks against all heads at once: ", 1e-6


def _run_layout(cfg: ModelConfig, grid: ParallelGrid, groups: ParallelGroups, policy: ActivationPolicy, mb: dict,
                count: torch.Tensor):
    """(global loss, full gradients, this rank's logits) of the model at this layout and policy."""
    model = apply_activation_policy(GPTStage(cfg, groups), policy)
    init_weights(model, seed=7, tp_rank=grid.tp_rank, tp_size=grid.tp_size)
    with torch.no_grad():
        logits = model(mb["input_ids"], mb["position_ids"], doc_ids=mb.get("doc_ids"))
    loss = model(mb["input_ids"], mb["position_ids"], doc_ids=mb.get("doc_ids"), labels=mb["labels"]) / count
    loss.backward()
    total = loss.detach().clone()
    if grid.grad_group is not None:
        dist.all_reduce(total, group=grid.grad_group)
    return total, {name: full_gradient(grid, p) for name, p in model.named_parameters()}, logits


def case(tp, sp, docs=False, seq_par=False, tied=False, tile=0, **extra) -> dict:
    """A model-parity case: tp, sp, packed documents, TP sequence sharding, tied embeddings, the loss and MLP tile;
    `extra`: model (ModelConfig fields), sp_ring, seq_len, world (ranks used), chunks (head chunks), ckpt."""
    return dict(tp=tp, sp=sp, docs=docs, seq_par=seq_par, tied=tied, tile=tile, **extra)


# model variants the cases take (`case(..., model=QWEN)`)
MQA = {"num_heads": 2, "num_kv_heads": 1}            # 2 query heads, 1 KV head
ONE_HEAD = {"num_heads": 1, "num_kv_heads": 1}
THREE_HEADS = {"num_heads": 3, "num_kv_heads": 3, "hidden_size": 48}
GQA_2_PER_RANK = {"num_heads": 8, "num_kv_heads": 4}   # at sp=2: 2 KV heads (and 4 query heads) a rank
MHA_2_PER_RANK = {"num_heads": 4, "num_kv_heads": 4}
BIASES = {"attention_bias": True, "mlp_bias": True}
# Qwen3's q/k head norms with Qwen2's q/k/v-only biases, heads of 12 (a q width of 96 at hidden 64), YaRN; Mistral's
# head width and a sliding window shorter than the sequence
QWEN = {"qk_layernorm": True, "add_qkv_bias": True, "head_dim": 12,
        "rope_scaling": RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=16)}
WINDOW = {"sliding_window": 7}
MISTRAL = {"head_dim": 12, **WINDOW}
LAYERNORM = {**BIASES, "norm": "layernorm", "mlp": "gelu"}


def check_model_parity(results: list, cases: list) -> None:
    """Every case ran, and every rank's loss and gradients equal the reference's within 1e-5 relative; with head
    chunks, the loss, logits and gradients equal those of the same layout without them within 1e-6."""
    ran = {tuple(sorted((k, str(v)) for k, v in layout.items()))
           for rank_results in results for layout, _ in rank_results}
    assert len(ran) == len(cases)
    for rank_results in results:
        for layout, errs in rank_results:
            bad = {k: v for k, v in errs.items() if v > (CHUNKED_TOLERANCE if k.startswith(CHUNKED) else 1e-5)}
            assert not bad, f"{layout}: relative errors {bad}"




# ----------------------------------------------------------------------------- a run at a layout

class Run(NamedTuple):
    """What a run is compared by: its logged losses, the full final weights, gradient norms, validation losses."""
    losses: list
    weights: dict
    grad_norms: list
    val_losses: list


def train_worker(rank, world, runs):
    """Train each (run_dir, overrides on TRAIN_PARITY) in turn on this world; return this rank's parameter shards
    (`rank_weights`, for `full_weights`)."""
    from megalysses.training import loop
    from megalysses.testing import plan_and_grid

    out = []
    for run_dir, overrides in runs:
        cfg = load_config(overrides=TRAIN_PARITY + overrides + [f"logging.run_dir={run_dir}"])
        run, grid = plan_and_grid(cfg, torch.device("cpu"))
        shards = {}
        original = loop.build_run

        def keep(*args, original=original, shards=shards, **kwargs):
            shards["run"] = original(*args, **kwargs)
            return shards["run"]

        loop.build_run = keep
        try:
            loop.train(cfg, run, grid, torch.device("cpu"))
        finally:
            loop.build_run = original
        out.append(rank_weights(shards["run"].model, grid))
    return out


def logged(run_dir: str | Path, weights: dict | None = None) -> Run:
    """A run's metrics.jsonl (and its final weights, where gathered) as a Run."""
    return Run(series(run_dir, "loss"), weights or {}, series(run_dir, "grad_norm"), series(run_dir, "val_loss"))


def run_layouts(tmp_path: Path, world: int, names: list[str], layouts: dict, chat: str = "") -> dict[str, Run]:
    """Train each named layout of `layouts` (name: (world, overrides)) on `world` ranks, in one spawned group;
    `chat` replaces {chat} in the overrides (the conversations' prefix)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    runs = [(str(tmp_path / n), [o.replace("{chat}", chat) for o in layouts[n][1]]) for n in names]
    per_rank = run_distributed(train_worker, world, tmp_path, args=(runs,), timeout=400)
    return {n: logged(tmp_path / n, full_weights([r[i] for r in per_rank])) for i, n in enumerate(names)}


def step_worker(rank, world, runs):
    """Build each (name, overrides) run's model and optimizer (as a run does) and take one training step on its
    grid; return {name: (loss, gradient norm)}."""
    from megalysses.config.checks import validate_config
    from megalysses.training.build import Parts, build_run
    from megalysses.testing import plan_and_grid, resolve_run
    from megalysses.training.step import train_step

    device, out, grids = torch.device("cpu"), {}, {}
    for name, overrides in runs:
        cfg = load_config(overrides=overrides)
        validate_config(cfg, world_size=world)
        p = cfg.parallel
        key = (p.tp, p.sp, p.pp, p.sp_ring)
        if key not in grids:
            grids[key] = plan_and_grid(cfg, device)[1]
        grid = grids[key]
        runtime = resolve_run(cfg, device, grid)
        built = build_run(cfg, runtime, grid, device, Parts(data=True))
        model, opt = built.model, built.opt
        batch = next(built.data.train_batches(0))
        result = train_step(model, opt, batch, grid, lr=cfg.optimizer.lr, grad_clip=cfg.optimizer.grad_clip,
                            dtype=runtime.torch_dtype, nan_policy="error")
        out[name] = (result.loss, result.grad_norm)
    return out


def one_step(per_rank: list[dict], name: str) -> Run:
    """A layout's step from `step_worker` on every rank, as a Run; every rank must report the same loss and norm."""
    losses, norms = {r[name][0] for r in per_rank}, {r[name][1] for r in per_rank}
    assert len(losses) == 1 and len(norms) == 1, f"{name}: ranks disagree: losses {losses}, norms {norms}"
    return Run([losses.pop()], {}, [norms.pop()], [])


SCALARS = {"losses": "loss", "grad_norms": "gradient norm", "val_losses": "validation loss"}


def check_run(want: Run, got: Run, name: str, steps: int = 3, evals: int = 1, tol: float | dict = 1e-5,
              quantities: tuple = ("val_losses", "losses", "grad_norms", "weights")) -> None:
    """`got` equals `want` in each of `quantities`: `steps` losses and gradient norms, `evals` validation losses,
    each within `tol` relative (a float, or one per quantity), and every final weight within `tol` in the
    Frobenius norm. Comparing weights, the reference's loss must have fallen (the optimizer moved them)."""
    tols = tol if isinstance(tol, dict) else dict.fromkeys(quantities, tol)
    for q in quantities:
        if q == "weights":
            continue
        a, b, count = getattr(got, q), getattr(want, q), evals if q == "val_losses" else steps
        assert len(a) == len(b) == count, f"{name}: {SCALARS[q]}es {a} and {b}, expected {count} of each"
        for step, (x, y) in enumerate(zip(a, b), 1):
            assert abs(x - y) <= tols[q] * abs(y), f"{name}: {SCALARS[q]} {step}: {a} != {b}"
    if "weights" in quantities:
        assert set(got.weights) == set(want.weights), f"{name}: parameter names differ"
        bad = {n: err for n, w in want.weights.items() if (err := rel_norm(got.weights[n], w)) > tols["weights"]}
        assert not bad, f"{name}: final weights differ: {bad}"
        if "losses" in quantities:      # the optimizer really moved the weights (a test that cannot fail is none)
            assert want.losses[-1] < want.losses[0], f"{name}: the reference's loss did not fall: {want.losses}"
