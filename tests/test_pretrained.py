"""Starting from GPT-2: Hugging Face folders in (init_from, sample.py) and out (export_hf.py).

Offline: the "GPT-2" here is a randomly initialised transformers GPT2LMHeadModel of GPT-2's
vocabulary, saved into a temporary folder, never the released weights."""

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from harness import SEPARATOR, flip_a_bit, python, run_world, tiny_args

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import checkpoint  # noqa: E402
import data.files  # noqa: E402
import pretrained  # noqa: E402
from config import Config  # noqa: E402
from data.tokenizers import REPO_COPY, gpt2_encoding  # noqa: E402
from errors import ConfigError  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from pretrained import gpt2_from_hf  # noqa: E402

HF_SHAPE = dict(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2)


def hf_model(seed=0, **shape):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**{**HF_SHAPE, **shape}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    hf_model().save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    return folder


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory, char_data):
    """The test corpus in GPT-2 BPE tokens, prepared by data/shakespeare/prepare.py."""
    from data.shakespeare.prepare import prepare
    folder = tmp_path_factory.mktemp("bpe") / "data"
    prepare(out_dir=folder, input_path=char_data.parent / "input_text.txt", bpe_file=REPO_COPY)
    return folder


def ids(n=24, seed=1):
    return torch.randint(0, 50257, (2, n), generator=torch.Generator().manual_seed(seed))


def full_logits(model: GPT, x):
    with torch.no_grad():
        return model(x, x)[0]  # with targets: logits at every position


def hf_logits(hf, x):
    with torch.no_grad():
        return hf(x).logits


@pytest.fixture
def train(script):
    """train.py ARGS to success, in this process."""
    def call(args):
        proc = script("train.py", *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc
    return call


@pytest.fixture
def fails_with(script):
    """A script run in this process ends with exit status 2 and one line holding every needle."""
    return lambda cmd, *needles: one_line_error(script(*cmd), *needles)


def one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- reading a Hugging Face folder ------------------------------------------------------------

def test_a_saved_hf_model_loads_with_its_logits(hf_folder):
    ours = pretrained.load_gpt(str(hf_folder))
    x = ids()
    assert (full_logits(ours, x) - hf_logits(hf_model(), x)).abs().max().item() < 1e-5


def test_pytorch_model_bin_is_read_with_weights_only_and_safetensors_first(tmp_path, hf_folder):
    hf = hf_model(seed=3)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")  # the older format
    ours = pretrained.load_gpt(str(tmp_path))
    x = ids(seed=2)
    assert (full_logits(ours, x) - hf_logits(hf, x)).abs().max().item() < 1e-5
    shutil.copy(hf_folder / "model.safetensors", tmp_path)  # both formats in one folder: safetensors is read
    assert (full_logits(pretrained.load_gpt(str(tmp_path)), x) - hf_logits(hf_model(), x)).abs().max().item() < 1e-5


def test_a_pickled_object_in_pytorch_model_bin_is_refused_not_run(tmp_path):
    hf_model().config.save_pretrained(tmp_path)
    torch.save({"x": object(), "pad": torch.zeros(2 * 10**6, dtype=torch.uint8)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="cannot read .*pytorch_model.bin") as error:
        pretrained.load_gpt(str(tmp_path))
    # not torch's advice (with terminal escapes) to load it unsafely
    assert str(error.value).endswith("(it is damaged, or holds objects that would run code when loaded, which "
                                     "weights_only=True refuses)")
    # torch's older format, pickle protocol 4: refused too, without torch's warning printed before the line
    torch.save(hf_model().state_dict(), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False,
               pickle_protocol=4)
    with warnings.catch_warnings(record=True) as warned, pytest.raises(ConfigError, match="cannot read"):
        warnings.simplefilter("always")
        pretrained.load_gpt(str(tmp_path))
    assert not warned, warned[0].message


def test_the_position_table_is_cropped_and_the_vocabulary_padded(hf_folder):
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50257, pad_vocab_to=64))
    state = pretrained.load_state(str(hf_folder), model)
    hf_state = hf_model().state_dict()
    assert state["transformer.wpe.weight"].shape == (16, 32)
    assert torch.equal(state["transformer.wpe.weight"], hf_state["transformer.wpe.weight"][:16])
    assert state["transformer.wte.weight"].shape == (50304, 32)
    assert not state["transformer.wte.weight"][50257:].any()
    assert torch.equal(state["transformer.h.0.attn.c_attn.weight"], hf_state["transformer.h.0.attn.c_attn.weight"].t())
    model.load_state_dict(state)
    x = ids(n=16)
    assert (full_logits(model, x) - hf_logits(hf_model(), x)).abs().max().item() < 1e-5


