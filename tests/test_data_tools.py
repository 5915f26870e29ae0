"""The data side of generate and plot_metrics: the run's tokenizer (any kind) loaded before the model,
prompts encoded as the training documents were, and metrics files with damaged lines still plotted (with the
long-context panels when long_eval logged)."""
import json

from megalysses.config.io import load_config, save_config
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


def _start(run, step, layout):
    return {"event": "start", "run": run, "step": step, "tokens": 64 * step, "layout": layout}


def test_plot_compares_runs_and_marks_restarts_and_layout_changes(tmp_path, capsys):
    """Two runs against tokens: run a restarted at step 4 with another layout, then again from its step-2
    checkpoint (steps 3-4 trained again: the later records are drawn); run b, of another batch size, never
    restarted. A run logged before tokens were counted can be drawn against steps only."""
    tp2, dp2 = {"tp": 2, "sp": 1, "pp": 1, "dp": 1}, {"tp": 1, "sp": 1, "pp": 1, "dp": 2}
    a = [_start(1, 0, tp2)] + [{"step": s, "tokens": 64 * s, "loss": 5.0 - s / 10} for s in (1, 2, 3, 4)]
    a += [_start(2, 4, dp2), {"step": 5, "tokens": 320, "loss": 4.4}, {"step": 6, "tokens": 384, "loss": 4.3},
          {"step": 6, "tokens": 384, "val_loss": 4.5}]
    a += [_start(3, 2, dp2), {"step": 3, "tokens": 192, "loss": 4.0}, {"step": 4, "tokens": 256, "loss": 3.9}]
    b = [_start(1, 0, tp2)] + [{"step": s, "tokens": 128 * s, "loss": 5.0 - s / 5} for s in (1, 2, 3)]
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = plot_metrics.timeline("a", plot_metrics.read_metrics(tmp_path / "a" / "metrics.jsonl")[0])
    assert [(r["step"], r["loss"]) for r in run.train] == [(1, 4.9), (2, 4.8), (3, 4.0), (4, 3.9)]
    assert run.val == []                               # step 6's validation was superseded with it
    assert [(e["tokens"], e["label"], e["layout_change"]) for e in run.events] == [
        (256, "tp2·sp1·pp1·dp1 -> tp1·sp1·pp1·dp2", True), (128, "resumed at step 2", False)]
    out = tmp_path / "compare.png"
    argv = [str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl"), "--x", "tokens", "--output", str(out)]
    assert plot_metrics.main(argv) == 0 and out.stat().st_size > 10_000
    assert "(2 restarts marked)" in capsys.readouterr().out
    assert plot_metrics.main(argv[:2]) == 1 and "give the image's path with --output" in capsys.readouterr().err
    (tmp_path / "b" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    assert plot_metrics.main(argv) == 1 and "plot it against --x step" in capsys.readouterr().err
    assert plot_metrics.main(argv[:2] + ["--output", str(out)]) == 0
