"""Runtime faults given to pretrain (in-process, a world of one): run and checkpoint directories that
cannot be written (found at start-up, before any step is trained), and training that never produces a
finite loss."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from tests.faults.cases_config import TINY, pretrain
from tests.faults.corpus import Case

NOBODY = 65534


@contextlib.contextmanager
def unprivileged():
    """Act as an ordinary user: as root, file permissions do not apply, so switch to 'nobody' meanwhile."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def read_only(target: str) -> Callable[[Path], int]:
    """pretrain with logging.run_dir or checkpoint.dir (`target`) inside a directory it may not write."""
    def run(tmp: Path) -> int:
        from megalysses.tools.pretrain import main
        base = Path(tempfile.mkdtemp(prefix="corpus-ro-"))    # reachable by an ordinary user
        try:
            base.chmod(0o755)
            (base / "run").mkdir(mode=0o777)
            (base / "run").chmod(0o777)
            (base / "locked").mkdir()
            (base / "locked").chmod(0o555)
            where = {"logging.run_dir": base / "locked" / "run", "checkpoint.dir": base / "locked" / "ckpt"}[target]
            sets = TINY + [f"logging.run_dir={base}/run", f"{target}={where}"]
            with unprivileged():
                return main([a for o in sets for a in ("--set", o)])
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return run


def _file(name: str) -> Callable[[Path], None]:
    return lambda tmp: (tmp / name).write_text("a file, not a directory\n")


def _dangling(tmp: Path) -> None:
    (tmp / "scratch").symlink_to(tmp / "unmounted" / "scratch")


NEVER_FINITE = ["model.init_std=1e30", "training.train_steps=3"]     # every forward overflows

CASES = [
    Case("runtime/run_dir_is_a_file", pretrain("logging.run_dir={tmp}/out", prepare=_file("out")), "logging.run_dir"),
    Case("runtime/run_dir_below_a_file", pretrain("logging.run_dir={tmp}/out/run", prepare=_file("out")),
         "lies below"),
    Case("runtime/run_dir_is_dev_null", pretrain("logging.run_dir=/dev/null"), "not a directory"),
    Case("runtime/run_dir_dangling_symlink", pretrain("logging.run_dir={tmp}/scratch", prepare=_dangling),
         "does not exist"),
    Case("runtime/run_dir_read_only", read_only("logging.run_dir"), "not writable"),
    Case("runtime/checkpoint_dir_is_a_file", pretrain("checkpoint.dir={tmp}/ckpt", prepare=_file("ckpt")),
         "checkpoint.dir"),
    Case("runtime/checkpoint_dir_below_a_file", pretrain("checkpoint.dir={tmp}/ckpt/x", prepare=_file("ckpt")),
         "checkpoint.dir"),
    Case("runtime/checkpoint_dir_is_the_config", pretrain("checkpoint.dir={tmp}/run/config.yaml",
                                                          prepare=lambda tmp: _file("run/config.yaml")(
                                                              (tmp / "run").mkdir() or tmp)), "checkpoint.dir"),
    Case("runtime/checkpoint_dir_is_dev_null", pretrain("checkpoint.dir=/dev/null"), "checkpoint.dir"),
    Case("runtime/checkpoint_dir_read_only", read_only("checkpoint.dir"), "checkpoint.dir"),
    Case("runtime/nan_skip_every_step", pretrain(*NEVER_FINITE, "training.nan_policy=skip"), "every step"),
    Case("runtime/nan_abort", pretrain(*NEVER_FINITE), "nan_policy"),
    Case("runtime/lr_that_diverges", pretrain("optimizer.lr=1e30", "optimizer.warmup_steps=0",
                                              "training.train_steps=4"), "nan_policy"),
]
