"""Optimizer offload (training.optimizer_offload, ZeRO-1): masters, moments and reduced gradients in host
memory, the gradients streamed there during the backward, the AdamW update on the CPU; and parameter offload
(training.param_offload, FSDP2's CPUOffloadPolicy): the weights in host memory too. On CPU each runs the
same arithmetic as without it: after a few steps the weights and the optimizer state must be exactly those
without offload, a checkpoint of either resumes with or without it, and the measured peak of a training
step drops by what the memory model predicts."""
import pytest
import torch

from megalysses.config.io import load_config
from megalysses.grid import ParallelGrid
from megalysses.model.policies import activation_offload
from megalysses.testing import run_distributed
from tests.fixtures import MOCK_32, PARITY_MODEL, with_model

BASE = with_model(MOCK_32 + PARITY_MODEL, num_layers=2) + [
    "training.micro_batch_size=1", "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "optimizer.grad_clip=0.1",
    "parallel.grad_bucket_elements=5000", "parallel.timeout_seconds=60", "training.train_steps=3",
    "logging.log_interval=1"]
RUNS = {   # name: overrides (world from the caller)
    "fp32, dp": ["training.global_batch_size=2"],
    "bf16, one micro-batch": ["training.global_batch_size=2", "training.dtype=bfloat16"],
    "bf16, fp32 main_grad, tied, no overlap": ["training.global_batch_size=4", "training.dtype=bfloat16",
                                               "model.tie_embeddings=true", "parallel.overlap_grad_reduce=false"],
    "sp, checkpointing": ["training.global_batch_size=1", "parallel.sp=2", "training.activation_checkpointing=true",
                          "training.activation_offload=true"],
    "fp32, 2 micro-batches, tp2 (a grad group of one rank)": ["training.global_batch_size=2", "parallel.tp=2"],
}
# summed after the reduction with offload (before it without): the same sum, up to fp32 rounding
REASSOCIATED = {"fp32, dp2, 2 micro-batches each": ["training.global_batch_size=4"]}
PARAM_RUNS = {   # FSDP, with and without parameter offload
    "bf16, dp2, 2 micro-batches, checkpointing": ["training.global_batch_size=4", "training.dtype=bfloat16",
                                                  "training.activation_checkpointing=true"],
    "pp2, tied embeddings": ["training.global_batch_size=2", "parallel.pp=2", "model.tie_embeddings=true"],
    "sp2, activation offload, clipped": ["training.global_batch_size=1", "parallel.sp=2", "optimizer.grad_clip=0.01",
                                         "training.activation_checkpointing=true", "training.activation_offload=true"],
}
PEAK = ["training.dtype=bfloat16", "training.activation_checkpointing=true", "training.global_batch_size=4",
        "data.document_mask=false", "model.num_layers=4", "parallel.grad_bucket_elements=20000", "data.seq_len=256"]
PEAKS = {   # (without, with) the offload, on 2 ranks (dp2, 2 micro-batches each)
    "optimizer offload (ZeRO-1)": (PEAK, PEAK + ["training.optimizer_offload=true"]),
    "parameter offload (FSDP)": (PEAK + ["parallel.fsdp=true"],
                                 PEAK + ["parallel.fsdp=true", "training.param_offload=true"]),
}


def train(overrides: list[str], world: int, steps: int = 3) -> dict:
    """`steps` optimizer steps; returns losses, norms, this rank's weights and optimizer state."""
    from megalysses.training.build import build_run
    from megalysses.training.data import TrainingData
    from megalysses.testing import plan_and_grid
    from megalysses.training.step import train_step

    cfg = load_config(overrides=BASE + overrides)
    device = torch.device("cpu")
    runtime, grid = plan_and_grid(cfg, device)
    built = build_run(cfg, runtime, grid, device)
    model, opt = built.model, built.opt
    batches = TrainingData(cfg, grid, runtime, device).train_batches(0)
    losses, norms = [], []
    for _ in range(steps):
        r = train_step(model, opt, next(batches), grid, lr=cfg.optimizer.lr, grad_clip=cfg.optimizer.grad_clip,
                       dtype=runtime.torch_dtype)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    state = {f"{kind}.{name}": t.clone() for name, _, chunks in opt.checkpoint_slots() for kind, t in chunks.items()}
    weights = {n: (q.to_local() if hasattr(q, "to_local") else q).detach().clone() for n, q in model.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights, "state": state,
            "host_grads": sum(s.host_grad is not None for s in getattr(opt, "slots", [])),
            "host_units": host_units(model), "pinned": arena_use(cfg, runtime, grid, model, opt)}


