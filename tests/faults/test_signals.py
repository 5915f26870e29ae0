"""Stop signals and launchers: the Slurm script's signal checkpoints, exits 0 and requeues, on two nodes that
meet at one rendezvous, in the container, Apptainer or host environment it is given; no path leaves a worker
running after its launcher is gone."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megalysses.checkpoint.manifest import read_latest, verify_checkpoint
from tests.faults.launch import (ROOT, TINY, env, free_port, gone, kill_all, sets, torchrun_cmd, wait_for_steps,
                                 workers_of)

FAKE_SRUN = """#!/usr/bin/env bash
# srun on SLURM_JOB_NUM_NODES nodes that are this machine, as far as signals go: one task per node; SIGUSR1 is
# forwarded to every task, SIGTERM answered by killing them (srun's "forcing job termination"). Its command
# line goes to the log (with FAKE_SRUN_DRY set, it only logs). pyxis' options (--container-*) are srun's and
# are dropped with the others: the task runs on this machine, in this directory.
echo "srun $* | ${MEGALYSSES_ENV:-}" >> "$FAKE_SLURM_LOG"
[ -n "${FAKE_SRUN_DRY:-}" ] && exit 0
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
tasks=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node "$@" &
    tasks+=($!)
done
trap 'kill -s USR1 ${tasks[*]}' USR1
trap 'kill -s KILL ${tasks[*]}' TERM
status=0
for task in "${tasks[@]}"; do
    while kill -0 $task 2>/dev/null; do wait $task; done
    wait $task || status=$?
done
exit $status
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


FAKE_APPTAINER = """#!/usr/bin/env bash
# apptainer exec [options] IMAGE COMMAND...: the command, on this machine (signals reach it, as Apptainer passes
# them on); its command line goes to the log
echo "apptainer $*" >> "$FAKE_SLURM_LOG"
shift
while [[ $# -gt 0 && $1 == --* ]]; do [[ $1 == --nv ]] && shift || shift 2; done
shift
exec "$@"
"""


def _slurm(tmp_path: Path, nodes: int, **variables: str) -> tuple[dict, Path]:
    """The environment of a batch script on `nodes` stand-in nodes of this machine, and the stand-ins' log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("apptainer", FAKE_APPTAINER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm.log"
    return {**env(), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_GPUS_ON_NODE": "1", "SLURM_CPUS_PER_TASK": "2", "RDZV_PORT": str(free_port()),
            "FAKE_SLURM_LOG": str(log), **variables}, log


def test_sbatch_signal_checkpoints_exits_0_and_requeues(tmp_path):
    """Two nodes of one process each meet at the head node's c10d rendezvous, in the container (pyxis' srun
    options: the image, the data and runs mounts, the working directory, the task's cores).
    --signal=B:USR1 reaches the batch shell only; the workers (below srun, torchrun_node.sh and torchrun, on
    both nodes) save a checkpoint, torchrun and the step exit 0, and the job is requeued."""
    run = tmp_path / "run"
    slurm_env, log = _slurm(tmp_path, 2, IMAGE="registry.example.com#team/megalysses:latest", DATA="/shared/data",
                            RUNS="/shared/runs")
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
        srun, requeue = log.read_text().splitlines()
        assert requeue == "requeue 4242"
        assert ("--cpus-per-task=2 --container-image=registry.example.com#team/megalysses:latest "
                "--container-mounts=/shared/data:/workspace/megalysses/data,/shared/runs:/workspace/megalysses/runs "
                "--container-workdir=/workspace/megalysses bash examples/slurm/torchrun_node.sh torchrun --nnodes=2 "
                "--nproc-per-node=1") in srun, srun
        _checkpoint_ok(run)
        assert gone(run, 5), "a process of the job was left running"
    finally:
        kill_all(run)
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("variables, launched", [
    ({"RUNTIME": "apptainer", "IMAGE": "/shared/megalysses.sif", "MOUNTS": "/scratch:/scratch"},
     ("--cpus-per-task=2 apptainer exec --nv --bind /shared/d:/workspace/megalysses/data,/shared/r:/workspace/"
      "megalysses/runs,/scratch:/scratch --pwd /workspace/megalysses /shared/megalysses.sif bash "
      "examples/slurm/torchrun_node.sh torchrun --nnodes=1")),
    ({"RUNTIME": "host", "ACTIVATE": "export MEGALYSSES_ENV=activated"},
     "--cpus-per-task=2 bash examples/slurm/torchrun_node.sh torchrun --nnodes=1"),
])
def test_sbatch_runs_in_apptainer_or_an_activated_environment(tmp_path, variables, launched):
    """Apptainer: srun's task is `apptainer exec` of the .sif with the mounts; host: the checkout's code, in the
    environment ACTIVATE sets up in the batch shell, which srun passes to the tasks."""
    slurm_env, log = _slurm(tmp_path, 1, FAKE_SRUN_DRY="1", DATA="/shared/d", RUNS="/shared/r", **variables)
    r = subprocess.run(["bash", str(ROOT / "examples/slurm/pretrain.sbatch"), "configs/quickstart.yaml"], cwd=ROOT,
                       env=slurm_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    (srun,) = log.read_text().splitlines()
    assert launched in srun, srun
    assert srun.endswith("pretrain.py --config configs/quickstart.yaml | "
                         + ("activated" if variables["RUNTIME"] == "host" else "")), srun


@pytest.mark.parametrize("variables, message", [
    ({"RUNTIME": "docker"}, "RUNTIME=docker: choose container (pyxis/enroot), apptainer or host"),
    ({}, "set IMAGE to the image for pyxis"),
    ({"RUNTIME": "apptainer"}, "set IMAGE to the image for Apptainer: a .sif file"),
])
def test_sbatch_without_its_runtime_says_what_to_set(tmp_path, variables, message):
    slurm_env, log = _slurm(tmp_path, 1, **variables)
    r = subprocess.run(["bash", str(ROOT / "examples/slurm/pretrain.sbatch"), "configs/quickstart.yaml"], cwd=ROOT,
                       env=slurm_env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stdout + r.stderr, r.stdout + r.stderr
    assert not log.exists()                      # nothing was launched


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
