"""Exact causal core attention over a full sequence: one dispatch point, four backends.

This is what every rank runs after the Ulysses all-to-all. Shapes: B batch, S full sequence, Hq query
heads, Hkv key/value heads (Hq % Hkv == 0; query head h reads KV head h // (Hq // Hkv), as in Hugging
Face's repeat_kv), D head dim.

    mask = prepare_attention_mask(doc_ids, backend)      # once per step, shared by every layer
    out = core_attention(q, k, v, mask=mask, backend=backend)

Backends:
    reference  matmul + softmax in fp32 with explicit masks; the ground truth, O(S^2) memory.
    sdpa       torch SDPA: is_causal without documents, a boolean (B, 1, S, S) mask with them.
    flex       FlexAttention with a BlockMask (compiled on CUDA; eager on CPU, forward only there:
               torch has no FlexAttention backward on CPU).
    flash      flash-attn (CUDA, fp16/bf16): flash_attn_func, or flash_attn_varlen_func on the
               packed documents (cu_seqlens: the data loader's, Documents, else from doc_ids).
    varlen     torch's variable-length attention (torch.nn.attention.varlen.varlen_attn, its flash kernel;
               CUDA, fp16/bf16): the packed documents as cumulative lengths, O(S) memory for the mask where
               FlexAttention's block mask is O((S/block)^2). torch raises on CPU.

Which backends can run a shape where is `unsupported_reason`'s answer; which one a run uses ("auto") is
decided once, by megalysses.plan.resolve, and every function here takes that concrete name.

Ring attention runs attention block by block and merges the blocks with their log-sum-exp; those
block kernels live in block_attention.py (unsupported_reason(..., ring=True) says which can run).

The kernels a GPU runs (SDPA's, flash-attn's, compiled FlexAttention and its block masks) and the optional
packages there are reached through one object, `kernels()` (GPUKernels), as megalysses.accelerator's Host is
for streams and pinned memory: a memory trace puts the forms of kernels/gpu_forms.py in its place
(`use_kernels`), and nothing here asks whether it is traced.

Document masks: doc_ids (B, S) ints, non-decreasing along each row; position i attends j iff j <= i
and doc_ids[b, i] == doc_ids[b, j]. A sliding window of W (window=W, model.sliding_window) also needs
i - j < W: each position attends to itself and the W - 1 before it, as Hugging Face's sliding_window.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from megalysses import accelerator
from megalysses.kernels.block_mask import MaskPattern, build_block_mask

try:
    from torch.nn.attention import flex_attention as flex_module
except Exception:   # torch < 2.5
    flex_module = None

# torch's variable-length attention, imported where it runs: its module imports torch's compiler stack
# (seconds that every process would pay at start-up)
_VARLEN = "torch.nn.attention.varlen"

try:
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except Exception:   # not installed, or built for another torch/CUDA
    flash_attn_func = flash_attn_varlen_func = None

BACKENDS = ("reference", "sdpa", "flex", "flash", "varlen")
_FLASH_WINDOW = flash_attn_func is not None and "window_size" in inspect.signature(flash_attn_func).parameters
_HALF = (torch.float16, torch.bfloat16)
DeviceLike = Union[torch.device, str]


def flex_available() -> bool:
    """Whether this torch has FlexAttention (torch >= 2.5)."""
    return flex_module is not None


def varlen_available() -> bool:
    """Whether this torch has variable-length attention (torch.nn.attention.varlen.varlen_attn), without
    importing it."""
    try:
        return importlib.util.find_spec(_VARLEN) is not None
    except ModuleNotFoundError:
        return False


@functools.cache
def _varlen_module() -> Any:
    return importlib.import_module(_VARLEN)


def _installed() -> frozenset:
    return frozenset({"flex"} if flex_available() else set()) | \
        frozenset({"varlen"} if varlen_available() else set()) | \
        frozenset({"flash_attn"} if flash_attn_func is not None else set())


def available_backends(device: DeviceLike = "cpu", packages: Optional[frozenset] = None) -> tuple[str, ...]:
    """Backends that exist for `device` with `packages` (a machine's optional packages, "flex" and "flash_attn"
    among them; default: this environment's); whether one can run a given shape is `unsupported_reason`'s
    question. flex on CPU is forward-only (torch has no FlexAttention backward there); flash needs CUDA."""
    packages = kernels().installed() if packages is None else packages
    on_cuda = torch.device(device).type == "cuda"
    names = ["reference", "sdpa"]
    if "flex" in packages:
        names.append("flex")
    if "flash_attn" in packages and on_cuda:
        names.append("flash")
    if "varlen" in packages and on_cuda:
        names.append("varlen")
    return tuple(names)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class AttentionNeeds:
    """What a call of attention asks of its backend: a backward (`training`), packed-document masks
    (`has_docs`), the blocks of ring attention (`ring`: each block's log-sum-exp and a backward against the
    merged one, kernels/block_attention.py), a sliding window (`window`: every backend masks it but SDPA's
    kernel for ring blocks on CUDA)."""

    training: bool = True
    has_docs: bool = False
    ring: bool = False
    window: bool = False


def unsupported_reason(backend: str, device: DeviceLike, dtype: torch.dtype, head_dim: Optional[int] = None,
                       needs: AttentionNeeds = AttentionNeeds(), packages: Optional[frozenset] = None) -> Optional[str]:
    """Why `backend` (a concrete name) cannot run attention of this head dim and dtype on `device` with
    `packages` (see available_backends), as `needs` asks; None when it can. head_dim None skips the shape
    rules."""
    training, has_docs, ring, window = needs.training, needs.has_docs, needs.ring, needs.window
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}"
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    here = available_backends(device, packages)
    if backend not in here:
        why = {"flex": "torch.nn.attention.flex_attention is missing (needs torch >= 2.5)",
               "flash": "it needs CUDA and an importable flash_attn package",
               "varlen": "it needs CUDA (torch's varlen_attn raises on a CPU) and torch.nn.attention.varlen "
                         "(torch >= 2.9)"}[backend]
        return f"is unavailable on {device.type}: {why}; available here: {', '.join(here)}"
    if backend == "flex":
        if not on_cuda and training:
            return ("has no backward on CPU (torch implements FlexAttention's backward for CUDA only); use "
                    "'sdpa' or 'reference' for training on CPU")
        if on_cuda and head_dim is not None and (head_dim < 16 or not _power_of_two(head_dim)):
            return f"needs a head dim that is a power of two >= 16 (compiled FlexAttention), got {head_dim}"
    if backend == "flash":
        if ring:
            return ("cannot run the blocks of ring attention: flash-attn's public functions give no backward "
                    "against the log-sum-exp merged over the blocks; use auto, sdpa, flex or reference")
        if dtype not in _HALF:
            return f"needs float16 or bfloat16 inputs, got {dtype}; use 'sdpa' or 'flex' for {dtype}"
        if head_dim is not None and (head_dim % 8 or head_dim > 256):
            return f"needs a head dim that is a multiple of 8 and at most 256, got {head_dim}"
        if window and kernels().flash_attn_func is not None and not _FLASH_WINDOW:   # (described machines: recent)
            return "masks no sliding window in this flash-attn release (window_size came in 2.3); use auto or flex"
    if backend == "varlen":
        if ring:
            return ("cannot run the blocks of ring attention: varlen_attn gives no backward against the "
                    "log-sum-exp merged over the blocks; use auto, sdpa, flex or reference")
        if dtype not in _HALF:
            return f"needs float16 or bfloat16 inputs (its flash kernel), got {dtype}; use 'sdpa' or 'flex'"
        if head_dim is not None and (head_dim % 8 or head_dim > 256):
            return f"needs a head dim that is a multiple of 8 and at most 256 (its flash kernel), got {head_dim}"
        if window and varlen_available() and "window_size" not in varlen_options():
            return "masks no sliding window in this torch's varlen_attn (it takes no window_size); use auto or flex"
    if backend == "sdpa" and ring and on_cuda:
        kernel = ("runs ring-attention blocks on CUDA with torch's flash kernel (the SDPA kernel that returns "
                  "the log-sum-exp)")
        if has_docs or window:
            what = "packed-document mask" if has_docs else "sliding-window mask"
            return f"{kernel}, which takes no {what}; use flex (auto picks it) or reference"
        if dtype not in _HALF:
            return f"{kernel}, which takes float16 or bfloat16 only, got {dtype}; use flex or reference"
        if head_dim is not None and (head_dim % 8 or head_dim > 256):
            return f"{kernel}, which needs a head dim that is a multiple of 8 and at most 256, got {head_dim}"
    return None


def doc_ids_to_cu_seqlens(doc_ids: Tensor) -> Tensor:
    """Cumulative document lengths over the flattened batch, as flash-attn's varlen functions want.

    doc_ids: (B, S) or (S,) -> int32 (num_docs + 1,), starting at 0 and ending at B*S. A document ends
    where the id changes and at the end of every row (documents never span rows)."""
    ids = doc_ids.reshape(-1, doc_ids.shape[-1])                         # (B, S)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    offsets = starts.flatten().nonzero().flatten()                        # first position of each document
    end = offsets.new_full((1,), ids.numel())
    return torch.cat([offsets, end]).to(torch.int32)


@dataclass(frozen=True)
class Documents:
    """The packed documents of a micro-batch with the boundaries the data loader computed on the host
    (megalysses/data/loader.py), so that a variable-length kernel reads nothing back from the device: the
    document id of every position, the cumulative lengths over the flattened batch (doc_ids_to_cu_seqlens's,
    where `ids` are) and each row's longest document (in host memory: the kernel's max_seqlen)."""

    ids: Tensor                   # (B, S) int
    cu_seqlens: Tensor            # int32 (num_docs + 1,)
    longest: Tensor               # (B,) int, in host memory


def documents_of(batch: Mapping[str, Tensor]) -> Optional[Tensor | Documents]:
    """What a micro-batch gives the model as its doc_ids: its Documents when the loader gave their boundaries
    (cu_seqlens, longest_document), else its doc_ids alone (None without packed-document masks)."""
    if "doc_ids" not in batch or "cu_seqlens" not in batch:
        return batch.get("doc_ids")
    return Documents(batch["doc_ids"], batch["cu_seqlens"], batch["longest_document"])


def document_ids(doc_ids: Optional[Tensor | Documents]) -> Optional[Tensor]:
    """The (B, S) document ids of a model's doc_ids argument (a tensor, or Documents)."""
    return doc_ids.ids if isinstance(doc_ids, Documents) else doc_ids