def arena_use(cfg, runtime, grid, model, opt) -> tuple[int, int] | None:
    """(the bytes of the rank's pinned arenas, what the run took of them, staging buffers included: a CPU adds a
    later micro-batch's gradients at once, without staging them), or None where the run pins nothing."""
    from megalysses.plan.memory import pinned_requests_of

    chunks = model.chunks if hasattr(model, "chunks") else [model]
    arenas = [a for a in [getattr(opt, "pinned", None)] + [o.pinned for o in map(activation_offload, chunks) if o]
              if hasattr(a, "capacity")]
    if not arenas:
        return None
    reqs = pinned_requests_of(cfg, runtime, grid.pp_rank)
    staging = sum(r.total for r in reqs if r.name == "gradient staging buffers")
    return sum(a.capacity for a in arenas), sum(a.high_water for a in arenas) + staging


def reduced_gradients(overrides: list[str], world: int) -> dict:
    """The first step's loss and reduced fp32 gradients (this rank's chunks, before clipping)."""
    from megalysses.training.build import build_run
    from megalysses.training.data import TrainingData
    from megalysses.testing import plan_and_grid
    from megalysses.training.step import train_step

    cfg = load_config(overrides=BASE + overrides)
    device = torch.device("cpu")
    runtime, grid = plan_and_grid(cfg, device)
    built = build_run(cfg, runtime, grid, device)
    model, opt = built.model, built.opt
    got = {}

    def capture(max_norm: float, ok=None, guard=True) -> torch.Tensor:
        opt.reduce_gradients()
        got.update({s.name: s.master.grad.clone() for s in opt.slots if s.master is not None})
        opt.zero_grad()
        return torch.tensor(1.0)

    opt.step = capture
    loss = train_step(model, opt, next(TrainingData(cfg, grid, runtime, device).train_batches(0)), grid, lr=1e-3,
                      grad_clip=1.0, dtype=runtime.torch_dtype).loss
    return {"loss": loss, "grads": got}


def host_units(model: torch.nn.Module) -> int:
    """FSDP units whose shards live in host memory (CPUOffloadPolicy): on CPU nothing else tells them apart."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    return sum(isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
               for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group)


def run_loop(overrides: list[str]) -> tuple[int, dict]:
    """pretrain's loop on this world: (the last step, this rank's weights)."""
    from megalysses.training import loop
    from megalysses.testing import resolve_run

    shards = {}
    original = loop.build_run

    def keep(*args, **kwargs):
        shards["run"] = original(*args, **kwargs)
        return shards["run"]

    cfg, grid = load_config(overrides=BASE + overrides), ParallelGrid()
    loop.build_run = keep
    try:
        summary = loop.train(cfg, resolve_run(cfg, torch.device("cpu"), grid), grid, torch.device("cpu"))
    finally:
        loop.build_run = original
    return summary["step"], {n: (q.to_local() if hasattr(q, "to_local") else q).detach().clone()
                             for n, q in shards["run"].model.named_parameters()}


def _resumed(tmp: str, name: str, first: list[str], then: list[str]) -> tuple[int, dict]:
    """2 steps with `first`, a checkpoint, then the last step with `then` (offload on or off)."""
    run_loop(first + [f"logging.run_dir={tmp}/{name}", "training.exit_at_step=2"])
    return run_loop(then + [f"logging.run_dir={tmp}/{name}"])


def _worker(rank: int, world: int, tmp: str) -> dict:
    from tests.test_memory_model import measured_step_peak

    out = {name: (train(o, world), train(o + ["training.optimizer_offload=true"], world)) for name, o in RUNS.items()}
    out["reassociated"] = {name: (reduced_gradients(o, world),
                                  reduced_gradients(o + ["training.optimizer_offload=true"], world))
                           for name, o in REASSOCIATED.items()}
    fsdp = ["parallel.fsdp=true"]
    out["param"] = {name: (train(o + fsdp, world), train(o + fsdp + ["training.param_offload=true"], world))
                    for name, o in PARAM_RUNS.items()}
    # a checkpoint of an offloaded run resumes without offload and vice versa, exactly: 2 steps, save, 1 more
    # step after a restart, against 3 steps straight
    zero = RUNS["bf16, one micro-batch"] + ["checkpoint.save_interval=2"]
    host = zero + ["training.optimizer_offload=true"]
    out["straight"] = run_loop(host + [f"logging.run_dir={tmp}/straight"])
    out["resumed"] = [_resumed(tmp, "zero1 from host", host, zero), _resumed(tmp, "zero1 to host", zero, host)]
    sharded = zero + fsdp
    weights = sharded + ["training.param_offload=true"]
    out["param straight"] = run_loop(weights + [f"logging.run_dir={tmp}/param straight"])
    out["param resumed"] = [_resumed(tmp, "fsdp from host", weights, sharded),
                            _resumed(tmp, "fsdp to host", sharded, weights)]
    out["peaks"] = {name: [measured_step_peak(BASE + o, world) for o in pair] for name, pair in PEAKS.items()}
    out["host piece"] = _host_piece_stays(rank, world)
    return out


def _host_piece_stays(rank: int, world: int) -> bool:
    """A host-memory tensor in a checkpoint on a GPU mesh (made here without its backend, as this machine has no
    GPU) is the tensor itself, not a copy on the device: a load fills it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    from megalysses.checkpoint.dcp_io import dtensor_view

    mesh = DeviceMesh("cuda", torch.arange(world), _init_backend=False)
    host = torch.arange(6.0).view(3, 2) + rank
    try:
        piece = dtensor_view(host, mesh, [Shard(0)], [3 * world, 2])
    except (AssertionError, RuntimeError) as e:     # what copying it to a GPU raises here
        return f"moved to the device: {e}"
    return piece.device_mesh.device_type == "cuda" and piece.to_local().data_ptr() == host.data_ptr()


