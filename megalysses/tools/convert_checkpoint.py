"""Convert between Hugging Face models (Llama, Qwen2/2.5, Qwen3, Mistral) and megalysses runs, in both directions.

    # Hugging Face -> a megalysses run directory (config.yaml + a weights-only checkpoint at step 0)
    python tools/convert_checkpoint.py --from-hf models/Llama-3.2-1B --to runs/llama1b [--config configs/X.yaml]
    torchrun --nproc-per-node 8 pretrain.py --config runs/llama1b/config.yaml --set data.paths=[...]

    # a megalysses run (or one checkpoint of it) -> a Hugging Face directory transformers loads
    python tools/convert_checkpoint.py --from runs/llama1b --to-hf out/llama1b-hf [--dtype bfloat16]

--from-hf reads config.json and the safetensors (one file or shards) tensor by tensor and writes our
layout (fused QKV and gate-up projections, the padded vocabulary) as a DCP checkpoint that loads at any
(tp, sp, pp, dp) layout, with or without FSDP; training starts from it with a fresh optimizer at step 0.
The run's config.yaml takes its model section from the Hugging Face config and everything else from
--config (default: the schema's defaults); set data.paths before training. Its checkpoint.init_from names the
converted step-0 weights, so a run of this config in any run directory starts from them (they hold a KEEP file:
checkpoint pruning leaves them). The model section is checked as a run checks its config (config.checks, --set
overrides included; its warnings printed) and every tensor's shape against it before anything is written; a RoPE
scaling that --set turns on takes the model's own context (max_position_embeddings) as its original one.
--set model.rope_theta, model.rope_scaling.* and model.sliding_window change the model section too (no tensor
depends on them: a context extension's RoPE scaling, say). (checkpoint.init_from can also point a run at a
Hugging Face directory directly, without converting.)
When the Hugging Face directory has a tokenizer.json, the run keeps a copy of its tokenizer files (its chat
template among them) in <run_dir>/tokenizer/ and its config.yaml points data.tokenizer at it (the model's ids are that
tokenizer's), unless --set names another. The paths config.yaml names are absolute: the run works from
any directory. The imported model's config.json and generation_config.json are kept in
<run_dir>/hf_source/.
--to-hf takes the fp32 master weights of a training checkpoint (or the weights of a weights-only one),
converts them back, and writes sharded safetensors, the index and config.json in --dtype, with the run's
tokenizer (a Hugging Face tokenizer's own files, its chat template included; a sentencepiece, byte or GPT-2
BPE one rebuilt as a tokenizer.json that gives the ids it trained on), into a new directory that is complete
or absent, its files with the mode the umask gives. config.json's max_position_embeddings is what serving
stacks take for the model's context: the longer of the longest sequence the checkpoint trained at
(data.seq_len at its step, curriculum included) and the imported model's own (an import never trained keeps
its own). eos_token_id and bos_token_id are data.eod / data.bos when set, else the imported model's, else the
run's tokenizer's; the imported model's generation_config.json goes along (else one with those ids is
written). The export is of the imported model's family (model_type) when it holds the run's architecture, else
of the one its settings call for (megalysses/model/hf.py hf_model_type), with its RoPE scaling written back.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import types
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
import yaml

from megalysses.config import Config, ConfigError, ModelConfig
from megalysses.config.checks import config_warnings, validate_config
from megalysses.config.io import apply_override, config_from_dict, config_to_dict, save_config
from megalysses.data.hf_tokenizer import hf_tokenizer_files, source_name
from megalysses.data.tokenizer import TokenizerError, canonical_kind, tokenizer_from_config
from megalysses.model.gpt import GPTStage, architecture
from megalysses.model.hf import (check_hf_names, check_hf_shapes, hf_config_dict, hf_tensors, model_config_from_hf,
                                 our_names, our_tensor)
from megalysses.model.hf_io import DTYPES, HFFormatError, check_new_dir, is_hf_dir, open_hf_dir, write_hf_dir
from megalysses.checkpoint.dcp_io import (LATEST, CheckpointError, SafeFileSystemReader, model_differences,
                                            resolve_checkpoint)
from megalysses.checkpoint.initial import WEIGHTS_ONLY, is_weights_only
from megalysses.checkpoint.manifest import FORMAT, mark_kept, verify_checkpoint, write_manifest


HF_SOURCE = "hf_source"      # <run_dir>/hf_source/: the imported model's config.json (and generation_config.json)
RUN_MODEL_KEYS = ("model.rope_theta", "model.rope_scaling", "model.sliding_window")
"""Model keys --from-hf takes from --set rather than from the Hugging Face config: they change no tensor."""
SOURCE_FILES = ("config.json", "generation_config.json")


class ConvertError(ValueError):
    """Bad input to the converter: the message names it and the fix."""


def _check_target(path: Path, flag: str) -> None:
    """A directory can be made at `path`: not a file, not below one."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == path else f"lies below {p}, which is a file"
                raise ConvertError(f"{flag} {path} {where}: give the path of a directory")
            return


