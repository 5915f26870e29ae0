"""A straggler named: one worker of a torchrun run stopped from outside (SIGSTOP, then SIGCONT well within the
group timeout) is named, with its host, in rank 0's warning and in metrics.jsonl's busy-time spread."""
import json
import os
import re
import signal
import socket
import subprocess
import time

from tests.faults.launch import ROOT, TINY, env, kill_all, torchrun_cmd, wait_for_steps, workers_of

STOP_S = 1.5          # long against a step of these tiny ones (tens of ms), short against the group timeout


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"busy_s_max"' in line]


def test_a_stopped_rank_is_named_in_the_log_and_the_metrics(tmp_path):
    """Two data-parallel ranks, 8 micro-batches each a step, so that most of a step is the forward and the backward
    the busy time counts (the optimizer's part is not: a stop that lands there, or inside a collective, keeps both
    ranks waiting alike and names nobody, so the stop is repeated until one lands in counted time, a few times at
    most). Every step is logged; the warning's threshold is high, so that only a stop, not a loaded machine's
    hiccup, crosses it."""
    run = tmp_path / "run"
    overrides = TINY + ["parallel.tp=1", "parallel.sp=1", "training.global_batch_size=16",
                        "training.train_steps=100000", "parallel.timeout_seconds=30",
                        "logging.straggler_warn_fraction=0.5", f"logging.run_dir={run}"]
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        p = subprocess.Popen(torchrun_cmd(2, overrides), cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_steps(run, p, 3)
        victim = workers_of(run)[1]
        for _ in range(6):
            os.kill(victim, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(victim, signal.SIGCONT)
            time.sleep(1.0)                         # the next logged steps
            if any(r["busy_s_max"] >= STOP_S - 0.2 for r in _rows(run)):
                break
        p.send_signal(signal.SIGTERM)               # torchrun passes it on: a checkpoint, then the end
        p.wait(timeout=120)
    finally:
        kill_all(run)
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    slowed = [r for r in _rows(run) if r["busy_s_max"] >= STOP_S - 0.2]
    assert slowed, f"no logged step counted the stop:\n{text[-3000:]}"
    assert all(r["busy_slowest_rank"] == 1 and r["busy_s_min"] < STOP_S / 2 for r in slowed), slowed
    warned = re.findall(r"^warning: rank (\d+) \(host (\S+)\) is a straggler: busy ([\d.]+) s", text, re.M)
    assert ("1", socket.gethostname()) in {(r, h) for r, h, _ in warned}, text[-3000:]
    assert all(r == "1" for r, _, busy in warned if float(busy) >= STOP_S - 0.2), warned
