"""Optimizer offload (training.optimizer_offload, ZeRO-1): masters, moments and reduced gradients in host
memory, the AdamW update on the CPU. On CPU both run the same arithmetic: after a few steps the weights
and the optimizer state must be exactly those without offload, and a checkpoint resumes exactly."""
import torch

from megalysses.config_io import load_config
from megalysses.grid import ParallelGrid
from megalysses.testing import run_distributed

BASE = ["data.mock=true", "data.seq_len=32", "model.vocab_size=128", "model.hidden_size=64", "model.num_layers=2",
        "model.num_heads=8", "model.num_kv_heads=2", "model.attention_backend=sdpa", "training.micro_batch_size=1",
        "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "optimizer.grad_clip=0.1",
        "parallel.grad_bucket_elements=5000", "parallel.timeout_seconds=60", "training.train_steps=3",
        "logging.log_interval=1"]
RUNS = {   # name: overrides (world from the caller)
    "fp32, dp": ["training.global_batch_size=2"],
    "bf16, one micro-batch": ["training.global_batch_size=2", "training.dtype=bfloat16"],
    "bf16, fp32 main_grad, tied, no overlap": ["training.global_batch_size=4", "training.dtype=bfloat16",
                                               "model.tie_embeddings=true", "parallel.overlap_grad_reduce=false"],
    "sp, checkpointing": ["training.global_batch_size=1", "parallel.sp=2", "training.activation_checkpointing=true",
                          "training.activation_offload=true"],
}


def train(overrides: list[str], world: int, steps: int = 3) -> dict:
    """`steps` optimizer steps; returns losses, norms, this rank's weights and optimizer state."""
    from megalysses.training import loop
    from megalysses.training.data import TrainingData
    from megalysses.training.runtime import resolve_run
    from megalysses.training.step import train_step

    cfg = load_config(overrides=BASE + overrides)
    device = torch.device("cpu")
    grid = ParallelGrid.for_config(cfg) if world > 1 else ParallelGrid.single()
    runtime = resolve_run(cfg, device, grid)
    model, opt = loop.build_model_and_optimizer(cfg, grid, device, runtime)
    batches = TrainingData(cfg, grid, device).train_batches(0)
    losses, norms = [], []
    for _ in range(steps):
        r = train_step(model, opt, next(batches), grid, lr=cfg.optimizer.lr, grad_clip=cfg.optimizer.grad_clip,
                       dtype=runtime.torch_dtype)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    state = {f"{kind}.{name}": t.clone() for name, _, chunks in opt.checkpoint_slots() for kind, t in chunks.items()}
    return {"losses": losses, "norms": norms, "weights": {n: q.detach().clone() for n, q in model.named_parameters()},
            "state": state, "host_grads": sum(s.host_grad is not None for s in opt.slots)}


def run_loop(overrides: list[str]) -> tuple[int, dict]:
    """pretrain's loop on this world: (the last step, this rank's weights)."""
    from megalysses.training import loop

    shards = {}
    original = loop.build_model

    def keep(*args):
        shards["model"] = original(*args)
        return shards["model"]

    loop.build_model = keep
    try:
        summary = loop.train(load_config(overrides=BASE + overrides), ParallelGrid(), torch.device("cpu"))
    finally:
        loop.build_model = original
    return summary["step"], {n: q.detach().clone() for n, q in shards["model"].named_parameters()}


def _worker(rank: int, world: int, tmp: str) -> dict:
    out = {name: (train(o, world), train(o + ["training.optimizer_offload=true"], world)) for name, o in RUNS.items()}
    # a checkpoint of an offloaded run resumes exactly: 2 steps, save, 1 more step after a restart
    o = RUNS["bf16, one micro-batch"] + ["training.optimizer_offload=true", "checkpoint.save_interval=2"]
    out["straight"] = run_loop(o + [f"logging.run_dir={tmp}/straight"])
    run_loop(o + [f"logging.run_dir={tmp}/resumed", "training.exit_at_step=2"])
    out["resumed"] = run_loop(o + [f"logging.run_dir={tmp}/resumed"])
    return out


def test_optimizer_offload_steps_exactly_like_the_device_optimizer(tmp_path):
    ranks = run_distributed(_worker, 2, tmp_dir=tmp_path, args=(str(tmp_path),), timeout=400)
    for rank, results in enumerate(ranks):
        for name in RUNS:
            plain, offloaded = results[name]
            assert offloaded["losses"] == plain["losses"] and offloaded["norms"] == plain["norms"], name
            assert plain["losses"][-1] < plain["losses"][0], name           # the weights did move
            for n, w in plain["weights"].items():
                assert torch.equal(offloaded["weights"][n], w), f"{name}, rank {rank}: {n}"
            for key, t in plain["state"].items():
                assert torch.equal(offloaded["state"][key], t), f"{name}, rank {rank}: {key}"
            assert offloaded["host_grads"] > 0 and plain["host_grads"] == 0, name
        (step, weights), (straight_step, straight) = results["resumed"], results["straight"]
        assert step == straight_step == 3, (step, straight_step)
        for n, w in straight.items():
            assert torch.equal(weights[n], w), f"resumed, rank {rank}: {n}"
