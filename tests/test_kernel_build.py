"""Our Triton kernels compile for CUDA GPUs (sm_90: H100/H200, sm_80: A100) at the launches a training step
of the 1B and 8B configs makes, without spilling registers or overflowing shared memory: the Triton
compiler and ptxas run here, no GPU needed (benchmarks/kernel_build.py, megalysses.tools.triton_build)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megalysses.kernels.triton_support import triton_importable

ROOT = Path(__file__).resolve().parents[1]


def nvidia_backend() -> bool:
    if not triton_importable():
        return False
    try:
        import triton
        return os.path.exists(triton.knobs.nvidia.ptxas.path) and os.path.exists(triton.knobs.nvidia.cuobjdump.path)
    except Exception:  # noqa: BLE001 - a Triton without the NVIDIA backend or its tools
        return False


def test_kernels_build_for_hopper_and_ampere_at_model_shapes(tmp_path):
    if not nvidia_backend():
        pytest.skip("needs triton with its NVIDIA backend (ptxas, cuobjdump): pip install triton on Linux x86-64")
    out = tmp_path / "builds.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/kernel_build.py"), "--out-dir", str(tmp_path),
                           "--name", "builds"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    # every kernel we launch was recorded and built, for both configs and both targets (the kernel modules
    # are imported by the script, not here: this process's tests run them under the CPU interpreter)
    launched = set(result["info"]["launched"])
    assert len(launched) == 6, launched
    for config in ("gpt_1b_1m_offload.yaml", "llama3_8b_128k.yaml"):
        for arch in (80, 90):
            built = {r["kernel"] for r in rows if r["config"] == config and r["arch"] == arch and "error" not in r}
            assert built == launched, (config, arch, launched - built)
    # the launches were planned as on the GPU, not as for the CPU interpreter (which takes larger blocks)
    assert {r["blocks"]["BLOCK"] for r in rows if r["kernel"].startswith("_swiglu")} == {1024}
    assert all(r["spill_bytes"] == 0 and r["shared_fits"] for r in rows)
