"""pretrain.py as users run it: torchrun, bad input ending with one clear message, preemption signals."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests import fixtures

ROOT = Path(__file__).resolve().parent.parent
TINY = fixtures.TINY + ["parallel.timeout_seconds=30"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def torchrun(nproc: int, overrides: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "pretrain.py")] + _sets(overrides)
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def test_missing_dataset(tmp_path):
    r = torchrun(2, TINY + ["data.mock=false", "model.vocab_size=512", f"data.paths=[{tmp_path}/nope_text_document]",
                            f"logging.run_dir={tmp_path}/run"])
    assert r.returncode != 0
    errs = error_lines(r.stdout)
    assert len(errs) == 1 and "nope_text_document" in errs[0], r.stdout + r.stderr


def test_layout_that_does_not_divide_the_world(tmp_path):
    r = torchrun(2, TINY + ["parallel.sp=4", f"logging.run_dir={tmp_path}/run"])
    assert r.returncode != 0
    errs = error_lines(r.stdout)
    assert len(errs) == 1 and "world size 2" in errs[0] and "tp*sp*pp" in errs[0], r.stdout + r.stderr


def test_backend_this_machine_lacks(tmp_path):
    r = torchrun(2, TINY + ["model.attention_backend=flash", f"logging.run_dir={tmp_path}/run"])
    assert r.returncode != 0
    errs = error_lines(r.stdout)
    assert len(errs) == 1 and "model.attention_backend=flash" in errs[0], r.stdout + r.stderr
    assert "megalysses/" not in r.stdout + r.stderr     # no traceback from our code (torchrun prints its own)


def test_checkpoint_of_another_model_shape(tmp_path):
    run = tmp_path / "run"
    ok = torchrun(1, TINY + ["training.train_steps=1", f"logging.run_dir={run}"])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    saved = {f: (run / f).read_text() for f in ("config.yaml", "runtime.json")}
    r = torchrun(2, TINY + ["model.hidden_size=64", f"logging.run_dir={run}"])
    assert r.returncode != 0
    errs = error_lines(r.stdout)
    assert len(errs) == 1 and "different model shape" in errs[0] and "hidden_size" in errs[0], r.stdout + r.stderr
    # the launch that failed left the run's config as it was: generation and conversion still read the right model
    assert {f: (run / f).read_text() for f in saved} == saved


def signal_a_training_run(run: Path, sig: int) -> tuple[int, str]:
    """Start a long single-process run, send it `sig` once it has logged, return (exit status, output)."""
    cmd = [sys.executable, str(ROOT / "pretrain.py")] + _sets(TINY + ["training.train_steps=100000",
                                                                      f"logging.run_dir={run}"])
    # as from a terminal: a shell that starts the suite in the background has the children ignore SIGINT
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=60)
    return p.returncode, out


def test_ctrl_c_ends_with_one_line(tmp_path):
    """SIGINT (Ctrl-C) interrupts at once, as users expect of it, with one line saying what is kept and which
    signals stop with a checkpoint instead of a traceback."""
    status, out = signal_a_training_run(tmp_path / "run", signal.SIGINT)
    assert status == 130, out
    assert "interrupted (Ctrl-C) while " in out and "SIGTERM or SIGUSR1" in out, out
    assert "no checkpoint was saved" in out and "resume" not in out, out      # none yet: nothing to resume from
    assert "Traceback" not in out, out


def test_ctrl_c_says_what_a_restart_starts_from(tmp_path):
    from megalysses.config.io import load_config
    from megalysses.tools.pretrain import _kept

    cfg = load_config(None, TINY + [f"logging.run_dir={tmp_path}"])
    assert _kept(cfg).startswith("no checkpoint was saved") and "begins again from step 0" in _kept(cfg)
    (tmp_path / "checkpoints" / "step_0000040").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_0000040\n")
    said = _kept(cfg)
    assert "step_0000040 (step 40), the steps after it are lost; a restart resumes from it" in said, said
    assert "starts afresh" in _kept(load_config(None, TINY + [f"logging.run_dir={tmp_path}", "checkpoint.load=null"]))


def test_ctrl_c_ends_a_rank_that_waits_inside_torch_for_a_peer_that_has_left(tmp_path):
    """A main thread waiting inside torch (here a store rendezvous whose key never comes: a peer interrupted first
    has left) never runs Python's SIGINT handler; the entry point's interrupt thread says the one line and ends
    the process STUCK_SECONDS later, not at the wait's timeout."""
    from megalysses.training.signals import STUCK_SECONDS

    script = tmp_path / "stuck.py"
    text = (
        "import sys, threading, time\n"
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "from megalysses.tools.pretrain import Interruption\n"
        "from megalysses.training.signals import StopSignals\n"
        "store = dist.TCPStore('127.0.0.1', 0, is_master=True, timeout=timedelta(seconds=120))\n"
        "signals = StopSignals(on_stuck=Interruption().leave)\n"
        "def say_when_waiting():\n"      # the main thread's frame at the wait's line, then a second inside it
        "    main = threading.main_thread().ident\n"
        "    while sys._current_frames()[main].f_lineno != WAIT_LINE:\n"
        "        time.sleep(0.01)\n"
        "    time.sleep(1)\n"
        "    print('waiting', flush=True)\n"
        "threading.Thread(target=say_when_waiting, daemon=True).start()\n"
        "try:\n"
        "    store.wait(['never'])\n"
        "except KeyboardInterrupt:\n"
        "    print('the main thread took it')\n")
    wait_line = text.splitlines().index("    store.wait(['never'])") + 1
    script.write_text(text.replace("WAIT_LINE", str(wait_line)))
    p = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout.readline().strip() == "waiting"
        start = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, out
    assert out.startswith("interrupted (Ctrl-C) while starting up: nothing was trained"), out
    assert "the main thread took it" not in out, out
    assert STUCK_SECONDS <= took < STUCK_SECONDS + 30, took