class AttentionMask:
    """The packed-document causal mask of one step, in whichever form each backend wants.

    Built once per step by `prepare_attention_mask` and handed to every layer; each form (dense boolean
    mask, FlexAttention BlockMask of `block`-token blocks, cumulative lengths) is computed on first use and
    then reused. The BlockMask holds four int32 (S/block)^2 index tensors: the run plan's block keeps them
    small beside the peak (plan/run_plan.py mask_block). `documents`, when given (the loader's boundaries
    of these doc_ids), is the cumulative lengths' form as it is, read back from the device never."""

    def __init__(self, doc_ids: Tensor, block: int = 128, documents: Optional[Documents] = None) -> None:
        self.doc_ids = doc_ids                                            # (B, S) int
        self.block = block
        self._forms: dict[str, Any] = {}
        self._documents = documents

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.doc_ids.shape)

    def _cached(self, name: Any, build: Callable[[], Any]) -> Any:
        if name not in self._forms:
            with torch.no_grad():
                self._forms[name] = build()
        return self._forms[name]

    def dense(self, window: int = 0) -> Tensor:
        """(B, 1, S, S) bool, True where attention is allowed (causal, same document, inside the window)."""
        def build() -> Tensor:
            S = self.doc_ids.shape[1]
            same_doc = self.doc_ids[:, :, None] == self.doc_ids[:, None, :]     # (B, S, S)
            return (same_doc & causal_dense(S, self.doc_ids.device, window))[:, None]
        return self._cached(("dense", window) if window else "dense", build)

    def block_mask(self, window: int = 0) -> Any:
        """FlexAttention BlockMask of shape (B, 1, S, S), built from the documents' boundaries per block
        (kernels/block_mask.py)."""
        def build() -> Any:
            docs = self.doc_ids
            pattern = MaskPattern(causal=True, q_docs=docs, k_docs=docs, window=window)
            return kernels().build_block_mask(pattern, docs.shape[1], docs.shape[1], self.block, docs.device)
        return self._cached(("block_mask", window) if window else "block_mask", build)

    def varlen(self) -> tuple[Tensor, int]:
        """(cu_seqlens int32 (num_docs + 1,), max document length) over the flattened batch: the loader's, or
        computed from the ids (nonzero and the longest length read back: two waits for the device)."""
        def build() -> tuple[Tensor, int]:
            if self._documents is not None:       # the longest length in host memory: no wait
                return self._documents.cu_seqlens.to(self.doc_ids.device), max(self._documents.longest.tolist())
            cu = doc_ids_to_cu_seqlens(self.doc_ids)
            return cu, int((cu[1:] - cu[:-1]).max())
        return self._cached("varlen", build)

    def build_for(self, backend: str, window: int = 0) -> "AttentionMask":
        """Compute now the form `backend` (a concrete name) uses; returns self."""
        if backend in ("flash", "varlen"):
            self.varlen()
        elif backend in ("sdpa", "flex"):
            (self.dense if backend == "sdpa" else self.block_mask)(window)
        return self


