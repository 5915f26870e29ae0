"""Suite-wide setup."""
import pytest
import torch

from megalysses import testing

testing.preload("megalysses.training.loop")     # what most distributed tests' ranks import


@pytest.fixture(scope="session", autouse=True)
def room_for_compiled_flex():
    """Tests that call compiled FlexAttention directly (not through a run, which reserves its own) ask
    for many shapes; past dynamo's default of 8 a shape would silently run the unfused eager path and
    test nothing compiled."""
    if torch.cuda.is_available():
        from megalysses.kernels.attention import reserve_compiles
        reserve_compiles(256)
    yield


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank gloo group in this process: a training run without spawning ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
