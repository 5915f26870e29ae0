"""Attention over one block of a blockwise (ring) computation: its output with the log-sum-exp (LSE) of
every query row, and the backward against the MERGED output and LSE of all blocks.

    out, lse, aux = block_attention(q, k, v, block, backend, scale)       # lse (B, H, Sq) fp32
    ... merge the blocks of a row: LSE = logaddexp(lse_1, lse_2, ...), O = sum_j exp(lse_j - LSE) O_j
    dq, dk, dv = block_attention_backward(q, k, v, MergedRows(O, LSE, dout), block, backend, scale, aux)

With the merged O and LSE, P = exp(S - LSE) is this block's share of the full softmax, so the backward
of a block needs nothing from the other blocks: dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
dQ = scale dS K, dK = scale dS^T Q (the flash-attention backward). Shapes as in attention.py: q
(B, Sq, Hq, D), k, v (B, Sk, Hkv, D), Hq % Hkv == 0; query head h reads KV head h // (Hq / Hkv).

Backends (which one can run where is `attention.unsupported_reason(..., ring=True)`'s question):
    reference  fp32 matmuls with an explicit mask; any device, any mask.
    sdpa       torch's own LSE-returning SDPA kernels (the ones behind F.scaled_dot_product_attention
               and torch's context parallelism): on CPU the flash kernel, with documents as an additive
               mask; on CUDA the flash kernel (float16/bfloat16, no document mask).
    flex       FlexAttention with a BlockMask and its LSE; the backward re-runs the block's forward and
               differentiates through out and LSE together (torch implements that on CUDA only).
A row with no allowed key in a block has LSE -inf and output 0, so it weighs nothing in the merge.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from megalysses import accelerator
from megalysses.kernels import attention
from megalysses.kernels.attention import flex_module
from megalysses.kernels.block_mask import MaskPattern

aten = torch.ops.aten


class MergedRows(NamedTuple):
    """What every block's backward reads of the query rows: their output and LSE merged over all blocks
    (the full softmax's), and the gradient of that output."""

    out: Tensor         # (B, Sq, Hq, D)
    lse: Tensor         # (B, Hq, Sq) fp32
    dout: Tensor        # (B, Sq, Hq, D)

    def rows(self, rows: slice) -> "MergedRows":
        """The same of the query rows `rows` alone."""
        return MergedRows(self.out[:, rows], self.lse[:, :, rows], self.dout[:, rows])


class AttentionBlock:
    """Which (query, key) pairs of one block may attend: causal in local index (a diagonal block, whose
    queries and keys are the same positions in the same order), the same document, and inside a sliding
    window.

    q_docs (B, Sq), k_docs (B, Sk): document ids of the block's queries and keys (None: no documents).
    window > 0: q_pos (Sq,), k_pos (Sk,), the queries' and keys' indices in the whole sequence, and a query
    attends only keys less than `window` before it (kernels/attention.py's sliding window).
    Each mask form a backend needs is built on first use and kept, so the layers, head chunks and backward of a
    step share it: FlexAttention's block mask of documents or a window (four int32 (Sq/block x Sk/block) index
    tensors, in blocks of `block` tokens) among them."""

    def __init__(self, causal: bool, q_docs: Optional[Tensor] = None, k_docs: Optional[Tensor] = None,
                 window: int = 0, q_pos: Optional[Tensor] = None, k_pos: Optional[Tensor] = None,
                 block: int = 128) -> None:
        if (q_docs is None) != (k_docs is None):
            raise ValueError("give the document ids of both the queries and the keys, or of neither")
        if window and (q_pos is None or k_pos is None):
            raise ValueError("a sliding window needs the positions of the block's queries and keys")
        self.causal, self.q_docs, self.k_docs, self.block = causal, q_docs, k_docs, block
        self.window, self.q_pos, self.k_pos = window, q_pos, k_pos
        self._forms: dict[Any, Any] = {}

    @property
    def has_docs(self) -> bool:
        return self.q_docs is not None

    @property
    def masked(self) -> bool:
        """Whether pairs other than causality's are left out (documents or a window): the block needs a mask."""
        return self.has_docs or bool(self.window)

    def _cached(self, key: Any, build: Any) -> Any:
        if key not in self._forms:
            with torch.no_grad():
                self._forms[key] = build()
        return self._forms[key]

    def allowed(self, sq: int, sk: int, device: torch.device) -> Optional[Tensor]:
        """(B or 1, 1, Sq, Sk) bool, True where attention is allowed; None when every pair is."""
        def build() -> Optional[Tensor]:
            mask = None
            if self.causal:
                mask = torch.ones(sq, sk, dtype=torch.bool, device=device).tril()[None, None]
            if self.has_docs:
                same = (self.q_docs[:, :, None] == self.k_docs[:, None, :])[:, None]      # (B, 1, Sq, Sk)
                mask = same if mask is None else mask & same
            if self.window:
                qp, kp = self.q_pos.to(device), self.k_pos.to(device)
                near = (qp[:, None] - kp[None, :] < self.window)[None, None]            # (1, 1, Sq, Sk)
                mask = near if mask is None else mask & near
            return mask
        return self._cached(("allowed", sq, sk), build)

    def bias(self, sq: int, sk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The allowed pairs as an additive mask (0 or -inf) in `dtype`."""
        def build() -> Tensor:
            allowed = self.allowed(sq, sk, device)
            return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
        return self._cached(("bias", sq, sk, dtype), build)

    def empty_rows(self, sq: int, sk: int, device: torch.device) -> Optional[Tensor]:
        """(B, 1, Sq) bool: queries with no allowed key in this block (only documents and windows make them)."""
        if not self.masked:
            return None
        return self._cached(("empty", sq, sk), lambda: ~self.allowed(sq, sk, device).any(-1))

    def flex_mask(self, sq: int, sk: int, device: torch.device) -> Any:
        """FlexAttention BlockMask (None: no mask, every pair allowed); with documents or a window built from the
        documents' boundaries and positions per block (kernels/block_mask.py, never per pair of tokens) on first
        use and kept, so the head chunks, the layers and the backward of a step share it."""
        if not self.masked:
            return attention.kernels().causal_block_mask(sq, device) if self.causal else None
        pattern = MaskPattern(self.causal, self.q_docs, self.k_docs, self.window, self.q_pos, self.k_pos)
        return self._cached(("flex", sq, sk),
                            lambda: attention.kernels().build_block_mask(pattern, sq, sk, self.block, device))


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(1, 2)                                               # (B, S, H, D) <-> (B, H, S, D)


def _expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    return k, v, rep


def _fold_kv_grad(g: Tensor, rep: int) -> Tensor:
    """(B, Sk, Hkv*rep, D) gradient of repeated KV heads -> (B, Sk, Hkv, D): the rep copies summed."""
    if rep == 1:
        return g
    B, S, H, D = g.shape
    return g.view(B, S, H // rep, rep, D).sum(3)


# ----------------------------------------------------------------------------- reference

def _ref_scores(q: Tensor, k: Tensor, block: AttentionBlock, scale: float) -> Tensor:
    scores = (_heads_first(q).float() @ _heads_first(k).float().transpose(-1, -2)) * scale   # (B, H, Sq, Sk)
    allowed = block.allowed(q.shape[1], k.shape[1], q.device)
    return scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))


def _finite(lse: Tensor) -> Tensor:
    """lse with -inf rows (no allowed key) at 0, so exp(scores - lse) is 0 there instead of NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _reference_forward(q, k, v, block, scale):
    k, v, _ = _expand_kv(q, k, v)
    scores = _ref_scores(q, k, block, scale)
    lse = scores.logsumexp(-1)                                            # (B, H, Sq)
    probs = (scores - _finite(lse)[..., None]).exp()
    out = probs @ _heads_first(v).float()                                 # (B, H, Sq, D)
    return _heads_first(out), lse, None


def _reference_backward(q, k, v, merged, block, scale, aux):
    out, lse, dout = merged
    k_, v_, rep = _expand_kv(q, k, v)
    probs = (_ref_scores(q, k_, block, scale) - _finite(lse.float())[..., None]).exp()   # (B, H, Sq, Sk)
    do, o = _heads_first(dout).float(), _heads_first(out).float()
    dv = probs.transpose(-1, -2) @ do                                     # (B, H, Sk, D)
    dp = do @ _heads_first(v_).float().transpose(-1, -2)
    ds = probs * (dp - (do * o).sum(-1, keepdim=True))
    dq = (ds @ _heads_first(k_).float()) * scale
    dk = (ds.transpose(-1, -2) @ _heads_first(q).float()) * scale
    return _heads_first(dq), _fold_kv_grad(_heads_first(dk), rep), _fold_kv_grad(_heads_first(dv), rep)


# ----------------------------------------------------------------------------- sdpa (torch's kernels)

def _sdpa_cpu_args(q: Tensor, k: Tensor, block: AttentionBlock) -> tuple[bool, Optional[Tensor]]:
    """(is_causal, attn_mask) for the CPU flash kernel: documents and windows (with causality folded in) as a
    bias."""
    if block.masked:
        return False, block.bias(q.shape[1], k.shape[1], q.dtype, q.device)
    return block.causal, None


def _sdpa_forward(q, k, v, block, scale):
    k, v, _ = _expand_kv(q, k, v)
    q_, k_, v_ = (_heads_first(t) for t in (q, k, v))
    if accelerator.on_gpu(q):
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q_, k_, v_, 0.0, block.causal, False, scale=scale)
        return _heads_first(out), lse, (seed, offset)
    is_causal, mask = _sdpa_cpu_args(q, k, block)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q_, k_, v_, 0.0, is_causal, attn_mask=mask,
                                                                 scale=scale)
    empty = block.empty_rows(q.shape[1], k.shape[1], q.device)
    if empty is not None:                                                 # the kernel reports 0 there
        lse = lse.masked_fill(empty, float("-inf"))
    return _heads_first(out), lse, None