def prepare_attention_mask(doc_ids: Optional[Tensor | Documents], backend: str, seq_len: Optional[int] = None,
                           device: Optional[DeviceLike] = None, window: int = 0, block: int = 128,
                           check: bool = True) -> Optional[AttentionMask]:
    """The document mask for one step, to pass as `mask=` to every layer's `core_attention`.

    doc_ids: (B, S) ints, non-decreasing per row, or None (plain causal: returns None), or the loader's
    Documents (their cumulative lengths and longest length used as they are: no read back). seq_len, when
    given, is checked against S; device, when given, is where the mask lives (default: doc_ids'); block:
    FlexAttention's block-mask block size. The form that `backend` (the run's concrete backend) uses with
    the layers' sliding `window` is built now; any other on first use. `check`: refuse doc ids that decrease
    (reading the answer back to the host); the model's forward leaves it to the loader, whose ids are
    cumulative sums, so that a training step does not wait for it."""
    if doc_ids is None:
        return None
    documents = doc_ids if isinstance(doc_ids, Documents) else None
    doc_ids = document_ids(doc_ids)
    if doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be a (B, S) integer tensor, got {tuple(doc_ids.shape)} {doc_ids.dtype}")
    if seq_len is not None and doc_ids.shape[1] != seq_len:
        raise ValueError(f"doc_ids cover {doc_ids.shape[1]} positions but the sequence has {seq_len}")
    if device is not None:
        doc_ids = doc_ids.to(device)
    if check and doc_ids.shape[1] > 1 and bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
        raise ValueError("doc_ids must be non-decreasing along each row (one id per packed document)")
    return AttentionMask(doc_ids, block, documents).build_for(backend, window)