@pytest.mark.parametrize("change, needle", [
    (lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"), "lack transformer.h.1.mlp.c_fc.bias"),
    (lambda s: s.update({"transformer.h.2.ln_1.weight": torch.ones(32)}), "unknown tensor transformer.h.2.ln_1.weight"),
    (lambda s: s.update({"transformer.h.0.attn.c_proj.weight": torch.zeros(32, 31)}),
     "transformer.h.0.attn.c_proj.weight has shape (31, 32)"),
    (lambda s: s.update({"ln_f.weight": torch.ones(32)}),  # (one of the two was dropped unseen)
     "hold transformer.ln_f.weight twice, with and without the 'transformer.' prefix"),
])
def test_a_missing_extra_or_misshapen_tensor_is_named(tmp_path, change, needle):
    hf = hf_model()
    hf.config.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    change(state)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        pretrained.load_gpt(str(tmp_path))


def test_old_files_without_the_transformer_prefix_load(tmp_path):
    hf = hf_model(seed=5)
    hf.config.save_pretrained(tmp_path)
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(hf.config.n_layer):  # the causal mask buffers older transformers saved with the weights
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16, dtype=torch.bool))
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    x = ids()
    assert (full_logits(pretrained.load_gpt(str(tmp_path)), x) - hf_logits(hf, x)).abs().max().item() < 1e-5
    # the tied table under lm_head.weight alone (safetensors' save_model keeps it): once "lack transformer.wte"
    safetensors_torch.save_model(hf, str(tmp_path / "model.safetensors"))
    assert "transformer.wte.weight" not in safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    pretrained.locate.cache_clear()
    assert (full_logits(pretrained.load_gpt(str(tmp_path)), x) - hf_logits(hf, x)).abs().max().item() < 1e-5


def test_config_json_of_another_architecture_or_size_is_refused(tmp_path):
    hf_model(activation_function="relu").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="activation_function='relu'"):
        pretrained.load_gpt(str(tmp_path))
    # a config.json of another size beside the weights: refused before a model that size is built
    hf_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 10**6}))
    pretrained.locate.cache_clear()
    with pytest.raises(ConfigError, match=r"a model of [\d,]+ weights, but .*model\.safetensors holds [\d,]+ bytes: "
                                          r"cut short \(an interrupted copy\?\) or another model's"):
        pretrained.load_gpt(str(tmp_path))
    # fewer positions than the weights' table: it was cropped to them without a word
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_positions": 16}))
    with pytest.raises(ConfigError, match="wpe.weight has 64 rows in the GPT-2 weights, but config.json gives "
                                          "n_positions=16: the two come from different models"):
        pretrained.load_gpt(str(tmp_path))
    # a hand-edited config.json: one line each, not a traceback or a silent int() of 2.5 or true
    (tmp_path / "config.json").write_text("[" * 100_000)  # nested past what the parser takes: a traceback once
    with pytest.raises(ConfigError, match="cannot be read: maximum recursion depth exceeded"):
        pretrained.read_shape(tmp_path)
    for change, message in (([1, 2], "holds a JSON list, not GPT-2's settings"),
                            ({"n_head": 0}, "holds n_head=0: GPT-2's config.json gives"),
                            ({"n_positions": -5}, "holds n_positions=-5"), ({"vocab_size": 2.5}, "vocab_size=2.5"),
                            ({"n_layer": True}, "n_layer=True"), ({"n_head": 3}, "n_embd=32 with n_head=3"),
                            ({"n_inner": 64}, "its MLP is 4 x n_embd wide (n_inner null or 128)"),
                            ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
                            ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
                            ({"scale_attn_weights": False}, "scale_attn_weights=False"),
                            ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
                            ({"add_cross_attention": True}, "add_cross_attention=True"),
                            ({"model_type": None}, "model_type=None")):  # (None: the key left out)
        (tmp_path / "config.json").write_text(json.dumps(change if isinstance(change, list) else {
            k: v for k, v in {**config, **change}.items() if v is not None}))
        with pytest.raises(ConfigError, match=re.escape(message)):
            pretrained.read_shape(tmp_path)
    for same in ({"activation_function": "gelu_pytorch_tanh"}, {"n_inner": 128}):  # GPT-2's, spelled otherwise
        (tmp_path / "config.json").write_text(json.dumps({**config, **same}))
        assert pretrained.read_shape(tmp_path)["n_embd"] == 32


def test_an_untied_lm_head_is_refused_not_dropped():
    hf = hf_model()
    state = {**hf.state_dict(), "lm_head.weight": torch.randn_like(hf.state_dict()["lm_head.weight"])}
    with pytest.raises(ValueError, match="an lm_head.weight other than wte.weight"):
        gpt2_from_hf(state, GPT(GPTConfig(**HF_SHAPE_OURS)))


# --- train.py --init_from ---------------------------------------------------------------------

