"""training.mlp_chunk_tokens and training.loss_chunk_tokens `auto`: tiles chosen from the memory model.

    policy = auto_tiles(cfg, plan)       # plan.activation with every `auto` tile made concrete

A tile's intermediates are one of the moments the memory model weighs (megalysses.memory): the MLP tile's
recomputation and gradients in a layer's backward, one tile of logits in the LM head + loss. Smaller tiles
lower that moment until another one sets the peak (the attention's backward, the norms', the loss,
the states); below that they save nothing, while larger tiles run fewer, larger matmuls and, for the
loss, add the fp32 head-weight gradient fewer times. So `auto` takes the largest tile that does not raise
the predicted peak above a reference tile's:

    MLP   no tiling (no recomputation of the MLP) when the untiled step's peak fits the device (the
          machine's memory, less Hardware's default reserve and fragmentation allowance, as the planner counts a
          fit) or is no higher than with tiles; else the reference is ALST's TiledMLP, tiles of `hidden`
          tokens, and the candidates hidden x 2^k up to the rank's local sequence. A sequence of no more
          than `hidden` local tokens is not tiled.
    loss  the reference is the kernel's default tile (fp32 logits of at most 512 MiB,
          kernels/linear_cross_entropy.py); the candidates are it x 2^k, up to one tile of the whole
          sequence.

The MLP tile is chosen first (the loss at its reference tile when it is auto), then the loss tile with it.
A layout the memory model does not cover (the reference attention backend on a ring) gets the
reference tiles. The step-time model counts the same recomputation for any tile of the MLP, so the choice
changes no predicted step time; it is the memory at the peak it leaves alone.
"""
from __future__ import annotations

from dataclasses import replace

from megalysses.config import Config
from megalysses.memory import loss_tile_tokens
from megalysses.plan.communicators import communicator_bytes
from megalysses.plan.memory import estimate_plan, options_of
from megalysses.plan.types import ActivationPolicy, RunPlan
from megalysses.plan.step_time import Hardware

AUTO = "auto"


def _estimate(cfg: Config, plan: RunPlan, **tiles: int):
    return estimate_plan(cfg, replace(plan, activation=replace(plan.activation, **tiles)))


def _peak(cfg: Config, plan: RunPlan, **tiles: int) -> float:
    return _estimate(cfg, plan, **tiles).peak


def _local_tokens(plan: RunPlan) -> int:
    """Tokens of a rank's residual stream: what MLP tiles split (model/policies.py TiledMLP)."""
    return plan.padded_seq_len // (plan.degrees.sp * (plan.degrees.tp if plan.activation.tp_sequence_parallel else 1))


def _largest_within(cfg: Config, plan: RunPlan, key: str, reference: int, at_reference: float,
                    ladder: list[int]) -> int:
    """The largest tile of `ladder` (ascending, above `reference`) whose peak is at most `at_reference`, the peak
    at `reference`, or `reference`. The peak does not fall as a tile grows (a larger tile's intermediates are
    larger), so a binary search finds it."""
    limit = at_reference * (1 + 1e-12)
    lo, hi = 0, len(ladder)                       # ladder[:lo] fit, ladder[hi:] do not
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if _peak(cfg, plan, **{key: ladder[mid]}) <= limit else (lo, mid)
    return ladder[lo - 1] if lo else reference


def mlp_tile(cfg: Config, plan: RunPlan) -> int:
    """The auto MLP tile of `plan` (its loss tile as it stands) in local tokens, or 0 for no tiling."""
    h, local = cfg.model.hidden_size, _local_tokens(plan)
    if local <= h:
        return 0
    whole = _estimate(cfg, plan, mlp_chunk_tokens=0)
    untiled, memory = whole.peak, plan.machine.memory_gib
    if memory and untiled <= Hardware().usable_bytes(memory, whole.largest.bytes, communicator_bytes(plan)):
        return 0
    at_h = _peak(cfg, plan, mlp_chunk_tokens=h)
    if untiled <= at_h * (1 + 1e-12):
        return 0
    ladder = [h << k for k in range((local // h).bit_length()) if h << k < local]
    return _largest_within(cfg, plan, "mlp_chunk_tokens", h, at_h, ladder)


def _loss_tokens(cfg: Config, plan: RunPlan) -> int:
    """Tokens of a rank's LM head + loss: one tile of them all is the largest loss tile."""
    return cfg.training.micro_batch_size * plan.padded_seq_len // plan.degrees.sp


def loss_tile(cfg: Config, plan: RunPlan) -> int:
    """The auto loss tile of `plan` (its MLP tile as it stands), in tokens."""
    tokens = _loss_tokens(cfg, plan)
    default = replace(options_of(cfg, plan), loss_chunk_tokens=0)
    reference = int(loss_tile_tokens(cfg.model, plan.degrees, default, tokens))
    if reference >= tokens:
        return reference
    # one tile of the whole sequence also drops the head weight's fp32 gradient sum: weighed on its own
    at_reference = _peak(cfg, plan, loss_chunk_tokens=reference)
    if _peak(cfg, plan, loss_chunk_tokens=tokens) <= at_reference * (1 + 1e-12):
        return tokens
    ladder = [reference << k for k in range(1, (tokens // reference).bit_length()) if reference << k < tokens]
    return _largest_within(cfg, plan, "loss_chunk_tokens", reference, at_reference, ladder)


def could_fit(cfg: Config, plan: RunPlan, budget: float) -> bool:
    """Whether some tiles that `cfg`'s `auto` ones can resolve to on `plan` (resolved with tiles=False: 0 where
    auto) leave the peak within `budget`; False means none can, so the search need not run. As the searches
    assume, the peak does not fall as a tile grows along a ladder, so the least peak is at a corner: the MLP
    at the smallest tile (`hidden` tokens) or untiled, the loss at the reference tile (0, the kernel's
    default) or one tile of the whole sequence. A layout the memory model does not cover raises its
    ValueError."""
    t, a, h = cfg.training, plan.activation, cfg.model.hidden_size
    mlp = ([h, 0] if _local_tokens(plan) > h else [0]) if t.mlp_chunk_tokens == AUTO else [a.mlp_chunk_tokens]
    loss = [0, _loss_tokens(cfg, plan)] if t.loss_chunk_tokens == AUTO else [a.loss_chunk_tokens]
    return any(_peak(cfg, plan, mlp_chunk_tokens=m, loss_chunk_tokens=x) <= budget for m in mlp for x in loss)


def auto_tiles(cfg: Config, plan: RunPlan) -> ActivationPolicy:
    """plan.activation with training.mlp_chunk_tokens and loss_chunk_tokens `auto` made concrete (the others
    as they are); plan.activation holds 0 where the config says auto."""
    t = cfg.training
    try:
        if t.mlp_chunk_tokens == AUTO:
            plan = replace(plan, activation=replace(plan.activation, mlp_chunk_tokens=mlp_tile(cfg, plan)))
        if t.loss_chunk_tokens == AUTO:
            plan = replace(plan, activation=replace(plan.activation, loss_chunk_tokens=loss_tile(cfg, plan)))
    except ValueError:          # a layout the memory model does not cover: the reference tiles
        a, h = plan.activation, cfg.model.hidden_size
        mlp = (h if _local_tokens(plan) > h else 0) if t.mlp_chunk_tokens == AUTO else a.mlp_chunk_tokens
        return replace(a, mlp_chunk_tokens=mlp, loss_chunk_tokens=0 if t.loss_chunk_tokens == AUTO else
                       a.loss_chunk_tokens)
    return plan.activation
