"""The optimizers' one shape: what the train step, the loop and checkpoints see of ZeRO-1's AdamW
(parallel/zero.py) and FSDP2's (parallel/fsdp.py), and the part of a step both share.

    opt.set_lr(lr)                 # the schedule's learning rate of this step
    opt.begin_step(micro_batches)  # before the backward passes (ZeRO-1 launches reductions from them)
    norm = opt.step(max_norm, ok)  # reduce, global norm, clip, AdamW, gather; the norm before clipping (on the
                                   # device: a step whose norm or `ok` is not finite updates nothing)
    opt.set_step(updates)          # AdamW's step count (a resume's: skipped steps excluded)
    opt.checkpoint_slots()         # (name, parameter, {master, exp_avg, exp_avg_sq}) as dim-0 chunks

AdamWBase holds torch's AdamW (foreach; decay on matrices only), the learning rate, the step count, the
global gradient norm (every element counted once over every rank), the clipping and the skip of a step whose
norm is not finite, all decided on the device (no host synchronisation): on a GPU the step count AdamW's bias
correction reads lives there too (torch's capturable AdamW), and a skipped step does not advance it, so the
steps after one update exactly as if it had never been taken; each optimizer says how
its gradients get to the tensors AdamW updates (`_prepare`), what its local sum of squares is, and what
follows the update (`_finish`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import torch
from torch import Tensor, nn

from megalysses import accelerator, comm
from megalysses.comm import Group


GUARD_ELEMENTS = 1 << 25      # a guarded update steps this many elements at a time (their copies kept aside)


@dataclass(frozen=True)
class AdamWSettings:
    """AdamW's hyper-parameters and where this rank's parameters sit, which decides the elements it counts in
    the global gradient norm: tp-replicated parameters on tp rank 0 only, the LM-head copy of a tied embedding
    not at all."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    tp_rank: int = 0
    embed_group: Group = None       # the two copies of an embedding tied across stages sum their gradients here
    tied_head_copy: bool = False    # this stage holds the LM-head copy of a tied embedding (not the first stage)

    def counts_in_norm(self, name: str, param: nn.Parameter) -> bool:
        """Whether this rank counts `param`'s gradient in the global norm (each element once over all ranks)."""
        replicated_over_tp = getattr(param, "tp_dim", None) is None
        return not (replicated_over_tp and self.tp_rank != 0) and not (self.tied_head_copy and name == "embed.weight")


class Optimizer(Protocol):
    """What the train step, the loop and checkpoints call; the same chunks to checkpoints either way."""

    def set_lr(self, lr: float) -> None: ...

    def begin_step(self, backward_passes: int) -> None: ...

    def step(self, max_norm: float = 0.0, ok: Optional[Tensor] = None, guard: bool = True) -> Tensor: ...

    def zero_grad(self) -> None: ...

    def set_step(self, step: int) -> None: ...

    def checkpoint_slots(self) -> Iterator[tuple[str, nn.Parameter, dict[str, Tensor]]]: ...


def adam_state(optimizer: torch.optim.Optimizer, p: Tensor) -> dict:
    """p's AdamW state (foreach, not fused), created as torch's AdamW creates it on a first step when it
    does not exist yet: a float32 step count (beside p when the optimizer is capturable, else on the host) and
    zero moments like p. A checkpoint load can then fill it, and no torch version's default-device tensor
    creation reaches the step."""
    st = optimizer.state[p]
    if not st:
        where = p.device if optimizer.defaults["capturable"] else torch.device("cpu")
        st.update(step=torch.zeros((), dtype=torch.float32, device=where), exp_avg=torch.zeros_like(p),
                  exp_avg_sq=torch.zeros_like(p))
    return st


