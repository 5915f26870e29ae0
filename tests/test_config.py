"""Typed config: strict YAML, --set overrides, cross-field validation, round trip."""
import pytest

from megalysses.config import Config, ConfigError
from megalysses.config.checks import config_warnings, validate_config
from megalysses.config.io import absolute_paths, config_from_dict, dump_config, load_config, read_yaml, save_config


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_with_mock_data_validate():
    load_config(overrides=["data.mock=true"])


def test_unknown_key_names_path_and_suggestion(tmp_path):
    p = _write(tmp_path, "model:\n  hiden_size: 64\ndata:\n  mock: true\n")
    with pytest.raises(ConfigError, match=r"model\.hiden_size.*did you mean 'hidden_size'"):
        load_config(p)
    p = _write(tmp_path, "optimiser:\n  lr: 1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optimiser'.*'optimizer'"):
        load_config(p)


def test_wrong_types(tmp_path):
    cases = {
        "model:\n  num_layers: four\n": "model.num_layers",
        "model:\n  num_layers: 2.5\n": "model.num_layers",
        "optimizer:\n  lr: fast\n": "optimizer.lr",
        "model:\n  tie_embeddings: maybe\n": "model.tie_embeddings",
        "model:\n  norm: batchnorm\n": "model.norm",
        "data:\n  paths: 3\n": "data.paths",
        "model: 3\n": "model",
    }
    for text, field in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(_write(tmp_path, text))
        assert field in str(e.value), (text, str(e.value))
        assert "\n" not in str(e.value)


def test_overrides_parse_by_type():
    cfg = load_config(overrides=["data.mock=true", "optimizer.lr=3e-4", "parallel.tp=2", "model.tie_embeddings=true",
                                 "data.paths=[0.5, a, 0.5, b]", "model.num_kv_heads=2", "checkpoint.load=none"])
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.parallel.tp == 2 and cfg.model.tie_embeddings is True
    assert cfg.data.paths == ["0.5", "a", "0.5", "b"]
    assert cfg.model.num_kv_heads == 2 and cfg.checkpoint.load is None


def test_bad_overrides():
    for ov, needle in [("optimizer.lr", "section.key=value"), ("optimizer.lrr=1", "optimizer.lrr"),
                       ("optimizer=1", "is a section"), ("parallel.tp=two", "parallel.tp"),
                       ("model.hidden_size.x=1", "not a section")]:
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            load_config(overrides=["data.mock=true", ov])


def test_yaml_float_strings_are_numbers(tmp_path):
    cfg = load_config(_write(tmp_path, "optimizer:\n  lr: 3e-4\ndata:\n  mock: true\n"))
    assert cfg.optimizer.lr == 3e-4


def test_dp_is_derived_and_says_so(tmp_path):
    for source in (dict(overrides=["parallel.dp=2"]), dict(path=_write(tmp_path, "parallel:\n  dp: 2\n"))):
        with pytest.raises(ConfigError, match=r"'parallel.dp': data parallelism is what the processes leave over, "
                                              r"world size / \(tp \* sp \* pp\)"):
            load_config(**source)


def test_colon_separated_digits_stay_text(tmp_path):
    """YAML 1.1 reads 98:2:0 as the base-60 number 352920; a config reads what the user wrote."""
    for source in (dict(path=_write(tmp_path, "data:\n  mock: true\n  split: 98:2:0\n")),
                   dict(overrides=["data.mock=true", "data.split=98:2:0"])):
        with pytest.raises(ConfigError, match="split '98:2:0': '98:2:0' is not a number.*like '969,30,1'"):
            load_config(**source)
    cfg = load_config(_write(tmp_path, "data:\n  mock: true\n  split: 98,2,0\noptimizer:\n  lr: 1.5e-4\n"),
                      ["training.train_steps=0x10", "data.seq_len=1_024"])
    assert (cfg.data.split, cfg.optimizer.lr) == ("98,2,0", 1.5e-4)
    assert (cfg.training.train_steps, cfg.data.seq_len) == (16, 1024)


