"""Sample text from a trained checkpoint (any layout it was saved at) or a Hugging Face model (Llama, Qwen2/2.5,
Qwen3, Mistral), in one process.

    python tools/generate.py --run runs/quickstart --prompt "def main(" --max-new-tokens 120
    python tools/generate.py --hf models/Llama-3.2-1B --prompt "Paris is" --prompt "Once upon" --top-p 0.9

--run reads <run>/config.yaml and the newest checkpoint under <run>/checkpoints (or --checkpoint) and
loads the weights the run computed with into one process (DCP reshards them); the prompts are encoded with the
run's tokenizer (data.tokenizer: byte, sentencepiece, a Hugging Face tokenizer.json, ...) as its
training documents were, except that a special token a prompt spells is that token (as transformers
encodes prompts: chat markup typed into a prompt is the markup). --hf reads config.json, the safetensors
and tokenizer.json of a Hugging Face model directory. All prompts are sampled together, left-padded, with
a KV cache (the prompt once, then one token per step); each stops at the end-of-document token or after
--max-new-tokens. Sampling: temperature (0 = greedy), then top-k and top-p (nucleus) cuts. The model is built
by the run builder (megalysses/training/build.py) on the device it runs on (this machine's GPU if it has one),
under a forward-only plan: nothing kept for a backward, no tiles, every weight on the device.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from torch import Tensor

from megalysses.config import Config, ConfigError
from megalysses.config.io import load_config, with_overrides
from megalysses.data.tokenizer import TokenizerError, build_tokenizer, tokenizer_from_config
from megalysses.distributed import destroy_distributed, init_distributed
from megalysses.grid import ParallelGrid
from megalysses.model.gpt import GPTStage, architecture
from megalysses.model.hf import model_config_from_hf, our_tensor
from megalysses.model.hf_io import HFFormatError, open_hf_dir
from megalysses.model.kv_cache import KVCache
from megalysses.plan import Machine, RunPlan, resolve
from megalysses.plan.machine import local_device
from megalysses.training.build import Parts, Run, WeightsLoader, build_run
from megalysses.checkpoint.dcp_io import (
    CheckpointError, check_model_shape, load_model_weights, resolve_checkpoint)


def _filter(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """logits (B, V) with everything outside the top-k and outside the smallest set of top-p mass at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = (probs.cumsum(-1) - probs) >= top_p            # the mass before it already reaches top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: temperature (0 = greedy), then the top-k (0: no cut) and top-p (nucleus,
    1: no cut) cuts, drawn with `generator`."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator


@torch.no_grad()
def generate(model: GPTStage, prompts: list[list[int]], max_new: int, sampling: Sampling, *, eod: Optional[int],
             vocab: int, device: torch.device, dtype: torch.dtype) -> list[list[int]]:
    """Each prompt followed by its sampled continuation (up to, not including, eod)."""
    temperature = sampling.temperature
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P, dtype=torch.bool)
    for b, p in enumerate(prompts):                              # left padding: every prompt ends at P - 1
        ids[b, P - len(p):], valid[b, P - len(p):] = torch.tensor(p), True
    ids, valid = ids.to(device), valid.to(device)
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)               # each prompt's own positions from 0
    cache = KVCache(model.cfg, B, P + max_new, device, dtype, key_valid=valid)
    logits = model(ids, pos, cache=cache)[:, -1]
    out = [list(p) for p in prompts]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    nxt_pos = pos[:, -1:] + 1
    for _ in range(max_new):
        scores = logits[:, :vocab].float()                         # columns past the tokenizer are padding
        if temperature <= 0:
            nxt = scores.argmax(-1)
        else:
            probs = _filter(scores / temperature, sampling.top_k, sampling.top_p).softmax(-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=sampling.generator).squeeze(-1).to(device)
        if eod is not None:
            done |= nxt == eod
        for b in (~done).nonzero().flatten().tolist():
            out[b].append(int(nxt[b]))
        if bool(done.all()):
            break
        logits = model(nxt[:, None], nxt_pos, cache=cache)[:, -1]
        nxt_pos = nxt_pos + 1
    return out


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens}: give at least 1 token to generate")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature {args.temperature}: give a finite number >= 0 (0 = greedy)")
    if args.top_k < 0:
        p.error(f"--top-k {args.top_k}: give a number >= 0 (0 = no top-k cut)")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p {args.top_p}: give a number in (0, 1] (1 = no nucleus cut)")
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                args.prompt += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--prompts-file {args.prompts_file}: cannot be read ({e})")
        if not args.prompt:
            p.error(f"--prompts-file {args.prompts_file} holds no prompt (one per line)")
    args.prompt = args.prompt or ["def "]
    if not all(args.prompt):
        p.error("--prompt is empty: give at least one character to continue from")


GENERATION = ["parallel.tp=1", "parallel.sp=1", "parallel.sp_ring=0", "parallel.pp=1", "parallel.virtual_stages=1",
              "parallel.backend=auto", "parallel.tp_sequence_parallel=false", "parallel.fsdp=false",
              "model.attention_backend=auto", "model.kernels=torch", "training.dtype=auto",
              "training.activation_checkpointing=false", "training.recompute_attention=true",
              "training.activation_offload=false", "training.checkpoint_stride=1", "training.mlp_chunk_tokens=0",
              "training.attention_head_chunks=1", "training.optimizer_offload=false", "training.param_offload=false"]