def _same_training(name: str, plain: dict, offloaded: dict) -> None:
    assert offloaded["losses"] == plain["losses"] and offloaded["norms"] == plain["norms"], name
    assert plain["losses"][-1] < plain["losses"][0], name           # the weights did move
    for n, w in plain["weights"].items():
        assert torch.equal(offloaded["weights"][n], w), f"{name}: {n}"
    for key, t in plain["state"].items():
        assert torch.equal(offloaded["state"][key], t), f"{name}: {key}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One group of 2 ranks for every check of this file."""
    tmp = tmp_path_factory.mktemp("offload")
    return run_distributed(_worker, 2, tmp_dir=tmp, args=(str(tmp),), timeout=400)


def test_optimizer_offload_steps_exactly_like_the_device_optimizer(ranks):
    for rank, results in enumerate(ranks):
        for name in RUNS:
            plain, offloaded = results[name]
            _same_training(f"{name}, rank {rank}", plain, offloaded)
            assert offloaded["host_grads"] > 0 and plain["host_grads"] == 0, name
            # the rank's pinned arena, sized from the plan, is what the run took of it, to the byte
            capacity, used = offloaded["pinned"]
            assert capacity == used > 0, (name, rank, capacity, used)
            offloads_activations = "training.activation_offload=true" in RUNS[name]
            assert (plain["pinned"] is not None) == offloads_activations, (name, plain["pinned"])
            assert plain["pinned"] is None or plain["pinned"][0] == plain["pinned"][1], (name, plain["pinned"])
        for name, (plain, offloaded) in results["reassociated"].items():
            assert offloaded["loss"] == plain["loss"] and plain["grads"].keys() == offloaded["grads"].keys(), name
            for n, g in plain["grads"].items():     # fp32 sums of 4 terms in another order: a few ulps apart
                torch.testing.assert_close(offloaded["grads"][n], g, rtol=1e-6, atol=1e-9, msg=f"{name}: {n}")


def test_parameter_offload_trains_exactly_like_fsdp(ranks):
    for rank, results in enumerate(ranks):
        for name, (plain, offloaded) in results["param"].items():
            _same_training(f"parameter offload, {name}, rank {rank}", plain, offloaded)
            for pinned in (plain["pinned"], offloaded["pinned"]):    # block inputs only: FSDP2 pins its own
                assert pinned is None or pinned[0] == pinned[1] > 0, (name, rank, pinned)
            # every block (2, or 1 a stage) and the root unit: the shards are in host memory
            assert plain["host_units"] == 0 and offloaded["host_units"] == 3 - ("pp2" in name), name


def test_a_checkpoint_resumes_with_and_without_offload(ranks):
    """Saved with offload, resumed without it, and the other way round, for either offload: the weights of
    the last step are those of the run that never stopped."""
    for rank, results in enumerate(ranks):
        for kind in ("", "param "):
            straight_step, straight = results[f"{kind}straight"]
            assert straight_step == 3
            for step, weights in results[f"{kind}resumed"]:
                assert step == 3, (kind, step)
                for n, w in straight.items():
                    assert torch.equal(weights[n], w), f"{kind}resumed, rank {rank}: {n}"


def test_checkpoints_take_host_memory_tensors_as_they_are(ranks):
    assert all(results["host piece"] is True for results in ranks), [results["host piece"] for results in ranks]


def test_offload_lowers_the_measured_peak_by_what_the_model_predicts(ranks):
    """The peak of live bytes over a training step on the 'device' (host memory left out) against the memory
    model: each within 10%, and the drop that each offload makes within 10% of the predicted drop (ZeRO-1's
    fp32 main_grad and optimizer state; FSDP's shards, their gradients and the optimizer state)."""
    for rank, results in enumerate(ranks):
        for name, (off, on) in results["peaks"].items():
            for peak in (off, on):
                assert abs(peak.predicted - peak.measured) <= 0.10 * peak.measured, (name, rank, peak)
            without, with_ = off.measured, on.measured
            drop, predicted_drop = without - with_, off.predicted - on.predicted
            assert drop > 0.4 * without, (name, rank, without, with_)
            assert abs(predicted_drop - drop) <= 0.10 * drop, (name, rank, drop, predicted_drop)
