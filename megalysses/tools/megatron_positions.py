"""Megatron-LM's position flags as megalysses settings: rotary embeddings (their base, their share of the head),
at most one RoPE scaling (llama3: --use-rope-scaling; linear: --rotary-seq-len-interpolation-factor; YaRN:
--position-embedding-type yarn with --rotary-scaling-factor, --yarn-* and --mscale, Megatron-LM's defaults for
those left out), and the sliding window (--window-size). Part of megalysses/tools/megatron_convert.py's
conversion: each function takes its converter (`c`: get, has, set, lossy, note).
"""
from __future__ import annotations

import math
from typing import Any

from megalysses.config.megatron_names import FLAGS
from megalysses.tools.megatron_script import MegatronArgsError


def window(c: Any) -> None:
    """--window-size (L, R): a causal window of L + 1 positions (L = -1: none)."""
    if not c.has("--window-size"):
        return
    raw = str(c.get("--window-size"))
    try:
        left, _right = (int(x) for x in raw.strip("()").split(","))
    except ValueError:
        raise MegatronArgsError(f"--window-size {raw}: expected two integers, as (4095,0) or 4095,0") from None
    c.set("--window-size", model__sliding_window=left + 1 if left >= 0 else 0)


def rope(c: Any) -> None:
    """Positions: RoPE (its base, its share of the head) and at most one scaling: llama3 (--use-rope-scaling),
    linear (--rotary-seq-len-interpolation-factor) or YaRN (--position-embedding-type yarn)."""
    kind = c.get("--position-embedding-type")
    rotary = kind in ("rope", "yarn") or c.get("--use-rotary-position-embeddings")
    if not rotary:
        c.lossy("--position-embedding-type", f"{kind} positions: megalysses uses rotary embeddings only; the "
                                             f"converted model has RoPE")
    if c.has("--no-position-embedding") and kind != "rope" and not c.get("--use-rotary-position-embeddings"):
        c.note(f"--no-position-embedding with --position-embedding-type {kind}: Megatron-LM refuses the pair")
    c.set("--position-embedding-type --use-rotary-position-embeddings --rotary-base --no-position-embedding",
          model__rope_theta=float(c.get("--rotary-base")))
    if c.get("--rotary-percent") != 1.0:
        c.lossy("--rotary-percent", f"{c.get('--rotary-percent')} of each head rotated: every dimension rotates "
                                    f"here")
    if c.get("--rope-type") == "yarn":
        c.lossy("--rope-type", FLAGS["--rope-type"].note)
    yarn = kind == "yarn"
    linear = c.get("--rotary-seq-len-interpolation-factor")
    candidates = (("--use-rope-scaling", c.get("--use-rope-scaling")), ("--position-embedding-type yarn", yarn),
                  ("--rotary-seq-len-interpolation-factor", linear not in (None, 1)))
    scalings = [flag for flag, on in candidates if on]
    if len(scalings) > 1:
        c.lossy(scalings[-1].split()[0], f"{' and '.join(scalings)}: one RoPE scaling here; the converted model "
                                         f"has the first")
    first = scalings[0] if scalings else ""
    if first == "--use-rope-scaling":
        c.set("--use-rope-scaling --rope-scaling-factor", **{
            "model__rope_scaling.type": "llama3", "model__rope_scaling.factor": c.get("--rope-scaling-factor")})
    elif first.startswith("--position-embedding-type"):
        c.set("--position-embedding-type", **{"model__rope_scaling.type": "yarn"})
        _yarn(c)
    elif first:
        c.set("--rotary-seq-len-interpolation-factor", **{"model__rope_scaling.type": "linear",
                                                          "model__rope_scaling.factor": float(linear)})
    for flag, owner in (("--rope-scaling-factor", "--use-rope-scaling"), ("--rotary-scaling-factor", "yarn"),
                        ("--mscale", "yarn"), ("--mscale-all-dim", "yarn"), ("--yarn-beta-fast", "yarn"),
                        ("--yarn-beta-slow", "yarn"), ("--yarn-original-max-position-embeddings", "yarn"),
                        ("--yarn-correction-range-round-to-int", "yarn"),
                        ("--no-yarn-correction-range-round-to-int", "yarn")):
        if c.has(flag) and flag not in c.out.mapped:
            words = "--position-embedding-type yarn" if owner == "yarn" else owner
            c.out.mapped[flag] = f"ignored without {words}, as in Megatron-LM"


def _yarn(c: Any) -> None:
    """Megatron-LM's YaRN settings (its defaults for those left out); its attention factor, always
    (1 + 0.1 mscale ln f) / (1 + 0.1 mscale_all_dim ln f), written as Hugging Face's fields give it."""
    factor = float(c.get("--rotary-scaling-factor"))
    mscale, all_dim = float(c.get("--mscale")), float(c.get("--mscale-all-dim"))
    rounding = [c.get(f) for f in ("--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int")
                if c.has(f)]
    keys = {"factor": factor, "original_max_position_embeddings": c.get("--yarn-original-max-position-embeddings"),
            "beta_fast": float(c.get("--yarn-beta-fast")), "beta_slow": float(c.get("--yarn-beta-slow")),
            "truncate": bool(rounding[-1]) if rounding else True}

    def get_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if mscale and all_dim:
        keys.update(mscale=mscale, mscale_all_dim=all_dim)
    elif (mscale, all_dim) != (1.0, 0.0):
        keys["attention_factor"] = get_mscale(mscale) / get_mscale(all_dim)
    flags = ("--position-embedding-type --rotary-scaling-factor --mscale --mscale-all-dim --yarn-beta-fast "
             "--yarn-beta-slow --yarn-original-max-position-embeddings --yarn-correction-range-round-to-int "
             "--no-yarn-correction-range-round-to-int")
    c.set(flags, **{f"model__rope_scaling.{k}": v for k, v in keys.items()})