@pytest.mark.parametrize("overrides,needle", [
    (["model.num_heads=6"], "model.num_heads=6"),                          # 256 % 6
    (["parallel.tp=3"], "parallel.tp=3"),
    (["model.num_kv_heads=3"], "num_kv_heads=3"),
    (["parallel.sp=4", "model.num_kv_heads=2", "parallel.tp=4"], "num_kv_heads=2 is not divisible by parallel.tp=4"),
    (["parallel.sp=4", "parallel.sp_ring=3"], "parallel.sp_ring=3 does not divide parallel.sp=4"),
    (["parallel.sp=16", "parallel.sp_ring=1"], "parallel.sp_ring=1 leaves a Ulysses degree of 16"),
    (["parallel.sp_ring=-1"], "parallel.sp_ring=-1"),
    (["model.num_layers=3", "parallel.pp=2"], "model.num_layers=3"),
    (["data.mock=false"], "data.paths"),
    (["data.tokenizer=sentencepiece"], "tokenizer_model"),
    (["logging.log_interval=0"], "logging.log_interval=0"),
    (["training.eval_steps=0"], "training.eval_steps=0"),
    (["optimizer.decay_fraction=1.5"], "optimizer.decay_fraction=1.5"),
    (["training.mlp_chunk_tokens=-1"], "training.mlp_chunk_tokens=-1"),
    (["parallel.grad_bucket_elements=0"], "parallel.grad_bucket_elements=0"),
])
def test_cross_field_rules(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["data.mock=true"] + overrides)
    assert needle in str(e.value)


def test_sp_is_ulysses_times_ring_and_any_length_is_valid():
    """Layouts Ulysses alone cannot run get a ring; an explicit ring is honoured when the heads allow it."""
    from megalysses.config.checks import check_heads
    from megalysses.plan import Machine, resolve

    assert check_heads(8, 8, 1, 3) == (1, 3)                 # 8 heads over 3 ranks: ring only
    assert check_heads(2, 1, 1, 4) == (2, 2)                 # the MQA example
    assert check_heads(32, 8, 1, 16) == (16, 1)              # Llama-3-8B: KV heads replicated up to 16
    assert check_heads(32, 8, 4, 16) == (8, 2)               # 8 query heads per tp rank
    assert check_heads(1, 1, 1, 8) == (1, 8)
    assert check_heads(8, 2, 1, 8, sp_ring=4) == (2, 4)
    # with the node size known, Ulysses stays inside a node and the ring crosses nodes
    assert check_heads(32, 8, 1, 64, ranks_per_node=8) == (8, 8)
    assert check_heads(32, 8, 1, 64) == (32, 2)
    assert check_heads(32, 8, 4, 16, ranks_per_node=8) == (2, 8)
    assert check_heads(32, 8, 8, 8, ranks_per_node=8) == (1, 8)
    assert check_heads(32, 8, 1, 16, ranks_per_node=6) == (2, 8)     # a 4-rank block would straddle nodes
    assert check_heads(32, 8, 1, 8, ranks_per_node=16) == (8, 1)
    assert check_heads(32, 8, 1, 8, sp_ring=2, ranks_per_node=2) == (4, 2)   # explicit: honoured as given
    for overrides in (["parallel.sp=3"], ["data.seq_len=100", "parallel.sp=8"],
                      ["data.seq_len=36", "parallel.sp=2", "parallel.tp=4", "parallel.tp_sequence_parallel=true"],
                      ["model.num_heads=2", "model.hidden_size=64", "model.num_kv_heads=1", "parallel.sp=4",
                       "data.seq_len=250"]):
        cfg = load_config(overrides=["data.mock=true"] + overrides)
        p = cfg.parallel
        run = resolve(cfg, Machine.described(None, ranks_per_node=0), p.tp * p.sp)
        assert run.degrees.ulysses * run.degrees.ring == p.sp


