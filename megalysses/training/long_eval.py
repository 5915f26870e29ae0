"""Long-context evaluation on the training grid: passkey retrieval, needle in a haystack and loss by position
(megalysses/evaluation/tasks.py), forward only, through the run's own layout (tp, Ulysses and ring sp, pp and
virtual stages, FSDP, head chunks, offload), so a length evaluates wherever a training step of it runs.

    evaluator = LongEval(cfg, grid, device, plan, tokenizer, haystack)   # PromptError: no prompts to write
    evaluator.check(settings)                                            # LongEvalError: bad settings, one line
    report = evaluator.run(model, settings, trained_length, doing)       # report.results: the figures

Every rank builds the samples it needs from (seed, task, length, depth, index) alone: the dp ranks take turns
with micro-batches of max(1, the plan's micro_batch_size * data.seq_len // length) samples (the tokens of a training
micro-batch, the curriculum's rule), each sp rank keeps its positions of them as the data loader would (the
plan's sequence layout), in the plan's compute dtype, and
the last pipeline stage scores its tokens (kernels/linear_cross_entropy.token_scores: the answer positions'
logits alone for the needle tasks). The per-sample sums (answer tokens, greedy hits; per position bucket,
tokens and loss) are added over the world in float64, so every layout reports the same figures. An answer
is correct when every one of its tokens is the argmax given the correct prefix.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from megalysses import comm
from megalysses.config import Config
from megalysses.data.loader import HOST_KEYS, BatchFormat, build_micro_batch
from megalysses.evaluation.haystack import DocumentStream, HaystackError
from megalysses.evaluation.tasks import (ACCURACY_TASKS, TASKS, Prompts, Sample, bucket_bounds, bucket_of, compose,
                                         minimum_length, position_sample, repeated_filler, task_prompt)
from megalysses.grid import ParallelGrid
from megalysses.parallel.interleaved import VirtualStages, run_interleaved
from megalysses.parallel.pipeline import Batch, forward_only
from megalysses.plan import RunPlan
from megalysses.parallel.fsdp import reshard
from megalysses.training.step import pipe_of

HAYSTACK_TASKS = ("niah", "niah-multikey", "position-loss")


def text_only(tokenizer: Any) -> set[int]:
    """The tokens the needle tasks leave out of the haystack: document boundaries (EOD, BOS)."""
    return {t for t in (tokenizer.eod_id, tokenizer.bos_id) if t is not None}


class LongEvalError(ValueError):
    """Settings the evaluation cannot run with: the message names the setting and the fix."""


@dataclass(frozen=True)
class LongEvalSettings:
    """What to evaluate: tasks (of evaluation.tasks.TASKS), lengths, needle depths in [0, 1], samples per
    (task, length, depth) and the seed of the prompts."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4
    seed: int = 0


@dataclass
class EvalProgress:
    """How far an evaluation has got: its cells (a task at a length and depth; loss by position: one per length)
    whose samples have all run, of all of them, the last one done (in words), and the sample tokens run so far, of
    all of them (what an estimate of the time left reads)."""

    cells: int
    tokens: int
    cells_done: int = 0
    tokens_done: int = 0
    last: str = ""


def sample_items(s: LongEvalSettings) -> list[tuple[str, int, int]]:
    """(task, depth index, sample index) of every sample of one length, a cell's samples one after the other."""
    items = [(t, d, k) for t in s.tasks if t in ACCURACY_TASKS for d in range(len(s.depths)) for k in range(s.samples)]
    return items + [("position-loss", 0, k) for k in range(s.samples) if "position-loss" in s.tasks]


def cell_count(s: LongEvalSettings) -> int:
    """The cells of one length: a task at a depth (loss by position: one)."""
    return len({(task, d) for task, d, _ in sample_items(s)})


@dataclass
class LongEvalReport:
    """The figures (one entry per task, length and depth, or position bucket), and beside them the trained
    length and the seconds each length took."""

    results: list[dict]
    trained_length: Optional[int]
    seconds: dict[int, float] = field(default_factory=dict)


