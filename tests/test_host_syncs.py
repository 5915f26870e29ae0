"""Host synchronisations (megalysses.measure.count_host_syncs): an ordinary training step makes none, a logging
step exactly one (its figures read back once), at one process and at two ranks with ZeRO-1, FSDP2 and a pipeline;
a save's are counted apart."""
import pytest
import torch

from fixtures import TINY, step_rows
from megalysses import accelerator
from megalysses.measure import adam_step_counts, count_host_syncs
from megalysses.testing import run_distributed

STEPS = 4
LOOP = TINY + [f"training.train_steps={STEPS}", "logging.log_interval=2", "parallel.timeout_seconds=60"]


class _Waitable:
    def synchronize(self) -> None:
        pass


def test_the_counter_sees_reads_and_waits():
    t, held = torch.arange(3.0), torch.zeros(())
    with count_host_syncs(lambda: [held]) as syncs:
        t.sum().item()
        bool(t.any())
        float(t[0])                       # three scalar reads
        held.item()                       # a tensor in host memory: no synchronisation
        t.add(1)                          # no read
        accelerator.read_back(t * 2)      # one read back, its own copy not counted again
        with accelerator.host_wait("save"):
            t[1].item()
            accelerator.synchronize(_Waitable())
        accelerator.synchronize(_Waitable(), "offload")
    assert syncs.step == 4, syncs.seen
    assert syncs.apart() == {"save": 2, "offload": 1}, syncs.seen
    with count_host_syncs() as none:
        held.item()
    assert none.step == 1


@pytest.mark.gpu
def test_the_counter_sees_copies_to_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = torch.ones(4, device="cuda")
    with count_host_syncs() as syncs:
        t.cpu()
        torch.empty(4).copy_(t)
        t.to("cpu", non_blocking=True)    # not waited for
        t.sum().item()
    assert syncs.step == 3, syncs.seen


def test_varlen_attention_reads_nothing_back_with_the_loaders_documents():
    """The loader computes the documents' cumulative lengths and each row's longest on the host (here with the
    padding of an sp=4 layout, a document of its own): varlen attention's mask takes them as they are, no read of
    the device, and they equal what the device would compute from the ids (reading its longest length back)."""
    import numpy as np
    from megalysses.data.loader import HOST_KEYS, BatchFormat, build_micro_batch
    from megalysses.degrees import Degrees
    from megalysses.kernels.attention import Documents, documents_of, prepare_attention_mask
    from megalysses.parallel.sequence_layout import SequenceLayout

    eod = 0
    samples = [np.array([5, 6, 0, 7, 0, 0, 8, 9, 9, 9, 0]), np.array([1] * 11), np.array([2, 0, 3])]
    mb = build_micro_batch(samples, 10, 0, BatchFormat(eod, reset_position_ids=True, document_mask=True),
                           SequenceLayout(Degrees(sp=4)))
    docs = documents_of(mb)
    assert isinstance(docs, Documents) and HOST_KEYS == ("longest_document",)
    with count_host_syncs(lambda: [docs.longest]) as syncs:
        cu, longest = prepare_attention_mask(docs, "varlen", check=False).varlen()
    assert syncs.step == 0, syncs.seen
    with count_host_syncs() as read:
        want_cu, want_longest = prepare_attention_mask(mb["doc_ids"], "varlen", check=False).varlen()
    assert read.step == 1, read.seen          # the longest length read back (and nonzero's wait, on a GPU)
    assert torch.equal(cu, want_cu) and longest == want_longest == 10
    assert mb["longest_document"].tolist() == [4, 10, 7]     # rows of 12: [3 2 1 4 2], [10 2], [2 1 7 2]
    assert documents_of({k: v for k, v in mb.items() if k != "cu_seqlens"}) is mb["doc_ids"]


class _Activities:
    """A watchdog's view of the loop: what it was doing when each synchronisation was made."""

    def __init__(self) -> None:
        self.syncs, self.marks = None, []

    def doing(self, what: str) -> None:
        self.marks.append((len(self.syncs.seen), what))

    def allow(self, factor: float) -> None:
        pass

    def by_activity(self) -> list[tuple[str, list[str]]]:
        ends = [at for at, _ in self.marks[1:]] + [len(self.syncs.seen)]
        return [(what, [reason for reason, _ in self.syncs.seen[at:end]])
                for (at, what), end in zip(self.marks, ends)]


def _loop_worker(rank, world, runs):
    import megalysses.training.loop as loop
    from megalysses.config.io import load_config
    from megalysses.testing import plan_and_grid

    out, build = {}, loop.build_run
    for name, overrides in runs:
        cfg = load_config(overrides=overrides)
        plan, grid = plan_and_grid(cfg, torch.device("cpu"))
        built = {}

        def capture(*args, built=built, **kwargs):
            built["run"] = build(*args, **kwargs)
            return built["run"]

        def host(built=built, grid=grid):       # host memory on a GPU too: the rank grid, AdamW's step counts
            return [grid.layout.ranks] + (adam_step_counts(built["run"].opt) if built else [])

        activities = _Activities()
        loop.build_run = capture
        try:
            with count_host_syncs(host) as syncs:
                activities.syncs = syncs
                loop.train(cfg, plan, grid, torch.device("cpu"), watchdog=activities)
        finally:
            loop.build_run = build
        out[name] = activities.by_activity()
    return out


