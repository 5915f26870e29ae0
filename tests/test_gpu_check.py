"""benchmarks/gpu_check.py keeps working between GPU windows: --smoke runs every stage end to end at a tiny shape
on CPU, and the parts a GPU run leans on (the stage runner's bounds, the history of the results file, the
three-way's order and fallbacks, pytest's output, the liger wheel) are checked here on their own."""
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import bench_gpu, gpu_check, gpu_check_memory, gpu_check_profile, gpu_check_stages
from benchmarks.harness import RESULTS, run_bounded

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(460)
def test_smoke_runs_every_stage_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    before = sorted(os.listdir(RESULTS))
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}             # on CPU, even where a GPU is visible
    # every stage must run: a budget above the smoke's own (gpu_check.SMOKE_BUDGET_S, for a quiet machine), so that
    # a loaded machine running other tests beside this one does not end it before the last stage
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--budget", "420",
                           "--out-dir", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=450)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(os.listdir(RESULTS)) == before                      # nothing beside the recorded results
    assert sorted(os.listdir(out)) == ["gpu_smoke.json", "gpu_smoke.log", "gpu_smoke.md"]
    run = json.loads((out / "gpu_smoke.json").read_text())["runs"][0]
    stages = run["stages"]
    assert list(stages) == [s.name for s in gpu_check.STAGES]
    assert {name: s["status"] for name, s in stages.items()} == {s.name: "ran" for s in gpu_check.STAGES}, stages
    env = stages["env"]["info"]
    assert env["torch"] and env["auto"]["no documents"]["attention"] == "sdpa"
    assert all(r["tests"] >= 1 for r in stages["tests"]["rows"]), stages["tests"]["rows"]
    rows = stages["three_way"]["rows"]
    assert {(r["framework"], r["for"]) for r in rows} == {(fw, p) for fw in ("megalysses", "transformers")
                                                          for p in ("speed", "memory")}
    assert all(r["fits"] and r["tokens_per_s"] > 0 for r in rows), rows
    assert stages["three_way"]["not_available"]["liger"]                # recorded, not run
    assert stages["three_way"]["comparison"][0]["speed_vs_transformers"] > 0
    for r in stages["probe"]["rows"] + stages["full_steps"]["rows"]:
        assert abs(r["error"]) <= gpu_check_memory.TARGET_ERROR, r
        assert r["full_predicted_gib" if "layers" in r else "tokens_per_s"] > 0, r
    ours = [r for r in rows if r["framework"] == "megalysses"]
    for r in stages["probe"]["rows"] + stages["full_steps"]["rows"] + ours:
        # the CUDA figures do not exist on CPU: recorded as absent, and nothing to judge
        for key in ("max_allocated_gib", "max_reserved_gib", "used_gib", "device_total_gib", "context_gib",
                    "fragmentation_gib", "cap_gib", "cap_applied"):
            assert key in r and r[key] is None, (key, r)
        assert r["verdicts"] == [] and r["plan_fits"] is True, r
        assert r["predicted_gib"] > 0 and r["traced_peak_gib"] > 0 and r["usable_gib"] > 0, r
        assert r["reserve_guess_gib"] > 0 and r["allowance_guess_gib"] > 0 and r["nccl_per_peer_mib"] > 0, r
        assert r["predicted_breakdown"]["compute"] > 0 and r["traced_step_breakdown"]["compute"] > 0, r
        assert r["predicted_step_s"] > 0 and r["traced_step_s"] > 0 and r["step_s"] > 0, r
    assert [r["seq_len"] for r in stages["full_steps"]["rows"]] == list(gpu_check_memory.SMOKE_FULL_LENGTHS)
    groups = {c["category"] for c in stages["profile"]["categories"]}
    assert {"GEMM", "attention"} <= groups, groups
    assert stages["profile"]["predicted_breakdown"]["compute"] > 0 and stages["profile"]["traced_step_s"] > 0
    md = (out / "gpu_smoke.md").read_text()
    assert md.count(gpu_check.MARKER) == 1 and md.index(gpu_check.MARKER) < md.index("## ")
    for number, stage in enumerate(gpu_check.STAGES, 1):
        assert f"### {number}. {stage.title}" in md
    assert md.count("| used - reserved (reserve + communicators guessed) |") == 3        # three-way, probe, full
    assert md.count("| tokens | step s | model s | model by category | traced s | traced by category |") == 3
    assert "| GEMM | " in md and "| group | measured ms | model: category, ms | trace: ms |" in md


