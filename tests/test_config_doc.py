"""The config reference: docs/CONFIG.md is what the schema generates (the failure names the command that
regenerates it), every key has a meaning, and `pretrain.py --print-config` prints a config that loads back."""
import dataclasses
from pathlib import Path

from megalysses.config import Config
from megalysses.config.doc import REGENERATE, key_docs, reference_markdown, sections
from megalysses.config.io import load_config

ROOT = Path(__file__).resolve().parents[1]


def _keys(node, prefix=""):
    for k, v in node.items():
        yield from _keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]


def test_config_md_is_current():
    current = (ROOT / "docs" / "CONFIG.md").read_text()
    assert current == reference_markdown(), (
        f"docs/CONFIG.md is out of date with megalysses/config/__init__.py (or megalysses/config/megatron_names.py): "
        f"regenerate it with {REGENERATE} and commit it")


def test_every_key_is_documented():
    documented = {k.key: k for section, cls in sections() for k in key_docs(cls, section)}
    assert set(documented) == set(_keys(dataclasses.asdict(Config())))
    undocumented = [k for k, d in documented.items() if not d.doc]
    assert not undocumented, \
        f"give these keys a docstring under the field in megalysses/config/__init__.py: {undocumented}"
    text = reference_markdown()
    assert all(f"| `{k}` |" in text for k in documented)
    assert "| `parallel.sp` | int | `1` |" in text and "`--context-parallel-size`" in text
    assert documented["optimizer.schedule"].choices == ("cosine", "linear", "constant", "wsd")


def test_the_check_names_the_command(tmp_path, capsys):
    from megalysses.tools.config_doc import main

    stale = tmp_path / "CONFIG.md"
    stale.write_text("old\n")
    assert main(["--check", "--output", str(stale)]) == 1
    assert "make docs" in capsys.readouterr().err
    assert main(["--output", str(stale)]) == 0 and main(["--check", "--output", str(stale)]) == 0


def test_print_config_loads_back_with_every_meaning(tmp_path, capsys):
    from megalysses.tools.pretrain import main

    overrides = ["optimizer.schedule=WSD", "training.rampup_batch_size=[4, 4, 1000]", "model.num_kv_heads=4"]
    assert main(["--config", str(ROOT / "configs" / "quickstart.yaml"), "--print-config"]
                + [a for o in overrides for a in ("--set", o)]) == 0
    out = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(out)
    assert load_config(tmp_path / "printed.yaml") == load_config(ROOT / "configs" / "quickstart.yaml", overrides)
    assert "  # Tensor-parallel degree (keep inside a node).\n  tp: 2\n" in out
    assert "wsd_decay_style: exponential" in out and "rampup_batch_size: [4, 4, 1000]" in out


def test_print_config_alone_prints_the_defaults(tmp_path, capsys):
    from megalysses.tools.pretrain import main

    assert main(["--print-config"]) == 0
    printed = capsys.readouterr()
    (tmp_path / "defaults.yaml").write_text(printed.out)
    assert load_config(tmp_path / "defaults.yaml", validate=False) == Config()
    assert "would stop with: config error: data.paths is empty" in printed.err     # and what a run still needs
