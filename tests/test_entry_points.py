"""The console scripts `pip install` creates: each one named in pyproject.toml is installed, resolves to a
callable, has its launcher, and `--help` prints its usage and exits 0 (in-process, as the launcher calls it)."""
import sys
import sysconfig
from importlib.metadata import distribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["megalysses-pretrain", "megalysses-preprocess", "megalysses-merge-datasets", "megalysses-train-tokenizer",
           "megalysses-generate", "megalysses-convert", "megalysses-plot", "megalysses-build-corpus", "megalysses-plan",
           "megalysses-from-megatron", "megalysses-eval-long"]


def installed() -> dict:
    return {ep.name: ep for ep in distribution("megalysses").entry_points if ep.group == "console_scripts"}


def test_installed_scripts_are_the_declared_ones():
    assert sorted(installed()) == sorted(SCRIPTS)
    missing = [n for n in SCRIPTS if not (Path(sysconfig.get_path("scripts")) / n).is_file()]
    assert not missing, f"no launcher for {missing} in {sysconfig.get_path('scripts')}"
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {name: ep.value for name, ep in installed().items()} == declared, \
        "the installed metadata is stale: pip install -e . again"


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_resolves_and_prints_help(name, monkeypatch, capsys):
    entry = installed()[name].load()
    assert callable(entry)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        entry()
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {name}"), out[:200]
