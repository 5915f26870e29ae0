"""Stop signals and launchers: the Slurm script's signal checkpoints, exits 0 and requeues; no path
leaves a worker running after its launcher is gone."""
import os
import signal
import subprocess
import sys
from pathlib import Path

from megalysses.checkpoint.manifest import read_latest, verify_checkpoint
from tests.faults.launch import (ROOT, TINY, env, free_port, gone, kill_all, sets, torchrun_cmd, wait_for_steps,
                                 workers_of)

FAKE_SRUN = """#!/usr/bin/env bash
# srun on one node, as far as signals go: the task is started once; SIGUSR1 is forwarded to it,
# SIGTERM answered by killing it (srun's "forcing job termination")
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
"$@" &
task=$!
trap 'kill -s USR1 $task' USR1
trap 'kill -s KILL $task' TERM
while kill -0 $task 2>/dev/null; do wait $task; done
wait $task
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) echo localhost ;;
    requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
esac
"""


def _checkpoint_ok(run: Path) -> Path:
    latest, problem = read_latest(run / "checkpoints")
    assert problem is None, problem
    assert verify_checkpoint(latest) == []
    return latest


def test_sbatch_signal_checkpoints_exits_0_and_requeues(tmp_path):
    """--signal=B:USR1 reaches the batch shell only; the workers (below srun, torchrun_node.sh and
    torchrun) save a checkpoint, torchrun and the step exit 0, and the job is requeued."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run, log = tmp_path / "run", tmp_path / "slurm.log"
    slurm_env = {**env(), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                 "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
                 "SLURM_GPUS_ON_NODE": "2", "RDZV_PORT": str(free_port()), "FAKE_SLURM_LOG": str(log)}
    config = tmp_path / "tiny.yaml"
    config.write_text("training:\n  train_steps: 100000\n")
    p = subprocess.Popen(["bash", str(ROOT / "examples/slurm/pretrain.sbatch"), str(config)]
                         + sets(TINY + [f"logging.run_dir={run}"]),
                         cwd=ROOT, env=slurm_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run, p, 2)
        assert len(workers_of(run)) == 2
        p.send_signal(signal.SIGUSR1)            # what Slurm does with --signal=B:USR1@...
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        assert "(signal)" in out and "checkpoint saved" in out, out
        assert log.read_text().split() == ["requeue", "4242"]
        _checkpoint_ok(run)
        assert gone(run, 5), "a process of the job was left running"
    finally:
        kill_all(run)
        if p.poll() is None:
            p.kill()


def test_sigterm_to_the_step_task_and_its_group(tmp_path):
    """Slurm's SIGTERM (time limit, scancel, preemption) to the step's task and its process group: torchrun
    ignores it, torchrun_node.sh passes it to the worker, which saves; everything exits 0."""
    run = tmp_path / "run"
    overrides = TINY + ["training.train_steps=100000", f"logging.run_dir={run}"]
    cmd = ["bash", str(ROOT / "examples/slurm/torchrun_node.sh")] + torchrun_cmd(
        1, overrides, "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        wait_for_steps(run, p, 2)
        os.killpg(p.pid, signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        assert "(signal)" in out, out
        _checkpoint_ok(run)
        assert gone(run, 5)
    finally:
        kill_all(run)
        if p.poll() is None:
            p.kill()


def _no_store_noise(out: str) -> None:
    """Workers that leave because their launcher is gone do not touch the store that went with it: no
    c10d "sendBytes failed ... Broken pipe" with its C++ stack on the way out."""
    assert "TCPStore" not in out and "Broken pipe" not in out and "Connection reset" not in out, out[-3000:]


def test_sigusr1_to_a_bare_torchrun_orphans_no_worker(tmp_path):
    """SIGUSR1 straight to torchrun (the README's recipe goes through the sbatch script and
    torchrun_node.sh, which keep it away from torchrun): torchrun has no handler for it and dies at once;
    the kernel sends each worker SIGTERM (PDEATHSIG), so they stop after the current step with a
    checkpoint that verifies, and exit; none is left running."""
    run = tmp_path / "run"
    p = subprocess.Popen(torchrun_cmd(2, TINY + ["training.train_steps=100000", f"logging.run_dir={run}"]),
                         cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run, p, 2)
        workers = workers_of(run)
        assert len(workers) == 2
        p.send_signal(signal.SIGUSR1)
        out, _ = p.communicate(timeout=120)       # until the workers, which share its stdout, are gone too
        assert p.returncode == -signal.SIGUSR1, out
        assert gone(run, 10), f"workers {workers} outlived their launcher"
        stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
        assert len(stopped) == 1 and "(signal); checkpoint saved" in stopped[0], out
        latest = _checkpoint_ok(run)
        assert stopped[0].startswith(f"stopped at step {int(latest.name.split('_')[1])} "), (stopped, latest)
        assert "Traceback" not in out, out
        _no_store_noise(out)
    finally:
        kill_all(run)
        if p.poll() is None:
            p.kill()


def test_workers_end_with_their_launcher(tmp_path):
    """kill -9 of torchrun's process group (the workers run in sessions of their own): the kernel sends
    each worker SIGTERM; they save a checkpoint and exit instead of training on unsupervised."""
    run = tmp_path / "run"
    p = subprocess.Popen(torchrun_cmd(2, TINY + ["training.train_steps=100000", f"logging.run_dir={run}"]),
                         cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        wait_for_steps(run, p, 2)
        workers = workers_of(run)
        assert len(workers) == 2
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
        assert gone(run, 30), f"workers {workers} outlived their launcher"
        _checkpoint_ok(run)
        _no_store_noise(out)
    finally:
        kill_all(run)