def _base_config(path: Optional[str], overrides: list[str]) -> dict:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConvertError(f"--config {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConvertError(f"--config {p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConvertError(f"--config {p}: the top level must be a mapping of sections")
    for ov in overrides:
        apply_override(data, ov)
    return data


def _own_tokenizer(hf_dir: str, overrides: list[str]) -> bool:
    """The run takes the imported model's tokenizer (a copy in <run_dir>/tokenizer/): it has a tokenizer.json,
    and --set names no other."""
    return (Path(hf_dir) / "tokenizer.json").is_file() and not any(o.startswith("data.tokenizer") for o in overrides)


def _imported_config(hf_dir: str, hf_config: dict, run_dir: str, config: Optional[str],
                     overrides: list[str]) -> Config:
    """The run's config: the model section from config.json (and what --set gives of RUN_MODEL_KEYS), the rest
    from --config and --set. A RoPE scaling that --set turns on takes the model's own context for its
    original_max_position_embeddings unless --set gives one."""
    try:
        model = model_config_from_hf(hf_config)
    except (ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"{hf_dir}: {e}") from None
    data = _base_config(config, overrides)
    if _own_tokenizer(hf_dir, overrides):
        # the model's ids are its tokenizer's: that one, not --config's, unless --set names another; the run
        # keeps a copy of its own (the Hugging Face folder may go)
        data.setdefault("data", {}).update(tokenizer="huggingface", tokenizer_model=str(Path(run_dir) / "tokenizer"))
    base_model = data.get("model") or {}
    kept = ("kernels", "attention_backend", "vocab_pad_multiple", "init_std")
    keep = {k: base_model[k] for k in kept if k in base_model}
    data["model"] = {**config_to_dict(Config())["model"], **dataclasses.asdict(model), **keep}
    for ov in overrides:       # what the weights do not fix, a context extension's RoPE scaling say, is --set's
        if ov.startswith(RUN_MODEL_KEYS):
            apply_override(data, ov)
    context = hf_config.get("max_position_embeddings")
    scaling = data["model"]["rope_scaling"]
    if model.rope_scaling.type == "none" and scaling.get("type") in ("llama3", "yarn") and isinstance(context, int) \
            and not any(o.startswith("model.rope_scaling.original_max_position_embeddings") for o in overrides):
        scaling["original_max_position_embeddings"] = context           # the model's own, not the schema's
    data.setdefault("logging", {})["run_dir"] = str(run_dir)
    cfg = config_from_dict(data)
    _check_run_config(cfg, model, hf_dir, context)
    return cfg


# our model keys that config.json names otherwise, for the messages of _check_run_config
_HF_KEYS = {"model.num_heads": "num_attention_heads", "model.num_kv_heads": "num_key_value_heads",
            "model.hidden_size": "hidden_size", "model.head_dim": "head_dim", "model.ffn_hidden_size":
            "intermediate_size", "model.num_layers": "num_hidden_layers", "model.vocab_size": "vocab_size"}


def _check_run_config(cfg: Config, imported: ModelConfig, hf_dir: str, context: Any) -> None:
    """The checks a run applies to its config (config.checks: its warnings printed, its errors raised as one
    ConvertError that names config.json's fields), data.paths aside (given when training starts); and a RoPE
    scaling that --set changed must not take an original context longer than the model's own."""
    for note in config_warnings(cfg):
        print(f"warning: {note}", flush=True)
    try:
        validate_config(cfg, paths_later=True)
    except ConfigError as e:
        named = [f"{theirs} for {ours}" for ours, theirs in _HF_KEYS.items() if f"{ours}=" in str(e)]
        where = f" (config.json of {hf_dir}: {', '.join(named)})" if named else ""
        raise ConvertError(f"the converted config would not run: {e}{where}") from None
    rs = cfg.model.rope_scaling
    if rs.type in ("llama3", "yarn") and rs != imported.rope_scaling and isinstance(context, int) and \
            rs.original_max_position_embeddings > context:
        raise ConvertError(f"model.rope_scaling.original_max_position_embeddings={rs.original_max_position_embeddings} "
                           f"is above the context of {hf_dir} (max_position_embeddings={context} in its config.json): "
                           f"the original context is the one the model was trained at; set it to {context} or less, "
                           f"or leave it out ({context})")


def from_hf(hf_dir: str, run_dir: str, config: Optional[str] = None, overrides: Optional[list[str]] = None
            ) -> tuple[Path, Config]:
    """Write <run_dir>/config.yaml and a weights-only checkpoint at step 0, which the config's
    checkpoint.init_from names and pruning keeps (a KEEP file); returns the checkpoint dir and the config.
    The config is checked as a run checks it, and every tensor's shape against it, before anything is written."""
    hf_config, tensors = open_hf_dir(hf_dir)
    cfg = _imported_config(hf_dir, hf_config, run_dir, config, overrides or [])
    own_tokenizer = _own_tokenizer(hf_dir, overrides or [])
    try:
        check_hf_names(tensors.keys(), cfg.model)
        check_hf_shapes(tensors.shape, cfg.model)         # each tensor's header, before any tensor is read
    except KeyError as e:
        raise ConvertError(f"{hf_dir}: {e.args[0]}") from None
    except HFFormatError:                                 # a damaged file names itself
        raise
    except ValueError as e:
        raise ConvertError(f"{hf_dir}: {e}") from None

    run = Path(run_dir)
    root = Path(cfg.checkpoint.dir or run / "checkpoints")
    for target, flag in ((run, "--to"), (root, "checkpoint.dir")):
        _check_target(target, flag)
    if resolve_checkpoint(root) is not None:
        raise ConvertError(f"{root} already holds checkpoints: convert into a new run directory")
    # every tensor is read (and a damaged file found) before anything is written
    state = {f"model.{name}": our_tensor(name, cfg.model, tensors.get) for name in our_names(cfg.model)}
    final, tmp = root / "step_0000000", root / "step_0000000.tmp"
    # any run started from this config starts from these weights, whatever its run directory
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=os.path.abspath(final)))
    created = [p for p in (run, root, run / HF_SOURCE, run / "tokenizer") if not p.exists()]
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
        meta = {"step": 0, "consumed_samples": 0, "optimizer_steps": 0, WEIGHTS_ONLY: True,
                "model_shape": architecture(cfg.model), "source": str(hf_dir), "format": FORMAT}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        write_manifest(tmp, {})
        mark_kept(tmp, f"checkpoint.init_from of {os.path.abspath(run / 'config.yaml')}: the weights of {hf_dir}")
        shutil.rmtree(run / HF_SOURCE, ignore_errors=True)
        (run / HF_SOURCE).mkdir(parents=True)
        for name in SOURCE_FILES:
            if (Path(hf_dir) / name).is_file():
                shutil.copyfile(Path(hf_dir) / name, run / HF_SOURCE / name)
        if own_tokenizer:
            (run / "tokenizer").mkdir(exist_ok=True)
            for name in TOKENIZER_FILES:
                if (Path(hf_dir) / name).is_file():
                    shutil.copyfile(Path(hf_dir) / name, run / "tokenizer" / name)
        os.replace(tmp, final)
        (root / f"{LATEST}.tmp").write_text(final.name + "\n")
        os.replace(root / f"{LATEST}.tmp", root / LATEST)
        save_config(cfg, run / "config.yaml")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:
            shutil.rmtree(p, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConvertError(f"--to {run_dir} cannot be written ({e.strerror or e}): choose a place this user can "
                               f"write to, with room for the model") from None
        raise
    return final, cfg


def _run_config(path: Path, checkpoint: Path, config: Optional[str]) -> tuple[Config, Path]:
    candidates = [Path(config)] if config else [path / "config.yaml", checkpoint.parent.parent / "config.yaml"]
    for c in candidates:
        if c.is_file():
            try:
                return config_from_dict(yaml.safe_load(c.read_text()) or {}), c
            except (yaml.YAMLError, UnicodeDecodeError, ConfigError) as e:
                raise ConvertError(f"{c} is not a megalysses config: {e}") from None
    raise ConvertError(f"no config.yaml for {path}: pass the run directory, or --config with the run's config")


def to_hf(source: str, hf_dir: str, dtype: str = "bfloat16", config: Optional[str] = None,
          max_shard_gib: float = 5.0) -> tuple[list[Path], list[str]]:
    """Write a Hugging Face directory from a run or checkpoint; returns the weight files and, in words,
    what the export carries (its context, special tokens, generation config, tokenizer)."""
    try:
        check_new_dir(hf_dir)                          # before the weights are read
    except HFFormatError as e:
        raise ConvertError(f"--to-hf {e}") from None
    path = Path(source)
    checkpoint = None
    if path.is_dir():
        checkpoint = resolve_checkpoint(path / "checkpoints") if (path / "checkpoints").is_dir() else None
        checkpoint = checkpoint or resolve_checkpoint(path)
    if checkpoint is None:
        raise ConvertError(f"--from {source}: no megalysses checkpoint there (a run directory, its checkpoints/ "
                           f"folder with `latest`, or one step_N folder)")
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise ConvertError(f"checkpoint {checkpoint} is corrupt or incomplete: {problems[0]}")
    cfg, config_path = _run_config(path, checkpoint, config)
    meta = json.loads((checkpoint / "meta.json").read_text())
    saved = meta.get("model_shape") or {}
    expect = {k: v for k, v in architecture(cfg.model).items()
              if k != "padded_vocab_size" and k in saved}                   # padding depends on the saving tp
    detail = model_differences(saved, expect)
    if detail:
        raise ConvertError(f"checkpoint {checkpoint} is for another model than its config.yaml describes ({detail}): "
                           f"pass --config with the config the run was trained with")
    padded = saved.get("padded_vocab_size", cfg.model.padded_vocab_size())
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPTStage(cfg.model).named_parameters()}
    shapes = {n: (padded,) + s[1:] if n in ("embed.weight", "lm_head.weight") else s for n, s in shapes.items()}
    prefix = "model" if is_weights_only(checkpoint) else "master"
    state = {f"{prefix}.{n}": torch.empty(s, dtype=torch.float32) for n, s in shapes.items()}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)))
    out_dtype = DTYPES[dtype]
    tensors = [(k, v.to(out_dtype)) for n in our_names(cfg.model)
               for k, v in hf_tensors(n, state[f"{prefix}.{n}"], cfg.model).items()
               if not (cfg.model.tie_embeddings and k == "lm_head.weight")]   # tied: transformers re-ties it
    imported = _imported_from(cfg, [path, checkpoint.parent.parent, config_path.parent])
    src = _read_json(imported / "config.json") if imported else {}
    positions, context = _max_positions(cfg, int(meta.get("step", 0)), src)
    ids = _special_ids(cfg, src)
    extra, tokenizer = _tokenizer_files(cfg, positions)
    generation = imported / "generation_config.json" if imported else None
    if generation is not None and generation.is_file():
        extra["generation_config.json"] = generation.read_bytes()
        gen_words = f"the generation_config.json of {generation.parent}"
    elif ids:
        extra["generation_config.json"] = (json.dumps(ids, indent=1) + "\n").encode()
        gen_words = "a generation_config.json with those ids"
    else:
        gen_words = "no generation_config.json"
    try:
        config_json = hf_config_dict(cfg.model, dtype, positions, **ids, model_type=src.get("model_type"))
        files = write_hf_dir(hf_dir, tensors, config_json, int(max_shard_gib * 2**30), extra)
    except HFFormatError as e:
        raise ConvertError(f"--to-hf {e}") from None
    except ValueError as e:
        raise ConvertError(f"--to-hf: {e}") from None
    special = ", ".join(f"{k} {v}" for k, v in ids.items()) or (
        "no eos_token_id / bos_token_id: neither data.eod / data.bos, an imported model nor the run's tokenizer "
        "names them; add them to config.json")
    return files, [f"{config_json['architectures'][0]}", f"max_position_embeddings {positions} ({context})", special,
                   gen_words, tokenizer]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path} cannot be read as JSON ({e}): restore it from the imported model") from None
    return data if isinstance(data, dict) else {}


