"""FLOPs per trained token and the peak dense FLOP/s of known GPUs: what MFU is measured against.

FLOPs per trained token (forward + backward = 3x forward, matmuls at 2 FLOPs per multiply-add):
    6 * N_matmul                      every weight matmul: q, k, v, o, MLP, LM head (not the embedding lookup)
  + 12 * L * Hq * D * C               attention scores and the weighted sum (2 matmuls x 2 FLOPs x C x 3),
                                      C the keys a query attends on average: S/2 causal over the full
                                      sequence S, W - W^2/(2S) with a sliding window W < S (attended_keys);
                                      document masks do less work than this, so MFU is an upper bound there.
                                      S is the length each step trains at (data.seq_len_schedule).
                                      The attention width Hq * D need not be the hidden size (model.head_dim).
MFU = achieved FLOP/s per device / the device's peak dense FLOP/s (bf16 on GPU).
"""
from __future__ import annotations

from typing import Optional

from megalysses.config import ModelConfig

# peak dense bf16 TFLOP/s by device name fragment, the first that the name contains (variants before
# their family: "NVIDIA H100 PCIe" is not the SXM part that "NVIDIA H100 80GB HBM3" names)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.0, "H100": 989.0, "H800": 989.0,
               "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "B200": 2250.0, "MI300X": 1307.0}


def matmul_params(m: ModelConfig) -> int:
    attn = m.hidden_size * m.head_size * (2 * m.num_heads + 2 * m.kv_heads)
    mlp = (3 if m.mlp == "swiglu" else 2) * m.hidden_size * m.ffn_size
    return m.num_layers * (attn + mlp) + m.hidden_size * m.vocab_size


def attended_keys(seq_len: int, window: int = 0) -> float:
    """The keys a query attends on average over a causal sequence of seq_len (continuously: S/2), with a
    sliding window of `window` positions (0: none): W - W^2 / (2S) when W < S."""
    if not window or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    context = attended_keys(seq_len, m.sliding_window)
    return 6.0 * matmul_params(m) + 12.0 * m.num_layers * m.num_heads * m.head_size * context


def peak_tflops(configured: float, gpu: Optional[str], dtype: str = "bfloat16") -> Optional[float]:
    """logging.peak_tflops when set; else the bf16 dense peak of a known `gpu` for bf16 compute; else None
    (no MFU is given rather than one against the wrong peak)."""
    if configured > 0:
        return configured
    if gpu is None or dtype != "bfloat16":
        return None
    return next((value for key, value in PEAK_TFLOPS.items() if key in gpu), None)
