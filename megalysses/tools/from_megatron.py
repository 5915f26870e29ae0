"""Convert a Megatron-LM pretrain_gpt.py command line into a megalysses config.

    python tools/from_megatron.py --script train_llama3_8b.sh --output configs/llama3_8b.yaml
    python tools/from_megatron.py --script train_gpt3.sh ckpt/ tb/ vocab.json merges.txt data/gpt_text_document \
        --output gpt3.yaml --allow-lossy            # words after the script are its $1, $2, ...
    python tools/from_megatron.py --output run.yaml -- --num-layers 32 --hidden-size 4096 ...   # the arguments

The script is read, not run (megalysses/tools/megatron_script.py says what it follows). The config keeps
Megatron-LM's meaning: its defaults for the flags left out (LayerNorm, GELU, biases, tied embeddings, fp32, no
position resets, ...), its arithmetic (samples to steps, warmup fractions, layers per virtual stage,
--cp-comm-type to the ring degree, the padded vocabulary), the tokenizer's size read from its files, an
unweighted --data-path blended by size (shares read from the .idx files). The file holds the keys whose value
differs from megalysses' default, and it loads (it is checked with the config loader before it is written).

Each flag that cannot be honoured (and each Megatron-LM default that cannot: learned absolute positions,
dropout 0.1) is named; the config is then written only with --allow-lossy, and the exit status is 1 without
it. Flags that change only speed, profiling or logging are named and left out; a Megatron-LM flag the table has
no entry for is named by its group (checkpoint format and persistence: not honoured; logging destinations:
left out; others: not honoured). A command line that cannot be read (flags Megatron-LM does not have, all
named at once, a mixture-of-experts model, a value of the wrong type, a script that never runs pretrain_gpt.py)
is one error line and exit status 2. --verbose lists what every flag became.

The config must start: it is checked at the launch's world size (--gpus, default the script's torchrun
--nproc-per-node x --nnodes, else tp x cp x pp) on H100 nodes of --gpus-per-node with the rules
`pretrain.py --dry-run --gpus N` applies (config.checks.validate_config, megalysses.plan.resolve). An attention
backend the layout cannot run (SDPA's or the reference's blocks for a ring) becomes auto, and the converter
says which backend and which Ulysses x ring split of parallel.sp the run takes there.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

from megalysses.config import Config, ConfigError
from megalysses.config.checks import validate_config
from megalysses.config.io import config_from_dict, config_to_dict, read_yaml
from megalysses.plan import Machine, RunPlan, resolve
from megalysses.plan.flops import peak_tflops
from megalysses.plan.search import longest_activity
from megalysses.tools.megatron_convert import Conversion, convert
from megalysses.tools.megatron_script import MegatronArgsError, launch_world, parse_arguments, script_launch


class _Dumper(yaml.SafeDumper):
    """Sections as blocks, lists on one line ([0.5, a, 0.5, b])."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def nested(values: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in values.items():
        node = out
        *sections, name = key.split(".")
        for s in sections:
            node = node.setdefault(s, {})
        node[name] = value
    return out


def differing(full: dict, default: dict) -> dict:
    """The keys of `full` (nested, in schema order) whose value differs from `default`'s."""
    out = {}
    for key, value in full.items():
        if isinstance(value, dict):
            sub = differing(value, default[key])
            if sub:
                out[key] = sub
        elif value != default[key]:
            out[key] = value
    return out


def config_text(conv: Conversion, cfg: Config, source: str) -> str:
    lines = [f"# Converted from a Megatron-LM command line ({source}) by tools/from_megatron.py.",
             "# Keys left out have megalysses' default; docs/CONFIG.md explains every key."]
    for flag, why in conv.lossy.items():
        lines += textwrap.wrap(f"not honoured: {flag}: {why}", 110, initial_indent="# ", subsequent_indent="#   ")
    body = yaml.dump(differing(config_to_dict(cfg), config_to_dict(Config())), Dumper=_Dumper, sort_keys=False,
                     width=110)
    return "\n".join(lines) + "\n" + body


def report(conv: Conversion, verbose: bool) -> str:
    total = len(conv.mapped) + len(conv.ignored) + len([f for f in conv.lossy if not f.endswith("default)")])
    lines = [(f"{total} flags: {len(conv.mapped)} mapped, {len(conv.lossy)} not honoured, {len(conv.ignored)} left "
             f"out (speed, profiling or logging only)")]
    sections = [("not honoured", conv.lossy), ("left out", conv.ignored)]
    if verbose:
        sections.insert(0, ("mapped", conv.mapped))
    for title, items in sections:
        if items:
            lines.append(f"{title}:")
            lines += [f"  {flag}: {what}" for flag, what in items.items()]
    if conv.notes:
        lines.append("notes:")
        lines += [f"  {n}" for n in conv.notes]
    return "\n".join(lines)


def check_start(cfg: Config, conv: Conversion, gpus: int, per_node: int) -> tuple[Config, RunPlan]:
    """(cfg, its plan) on `gpus` H100s, `per_node` to a node, by the rules a run (and `pretrain.py --dry-run --gpus`)
    applies; an attention backend the layout cannot run becomes auto. Notes what the run takes in `conv`; raises
    ConfigError when the config cannot start there."""
    machine = Machine.described("H100", ranks_per_node=min(gpus, per_node))
    validate_config(cfg, world_size=gpus)
    try:
        run = resolve(cfg, machine, gpus)
    except ConfigError as e:
        if cfg.model.attention_backend == "auto" or "attention backend" not in str(e):
            raise
        conv.notes.append(f"model.attention_backend=auto instead of {cfg.model.attention_backend}: {e}")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_backend="auto"))
        run = resolve(cfg, machine, gpus)
    cfg = _watchdog_timeout(cfg, run, conv)
    p = cfg.parallel
    split = " (parallel.sp_ring, as the script fixes it)" if p.sp_ring else " (megalysses' choice)" if p.sp > 1 else ""
    conv.notes.append(f"on {gpus} GPUs ({min(gpus, per_node)} a node): attention {run.attention} "
                      f"({run.attention_reason}); parallel.sp={p.sp} runs as ulysses {run.degrees.ulysses} x ring "
                      f"{run.degrees.ring}{split}")
    return cfg, run


