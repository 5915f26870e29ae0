"""The memory trace reaches the run's code through interfaces only. No production module of the step, the loop,
the builder, parallel/, comm, the grid or kernels/ asks whether it runs on the meta device or the trace's fake
backend (a structural check of their code, shown to catch such a branch); what they ask instead:
megalysses.accelerator's Host (whether a device's tensors hold values, whether it is the GPU), a group's backend
(the devices it takes, the device mesh's among them) and kernels/attention.py's GPUKernels (the GPU's attention
kernels, which the trace's forms replace without setting any module's attributes). What the trace does to
FSDP2's private internals lives in training/fsdp_meta.py, patched on the torch releases it was checked on and
refused, in one line naming the release, on another."""
import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megalysses import accelerator, comm
from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.plan import Machine
from megalysses.training import fsdp_meta
from megalysses.training.trace import trace_step

REPO = Path(__file__).resolve().parent.parent
PRODUCTION = sorted([REPO / "megalysses/training/loop.py", REPO / "megalysses/training/build.py",
                     REPO / "megalysses/training/step.py", REPO / "megalysses/comm.py", REPO / "megalysses/grid.py",
                     *(REPO / "megalysses/parallel").glob("*.py"),
                     *(p for p in (REPO / "megalysses/kernels").glob("*.py") if p.name != "gpu_forms.py")])
TRACE_MODULES = ("megalysses.training.trace", "megalysses.training.roofline", "megalysses.training.fsdp_meta",
                 "megalysses.tracker", "megalysses.kernels.gpu_forms")
TRACE_FILES = [REPO / "megalysses/training/trace.py", REPO / "megalysses/training/roofline.py",
               REPO / "megalysses/kernels/gpu_forms.py"]
"""The trace's own modules but the FSDP2 adapter (fsdp_meta.py) and the tracker's storage hook (tracker.py)."""
SMALL = ["data.mock=true", "model.vocab_size=512", "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=320", "training.micro_batch_size=1", "data.seq_len=1024",
         "training.global_batch_size=1", "training.dtype=bfloat16"]
H100 = Machine.described("H100")


def trace_branches(source: str) -> list[str]:
    """Where `source` asks whether it is traced or on the meta device: `.is_meta`, a string (not a docstring)
    that is "meta", names a backend of the meta device ("meta:") or the fake backend, a Fake* name, an import of
    the trace's modules."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and node.attr in ("is_meta", "is_fake"):
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value == "meta" or "meta:" in node.value or "fake" in node.value.lower():
                found.append(f"{where}: {node.value!r}")
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if "fake" in name.lower():
                found.append(f"{where}: {name}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
            traced = [n for n in names if n in TRACE_MODULES or "fake" in n.lower()]
            found += [f"{where}: imports {traced[0]}"] if traced else []
    return sorted(found)


def test_no_production_module_branches_on_the_trace():
    found = {str(p.relative_to(REPO)): trace_branches(p.read_text()) for p in PRODUCTION}
    assert len(found) >= 10 and all(p.is_file() for p in PRODUCTION)
    assert not {p: f for p, f in found.items() if f}, found


def test_the_check_sees_a_branch_on_the_trace():
    planted = '''
"""A docstring may say "meta" and fake."""
from torch.testing._internal.distributed.fake_pg import FakeProcessGroup
from megalysses.training import trace

def f(t, device, backend):
    """Nor is this docstring a branch: "meta"."""
    if t.is_meta or device.type == "meta" or "meta:" in backend or backend == "fake":
        return isinstance(t, FakeTensor)
'''
    assert trace_branches(planted) == sorted([
        "line 3: imports torch.testing._internal.distributed.fake_pg", "line 4: imports megalysses.training.trace",
        "line 8: .is_meta", "line 8: 'meta'", "line 8: 'meta:'", "line 8: 'fake'", "line 9: FakeTensor"])


def module_swaps(source: str) -> list[str]:
    """Where `source` sets what another module holds: a setattr call, an assignment to an attribute or an item of
    an imported name (`attention.flash_attn_func = ...`, `attention._BACKEND_FNS["sdpa"] = ...`)."""
    tree = ast.parse(source)
    imported = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}

    def root(node: ast.AST) -> str:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return getattr(node, "id", "")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            found.append(f"line {node.lineno}: setattr({ast.unparse(node.args[0]) if node.args else ''}, ...)")
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        found += [f"line {node.lineno}: {ast.unparse(t)} = ..." for t in targets
                  if isinstance(t, (ast.Attribute, ast.Subscript)) and root(t) in imported]
    return sorted(found)


def test_the_trace_swaps_no_module_attributes():
    """The trace puts its forms in place through the interfaces the run's code asks (the accelerator's `use`,
    kernels/attention.py's `use_kernels`, the Triton launcher's hook), never by setting what a module holds."""
    found = {str(p.relative_to(REPO)): module_swaps(p.read_text()) for p in TRACE_FILES}
    assert all(p.is_file() for p in TRACE_FILES) and not {p: f for p, f in found.items() if f}, found


def test_the_check_sees_a_module_attribute_set():
    planted = """