class AdamWBase:
    """torch's AdamW over `decay` (weight decay) and `no_decay` tensors, with what every optimizer's step shares:
    the learning rate, the step count, the global gradient norm and clipping, and the skip of a step whose
    norm is not finite. Subclasses fill in the hooks below."""

    def __init__(self, decay: list[Tensor], no_decay: list[Tensor], settings: AdamWSettings,
                 update_device: torch.device) -> None:
        """`update_device`: where the gradients AdamW reads live (the clipping coefficient and the step count go
        there: on a GPU AdamW is capturable, its bias correction computed from the step count on the device)."""
        self.settings, self.update_device = settings, update_device
        groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                           foreach=True, capturable=update_device.type == "cuda")

    # ------------------------------------------------------------------ the hooks
    def _prepare(self) -> None:
        """Bring this step's gradients to the tensors AdamW updates (reductions, tied embeddings)."""

    def _local_norm_sq(self) -> Tensor:
        """This rank's sum of squares of the gradient elements it counts, on the collectives' device."""
        raise NotImplementedError

    def _update_grads(self) -> list[Tensor]:
        """The gradients AdamW reads (clipped in place)."""
        raise NotImplementedError

    def _finish(self) -> None:
        """What follows the update (ZeRO-1: the updated chunks back into the parameters)."""

    def zero_grad(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def set_step(self, step: int) -> None:
        """AdamW's step count of every tensor that has state (a resume's: skipped steps excluded)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"].fill_(float(step))

    def begin_step(self, backward_passes: int) -> None:
        """Announce how many backward passes (micro-batches) this step will run."""

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The true global L2 norm (every element once, all stages, shards and chunks)."""
        local = self._local_norm_sq()
        comm.all_reduce_(local, comm.world())
        return local.sqrt()

    @torch.no_grad()
    def step(self, max_norm: float = 0.0, ok: Optional[Tensor] = None, guard: bool = True) -> Tensor:
        """Prepare the gradients, clip to `max_norm` (0: no clipping), update; the gradient norm before clipping,
        left on the device (nothing here reads a value back to the host). With `guard`, a step whose norm is not
        finite (the same on every rank), or whose `ok` (a device bool: the loss was finite) is false, updates
        nothing: the weights, AdamW's moments and its step count are put back, decided on the device. Without
        `guard` (training.nan_policy=abort: the run stops at that read-back) the update is not checked."""
        self._prepare()
        norm = self.grad_norm()
        if max_norm > 0:
            coef = self._to_update_device(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
            for g in self._update_grads():
                g.mul_(coef)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                adam_state(self.optimizer, p)
        if guard:
            finite = torch.isfinite(norm) if ok is None else torch.isfinite(norm) & ok
            self._guarded_update(self._to_update_device(finite))
        else:
            self.optimizer.step()
        self._finish()
        self.zero_grad()
        return norm

    def _to_update_device(self, t: Tensor) -> Tensor:
        """t where AdamW's tensors are: an offloaded update waits for it on the host (counted apart)."""
        if t.device == self.update_device:
            return t
        with accelerator.host_wait("offload"):
            return t.to(self.update_device)

    def _guarded_update(self, ok: Tensor) -> None:
        """AdamW's update where `ok`, none where not: the tensors are stepped in runs of up to GUARD_ELEMENTS
        elements (each element's arithmetic is the same as in one step of all of them), a run's weights, moments
        and step counts kept aside while it is stepped and put back unless `ok` (the step counts are where `ok`
        is: on the GPU, or on the host where the update runs there; a trace's meta device, which holds no values
        and cannot run torch's capturable AdamW, leaves them on the host)."""
        groups = self.optimizer.param_groups
        everything = [g["params"] for g in groups]
        try:
            for index, params in enumerate(everything):
                for run in _runs(params, GUARD_ELEMENTS):
                    for j, g in enumerate(groups):
                        g["params"] = run if j == index else []
                    state = self.optimizer.state
                    now = [_as_local(t) for p in run for t in (p, state[p]["exp_avg"], state[p]["exp_avg_sq"])]
                    now += [state[p]["step"] for p in run if state[p]["step"].device == ok.device]
                    kept = [t.clone() for t in now]
                    self.optimizer.step()
                    for new, old in zip(now, kept):
                        torch.where(ok, new, old, out=new)
        finally:
            for g, params in zip(groups, everything):
                g["params"] = params


def _as_local(t: Tensor) -> Tensor:
    """This rank's part of t (an FSDP2 DTensor's local shard; any other tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _runs(tensors: list[Tensor], limit: int) -> Iterator[list[Tensor]]:
    """`tensors` in order, in runs of at most `limit` elements (a larger tensor alone)."""
    run, size = [], 0
    for t in tensors:
        if run and size + t.numel() > limit:
            yield run
            run, size = [], 0
        run.append(t)
        size += t.numel()
    if run:
        yield run
