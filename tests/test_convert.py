"""Hugging Face <-> megalysses: tools/convert_checkpoint.py both ways, checkpoint.init_from, and training
in between; transformers loads what comes back. (fp32, CPU; a tiny Llama with GQA, llama3 RoPE scaling,
attention biases without MLP biases, and a vocabulary that needs padding.)"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megalysses.data import MockGPTDataset  # noqa: E402
from megalysses.model.gpt import GPTStage  # noqa: E402
from megalysses.model.hf import model_config_from_hf, our_tensor  # noqa: E402
from megalysses.model.hf_io import open_hf_dir  # noqa: E402
from megalysses.tools import convert_checkpoint, generate  # noqa: E402
from tests.fixtures import losses  # noqa: E402
from test_data_hf_tokenizer import word_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
S, V = 48, 100


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=True, mlp_bias=False,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.3, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    hf.save_pretrained(out, max_shard_size="40KB")                # several shards and an index
    return out


def load_hf(path):
    return transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def test_our_model_equals_transformers_with_llama3_rope_scaling(hf_dir):
    hf = load_hf(hf_dir)
    config, tensors = open_hf_dir(hf_dir)
    cfg = model_config_from_hf(config, attention_backend="reference")
    assert cfg.rope_scaling.type == "llama3" and cfg.attention_bias and not cfg.mlp_bias
    ours = GPTStage(cfg).eval()
    ours.load_state_dict({n: our_tensor(n, cfg, tensors.get) for n, _ in ours.named_parameters()})
    ids = torch.randint(0, V, (2, 120))                           # well past the original 16 positions
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(120).expand(2, 120))[..., :V], hf(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling_from_the_transformers_4_key(hf_dir, tmp_path):
    """A config.json as transformers 4 writes it (rope_theta at the top, llama3 scaling under rope_scaling,
    no rope_parameters), with other scaling values than the fixture's: both readers take them."""
    folder = tmp_path / "v4"
    shutil.copytree(hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 32}
    config.update(rope_theta=20000.0, rope_scaling=scaling, max_position_embeddings=256)
    (folder / "config.json").write_text(json.dumps(config))

    cfg = model_config_from_hf(json.loads((folder / "config.json").read_text()), attention_backend="reference")
    rs = cfg.rope_scaling
    assert cfg.rope_theta == 20000.0
    assert (rs.type, rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings) == \
        ("llama3", 8.0, 2.0, 8.0, 32)
    _, tensors = open_hf_dir(folder)
    ours = GPTStage(cfg).eval()
    ours.load_state_dict({n: our_tensor(n, cfg, tensors.get) for n, _ in ours.named_parameters()})
    ids = torch.randint(0, V, (2, 120))                           # well past the original 32 positions
    hf = load_hf(folder)
    assert {k: hf.config.rope_parameters[k] for k in scaling} == scaling     # transformers read the key too
    with torch.no_grad():
        theirs = hf(ids).logits
        torch.testing.assert_close(ours(ids, torch.arange(120).expand(2, 120))[..., :V], theirs,
                                   rtol=1e-5, atol=1e-5)
        assert (theirs - load_hf(hf_dir)(ids).logits).abs().max() > 1e-4     # other frequencies than the fixture's


def test_generate_from_a_hugging_face_directory(hf_dir, tmp_path, capsys):
    """tools/generate.py --hf, greedy, two prompts batched (left-padded): the text transformers' generate
    gives for each prompt alone, cut at the model's EOS as ours stops there."""
    folder = tmp_path / "with-tokenizer"
    hf = load_hf(hf_dir)
    with torch.no_grad():                                          # larger weights: varied greedy text
        for name, p in hf.named_parameters():
            if not name.endswith("bias") and "norm" not in name:
                p.mul_(16)
    hf.save_pretrained(folder)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, V)]    # every model id is a word
    word_tokenizer(folder, words)
    prompts, new = ["w5 w17 w3 w60 w9", "w40 w41"], 12
    argv = ["--hf", str(folder), "--temperature", "0", "--max-new-tokens", str(new)]
    assert generate.main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err
    assert out.startswith(f"--- sampled from {folder} ---\n")
    got = out.split("\n", 1)[1].rstrip("\n").split("\n---\n")
    tok = generate.build_tokenizer("huggingface", str(folder))
    assert tok.eod_id == hf.generation_config.eos_token_id == 2
    want = []
    for prompt in prompts:
        ids = [words.index(w) for w in prompt.split()]
        row = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)[0].tolist()
        tail = row[len(ids):]
        tail = tail[:tail.index(2)] if 2 in tail else tail
        assert len(set(tail)) >= 5, tail                         # varied text, not one token repeated
        want.append(tok.decode(ids + tail))
    assert got == want
    # past the model's max_position_embeddings (256) a warning says the text is unreliable
    assert generate.main(["--hf", str(folder), "--max-new-tokens", "252", "--prompt", prompts[0]]) == 0
    assert "come to 257 tokens, past the 256 the model was trained at" in capsys.readouterr().err