def core_attention(q: Tensor, k: Tensor, v: Tensor, doc_ids: Optional[Tensor] = None, backend: str = "sdpa",
                   scale: Optional[float] = None, *, mask: Optional[AttentionMask] = None, window: int = 0) -> Tensor:
    """Exact causal (optionally document-masked) attention; differentiable in q, k and v.

    q: (B, S, Hq, D); k, v: (B, S, Hkv, D), Hq % Hkv == 0 -> (B, S, Hq, D) in q's dtype.
    doc_ids: (B, S) document ids (builds a mask for this call only), or mask: a prepared AttentionMask
    (build it once per step); at most one of them. scale defaults to 1/sqrt(D). window > 0: each
    position attends to itself and the window - 1 positions before it only."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"expected q (B, S, Hq, D) and k, v (B, S, Hkv, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of kv heads {k.shape[2]}")
    if doc_ids is not None:
        if mask is not None:
            raise ValueError("pass doc_ids or mask, not both")
        mask = prepare_attention_mask(doc_ids, "reference", device=q.device)
    if mask is not None and mask.shape != tuple(q.shape[:2]):
        raise ValueError(f"mask is for (B, S) = {mask.shape} but q has {tuple(q.shape[:2])}")
    if mask is not None and mask.doc_ids.device != q.device:
        raise ValueError(f"mask is on {mask.doc_ids.device} but q is on {q.device}: "
                         f"prepare_attention_mask(..., device=q.device)")
    if window < 0:
        raise ValueError(f"window={window}: give the sliding window's length, or 0 for none")
    check_backend(backend, q, mask is not None, window=window > 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _BACKEND_FNS[backend](q, k, v, mask, scale, window)


def check_backend(backend: str, q: Tensor, has_docs: bool, ring: bool = False, window: bool = False) -> None:
    """Refuse a backend that cannot run this call (the plan chose it for the run; a direct call may not
    have): ValueError for a name that is not a concrete backend, RuntimeError saying why one cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: give a concrete backend, one of "
                         f"{', '.join(BACKENDS)} (megalysses.plan.resolve decides what auto is)")
    training = torch.is_grad_enabled() and q.requires_grad
    device = torch.device("cuda") if accelerator.on_gpu(q) else q.device
    why = unsupported_reason(backend, device, q.dtype, q.shape[-1], AttentionNeeds(training, has_docs, ring, window))
    if why is not None:
        raise RuntimeError(f"attention backend {backend!r} {why}")


