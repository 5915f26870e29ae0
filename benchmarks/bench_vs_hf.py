"""Single-process training-step throughput: megalysses against transformers' LlamaForCausalLM.

    pip install -e ".[test]"       # transformers is a test / benchmark extra
    python benchmarks/bench_vs_hf.py [--hidden 256 --layers 4 --heads 8 --kv-heads 4 --seq-len 512 --batch 4]
                                     [--steps 10 --rounds 3] [--out-dir DIR | --record] [--name vs_hf]

Both sides train the same model: a random LlamaForCausalLM is built from the config, and its
weights are converted into a megalysses GPT (megalysses.model.hf), so the first-step losses agree
(printed as a check). One training step is, on both sides: forward with the token-mean
cross-entropy over the same shifted labels, backward, global-norm gradient clipping at 1.0, AdamW
(lr 3e-4, weight decay 0.1 on matrices, none on vectors). megalysses runs its own train_step
(the pp=1 schedule and the ZeRO-1 AdamW with fp32 master weights, here over a group of one);
transformers runs model(input_ids, labels=...) + clip_grad_norm_ + torch.optim.AdamW.

Attention is SDPA on both sides. On CUDA megalysses computes with bf16 weights (fp32 masters in its
optimizer) and transformers under bf16 autocast over fp32 weights; on CPU both in float32.
The two are timed in alternating rounds (after warm-up steps) so that machine noise hits both
alike; tokens/s is the median over rounds. Prints a table with the ratio; with --out-dir (or --record:
benchmarks/results/) writes it as <name>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_text  # noqa: E402
from megalysses.config import ModelConfig  # noqa: E402
from megalysses.grid import ParallelGrid  # noqa: E402
from megalysses.model.gpt import GPTStage  # noqa: E402
from megalysses.model.hf import from_hf_state_dict, model_config_from_hf  # noqa: E402
from megalysses.parallel.optimizer import AdamWSettings  # noqa: E402
from megalysses.parallel.zero import ShardedAdamW  # noqa: E402
from megalysses.training.step import train_step  # noqa: E402

LR, WD, BETAS, EPS, CLIP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Ours:
    name = "megalysses"

    def __init__(self, cfg: ModelConfig, hf_state: dict, device: torch.device, dtype: torch.dtype) -> None:
        self.model = GPTStage(cfg).to(device)
        self.model.load_state_dict(from_hf_state_dict(hf_state, cfg))
        self.opt = ShardedAdamW(self.model.named_parameters(), None,
                                AdamWSettings(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD))
        self.model.to(dtype)       # compute weights; the optimizer keeps the fp32 masters
        self.grid = ParallelGrid.single()
        self.dtype = dtype

    def step(self, tokens: torch.Tensor) -> float:
        B, S = tokens.shape[0], tokens.shape[1] - 1
        batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                 "position_ids": torch.arange(S, device=tokens.device).expand(B, S)}
        return train_step(self.model, self.opt, [batch], self.grid, lr=LR, grad_clip=CLIP, dtype=self.dtype).loss


class HF:
    name = "transformers"

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model.to(device).train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=True)
        self.device, self.dtype = device, dtype

    def step(self, tokens: torch.Tensor) -> float:
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = self.model(input_ids=inputs, labels=labels, shift_labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def timed(runner, batches: list[torch.Tensor], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for tokens in batches:
        runner.step(tokens)
    sync(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    add_output_args(p, name="vs_hf")
    args = p.parse_args(argv)
    folder = output_dir(p, args)
    try:
        import transformers
    except ImportError:
        raise SystemExit("transformers is not installed: pip install -e '.[test]' "
                         "(it is the benchmark's peer)") from None

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    hf_model = transformers.LlamaForCausalLM(hf_cfg)
    cfg = model_config_from_hf(hf_cfg, attention_backend="sdpa")
    runners = [Ours(cfg, hf_model.state_dict(), device, dtype), HF(hf_model, device, dtype)]

    gen = torch.Generator().manual_seed(1)
    n = args.warmup + args.rounds * args.steps
    data = [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen).to(device) for _ in range(n)]
    first_loss = {r.name: r.step(data[0]) for r in runners}                  # same weights, same batch
    for tokens in data[1:args.warmup]:
        for r in runners:
            r.step(tokens)
    seconds: dict[str, list[float]] = {r.name: [] for r in runners}
    for k in range(args.rounds):
        chunk = data[args.warmup + k * args.steps: args.warmup + (k + 1) * args.steps]
        for r in (runners if k % 2 == 0 else runners[::-1]):
            seconds[r.name].append(timed(r, chunk, device))

    tokens_per_step = args.batch * args.seq_len
    rows = []
    for r in runners:
        med = statistics.median(seconds[r.name]) / args.steps
        rows.append({"framework": r.name, "ms_per_step": 1e3 * med, "tokens_per_s": tokens_per_step / med,
                     "first_step_loss": first_loss[r.name]})
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    print(f"\nTraining step, {device.type} {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads: "
          f"vocab {args.vocab}, h {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), "
          f"ffn {args.ffn}, batch {args.batch} x seq {args.seq_len}; "
          f"median of {args.rounds} rounds x {args.steps} steps\n")
    print("| framework | ms / step | tokens / s | first-step loss |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['framework']} | {row['ms_per_step']:.1f} | {row['tokens_per_s']:.0f} "
              f"| {row['first_step_loss']:.6f} |")
    print(f"\nmegalysses / transformers tokens/s: {ratio:.2f}x")
    recorded = {k: v for k, v in vars(args).items() if k not in ("out_dir", "record", "name")}
    result = {"args": recorded, "device": device.type, "dtype": str(dtype), "threads": torch.get_num_threads(),
              "rows": rows, "ratio": ratio, "machine": platform.platform(), "torch": torch.__version__,
              "transformers": transformers.__version__}
    if folder is not None:
        out = write_text(folder, f"{args.name or 'vs_hf'}.json", json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
