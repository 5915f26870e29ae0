"""What the planner tests share: Llama-3.1-8B's shape, a config with overrides, its run on described H100s."""
from megalysses.config import ModelConfig
from megalysses.config.io import load_config
from megalysses.plan import resolve
from megalysses.plan.search import described_machine
from megalysses.plan.machine import device_memory_gib
from megalysses.plan.step_time import Hardware

H100_GIB = device_memory_gib("H100")     # what an H100 80GB exposes: 79.6 GiB

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                        ffn_hidden_size=14336)


def load(path: str, **sets):
    """`path` with `section.key=value` overrides, as --set gives them."""
    return load_config(path, [f"{k}={v}" for k, v in sets.items()])


def h100s(cfg, gpus):
    """The run of `cfg` on `gpus` described H100s (a plain torch install)."""
    return resolve(cfg, described_machine(gpus, H100_GIB, Hardware()), gpus)