def _sdpa_backward(q, k, v, merged, block, scale, aux):
    out, lse, dout = merged
    k_, v_, rep = _expand_kv(q, k, v)
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype)          # the kernels want a unit last stride
    args = [_heads_first(t) for t in (dout, q, k_, v_, out)] + [lse.float().contiguous()]
    if accelerator.on_gpu(q):
        seed, offset = aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            *args, None, None, q.shape[1], k.shape[1], 0.0, block.causal, seed, offset, scale=scale)
    else:
        is_causal, mask = _sdpa_cpu_args(q, k, block)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *args, 0.0, is_causal, attn_mask=mask, scale=scale)
    return _heads_first(dq), _fold_kv_grad(_heads_first(dk), rep), _fold_kv_grad(_heads_first(dv), rep)


# ----------------------------------------------------------------------------- flex

@functools.lru_cache(maxsize=1)
def _lse_kwargs() -> dict:
    """How this torch asks FlexAttention for the LSE (return_aux from 2.9, return_lse before)."""
    request = getattr(flex_module, "AuxRequest", None)
    return {"return_aux": request(lse=True)} if request is not None else {"return_lse": True}


def _flex_call(q_: Tensor, k_: Tensor, v_: Tensor, block_mask: Any, scale: float) -> tuple[Tensor, Tensor]:
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=q_.shape[1] != k_.shape[1], **_lse_kwargs())
    if accelerator.on_gpu(q_):
        out, extra = attention.kernels().compiled_flex()(q_, k_, v_, **kwargs)
    else:
        with warnings.catch_warnings():   # eager on CPU (forward only) is for tests
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, extra = flex_module.flex_attention(q_, k_, v_, **kwargs)
    return out, getattr(extra, "lse", extra)


