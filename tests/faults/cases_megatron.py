"""Bad Megatron-LM command lines and scripts given to tools/from_megatron.py (its main function, in-process):
one error line naming the flag or the line, and no config written."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from tests.faults.corpus import Case

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
        "--global-batch-size 4 --train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128").split()


def convert(*argv: str, drop: tuple[str, ...] = ()) -> Callable[[Path], int]:
    """from_megatron on BASE (less the flags in `drop`, with their values) plus `argv`."""
    def body(tmp: Path) -> int:
        from megalysses.tools.from_megatron import main
        base, skip = [], False
        for word in BASE:
            skip = word in drop or (skip and not word.startswith("--"))
            if not skip:
                base.append(word)
        return main(["--output", str(tmp / "run.yaml"), "--", *base, *argv])
    return body


def script(text: str, *args: str) -> Callable[[Path], int]:
    def body(tmp: Path) -> int:
        from megalysses.tools.from_megatron import main
        (tmp / "train.sh").write_text(text)
        return main(["--script", str(tmp / "train.sh"), *args, "--output", str(tmp / "run.yaml")])
    return body


CASES = [
    Case("megatron/unknown_flag", convert("--use-magic-attention"), "--use-magic-attention"),
    Case("megatron/misspelt_flag", convert("--hiden-dropout", "0"), "did you mean --hidden-dropout"),
    Case("megatron/every_unknown_flag_at_once", convert("--hiden-dropout", "0", "--use-magic-attention"),
         "2 flags that Megatron-LM's pretrain_gpt.py does not have: --hiden-dropout (did you mean --hidden-dropout?), "
         "--use-magic-attention"),
    Case("megatron/mixture_of_experts", convert("--num-experts", "8", "--moe-router-topk", "2"),
         "a mixture-of-experts command line (--num-experts 8, --moe-router-topk)"),
    Case("megatron/cannot_start", lambda tmp: __import__("megalysses.tools.from_megatron", fromlist=["m"]).main(
        ["--output", str(tmp / "x.yaml"), "--gpus", "3", "--", *BASE]),
         "cannot start on 3 GPUs: training.global_batch_size=4 is not divisible by micro_batch_size=1 * dp=3"),
    Case("megatron/int_word", convert("--num-layers", "four"), "--num-layers: expected an integer"),
    Case("megatron/float_word", convert("--clip-grad", "high"), "--clip-grad: expected a number"),
    Case("megatron/bad_choice", convert("--normalization", "BatchNorm"), "--normalization: 'BatchNorm'"),
    Case("megatron/value_missing", convert("--seed"), "--seed needs one value"),
    Case("megatron/split_value", convert("--step-batch-size-schedule", "0:2", "40:4"), "quote the expansion"),
    Case("megatron/rampup_two_numbers", convert("--rampup-batch-size", "2", "2"), "--rampup-batch-size needs three"),
    Case("megatron/flag_with_value", convert("--swiglu=true"), "--swiglu takes no value"),
    Case("megatron/stray_word", convert("--swiglu", "stray"), "unexpected argument 'stray' (after --swiglu)"),
    Case("megatron/no_layers", convert(drop=("--num-layers",)), "--num-layers is missing"),
    Case("megatron/no_tokenizer", convert(drop=("--tokenizer-type",)), "--tokenizer-type is missing"),
    Case("megatron/no_iters", convert(drop=("--train-iters",)), "one of --train-iters and --train-samples"),
    Case("megatron/no_global_batch", convert(drop=("--global-batch-size",)), "--global-batch-size is missing"),
    Case("megatron/tiktoken", convert("--tokenizer-type", "TikTokenizer"), "TikTokenizer"),
    Case("megatron/wsd_without_decay", convert("--lr-decay-style", "WSD"), "--lr-wsd-decay-iters"),
    Case("megatron/samples_flag_with_iters", convert("--lr-decay-samples", "100"), "--lr-decay-samples with"),
    Case("megatron/virtual_not_dividing", convert("--pipeline-model-parallel-size", "2",
                                                  "--num-layers-per-virtual-pipeline-stage", "3"),
         "--num-layers-per-virtual-pipeline-stage 3"),
    Case("megatron/positions_below_length", convert("--max-position-embeddings", "16"), "--max-position-embeddings"),
    Case("megatron/ramp_that_does_not_divide", convert("--rampup-batch-size", "3", "2", "8"),
         "training.rampup_batch_size"),
    Case("megatron/lossy_without_permission", convert("--fp16"), "--allow-lossy"),
    Case("megatron/padded_vocab_below_the_tokenizer", convert("--padded-vocab-size", "100"),
         "--padded-vocab-size 100 is smaller than the tokenizer's 128 tokens"),
    Case("megatron/padded_vocab_not_split_by_tp", convert("--padded-vocab-size", "129", "--tensor-model-parallel-size",
                                                          "2"), "not divisible by --tensor-model-parallel-size 2"),
    Case("megatron/no_data", convert(drop=("--mock-data",)), "--data-path is missing"),
    Case("megatron/null_tokenizer_without_size", convert(drop=("--vocab-size",)), "--vocab-size is missing"),
    Case("megatron/hf_tokenizer_missing", convert("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                                  "/nonexistent/tok", drop=("--vocab-size",)),
         "cannot read the tokenizer"),
    Case("megatron/script_missing", lambda tmp: __import__("megalysses.tools.from_megatron", fromlist=["m"]).main(
        ["--script", str(tmp / "nope.sh"), "--output", str(tmp / "x.yaml")]), "cannot read the script"),
    Case("megatron/script_without_pretrain", script("echo hello\npython train.py --lr 1\n"), "never runs pretrain_gpt"),
    Case("megatron/script_loop", script("for N in 1 2; do A+=(--seed $N); done\ntorchrun pretrain_gpt.py ${A[@]}\n"),
         "a 'for' block"),
    Case("megatron/script_command_output", script("torchrun pretrain_gpt.py --num-layers $(cat n.txt)\n"),
         "a command's output"),
    Case("megatron/script_unclosed_quote", script("X=\"open\ntorchrun pretrain_gpt.py\n"), "unclosed"),
    Case("megatron/script_latin1", lambda tmp: (tmp.joinpath("t.sh").write_bytes(b"# caf\xe9\n"), __import__(
        "megalysses.tools.from_megatron", fromlist=["m"]).main(["--script", str(tmp / "t.sh"), "--output",
                                                                str(tmp / "x.yaml")]))[1], "not UTF-8"),
    Case("megatron/neither_form", lambda tmp: __import__("megalysses.tools.from_megatron", fromlist=["m"]).main(
        ["--output", str(tmp / "x.yaml")]), "give either --script"),
]