def _stage(name, run, cap=10.0):
    return gpu_check.Stage(name, name.title(), cap, cap, run, lambda r: [f"rendered {name}"])


def test_a_stage_that_fails_or_overruns_is_recorded_and_the_next_one_runs(tmp_path):
    def boom(check, until):
        raise RuntimeError("a broken stage")

    def hangs(check, until):                  # a child that would hang: killed at the stage's bound
        done = run_bounded([sys.executable, "-c", "import time; time.sleep(60)"], until - time.monotonic())
        return gpu_check_stages.failure(done)

    def slow(check, until):
        time.sleep(2.0)
        return {"status": "ran", "rows": [1]}
    stages = (_stage("boom", boom), _stage("hangs", hangs, cap=1.5), _stage("slow", slow), _stage("late", slow),
              _stage("skipped", slow))
    check = gpu_check.Check(smoke=True, budget_s=6.0, out=tmp_path, work=tmp_path, command="gpu_check.py --smoke",
                            stages=stages)
    start = time.monotonic()
    gpu_check.run_stages(check, {"boom", "hangs", "slow", "late"})
    assert time.monotonic() - start < 10
    status = {name: r["status"] for name, r in check.results.items()}
    assert status == {"boom": "failed", "hangs": "timed out", "slow": "ran", "late": "not run"}, check.results
    assert "RuntimeError: a broken stage" in check.results["boom"]["why"]
    assert check.results["hangs"]["bound_s"] == 1.5 and check.results["late"]["why"].startswith("the budget ended")
    md = (tmp_path / "gpu_smoke.md").read_text()
    assert "| 2. hangs | timed out |" in md and "rendered slow" in md and "skipped" not in md
    assert "a broken stage" in (tmp_path / "gpu_smoke.log").read_text()       # the traceback, for diagnosis


def _check(out, date, **results):
    check = gpu_check.Check(smoke=True, budget_s=10.0, out=out, work=out, command="gpu_check.py --smoke", date=date,
                            stages=(_stage("one", None),))
    check.results = {"one": {"status": "ran", **results}}
    return check


def test_results_keep_the_history_newest_first(tmp_path, monkeypatch):
    """The first run into an --out-dir starts from the tracked file (benchmarks/results/), later runs into the
    same folder from the folder's own; copied back, the file holds every run, newest on top."""
    tracked, out = tmp_path / "results", tmp_path / "out"
    tracked.mkdir()
    (tracked / "gpu_smoke.md").write_text(f"# GPU check: old title\n\n{gpu_check.MARKER}\n\n## the tracked run\n")
    (tracked / "gpu_smoke.json").write_text(json.dumps({"runs": [{"date": "tracked"}]}))
    monkeypatch.setattr(gpu_check, "RESULTS", tracked)
    first = _check(out, "first")
    first.save()
    first.save()                                               # saved after every stage: the history is read once
    gpu_check.write_results(_check(out, "second", rows=[2]))
    md = (out / "gpu_smoke.md").read_text()
    assert md.count("# GPU check:") == 1 and md.count(gpu_check.MARKER) == 1 and "old title" not in md
    assert md.index("## second") < md.index("## first") < md.index("## the tracked run")
    assert md.count("## first") == 1
    assert [r["date"] for r in json.loads((out / "gpu_smoke.json").read_text())["runs"]] == ["second", "first",
                                                                                            "tracked"]
    rerun = _check(out, "a rerun of some stages")
    rerun.results = {}
    assert rerun.latest("one")["rows"] == [2]           # a stage not run again: the newest earlier result of it
    (tracked / "gpu_smoke.md").write_text("notes written by hand\n")          # no marker: all of it kept below
    for name in ("gpu_smoke.md", "gpu_smoke.json"):          # a fresh --out-dir
        (out / name).unlink()
    gpu_check.write_results(_check(out, "third"))
    md = (out / "gpu_smoke.md").read_text()
    assert md.index("## third") < md.index("notes written by hand")


