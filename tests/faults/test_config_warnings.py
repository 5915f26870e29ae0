"""Settings that are legal but almost certainly not meant (optimizer.min_lr above optimizer.lr,
warmup longer than the run, optimizer.lr=0) were accepted without a word: each now gets one warning
line from pretrain, and the run goes on to train."""
import contextlib
import hashlib
import io
import json
from pathlib import Path

from tests.faults.launch import TINY


def _pretrain(run: Path, *overrides: str) -> tuple[int, str]:
    """pretrain's main in this process (a world of one); (exit status, everything it printed)."""
    from megalysses.tools.pretrain import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main([a for o in TINY + [f"logging.run_dir={run}", "training.train_steps=2", *overrides]
                       for a in ("--set", o)])
    return status, out.getvalue()


def _trained(run: Path, out: str) -> list[int]:
    done = [line for line in out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and done[0].startswith("done: step 2, loss "), out
    return [rec["step"] for rec in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in rec]


def _warnings(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("warning:")]


def test_min_lr_above_lr_and_warmup_past_the_end_warn_and_train(tmp_path):
    status, out = _pretrain(tmp_path / "run", "optimizer.lr=1e-3", "optimizer.min_lr=1e-2",
                            "optimizer.warmup_steps=5")
    assert status == 0, out
    warnings = _warnings(out)
    assert len(warnings) == 2, out
    assert "optimizer.min_lr=0.01 is above optimizer.lr=0.001" in warnings[0]
    assert "optimizer.warmup_steps=5 is more than training.train_steps=2" in warnings[1]
    assert _trained(tmp_path / "run", out) == [1, 2]


def test_lr_zero_warns_and_trains(tmp_path):
    status, out = _pretrain(tmp_path / "run", "optimizer.lr=0")
    assert status == 0, out
    assert _warnings(out) == ["warning: optimizer.lr=0: the weights will not change"], out
    assert _trained(tmp_path / "run", out) == [1, 2]


def test_data_of_another_tokenizer_warns_naming_both_and_trains(tmp_path):
    """Byte-tokenized data (every id inside a 300-piece sentencepiece vocabulary) trained with that sentencepiece
    model: one warning naming both tokenizers, from the identity preprocessing wrote beside the data; none with
    the tokenizer that wrote it, nor for data that records none (older datasets)."""
    from megalysses.data.tokenizer_identity import sidecar_path
    from megalysses.tools.preprocess_data import main as preprocess
    from tests.faults.cases_data import sp_model

    docs = "".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * 4}) + "\n" for i in range(40))
    (tmp_path / "in.jsonl").write_text(docs)
    preprocess(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "d"), "--append-eod",
                "--log-interval", "0"])
    data = ["data.mock=false", f"data.paths=[{tmp_path / 'd_text_document'}]", "model.vocab_size=512",
            "data.split=100,0,0", "training.eval_interval=0", "checkpoint.save_interval=0"]
    model = sp_model(tmp_path)
    status, out = _pretrain(tmp_path / "sp", *data, "data.tokenizer=sentencepiece", f"data.tokenizer_model={model}")
    assert status == 0, out
    digest = hashlib.sha256(Path(model).read_bytes()).hexdigest()[:12]
    assert _warnings(out) == [(f"warning: {tmp_path / 'd_text_document'} was tokenized with byte (259 ids, EOD 257), "
                               f"but this run's tokenizer is sentencepiece sp.model (sha256 {digest}, 300 ids, EOD 2): "
                               f"set data.tokenizer (and data.tokenizer_model, data.eod) to the one that wrote it, or "
                               f"re-tokenize it")], out
    assert _trained(tmp_path / "sp", out) == [1, 2]
    status, out = _pretrain(tmp_path / "byte", *data, "data.tokenizer=byte")
    assert status == 0 and _warnings(out) == [], out
    Path(sidecar_path(tmp_path / "d_text_document")).unlink()
    status, out = _pretrain(tmp_path / "old", *data, "data.tokenizer=sentencepiece", f"data.tokenizer_model={model}")
    assert status == 0 and _warnings(out) == [], out


def test_a_rope_scaling_factor_without_its_type_warns_and_trains(tmp_path):
    """model.rope_scaling.factor (or any of its fields) set while the type is none applies to nothing: one line says
    so and names the key that turns it on."""
    status, out = _pretrain(tmp_path / "run", "model.rope_scaling.factor=4")
    assert status == 0, out
    assert _warnings(out) == [("warning: model.rope_scaling.factor=4.0 is unused: model.rope_scaling.type is none "
                               "(plain RoPE); set model.rope_scaling.type (llama3, linear or yarn) to apply it")], out
    assert _trained(tmp_path / "run", out) == [1, 2]
    from megalysses.config import Config, ModelConfig, RopeScalingConfig
    from megalysses.config.checks import config_warnings

    assert config_warnings(Config(model=ModelConfig(rope_scaling=RopeScalingConfig(type="linear", factor=4)))) == []
    two = config_warnings(Config(model=ModelConfig(rope_scaling=RopeScalingConfig(factor=4, beta_fast=16))))
    assert two == [("model.rope_scaling.factor=4, model.rope_scaling.beta_fast=16 are unused: model.rope_scaling.type "
                    "is none (plain RoPE); set model.rope_scaling.type (llama3, linear or yarn) to apply it")]
