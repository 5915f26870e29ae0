"""Checkpoints: resume is exact at the same layout, close at another (resharding), a save killed
halfway leaves the previous checkpoint as `latest`, and checkpoint.init_from a run starts a new run from
its weights."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from megalysses.testing import DistributedTestError, run_distributed
from tests.fixtures import full_weights, losses, rel_norm, step_rows
from tests.parity import train_worker

SIX = ["training.train_steps=6", "optimizer.warmup_steps=2"]
TP2SP2 = ["parallel.tp=2", "parallel.sp=2"]
PP2DP2 = ["parallel.pp=2"]


def _steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in step_rows(run_dir)]


def _train_scrambled_if_init(rank, world, runs):
    """train_worker, except that a run with checkpoint.init_from starts from a model whose freshly built
    weights are scrambled: unless init_from loads the source's weights, that run trains another model."""
    from megalysses.training import build as builder

    original = builder.build_model

    def build(cfg, *args):
        model = original(cfg, *args)
        if cfg.checkpoint.init_from:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-0.5).add_(0.01)
        return model

    builder.build_model = build
    return train_worker(rank, world, runs)


def test_resume_exact_and_resharded(tmp_path):
    """Also checkpoint.init_from=<run dir>: `source` saves the seed's initial weights after one step at
    lr 0 (its optimizer state is not fresh); a run started from it at another layout, at step 0 with a
    fresh optimizer, trains as `straight` does from scratch."""
    straight, split, cross = tmp_path / "straight", tmp_path / "split", tmp_path / "cross"
    ring_split, ring_cross = tmp_path / "ring_split", tmp_path / "ring_cross"
    source, init = tmp_path / "source", tmp_path / "init"
    runs = [
        (str(straight), TP2SP2 + SIX),
        (str(split), TP2SP2 + SIX + ["training.exit_at_step=3"]),              # stops with a checkpoint at 3
        (str(split), TP2SP2 + SIX),                                            # resumes from `latest`
        (str(cross), PP2DP2 + SIX + [f"checkpoint.load={split}/checkpoints/step_0000003"]),
        # sp=4 saved as ulysses 2 x ring 2, resumed as ring 4
        (str(ring_split), ["parallel.sp=4", "parallel.sp_ring=2"] + SIX + ["training.exit_at_step=3"]),
        (str(ring_cross), ["parallel.sp=4", "parallel.sp_ring=4"] + SIX +
         [f"checkpoint.load={ring_split}/checkpoints/step_0000003"]),
        (str(source), TP2SP2 + ["training.train_steps=1", "optimizer.lr=0"]),
        (str(init), PP2DP2 + SIX + ["training.exit_at_step=3", f"checkpoint.init_from={source}"]),
    ]
    per_rank = run_distributed(_train_scrambled_if_init, 4, tmp_path, args=(runs,), timeout=400)
    weights = [full_weights([r[i] for r in per_rank]) for i in range(len(runs))]

    assert _steps(split) == [1, 2, 3, 4, 5, 6]
    assert losses(split) == losses(straight), "resume at the same layout is not bit-for-bit"
    for name, w in weights[0].items():
        assert torch.equal(weights[2][name], w), f"{name} differs after resume"
        assert not torch.equal(weights[1][name], w) or "norm" in name   # the first part really stopped at 3

    for run, w, first in ((cross, weights[3], 4), (ring_cross, weights[5], 4), (ring_split, None, 1)):
        assert _steps(run) == list(range(first, first + 3))
        for a, b in zip(losses(run), losses(straight)[first - 1:]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{run.name}: loss {a} != {b}"
        bad = {n: rel_norm(w[n], ref) for n, ref in weights[0].items() if w is not None and rel_norm(w[n], ref) > 1e-5}
        assert not bad, f"{run.name}: resharded resume differs: {bad}"

    assert losses(source)[0] == losses(straight)[0]
    assert _steps(init) == [1, 2, 3]
    for a, b in zip(losses(init), losses(straight)[:3]):
        assert abs(a - b) <= 1e-5 * abs(b), f"init_from: loss {a} != {b} (straight, from scratch)"
    bad = {n: rel_norm(weights[7][n], ref) for n, ref in weights[1].items() if rel_norm(weights[7][n], ref) > 1e-5}
    assert not bad, f"init_from: the weights after 3 steps differ from straight's: {bad}"
    _init_from_bad_input(tmp_path, source)


def _init_from_bad_input(tmp_path: Path, source: Path) -> None:
    """init_from a missing path, a run that saved no checkpoint, a corrupt checkpoint: one ConfigError each
    (pretrain prints it as its one `error:` line), raised before any weight is touched."""
    from megalysses.config import ConfigError
    from megalysses.checkpoint.initial import load_initial_weights

    empty = tmp_path / "no_checkpoints"
    (empty / "checkpoints").mkdir(parents=True)
    shutil.copy(source / "config.yaml", empty / "config.yaml")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(source, corrupt)
    shard = sorted((corrupt / "checkpoints" / "step_0000001").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    for path, message in ((tmp_path / "nope", "does not exist"),
                          (empty, "nor a megalysses run or checkpoint"),
                          (corrupt, "corrupt or incomplete")):
        with pytest.raises(ConfigError, match=message) as e:
            load_initial_weights(str(path), None, None, None, None)
        assert f"checkpoint.init_from={path}" in str(e.value) and "\n" not in str(e.value)
        assert path != corrupt or f"{shard} does not match its checksum" in str(e.value)


def test_fsdp_resume_and_interchange_with_zero1(tmp_path):
    """FSDP resumes bit-for-bit; an FSDP checkpoint resumes under ZeRO-1 at another layout and back."""
    fsdp = ["parallel.fsdp=true"]
    straight, f_straight, f_split = tmp_path / "straight", tmp_path / "f_straight", tmp_path / "f_split"
    z_split, z_from_f, f_from_z = tmp_path / "z_split", tmp_path / "z_from_f", tmp_path / "f_from_z"
    runs = [
        (str(straight), TP2SP2 + SIX),
        (str(f_straight), TP2SP2 + fsdp + SIX),
        (str(f_split), TP2SP2 + fsdp + SIX + ["training.exit_at_step=3"]),
        (str(f_split), TP2SP2 + fsdp + SIX),
        (str(z_split), TP2SP2 + SIX + ["training.exit_at_step=3"]),
        (str(z_from_f), PP2DP2 + SIX + [f"checkpoint.load={f_split}/checkpoints/step_0000003"]),
        (str(f_from_z), PP2DP2 + fsdp + SIX + [f"checkpoint.load={z_split}/checkpoints/step_0000003"]),
    ]
    per_rank = run_distributed(train_worker, 4, tmp_path, args=(runs,), timeout=400)
    weights = [full_weights([r[i] for r in per_rank]) for i in range(len(runs))]

    assert losses(f_split) == losses(f_straight), "FSDP resume at the same layout is not bit-for-bit"
    for name, w in weights[1].items():
        assert torch.equal(weights[3][name], w), f"{name} differs after FSDP resume"
    for run, w in ((z_from_f, weights[5]), (f_from_z, weights[6])):
        assert _steps(run) == [4, 5, 6]
        for a, b in zip(losses(run), losses(straight)[3:]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{run.name}: loss {a} != {b}"
        bad = {n: rel_norm(w[n], ref) for n, ref in weights[0].items() if rel_norm(w[n], ref) > 1e-5}
        assert not bad, f"{run.name}: resumed weights differ: {bad}"


def _rng_worker(rank, world, run_dir):
    """Train one step (saved with the RNG state), reseed, and train again: the second run only loads."""
    one_step = [(run_dir, ["training.train_steps=1", "training.eval_interval=0"])]
    torch.manual_seed(123)
    train_worker(rank, world, one_step)
    saved = torch.load(Path(run_dir) / "checkpoints" / "step_0000001" / f"rng_rank{rank}.pt")["torch"]
    torch.manual_seed(999)
    before = torch.get_rng_state()
    train_worker(rank, world, one_step)
    return torch.equal(before, saved), torch.equal(torch.get_rng_state(), saved)


def test_resume_restores_the_rng_state(tmp_path):
    for equal_before, equal_after in run_distributed(_rng_worker, 1, tmp_path, args=(str(tmp_path / "run"),)):
        assert not equal_before and equal_after


def _batch_size_worker(rank, world, run_dir):
    """The samples consumed at each run's start: 2 steps at a global batch of 4, then on to 3 at 8."""
    from megalysses.training.data import TrainingData

    seen, real = [], TrainingData.train_batches

    def spy(self, consumed):
        seen.append(consumed)
        return real(self, consumed)

    TrainingData.train_batches = spy
    train_worker(rank, world, [(run_dir, [f"training.global_batch_size={gbs}", f"training.train_steps={steps}",
                                           "training.eval_interval=0"]) for gbs, steps in ((4, 2), (8, 3))])
    return seen


def test_resume_at_another_global_batch_size_continues_the_sample_stream(tmp_path):
    assert run_distributed(_batch_size_worker, 1, tmp_path, args=(str(tmp_path / "run"),)) == [[0, 8]]


def _skip_step_2(rank, world, runs):
    """train_worker, with step 2 skipped as a non-finite loss skips it (training.nan_policy=skip)."""
    from megalysses.training import loop
    from megalysses.training.step import StepResult

    at, lr_at, train_step = [0], loop.lr_at, loop.train_step

    def lr_at_spy(step, *args):
        at[0] = step
        return lr_at(step, *args)

    def skip(model, opt, *args, **kwargs):
        if at[0] == 1:
            opt.zero_grad()
            return StepResult(torch.tensor([float("nan"), 0.0, float("nan"), 1.0], dtype=torch.float64))
        return train_step(model, opt, *args, **kwargs)

    loop.lr_at, loop.train_step = lr_at_spy, skip
    return train_worker(rank, world, runs)


def test_resume_after_a_skipped_step_is_exact(tmp_path):
    """The optimizer's step count (bias correction) and the count of updates come back from the checkpoint,
    not from the step number, which counts the skipped step too."""
    six = ["training.train_steps=6", "training.eval_interval=0", "training.nan_policy=skip"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    runs = [(straight, six), (split, six + ["training.exit_at_step=3"]), (split, six)]
    per_rank = run_distributed(_skip_step_2, 1, tmp_path, args=(runs,))
    weights = [full_weights([r[i] for r in per_rank]) for i in range(3)]
    for name, w in weights[0].items():
        assert torch.equal(weights[2][name], w), f"{name} differs after a resume that follows a skipped step"


def _die_during_save(rank, world, runs):
    """Rank 0 dies abruptly while renaming the step-4 checkpoint into place."""
    import megalysses.checkpoint.dcp_io as ckpt

    real = os.replace

    def replace(src, dst):
        if rank == 0 and str(src).endswith("step_0000004.tmp"):
            os._exit(9)
        return real(src, dst)

    ckpt.os.replace = replace
    return train_worker(rank, world, runs)


@pytest.mark.parametrize("mode", ["true", "false"])
def test_killed_save_keeps_previous_checkpoint(tmp_path, mode):
    """Synchronous, or in the background (where rank 0's completing thread dies at the rename)."""
    run = tmp_path / "run"
    common = ["training.train_steps=4", "checkpoint.save_interval=2", "parallel.timeout_seconds=15",
              f"checkpoint.async_save={mode}"]
    run_distributed(train_worker, 2, tmp_path, args=([(str(run), common + ["training.exit_at_step=2"])],))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000002"

    with pytest.raises(DistributedTestError):
        run_distributed(_die_during_save, 2, tmp_path, args=([(str(run), common)],), timeout=120)
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000002"
    assert not (ckpts / "step_0000004").exists()
    logged = losses(run)                      # steps 1, 2, then 3, 4 of the run that died

    run_distributed(train_worker, 2, tmp_path, args=([(str(run), common)],))
    assert (ckpts / "latest").read_text().strip() == "step_0000004"
    assert _steps(run)[-2:] == [3, 4]
    assert losses(run)[-2:] == logged[2:4], "the resumed run did not repeat steps 3-4 exactly"


def _sigkill_during_background_write(rank, world, runs):
    """Rank 0 is SIGKILLed while the step-4 checkpoint is being written in the background, once training has gone
    on to step 6 (the write is held back until then). The run resumes at step 3: its 4th step is step 6."""
    import signal
    import threading
    import time

    import megalysses.checkpoint.dcp_io as ckpt
    from megalysses.training import loop

    trained, real_step, real_checksums = threading.Event(), loop.train_step, ckpt.checksums
    steps = [0]

    def step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == 4 and rank == 0:
            trained.set()
            time.sleep(30)             # the kill lands here, during step 6
        return real_step(*args, **kwargs)

    def checksums(directory, names):
        if rank == 0 and directory.name == "step_0000004.tmp":
            assert threading.current_thread() is not threading.main_thread()
            trained.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_checksums(directory, names)

    loop.train_step, ckpt.checksums = step, checksums
    return train_worker(rank, world, runs)


def test_sigkill_during_a_background_write_keeps_previous_checkpoint(tmp_path):
    """A rank killed while its checkpoint is written in the background (training already a step further) leaves
    `latest` at the previous checkpoint and the step's .tmp directory, which is never resumed; the resumed run
    repeats the steps exactly."""
    run = tmp_path / "run"
    common = ["training.train_steps=6", "checkpoint.save_interval=2", "parallel.timeout_seconds=15",
              "checkpoint.async_save=true"]
    run_distributed(train_worker, 2, tmp_path, args=([(str(run), common + ["training.exit_at_step=2"])],))
    with pytest.raises(DistributedTestError):
        run_distributed(_sigkill_during_background_write, 2, tmp_path, args=([(str(run), common)],), timeout=120)
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000002"
    assert not (ckpts / "step_0000004").exists() and (ckpts / "step_0000004.tmp").is_dir()
    assert _steps(run)[-1] == 5, "training did not go on while the checkpoint was written"
    logged = losses(run)                      # steps 1, 2, then 3, 4, 5 of the run that was killed

    run_distributed(train_worker, 2, tmp_path, args=([(str(run), common)],))
    assert (ckpts / "latest").read_text().strip() == "step_0000006"
    assert _steps(run)[-4:] == [3, 4, 5, 6]
    assert losses(run)[-4:-1] == logged[2:5], "the resumed run did not repeat steps 3-5 exactly"


def _staged_worker(rank, world, runs):
    """train_worker, recording this rank's staging arena (capacity, high water) as each background saver closes."""
    from megalysses.checkpoint.background import BackgroundSaver

    seen, close = [], BackgroundSaver.close

    def spy(self):
        seen.append((self.staging.arena.capacity, self.staging.arena.high_water))
        return close(self)

    BackgroundSaver.close = spy
    return train_worker(rank, world, runs), seen


def _checkpoint_bytes(step_dir: Path) -> dict[str, bytes]:
    """The files of a checkpoint that hold its state (not DCP's metadata, which records a save id)."""
    return {p.name: p.read_bytes() for p in step_dir.iterdir()
            if p.name.endswith((".distcp", ".pt")) or p.name == "meta.json"}


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.sp=2", "parallel.fsdp=true"]])
def test_async_saves_resume_bit_identically_to_sync_ones(tmp_path, layout):
    """The same run saved synchronously and in the background, stopped at step 4 and resumed to 6: the same
    checkpoint files byte for byte, the same losses and weights bit for bit; the staging arena holds what the plan
    counts for it, all of it on rank 0 (the largest chunks)."""
    six = layout + ["training.train_steps=6", "checkpoint.save_interval=2", "training.eval_interval=0"]
    runs = []
    for mode in ("false", "true"):
        d = str(tmp_path / mode)
        runs += [(d, six + [f"checkpoint.async_save={mode}", "training.exit_at_step=4"]),
                 (d, six + [f"checkpoint.async_save={mode}"])]
    per_rank = run_distributed(_staged_worker, 2, tmp_path, args=(runs,), timeout=300)
    weights = [full_weights([r[0][i] for r in per_rank]) for i in range(len(runs))]
    sync, background = tmp_path / "false", tmp_path / "true"
    assert _steps(background) == [1, 2, 3, 4, 5, 6]
    assert losses(background) == losses(sync)
    for name, w in weights[1].items():
        assert torch.equal(weights[3][name], w), f"{name} differs after resuming from a background save"
    for step in ("step_0000004", "step_0000006"):
        files = _checkpoint_bytes(sync / "checkpoints" / step)
        assert files and _checkpoint_bytes(background / "checkpoints" / step) == files, step
    for rank, (_, arenas) in enumerate(per_rank):
        assert len(arenas) == 2                               # one saver per run, none in the synchronous runs
        for capacity, high in arenas:
            assert 0 < high <= capacity and (high == capacity or rank > 0), (rank, capacity, high)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_never_unpickles_arbitrary_objects(tmp_path):
    import pickle

    from megalysses.checkpoint.dcp_io import CheckpointError, SafeFileSystemReader

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_pruning_keeps_the_checkpoint_an_init_from_names(tmp_path, capsys):
    """A run started from one checkpoint folder of another run marks it (a KEEP file naming the run, outside its
    manifest): that run's checkpoint.keep_last then prunes around it, and it still verifies."""
    from megalysses.checkpoint.manifest import verify_checkpoint
    from megalysses.tools.pretrain import main
    from tests.faults.launch import TINY

    def pretrain(run: Path, *overrides: str) -> str:
        sets = TINY + [f"logging.run_dir={run}", "checkpoint.save_interval=1", *overrides]
        assert main([a for o in sets for a in ("--set", o)]) == 0
        return capsys.readouterr().out

    source, started = tmp_path / "source", tmp_path / "started"
    pretrain(source, "training.train_steps=2", "checkpoint.keep_last=0")
    step1 = source / "checkpoints" / "step_0000001"
    out = pretrain(started, "training.train_steps=1", f"checkpoint.init_from={step1}")
    assert f"initial weights: {step1}" in out
    assert (step1 / "KEEP").read_text() == f"the initial weights of the run {started}\n"
    pretrain(source, "training.train_steps=4", "checkpoint.keep_last=1")
    assert sorted(p.name for p in (source / "checkpoints").glob("step_*")) == ["step_0000001", "step_0000004"]
    assert verify_checkpoint(step1) == []