class FakeChild:
    """bench_gpu.run_child stand-in: liger out of memory without checkpointing, transformers broken at 32K."""

    def __init__(self):
        self.calls = []

    def __call__(self, fw, seq, opts, smoke, steps, warmup, timeout, log=None):
        self.calls.append((fw, seq, json.dumps(opts, sort_keys=True)))
        row = {"framework": fw, "seq_len": seq, "options": opts}
        if fw == "liger" and not opts.get("ckpt"):
            return {**row, "fits": False}
        if fw == "transformers" and seq == 32768:
            return {**row, "fits": None, "error": "RuntimeError: CUDA error"}
        speed = {"megalysses": 120.0, "liger": 100.0, "transformers": 80.0}[fw]
        peak = 30.0 if fw == "megalysses" else 40.0
        return {**row, "fits": True, "tokens_per_s": speed, "mfu": 0.4, "peak_gib": peak, "settings": "s"}


def test_three_way_order_fallbacks_and_comparison(monkeypatch):
    """Speed at both lengths first (fastest settings first, the next on out of memory), then memory with
    checkpointing; a checkpointed speed row is the memory row too; a peer that fails is a row and the rest go on."""
    fake = FakeChild()
    monkeypatch.setattr(bench_gpu, "run_child", fake)
    monkeypatch.setattr(bench_gpu, "available", lambda fw: None)
    monkeypatch.setattr(gpu_check_stages, "_settings", lambda fw, smoke, cuda: [{}, {"ckpt": True}])
    check = SimpleNamespace(smoke=False, has_gpu=True, note=lambda *a: None, partial=lambda r: None, results={})
    result = gpu_check_stages.three_way(check, time.monotonic() + 60)
    assert result["status"] == "ran"
    assert [c[:2] for c in fake.calls[:8]] == [("megalysses", 16384), ("liger", 16384), ("liger", 16384),
                                      ("transformers", 16384), ("megalysses", 32768), ("liger", 32768),
                                      ("liger", 32768), ("transformers", 32768)]
    memory = fake.calls[8:]                    # liger's fastest was checkpointing: no second run of it
    assert [c[:2] for c in memory] == [("megalysses", 16384), ("transformers", 16384), ("megalysses", 32768),
                                       ("transformers", 32768)] and all('"ckpt": true' in c[2] for c in memory)
    liger = [r for r in result["rows"] if r["framework"] == "liger"]
    assert [r["for"] for r in liger] == ["speed, memory", "speed, memory"]
    c16, c32 = result["comparison"]
    assert c16["speed_vs_liger"] == pytest.approx(1.2) and c16["peak_vs_liger"] == pytest.approx(0.75)
    assert c32["speed_vs_transformers"] is None and c32["speed_vs_liger"] == pytest.approx(1.2)
    assert any("CUDA error" in line for line in gpu_check_stages.render_three_way(result))
    monkeypatch.setattr(bench_gpu, "run_child", lambda fw, *a, **k: {"framework": fw, "seq_len": a[0],
                                                                      "options": a[1], "fits": None, "error": "boom"})
    assert gpu_check_stages.three_way(check, time.monotonic() + 60)["status"] == "failed"   # megalysses broke


