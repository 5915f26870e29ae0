"""The data side of generate and plot_metrics: the run's tokenizer (any kind) loaded before the model,
prompts encoded as the training documents were, and metrics files with damaged lines still plotted (with the
long-context panels when long_eval logged)."""
import json

from megalysses.config_io import load_config, save_config
from megalysses.tools import generate, plot_metrics


def test_generate_loads_the_runs_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "def": 3, "f": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    run = tmp_path / "run"
    base = ["data.mock=true", "model.vocab_size=8", "data.tokenizer=huggingface", f"data.tokenizer_model={tmp_path}"]
    save_config(load_config(None, base), run / "config.yaml")
    cfg, tok = generate.load_run(run)
    assert (tok.eod_id, tok.vocab_size) == (2, 5)
    assert generate.prompt_ids(tok, "def f", cfg.data.bos) == [3, 4]
    save_config(load_config(None, base + ["data.bos=<s>"]), run / "config.yaml")
    cfg, tok = generate.load_run(run)
    assert generate.prompt_ids(tok, "def f", cfg.data.bos) == [1, 3, 4]


def test_plot_skips_damaged_lines(tmp_path, capsys):
    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 100.0} for s in range(1, 6)]
    long_eval = {"step": 4, "long_eval/passkey/512": 0.5, "long_eval/niah/512": 0.25,
                 "long_eval/position-loss/512/0-1": 3.0, "long_eval/position-loss/512/1-2": 2.5}
    lines = [json.dumps(r) for r in rows] + ["\x00\x01 not json", '{"step": 3, "val_loss": 4.7}', '{"step": 6, "lo',
                                             json.dumps(long_eval)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert plot_metrics.main([str(tmp_path), "--output", str(tmp_path / "curves.svg")]) == 0
    svg = (tmp_path / "curves.svg").read_text()
    assert len(svg) > 1000 and svg.count('<g id="axes_') == 4        # loss, throughput, long context, by position
    assert "skipped 2 lines" in capsys.readouterr().err
    kept, skipped = plot_metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in kept] == [1, 2, 3, 4, 5, 3, 4] and skipped == 2