def tiny_finetune(bpe_data, out_dir, hf_folder, **overrides):
    return tiny_args(bpe_data, out_dir, **{"dataset": "shakespeare", "init_from": str(hf_folder), "n_layer": 2,
                                           "n_head": 2, "n_embd": 32, "block_size": 32, **overrides})


def test_max_iters_0_reports_the_pretrained_val_loss(tmp_path, bpe_data, hf_folder, train):
    proc = train(tiny_finetune(bpe_data, tmp_path / "out", hf_folder, max_iters=0, block_size=64))  # every position
    assert f"weights from {hf_folder}: 2 layers, 2 heads, 32 wide, its first 64 positions\n" in proc.stdout  # (it
    # said "positions cropped to 64", of 64)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert len(evals) == 1 and evals[0]["step"] == 0
    # a random GPT-2 of this vocabulary starts at ln(50257) = 10.8; a scratch model too, but
    # not at the same value: the weights are the folder's
    scratch = train(tiny_finetune(bpe_data, tmp_path / "scratch", hf_folder, max_iters=0, init_from="scratch"))
    assert "weights from" not in scratch.stdout
    other = [json.loads(l) for l in (tmp_path / "scratch" / "metrics.jsonl").read_text().splitlines()]
    assert abs(evals[0]["val_loss"] - 10.82) < 0.2 and other[-1]["val_loss"] != evals[0]["val_loss"]
    assert not (tmp_path / "out" / "last.pt").exists()  # nothing trained, nothing saved


@pytest.mark.slow
def test_fine_tuning_on_two_ranks_starts_from_the_folder_and_resumes_exactly(tmp_path, bpe_data, hf_folder):
    """Two ranks: rank 0 reads the folder and the other receives; 2+2 steps equal 4 steps, and the
    resume needs the folder no more (a cache cleared, no network)."""
    def finetune(out, folder=hf_folder, **overrides):  # what rank 0 printed
        run_world(2, tiny_finetune(bpe_data, out, folder, learning_rate=1e-4, warmup_iters=0, eval_interval=2,
                                   **overrides), tmp_path / "results")
        return (tmp_path / "results" / "rank0.log").read_text()

    finetune(tmp_path / "whole", max_iters=4, resume="never")
    gone = shutil.copytree(hf_folder, tmp_path / "gone")
    finetune(tmp_path / "split", gone, max_iters=2, resume="never", lr_decay_iters=4)
    shutil.rmtree(gone)
    first = checkpoint.read(tmp_path / "split" / "last.pt")["model"]
    start = gpt2_from_hf(hf_model().state_dict(), GPT(GPTConfig(**{**HF_SHAPE_OURS, "block_size": 32})))
    moved = max((first[k] - start[k]).abs().max().item() for k in start)
    assert 0 < moved < 1e-2  # two small steps away from the folder's weights
    printed = finetune(tmp_path / "split", f"{gone}/", max_iters=4, resume="auto", lr_decay_iters=4)  # (spelled
    # otherwise: it was "no Hugging Face GPT-2 model there")
    assert "resuming from" in printed and "weights from" not in printed
    whole = checkpoint.read(tmp_path / "whole" / "last.pt")["model"]
    split = checkpoint.read(tmp_path / "split" / "last.pt")["model"]
    assert all(torch.equal(whole[k], split[k]) for k in whole)


def test_a_resume_needs_a_folder_named_without_a_slash_no_more(tmp_path, bpe_data, hf_folder, train, monkeypatch,
                                                               script):
    """(a folder named as an export names it, gpt2-shakespeare, was refused once gone: "not scratch, resume,
    a GPT-2 name or a folder", though its shape is in the checkpoint)"""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_folder, tmp_path / "tiny-gpt2")
    train(tiny_finetune(bpe_data, tmp_path / "out", "tiny-gpt2", max_iters=1, eval_interval=1))
    shutil.rmtree(tmp_path / "tiny-gpt2")
    again = tiny_finetune(bpe_data, tmp_path / "out", "tiny-gpt2", max_iters=2, eval_interval=1, resume="auto")
    assert "resuming from" in train(again).stdout and checkpoint.read(tmp_path / "out" / "last.pt")["step"] == 2
    # init_from=resume continues it too, in the checkpoint's shape (it was refused: "holds another model shape",
    # of the config's), and keeps where it started (a resume from tiny-gpt2 was then "no ... GPT-2 model there")
    again = tiny_finetune(bpe_data, tmp_path / "out", "resume", max_iters=3, eval_interval=1, resume="auto", n_embd=64)
    assert "resuming from" in train(again).stdout
    assert checkpoint.read(tmp_path / "out" / "last.pt", tensors=False)["config"]["init_from"] == "tiny-gpt2"
    again = tiny_finetune(bpe_data, tmp_path / "out", "tiny-gpt2", max_iters=4, eval_interval=1, resume="auto")
    assert "resuming from" in train(again).stdout and checkpoint.read(tmp_path / "out" / "last.pt")["step"] == 4
    for name in ("last.pt", "previous.pt"):  # a weight's bit flipped (the rest reads): init_from=resume cannot
        flip_a_bit(tmp_path / "out" / name)  # start afresh, so the line says --init_from=scratch with --resume=never
    ran = script("train.py", *tiny_finetune(bpe_data, tmp_path / "out", "resume", resume="auto"))
    assert ran.returncode == 2 and "fails its CRC-32 check" in ran.stderr and ran.stderr.endswith(
        "or --resume=never --init_from=scratch\n"), ran.stderr


