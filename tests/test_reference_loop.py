"""The single-process run that every layout is compared with, against a training loop written in plain
torch: the layouts' parity shares our loop, optimizer and schedule with that run, so a mistake there
(a step's learning rate, the betas, the clip) would pass parity; here it cannot."""
import torch

from megalysses.config.io import load_config
from tests.fixtures import TRAIN_PARITY
from tests.parity import Run, check_run, run_layouts

# Adam moves an element by ~lr * g / (|g| + eps): with eps near |g| it sees the gradients' scale, so a
# clip coefficient that is wrong shows in the weights. TRAIN_PARITY's clip of 0.5 binds at every step (the
# gradient norms are ~1.5); 10 never does.
BINDING = ["optimizer.eps=1e-4"]
NOT_BINDING = ["optimizer.eps=1e-4", "optimizer.grad_clip=10"]
LAYOUTS = {"clip_binds": (1, BINDING), "clip_free": (1, NOT_BINDING),
           "fsdp_dp2_clip_free": (2, ["parallel.fsdp=true"] + NOT_BINDING)}


def plain_torch(overrides: list[str], steps: int = 3) -> tuple[dict, list[float]]:
    """The run `overrides` describe, by hand: the model and the batches of that run; torch's AdamW with
    decay on matrices only, clip_grad_norm_, the schedule's learning rate of each step, and the loss
    summed over the step's micro-batches and divided by its count of labelled tokens."""
    from megalysses.model.gpt import GPTStage, init_weights
    from megalysses.training.data import TrainingData
    from megalysses.testing import plan_and_grid
    from megalysses.training.schedule import lr_at

    cfg = load_config(overrides=TRAIN_PARITY + overrides)
    o = cfg.optimizer
    model = GPTStage(cfg.model)
    init_weights(model, cfg.training.seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    run, grid = plan_and_grid(cfg, torch.device("cpu"))
    batches = TrainingData(cfg, grid, run, torch.device("cpu")).train_batches(0)
    norms = []
    for step in range(steps):
        micro_batches = next(batches)
        count = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
        for mb in micro_batches:
            loss = model(mb["input_ids"], mb["position_ids"], doc_ids=mb.get("doc_ids"), labels=mb["labels"])
            (loss / count).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, o.grad_clip).item())
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o, cfg.training.train_steps)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def check(got: Run, want: tuple[dict, list[float]], name: str) -> None:
    """The run's 3 gradient norms and final weights are plain torch's (within 1e-5)."""
    weights, norms = want
    check_run(Run([], weights, norms, []), got, f"{name} against plain torch", quantities=("grad_norms", "weights"))


def test_single_process_run_is_plain_torch(tmp_path):
    runs = run_layouts(tmp_path, 1, ["clip_binds", "clip_free"], LAYOUTS)
    assert min(runs["clip_binds"][2]) > 0.5 and max(runs["clip_free"][2]) < 10, "the clips are not what they say"
    check(runs["clip_binds"], plain_torch(BINDING), "clip_binds")
    check(runs["clip_free"], plain_torch(NOT_BINDING), "clip_free")


def test_fsdp_with_a_clip_that_does_not_bind_is_plain_torch(tmp_path):
    got = run_layouts(tmp_path, 2, ["fsdp_dp2_clip_free"], LAYOUTS)["fsdp_dp2_clip_free"]
    check(got, plain_torch(NOT_BINDING), "fsdp_dp2_clip_free")
