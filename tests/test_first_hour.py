"""The README's first hour, run as it is written: the commands of its marked block, read from README.md and run
in order at a tiny size; and the set-up before it (`make quickstart`, a dry run): what it installs, with pip's
progress shown.

Each command runs as its program does, in this process where it can, to spare the interpreter start-ups:
`python tools/NAME.py ARGS` is megalysses.tools.NAME.main(ARGS), `torchrun --nproc-per-node N pretrain.py ARGS`
is pretrain's main on N gloo ranks (megalysses.testing.run_distributed), `python - <<'EOF'` runs the script
given. SIZES are the only edits to the block, and each must be found in it, so a README that changes them fails
here; the first run also gets TINY_MODEL's overrides (the resume reads them from the run's config.yaml)."""
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sysconfig
from pathlib import Path

import pytest

from megalysses.testing import run_distributed
from tests.fixtures import metrics

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- first-hour"
# (one preprocessing worker writes the bytes that two write, tests/test_data_preprocess.py: it spares a pool's start)
SIZES = {"--vocab-size 4096": "--vocab-size 400", "--workers 2": "--workers 1",
         "--set training.train_steps=200": "--set training.train_steps=2",
         "--set training.train_steps=300": "--set training.train_steps=3", "--max-new-tokens 100": "--max-new-tokens 4",
         "max_new_tokens=40": "max_new_tokens=4"}
TINY_MODEL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
              "data.seq_len=32", "training.micro_batch_size=1", "training.global_batch_size=2",
              "logging.log_interval=1", "parallel.timeout_seconds=60"]


def readme_block(marker: str) -> str:
    """The ```bash block that follows `marker` (an HTML comment, once in README.md)."""
    text = (ROOT / "README.md").read_text()
    assert text.count(marker) == 1, f"README.md has one block after {marker!r}"
    block = re.search(r"```bash\n(.*?)```", text[text.index(marker):], re.S)
    assert block is not None, f"{marker!r} is followed by a ```bash block"
    return block.group(1)


def first_hour_block() -> str:
    return readme_block(MARKER)


def commands(block: str) -> list[tuple[list[str], str]]:
    """(argv, the text a here-document gives it) of each command: comments dropped, continued lines joined."""
    lines, out = block.splitlines(), []
    while lines:
        line = lines.pop(0)
        while line.endswith("\\"):
            line = line[:-1] + lines.pop(0)
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        body = []
        if argv[-1].startswith("<<"):          # a here-document, to its end line
            end = argv.pop()[2:]
            while lines[0] != end:
                body.append(lines.pop(0) + "\n")
            lines.pop(0)
        out.append((argv, "".join(body)))
    return out


def scaled_commands(block: str, sizes: dict[str, str], overrides: list[str], what: str
                    ) -> list[tuple[list[str], str]]:
    """The commands of `block` with each of `sizes` (said once in it, or `what` no longer says it) replaced by
    its tiny stand-in, and the first torchrun launch given `overrides` as --set."""
    for size, tiny in sizes.items():
        assert block.count(size) == 1, f"{what} no longer says {size!r}: update SIZES"
        block = block.replace(size, tiny)
    steps = commands(block)
    launch = next(argv for argv, _ in steps if argv[0] == "torchrun")
    launch.extend(a for o in overrides for a in ("--set", o))
    return steps


def _pretrain(rank: int, world: int, cwd: str, argv: list[str]) -> int:
    from megalysses.tools import pretrain

    os.chdir(cwd)
    pretrain.destroy_distributed = lambda: None        # the test's process group outlives the run
    return pretrain.main(argv)


def run(argv: list[str], stdin: str, cwd: Path) -> str:
    """One command of the block, as its program runs it; what a script given to python printed."""
    if argv[:2] == ["python", "-"]:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(stdin, "README.md", "exec"), {"__name__": "__main__"})
        return printed.getvalue()
    elif argv[0] == "python" and argv[1].startswith("tools/"):
        tool = importlib.import_module(f"megalysses.tools.{Path(argv[1]).stem}")
        result = tool.main(argv[2:])
        assert not isinstance(result, int) or result == 0, (argv, result)
    elif argv[0] == "torchrun":
        assert argv[1] == "--nproc-per-node" and argv[3] == "pretrain.py", argv
        assert run_distributed(_pretrain, int(argv[2]), cwd, args=(str(cwd), argv[4:])) == [0] * int(argv[2])
    else:
        raise AssertionError(f"the first hour runs a command this test does not know how to run: {argv}")
    return ""