HF_SHAPE_OURS = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50257)


@pytest.mark.parametrize("override, needle", [
    ({"bias": False}, "--bias=false cannot load it"),
    ({"block_size": 65}, "block_size 65 is longer than"),  # (64, the whole table: test_max_iters_0_...)
    ({"n_embd": 64}, None),  # the folder's shape wins over the config's: not an error
])
def test_config_that_cannot_load_the_weights_is_one_line(tmp_path, bpe_data, hf_folder, override, needle, train,
                                                         fails_with):
    args = tiny_finetune(bpe_data, tmp_path / "out", hf_folder, max_iters=0, **override)
    if needle is None:
        assert "32 wide" in train(args).stdout
        # out_dir holds a run from scratch of this config's shape: not resumed as if it were the folder's
        train(tiny_finetune(bpe_data, tmp_path / "mixed", "scratch", max_iters=1, eval_interval=1, **override))
        fails_with(["train.py", *tiny_finetune(bpe_data, tmp_path / "mixed", hf_folder, resume="auto", **override)],
                   "holds another model shape (checkpoint, now): {'n_embd': (64, 32)}")
        fails_with(["train.py", *tiny_finetune(bpe_data, tmp_path / "mixed", "resume", resume="auto")],
                   "holds another model shape (checkpoint, now): {'n_embd': (64, 32)}")  # (init_from=resume too)
    else:
        fails_with(["train.py", *args], needle)


def test_a_character_dataset_cannot_take_gpt2_weights(tmp_path, char_data, hf_folder, fails_with):
    args = tiny_args(char_data, tmp_path / "out", init_from=str(hf_folder), max_iters=0)
    fails_with(["train.py", *args], "reads GPT-2 BPE tokens", "--dataset=shakespeare")
    with pytest.raises(ConfigError, match="reads GPT-2 BPE tokens"):  # as many characters as GPT-2 has tokens
        pretrained.model_args(Config(init_from=str(hf_folder), resume="never", block_size=32),
                              {"vocab_size": 50257, "tokenizer": "char"})


@pytest.mark.parametrize("damage, message", [(lambda state: state.pop("transformer.ln_f.bias"), "lack transformer.ln_f.bias"),
                                             (lambda state: state["transformer.ln_f.weight"][3:4].fill_(float("nan")),
                                              "transformer.ln_f.weight holds NaN or inf, or no floats, in the GPT-2"),
                                             (lambda state: state.update({"transformer.ln_f.weight": state[  # (0 or 1)
                                                 "transformer.ln_f.weight"].bool()}),
                                              "transformer.ln_f.weight holds NaN or inf, or no floats, in the GPT-2")])
def test_a_damaged_folder_is_one_line_on_every_launcher(tmp_path, bpe_data, hf_folder, fails_with, damage, message):
    """(NaN weights once trained into "the validation loss is nan", sampled into a traceback, and scored;
    one NaN among the values is enough)"""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((hf_folder / "config.json").read_text())
    state = safetensors_torch.load_file(hf_folder / "model.safetensors")
    damage(state)
    safetensors_torch.save_file(state, str(bad / "model.safetensors"))
    fails_with(["train.py", *tiny_finetune(bpe_data, tmp_path / "out", bad, max_iters=0)], message)
    fails_with(["sample.py", f"--init_from={bad}", "--max_new_tokens=2"], message)


@pytest.mark.slow  # a process of its own: huggingface_hub reads HF_HOME when imported
def test_a_released_name_offline_and_uncached_says_where_to_put_the_files(tmp_path, bpe_data, hf_folder):
    # the cache holds gpt2's config.json alone (what a tokenizer's download leaves): once a traceback
    repo = tmp_path / "hf-home" / "hub" / "models--openai-community--gpt2"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123" / "config.json").write_text((hf_folder / "config.json").read_text())
    proc = python("train.py", *tiny_args(bpe_data, tmp_path / "out", dataset="shakespeare", init_from="gpt2",
                                         max_iters=0), HF_HOME=tmp_path / "hf-home", HF_HUB_OFFLINE=1)
    assert proc.returncode == 2, proc.stderr
    line, = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "gpt2 is not in the Hugging Face cache" in line and "--init_from=./gpt2 (a path)" in line
    assert "`hf download openai-community/gpt2 config.json model.safetensors --local-dir gpt2`" in line