def test_round_trip_without_training_is_exact(hf_dir, tmp_path):
    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--to", str(tmp_path / "run")]) == 0
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_0000000" / "meta.json").read_text())
    assert meta["weights_only"] and meta["model_shape"]["padded_vocab_size"] == 128
    assert convert_checkpoint.main(["--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back"),
                                    "--dtype", "float32", "--max-shard-gib", "0.00005"]) == 0
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, V, (2, 64))
    with torch.no_grad():
        diff = (load_hf(hf_dir)(ids).logits - load_hf(tmp_path / "back")(ids).logits).abs().max().item()
    assert diff <= 1e-5
    # a config.yaml that does not describe the checkpoint's model is an error, not a model transformers rejects
    config = tmp_path / "run" / "config.yaml"
    config.write_text(config.read_text().replace("hidden_size: 64", "hidden_size: 128"))
    with pytest.raises(convert_checkpoint.ConvertError, match="another model than its config.yaml describes "
                                                              r"\(hidden_size: checkpoint 64 vs config 128\)"):
        convert_checkpoint.to_hf(str(tmp_path / "run"), str(tmp_path / "wrong"))


def test_the_tokenizer_travels_with_the_model(hf_dir, tmp_path, capsys):
    """--from-hf points the run at the model's own tokenizer.json (--config's tokenizer does not number the
    model's ids); --to-hf puts the run's Hugging Face tokenizer beside the weights."""
    folder = tmp_path / "with-tokenizer"
    shutil.copytree(hf_dir, folder)
    word_tokenizer(folder, ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, V)])
    config = tmp_path / "sp.yaml"
    config.write_text("data:\n  tokenizer: sentencepiece\n  tokenizer_model: data/tokenizer.model\n")
    assert convert_checkpoint.main(["--from-hf", str(folder), "--to", str(tmp_path / "run"),
                                    "--config", str(config)]) == 0
    data = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]
    own = tmp_path / "run" / "tokenizer"         # the run's own copy: the Hugging Face folder may go
    assert (data["tokenizer"], data["tokenizer_model"]) == ("huggingface", str(own))
    assert (own / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert convert_checkpoint.main(["--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back")]) == 0
    assert "the run's tokenizer (tokenizer.json" in capsys.readouterr().out
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert generate.build_tokenizer("huggingface", str(tmp_path / "back")).eod_id == 2
    # a tokenizer named with --set is the user's choice
    assert convert_checkpoint.main(["--from-hf", str(folder), "--to", str(tmp_path / "byte"),
                                    "--set", "data.tokenizer=byte"]) == 0
    assert yaml.safe_load((tmp_path / "byte" / "config.yaml").read_text())["data"]["tokenizer"] == "byte"
    assert convert_checkpoint.main(["--from", str(tmp_path / "byte"), "--to-hf", str(tmp_path / "byte_hf")]) == 0
    assert "no tokenizer: the run's (data.tokenizer=byte)" in capsys.readouterr().out
    assert not (tmp_path / "byte_hf" / "tokenizer.json").exists()


def torchrun(nproc, config, overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "pretrain.py"), "--config", str(config)] + [a for o in overrides for a in ("--set", o)]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=180)


TRAIN = ["data.mock=true", f"data.seq_len={S}", "data.document_mask=false", "data.reset_position_ids=false",
         "training.global_batch_size=2", "training.micro_batch_size=1", "training.train_steps=2",
         "logging.log_interval=1", "optimizer.warmup_steps=1", "model.attention_backend=sdpa",
         "parallel.timeout_seconds=60"]


def hf_loss_on_first_batch(path) -> float:
    """transformers' mean loss over the first global batch of the mock data a run sees."""
    data = MockGPTDataset(2 * 2, S, V, V - 1, 1234)
    tokens = torch.from_numpy(np.stack([data[0], data[1]]).astype(np.int64))
    with torch.no_grad():
        labels = tokens[:, 1:].contiguous()
        return load_hf(path)(input_ids=tokens[:, :-1].contiguous(), labels=labels, shift_labels=labels).loss.item()


