"""Bad input to the long-context evaluation: tools/eval_long.py's arguments and runs, the long_eval config section
(pretrain, in-process) and build_corpus --passkey. Nothing here needs trained weights: what can be checked
without them is checked before they are read."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from tests.faults.cases_config import pretrain
from tests.faults.cases_convert import hf_model, read_only
from tests.faults.cases_tools import run_dir, tokenizer_json
from tests.faults.corpus import Case

BYTES = ["model.vocab_size=259", "data.seq_len=640"]


def eval_long(*extra: str, run: Callable[[Path], str] = run_dir(*BYTES)) -> Callable[[Path], int]:
    def body(tmp: Path) -> int:
        from megalysses.tools.eval_long import main
        return main(["--run", run(tmp), "--out", str(tmp / "out"), *[a.format(tmp=tmp) for a in extra]])
    return body


def haystack(tokens: int) -> Callable[[Path], None]:
    """A byte-tokenized dataset {tmp}/hay of one document of `tokens` tokens."""
    def build(tmp: Path) -> None:
        import numpy as np

        from megalysses.data.indexed import IndexedDatasetBuilder, bin_path, idx_path
        b = IndexedDatasetBuilder(bin_path(tmp / "hay"), dtype=np.uint16)
        b.add_document(np.full(tokens, ord("a")), [tokens])
        b.finalize(idx_path(tmp / "hay"))
    return build


def with_steps(*steps: int) -> Callable[[Path], str]:
    """A run directory whose checkpoints/ holds (empty) folders of these steps."""
    def build(tmp: Path) -> str:
        run = run_dir(*BYTES)(tmp)
        for s in steps:
            (Path(run) / "checkpoints" / f"step_{s:07d}").mkdir(parents=True)
        return run
    return build


def _then(prepare: Callable[[Path], object], body: Callable[[Path], int]) -> Callable[[Path], int]:
    return lambda tmp: (prepare(tmp), body(tmp))[1]


def _word_tokenizer_run(tmp: Path) -> str:
    return run_dir("data.tokenizer=huggingface", f"data.tokenizer_model={tokenizer_json(100)(tmp)}")(tmp)


def corpus(*extra: str) -> Callable[[Path], int]:
    def body(tmp: Path) -> int:
        from megalysses.tools.build_corpus import main
        main(["--passkey", "--output", str(tmp / "c.jsonl"), *extra])
        return 0
    return body


PASSKEY = ["--tasks", "passkey"]

CASES = [
    # the settings
    Case("long_eval/length_shorter_than_the_prompt", eval_long(*PASSKEY, "--lengths", "64"),
         "cannot hold the passkey prompt"),
    Case("long_eval/niah_length_shorter_than_its_prompt", eval_long("--tasks", "niah", "--lengths", "300",
                                                                    "--haystack", "{tmp}/hay", run=lambda tmp: (
                                                                        haystack(5000)(tmp), run_dir(*BYTES)(tmp))[1]),
         "cannot hold the niah prompt"),
    Case("long_eval/depth_above_one", eval_long(*PASSKEY, "--depths", "0,1.5"), "outside [0, 1]"),
    Case("long_eval/depth_negative", eval_long(*PASSKEY, "--depths", "-0.1"), "outside [0, 1]"),
    Case("long_eval/unknown_task", eval_long("--tasks", "passkey,needle"), "unknown task"),
    Case("long_eval/no_task", eval_long("--tasks", ","), "no task"),
    Case("long_eval/samples_zero", eval_long(*PASSKEY, "--samples", "0"), "--samples"),
    Case("long_eval/lengths_not_numbers", eval_long(*PASSKEY, "--lengths", "1k"), "--lengths"),
    Case("long_eval/lengths_empty", eval_long(*PASSKEY, "--lengths", ","), "--lengths"),
    Case("long_eval/layout_larger_than_the_world", eval_long(*PASSKEY, "--set", "parallel.sp=4"), "world size 1"),
    Case("long_eval/unknown_setting", eval_long(*PASSKEY, "--set", "parallel.spp=2"), "parallel.sp"),
    # real text
    Case("long_eval/mock_run_without_haystack", eval_long("--tasks", "niah", "--lengths", "700"),
         "reads real text"),
    Case("long_eval/haystack_too_short", _then(haystack(300), eval_long(
        "--tasks", "position-loss", "--lengths", "700", "--haystack", "{tmp}/hay")), "fewer than the 701"),
    Case("long_eval/haystack_missing", eval_long("--tasks", "niah", "--lengths", "700", "--haystack",
                                                 "{tmp}/nope"), "nope"),
    # the run
    Case("long_eval/run_missing", eval_long(run=lambda tmp: str(tmp / "nowhere")), "not a run directory"),
    Case("long_eval/null_tokenizer", eval_long(*PASSKEY, run=run_dir(*BYTES, "data.tokenizer=NullTokenizer")),
         "cannot write the prompts"),
    Case("long_eval/tokenizer_without_digits", eval_long(*PASSKEY, run=_word_tokenizer_run),
         "cannot write the prompts"),
    Case("long_eval/no_checkpoint", eval_long(*PASSKEY), "no checkpoint"),
    Case("long_eval/step_not_saved", eval_long(*PASSKEY, "--step", "7", run=with_steps(5, 10)),
         "no checkpoint of step 7"),
    Case("long_eval/step_without_run", lambda tmp: __import__("megalysses.tools.eval_long", fromlist=["m"]).main(
        ["--from-hf", str(tmp), "--out", str(tmp / "o"), "--step", "3"]), "--step"),
    Case("long_eval/hf_without_out", lambda tmp: __import__("megalysses.tools.eval_long", fromlist=["m"]).main(
        ["--from-hf", str(tmp)]), "--out"),
    Case("long_eval/hf_dir_missing", lambda tmp: __import__("megalysses.tools.eval_long", fromlist=["m"]).main(
        ["--from-hf", str(tmp / "nope"), "--out", str(tmp / "o")]), "not a directory"),
    Case("long_eval/out_not_writable", lambda tmp: eval_long(*PASSKEY, "--out", f"{read_only(tmp)}/results")(tmp),
         "cannot write there"),
    Case("long_eval/hf_out_not_writable", lambda tmp: __import__("megalysses.tools.eval_long", fromlist=["m"]).main(
        ["--from-hf", hf_model()(tmp), "--out", f"{read_only(tmp)}/results", "--tasks", "passkey"]),
         "cannot write there"),
    Case("long_eval/out_is_a_file", _then(lambda tmp: (tmp / "f").write_text("x"), eval_long(
        *PASSKEY, "--out", "{tmp}/f/results")), "is a file"),
    # the config section, as pretrain reads it
    Case("long_eval/config_depth_above_one", pretrain("long_eval.depths=[0,2]"), "long_eval.depths"),
    Case("long_eval/config_no_task", pretrain("long_eval.tasks=[]"), "long_eval.tasks"),
    Case("long_eval/config_unknown_task", pretrain("long_eval.tasks=[needle]"), "long_eval.tasks"),
    Case("long_eval/config_length_zero", pretrain("long_eval.lengths=[0]"), "long_eval.lengths"),
    Case("long_eval/config_samples_zero", pretrain("long_eval.samples=0"), "long_eval.samples"),
    Case("long_eval/config_mock_data_needs_haystack", pretrain("long_eval.interval=1"), "long_eval.haystack"),
    Case("long_eval/config_length_shorter_than_the_prompt", pretrain(
        "long_eval.interval=1", "long_eval.tasks=[passkey]", "model.vocab_size=259"), "cannot hold the passkey"),
    Case("long_eval/config_tokenizer_larger_than_the_model", pretrain(
        "long_eval.interval=1", "long_eval.tasks=[passkey]", "long_eval.lengths=[400]"), "model.vocab_size"),
    # the corpus
    Case("long_eval/corpus_documents_too_short", corpus("--seq-len", "100", "--documents", "2"),
         "cannot hold the passkey prompt"),
    Case("long_eval/corpus_no_documents", corpus("--documents", "0"), "--documents"),
]
