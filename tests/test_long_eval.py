"""Long-context evaluation: prompts of exact lengths, the scoring kernel against full logits, a synthetic passkey
corpus through preprocessing, training with long_eval and tools/eval_long.py on one process, and the same figures
from the layouts of the parity matrix (tp, Ulysses and ring sp, pp and virtual stages, FSDP, head chunks, dp).

The answers of the needle tasks are made the model's own greedy choice (computed from full logits) in half of
the samples and wrong in the last token in the other half, so every (task, depth) cell must read exactly 50%:
a metric that can move, and one that a misplaced label, sample or rank would change."""
import contextlib
import io
import json
import re
import textwrap

import numpy as np
import pytest
import torch

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.data.tokenizer import ByteTokenizer
from megalysses.evaluation.corpus import passkey_documents, passkey_records, plain_text
from megalysses.evaluation.tasks import (NIAH_KEYS, PromptError, Prompts, bucket_bounds, bucket_of, compose,
                                         document_positions, minimum_length, niah_prompt, passkey_prompt,
                                         repeated_filler)
from megalysses.kernels.linear_cross_entropy import token_scores
from megalysses.testing import run_distributed
from tests.fixtures import metrics

LENGTH = 448
TASKS = ("passkey", "niah", "position-loss")
RUN = ["data.tokenizer=byte", "model.vocab_size=259", "model.hidden_size=32", "model.num_layers=4",
       "model.num_heads=4", "model.num_kv_heads=2", "model.attention_backend=sdpa", f"data.seq_len={LENGTH}",
       "data.split=50,50,0", "training.micro_batch_size=1", "training.global_batch_size=1", "training.train_steps=2",
       "optimizer.warmup_steps=1", "optimizer.lr=3e-3", "checkpoint.save_interval=0", "logging.log_interval=1",
       "parallel.timeout_seconds=60", "long_eval.interval=2", f"long_eval.tasks=[{','.join(TASKS)}]",
       "long_eval.depths=[0,1]", "long_eval.samples=1"]
DEPTHS, SAMPLES = (0.0, 1.0), 2
EVAL = ["--tasks", ",".join(TASKS), "--lengths", str(LENGTH), "--depths", "0,1", "--samples", str(SAMPLES)]
LAYOUTS = {   # name: --set overrides of the run's single-process layout, on 4 ranks (the rest data parallelism)
    "dp4_mbs2": ["training.micro_batch_size=2"],
    "tp2_seqpar": ["parallel.tp=2", "parallel.tp_sequence_parallel=true"],
    "sp2": ["parallel.sp=2"],
    "ring2_pp2": ["parallel.sp=2", "parallel.sp_ring=2", "parallel.pp=2"],
    "u2ring2": ["parallel.sp=4", "parallel.sp_ring=2"],
    "tp2_pp2v2": ["parallel.tp=2", "parallel.pp=2", "parallel.virtual_stages=2"],
    "fsdp_sp2_chunks2": ["parallel.fsdp=true", "parallel.sp=2", "training.attention_head_chunks=2"],
}
GRIDS = {     # the layout each one reports: (tp, ulysses, ring, pp, dp)
    "dp4_mbs2": (1, 1, 1, 1, 4), "tp2_seqpar": (2, 1, 1, 1, 2), "sp2": (1, 2, 1, 1, 2), "ring2_pp2": (1, 1, 2, 2, 1),
    "u2ring2": (1, 2, 2, 1, 1), "tp2_pp2v2": (2, 1, 1, 2, 1), "fsdp_sp2_chunks2": (1, 2, 1, 1, 2),
}