def first_loss(run: Path) -> float:
    return losses(run)[0]


def test_hf_to_megalysses_train_and_back(hf_dir, tmp_path):
    """The documented path: convert, train at tp=2 (the first loss is transformers' loss on the same
    batch), convert back; transformers loads the trained model. And init_from a Hugging Face directory
    at another layout starts from the same weights."""
    run = tmp_path / "run"
    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--to", str(run)]) == 0
    want = hf_loss_on_first_batch(hf_dir)
    r = torchrun(2, run / "config.yaml", TRAIN + ["parallel.tp=2"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"initial weights: {run / 'checkpoints' / 'step_0000000'} (weights only)" in r.stdout
    assert abs(first_loss(run) - want) <= 1e-5 * want
    back = ["--from", str(run), "--to-hf", str(tmp_path / "trained"), "--dtype", "float32"]
    assert convert_checkpoint.main(back) == 0
    trained = load_hf(tmp_path / "trained")
    ids = torch.randint(0, V, (1, 32))
    with torch.no_grad():
        before, after = load_hf(hf_dir)(ids).logits, trained(ids).logits
    assert torch.isfinite(after).all() and (before - after).abs().max() > 1e-4     # training changed it
    # trained at 48 tokens, the export keeps the imported model's 256, its special tokens and generation config
    assert (trained.config.max_position_embeddings, trained.config.bos_token_id, trained.config.eos_token_id) == \
        (256, 1, 2)
    assert (tmp_path / "trained" / "generation_config.json").read_bytes() == \
        (hf_dir / "generation_config.json").read_bytes()

    fresh = tmp_path / "fresh"
    r = torchrun(2, run / "config.yaml", TRAIN + ["parallel.tp=1", "parallel.sp=2", f"checkpoint.init_from={hf_dir}",
                                                  f"logging.run_dir={fresh}", "training.train_steps=1"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"initial weights: the Hugging Face model {hf_dir}" in r.stdout
    assert abs(first_loss(fresh) - want) <= 1e-5 * want
    # init_from a Hugging Face directory: the same, read from that directory
    assert convert_checkpoint.main(["--from", str(fresh), "--to-hf", str(tmp_path / "fresh_hf")]) == 0
    config = json.loads((tmp_path / "fresh_hf" / "config.json").read_text())
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (256, 1, 2)
    assert (tmp_path / "fresh_hf" / "generation_config.json").is_file()


def pretrain_in_process(config: Path, overrides: list[str], capsys) -> str:
    """pretrain's main in this process (a world of one); what it printed."""
    from megalysses.tools import pretrain

    assert pretrain.main(["--config", str(config)] + [a for o in overrides for a in ("--set", o)]) == 0
    return capsys.readouterr().out


def test_a_fine_tune_into_another_run_directory_starts_from_the_converted_weights(hf_dir, tmp_path, capsys):
    """One conversion, several fine-tunes: config.yaml's checkpoint.init_from names the converted step-0 weights,
    so a run directory of its own starts from them (its first loss is transformers' on the same batch), even
    after the converted run pruned its older checkpoints (the step-0 weights hold a KEEP file); every start
    says where its weights come from, random ones included."""
    run = tmp_path / "run"
    assert convert_checkpoint.main(["--from-hf", str(hf_dir), "--to", str(run)]) == 0
    step0 = run / "checkpoints" / "step_0000000"
    assert yaml.safe_load((run / "config.yaml").read_text())["checkpoint"]["init_from"] == str(step0)
    assert "checkpoint.init_from of" in (step0 / "KEEP").read_text()
    want = hf_loss_on_first_batch(hf_dir)
    one = TRAIN + ["training.train_steps=1"]

    # the converted run itself, pruned to its last checkpoint: the step-0 weights stay
    out = pretrain_in_process(run / "config.yaml", TRAIN + ["training.train_steps=3", "checkpoint.save_interval=1",
                                                            "checkpoint.keep_last=1"], capsys)
    assert f"initial weights: {step0} (weights only)" in out
    assert abs(first_loss(run) - want) <= 1e-5 * want
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000000", "step_0000003"]

    other = tmp_path / "other"
    out = pretrain_in_process(run / "config.yaml", one + [f"logging.run_dir={other}"], capsys)
    assert f"initial weights: {step0} (weights only)" in out
    assert abs(first_loss(other) - want) <= 1e-5 * want

    scratch = tmp_path / "scratch"
    out = pretrain_in_process(run / "config.yaml", one + [f"logging.run_dir={scratch}", "checkpoint.init_from=null",
                                                          "training.seed=7"], capsys)
    assert "initial weights: random (seed 7)" in out
    assert abs(first_loss(scratch) - want) > 1e-3 * want


@pytest.mark.parametrize("argv,message", [
    (["--from-hf", "{tmp}/nope", "--to", "{tmp}/run"], "is not a directory"),
    (["--from-hf", "{hf}"], "--from-hf needs --to"),
    (["--from", "{tmp}", "--to-hf", "{tmp}/out"], "no megalysses checkpoint there"),
    (["--from", "{tmp}/nope"], "--from needs --to-hf"),
])
def test_bad_arguments_get_one_message(hf_dir, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, hf=hf_dir) for a in argv]
    assert convert_checkpoint.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_families_convert_in_and_out(family, tmp_path):
    """A tiny Qwen2 (YaRN), Qwen3 (q/k norms, linear scaling) or Mistral (a sliding window) saved by transformers
    converts in and back out; transformers loads the export with the family's own config class and the
    model's generation config, and its logits are the original's."""
    from test_hf import family_model

    torch.manual_seed(0)
    hf = family_model(family)
    hf.save_pretrained(tmp_path / "hf")
    assert convert_checkpoint.main(["--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "run")]) == 0
    assert convert_checkpoint.main(["--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back"),
                                    "--dtype", "float32"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(back) is type(hf) and type(back.config) is type(hf.config)
    assert {k: v for k, v in back.config.rope_parameters.items() if k != "rope_theta"} == \
        {k: v for k, v in hf.config.rope_parameters.items() if k != "rope_theta"}
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "back").to_dict() == \
        transformers.GenerationConfig.from_pretrained(tmp_path / "hf").to_dict()
    ids = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_context_extension_sets_its_rope_scaling_at_conversion(tmp_path):
    """--from-hf takes the RoPE scaling (no tensor depends on it) from --set, and --to-hf writes it back: a Qwen2.5
    extended from its 64 positions with YaRN x4 exports as that model."""
    from test_hf import family_model

    torch.manual_seed(0)
    family_model("qwen2").save_pretrained(tmp_path / "hf")
    yarn = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0",
            "model.rope_scaling.original_max_position_embeddings=64"]
    assert convert_checkpoint.main(["--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "run"),
                                    *[a for s in yarn for a in ("--set", s)]]) == 0
    scaling = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["rope_scaling"]
    assert (scaling["type"], scaling["factor"], scaling["original_max_position_embeddings"]) == ("yarn", 4.0, 64)
    assert convert_checkpoint.main(["--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back")]) == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert {k: config.rope_parameters[k] for k in ("rope_type", "factor", "original_max_position_embeddings")} == \
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_a_rope_scaling_turned_on_at_conversion_takes_the_models_own_context(tmp_path, capsys):
    """--set model.rope_scaling.type=yarn on a model without scaling: original_max_position_embeddings is the model's
    own context (config.json's max_position_embeddings), not the schema's default; given, it is --set's. The hint
    to add data.paths comes only when the config has none."""
    from test_hf import family_model

    torch.manual_seed(0)
    family_model("mistral").save_pretrained(tmp_path / "hf")               # plain RoPE, 64 positions
    config = tmp_path / "with_data.yaml"
    config.write_text("data:\n  paths: [data/corpus_text_document]\n")
    argv = ["--from-hf", str(tmp_path / "hf"), "--set", "model.rope_scaling.type=yarn", "--set",
            "model.rope_scaling.factor=4"]
    assert convert_checkpoint.main(argv + ["--to", str(tmp_path / "a"), "--config", str(config)]) == 0
    assert "--set data.paths" not in capsys.readouterr().out
    scaling = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["model"]["rope_scaling"]
    assert (scaling["type"], scaling["original_max_position_embeddings"]) == ("yarn", 64)
    given = ["--set", "model.rope_scaling.original_max_position_embeddings=32"]
    assert convert_checkpoint.main(argv + given + ["--to", str(tmp_path / "b")]) == 0
    assert "--set data.paths=[...]" in capsys.readouterr().out
    scaling = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["model"]["rope_scaling"]
    assert scaling["original_max_position_embeddings"] == 32
