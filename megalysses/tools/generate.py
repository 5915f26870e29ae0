"""Sample text from a trained checkpoint (any layout it was saved at) in one process.

    python tools/generate.py --run runs/quickstart --prompt "def main(" --max-new-tokens 120

Reads <run>/config.yaml and the newest checkpoint under <run>/checkpoints (or --checkpoint), loads
the model weights into a single process (DCP reshards them), and samples with temperature / top-k.
The prompt is encoded with the run's tokenizer (data.tokenizer: byte, sentencepiece, a Hugging Face
tokenizer.json, ...) as its training documents were, and sampling stops at the run's EOD.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from megalysses.config import Config, ConfigError, load_config
from megalysses.data.tokenizer import TokenizerError, tokenizer_from_config
from megalysses.distributed import destroy_distributed, init_distributed
from megalysses.grid import ParallelGrid
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.training.checkpoint import (
    CheckpointError, build_mesh, check_model_shape, load_model_weights, resolve_checkpoint)
from megalysses.training.loop import model_shape


@torch.no_grad()
def sample(model: GPTStage, ids: list[int], max_new: int, temperature: float, top_k: int, eod: int,
           max_len: int, generator: torch.Generator, vocab: int) -> list[int]:
    out = list(ids)
    for _ in range(max_new):
        window = torch.tensor([out[-max_len:]], dtype=torch.long)
        pos = torch.arange(window.shape[1]).unsqueeze(0)
        logits = model(window, pos)[0, -1, :vocab].float()       # (V,): rows past the tokenizer are padding
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if nxt == eod:
            break
        out.append(nxt)
    return out


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens}: give at least 1 token to generate")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature {args.temperature}: give a finite number >= 0 (0 = greedy)")
    if args.top_k < 0:
        p.error(f"--top-k {args.top_k}: give a number >= 0 (0 = no top-k cut)")
    if not args.prompt:
        p.error("--prompt is empty: give at least one character to continue from")


def load_run(run: Path) -> tuple[Config, Any]:
    """The run's config (forced to one CPU process) and its tokenizer; raises ValueError naming the problem."""
    if not (run / "config.yaml").is_file():
        raise ValueError(f"{run} is not a run directory (no config.yaml): pass the logging.run_dir of a run")
    # one CPU process: the layout, attention backend and kernels of the run do not apply here
    try:
        cfg = load_config(run / "config.yaml", ["parallel.tp=1", "parallel.sp=1", "parallel.pp=1",
                                                "parallel.tp_sequence_parallel=false", "parallel.fsdp=false",
                                                "model.attention_backend=sdpa", "model.kernels=torch"])
    except (ConfigError, OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{run / 'config.yaml'} cannot be read as a run config: {e}") from None
    try:
        tok = tokenizer_from_config(cfg.data, cfg.model.vocab_size)
    except TokenizerError as e:
        raise ValueError(f"the run's tokenizer (data.tokenizer={cfg.data.tokenizer}): {e}") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the run's tokenizer has {tok.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}: "
                         f"this is not the tokenizer the run trained with; fix data.tokenizer in {run / 'config.yaml'}")
    return cfg, tok


def prompt_ids(tok: Any, prompt: str, bos: Optional[str]) -> list[int]:
    """The prompt as the training documents began: with the run's data.bos in front when it has one."""
    ids = tok.encode(prompt)
    if bos is not None and tok.bos_id is not None and ids[:1] != [tok.bos_id]:
        ids = [tok.bos_id] + ids
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (holds config.yaml and checkpoints/)")
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint dir or a dir with `latest` (default: <run>/checkpoints)")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    _check_args(p, args)
    try:
        cfg, tok = load_run(Path(args.run))
        ids = prompt_ids(tok, args.prompt, cfg.data.bos)
        if not ids:
            raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens: give some text")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    source = args.checkpoint or cfg.checkpoint.dir or Path(args.run) / "checkpoints"
    try:
        path = resolve_checkpoint(source)
        if path is None:
            raise CheckpointError(f"no checkpoint under {source}")
        check_model_shape(path, model_shape(cfg))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    device = init_distributed("gloo", 60.0)
    try:
        grid = ParallelGrid()
        model = GPTStage(cfg.model)
        init_weights(model, cfg.training.seed)
        load_model_weights(path, model, grid, build_mesh(grid, device))
        model.eval()
        gen = torch.Generator().manual_seed(args.seed)
        ids = sample(model, ids, args.max_new_tokens, args.temperature, args.top_k,
                     tok.eod_id, cfg.data.seq_len, gen, tok.vocab_size)
        print(f"--- sampled from {path} ---")
        print(tok.decode(ids))
    finally:
        destroy_distributed()
    return 0


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