def check_settings(s: LongEvalSettings, prompts: Prompts, haystack: Optional[DocumentStream],
                   drop: set[int]) -> None:
    """LongEvalError (HaystackError) for settings that cannot run: an unknown task, a depth outside [0, 1], a
    length shorter than a task's prompt, no haystack, too short a one or one of another tokenizer for the tasks
    that read real text (DatasetError). Without lengths, the rest alone."""
    unknown = [t for t in s.tasks if t not in TASKS]
    if unknown or not s.tasks:
        what = f"unknown task {unknown[0]!r}" if unknown else "no task given"
        raise LongEvalError(f"{what}: choose among {', '.join(TASKS)}")
    bad = [d for d in s.depths if not 0.0 <= d <= 1.0] if s.depths else [None]
    if bad:
        raise LongEvalError(f"depth {bad[0]} is outside [0, 1]: give needle depths as fractions of the text, 0 "
                            f"(its start) to 1 (right before the question)")
    if s.samples < 1 or (s.lengths and min(s.lengths) < 1):
        raise LongEvalError(f"lengths {list(s.lengths)} and samples {s.samples}: give lengths and samples >= 1")
    needs_text = [t for t in s.tasks if t in HAYSTACK_TASKS]
    if needs_text and haystack is None:
        raise LongEvalError(f"the task {needs_text[0]} reads real text, and this run has no dataset to take it "
                            f"from (data.mock): name one (--haystack, or long_eval.haystack)")
    if needs_text:
        haystack.check_ids(prompts.tok.vocab_size)
    if not s.lengths:
        return
    for task in s.tasks:
        need = minimum_length(prompts, task)
        if min(s.lengths) < need:
            raise LongEvalError(f"length {min(s.lengths)} cannot hold the {task} prompt, which needs at least "
                                f"{need} tokens with this tokenizer: give longer lengths")
    if needs_text:
        want = max(s.lengths) + 1
        have = haystack.text_tokens(want, drop)
        if have < want:
            raise HaystackError(f"{haystack.name} holds {have} tokens of text, fewer than the {want} a sample of "
                                f"length {max(s.lengths)} needs: give a larger haystack (--haystack, or "
                                f"long_eval.haystack) or shorter lengths")