def test_prompts_are_exactly_as_long_as_asked():
    prompts = Prompts(ByteTokenizer(), bos="256")
    rng = np.random.default_rng(0)
    for depth in (0.0, 0.4, 1.0):
        prompt = passkey_prompt(prompts, depth, rng)
        sample = compose(prompts, prompt, 400, repeated_filler(prompts), rng)
        text = bytes(t for t in sample.tokens[1:] if t < 256).decode()
        key = text.rsplit(" ", 1)[1]
        assert sample.tokens[0] == 256 and len(sample.tokens) == 401 and len(key) == 5
        assert (sample.buckets == 0).sum() == len(prompt.answer) == 6 and (sample.buckets[-6:] == 0).all()
        needle = text.index(f"The pass key is {key}.")
        filler = text.index("The grass")
        assert (needle < filler) == (depth == 0.0) and (text.index("What is") - needle < 80) == (depth == 1.0)
        assert sum(c.isdigit() for c in text) == 15                  # the key twice in the needle, once answered

    def haystack(n, rng):
        return np.frombuffer((b"Lorem ipsum dolor. " * n)[:n], dtype=np.uint8).astype(np.int64)

    sample = compose(prompts, niah_prompt(prompts, 0.5, rng, NIAH_KEYS), 700, haystack, rng)
    text = bytes(t for t in sample.tokens if t < 256).decode()
    assert len(sample.tokens) == 701 and text.count("special magic numbers for") == NIAH_KEYS
    asked = text.rsplit("magic number for ", 1)[1].split(" ")[0]
    assert text.count(asked) == 3 and text.endswith(text.split(f"for {asked} is: ")[1].split(".")[0])
    with pytest.raises(PromptError, match="length 100 cannot hold the passkey prompt"):
        compose(prompts, passkey_prompt(prompts, 0.5, rng), 100, repeated_filler(prompts), rng)


def test_positions_and_buckets():
    inputs = np.array([5, 5, 257, 5, 5, 5, 5, 5, 257, 5])
    assert document_positions(inputs, 257).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0]
    assert bucket_of(np.arange(9)).tolist() == [0, 1, 2, 2, 3, 3, 3, 3, 4]
    assert [bucket_bounds(b, 10) for b in range(5)] == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]


def test_token_scores_equal_full_logits_and_read_only_labelled_rows():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 9, 16, generator=g), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 37, (2, 9), generator=g)
    logits = (x @ w.t())[..., :37]                                   # rows 37-39 are vocabulary padding
    labels[0, :3] = logits[0, :3].argmax(-1)                        # some labels are the argmax
    labels[1, 5:] = -100
    losses, top = token_scores(x, w, labels, vocab_size=37, chunk_tokens=4)
    valid = labels != -100
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 37), labels.reshape(-1).clamp_min(0),
                                             reduction="none").view(2, 9) * valid
    assert torch.allclose(losses, want, atol=1e-5) and (losses[~valid] == 0).all()
    assert torch.equal(top, valid & (logits.argmax(-1) == labels)) and top[0, :3].all()
    x.requires_grad_()
    token_scores(x, w, torch.full((2, 9), -100))                     # no labelled row: the head is not run


def test_passkey_corpus_documents_are_one_sample_each():
    docs = list(passkey_documents([textwrap.__doc__, json.__doc__], seq_len=400, count=5, seed=1))
    assert all(len(d.encode()) == 399 and d.isascii() for d in docs)
    for d in docs:
        key = d.rsplit(" ", 1)[1]
        assert d.count(key) == 3 and sum(c.isdigit() for c in d) == 15
    assert plain_text("Tab\there: 3 ü!") == "Tab here: !"
    with pytest.raises(ValueError, match="cannot hold the passkey prompt"):
        passkey_documents(iter(()), seq_len=200, count=1, seed=1)
    assert list(passkey_records(docs, "all")) == [{"text": d} for d in docs]
    with pytest.raises(ValueError, match="loss on 'key': give one of all, answer"):
        next(passkey_records(docs, "key"))


