"""Every layout the config accepts builds its stages and trains: each combination of what decides how a
pipeline stage is built (pp 1 to 4, virtual stages, tied or untied embeddings, ZeRO-1 or FSDP), each
with tp, Ulysses sp, ring sp or dp beside it, builds its model and optimizer and takes one step whose
loss and gradient norm equal one process's. One spawned group per world size loops over its layouts."""
import itertools

import pytest

from megalysses.testing import run_distributed
from tests.parity import check_run, one_step, step_worker

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


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    shapes = sorted({ref for _, ref, _ in LAYOUTS.values()})
    runs = [(str((layers, tied, batch)), BASE + [f"model.num_layers={layers}", f"model.tie_embeddings={tied}",
                                                 f"training.global_batch_size={batch}"])
            for layers, tied, batch in shapes]
    got = run_distributed(step_worker, 1, tmp_path_factory.mktemp("ref"), args=(runs,))
    return {shape: one_step(got, str(shape)) for shape in shapes}


@pytest.mark.parametrize("world", sorted({w for w, _, _ in LAYOUTS.values()}))
def test_every_layout_builds_and_takes_a_step(tmp_path, references, world):
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
    per_rank = run_distributed(step_worker, world, tmp_path, args=([(n, BASE + LAYOUTS[n][2]) for n in names],),
                               timeout=300)
    for name in names:
        check_run(references[LAYOUTS[name][1]], one_step(per_rank, name), name, steps=1,
                  quantities=("losses", "grad_norms"))