def test_a_released_name_comes_from_the_cache_else_a_download_else_says_where_to_put_it(tmp_path, monkeypatch):
    """pretrained.locate with snapshot_download replaced (the slow test above: the real one, offline)."""
    import huggingface_hub
    partial, whole = tmp_path / "partial", tmp_path / "whole"  # a cached config.json alone; a model folder
    for folder, files in ((partial, ["config.json"]), (whole, ["config.json", "model.safetensors"])):
        folder.mkdir()
        for name in files:
            (folder / name).write_text("{}")
    found, asked = {True: partial, False: whole}, []  # local_files_only -> what it finds (None: it raises)

    def snapshot_download(repo_id, allow_patterns, local_files_only=False):
        asked.append((repo_id, local_files_only))
        if found[local_files_only] is None:
            raise OSError("offline")
        return str(found[local_files_only])
    pretrained.locate.cache_clear()  # (an earlier test may have located one of these names)
    try:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        assert pretrained.locate("gpt2") == whole  # the cache's is not whole: downloaded
        assert asked == [("openai-community/gpt2", True), ("openai-community/gpt2", False)]
        found.update({True: whole, False: None})
        assert pretrained.locate("gpt2-medium") == whole  # whole in the cache: not downloaded
        found.update({True: partial, False: None})
        with pytest.raises(ConfigError) as offline:
            pretrained.locate("gpt2-large")
        assert str(offline.value) == (
            "gpt2-large is not in the Hugging Face cache and cannot be downloaded here (OSError: offline): on a "
            "machine with a network run `hf download openai-community/gpt2-large config.json model.safetensors "
            "--local-dir gpt2-large` (`huggingface-cli download` before huggingface_hub 1.0) and pass "
            "--init_from=./gpt2-large (a path), or copy its cache (~/.cache/huggingface/hub)")
    finally:
        pretrained.locate.cache_clear()


def test_a_mistyped_name_gets_a_suggestion():
    with pytest.raises(ConfigError, match="^init_from gpt3: no Hugging Face GPT-2 model there .*did you mean 'gpt2'"):
        pretrained.locate("gpt3")  # (train.py: once nothing is resumed, which needs no folder)
    with pytest.raises(ConfigError, match="did you mean 'gpt2-medium'"):
        pretrained.locate("gpt2-meduim")
    for small in ("gpt2-small", "gpt2-smal"):  # the 124M model (difflib alone: gpt2-xl)
        with pytest.raises(ConfigError, match="did you mean 'gpt2'\\?$"):
            pretrained.locate(small)
    for given, near in (("gpt2-XL", "gpt2-xl'"), ("GPT2", "gpt2'"), ("Resume", "resume'"),
                        ("scratc", "scratch' \\(train.py\\)")):  # (sample.py and eval.py read one)
        with pytest.raises(ConfigError, match=f"did you mean '{near}\\?$"):
            pretrained.locate(given)


# --- export_hf.py -----------------------------------------------------------------------------

