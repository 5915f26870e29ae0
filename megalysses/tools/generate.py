"""Sample text from a trained checkpoint (any layout it was saved at) in one process.

    python tools/generate.py --run runs/quickstart --prompt "def main(" --max-new-tokens 120

Reads <run>/config.yaml and the newest checkpoint under <run>/checkpoints (or --checkpoint), loads
the model weights into a single process (DCP reshards them), and samples with temperature / top-k.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


from megalysses.config import load_config
from megalysses.data import build_tokenizer
from megalysses.distributed import destroy_distributed, init_distributed
from megalysses.grid import ParallelGrid
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.training.checkpoint import (
    CheckpointError, check_model_shape, load_model_weights, resolve_checkpoint)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (holds config.yaml and checkpoints/)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint dir or a dir with `latest` (default: <run>/checkpoints)")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if not (Path(args.run) / "config.yaml").is_file():
        print(f"error: {args.run} is not a run directory (no config.yaml): pass the logging.run_dir of a run",
              file=sys.stderr)
        return 1
    if not args.prompt:
        print("error: --prompt is empty: give at least one character to continue from", file=sys.stderr)
        return 1
    # one CPU process: the layout, attention backend and kernels of the run do not apply here
    # (a single process needs no padding: at sp=1 the model takes any prompt length)
    cfg = load_config(Path(args.run) / "config.yaml", ["parallel.tp=1", "parallel.sp=1", "parallel.sp_ring=0",
                                                       "parallel.pp=1", "parallel.tp_sequence_parallel=false",
                                                       "parallel.fsdp=false", "model.attention_backend=sdpa",
                                                       "model.kernels=torch"])
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
        load_model_weights(path, model, grid, grid.device_mesh(device))
        model.eval()
        tok = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_model)
        gen = torch.Generator().manual_seed(args.seed)
        ids = sample(model, tok.encode(args.prompt), args.max_new_tokens, args.temperature, args.top_k,
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
