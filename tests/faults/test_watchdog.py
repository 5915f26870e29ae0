"""A stuck rank ends the job within parallel.timeout_seconds (+ a margin), with one message naming the
rank and what it was doing; every group, the device mesh's included, honours the timeout."""
import contextlib
import io
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megalysses.testing import run_distributed
from megalysses.training.watchdog import Watchdog
from tests.faults.launch import ROOT, TINY, env, error_lines, gone, kill_all, torchrun_cmd, wait_for_steps, workers_of


def _pair(timeout=1.5):
    """Two watchdogs (ranks 0 and 1 of a job) sharing one in-memory store; exits are recorded."""
    store, exits = dist.HashStore(), []
    dogs = [Watchdog(r, 2, timeout, dist.PrefixStore("t/", store), interval=0.3,
                     exit=lambda code, r=r: exits.append(r)) for r in range(2)]
    return dogs, exits


def _run(dogs, exits, seconds):
    """Start the watchdogs; return what they printed once every one has ended the job (or after `seconds`)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for d in dogs:
            d._beat_once()
        for d in dogs:
            d._thread.start()
        deadline = time.monotonic() + seconds
        while len(exits) < len(dogs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for d in dogs:
            d.stop()
    return out.getvalue()


def test_rank_stuck_outside_collectives_is_named_with_its_activity():
    """Rank 1 hangs reading its batch (a hung filesystem), rank 0 waits for it: one message names rank 1."""
    dogs, exits = _pair()
    dogs[0].doing("training step 12")
    dogs[0].doing("waiting for every rank to finish step 12")
    dogs[1].doing("reading the batch of step 12")
    out = _run(dogs, exits, 10)
    errors = error_lines(out)
    assert len(errors) == 1, out
    assert "rank 1 has spent" in errors[0] and "reading the batch of step 12" in errors[0], errors
    assert sorted(exits) == [0, 1]             # every rank ends


def test_frozen_rank_is_named_by_its_neighbour():
    """Rank 1's process is frozen (its watchdog thread too): rank 0 sees its heartbeat stop."""
    dogs, exits = _pair()
    dogs[0].doing("training step 3")
    dogs[1].doing("training step 3")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        dogs[1]._beat_once()                    # one heartbeat, then nothing: frozen
        dogs[0]._beat_once()
        dogs[0]._thread.start()
        deadline = time.monotonic() + 6
        while not exits and time.monotonic() < deadline:
            dogs[0].doing("training step 3")    # rank 0 itself keeps moving
            time.sleep(0.2)
        dogs[0].stop()
    errors = error_lines(out.getvalue())
    assert exits == [0] and len(errors) == 1, out.getvalue()
    assert "rank 1" in errors[0] and "stopped responding" in errors[0] and "training step 3" in errors[0]


def test_single_process_stuck_in_one_activity():
    exits = []
    dog = Watchdog(0, 1, 1.0, None, interval=0.2, exit=lambda code: exits.append(code))
    dog.doing("opening the datasets")
    out = _run([dog], exits, 10)
    assert exits == [1] and error_lines(out) == [error_lines(out)[0]]
    assert "rank 0 has spent" in out and "opening the datasets" in out


def test_an_allowance_stretches_the_timeout_until_it_is_put_back():
    """A profiled step may take PROFILE_ALLOWANCE times the timeout; once the allowance is put back, the same
    activity ends the job."""
    exits = []
    dog = Watchdog(0, 1, 0.5, None, interval=0.1, exit=lambda code: exits.append(code))
    dog.allow(4.0)
    dog.doing("training step 3")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        dog._thread.start()
        time.sleep(1.2)                     # over twice the timeout, within the allowance
        assert exits == []
        dog.allow(1.0)
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        dog.stop()
    assert exits == [1] and "rank 0 has spent" in out.getvalue() and "training step 3" in out.getvalue()