# ---------------------------------------------------------------------------------------------------
# backends: (q (B,S,Hq,D), k, v (B,S,Hkv,D), mask or None, scale, window) -> (B,S,Hq,D)

def _causal(q_idx: Any, kv_idx: Any, window: int) -> Any:
    """Whether query index q_idx may attend key index kv_idx: causal, and inside a window (0 = none)."""
    allowed = kv_idx <= q_idx
    return allowed & (q_idx - kv_idx < window) if window else allowed


def causal_dense(S: int, device: torch.device, window: int = 0) -> Tensor:
    """(S, S) bool: the causal (sliding-window) pairs of S positions."""
    idx = torch.arange(S, device=device)
    return _causal(idx[:, None], idx[None, :], window)


@functools.lru_cache(maxsize=2)
def window_dense(S: int, device: torch.device, window: int) -> Tensor:
    """causal_dense with a window, cached: SDPA's mask without documents, shared by the layers of a step."""
    return causal_dense(S, device, window)


def _repeat_kv(x: Tensor, rep: int) -> Tensor:
    """(B, S, Hkv, D) -> (B, S, Hkv*rep, D), head h of the result = head h // rep of x."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=2)


def _reference(q: Tensor, k: Tensor, v: Tensor, mask: Optional[AttentionMask], scale: float, window: int) -> Tensor:
    rep = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)                                        # (B, Hq, S, D)
    kf = _repeat_kv(k, rep).float().transpose(1, 2)
    vf = _repeat_kv(v, rep).float().transpose(1, 2)
    S = q.shape[1]
    allowed = causal_dense(S, q.device, window)                           # (S, S) causal
    if mask is not None:
        docs = mask.doc_ids
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])   # (B, 1, S, S)
    scores = (qf @ kf.transpose(-1, -2)) * scale                          # (B, Hq, S, S)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (probs @ vf).transpose(1, 2).to(q.dtype)                       # (B, S, Hq, D)


_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[AttentionMask], scale: float, window: int) -> Tensor:
    rep = q.shape[2] // k.shape[2]
    attn_mask = mask.dense(window) if mask is not None else None          # (B, 1, S, S) bool
    if attn_mask is None and window:
        attn_mask = window_dense(q.shape[1], q.device, window)            # (S, S)
    # native GQA only where SDPA's flash kernel takes it (CUDA, half precision, no mask); elsewhere
    # enable_gqa would fall back to the O(S^2)-memory math kernel, so expand the kv heads instead
    native_gqa = rep > 1 and _SDPA_HAS_GQA and accelerator.on_gpu(q) and q.dtype in _HALF and attn_mask is None
    if not native_gqa:
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))                   # (B, H, S, D)
    kwargs = {"enable_gqa": True} if native_gqa else {}
    out = kernels().sdpa(q_, k_, v_, attn_mask=attn_mask, is_causal=attn_mask is None, scale=scale, **kwargs)
    return out.transpose(1, 2)                                            # (B, S, Hq, D)


@functools.lru_cache(maxsize=8)
def causal_block_mask(S: int, device: torch.device, window: int = 0) -> Any:
    """The plain causal (sliding-window) BlockMask of S positions in 128-token blocks (cached)."""
    return kernels().build_block_mask(MaskPattern(causal=True, window=window), S, S, device=device)


@functools.lru_cache(maxsize=1)
def compiled_flex() -> Callable:
    """torch.compile'd flex_attention (static shapes), the fused kernel on CUDA."""
    return torch.compile(flex_module.flex_attention, dynamic=False)