def test_gpt2_to_hf_is_what_transformers_computes():
    """In process, GPT-2's own layout (biases, no padding); the script is tested below."""
    from pretrained import gpt2_to_hf
    ours = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50257)).eval()
    hf = hf_model(seed=9)
    missing, unexpected = hf.load_state_dict(gpt2_to_hf(ours), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head is tied to wte
    x = ids()
    assert (full_logits(ours, x) - hf_logits(hf, x)).abs().max().item() < 1e-5


def test_export_loads_in_transformers_with_equal_logits(tmp_path, bpe_data, train, script, fails_with, monkeypatch):
    """A model without biases and with a padded vocabulary: both must be undone for GPT-2's format."""
    out = tmp_path / "out"
    train(tiny_args(bpe_data, out, dataset="shakespeare", max_iters=3, eval_interval=3, bias=False,
                    pad_vocab_to=64, block_size=32, dropout=0.1))
    synced = []  # what the folder held at each fsync of it
    monkeypatch.setattr(data.files, "fsync_dir", lambda d: synced.append((Path(d), sorted(os.listdir(d)))))
    (tmp_path / "hf").mkdir()  # another model's tokens past GPT-2's vocabulary: the export removes them
    for name in ("added_tokens.json", "special_tokens_map.json"):
        (tmp_path / "hf" / name).write_text('{"<pad>": 50257}' if name[0] == "a" else '{"pad_token": "<pad>"}')
    sharded = ("model.safetensors.index.json", "model-00001-of-00002.safetensors", "pytorch_model.bin.index.json",
               "pytorch_model-00002-of-00002.bin")  # a larger model's download, in parts: left beside the export
    for name in sharded:
        (tmp_path / "hf" / name).write_text("{}")
    (tmp_path / "hf" / "notes.txt").write_text("mine")  # kept, and not listed as exported (it was)
    proc = script("scripts/export_hf.py", f"--out_dir={out}", f"--to={tmp_path / 'hf'}")
    assert proc.returncode == 0, proc.stderr
    assert "notes.txt" not in proc.stdout and (tmp_path / "hf" / "notes.txt").read_text() == "mine"
    assert not {"added_tokens.json", "special_tokens_map.json", *sharded} & set(os.listdir(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["model_max_length"] == 32
    assert "model.safetensors" in proc.stdout and "vocab.json" in proc.stdout
    made_durable = [listed for folder, listed in synced if folder == tmp_path / "hf"]  # once all were made
    assert made_durable == [sorted(os.listdir(tmp_path / "hf"))]
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ckpt = checkpoint.read(out / "best.pt")
    ours = GPT(GPTConfig(**ckpt["model_args"]))
    ours.load_state_dict(ckpt["model"])
    ours.eval()
    x = ids(n=32)
    assert hf.config.vocab_size == 50257 and hf.config.n_positions == 32
    assert hf.config.bos_token_id == hf.config.eos_token_id == 50256  # GPT-2 BPE's end of text
    assert hf.config.resid_pdrop == hf.config.embd_pdrop == hf.config.attn_pdrop == 0.1  # as trained (it said 0.0)
    assert (full_logits(ours, x) - hf_logits(hf, x)).abs().max().item() < 1e-5
    # and back in: the exported folder is a valid init_from
    again = pretrained.load_gpt(str(tmp_path / "hf"))
    assert (full_logits(again, x) - full_logits(ours, x)).abs().max().item() < 1e-5
    # an export that fails midway (here the vocabulary file is damaged, after the weights were made)
    # leaves the good export as it was: it once replaced the weights and config, then stopped
    before = {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()}
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(REPO_COPY.read_bytes()[:-10])
    monkeypatch.setattr(data.tokenizers, "REPO_COPY", damaged)
    fails_with(["scripts/export_hf.py", f"--out_dir={out}", "--checkpoint=last", f"--to={tmp_path / 'hf'}"],
               "cannot write GPT-2's tokenizer files:", "sha256")
    assert {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir()} == before
    fails_with(["scripts/export_hf.py", f"--out_dir={out}", f"--to={tmp_path / 'new' / 'deeper'}"], "sha256")
    assert not (tmp_path / "new").exists()  # the folders made for it go too (they were left, empty)
    # a folder at one of the names: refused before any file is replaced (it replaced three, then stopped)
    (tmp_path / "hf" / "vocab.json").unlink()
    (tmp_path / "hf" / "vocab.json").mkdir()
    monkeypatch.setattr(data.tokenizers, "REPO_COPY", REPO_COPY)
    before = {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir() if f.is_file()}
    fails_with(["scripts/export_hf.py", f"--out_dir={out}", "--checkpoint=last", f"--to={tmp_path / 'hf'}"],
               f"{tmp_path / 'hf' / 'vocab.json'} is a folder, where the export writes or removes a file: move it away")
    assert {f.name: f.read_bytes() for f in (tmp_path / "hf").iterdir() if f.is_file()} == before


def test_exported_tokenizer_files_encode_as_tiktoken(tmp_path):
    from data.tokenizers import write_gpt2_tokenizer_files
    write_gpt2_tokenizer_files(tmp_path, 1024)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    enc = gpt2_encoding(REPO_COPY, verbose=False)
    text = ("First Citizen:\nBefore we proceed any further, hear me speak.  Ünïcödé — 123,456 "
            "don't  tabs\tand emoji 🙂 sí soft\u00adhyphen ®î<|endoftext|>")  # í, U+00AD: byte 0xAD, not
    # printable; ® and î: byte 0xAE, the first printable one after it
    assert tok(text)["input_ids"] == enc.encode(text, allowed_special={"<|endoftext|>"})
    assert tok.decode(enc.encode_ordinary(text)) == text
    assert len(tok) == 50257


def test_export_of_a_character_model_has_no_tokenizer_files(tmp_path, char_data, train, script, fails_with):
    out = tmp_path / "out"
    train(tiny_args(char_data, out, max_iters=2, eval_interval=2))
    (tmp_path / "hf").mkdir()  # what a GPT-2 export or download left there is removed
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json", "pytorch_model.bin",
                 "generation_config.json", "added_tokens.json", "special_tokens_map.json"):  # (eos 50256 in it: generate() indexed past the vocabulary)
        (tmp_path / "hf" / name).write_text("{}")
    (tmp_path / "hf" / ".export.k1ll3d9x.tmp").mkdir()  # an export killed with kill -9 left it: a model's size each
    (tmp_path / "hf" / ".export.k1ll3d9x.tmp" / "model.safetensors").write_text("{}")
    exported = script("scripts/export_hf.py", f"--out_dir={out}", "--checkpoint=last", f"--to={tmp_path / 'hf'}")
    assert exported.returncode == 0, exported.stderr
    assert sorted(f.name for f in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    (tmp_path / "loop").symlink_to("loop")  # Path.resolve raised on a link loop: a traceback once
    fails_with(["scripts/export_hf.py", f"--out_dir={out}", f"--to={tmp_path / 'loop'}"], "cannot write")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert hf.config.vocab_size == json.loads((out / "meta.json").read_text())["vocab_size"]
    assert hf.config.bos_token_id is None and hf.config.eos_token_id is None  # once 50256: generate() indexed past
    # no tokenizer for its characters comes with it: sample.py and eval.py refuse it as text
    for cmd in ("sample.py", "eval.py"):
        fails_with([cmd, f"--init_from={tmp_path / 'hf'}", "--device=cpu"], f"has a vocabulary of {hf.config.vocab_size} "
                   "tokens, not GPT-2's BPE (50257)", "from its own checkpoint: --out_dir)")
    # nor does train.py start from it (it said the folder "reads GPT-2 BPE tokens (68 of them)")
    fails_with(["train.py", *tiny_args(char_data, tmp_path / "again", init_from=str(tmp_path / "hf"))],
               f"has a vocabulary of {hf.config.vocab_size} tokens, not GPT-2's BPE (50257): init_from takes GPT-2 BPE")


def test_an_export_holds_its_folders_lock_until_its_last_file(tmp_path, monkeypatch):
    """(it removed an earlier export's stale files after letting go: a character model's export, so, deleted the
    tokenizer files another export into the folder, of a GPT-2 BPE model, had just moved in)"""
    import fcntl
    import export_hf
    held = []

    def fsync_dir(folder):  # the export's last step: may another export lock the folder now?
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
    monkeypatch.setattr(export_hf, "fsync_dir", fsync_dir)
    export_hf.export(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16)), tmp_path / "hf", False)
    assert held == [True]


def test_export_bad_input_is_one_line(tmp_path, fails_with, trained):
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'none'}", "--to=x"], "does not exist")
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path}", "--to="], "--to is empty")  # not the current folder
    (tmp_path / "empty").mkdir()
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", "--to=x"],
               "no best.pt, last.pt or previous.pt")
    (tmp_path / "other").mkdir()  # another training run's folder (once its config.json was replaced)
    (tmp_path / "other" / "run.lock").write_text("")
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'other'}"],
               f"--to={tmp_path / 'other'} is another run's own folder: give another folder")
    (tmp_path / "other" / "run.lock").rename(tmp_path / "other" / "last.pt")  # a run copied without its lock
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'other'}"],
               f"--to={tmp_path / 'other'} is another run's own folder: give another folder")
    written = json.loads((trained / "config.json").read_text())  # as train.py writes it, but started from gpt2/
    written["config"]["init_from"] = str(tmp_path / "gpt2")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(written))
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'gpt2'}"],
               f"--to={tmp_path / 'gpt2'} is the folder the run started from (init_from): give another folder")
    assert written["run"]["backend"] is None  # (one process forms no group: train.py says 'backend none')
    assert written["run"]["cwd"] == os.getcwd()  # a relative init_from is from where training ran, not from here
    written["config"]["init_from"], written["run"]["cwd"] = "gpt2-mine", str(tmp_path)
    (tmp_path / "empty" / "config.json").write_text(json.dumps(written))
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'gpt2-mine'}"],
               f"--to={tmp_path / 'gpt2-mine'} is the folder the run started from (init_from): give another folder")
    written["config"]["init_from"] = "gpt2"  # the released model, from the cache: a folder named gpt2 is not it
    (tmp_path / "empty" / "config.json").write_text(json.dumps(written))
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", "--to=gpt2"], "no best.pt, last.pt")
    (tmp_path / "link").symlink_to(tmp_path / "empty")  # its config.json would replace the run's
    for to in (tmp_path / "empty", tmp_path / "link"):
        fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", f"--to={to}"],
                   f"--to={to} is the run's own folder")
    for to in ("best.dcp", "last.pt", "best.dcp/hf"):  # (files added; a folder named last.pt, or put in a .dcp the
        fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'out' / to}"],
                   f"--to={tmp_path / 'out' / to} is a checkpoint's name, or inside one: give another folder")
        assert not (tmp_path / "out" / to).exists()  # next save replaces, was taken: a run's resume was refused)
    (tmp_path / "data").mkdir()  # a dataset's meta.json: it was "another run's own folder"
    for name in ("meta.json", "train.bin"):
        (tmp_path / "data" / name).write_text("")
    fails_with(["scripts/export_hf.py", f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'data'}"],
               f"--to={tmp_path / 'data'} is a dataset folder: give another folder")