def test_ctrl_c_in_a_terminal_ends_a_torchrun_launch_with_one_line(tmp_path):
    """A terminal sends Ctrl-C's SIGINT to its whole foreground process group: torchrun and every worker (and
    torchrun passes its own SIGINT on to them). One line says what is kept; after it comes only torchrun's own
    report of the signal, and torchrun's exit status 1 (the README says so)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "pretrain.py")] + _sets(TINY + ["parallel.sp=2", "training.train_steps=100000",
                                                      f"logging.run_dir={run}"])
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = out.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("interrupted (Ctrl-C) while ")]
    assert len(said) == 1 and "SIGTERM or SIGUSR1" in lines[said[0]], out
    after = lines[said[0] + 1:]
    assert not [line for line in after if "megalysses" in line or line.startswith(("error:", "[rank"))], out
    assert "SignalException" in after[-1], out        # torchrun's own report closes the output
    assert p.returncode == 1, out


def test_a_rank_that_raises_is_named_with_its_error_and_activity(tmp_path):
    """A bug that only rank 1 hits (planted by a sitecustomize module): its error and activity end the job at
    once in one line, which torchrun's report closes with (its error file), and no rank is called frozen."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import megalysses.training.build as build\n"
        "    def planted(*args, **kwargs):\n"
        "        raise KeyError('planted')\n"
        "    build.build_optimizer = planted\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "pretrain.py")] + _sets(TINY + ["parallel.sp=2", "parallel.timeout_seconds=120",
                                                      f"logging.run_dir={tmp_path / 'run'}"])
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env={**_env(), "PYTHONPATH": str(tmp_path)}, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=240)
    took = time.monotonic() - t0
    assert r.returncode != 0
    errs = error_lines(r.stdout)
    assert errs == ["error: rank 1 failed while building the optimizer: KeyError: 'planted'"], r.stdout
    # ended by the error, not by the 120 s timeout (a start-up on a loaded machine takes a good part of a minute)
    assert "stopped responding" not in r.stdout and took < 100, (took, r.stdout)
    assert any(errs[0] in line for line in r.stdout.splitlines()[-15:]), r.stdout