from megalysses.kernels import attention
import torch.nn.functional as F

def swap(opt, forms):
    saved = attention._BACKEND_FNS["sdpa"]
    attention._BACKEND_FNS["sdpa"] = forms.sdpa
    F.scaled_dot_product_attention = forms.sdpa
    for module, name, form in forms.attributes:
        setattr(module, name, form)
    opt.step = forms.step
    local = {}
    local["x"] = saved
"""
    assert module_swaps(planted) == sorted([
        "line 7: attention._BACKEND_FNS['sdpa'] = ...", "line 8: F.scaled_dot_product_attention = ...",
        "line 10: setattr(module, ...)"])


def test_the_trace_puts_its_kernel_forms_in_place_and_back():
    """Inside gpu_kernels the attention backends call the GPU forms and see the described machine's packages
    (flash-attn's backends exist on CUDA); after it, the real kernels again."""
    from megalysses.kernels import attention, gpu_forms
    from megalysses.tracker import LiveBytes

    real = attention.kernels()
    with gpu_forms.gpu_kernels(LiveBytes(), frozenset({"flash_attn"})):
        forms = attention.kernels()
        assert forms.sdpa is gpu_forms.cuda_sdpa and forms.installed() == {"flash_attn"}
        assert "flash" in attention.available_backends("cuda") and "flex" not in attention.available_backends("cuda")
    assert attention.kernels() is real and real.sdpa is torch.nn.functional.scaled_dot_product_attention


def test_the_host_says_whether_a_device_holds_values():
    """The loop initialises weights where the Host says tensors hold values: a real device's, not the meta
    device's (a dry run's), nothing in a trace (fake tensors); the trace's GPU is the meta device."""
    from megalysses.training.roofline import Roofline
    from megalysses.training.trace import FakeGPU
    from megalysses.plan.step_time import Hardware
    from megalysses.tracker import LiveBytes

    host = accelerator.Host()
    assert host.holds_values(torch.device("cpu")) and not host.holds_values(torch.device("meta"))
    fake = FakeGPU(LiveBytes(), Roofline(Hardware()))
    assert not fake.holds_values(torch.device("cpu")) and not fake.holds_values(torch.device("meta"))
    assert fake.is_gpu(torch.device("meta")) and not host.is_gpu(torch.device("meta"))


@pytest.mark.parametrize("backend, meta_taken", [("cpu:fake,cuda:fake,meta:fake", True), ("fake", False)])
def test_collectives_take_the_devices_of_the_groups_backend(backend, meta_taken):
    """A collective's tensors are checked against the devices the group's backend has: the trace's, which
    has one for the meta device, takes a meta tensor; the dry run's plain fake backend, like gloo, refuses it.
    A device mesh takes the same devices: the meta device's own for the trace, the host's for a dry run."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=2)
    try:
        comm.check_device("all_reduce", None, torch.ones(1))
        meta = torch.device("meta")
        assert comm.collective_device_type(meta) == ("meta" if meta_taken else "cpu")
        assert comm.collective_device_type(torch.device("cpu")) == "cpu"
        if meta_taken:
            comm.check_device("all_reduce", None, torch.ones(1, device="meta"))
        else:
            with pytest.raises(RuntimeError, match="all_reduce: a tensor on meta was handed to a fake collective"):
                comm.check_device("all_reduce", None, torch.ones(1, device="meta"))
    finally:
        dist.destroy_process_group()


def _internals() -> tuple:
    from torch.distributed.fsdp._fully_shard import _fsdp_init
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    return (FSDPParamGroup._validate_no_meta_params, _fsdp_init._move_states_to_device,
            FSDPParam._init_sharded_param)


def test_the_fsdp_adapter_patches_this_torch_and_restores_it():
    """On this torch (one of CHECKED_TORCH) the adapter replaces the three internals inside its block and puts
    them back after; an FSDP run with parameter offload traces through it."""
    assert fsdp_meta.torch_release(torch.__version__) in fsdp_meta.CHECKED_TORCH
    assert fsdp_meta.torch_release("2.11.0a0+git1234") == (2, 11)
    before = _internals()
    with fsdp_meta.fsdp_internals():
        inside = _internals()
    assert all(a is not b for a, b in zip(before, inside)) and _internals() == before
    cfg = load_config(overrides=SMALL + ["parallel.fsdp=true", "training.param_offload=true"])
    traced = trace_step(cfg, H100, 1)
    assert traced.device.bytes > 0 and traced.pinned.bytes > 0 and _internals() == before


def test_the_fsdp_adapter_refuses_another_torch(monkeypatch):
    """On a torch it was not checked on, the adapter patches nothing and says so in one line naming the
    release; the trace of an FSDP run stops there, a ZeRO-1 run's (no FSDP2) still traces."""
    monkeypatch.setattr(torch, "__version__", "2.12.0+cpu")
    before = _internals()
    with pytest.raises(ConfigError, match=r"torch 2\.12\.0\+cpu is not one of those") as e:
        with fsdp_meta.fsdp_internals():
            pass
    assert "\n" not in str(e.value) and _internals() == before
    with pytest.raises(ConfigError, match=r"torch 2\.12\.0\+cpu"):
        trace_step(load_config(overrides=SMALL + ["parallel.fsdp=true"]), H100, 1)
    assert not dist.is_initialized() and _internals() == before and not hasattr(torch, "meta")
    assert trace_step(load_config(overrides=SMALL), H100, 1).device.bytes > 0


def test_start_up_checks_the_host_memory_of_the_plans_machine(tmp_path):
    """The loop checks the host memory the plan's machine states (this node's, where it knows it): a node too
    small for the offloaded optimizer state is refused before step 1; a machine whose memory is not known (a
    described one) is not judged."""
    from dataclasses import replace

    from fixtures import TINY
    from megalysses.grid import ParallelGrid
    from megalysses.plan import resolve
    from megalysses.training.loop import train

    cfg = load_config(overrides=TINY + ["training.optimizer_offload=true", f"logging.run_dir={tmp_path}"])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        grid, node = ParallelGrid(), Machine.current("cpu")
        small = resolve(cfg, replace(node, host_memory_gib=1e-6), 1)
        with pytest.raises(ConfigError, match="GiB of host memory per node"):
            train(cfg, small, grid, torch.device("cpu"), dry_run=True)
        unknown = resolve(cfg, replace(node, host_memory_gib=None), 1)
        assert train(cfg, unknown, grid, torch.device("cpu"), dry_run=True)["stopped_by"] == "dry_run"
    finally:
        dist.destroy_process_group()