def _imported_from(cfg: Config, run_dirs: list[Path]) -> Optional[Path]:
    """The folder holding the config.json (and generation_config.json) of the Hugging Face model the run
    started from: its copy in the run directory (--from-hf), or checkpoint.init_from, a Hugging Face
    directory or a run imported so. None for a run trained from scratch."""
    init = Path(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else None
    candidates = [d / HF_SOURCE for d in run_dirs]
    if init is not None:
        candidates += [init] if is_hf_dir(init) else [init / HF_SOURCE, init.parent.parent / HF_SOURCE]
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def _max_positions(cfg: Config, step: int, source: dict) -> tuple[int, str]:
    """config.json's max_position_embeddings, and why: the longer of the longest sequence the checkpoint
    trained at (the curriculum's length at its last step) and the imported model's own."""
    own = source.get("max_position_embeddings")
    own = own if isinstance(own, int) and own > 0 else None
    trained = cfg.data.seq_len_at(step - 1) if step > 0 else None
    if trained is None:
        if own is not None:
            return own, "the imported model's own: this checkpoint has not trained"
        return cfg.data.seq_len, "data.seq_len: this checkpoint has not trained"
    if own is not None and own > trained:
        return own, f"the imported model's own, longer than the {trained} tokens it trained at"
    return trained, f"the length it trained at by step {step}" + (f", longer than the imported model's {own}"
                                                                   if own is not None and own < trained else "")


def _special_ids(cfg: Config, source: dict) -> dict:
    """eos_token_id / bos_token_id: data.eod / data.bos when set, else the imported model's, else those of
    the run's tokenizer (when it can be built and fits the model); mock data ends its documents with the
    last id and has no BOS."""
    try:
        tok = tokenizer_from_config(cfg.data, cfg.model.vocab_size)
        tok = tok if tok.vocab_size <= cfg.model.vocab_size else None
    except (TokenizerError, OSError, ValueError):
        tok = None
    if cfg.data.mock:
        tok = types.SimpleNamespace(eod_id=cfg.model.vocab_size - 1, bos_id=None)
    ids = {}
    for key, explicit, attr in (("bos_token_id", cfg.data.bos, "bos_id"), ("eos_token_id", cfg.data.eod, "eod_id")):
        mine = getattr(tok, attr, None) if tok is not None else None
        if explicit is None and source.get(key) is not None:
            ids[key] = source[key]
        elif mine is not None and mine >= 0:
            ids[key] = int(mine)
    return ids


# the chat template travels with the tokenizer: in tokenizer_config.json, or beside it (transformers >= 4.43)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")


def _tokenizer_files(cfg: Config, model_max_length: int) -> tuple[dict[str, bytes], str]:
    """The run's tokenizer as files to go beside the weights, so that transformers' AutoTokenizer and
    tools/generate.py --hf load the pair and encode as the run did: a Hugging Face tokenizer's own files (its
    tokenizer.json, or its folder's tokenizer files), or a sentencepiece, byte or GPT-2 BPE tokenizer rebuilt
    as a tokenizer.json (megalysses/data/hf_tokenizer.py, checked to give the run's ids). Returns
    {name: bytes} and what was done, in words."""
    d = cfg.data
    kind = "mock data" if d.mock else f"data.tokenizer={d.tokenizer}"
    if d.mock or canonical_kind(d.tokenizer) == "null":
        return {}, (f"no tokenizer: the run has none ({kind}); put one beside the weights to load them with "
                    f"AutoTokenizer")
    if canonical_kind(d.tokenizer) != "huggingface":
        try:
            tok = tokenizer_from_config(d, cfg.model.vocab_size)
            if tok.vocab_size > cfg.model.vocab_size:
                return {}, (f"no tokenizer: the run's ({kind}) has {tok.vocab_size} ids, more than the model's "
                            f"model.vocab_size={cfg.model.vocab_size}: it is not the tokenizer the model learned")
            files = hf_tokenizer_files(tok, model_max_length)
        except (TokenizerError, OSError) as e:
            return {}, f"no tokenizer: the run's ({kind}) could not be converted: {e}"
        return files, f"the run's tokenizer ({source_name(tok)}) as tokenizer.json, giving the ids it trained on"
    source = Path(d.tokenizer_model or "")
    files = [f for f in ([source / n for n in TOKENIZER_FILES] if source.is_dir() else [source]) if f.is_file()]
    if not any(f.name == "tokenizer.json" or f == source for f in files):
        return {}, (f"no tokenizer: the run's, {source}, is not there any more; copy its tokenizer.json beside the "
                    f"weights")
    out = {("tokenizer.json" if f == source else f.name): f.read_bytes() for f in files}
    return out, f"the run's tokenizer ({', '.join(f.name for f in files)} from {source})"


def main(argv: Optional[list[str]] = None) -> int:
    # one process, no process group, on purpose: DCP's warning about it says nothing to the user
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR",
                           help="a Hugging Face Llama, Qwen2/2.5, Qwen3 or Mistral directory (config.json + "
                                "safetensors)")
    direction.add_argument("--from", dest="source", metavar="RUN_DIR", help="a megalysses run, or one checkpoint")
    p.add_argument("--to", metavar="RUN_DIR", help="with --from-hf: the run directory to create")
    p.add_argument("--to-hf", metavar="HF_DIR", help="with --from: the Hugging Face directory to write")
    p.add_argument("--config", help="--from-hf: a megalysses YAML for everything but the model section; "
                                    "--from: the run's config.yaml, when not in the run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="--from-hf: override a value of the written config; repeatable")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="--to-hf: the dtype of the tensors written. Default bfloat16, whatever the checkpoint holds "
                        "(fp32 master weights when it trained): the dtype these models are published and served "
                        "in, at half the size; float32 keeps the master weights exactly")
    p.add_argument("--max-shard-gib", type=float, default=5.0, help="--to-hf: largest safetensors file")
    args = p.parse_args(argv)
    try:
        if args.from_hf:
            if not args.to:
                raise ConvertError("--from-hf needs --to RUN_DIR (the megalysses run directory to create)")
            if args.to_hf:
                raise ConvertError("--to-hf goes with --from RUN_DIR, not with --from-hf")
            final, cfg = from_hf(args.from_hf, args.to, args.config, args.overrides)
            data = "" if cfg.data.paths or cfg.data.mock else " --set data.paths=[...]"
            print(f"wrote {final} (weights only, step 0; checkpoint.init_from names it) and "
                  f"{Path(args.to) / 'config.yaml'}: train with pretrain.py --config {Path(args.to) / 'config.yaml'}"
                  f"{data}")
        else:
            if not args.to_hf:
                raise ConvertError("--from needs --to-hf HF_DIR (the Hugging Face directory to write)")
            if args.max_shard_gib <= 0:
                raise ConvertError(f"--max-shard-gib={args.max_shard_gib} must be positive")
            files, notes = to_hf(args.source, args.to_hf, args.dtype, args.config, args.max_shard_gib)
            print(f"wrote {len(files)} safetensors file(s) ({args.dtype}) and config.json to {args.to_hf}; "
                  + "; ".join(notes))
    except (ConvertError, HFFormatError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cli() -> int:
    return main()


if __name__ == "__main__":
    sys.exit(cli())