def _watchdog_timeout(cfg: Config, plan: RunPlan, conv: Conversion) -> Config:
    """cfg with parallel.timeout_seconds raised where the run's longest step or validation, as the planner predicts
    it on the plan's GPUs, needs more (a note says so): Megatron-LM's --distributed-timeout-minutes bounds one
    collective, megalysses' watchdog a whole activity of the loop (config.checks and the start-up check apply it)."""
    longest = longest_activity(cfg, plan, peak_tflops(cfg.logging.peak_tflops, plan.machine.gpu, plan.dtype))
    timeout = cfg.parallel.timeout_seconds
    if longest is None or longest.timeout_needed <= timeout:
        return cfg
    conv.notes.append(f"parallel.timeout_seconds={longest.timeout_suggested:.0f} instead of {timeout:g} "
                      f"(--distributed-timeout-minutes): Megatron-LM's bounds one collective, megalysses' watchdog a "
                      f"whole step or validation, and {longest.what} is predicted at ~{longest.seconds:.0f} s here")
    parallel = dataclasses.replace(cfg.parallel, timeout_seconds=longest.timeout_suggested)
    return dataclasses.replace(cfg, parallel=parallel)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, megatron = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", nargs="+", metavar=("FILE", "ARG"), help="a shell script that runs pretrain_gpt.py, "
                   "and the arguments it takes ($1, $2, ...)")
    p.add_argument("--output", required=True, type=Path, help="the megalysses config to write (YAML)")
    p.add_argument("--allow-lossy", action="store_true", help="write the config even when flags cannot be honoured")
    p.add_argument("--run-dir", help="logging.run_dir of the config (default: runs/<output name>)")
    p.add_argument("--vocab-size", type=int, help="the tokenizer's vocabulary size, when its files are not on this "
                   "machine (they are read otherwise)")
    p.add_argument("--verbose", action="store_true", help="also list what every flag became")
    p.add_argument("--gpus", type=int, help="the world size the config is checked at (default: the script's torchrun "
                   "--nproc-per-node x --nnodes, else tensor x context x pipeline parallel sizes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the script's --nproc-per-node, else 8)")
    args = p.parse_args(ours)
    try:
        if (args.script is None) == (megatron is None):
            raise MegatronArgsError("give either --script FILE or the pretrain_gpt.py arguments after --")
        source, launcher = "the arguments after --", []
        if args.script:
            path = Path(args.script[0])
            try:
                text = path.read_bytes().decode("utf-8")
            except OSError as e:
                raise MegatronArgsError(f"cannot read the script {path}: {e.strerror}") from None
            except UnicodeDecodeError:
                raise MegatronArgsError(f"the script {path} is not UTF-8 text") from None
            (launcher, megatron), source = script_launch(text, args.script[1:]), path.name
        conv = convert(parse_arguments(megatron), vocab_size=args.vocab_size)
        gpus, per_node = _world(args, launcher, conv)
    except MegatronArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    values = {**conv.values, "logging.run_dir": args.run_dir or f"runs/{args.output.stem}"}
    try:
        cfg = config_from_dict(nested(values))
        validate_config(cfg)
    except ConfigError as e:
        print(report(conv, args.verbose))
        print(f"error: the converted config does not load: {e}", file=sys.stderr)
        return 1
    try:
        cfg, _ = check_start(cfg, conv, gpus, per_node)
    except ConfigError as e:
        print(report(conv, args.verbose))
        print(f"error: the converted config cannot start on {gpus} GPUs: {e}", file=sys.stderr)
        return 1
    print(report(conv, args.verbose))
    if conv.lossy and not args.allow_lossy:
        print(f"error: {len(conv.lossy)} settings cannot be honoured (above): {args.output} not written; pass "
              f"--allow-lossy to write it anyway", file=sys.stderr)
        return 1
    text = config_text(conv, cfg, source)
    tmp = args.output.with_name(args.output.name + ".tmp")
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        if config_from_dict(read_yaml(tmp)) != cfg:       # what is written loads back as the conversion
            raise ConfigError(f"{tmp} does not load back as the converted config")
        tmp.replace(args.output)
    except (OSError, ConfigError) as e:
        tmp.unlink(missing_ok=True)
        print(f"error: cannot write {args.output}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}; see it explained: python pretrain.py --config {args.output} --print-config")
    return 0


def _world(args: argparse.Namespace, launcher: list[str], conv: Conversion) -> tuple[int, int]:
    """(world size, GPUs per node) to check the config at: --gpus / --gpus-per-node, else the launch line's."""
    nproc, nnodes = launch_world(launcher)
    v = conv.values
    gpus = args.gpus or (nproc * nnodes if nproc and nnodes else nproc) or \
        v["parallel.tp"] * v["parallel.sp"] * v["parallel.pp"]
    per_node = args.gpus_per_node or nproc or 8
    if gpus < 1 or per_node < 1:
        raise MegatronArgsError(f"--gpus {gpus} and --gpus-per-node {per_node} must be at least 1")
    return gpus, per_node


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