def _check(activities: list[tuple[str, list[str]]], name: str) -> None:
    """Training a step: no synchronisation; its read-back: one on a logging step (2 and 4), none on the others;
    the final checkpoint's apart (saved, or staged and written in the background: checkpoint.async_save)."""
    for step in range(1, STEPS + 1):
        trained = [reasons for what, reasons in activities if what == f"training step {step}"]
        assert trained == [[]], (name, step, trained)
        read = [reasons for what, reasons in activities if what == f"waiting for every rank to finish step {step}"]
        assert read == ([["step"]] if step % 2 == 0 else []), (name, step, read)
    saving = ("saving the checkpoint", "staging the checkpoint", "waiting for the checkpoint")  # written, or in the
    saved = [reasons for what, reasons in activities if what.startswith(saving)]                    # background
    assert saved and all(r == "save" for reasons in saved for r in reasons), (name, saved)


def test_one_process_step_makes_no_host_sync_and_a_logging_step_one(tmp_path, world_of_one):
    runs = [("one", LOOP + [f"logging.run_dir={tmp_path / 'one'}"])]
    _check(_loop_worker(0, 1, runs)["one"], "one")


def test_two_ranks_make_no_host_sync_on_an_ordinary_step(tmp_path):
    layouts = {"zero1": ["parallel.tp=1", "parallel.sp=1", "parallel.overlap_grad_reduce=true",
                         "training.nan_policy=skip"],       # the guarded update, its skip decided on the device
               "fsdp": ["parallel.tp=1", "parallel.sp=1", "parallel.fsdp=true", "training.nan_policy=skip"],
               "pp2": ["parallel.tp=1", "parallel.sp=1", "parallel.pp=2"]}
    runs = [(name, LOOP + o + [f"logging.run_dir={tmp_path / name}"]) for name, o in layouts.items()]
    for per_rank in run_distributed(_loop_worker, 2, tmp_path, args=(runs,), timeout=300):
        for name in layouts:
            _check(per_rank[name], name)
    for name in layouts:        # every rank's busy time came to rank 0 in that one read-back
        rows = step_rows(tmp_path / name)
        assert [r["step"] for r in rows] == [2, 4] and all("busy_slowest_rank" in r for r in rows), (name, rows)


def _train_with_step_3_not_finite(cfg, monkeypatch):
    """Train `cfg` with step 3's gradients made infinite (through the real step: the norm is not finite);
    returns (the loop's summary, the optimizer, AdamW's step counts after each step)."""
    import megalysses.training.loop as loop
    from megalysses.grid import ParallelGrid
    from megalysses.testing import resolve_run

    built, build, step = {}, loop.build_run, loop.train_step
    calls, counts = [], []

    def capture(*args, **kwargs):
        built["run"] = build(*args, **kwargs)
        return built["run"]

    def poisoned(model, opt, *args, **kwargs):
        calls.append(1)
        hook = next(model.parameters()).register_hook(lambda g: g * float("inf")) if len(calls) == 3 else None
        try:
            return step(model, opt, *args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
            counts.append({float(st["step"]) for st in opt.optimizer.state.values()})

    monkeypatch.setattr(loop, "build_run", capture)
    monkeypatch.setattr(loop, "train_step", poisoned)
    grid = ParallelGrid()
    summary = loop.train(cfg, resolve_run(cfg, torch.device("cpu"), grid), grid, torch.device("cpu"))
    return summary, built["run"].opt, counts


def test_a_skipped_step_is_counted_at_the_next_logging_step(tmp_path, world_of_one, monkeypatch):
    """nan_policy=skip: step 3 updates nothing, AdamW's step count (its bias correction) included, from that step
    on, not only once a logging step reads it back; the logging step 5 reads it back: 4 updates, 1 step skipped."""
    from fixtures import step_rows
    from megalysses.config.io import load_config

    run = tmp_path / "run"
    cfg = load_config(overrides=TINY + ["training.train_steps=5", "logging.log_interval=5",
                                        "training.nan_policy=skip", f"logging.run_dir={run}"])
    summary, opt, counts = _train_with_step_3_not_finite(cfg, monkeypatch)
    assert summary["step"] == 5
    (row,) = step_rows(run)
    assert row["step"] == 5 and row["skipped_steps"] == 1 and row["updates"] == 4, row
    assert counts == [{1.0}, {2.0}, {2.0}, {3.0}, {4.0}], counts


def test_an_abort_is_reported_at_the_next_logging_step(tmp_path, world_of_one, monkeypatch):
    """nan_policy=abort: the step it happened at, found at the logging step, before the checkpoint due there."""
    from megalysses.config.io import load_config
    from megalysses.training.step import NonFiniteLossError

    run = tmp_path / "run"
    cfg = load_config(overrides=TINY + ["training.train_steps=8", "logging.log_interval=4",
                                        "checkpoint.save_interval=4", f"logging.run_dir={run}"])
    with pytest.raises(NonFiniteLossError, match=r"not finite at step 3 \(found at step 4.*nan_policy=skip"):
        _train_with_step_3_not_finite(cfg, monkeypatch)
    assert not list((run / "checkpoints").glob("step_*"))
