"""Bad configs given to pretrain (in-process, a world of one)."""
from __future__ import annotations

from pathlib import Path

from tests.faults.corpus import Case

TINY = ["data.mock=true", "data.seq_len=32", "model.vocab_size=128", "model.hidden_size=32", "model.num_layers=2",
        "model.num_heads=4", "training.global_batch_size=2", "training.micro_batch_size=1",
        "training.train_steps=1", "parallel.timeout_seconds=30"]


def pretrain(*overrides: str, config: str | None = None) -> "callable":
    """A case body: pretrain.main with the tiny model, the given --set overrides, run_dir in the case's tmp."""
    def run(tmp: Path) -> int:
        from megalysses.tools.pretrain import main
        argv = [] if config is None else ["--config", config.format(tmp=tmp)]
        sets = TINY + [f"logging.run_dir={tmp}/run"] + list(overrides)
        return main(argv + [a for o in sets for a in ("--set", o)])
    return run


CASES = [
    Case("config/unknown_key", pretrain("model.hiden_size=3"), "hidden_size"),
    Case("config/hidden_not_divisible_by_heads", pretrain("model.hidden_size=30"), "num_heads"),
]