def _groups_time_out(rank, world, flag):
    """Rank 1 never joins; rank 0's collectives on a grid group and on a mesh group end in ~2 s. What they
    raise counts as a collective failure (so pretrain hands it to the watchdog), also when it comes from
    wait() on an async op (the gradient buckets' reduce-scatter), where no torch.distributed frame is on
    the stack: first gloo's timeout, then its closed pair."""
    from megalysses.distributed import collective_failure
    from megalysses.grid import ParallelGrid
    from megalysses.degrees import Degrees

    grid = ParallelGrid(Degrees.of_world(world, tp=2), timeout_seconds=2)
    mesh = grid.device_mesh(torch.device("cpu"))
    spare = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    took, failures = [], []
    if rank == 0:
        for group in (grid.tp_group, mesh.get_group("tp")):
            t0 = time.monotonic()
            with pytest.raises(RuntimeError) as e:
                dist.all_reduce(torch.ones(1), group=group)
            took.append(time.monotonic() - t0)
            failures.append(collective_failure(e.value))
        for _ in range(2):
            work = dist.all_reduce(torch.ones(1), group=spare, async_op=True)
            with pytest.raises(RuntimeError) as e:
                work.wait()
            failures.append(collective_failure(e.value))
        Path(flag).touch()
    else:
        deadline = time.monotonic() + 60
        while not Path(flag).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return took, failures


def test_every_group_honours_the_timeout(tmp_path):
    took, failures = run_distributed(_groups_time_out, 2, tmp_path, args=(str(tmp_path / "done"),), pg_timeout=60)[0]
    assert len(took) == 2 and all(t < 10 for t in took), took     # not torch's default of 30 minutes
    assert failures == [True] * 4, failures


def test_a_programming_error_is_not_a_collective_failure():
    from megalysses.distributed import collective_failure

    for text in ("I/O operation on closed file", "timed out waiting for the data loader", "peer review"):
        try:
            raise RuntimeError(text)
        except RuntimeError as e:
            assert not collective_failure(e), text


def test_sigstopped_worker_ends_the_job_naming_it(tmp_path):
    """Under torchrun, one worker stopped with SIGSTOP: the job ends within timeout + 30 s, one message.

    Where the time goes: rank 0 learns of it when a collective times out (timeout) or when rank 1's
    heartbeat has stood still for longer than the timeout (checked every interval, timeout / 5 here);
    it reads every heartbeat twice, 1.5 intervals apart, to name the frozen rank, SIGKILLs it (same host)
    and exits 1; torchrun then ends at once: about timeout + 2.5 intervals + torchrun's teardown, 9-10 s.
    torchrun cannot end it within the margin: on a worker's failure it sends the others SIGTERM and waits
    30 s before SIGKILL, and a stopped process does not act on SIGTERM. So the reporting rank must kill
    the frozen one itself, whichever way it learnt of the stop: a collective error raised by an async
    op's wait() has to reach the watchdog too (past it, rank 0 left with a traceback and the job took
    timeout + 30 s and more; test_every_group_honours_the_timeout checks that it is recognised)."""
    run = tmp_path / "run"
    timeout = 6
    p = subprocess.Popen(torchrun_cmd(2, TINY + [f"parallel.timeout_seconds={timeout}", "training.train_steps=100000",
                                                 f"logging.run_dir={run}"]),
                         cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run, p, 3)
        time.sleep(1)                          # training for a while (activities are published within ~0.3 s)
        victim = workers_of(run)[1]
        stopped = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        out, _ = p.communicate(timeout=timeout + 60)
        took = time.monotonic() - stopped
        assert p.returncode != 0
        assert took <= timeout + 30, f"the job took {took:.0f} s to end:\n{out[-3000:]}"
        errors = error_lines(out)
        assert len(errors) == 1, out
        assert "rank 1" in errors[0] and "stopped responding" in errors[0] and "step" in errors[0], errors
        assert "megalysses/" not in out      # no traceback from our code (torchrun prints its own report)
        assert gone(run, 10), "a worker was left running"
    finally:
        kill_all(run)
        if p.poll() is None:
            p.kill()