@pytest.mark.parametrize("bad", [["model.hiden_size=3"], ["parallel.pp=3"]], ids=["on loading", "at start-up"])
def test_a_config_error_closes_a_torchrun_launch(tmp_path, bad):
    """torchrun's report of the failed workers ends with the config error (each worker's error file), not
    with "To enable traceback see ...": `... | tail` shows the cause."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(ROOT / "pretrain.py")] + _sets(TINY + bad + [f"logging.run_dir={tmp_path / 'run'}"]),
                       cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stdout.splitlines()[-15:]
    assert any(("config error: " in line or "error: " in line) and ("hiden_size" in line or "pp=3" in line)
               for line in last), r.stdout
    assert not any("To enable traceback" in line for line in last), r.stdout


def test_a_step_longer_than_the_watchdog_allows_is_refused_before_step_1(tmp_path):
    """At 1e-9 TFLOP/s (logging.peak_tflops) the planner's step outlasts parallel.timeout_seconds by far."""
    r = torchrun(1, TINY + ["logging.peak_tflops=1e-9", f"logging.run_dir={tmp_path / 'run'}"])
    errs = error_lines(r.stdout)
    assert r.returncode != 0 and len(errs) == 1, r.stdout + r.stderr
    assert "parallel.timeout_seconds=30 is less than twice the time of a training step" in errs[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_config_key_fails_before_launching_anything(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--set", "model.hiden_size=3"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "did you mean 'hidden_size'" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_and_exits(tmp_path, sig):
    run = tmp_path / "run"
    status, out = signal_a_training_run(run, sig)
    assert status == 0, out
    assert "(signal)" in out
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "meta.json").is_file()


def test_a_run_directory_works_from_any_directory(tmp_path, monkeypatch):
    """A run trained at tp=2 in one directory, with its data, tokenizer and run directory named relative to it:
    from another directory, tools/generate.py samples from its checkpoint (resharded to one process), the
    converter exports it, tools/plot_metrics.py draws its curves, and a resume through its config.yaml
    continues it; a wrong --run gives one clear message."""
    from megalysses.tools import preprocess_data, train_tokenizer

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    import argparse as module_text
    text = Path(module_text.__file__).read_text()
    docs = [text[i:i + 2000] for i in range(0, len(text), 2000)]
    (work / "data" / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    monkeypatch.chdir(work)
    train_tokenizer.main(["--input", "data/c.jsonl", "--model-prefix", "data/sp", "--vocab-size", "300"])
    preprocess_data.main(["--input", "data/c.jsonl", "--output-prefix", "data/c", "--append-eod", "--workers", "1",
                          "--tokenizer-type", "sentencepiece", "--tokenizer-model", "data/sp.model"])
    monkeypatch.chdir(ROOT)
    relative = ["data.mock=false", "data.paths=[data/c_text_document]", "data.tokenizer=sentencepiece",
                "data.tokenizer_model=data/sp.model", "model.vocab_size=512", "logging.run_dir=runs/r"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "pretrain.py")] + _sets(TINY + relative + ["parallel.tp=2", "training.train_steps=2"])
    ok = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    run = work / "runs" / "r"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    gen = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), "--run", str(run), "--prompt", "def",
                          "--max-new-tokens", "5", "--temperature", "0"], cwd=elsewhere, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stdout + gen.stderr
    assert "sampled from" in gen.stdout and "step_0000002" in gen.stdout
    assert gen.stdout.split("---\n", 1)[1].startswith("def")        # the prompt, then the continuation
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "--from", str(run),
                          "--to-hf", "hf"], cwd=elsewhere, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and (elsewhere / "hf" / "config.json").is_file(), out.stdout + out.stderr
    resume = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), "--config", str(run / "config.yaml"),
                             "--set", "training.train_steps=3", "--set", "parallel.tp=1"], cwd=elsewhere, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert resume.returncode == 0 and "resumed from" in resume.stdout and "done: step 3" in resume.stdout, \
        resume.stdout + resume.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), "--run", str(tmp_path / "nope")],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "not a run directory" in bad.stderr and "Traceback" not in bad.stderr
    pytest.importorskip("matplotlib")
    plot = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(run)], cwd=elsewhere,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert (run / "metrics.png").stat().st_size > 1000


def test_a_described_dry_run_checks_its_machine_and_its_fit_as_the_planner_does(tmp_path, capsys):
    """--dry-run --gpus N: a described-machine flag the planner refuses is refused in the same words (one line,
    nothing written); a layout that does not fit the machine ends in the planner's verdict as one error line and a
    non-zero exit, with --trace-memory the traced peak held to the same usable memory."""
    from megalysses.tools import plan, pretrain

    config, run_dir = str(ROOT / "configs" / "quickstart.yaml"), tmp_path / "run"
    dry = ["--config", config, "--set", "data.mock=true", "--set", f"logging.run_dir={run_dir}", "--dry-run"]
    for flags in (["--gpu-memory-gib", "-80"], ["--gpu-memory-gib", "1"], ["--host-memory-gib", "0"],
                  ["--gpus-per-node", "0"], ["--packages", "triton,flash"], ["--gpus", "0"]):
        argv = ["--gpus", "2", *flags]
        assert pretrain.main(dry + argv) == 2, flags
        said = capsys.readouterr().err.strip().splitlines()
        assert plan.main(["--config", config, *argv]) == 1, flags
        assert said == capsys.readouterr().err.strip().splitlines() and len(said) == 1, (said, flags)
        assert said[0].startswith(f"error: {flags[0]} ") and not run_dir.exists()
    assert pretrain.main(dry + ["--gpus", "2", "--gpu", "MI300X"]) == 2
    assert capsys.readouterr().err.startswith("error: --gpu MI300X: its memory is not known here")

    small = ["--gpus", "4", "--gpu-memory-gib", "1.68"]       # just past the reserve and the communicators
    assert plan.main(["--config", config, *small, "--no-search"]) == 0
    assert "the config's own layout does not fit (peak" in capsys.readouterr().out
    assert pretrain.main(dry + small) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the config's own layout does not fit (peak"), err
    assert pretrain.main(dry + small + ["--trace-memory"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit (peak" in err[0] and "; traced peak 0.0" in err[0] and "> usable" in err[0]
