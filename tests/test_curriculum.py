"""Sequence-length curriculum (data.seq_len_schedule) through the real training loop: the lengths change
at the scheduled steps with the tokens per step constant, every layout (sp as Ulysses and as a ring, tp,
pp, dp) trains like one process, metrics.jsonl and the log show the length, and a run resumed in the
middle of a stage or across a stage boundary repeats the uninterrupted run's losses bit for bit."""
import contextlib
import io

import torch
import torch.distributed as dist

from megalysses.config.io import load_config
from megalysses.testing import run_distributed
from megalysses.training import loop
from tests.fixtures import full_weights, losses, metrics
from tests.parity import train_worker

# steps 1-2 at 2 tokens (16 sequences per sample), 3-4 at 16 (2), 5-6 at 32; validation at 32 on steps 3, 6
SCHEDULE = ["data.seq_len_schedule=[[0, 2], [2, 16], [4, 32]]", "training.train_steps=6",
            "training.global_batch_size=4", "model.num_layers=2"]
LENGTHS = [2, 2, 16, 16, 32, 32]
SEQ, GBS = 32, 4
LAYOUTS = {  # name: (overrides, sp, dp, the multiple each sequence is padded to)
    "sp2": (["parallel.sp=2"], 2, 1, 2),
    "ring2": (["parallel.sp=2", "parallel.sp_ring=2"], 2, 1, 4),   # 2 zigzag chunks per rank: 2 tokens padded to 4
    "tp2": (["parallel.tp=2", "parallel.tp_sequence_parallel=true"], 1, 1, 2),
    "pp2": (["parallel.pp=2", "training.activation_checkpointing=true"], 1, 1, 1),
    "dp2": ([], 1, 2, 1),
}


def _recording_worker(rank, world, runs):
    """train_worker on each run, also returning the input shapes of every step's micro-batches on this rank
    and what rank 0 printed."""
    out, original = [], loop.train_step
    for run in runs:
        shapes = []

        def record(model, opt, batch, *args, shapes=shapes, **kwargs):
            shapes.append([tuple(mb["input_ids"].shape) for mb in batch])
            return original(model, opt, batch, *args, **kwargs)

        loop.train_step, text = record, io.StringIO()
        try:
            with contextlib.redirect_stdout(text):
                (result,) = train_worker(rank, world, [run])
        finally:
            loop.train_step = original
        out.append({**result, "shapes": shapes, "printed": text.getvalue()})
    return out


def _reference(run_dir):
    """The schedule on one process, trained in this process (a gloo group of one)."""
    dist.init_process_group("gloo", init_method=f"file://{run_dir.parent}/store", rank=0, world_size=1)
    try:
        return _recording_worker(0, 1, [(str(run_dir), SCHEDULE)])[0]
    finally:
        dist.destroy_process_group()


def test_schedule_at_every_layout_and_exact_resume(tmp_path):
    ref = _reference(tmp_path / "single")
    ref_losses = losses(tmp_path / "single")

    # the lengths change at the scheduled steps; each step has the same micro-batches and tokens
    rows = [r for r in metrics(tmp_path / "single") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and [r["seq_len"] for r in rows] == LENGTHS
    assert ref["shapes"] == [[(SEQ // n, n)] * GBS for n in LENGTHS]
    printed = ref["printed"].splitlines()
    assert "seq_len 2 -> 16 at step 3 -> 32 at step 5" in printed[0]
    phases = [line for line in printed if line.startswith("seq_len ")]
    cuts = [(2, 1, "each sample of 32 tokens cut into 16 sequences"),
            (16, 3, "each sample of 32 tokens cut into 2 sequences"), (32, 5, "whole samples")]
    assert phases == [f"seq_len {n} from step {step} (phase {k} of 3 of data.seq_len_schedule: {cut})"
                      for k, (n, step, cut) in enumerate(cuts, 1)]
    assert printed.index(phases[1]) == printed.index(next(x for x in printed if x.startswith("step      2/6"))) + 1
    assert [x.split(" | ")[1] for x in printed if x.startswith("step ") and "| seq " in x] == \
        [f"seq {n}" for n in LENGTHS]
    assert len([r for r in metrics(tmp_path / "single") if "val_loss" in r]) == 2

    split = tmp_path / "split"
    runs = [(str(tmp_path / name), SCHEDULE + overrides) for name, (overrides, *_) in LAYOUTS.items()]
    runs += [  # interrupted inside the 16-token stage (after step 3), then where it ends (after step 4)
        (str(split), SCHEDULE + ["parallel.sp=2", "training.exit_at_step=3"]),
        (str(split), SCHEDULE + ["parallel.sp=2", "training.exit_at_step=4"]),
        (str(split), SCHEDULE + ["parallel.sp=2"]),
    ]
    per_rank = run_distributed(_recording_worker, 2, tmp_path, args=(runs,), timeout=400)

    for i, (name, (_, sp, dp, multiple)) in enumerate(LAYOUTS.items()):
        assert [r["seq_len"] for r in metrics(tmp_path / name) if "loss" in r] == LENGTHS, name
        padded = [-(-n // multiple) * multiple for n in LENGTHS]
        for rank in per_rank:
            shapes = rank[i]["shapes"]
            assert [len(s) for s in shapes] == [GBS // dp] * 6, name            # the same micro-batches
            # ... of the same samples (tokens per step constant), cut to the step's length, padded, sharded
            assert shapes == [[(SEQ // n, p // sp)] * (GBS // dp) for n, p in zip(LENGTHS, padded)], name
        for step, (a, b) in enumerate(zip(losses(tmp_path / name), ref_losses, strict=True), 1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name}: step {step} loss {a} != {b}"

    # resumed inside a stage and across a stage boundary: the sp2 run's losses and weights, bit for bit
    assert [r["step"] for r in metrics(split) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["seq_len"] for r in metrics(split) if "loss" in r] == LENGTHS
    assert losses(split) == losses(tmp_path / "sp2"), "the resumed run is not bit-for-bit"
    sp2 = full_weights([r[0] for r in per_rank])
    weights = [full_weights([r[k] for r in per_rank]) for k in (5, 6, 7)]
    assert all(torch.equal(weights[2][n], w) for n, w in sp2.items())
    for stopped in weights[:2]:                          # the first two parts really stopped early
        assert not all(torch.equal(stopped[n], w) for n, w in sp2.items())
    assert [len(per_rank[0][k]["shapes"]) for k in (5, 6, 7)] == [3, 1, 2]
    assert [s[0][1] * 2 for k in (5, 6, 7) for s in per_rank[0][k]["shapes"]] == LENGTHS
    for k, stopped in ((6, 3), (7, 4)):                 # each resumed part names its length first
        printed = per_rank[0][k]["printed"]
        assert f"at step {stopped}" in printed
        assert f"seq_len {LENGTHS[stopped]} from step {stopped + 1} (phase " in printed


def test_the_8b_config_grows_to_its_length():
    cfg = load_config("configs/llama3_8b_128k.yaml", ["data.mock=true", "data.paths=[]"])
    d = cfg.data
    assert [d.seq_len_at(s) for s in (0, 999, 1000, 2499, 2500, cfg.training.train_steps - 1)] == \
        [8192, 8192, 32768, 32768, 131072, 131072]
