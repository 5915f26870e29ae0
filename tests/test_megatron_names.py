"""Megatron-LM's names written as config keys get the key they are here (as parallel.dp gets its answer),
Megatron-LM's spellings of choice values read as ours, and a name whose meaning depends on its value says so."""
import pytest

from megalysses.config import ConfigError
from megalysses.config.io import load_config
from megalysses.config.megatron_names import FLAGS, answer_for, flags_for_key

# the names that once got a suggestion of an unrelated key, each with the key it is
EIGHT = [("parallel.cp", "parallel.sp"), ("context_parallel_size", "parallel.sp"),
         ("optimizer.lr_decay_style", "optimizer.schedule"), ("model.num_attention_heads", "model.num_heads"),
         ("model.num_query_groups", "model.num_kv_heads"), ("data.data_path", "data.paths"),
         ("training.recompute_granularity", "training.activation_checkpointing"),
         ("model.position_embedding_type", "rotary embeddings only")]


@pytest.mark.parametrize("name,answer", EIGHT)
def test_megatron_names_point_at_the_key(name, answer, tmp_path):
    """As --set and in a YAML file: one line naming the Megatron-LM flag and what it is here."""
    section, _, key = name.rpartition(".")
    text = f"{section}:\n  {key}: 2\n" if section else f"{key}: 2\n"
    (tmp_path / "c.yaml").write_text(text + ("data:\n  mock: true\n" if section != "data" else "  mock: true\n"))
    for source in (dict(overrides=["data.mock=true", f"{name}=2"]), dict(path=tmp_path / "c.yaml")):
        with pytest.raises(ConfigError) as e:
            load_config(**source)
        message = str(e.value)
        assert f"unknown config key '{name}': that is Megatron-LM's --" in message and answer in message, message
        assert "did you mean" not in message and "\n" not in message


def test_the_answer_depends_on_the_value_where_the_meaning_does():
    selective = answer_for("training.recompute_granularity", "selective")
    assert "recomputes core attention only" in selective and "recompute_attention: false is the opposite" in selective
    assert "activation_checkpointing: true" in answer_for("training.recompute_granularity", "full")
    assert "drop the key" in answer_for("model.position_embedding_type", "rope")
    assert "not available" in answer_for("model.position_embedding_type", "learned_absolute")
    with pytest.raises(ConfigError, match="selective recomputes core attention only"):
        load_config(overrides=["data.mock=true", "training.recompute_granularity=selective"])
    assert answer_for("model.hiden_size") is None and answer_for("model.num_layers_x") is None
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):        # typos still get the nearest key
        load_config(overrides=["data.mock=true", "model.hiden_size=3"])


def test_every_key_named_in_the_table_exists():
    import dataclasses

    from megalysses.config import Config

    def keys(node, prefix=""):
        for k, v in node.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    named = {k for flag in FLAGS.values() for k in flag.keys}
    assert named <= set(keys(dataclasses.asdict(Config()))), named - set(keys(dataclasses.asdict(Config())))
    assert flags_for_key("parallel.sp") == ["--context-parallel-size"]


def test_megatron_spellings_of_values():
    base = ["data.mock=true"]
    assert load_config(overrides=base + ["model.norm=RMSNorm"]).model.norm == "rmsnorm"
    assert load_config(overrides=base + ["model.norm=LayerNorm"]).model.norm == "layernorm"
    assert load_config(overrides=base + ["model.attention_backend=unfused"]).model.attention_backend == "reference"
    with pytest.raises(ConfigError, match="model.norm: 'BatchNorm' is not one of"):
        load_config(overrides=base + ["model.norm=BatchNorm"])


def test_megatron_spelling_wsd_implies_exponential(tmp_path):
    base = ["data.mock=true"]
    assert load_config(overrides=base + ["optimizer.schedule=WSD"]).optimizer.wsd_decay_style == "exponential"
    assert load_config(overrides=base + ["optimizer.schedule=wsd"]).optimizer.wsd_decay_style == "linear"
    for given in (["optimizer.schedule=WSD", "optimizer.wsd_decay_style=cosine"],
                  ["optimizer.wsd_decay_style=cosine", "optimizer.schedule=WSD"]):
        assert load_config(overrides=base + given).optimizer.wsd_decay_style == "cosine"
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  mock: true\noptimizer:\n  schedule: WSD\n  lr: 1.0e-3\n")
    cfg = load_config(p)
    assert (cfg.optimizer.schedule, cfg.optimizer.wsd_decay_style) == ("wsd", "exponential")
    p.write_text("data:\n  mock: true\noptimizer:\n  schedule: WSD\n  wsd_decay_style: minus_sqrt\n")
    assert load_config(p).optimizer.wsd_decay_style == "minus_sqrt"