PYTEST_V = """\
collected 146 items / 94 deselected / 52 selected

tests/test_gpu.py::test_two_ranks_on_one_gpu_keep_every_tensor_on_it PASSED [ 10%]
tests/test_gpu.py::test_bf16_training_tracks_fp32 PASSED [ 20%]
tests/test_gpu.py::test_bf16_training_tracks_fp32 ERROR [ 20%]
tests/test_kernels.py::test_swiglu_triton_matches_torch[dtype0] FAILED [ 30%]
tests/test_kernels.py::test_library_kernels_match_torch[apex] SKIPPED (apex needs its package) [ 40%]
tests/test_attention_backends.py::test_backend_output_matches_reference[flex-4-1-causal-cuda] PASSED [ 50%]
=========================== short test summary info ============================
FAILED tests/test_kernels.py::test_swiglu_triton_matches_torch[dtype0] - AssertionError: Tensor-likes are not close!
ERROR tests/test_gpu.py::test_bf16_training_tracks_fp32 - RuntimeError: teardown
=== 2 failed, 2 passed, 1 skipped, 94 deselected in 50.1s ===
"""


def test_pytest_output_is_counted_per_item():
    """-v lines per item of the subset; a teardown ERROR after PASSED is a failure; a test outside every item's
    words (MQA heads at head dim 64) counts nowhere, so an item left with none shows as stale."""
    tally = gpu_check_stages.tally(PYTEST_V, gpu_check_stages.subset("cuda"))
    assert (tally["reported"], tally["selected"]) == (5, 52)
    placement, curve, kernels, attention = tally["rows"]          # in gpu_check_stages.SUBSET's order
    assert (placement["tests"], placement["passed"], placement["failures"]) == (1, 1, [])
    assert curve["failures"] == [{"id": "tests/test_gpu.py::test_bf16_training_tracks_fp32", "outcome": "ERROR",
                                  "message": "RuntimeError: teardown"}]
    assert (kernels["tests"], kernels["skipped"], kernels["failures"][0]["message"]) == (
        2, 1, "AssertionError: Tensor-likes are not close!")
    assert attention["tests"] == 0
    files, expr = gpu_check_stages.selection(gpu_check_stages.subset("cuda"))
    assert files == ["tests/test_gpu.py", "tests/test_kernels.py", "tests/test_attention_backends.py"]
    assert "(test_attention_backends and cuda and 8-2)" in expr


def test_memory_stages_run_only_what_the_time_left_holds(monkeypatch, tmp_path):
    from megalysses.plan import Machine, resolve

    cfg = gpu_check_memory.base_config(SimpleNamespace(smoke=True, resolved=lambda: None))
    plan = SimpleNamespace(cfg=cfg, plan=resolve(cfg, Machine.described(None), 1), step=SimpleNamespace(total=1000.0),
                           estimate=SimpleNamespace(peak=2 ** 30, part="backward"))
    monkeypatch.setattr(gpu_check_memory, "planned", lambda check, S: (plan, 9))
    check = SimpleNamespace(smoke=True, env=None, work=tmp_path, note=lambda *a: None, partial=lambda r: None)
    full = gpu_check_memory.full_steps(check, time.monotonic() + 60)
    assert full["status"] == "ran" and all(r["error_text"].startswith("not run: ") for r in full["rows"])
    assert "a step is predicted at 1000 s" in full["rows"][0]["error_text"]
    monkeypatch.setattr(gpu_check_memory, "planned", lambda check, S: (None, 9))
    probe = gpu_check_memory.probe(check, time.monotonic() + 60)
    assert probe["status"] == "ran" and probe["rows"] == [] and "no layout of the 9 considered fits" in probe["why"]


def test_liger_wheel_is_unpacked_onto_the_path_of_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(sys, "path", list(sys.path))
    wheels, work = tmp_path / ".whl", tmp_path / "work"
    assert gpu_check.liger_from_wheel(wheels, work) is None                   # no folder: nothing to do
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "liger_kernel-9.9.0-py3-none-any.whl", "w") as z:
        z.writestr("liger_kernel/__init__.py", "WHERE = __file__\n")
        z.writestr("liger_kernel-9.9.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: liger-kernel\nVersion: 9.9.0\n")
    assert gpu_check.liger_from_wheel(wheels, work) == ".whl/liger_kernel-9.9.0-py3-none-any.whl"
    from benchmarks.harness import child_env
    code = "import importlib.metadata as m, liger_kernel; print(m.version('liger-kernel'), liger_kernel.WHERE)"
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("9.9.0 " + str(work)), done.stdout + done.stderr
    assert gpu_check.liger_from_wheel(wheels, tmp_path / "again") is None     # importable now: left alone