def test_answer_only_corpus_trains_the_labels_the_evaluation_scores(tmp_path, capsys):
    """--loss-on answer through preprocess_data.py --chat and the loader: one document a sequence of exactly
    seq_len tokens, its text the evaluation's prompt, and the labels that carry the loss its answer and EOD alone,
    at the positions the evaluation scores."""
    from megalysses.data.build import build_gpt_datasets
    from megalysses.data.loader import BatchFormat, build_micro_batch
    from megalysses.tools import build_corpus, preprocess_data

    docs = list(passkey_documents([textwrap.__doc__, json.__doc__], seq_len=400, count=6, seed=2))
    with open(tmp_path / "pk.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in passkey_records(docs, "answer"))
    preprocess_data.main(["--input", str(tmp_path / "pk.jsonl"), "--output-prefix", str(tmp_path / "pk"), "--chat",
                          "--workers", "1", "--tokenizer-type", "byte", "--log-interval", "0"])
    train, _, _ = build_gpt_datasets([str(tmp_path / "pk_text_document")], "100,0,0", 400, 1, (6, None, None))
    rows = [train[i] for i in range(6)]
    batch = build_micro_batch(rows, 400, 0, BatchFormat(257, True, True))
    labels, inputs = batch["labels"].numpy(), batch["input_ids"].numpy()
    prompts = Prompts(ByteTokenizer())
    rng = np.random.default_rng(0)
    scored = compose(prompts, passkey_prompt(prompts, 0.5, rng), 398, repeated_filler(prompts), rng).buckets == 0
    for row, lab, inp in zip(rows, labels, inputs):
        text = bytes(row.tokens[:-1].astype(np.uint8)).decode()
        key = text.rsplit(" ", 1)[1]
        assert len(row.tokens) == 400 and row.tokens[-1] == 257 and text in docs and (inp == row.tokens).all()
        assert text.endswith(f"What is the pass key? The pass key is {key}") and f"The pass key is {key}." in text
        assert (np.flatnonzero(lab != -100) == np.arange(392, 399)).all() and lab[398] == 257   # the answer, EOD
        assert bytes(lab[392:398].astype(np.uint8)).decode() == f" {key}" and scored[392:].all() and \
            not scored[:392].any()                         # the labels the evaluation scores at length 398
    for argv, said in ((["--stdlib", "--loss-on", "answer"], "error: --loss-on only applies with --passkey"),
                       (["--passkey", "--loss-on", "key"], "error: argument --loss-on: invalid choice: 'key'")):
        with pytest.raises(SystemExit):
            build_corpus.main(argv + ["--output", str(tmp_path / "x.jsonl")])
        assert said in capsys.readouterr().err.strip().splitlines()[-1]


def _greedy_answers(cfg, samples: dict) -> dict:
    """The samples with their answers the model's greedy tokens (from full logits, one batched forward per answer
    position, through micro-batches built as the evaluation builds them) where the sample index is even, and the
    last one wrong where it is odd."""
    from megalysses.checkpoint.initial import load_initial_weights
    from megalysses.data.loader import BatchFormat, build_micro_batch
    from megalysses.training.build import build_model
    from megalysses.testing import plan_and_grid

    device = torch.device("cpu")
    run, grid = plan_and_grid(cfg, device)
    model = build_model(cfg, grid, device, grid.device_mesh(device), run)
    load_initial_weights(cfg.logging.run_dir, model, cfg, grid, grid.device_mesh(device))
    model.eval()
    keys = list(samples)
    tokens = [samples[k].tokens.copy() for k in keys]
    first = [LENGTH - int((samples[k].buckets == 0).sum()) for k in keys]
    for j in range(min(first), LENGTH):
        mb = build_micro_batch(tokens, LENGTH, 0, BatchFormat(257, True, True))
        with torch.no_grad():
            best = model(mb["input_ids"], mb["position_ids"], doc_ids=mb["doc_ids"])[:, j].argmax(-1).tolist()
        for b, key in enumerate(keys):
            if j >= first[b]:
                tokens[b][j + 1] = best[b] if key[1][2] % 2 == 0 or j < LENGTH - 1 else (best[b] + 1) % 256
    return {k: type(samples[k])(t, samples[k].buckets) for k, t in zip(keys, tokens)}


def _pipeline(rank, world, tmp):
    """One process: the passkey corpus (its answers alone trained) through preprocessing, two training steps with
    long_eval, the answers made greedy (or not), and tools/eval_long.py on the run."""
    from megalysses.data.tokenizer import tokenizer_from_config
    from megalysses.evaluation.haystack import DocumentStream
    from megalysses.tools import preprocess_data
    from megalysses.training.long_eval import LongEval, LongEvalSettings
    from megalysses.training.loop import train
    from megalysses.testing import plan_and_grid

    with open(f"{tmp}/pk.jsonl", "w") as f:
        for record in passkey_records(passkey_documents([textwrap.__doc__, json.__doc__], LENGTH, 8, seed=0),
                                      "answer"):
            f.write(json.dumps(record) + "\n")
    preprocess_data.main(["--input", f"{tmp}/pk.jsonl", "--output-prefix", f"{tmp}/pk", "--chat", "--workers", "1",
                          "--tokenizer-type", "byte", "--log-interval", "0"])
    cfg = load_config(None, RUN + [f"data.paths=[{tmp}/pk_text_document]", f"logging.run_dir={tmp}/run"])
    run, grid = plan_and_grid(cfg, torch.device("cpu"))
    train(cfg, run, grid, torch.device("cpu"))
    logged = metrics(tmp / "run")
    evaluator = LongEval(cfg, grid, torch.device("cpu"), run, tokenizer_from_config(cfg.data),
                         DocumentStream.validation(cfg.data))
    s = LongEvalSettings(TASKS[:2], (LENGTH,), DEPTHS, SAMPLES)
    forced = _greedy_answers(cfg, {(LENGTH, item): evaluator.sample(s, LENGTH, item) for item in evaluator._items(s)})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = _evaluate_with(forced, ["--run", f"{tmp}/run", "--out", f"{tmp}/single"] + EVAL)
    pictures = sorted(p.name for p in (tmp / "single").glob("*.png"))
    return {"logged": logged, "forced": forced, "results": results, "pictures": pictures,
            "table": (tmp / "single" / "long_eval.md").read_text(), "printed": printed.getvalue()}


def _evaluate_with(forced: dict, argv: list[str]) -> dict:
    """tools/eval_long.py with the needle tasks' samples replaced by `forced`; its long_eval.json (every rank)."""
    from megalysses.tools import eval_long
    from megalysses.training import long_eval

    original = long_eval.LongEval.sample

    def sample(self, s, length, item):
        return forced[(length, item)] if (length, item) in forced else original(self, s, length, item)

    long_eval.LongEval.sample = sample
    try:
        assert eval_long.main(argv) == 0
    finally:
        long_eval.LongEval.sample = original
    torch.distributed.barrier()
    return json.loads(open(f"{argv[argv.index('--out') + 1]}/long_eval.json").read())


def _layouts(rank, world, tmp, forced):
    from megalysses.tools import eval_long

    eval_long.draw = lambda *args: []                  # the pictures: drawn once, by the single process
    return {name: _evaluate_with(forced, ["--run", f"{tmp}/run", "--out", f"{tmp}/{name}"] + EVAL +
                                 [a for o in overrides for a in ("--set", o)])
            for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long_eval")
    return tmp, run_distributed(_pipeline, 1, tmp, args=(tmp,), timeout=300)[0]


def test_training_logs_long_eval_and_the_tool_writes_its_figures(single):
    _, out = single
    evals = [r for r in out["logged"] if any(k.startswith("long_eval/") for k in r)]
    assert [r["step"] for r in evals] == [2]
    assert {"long_eval/passkey/448", "long_eval/niah/448", "long_eval/position-loss/448/256-448"} <= set(evals[0])
    assert out["pictures"] == ["long_eval_niah.png", "long_eval_passkey.png", "long_eval_position_loss.png"]
    assert "| passkey: length | depth 0 | depth 1 | mean |" in out["table"]
    accuracy = [r for r in out["results"]["results"] if "accuracy" in r]
    assert len(accuracy) == 4 and {r["accuracy"] for r in accuracy} == {0.5}, accuracy   # the forced answers
    assert all(set(r) == {"task", "length", "depth", "accuracy", "samples"} for r in accuracy)
    position = [r for r in out["results"]["results"] if r["task"] == "position-loss"]
    assert [r["positions"] for r in position][-1] == [256, 448] and all(r["tokens"] > 0 for r in position)
    # what it runs, said before the weights are read, then a line per cell done (2 samples each, one at a time)
    lines = [line for line in out["printed"].splitlines() if line.startswith("long_eval: ")]
    assert lines[0] == (f"long_eval: tasks passkey, niah, position-loss; lengths {LENGTH} (trained at {LENGTH}); "
                        f"depths 0, 1; 2 samples each: 5 cells, 10 samples, {10 * LENGTH:,} tokens"), lines
    done = [re.match(r"long_eval: (\d) of 5 cells done \((.*)\), 0:\d\d:\d\d elapsed, about 0:\d\d:\d\d left$",
                     line) for line in lines[1:]]
    assert all(done) and [(int(m[1]), m[2]) for m in done] == [
        (1, f"passkey at {LENGTH} tokens, depth 0"), (2, f"passkey at {LENGTH} tokens, depth 1"),
        (3, f"niah at {LENGTH} tokens, depth 0"), (4, f"niah at {LENGTH} tokens, depth 1"),
        (5, f"position-loss at {LENGTH} tokens")], lines
    assert lines[-1].endswith("about 0:00:00 left")
    assert out["printed"].index("long_eval: tasks") < out["printed"].index("| passkey: length")


def test_the_plan_names_the_default_lengths_left_out_and_the_estimate_reads_the_tokens_left():
    from argparse import Namespace

    from megalysses.tools.eval_long import _settings, plan_lines, progress_line
    from megalysses.training.long_eval import EvalProgress

    cfg = load_config(None, ["data.mock=true", "model.vocab_size=259", "long_eval.tasks=[passkey,position-loss]",
                             "long_eval.depths=[0.5]", "long_eval.samples=3"])
    prompts = Prompts(ByteTokenizer())
    args = Namespace(tasks=None, lengths=None, depths=None, samples=None, seed=None)
    settings, dropped = _settings(cfg, args, prompts, 640)
    need = minimum_length(prompts, "passkey")
    assert 160 < need <= 320 and settings.lengths == (320, 640)
    assert dropped == [(f"length 160 (a quarter of the trained 640) left out: it cannot hold the passkey prompt, "
                        f"which needs {need} tokens with this tokenizer")]
    plan = ("long_eval: tasks passkey, position-loss; lengths 320, 640 (extrapolation) (trained at 320); depths 0.5; "
            "3 samples each: 4 cells, 12 samples, 5,760 tokens")
    assert plan_lines(settings, 320, dropped) == [plan, f"long_eval: {dropped[0]}"]
    tally = EvalProgress(cells=4, tokens=5760, cells_done=1, tokens_done=960, last="passkey at 320 tokens, depth 0.5")
    assert progress_line(tally, 90.0) == ("long_eval: 1 of 4 cells done (passkey at 320 tokens, depth 0.5), 0:01:30 "
                                          "elapsed, about 0:07:30 left")
    from megalysses.tools.eval_long import _parser
    assert "Llama, Qwen2/2.5, Qwen3 or Mistral" in " ".join(_parser().format_help().split())


def test_results_that_cannot_be_written_are_printed_and_one_error(tmp_path, capsys):
    from megalysses.tools.eval_long import _write
    from megalysses.training.long_eval import LongEvalReport, LongEvalSettings
    from tests.faults.cases_convert import read_only

    report = LongEvalReport([{"task": "passkey", "length": 400, "depth": 0.5, "accuracy": 0.5, "samples": 2}], 400)
    with pytest.raises(ConfigError, match="cannot write the results into .*: give --out a directory"):
        _write(read_only(tmp_path) / "out", report, LongEvalSettings(("passkey",), (400,)), tmp_path, {})
    assert "| 400 | 50% | 50% |" in capsys.readouterr().out


def test_every_layout_reports_the_figures_of_one_process(single):
    tmp, out = single
    per_rank = run_distributed(_layouts, 4, tmp, args=(tmp, out["forced"]), timeout=300)
    reference = out["results"]["results"]
    for name, got in per_rank[0].items():
        assert got["layout"]["world"] == 4, name
        assert tuple(got["layout"][k] for k in ("tp", "ulysses", "ring", "pp", "dp")) == GRIDS[name], name
        results = got["results"]
        assert [(r["task"], r.get("depth"), r.get("positions")) for r in results] == \
            [(r["task"], r.get("depth"), r.get("positions")) for r in reference], name
        for a, b in zip(results, reference):
            if "accuracy" in b:
                assert a == b, f"{name}: {a} != one process's {b}"
            else:
                assert a["tokens"] == b["tokens"] and abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), name


def test_training_lengths_follow_the_curriculum(monkeypatch):
    from megalysses.training.long_eval import LongEval, TrainingLongEval
    from megalysses.testing import resolve_run

    cfg = load_config(None, ["data.mock=true", "model.vocab_size=259", "data.seq_len=640",
                             "data.seq_len_schedule=[[0, 320], [3, 640]]", "long_eval.interval=2",
                             "long_eval.tasks=[passkey]"])
    seen = []
    monkeypatch.setattr(LongEval, "run", lambda self, model, s, trained, doing: seen.append((s.lengths, trained)))
    hook = TrainingLongEval(cfg, None, torch.device("cpu"), resolve_run(cfg, torch.device("cpu")))
    for step in (2, 4):
        hook(None, step, lambda what: None)
    assert seen == [((320,), 320), ((640,), 640)] and hook.due(4) and not hook.due(3)
    cfg.long_eval.lengths = [1280]
    hook(None, 4, lambda what: None)
    assert seen[-1] == ((1280,), 640)
    with pytest.raises(ConfigError, match="long_eval: length 160 cannot hold the passkey prompt"):
        short = load_config(None, ["data.mock=true", "model.vocab_size=259", "data.seq_len=640",
                                   "data.seq_len_schedule=[[0, 160], [3, 640]]", "long_eval.interval=2",
                                   "long_eval.tasks=[passkey]"])
        TrainingLongEval(short, None, torch.device("cpu"), resolve_run(short, torch.device("cpu")))


def test_an_evaluation_plans_no_checkpoint_saves():
    """An evaluation writes no checkpoint: its plan saves none in the background (no saver's communicator, no
    staging memory, nothing said of them at start-up), whatever the run's config asked; its batch fits the world."""
    from megalysses.plan import Machine, resolve
    from megalysses.tools.eval_long import _fit_layout
    from megalysses.training.runtime import memory_options

    cfg = load_config(None, ["checkpoint.async_save=true", "training.global_batch_size=8", "model.num_layers=2",
                             "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=4", "data.mock=true"])
    assert resolve(cfg, Machine.current(torch.device("cpu")), 2).async_save
    cfg, _ = _fit_layout(cfg, 2, [])
    plan = resolve(cfg, Machine.current(torch.device("cpu")), 2)
    assert not plan.async_save and cfg.training.global_batch_size == 2 * cfg.training.micro_batch_size
    assert not any("checkpoints" in o for o in memory_options(cfg, plan))
