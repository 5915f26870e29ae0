"""Every layout the config accepts builds its stages and trains: each combination of what decides how a
pipeline stage is built (pp 1 to 4, virtual stages, tied or untied embeddings, ZeRO-1 or FSDP), each
with tp, Ulysses sp, ring sp or dp beside it, builds its model and optimizer and takes one step whose
loss and gradient norm equal one process's. One spawned group per world size loops over its layouts."""
import itertools

import pytest
import torch

from megalysses.config.io import load_config
from megalysses.testing import run_distributed

BASE = ["data.mock=true", "data.seq_len=16", "model.vocab_size=64", "model.hidden_size=16", "model.num_heads=4",
        "model.num_kv_heads=2", "model.ffn_hidden_size=32", "model.attention_backend=sdpa",
        "training.micro_batch_size=1", "training.train_steps=1",
        "optimizer.warmup_steps=1", "parallel.timeout_seconds=60"]
BESIDE = {"": [], "tp2": ["parallel.tp=2"], "sp2": ["parallel.sp=2"],
          "ring2": ["parallel.sp=2", "parallel.sp_ring=2"], "dp2": [],
          # attention in 2 head chunks over Ulysses (each chunk's KV head replicated), up to 2 stages
          "sp2_chunks2": ["parallel.sp=2", "training.attention_head_chunks=2"]}


def layouts() -> dict[str, tuple[int, tuple[int, bool], list[str]]]:
    """name: (world, (num_layers, tied, global batch): the reference it equals, overrides). One layer per
    virtual stage; 2 * pp sequences a step, so that every dp rank's micro-batches are a multiple of pp."""
    out = {}
    for pp, v, tied, fsdp, beside in itertools.product((1, 2, 3, 4), (1, 2), (True, False), (False, True), BESIDE):
        if (pp == 1 and v > 1) or (beside == "sp2_chunks2" and pp > 2):
            continue
        layers = pp * v
        name = f"pp{pp}" + (f"v{v}" if v > 1 else "") + ("_tied" if tied else "") + ("_fsdp" if fsdp else "") \
            + (f"_{beside}" if beside else "")
        out[name] = (pp * (2 if beside else 1), (layers, tied, 2 * pp),
                     [f"parallel.pp={pp}", f"parallel.virtual_stages={v}", f"model.tie_embeddings={tied}",
                      f"parallel.fsdp={fsdp}", f"model.num_layers={layers}", f"training.global_batch_size={2 * pp}"]
                     + BESIDE[beside])
    return out


LAYOUTS = layouts()


def _one_step(rank, world, runs):
    """Build each layout's model and optimizer (as a run does) and take one training step on its grid."""
    from megalysses.config.checks import validate_config
    from megalysses.training.data import TrainingData
    from megalysses.training.loop import build_model_and_optimizer
    from megalysses.training.runtime import plan_and_grid, resolve_run
    from megalysses.training.step import train_step

    device, out, grids = torch.device("cpu"), {}, {}
    for name, overrides in runs:
        cfg = load_config(overrides=BASE + overrides)
        validate_config(cfg, world_size=world)
        p = cfg.parallel
        key = (p.tp, p.sp, p.pp, p.sp_ring)
        if key not in grids:
            grids[key] = plan_and_grid(cfg, device)[1]
        grid = grids[key]
        runtime = resolve_run(cfg, device, grid)
        model, opt = build_model_and_optimizer(cfg, grid, device, runtime)
        batch = next(TrainingData(cfg, grid, runtime, device).train_batches(0))
        result = train_step(model, opt, batch, grid, lr=cfg.optimizer.lr, grad_clip=cfg.optimizer.grad_clip,
                            dtype=runtime.torch_dtype, nan_policy="error")
        out[name] = (result.loss, result.grad_norm)
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    shapes = sorted({ref for _, ref, _ in LAYOUTS.values()})
    runs = [(str((layers, tied, batch)), [f"model.num_layers={layers}", f"model.tie_embeddings={tied}",
                                          f"training.global_batch_size={batch}"]) for layers, tied, batch in shapes]
    got = run_distributed(_one_step, 1, tmp_path_factory.mktemp("ref"), args=(runs,))[0]
    return {shape: got[str(shape)] for shape in shapes}


@pytest.mark.parametrize("world", sorted({w for w, _, _ in LAYOUTS.values()}))
def test_every_layout_builds_and_takes_a_step(tmp_path, references, world):
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
    per_rank = run_distributed(_one_step, world, tmp_path, args=([(n, LAYOUTS[n][2]) for n in names],),
                               timeout=300)
    for name in names:
        ref_loss, ref_norm = references[LAYOUTS[name][1]]
        losses = {r[name][0] for r in per_rank}
        norms = {r[name][1] for r in per_rank}
        assert len(losses) == 1 and len(norms) == 1, f"{name}: ranks disagree: losses {losses}, norms {norms}"
        loss, norm = losses.pop(), norms.pop()
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{name}: loss {loss} != one process's {ref_loss}"
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), f"{name}: gradient norm {norm} != {ref_norm}"
