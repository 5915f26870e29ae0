"""bf16 compute against fp32 on CPU, with stated tolerances: one step's loss and gradients, and a short
training run's loss curve. bf16 means what a GPU run does: bf16 weights and activations (norm
statistics, softmax and the loss in fp32 inside the ops), fp32 master weights and moments in the
optimizer, gradients accumulated over micro-batches in fp32."""
import torch

from megalysses.config import ModelConfig
from megalysses.grid import ParallelGrid
from megalysses.model.gpt import GPTStage, init_weights
from megalysses.parallel.optimizer import AdamWSettings
from megalysses.parallel.zero import ShardedAdamW
from megalysses.training.step import train_step

CFG = ModelConfig(vocab_size=200, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, attention_backend="sdpa")
S = 64
LOSS_TOL = 1e-2          # relative, one step
GRAD_COS = 0.99          # cosine similarity of every parameter's gradient
CURVE_TOL = 0.01         # relative, mean over the last 5 of 20 steps


def batches(n: int, micro: int = 2):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        step = []
        for _ in range(micro):
            # a learnable stream: each token is the previous one plus 3 (mod V), 10% of them random
            start = torch.randint(0, CFG.vocab_size, (1, 1), generator=g)
            seq = (start + 3 * torch.arange(S + 1)) % CFG.vocab_size
            noise = torch.rand(1, S + 1, generator=g) < 0.1
            seq = torch.where(noise, torch.randint(0, CFG.vocab_size, (1, S + 1), generator=g), seq)
            step.append({"input_ids": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(S)[None]})
        out.append(step)
    return out


def build(dtype: torch.dtype):
    model = GPTStage(CFG)
    init_weights(model, seed=1)
    opt = ShardedAdamW(model.named_parameters(), None,
                       AdamWSettings(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    model.to(dtype)
    return model, opt


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


def test_one_step_loss_and_gradients_close_to_fp32():
    grads, losses = {}, {}
    step = batches(1)[0]
    for dtype in (torch.float32, torch.bfloat16):
        model, opt = build(dtype)
        opt.begin_step(len(step))
        total = sum(model(mb["input_ids"], mb["position_ids"], labels=mb["labels"]) for mb in step)
        total.backward()
        losses[dtype] = total.item()
        grads[dtype] = {s.name: s.grad() for s in opt.slots}       # fp32 accumulations over the micro-batches
    assert abs(losses[torch.bfloat16] - losses[torch.float32]) <= LOSS_TOL * losses[torch.float32]
    for name, g in grads[torch.float32].items():
        assert grads[torch.bfloat16][name].dtype == torch.float32, name
        assert cosine(grads[torch.bfloat16][name], g) >= GRAD_COS, name


def test_training_curve_tracks_fp32():
    curves = {}
    data = batches(20)
    grid = ParallelGrid.single()
    for dtype in (torch.float32, torch.bfloat16):
        model, opt = build(dtype)
        curves[dtype] = [train_step(model, opt, mbs, grid, lr=3e-3, grad_clip=1.0, dtype=dtype).loss for mbs in data]
        assert all(p.dtype == dtype for p in model.parameters())
    fp32, bf16 = curves[torch.float32], curves[torch.bfloat16]
    assert fp32[-1] < 0.8 * fp32[0]                                   # it learns, so the comparison means something
    rel = [abs(a - b) / b for a, b in zip(bf16[-5:], fp32[-5:])]
    assert sum(rel) / len(rel) <= CURVE_TOL, (bf16[-5:], fp32[-5:])