# --- sample.py --init_from --------------------------------------------------------------------

def test_sample_from_a_folder_is_one_batch_and_repeatable(tmp_path, hf_folder, script):
    cmd = ["sample.py", f"--init_from={hf_folder}", "--start=Hello", "--num_samples=3", "--max_new_tokens=8",
           "--device=cpu"]
    first, second = script(*cmd), script(*cmd)
    assert first.returncode == second.returncode == 0, first.stderr
    first, second = first.stdout, second.stdout
    assert first == second
    samples = [s.strip() for s in first.split(SEPARATOR) if s.strip()]
    assert len(samples) == 3 and all(s.startswith("Hello") for s in samples) and len(set(samples)) == 3


def test_batched_generation_gives_each_row_its_own_tokens():
    """A batch through the KV cache equals each row generated alone (greedy, so no randomness)."""
    model = pretrained.GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=101)).eval()
    prompts = torch.randint(0, 101, (3, 5), generator=torch.Generator().manual_seed(0))
    together = model.generate(prompts, 20, temperature=0)
    for row in range(3):
        assert torch.equal(together[row], model.generate(prompts[row:row + 1], 20, temperature=0)[0])


def test_sample_init_from_missing_folder_is_one_line(tmp_path, fails_with):
    fails_with(["sample.py", f"--init_from={tmp_path / 'nothing'}"], "no Hugging Face GPT-2 model there")
    (tmp_path / "half").mkdir()  # what `hf download gpt2 config.json` leaves: no weights
    (tmp_path / "half" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    fails_with(["sample.py", f"--init_from={tmp_path / 'half'}"], "no Hugging Face GPT-2 model there")
    (tmp_path / "half" / "model.safetensors.index.json").write_text("{}")  # save_pretrained(max_shard_size=...)
    fails_with(["sample.py", f"--init_from={tmp_path / 'half'}"], "(its weights are in shards, which are not read")
    fails_with(["sample.py", "--init_from=gpt2-small"], "no Hugging Face GPT-2 model there", "did you mean 'gpt2'?")
    (tmp_path / "run").mkdir()  # a run of this repo: "no Hugging Face GPT-2 model there" said no more
    (tmp_path / "run" / "last.pt").write_text("")
    for init_from in (tmp_path / "run", tmp_path / "run" / "last.pt"):
        fails_with(["sample.py", f"--init_from={init_from}"], "(a checkpoint of this repo's: sample.py reads a run's "
                   "folder as --out_dir, train.py continues it with --resume=PATH)")
    assert "checkpoint" not in fails_with(["sample.py", "--init_from=gpt2.pt"], "did you mean 'gpt2'?")  # (none there)
    fails_with(["eval.py", "--init_from=openai-community/gpt2-xl"], "did you mean 'gpt2-xl'?")  # (the hub's name)
    assert "did you mean" not in fails_with(["sample.py", f"--init_from={tmp_path / 'ft' / 'gpt2-large'}"])  # a path
    for tool in ("sample.py", "eval.py"):  # --out_dir was ignored without a word
        fails_with([tool, "--init_from=gpt2", "--out_dir=out"], "both name the model: give one")


def test_sample_py_generates_all_samples_in_one_call(monkeypatch, capsys, hf_folder):
    import sample
    calls = []
    original = GPT.generate

    def counted(self, idx, *args, **kwargs):
        calls.append(tuple(idx.shape))
        return original(self, idx, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", counted)
    sample.main([f"--init_from={hf_folder}", "--start=Hi", "--num_samples=4", "--max_new_tokens=3", "--device=cpu"])
    assert calls == [(4, 1)]  # "Hi" is one GPT-2 token; four rows together
    assert capsys.readouterr().out.count("---------------") == 4


@pytest.mark.slow
def test_fsdp_starts_from_the_folder_too(tmp_path, bpe_data, hf_folder, train):
    one = tiny_finetune(bpe_data, tmp_path / "one", hf_folder, max_iters=0)
    two = tiny_finetune(bpe_data, tmp_path / "two", hf_folder, max_iters=0, strategy="fsdp")
    train(one)
    run_world(2, two, tmp_path / "results")
    val = [json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"] for d in ("one", "two")]
    assert abs(val[0] - val[1]) < 1e-5


def test_a_config_json_whose_n_embd_does_not_match_the_weights_is_one_line(tmp_path, bpe_data, hf_folder,
                                                                           fails_with):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((hf_folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    (bad / "model.safetensors").write_bytes((hf_folder / "model.safetensors").read_bytes())
    fails_with(["train.py", *tiny_finetune(bpe_data, tmp_path / "out", bad, max_iters=0)],
               "has shape (50257, 32) in the GPT-2 weights, but (50257, 64) in a GPT of n_layer=2, n_head=2, n_embd=64")
