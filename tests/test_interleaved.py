"""The interleaved 1F1B schedule: every action exactly once, dependencies respected, and the bubble
shrinks with the number of virtual stages. (Numerical parity is in test_training_parity.py.)"""
import pytest

from megalysses.config import ConfigError
from megalysses.config.checks import validate_config
from megalysses.config.io import load_config
from megalysses.parallel.interleaved import rank_order, slot_schedule


@pytest.mark.parametrize("P,v,M", [(2, 1, 4), (2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 3, 16), (4, 4, 4)])
def test_schedule_complete_ordered_and_bubble(P, v, M):
    slots = slot_schedule(P, v, M)
    when = {}
    for t, row in enumerate(slots):
        for r, a in enumerate(row):
            if a is not None:
                key = (a.kind, a.mb, a.chunk * P + r)
                assert key not in when, f"{key} scheduled twice"
                when[key] = t
    V = P * v
    assert set(when) == {(k, m, s) for k in "FB" for m in range(M) for s in range(V)}
    for m in range(M):
        for s in range(V):
            if s > 0:
                assert when[("F", m, s)] > when[("F", m, s - 1)]
            assert when[("B", m, s)] > (when[("B", m, s + 1)] if s < V - 1 else when[("F", m, s)])
    # each rank is busy 2*M*v slots; the pipeline fill and drain add 2(P-1) slots of 1/v of a stage
    assert len(slots) == 2 * M * v + 2 * (P - 1)
    for r in range(P):
        assert len(rank_order(P, v, M, r)) == 2 * M * v


def test_forward_only_any_micro_batch_count():
    slots = slot_schedule(3, 2, 5, forward_only=True)
    assert sum(a is not None for row in slots for a in row) == 3 * 2 * 5


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel.virtual_stages=2"], 1, "needs parallel.pp >= 2"),
    (["parallel.pp=2", "parallel.virtual_stages=3", "model.num_layers=4"], 2, "pp * parallel.virtual_stages"),
    (["parallel.pp=2", "parallel.virtual_stages=2", "model.num_layers=4", "training.global_batch_size=3"], 2,
     "not a multiple of parallel.pp=2"),
])
def test_interleaving_config_errors(overrides, world, needle):
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*").replace("(", r"\(")):
        validate_config(load_config(overrides=["data.mock=true"] + overrides), world_size=world)