def test_the_first_hour_runs_as_written(tmp_path, monkeypatch, capsys):
    steps = scaled_commands(first_hour_block(), SIZES, TINY_MODEL, "the first hour")
    # a JSON Lines corpus of one's own: Python's json package, a document per block of its files
    library = Path(sysconfig.get_paths()["stdlib"]) / "json"
    documents = [b for f in sorted(library.glob("*.py")) for b in f.read_text().split("\n\n") if b.strip()]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "my.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    scripts = [run(argv, stdin, tmp_path) for argv, stdin in steps]
    printed = capsys.readouterr().out

    run_dir = tmp_path / "runs" / "my"
    marks = [row for row in metrics(run_dir) if "event" in row]
    assert [(m["step"], m["layout"]["tp"], m["layout"]["sp"]) for m in marks] == [(0, 1, 2), (2, 2, 1)]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000003"
    assert (run_dir / "metrics.png").is_file() and "(1 restarts marked)" in printed
    # the export's tokenizer, loaded by transformers, gives the ids the run trained on
    from transformers import AutoTokenizer

    from megalysses.data.tokenizer import build_tokenizer

    text = (library / "decoder.py").read_text()[:2000]
    ours = build_tokenizer("sentencepiece", str(tmp_path / "data" / "my_tokenizer.model"))
    assert AutoTokenizer.from_pretrained(tmp_path / "out" / "my-hf")(text)["input_ids"] == ours.encode(text)
    assert scripts[-1].startswith("def ")                 # transformers' generation, from the prompt


def test_make_quickstart_installs_what_training_and_plotting_need_with_progress(tmp_path):
    """A dry run (make -n) in an environment that does not exist yet: the torch requirement from its index,
    then megalysses[plot]; pip's progress shown (no --quiet but on pip's own upgrade); the test extra comes with
    `make test`, a GPU machine's torch with SYSTEM_SITE_PACKAGES=1."""
    def dry(*args: str) -> list[str]:
        r = subprocess.run(["make", "-n", *args, f"VENV={tmp_path}/env"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    quickstart = dry("quickstart", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    installs = [line for line in quickstart if "pip install" in line]
    assert installs[0].endswith("pip install --quiet --upgrade pip")
    assert installs[1].endswith('pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"')
    assert installs[2:] == [f'{tmp_path}/env/bin/python -m pip install -e ".[plot]"'], installs
    assert "torchrun" in " ".join(quickstart)
    assert f'{tmp_path}/env/bin/python -m pip install -e ".[test]"' in dry("test")
    assert f"python3 -m venv --system-site-packages {tmp_path}/env" in " ".join(dry("quickstart",
                                                                                   "SYSTEM_SITE_PACKAGES=1"))


@pytest.mark.parametrize("block, expected", [
    ("# a comment\npython tools/x.py --a 1 \\\n    --b 'two words'   # said\n",
     [(["python", "tools/x.py", "--a", "1", "--b", "two words"], "")]),
    ("python - <<'EOF'\nprint(1)\nEOF\ntorchrun x\n", [(["python", "-"], "print(1)\n"), (["torchrun", "x"], "")]),
])
def test_the_block_is_read_as_bash_reads_it(block, expected):
    assert commands(block) == expected


def test_the_first_hour_writes_only_where_git_ignores():
    """The corpus, the tokenizer and the datasets go under data/, the runs under runs/, the export under out/:
    each a folder .gitignore names, so the first hour leaves nothing for `git status` to list."""
    ignored = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    written = []
    for argv, _ in commands(first_hour_block()):
        for flag in ("--output", "--model-prefix", "--output-prefix", "--to-hf"):
            if flag in argv:
                written.append(argv[argv.index(flag) + 1])
    corpus = re.search(r"build_corpus\.py .*--output (\S+)`", first_hour_block())
    assert corpus is not None and written, "the first hour names where its corpus and datasets go"
    for path in written + [corpus.group(1)]:
        assert path.split("/")[0] in ignored and "/" in path, f"{path} is not in a folder .gitignore names"