def reserve_compiles(count: int) -> int:
    """Let torch.compile keep `count` specialisations of one function. Compiled FlexAttention (and its
    block masks) specialise on every shape and grad mode; past dynamo's limit (8 by default) a new shape
    would silently run FlexAttention's unfused eager path, which materialises the (S, S) scores. Never
    lowers a higher limit already set; returns the limit in force."""
    import torch._dynamo

    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), count))
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * count)
    return getattr(dynamo, name)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: Optional[AttentionMask], scale: float, window: int) -> Tensor:
    gpu = accelerator.on_gpu(q)
    if not gpu:         # forward only (the plan refuses training): torch refuses inputs requiring grad
        q, k, v = q.detach(), k.detach(), v.detach()
    block_mask = mask.block_mask(window) if mask is not None else \
        kernels().causal_block_mask(q.shape[1], q.device, window)
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))                   # (B, H, S, D)
    gqa = q.shape[2] != k.shape[2]
    if gpu:
        out = kernels().compiled_flex()(q_, k_, v_, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    else:
        with warnings.catch_warnings():   # eager on CPU is for tests; torch warns that it is unfused
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_module.flex_attention(q_, k_, v_, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)                                            # (B, S, Hq, D)


def _flash(q: Tensor, k: Tensor, v: Tensor, mask: Optional[AttentionMask], scale: float, window: int) -> Tensor:
    sliding = {"window_size": (window - 1, 0)} if window else {}         # keys i - (window - 1) .. i
    if mask is None:
        return kernels().flash_attn_func(q, k, v, softmax_scale=scale, causal=True, **sliding)  # GQA native
    B, S, Hq, D = q.shape
    cu_seqlens, max_len = mask.varlen()
    out = kernels().flash_attn_varlen_func(q.reshape(B * S, Hq, D), k.reshape(B * S, -1, D),
                                           v.reshape(B * S, -1, D), cu_seqlens, cu_seqlens, max_len, max_len,
                                           softmax_scale=scale, causal=True, **sliding)
    return out.view(B, S, Hq, D)


@functools.lru_cache(maxsize=1)
def varlen_options() -> frozenset:
    """What this torch's varlen_attn takes beyond q, k, v and the lengths: "is_causal" (torch 2.9, 2.10) or a
    causal "window_size" (later), "scale", "enable_gqa" (native grouped-query attention, torch >= 2.12)."""
    if not varlen_available():
        return frozenset()
    return frozenset(inspect.signature(_varlen_module().varlen_attn).parameters)


def varlen_native_gqa() -> bool:
    """Whether varlen_attn reads grouped KV heads as they are (else they are repeated to the query heads)."""
    return "enable_gqa" in varlen_options()


def _varlen(q: Tensor, k: Tensor, v: Tensor, mask: Optional[AttentionMask], scale: float, window: int) -> Tensor:
    B, S, Hq, D = q.shape
    if mask is not None:
        cu_seqlens, max_len = mask.varlen()
    else:          # plain causal: each row one sequence
        cu_seqlens, max_len = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device), S
    options, kwargs = varlen_options(), {}
    if q.shape[2] != k.shape[2]:
        if "enable_gqa" in options:
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, Hq // k.shape[2]), _repeat_kv(v, Hq // k.shape[2])
    # causal: keys up to the query; a sliding window: keys i - (window - 1) .. i
    kwargs.update({"is_causal": True} if "is_causal" in options else {"window_size": (window - 1 if window else -1, 0)})
    if "scale" in options:
        kwargs["scale"] = scale
    elif scale != 1.0 / math.sqrt(D):          # the default scale is 1/sqrt(D): fold another into q
        q = q * (scale * math.sqrt(D))
    out = _varlen_module().varlen_attn(q.reshape(B * S, Hq, D), k.reshape(B * S, -1, D), v.reshape(B * S, -1, D),
                                    cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)
    return out.view(B, S, Hq, D)