def _flex_forward(q, k, v, block, scale):
    if not accelerator.on_gpu(q):
        q, k, v = q.detach(), k.detach(), v.detach()
    mask = block.flex_mask(q.shape[1], k.shape[1], q.device)
    out, lse = _flex_call(*(_heads_first(t) for t in (q, k, v)), mask, scale)
    return _heads_first(out), lse.float(), None


def _flex_backward(q, k, v, merged, block, scale, aux):
    """Re-run the block's forward (o_j, lse_j) and differentiate through both: with w = exp(lse_j - LSE),
    the merged O = sum_j w_j o_j gives dL/do_j = w dO and dL/dlse_j = w (rowsum(dO o_j) - rowsum(dO O))."""
    out, lse, dout = merged
    mask = block.flex_mask(q.shape[1], k.shape[1], q.device)
    with torch.enable_grad():
        q_, k_, v_ = (_heads_first(t).detach().requires_grad_() for t in (q, k, v))
        o, block_lse = _flex_call(q_, k_, v_, mask, scale)
        do, big_o = _heads_first(dout).float(), _heads_first(out).float()
        w = (block_lse.float() - lse.float()).exp()                       # (B, H, Sq); 0 where it is -inf
        d_o = (w[..., None] * do).to(o.dtype)
        d_l = w * ((do * o.float()).sum(-1) - (do * big_o).sum(-1))
        dq, dk, dv = torch.autograd.grad((o, block_lse), (q_, k_, v_), (d_o, d_l.to(block_lse.dtype)))
    return _heads_first(dq), _heads_first(dk), _heads_first(dv)


_FORWARD = {"reference": _reference_forward, "sdpa": _sdpa_forward, "flex": _flex_forward}
_BACKWARD = {"reference": _reference_backward, "sdpa": _sdpa_backward, "flex": _flex_backward}
LSE_BACKENDS = tuple(_FORWARD)


def block_attention(q: Tensor, k: Tensor, v: Tensor, block: AttentionBlock, backend: str,
                    scale: float) -> tuple[Tensor, Tensor, Any]:
    """(out (B, Sq, Hq, D), lse (B, Hq, Sq) fp32, aux) of one block; aux goes back to the backward.
    backend is a concrete name from LSE_BACKENDS (the plan chooses it: megalysses.plan.resolve)."""
    return _FORWARD[backend](q, k, v, block, scale)


def block_attention_backward(q: Tensor, k: Tensor, v: Tensor, merged: MergedRows, block: AttentionBlock,
                             backend: str, scale: float, aux: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, given the MERGED out and lse of the rows (the blocks' combined softmax) and
    the upstream gradient of that out; shapes as q, k, v."""
    return _BACKWARD[backend](q, k, v, merged, block, scale, aux)


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block into running fp32 (out (B, S, H, D), lse (B, H, S)) in place (online softmax):
    LSE' = logaddexp(LSE, lse_j), O' = exp(LSE - LSE') O + exp(lse_j - LSE') o_j. -inf rows stay exact."""
    new = torch.logaddexp(lse, block_lse.float())
    safe = _finite(new)
    w_old = (lse - safe).exp().transpose(1, 2)[..., None]                 # (B, S, H, 1)
    w_new = (block_lse.float() - safe).exp().transpose(1, 2)[..., None]
    out.mul_(w_old).add_(w_new * block_out.float())
    lse.copy_(new)