def test_ulysses_degree_follows_the_launchers_node_size(monkeypatch):
    """The machine a run resolves on is the launcher's: its ranks per node (LOCAL_WORLD_SIZE) keep
    Ulysses inside a node; a described machine says its own."""
    from megalysses.plan import Machine, resolve

    cfg = load_config(overrides=["data.mock=true", "model.num_heads=32", "model.num_kv_heads=8",
                                 "model.hidden_size=512", "parallel.sp=16"])

    def split(machine):
        run = resolve(cfg, machine, 16)
        return run.degrees.ulysses, run.degrees.ring

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert split(Machine.current()) == (16, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert split(Machine.current()) == (8, 2)
    assert split(Machine.described(None, ranks_per_node=4)) == (4, 4)


def test_world_size_rules():
    cfg = load_config(overrides=["data.mock=true", "parallel.tp=2", "training.global_batch_size=6"])
    with pytest.raises(ConfigError, match="world size 3"):
        validate_config(cfg, world_size=3)
    with pytest.raises(ConfigError, match="global_batch_size=6.*dp=4"):
        validate_config(cfg, world_size=8)
    validate_config(cfg, world_size=6)


def test_round_trip(tmp_path):
    cfg = load_config(overrides=["data.mock=true", "optimizer.lr=1e-3", "data.paths=[/d/a,/d/b]",
                                 "model.num_kv_heads=4", "logging.run_dir=/r/x"])
    save_config(cfg, tmp_path / "out.yaml")
    again = load_config(tmp_path / "out.yaml")
    assert again == cfg
    assert config_from_dict({}) == Config()
    assert "num_kv_heads: 4" in dump_config(cfg)


def test_a_runs_config_names_its_files_absolute(tmp_path, monkeypatch):
    """A run's config.yaml reads the same from any directory: the files and folders it names are absolute
    (a blend's weights stay numbers), "auto" and None stay what they are."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["data.paths=[0.3,d/a,0.7,/abs/b]", "data.valid_paths=[v]",
                                 "data.tokenizer=sentencepiece", "data.tokenizer_model=tok/sp.model",
                                 "logging.run_dir=runs/x", "checkpoint.init_from=../hf"])
    save_config(cfg, tmp_path / "runs" / "x" / "config.yaml")
    monkeypatch.chdir("/")
    again = load_config(tmp_path / "runs" / "x" / "config.yaml")
    d = again.data
    assert d.paths == ["0.3", str(tmp_path / "d" / "a"), "0.7", "/abs/b"] and d.valid_paths == [str(tmp_path / "v")]
    assert d.tokenizer_model == str(tmp_path / "tok" / "sp.model") and d.vocab_file is None
    assert again.logging.run_dir == str(tmp_path / "runs" / "x") and again.checkpoint.load == "auto"
    assert again.checkpoint.init_from == str(tmp_path.parent / "hf")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "model: [\n"))


def test_no_float_field_takes_nan_or_inf(tmp_path):
    """Every float field, however the value arrives: --set, YAML, or a Config built in code."""
    import dataclasses

    defaults = Config()
    floats = [(sec.name, f.name) for sec in dataclasses.fields(defaults)
              for f in dataclasses.fields(getattr(defaults, sec.name))
              if isinstance(getattr(getattr(defaults, sec.name), f.name), float)]
    assert len(floats) >= 14
    for section, name in floats:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError, match=f"{section}.{name}.*not a finite number"):
                load_config(overrides=["data.mock=true", f"{section}.{name}={bad}"])
        cfg = load_config(overrides=["data.mock=true"])
        setattr(getattr(cfg, section), name, float("nan"))
        with pytest.raises(ConfigError, match=f"{section}.{name}=nan"):
            validate_config(cfg)
    with pytest.raises(ConfigError, match="optimizer.lr"):
        load_config(_write(tmp_path, "optimizer:\n  lr: .nan\ndata:\n  mock: true\n"))


def test_duplicate_keys_and_encodings(tmp_path):
    with pytest.raises(ConfigError, match="'model' appears twice"):
        load_config(_write(tmp_path, "model:\n  num_layers: 2\ndata:\n  mock: true\nmodel:\n  hidden_size: 64\n"))
    p = tmp_path / "latin1.yaml"
    p.write_bytes("model:\n  norm: rmsnorm # \xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    merged = "base: &b\n  num_layers: 2\n  hidden_size: 64\nmodel:\n  <<: *b\n  num_layers: 4\n"
    assert read_yaml(_write(tmp_path, merged))["model"] == {"num_layers": 4, "hidden_size": 64}   # YAML merge keys
    with pytest.raises(ConfigError, match="model: expected a mapping"):   # not silently replaced by the override
        load_config(_write(tmp_path, "model: 3\ndata:\n  mock: true\n"), overrides=["model.num_layers=2"])


def test_warnings_for_legal_but_suspicious_settings():
    assert config_warnings(load_config(overrides=["data.mock=true"])) == []
    notes = config_warnings(load_config(overrides=["data.mock=true", "optimizer.lr=0", "training.train_steps=10"]))
    assert len(notes) == 2 and "optimizer.lr=0" in notes[0] and "warmup_steps=100" in notes[1]
    notes = config_warnings(load_config(overrides=["data.mock=true", "optimizer.min_lr=1e-2"]))
    assert notes == [notes[0]] and "min_lr=0.01 is above optimizer.lr" in notes[0]


SCHEDULE = ["data.mock=true", "data.seq_len=32", "training.train_steps=6"]


def test_seq_len_schedule_lookup_and_round_trip(tmp_path):
    cfg = load_config(overrides=SCHEDULE + ["data.seq_len_schedule=[[0, 8], [2, 16], [4, 32]]"])
    assert cfg.data.seq_len_schedule == [[0, 8], [2, 16], [4, 32]]
    # from_step counts completed steps: steps 1-2 (after 0, 1 done) at 8, 3-4 at 16, then 32
    assert [cfg.data.seq_len_at(done) for done in range(8)] == [8, 8, 16, 16, 32, 32, 32, 32]
    assert not [n for n in config_warnings(cfg) if "seq_len_schedule" in n]
    save_config(cfg, tmp_path / "out.yaml")
    assert load_config(tmp_path / "out.yaml") == absolute_paths(cfg)
    plain = load_config(overrides=SCHEDULE)
    assert plain.data.seq_len_schedule == [] and {plain.data.seq_len_at(s) for s in range(8)} == {32}


@pytest.mark.parametrize("schedule,message", [
    ("[[1, 8], [4, 32]]", r"seq_len_schedule\[0\]=\[1, 8\]: the first entry must start at step 0.*make it \[0, 8\]"),
    ("[[0, 8], [4, 16], [4, 32]]", (r"seq_len_schedule\[2\]=\[4, 32\]: from_step 4 is not after the previous "
                                    r"entry's 4.*strictly increasing")),
    ("[[0, 8], [4, 16], [3, 32]]", r"seq_len_schedule\[2\]=\[3, 32\]: from_step 3 is not after"),
    ("[[0, 16], [2, 8], [4, 32]]", (r"seq_len_schedule\[1\]=\[2, 8\]: seq_len 8 is shorter than the previous "
                                    r"entry's 16.*must not decrease")),
    ("[[0, 12], [4, 32]]", (r"seq_len_schedule\[0\]=\[0, 12\]: seq_len 12 does not divide data.seq_len=32.*use "
                            r"a divisor of 32")),
    ("[[0, 8], [2, 16]]", (r"seq_len_schedule ends at seq_len 16 but data.seq_len=32 is the final length: "
                           r"append \[from_step, 32\].*or set data.seq_len=16")),
    ("[[0, 8, 1], [4, 32]]", r"seq_len_schedule\[0\]=\[0, 8, 1\]: each entry is a \[from_step, seq_len\] pair"),
    ("[[0], [4, 32]]", r"seq_len_schedule\[0\]=\[0\]: each entry is a \[from_step, seq_len\] pair"),
    ("[[0, 0], [4, 32]]", r"seq_len_schedule\[0\]=\[0, 0\]: seq_len 0 must be >= 1"),
    ("[[0, -8], [4, 32]]", r"seq_len_schedule\[0\]=\[0, -8\]: seq_len -8 must be >= 1"),
    ("[0, 32]", r"data.seq_len_schedule\[0\]: expected a list"),
    ("[[0, eight]]", r"data.seq_len_schedule\[0\]\[1\]: expected an integer"),
])
def test_bad_seq_len_schedule_is_one_config_error(schedule, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(overrides=SCHEDULE + [f"data.seq_len_schedule={schedule}"])
    assert "\n" not in str(e.value)


def test_seq_len_schedule_phase_after_the_last_step_is_a_warning():
    cfg = load_config(overrides=SCHEDULE + ["data.seq_len_schedule=[[0, 8], [6, 32]]"])
    notes = [n for n in config_warnings(cfg) if "seq_len_schedule" in n]
    assert len(notes) == 1 and "phase from step 6 (seq_len 32)" in notes[0] and "train_steps=6" in notes[0]