_BACKEND_FNS: dict[str, Callable[..., Tensor]] = {"reference": _reference, "sdpa": _sdpa, "flex": _flex,
                                                  "flash": _flash, "varlen": _varlen}


@dataclass(frozen=True)
class GPUKernels:
    """The kernels attention runs on a GPU, and the optional packages there: what `kernels()` gives the backends
    above (class defaults: the real ones), what a memory trace replaces (kernels/gpu_forms.py, with
    `use_kernels`).

        sdpa(q, k, v, attn_mask=, is_causal=, scale=[, enable_gqa=]) -> out    the sdpa backend's kernel
        flash_attn_func, flash_attn_varlen_func                                 flash-attn's (None: not installed)
        compiled_flex() -> flex_attention                                       FlexAttention compiled for the GPU
        causal_block_mask(S, device, window) -> BlockMask                       the plain causal one
        build_block_mask(pattern, sq, sk, block, device) -> BlockMask           kernels/block_mask.py's
        installed() -> frozenset                                                the optional packages there
    """

    sdpa: Callable[..., Tensor] = F.scaled_dot_product_attention
    flash_attn_func: Optional[Callable[..., Tensor]] = flash_attn_func
    flash_attn_varlen_func: Optional[Callable[..., Tensor]] = flash_attn_varlen_func
    compiled_flex: Callable[[], Callable] = compiled_flex
    causal_block_mask: Callable[..., Any] = causal_block_mask
    build_block_mask: Callable[..., Any] = build_block_mask
    installed: Callable[[], frozenset] = _installed


_KERNELS = accelerator.Replaceable(GPUKernels())


def kernels() -> GPUKernels:
    """The GPU kernels in use: the real ones unless `use_kernels` put others in their place."""
    return _KERNELS.current()


def use_kernels(replacement: GPUKernels) -> ContextManager[GPUKernels]:
    """Run the block with `replacement` in place of the GPU kernels in use (a trace's forms), then restore them."""
    return _KERNELS.use(replacement)