FLASH_BWD = ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, "
             "8, 4, cutlass::bfloat16_t>>(pytorch_flash::Flash_bwd_params)")


@pytest.mark.parametrize("name,group", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "GEMM"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", "GEMM"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "GEMM"),
    (FLASH_BWD, "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("triton_tem_fused_flex_attention_0", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)", "attention"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>",
     "copies and casts"),
    ("Memcpy DtoH (Device -> Pinned)", "copies and casts"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>>",
     "copies and casts"),
    ("_rms_norm_bwd", "elementwise"), ("_rope_qkv_kernel", "elementwise"), ("_swiglu_fwd", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>",
     "elementwise"),
    ("aten::mm", "GEMM"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::copy_", "copies and casts"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"), ("some_new_kernel", "other"),
])
def test_profile_groups_kernels_by_what_they_do(name, group):
    """CUDA kernel names as the profiler reports them (aten op names on CPU) in GEMM, attention, copies and
    casts, elementwise; flash-attention's templates name cutlass, and are attention, not GEMM."""
    assert gpu_check_profile.category(name) == group
    summary = gpu_check_profile.summarise([(name, 300.0, 2), ("_swiglu_bwd", 100.0, 1)])
    assert summary["total_ms"] == pytest.approx(0.4) and summary["top"][0]["share"] == pytest.approx(0.75)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_sigterm_stops_the_stage_running_kills_its_child_and_keeps_the_rows(tmp_path):
    """A timeout around gpu_check (SIGTERM) ends it at once: the child of the stage running is killed with
    it (children run in sessions of their own, out of reach of a signal to the process group), and the
    results say which stage was stopped."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out-dir", str(out)],
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "gpu_smoke.json").exists() and time.monotonic() < deadline:   # stage 1 done
            time.sleep(0.05)
        kids = []
        while not kids and time.monotonic() < deadline:          # stage 2's pytest, or a later stage's child
            kids = _children(p.pid)
            time.sleep(0.02)
        assert kids, "no child process seen"
        p.terminate()
        assert p.wait(timeout=30) == 1 and "stopped by SIGTERM" in p.stderr.read()
    finally:
        p.kill()
    for _ in range(50):
        if not any(_alive(k) for k in kids):
            break
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids), kids
    stages = json.loads((out / "gpu_smoke.json").read_text())["runs"][0]["stages"]
    assert stages["env"]["status"] == "ran"
    stopped = [name for name, s in stages.items() if s["status"] == "stopped"]
    assert len(stopped) == 1 and list(stages)[-1] == stopped[0], stages
    assert "SystemExit: stopped by SIGTERM" in stages[stopped[0]]["why"]


# ------------------------------------------------------------------ what the budget assumes, measured and judged

MEASURED = {"seq_len": 131072, "predicted_gib": 70.0, "traced_peak_gib": 71.0, "max_allocated_gib": 70.5,
            "max_reserved_gib": 72.0, "used_gib": 73.0, "device_total_gib": 79.6, "cap_gib": None,
            "cap_applied": False, "plan_fits": True, "usable_gib": 74.9}


def test_overheads_are_used_less_reserved_and_reserved_less_allocated():
    assert gpu_check_memory.overheads(MEASURED) == pytest.approx({"context_gib": 1.0, "fragmentation_gib": 1.5})
    cpu = dict.fromkeys(("max_allocated_gib", "max_reserved_gib", "used_gib"))
    assert gpu_check_memory.overheads(cpu) == {"context_gib": None, "fragmentation_gib": None}
    assert gpu_check_memory.verdicts({**MEASURED, **cpu}) == []              # on CPU: nothing to judge


@pytest.mark.parametrize("change, failed", [
    ({}, None),
    ({"predicted_gib": 70.5 * 1.049}, None),                     # within 5%
    ({"predicted_gib": 70.5 * 0.94}, "memory model 66.27 GiB against max_memory_allocated 70.50 GiB: -6.0%"),
    ({"traced_peak_gib": 70.5 * 1.06}, "trace 74.73 GiB against max_memory_allocated 70.50 GiB: +6.0%"),
    ({"traced_peak_gib": None}, None),                           # not traced: the model is still judged
    ({"used_gib": 78.7}, "yet 78.70 GiB of the device's 79.60 GiB is used: within 1 GiB"),
    ({"used_gib": 78.7, "plan_fits": False}, None),              # the plan did not say it fits
    ({"used_gib": 79.0, "device_total_gib": 139.8}, None),       # an H200 uncapped: its own total
    ({"used_gib": 79.0, "device_total_gib": 139.8, "cap_gib": 79.6, "cap_applied": True},
     "yet 79.00 GiB of the device's 79.60 GiB is used"),         # capped: the H100's
    ({"error_text": "out of memory: CUDA out of memory", "max_allocated_gib": None},
     "the plan says it fits, yet it ran out of memory"),
])
def test_memory_verdicts_hold_the_model_within_5_percent_and_a_fitting_run_1_gib_short(change, failed):
    found = gpu_check_memory.verdicts({**MEASURED, **change})
    assert (found == []) if failed is None else (len(found) == 1 and failed in found[0]), found


def test_a_larger_gpu_is_capped_at_the_h100s_memory():
    from megalysses.plan.machine import DEVICE_MEMORY_GIB

    h100, h200 = 81559 * 2**20, 143771 * 2**20               # torch.cuda's total_memory of each
    assert bench_gpu.cap_fraction(h100, DEVICE_MEMORY_GIB["H100"]) is None
    assert bench_gpu.cap_fraction(h200, DEVICE_MEMORY_GIB["H100"]) * h200 == pytest.approx(79.6 * 2**30)
    import torch
    assert bench_gpu.cap_memory(torch.device("cpu")) == {"cap_gib": None, "cap_applied": None}
    assert set(bench_gpu.allocator_figures(torch.device("cpu")).values()) == {None}
    check = SimpleNamespace(env={"gpu_memory_gib": 139.8})
    assert gpu_check_memory.gpu_gib(check) == DEVICE_MEMORY_GIB["H100"]     # the planner plans for the cap


def test_a_failed_memory_check_fails_its_stage_with_the_numbers_and_keeps_the_rows(monkeypatch, tmp_path):
    check = SimpleNamespace(smoke=True, env=None, work=tmp_path, note=lambda *a: None, partial=lambda r: None,
                            resolved=lambda: None)
    measured = {"measured_gib": 1.0, "predicted_gib": 1.2, "steps": 2, "step_s": 0.1, "tokens_per_s": 1.0,
                "max_allocated_gib": 1.0, "max_reserved_gib": 1.25, "used_gib": 2.0, "device_total_gib": 79.6,
                "cap_gib": None, "cap_applied": False}
    monkeypatch.setattr(gpu_check_memory, "_run", lambda *a: dict(measured))
    monkeypatch.setattr(gpu_check_memory, "traced", lambda *a: {"traced_peak_gib": 1.01, "traced_step_s": 0.01})
    full = gpu_check_memory.full_steps(check, time.monotonic() + 60)
    assert full["status"] == "failed" and "memory model 1.20 GiB against max_memory_allocated 1.00 GiB" in full["why"]
    assert [r["seq_len"] for r in full["rows"]] == list(gpu_check_memory.SMOKE_FULL_LENGTHS)
    assert full["rows"][0]["context_gib"] == pytest.approx(0.75) and full["rows"][0]["plan_fits"] is True
    assert "+20.0%, over 5%" in "\n".join(gpu_check_memory.render_full_steps(full))