"""What generation changes in a run's config: one process on this machine (its GPU if it has one), whose plan
decides the attention backend (the KV cache attends whatever it is) and the dtype (the machine's: bf16 on a GPU,
fp32 on the CPU); the torch references, which run anywhere, as the kernels; and a forward-only plan: nothing kept
for a backward (no checkpointing, nor its offload), no tiles or head chunks, every weight on the device."""


def generation_config(cfg: Config) -> Config:
    """`cfg` as one process generates with it (GENERATION)."""
    return with_overrides(cfg, GENERATION)


def load_run(run: Path) -> tuple[Config, Any]:
    """The run's config as one process generates with it (GENERATION) and its tokenizer; raises ValueError naming
    the problem."""
    if not (run / "config.yaml").is_file():
        raise ValueError(f"{run} is not a run directory (no config.yaml): pass the logging.run_dir of a run")
    try:
        cfg = load_config(run / "config.yaml", GENERATION)
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
    """The prompt as the training documents began (with the run's data.bos in front when it has one), the special
    tokens it spells parsed."""
    ids = tok.encode(prompt, parse_special=True)
    if bos is not None and tok.bos_id is not None and ids[:1] != [tok.bos_id]:
        ids = [tok.bos_id] + ids
    return ids


def generation_plan(cfg: Config) -> RunPlan:
    """The plan of one process generating with `cfg` on this machine (its GPU if it has one)."""
    try:
        return resolve(cfg, Machine.current(local_device()), 1)
    except ConfigError as e:
        raise ValueError(f"cannot generate here: {e}") from None


@dataclass(frozen=True)
class Source:
    """What is sampled from: the config generation runs (GENERATION applied), what reads its weights into the built
    model, its tokenizer and the bos token prompts begin with, where it is (said above the samples) and the length
    it trained at (None: unknown)."""

    cfg: Config
    weights: WeightsLoader
    tok: Any
    bos: Optional[str]
    where: str
    trained: Optional[int]


def _from_run(args: argparse.Namespace) -> Source:
    """A run directory: its config, its checkpoint's compute weights (the model its training ran)."""
    cfg, tok = load_run(Path(args.run))
    saved = args.checkpoint or cfg.checkpoint.dir or Path(args.run) / "checkpoints"
    path = resolve_checkpoint(saved)
    if path is None:
        raise CheckpointError(f"no checkpoint under {saved}")
    check_model_shape(path, architecture(cfg.model))
    return Source(cfg, lambda model, grid, mesh: load_model_weights(path, model, grid, mesh), tok, cfg.data.bos,
                  str(path), cfg.data.seq_len)


def _from_hf(folder: str) -> Source:
    """A Hugging Face model directory: its architecture, its tensors converted to ours, its max_position_embeddings."""
    try:
        config, tensors = open_hf_dir(folder)
        cfg = generation_config(Config(model=model_config_from_hf(config)))
    except (HFFormatError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--hf {folder}: {e}") from None
    try:
        tok = build_tokenizer("huggingface", folder)
    except TokenizerError as e:
        raise ValueError(f"--hf {folder}: its tokenizer: {e}") from None

    def weights(model: GPTStage, grid: ParallelGrid, mesh: Any) -> None:
        model.load_state_dict({n: our_tensor(n, model.cfg, tensors.get).float() for n, _ in model.named_parameters()})
    return Source(cfg, weights, tok, None, folder, config.get("max_position_embeddings"))


def build(source: Source) -> Run:
    """The run of `source` as one process samples from it: built by the run builder under the generation plan, on
    this process's device (its GPU if it has one), its weights read into it there; the model in eval mode."""
    plan = generation_plan(source.cfg)
    device = init_distributed(plan.collective, 60.0)         # a checkpoint's read reshards over a world of one
    try:
        run = build_run(source.cfg, plan, ParallelGrid.for_plan(plan), device,
                        Parts(optimizer=False, weights=source.weights))
    finally:
        destroy_distributed()
    run.model.eval()
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run directory (holds config.yaml and checkpoints/)")
    source.add_argument("--hf", help="a Hugging Face Llama directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--checkpoint", default=None,
                   help="with --run: a checkpoint dir or a dir with `latest` (default: <run>/checkpoints)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch (default 'def ')")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    _check_args(p, args)
    try:
        source = _from_hf(args.hf) if args.hf else _from_run(args)
        tok, trained = source.tok, source.trained
        prompts = [prompt_ids(tok, text, source.bos) for text in args.prompt]
        empty = [text for text, ids in zip(args.prompt, prompts) if not ids]
        if empty:
            raise ValueError(f"--prompt {empty[0]!r} encodes to no tokens: give some text")
        run = build(source)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    longest = max(len(ids) for ids in prompts) + args.max_new_tokens
    if trained and longest > trained:
        print(f"warning: the longest prompt and --max-new-tokens {args.max_new_tokens} come to {longest} tokens, past "
              f"the {trained} the model was trained at: text beyond that length is unreliable", file=sys.stderr)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, torch.Generator().manual_seed(args.seed))
    outs = generate(run.model, prompts, args.max_new_tokens, sampling, eod=tok.eod_id, vocab=tok.vocab_size,
                    device=run.device, dtype=run.plan.torch_dtype)
    print(f"--- sampled from {source.where} ---")
    print("\n---\n".join(tok.decode(ids) for ids in outs))
    return 0


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