class LongEval:
    """The long-context evaluation of one run's model on its grid (see the module's docstring)."""

    def __init__(self, cfg: Config, grid: ParallelGrid, device: torch.device, plan: RunPlan, tokenizer: Any,
                 haystack: Optional[DocumentStream]) -> None:
        self.cfg, self.grid, self.device, self.plan = cfg, grid, device, plan
        self.haystack = haystack
        self.prompts = Prompts(tokenizer, cfg.data.bos)
        self.eod = tokenizer.eod_id              # data.eod where the run names one (tokenizer_from_config)
        self.drop = text_only(tokenizer)
        self.separator = self.prompts.plain("\n\n")

    def check(self, s: LongEvalSettings) -> None:
        """check_settings with this evaluation's prompts and haystack."""
        check_settings(s, self.prompts, self.haystack, self.drop)

    def run(self, model: torch.nn.Module, s: LongEvalSettings, trained_length: Optional[int] = None,
            doing: Callable[[str], None] = lambda what: None,
            progress: Callable[[EvalProgress], None] = lambda done: None) -> LongEvalReport:
        """The figures of `s` for `model` (this rank's stage or virtual stages), the same on every rank;
        `progress` is told each time cells are done."""
        training = model.training
        model.eval()
        report = LongEvalReport([], trained_length)
        lengths = sorted(set(s.lengths))
        tally = EvalProgress(cells=cell_count(s) * len(lengths), tokens=len(sample_items(s)) * sum(lengths))
        try:
            for length in lengths:
                t0 = time.perf_counter()
                report.results += self._length(model, s, length, doing, (tally, progress))
                report.seconds[length] = time.perf_counter() - t0
        finally:
            reshard(model)
            model.train(training)
        order = {t: i for i, t in enumerate(TASKS)}
        report.results.sort(key=lambda r: (order[r["task"]], r["length"], r.get("depth", r.get("positions"))))
        return report

    def _items(self, s: LongEvalSettings) -> list[tuple[str, int, int]]:
        """(task, depth index, sample index) of every sample of one length."""
        return sample_items(s)

    def sample(self, s: LongEvalSettings, length: int, item: tuple[str, int, int]) -> Sample:
        """Sample `item` of `length`: the same on every rank."""
        task, d, k = item
        rng = np.random.default_rng([s.seed, TASKS.index(task), length, d, k])
        if task == "position-loss":
            return position_sample(self.haystack.window(length + 1, rng), self.eod)
        filler = (repeated_filler(self.prompts) if task == "passkey" else
                  lambda n, r: self.haystack.window(n, r, self.drop, self.separator))
        return compose(self.prompts, task_prompt(self.prompts, task, s.depths[d], rng), length, filler, rng)

    def _length(self, model: torch.nn.Module, s: LongEvalSettings, length: int, doing: Callable[[str], None],
                told: tuple[EvalProgress, Callable[[EvalProgress], None]]) -> list[dict]:
        g = self.grid
        per_mb = max(1, self.plan.micro_batch_size * self.cfg.data.seq_len // length)
        items = self._items(s)
        chunk = per_mb * g.dp_size
        rounds = -(-len(items) // chunk)
        buckets = int(bucket_of(np.array([length - 1]))[0]) + 1
        stats = torch.zeros(len(items), buckets, 3, dtype=torch.float64, device=self.device)  # tokens, hits, loss
        last = {(task, d): i for i, (task, d, _) in enumerate(items)}        # each cell's last sample
        for c in range(rounds):
            doing(f"evaluating long context at {length} tokens (micro-batch {c + 1} of {rounds})")
            ids = range(c * chunk + g.dp_rank * per_mb, c * chunk + (g.dp_rank + 1) * per_mb)   # this dp rank's
            samples = [self.sample(s, length, items[i]) if i < len(items) else None for i in ids]
            mb, local = self._micro_batch(samples, length)
            out = self._forward(model, mb)
            if out is not None and g.tp_rank == 0:
                losses, hits = (x.to(torch.float64) for x in out)
                for b, i in enumerate(ids):
                    keep = local[b] >= 0
                    if i < len(items) and bool(keep.any()):
                        where = local[b][keep]
                        stats[i].index_add_(0, where, torch.stack([torch.ones_like(losses[b][keep]),
                                                                   hits[b][keep], losses[b][keep]], dim=1))
            ran = range(c * chunk, min((c + 1) * chunk, len(items)))
            _advance(told, [cell for cell, i in last.items() if i in ran], len(ran) * length, s.depths, length)
        comm.all_reduce_(stats, comm.world())
        return _figures(items, stats.cpu(), s, length)

    def _micro_batch(self, samples: list[Optional[Sample]], length: int) -> tuple[Batch, torch.Tensor]:
        """This rank's shard of the samples (None: a placeholder scoring nothing), as the data loader builds a
        micro-batch of the run, with labels only where a sample scores; and each local label's bucket."""
        d, g = self.cfg.data, self.grid
        tokens = [x.tokens if x is not None else np.zeros(length + 1, dtype=np.int64) for x in samples]
        layout = self.plan.sequence
        fmt = BatchFormat(self.eod, d.reset_position_ids, d.document_mask, d.eod_mask_loss)
        mb = build_micro_batch(tokens, length, g.sp_rank, fmt, layout)
        full = np.full((len(samples), layout.padded_len(length)), -1, dtype=np.int64)
        for b, x in enumerate(samples):
            if x is not None:
                full[b, :length] = x.buckets
        local = torch.from_numpy(np.ascontiguousarray(full[:, layout.positions(full.shape[1], g.sp_rank)]))
        local[mb["labels"] == -100] = -1
        mb["labels"][local < 0] = -100
        return {k: v if k in HOST_KEYS else v.to(self.device) for k, v in mb.items()}, local.to(self.device)

    def _forward(self, model: torch.nn.Module, mb: Batch) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """One micro-batch forward only through the pipeline; (losses, hits) of its local tokens on the last
        stage, None elsewhere."""
        out: list = []
        pipe = pipe_of(model, mb, self.grid, self.plan.torch_dtype)
        with torch.no_grad():
            if isinstance(model, VirtualStages):
                run_interleaved(model, [mb], 1.0, pipe, forward_only=True, scores=out)
            else:
                forward_only(model, [mb], 1.0, pipe, scores=out)
        return out[0] if out else None


def _advance(told: tuple[EvalProgress, Callable[[EvalProgress], None]], done: list[tuple[str, int]], tokens: int,
             depths: tuple[float, ...], length: int) -> None:
    """The tally after a micro-batch of `tokens` sample tokens that completed the cells `done` (task, depth
    index), in order; the listener told when any were."""
    tally, progress = told
    tally.tokens_done += tokens
    if done:
        task, d = done[-1]
        tally.cells_done += len(done)
        tally.last = f"{task} at {length} tokens" + (f", depth {depths[d]:g}" if task in ACCURACY_TASKS else "")
        progress(tally)


def _figures(items: list[tuple[str, int, int]], stats: torch.Tensor, s: LongEvalSettings, length: int) -> list[dict]:
    """Per (task, depth): the share of samples whose every answer token was the argmax; per position bucket of
    loss by position: the mean loss and the tokens counted."""
    out, correct = [], {}
    for (task, d, _), st in zip(items, stats):
        if task in ACCURACY_TASKS:
            correct.setdefault((task, d), []).append(bool(st[0, 0] > 0 and st[0, 1] == st[0, 0]))
    for (task, d), hits in correct.items():
        out.append({"task": task, "length": length, "depth": s.depths[d], "accuracy": sum(hits) / len(hits),
                    "samples": len(hits)})
    position = stats[[i for i, (task, _, _) in enumerate(items) if task == "position-loss"]].sum(dim=0)
    for b, (tokens, _, loss) in enumerate(position.tolist()):
        if tokens:
            out.append({"task": "position-loss", "length": length, "positions": list(bucket_bounds(b, length)),
                        "loss": loss / tokens, "tokens": int(tokens)})
    return out


def scalars(report: LongEvalReport) -> dict[str, float]:
    """The report as logged scalars: long_eval/<task>/<length> (accuracy over the depths) and
    long_eval/position-loss/<length>/<lo>-<hi> (loss of a position bucket)."""
    out: dict[str, list[float]] = {}
    for r in report.results:
        if "accuracy" in r:
            out.setdefault(f"long_eval/{r['task']}/{r['length']}", []).extend([r["accuracy"]] * r["samples"])
        else:
            lo, hi = r["positions"]
            out[f"long_eval/position-loss/{r['length']}/{lo}-{hi}"] = [r["loss"]]
    return {k: math.fsum(v) / len(v) for k, v in out.items()}


class TrainingLongEval:
    """long_eval while training: every long_eval.interval steps, its tasks at long_eval.lengths (default: the
    length the step trained at, which follows a data.seq_len_schedule). Settings that cannot run are a
    ConfigError before step 1."""

    def __init__(self, cfg: Config, grid: ParallelGrid, device: torch.device, plan: RunPlan) -> None:
        from megalysses.config import ConfigError
        from megalysses.data.tokenizer import tokenizer_from_config

        e, d = cfg.long_eval, cfg.data
        self.cfg, self.plan = cfg, plan
        try:
            tok = tokenizer_from_config(d, cfg.model.vocab_size)
            if tok.vocab_size > cfg.model.vocab_size:
                raise LongEvalError(f"data.tokenizer={d.tokenizer} has {tok.vocab_size} ids, more than "
                                    f"model.vocab_size={cfg.model.vocab_size}: its prompts would not fit the model")
            text = any(t in HAYSTACK_TASKS for t in e.tasks)
            haystack = (DocumentStream.whole(e.haystack) if e.haystack else
                        DocumentStream.validation(d) if text and not d.mock else None)
            self.evaluator = LongEval(cfg, grid, device, plan, tok, haystack if text else None)
            lengths = e.lengths or sorted({p.seq_len for p in plan.train_phases})
            self.evaluator.check(self.settings(lengths))
        except ValueError as err:          # PromptError, LongEvalError, HaystackError, TokenizerError
            raise ConfigError(f"long_eval: {' '.join(str(err).split())}") from None

    def settings(self, lengths: list[int]) -> LongEvalSettings:
        e = self.cfg.long_eval
        return LongEvalSettings(tuple(e.tasks), tuple(lengths), tuple(e.depths), e.samples, e.seed)

    def due(self, step: int) -> bool:
        return step % self.cfg.long_eval.interval == 0

    def __call__(self, model: torch.nn.Module, step: int, doing: Callable[[str], None]) -> LongEvalReport:
        """The evaluation after `step` steps: at long_eval.lengths, or the length that step trained at."""
        trained = self.plan.train_phase(step - 1).seq_len
        return self.evaluator.run(model, self.settings(self.cfg.long_eval.lengths or [trained]), trained, doing)
