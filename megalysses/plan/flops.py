"""FLOPs per trained token and the peak dense FLOP/s of known GPUs: what MFU is measured against.

FLOPs per trained token (forward + backward = 3x forward, matmuls at 2 FLOPs per multiply-add):
    6 * N_matmul                      every weight matmul: q, k, v, o, MLP, LM head (not the embedding lookup)
  + 6 * L * Hq * D * S                attention scores and the weighted sum, causal over the full
                                      sequence S (2 matmuls x 2 FLOPs x S/2 average context x 3);
                                      document masks do less work than this, so MFU is an upper bound there.
                                      S is the length each step trains at (data.seq_len_schedule).
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
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.kv_heads)
    mlp = (3 if m.mlp == "swiglu" else 2) * m.hidden_size * m.ffn_size
    return m.num_layers * (attn + mlp) + m.hidden_size * m.vocab_size


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    return 6.0 * matmul_params(m) + 6.0 * m.num_layers * m.num_heads * m.head_dim * seq_len


def peak_tflops(configured: float, gpu: Optional[str], dtype: str = "bfloat16") -> Optional[float]:
    """logging.peak_tflops when set; else the bf16 dense peak of a known `gpu` for bf16 compute; else None
    (no MFU is given rather than one against the wrong peak)."""
    if configured > 0:
        return configured
    if gpu is None or dtype != "bfloat16":
        return None
    return next((value for key, value in PEAK_TFLOPS.items() if key in gpu), None)
