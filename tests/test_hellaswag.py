"""HellaSwag: scores equal to a plain transformers scorer, the same for any world size, on
schedule in training across a resume, and one clear line for every bad input. Offline: the file
is written here in the official format, the "GPT-2" is a random transformers model."""

import errno
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness import REPO, child_env, metrics, ranks_say, run_ranks, tiny_args

transformers = pytest.importorskip("transformers")

import eval as eval_py  # noqa: E402
import pretrained  # noqa: E402
import train  # noqa: E402
from config import resolve  # noqa: E402
from data.tokenizers import GPT2_TIKTOKEN_SHA256, REPO_COPY, gpt2_encoding  # noqa: E402
from errors import ConfigError, reported  # noqa: E402
from evals import hellaswag  # noqa: E402
from world import World  # noqa: E402

WORDS = ("the man woman dog child runs jumps into water slowly then quickly ball house kitchen "
         "unbelievably extraordinary photosynthesis skateboard onto rooftop, and. she he").split()
LINE = re.compile(r"hellaswag: acc (\d\.\d{4}) acc_norm (\d\.\d{4}) over (\d+) examples")


def write_examples(path, n, seed=0, ctx_words=(3, 20), end_words=(1, 12)):
    """n examples of the official format; endings of one to a dozen words, so token lengths differ."""
    rng = random.Random(seed)
    say = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"ind": i, "ctx": say(*ctx_words), "endings": [say(*end_words) for _ in range(4)],
                                "label": rng.randrange(4), "split": "val"}) + "\n")
    return path


@pytest.fixture(scope="module")
def hs_file(tmp_path_factory):
    return write_examples(tmp_path_factory.mktemp("hs") / "hellaswag_val.jsonl", 24)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    return folder


def reference_picks(hf, path) -> list:
    """llm.c's scorer, written out: per example, the 4 rows right-padded, one full forward,
    losses of the shifted targets masked to the ending, summed and averaged."""
    enc = gpt2_encoding(verbose=False)
    picks = []
    for line in open(path):
        ex = json.loads(line)
        ctx = enc.encode(ex["ctx"])
        rows = [ctx + enc.encode(" " + e) for e in ex["endings"]]
        tokens = torch.zeros(4, max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row)
            mask[i, len(ctx):len(row)] = 1
        with torch.no_grad():
            logits = hf(tokens).logits
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(4, -1)
        total = (losses * mask[:, 1:]).sum(1)
        picks.append((total.argmin().item(), (total / mask[:, 1:].sum(1)).argmin().item(), ex["label"]))
    return picks


def run_eval(argv, capsys) -> list:
    eval_py.main([str(a) for a in argv])
    return capsys.readouterr().out.strip().splitlines()


def fails(argv, capsys) -> str:
    """eval.py's one error line (exit status 2), and no score printed."""
    with pytest.raises(SystemExit) as exit, reported():
        eval_py.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and "hellaswag: acc" not in out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# --- scoring -------------------------------------------------------------------------------

def test_acc_and_each_chosen_ending_match_a_transformers_reference(hf_folder, hs_file, capsys, monkeypatch):
    expected = reference_picks(transformers.GPT2LMHeadModel.from_pretrained(hf_folder).eval(), hs_file)
    examples = hellaswag.load(str(hs_file), block_size=64)
    assert len({len(row) for ex in examples for row in ex.rows}) > 5  # endings of many lengths
    forwards, real = [], hellaswag.score  # batch_size sequences a forward, not examples (4 x the memory planned)
    monkeypatch.setattr(hellaswag, "score",
                        lambda model, batch, *a: forwards.append(len(batch)) or real(model, batch, *a))
    score, picks = hellaswag.evaluate(pretrained.load_gpt(str(hf_folder)), examples, World(), torch.autocast("cpu", enabled=False), batch_size=20)
    assert [picks[i] for i in range(len(examples))] == [(s, m) for s, m, _ in expected]
    assert score.correct == sum(s == label for s, _, label in expected)
    assert score.correct_norm == sum(m == label for _, m, label in expected)
    assert (score.examples, score.truncated) == (24, 0) and forwards == [5] * 4 + [4]
    assert score.correct != score.correct_norm  # the two criteria really differ here
    model = pretrained.load_gpt(str(hf_folder))  # a batch smaller than one example's 4 endings: one example a forward
    _, few = hellaswag.evaluate(model, examples[:3], World(), torch.autocast("cpu", enabled=False), batch_size=1)
    assert few == {i: picks[i] for i in range(3)}
    # eval.py: its last line, exactly
    assert run_eval(["--init_from", hf_folder, "--hellaswag", hs_file], capsys)[-1] == score.line()
    read, write = os.pipe()  # a pipe is read as the file (--hellaswag=/dev/stdin once said "does not exist")
    assert os.write(write, hs_file.read_bytes()) == hs_file.stat().st_size  # (24 examples: one pipe buffer)
    os.close(write)
    try:
        assert run_eval(["--init_from", hf_folder, "--hellaswag", f"/dev/fd/{read}"], capsys)[-1] == score.line()
    finally:
        os.close(read)


def test_a_full_stderr_does_not_end_the_evaluation_and_a_nan_model_is_refused(hf_folder, hs_file, capsys,
                                                                                 monkeypatch):
    class Full(io.StringIO):  # 2>/dev/full, or a log on a disk that filled: the progress bar's write failed
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sys, "stderr", Full())
    assert LINE.fullmatch(run_eval(["--init_from", hf_folder, "--hellaswag", hs_file], capsys)[-1])
    model = pretrained.load_gpt(str(hf_folder))  # NaN's argmin is ending 0: a diverged model scored 1 in 4
    with torch.no_grad():
        model.lm_head.weight[5] = float("nan")  # (tied: the embedding's row of one token too)
    score, _ = hellaswag.evaluate(model, hellaswag.load(str(hs_file), block_size=64), World(),
                                  torch.autocast("cpu", enabled=False), batch_size=20)
    assert score.not_finite == score.examples == 24  # (eval.py and train.py stop on it)

    class OneEndingOverflows(torch.nn.Module):  # example 0's first ending alone: that example is refused too
        def forward(self, x, y):
            logits = torch.zeros(*x.shape, 8)
            logits[0, :, 3] = -math.inf  # (its ending's tokens are 3: a loss of inf)
            return logits, None
    rows = [hellaswag.Example([[1, 3, 3], [1, 2, 2], [1, 4, 4], [1, 5, 5]], 1, 0, False)] * 2
    assert hellaswag.score(OneEndingOverflows(), rows, "cpu", torch.autocast("cpu", enabled=False)) == (
        [-1, 0], [-1, 0])  # (the other's endings tie: the first)


def test_a_val_loss_that_is_not_finite_is_refused_not_printed(hf_folder, bpe_data, tmp_path, capsys, monkeypatch):
    """eval.py printed "val loss nan" and exited 0 (HellaSwag's losses and train.py's were refused)."""
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_folder)
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(3e38)  # finite weights, whose logits overflow float32
    model.save_pretrained(tmp_path / "overflows")
    capsys.readouterr()  # (transformers' progress bars)
    with pytest.raises(SystemExit) as ended, reported():
        eval_py.main(["--init_from", str(tmp_path / "overflows"), "--no_hellaswag", "--data_dir", str(bpe_data),
                      "--val_windows=4"])
    out, err = capsys.readouterr()
    assert ended.value.code == 1 and "val loss" not in out
    assert err == f"error: the val loss on {bpe_data} is nan\n"
    monkeypatch.setattr(eval_py, "val_loss", lambda *args: float("inf"))  # (float16's overflow, as often)
    with pytest.raises(SystemExit) as ended, reported():
        eval_py.main(["--init_from", str(hf_folder), "--no_hellaswag", "--data_dir", str(bpe_data), "--val_windows=4"])
    assert (ended.value.code, capsys.readouterr().err) == (1, f"error: the val loss on {bpe_data} is inf\n")


def test_a_diverged_run_stops_at_its_hellaswag_naming_the_causes_its_settings_allow(bpe_data, small_file, tmp_path,
                                                                                    capsys):
    with pytest.raises(SystemExit) as ended:  # (scored with the loss still unchecked: log_interval is later)
        train.cli(bpe_args(bpe_data, small_file, tmp_path, learning_rate=1e30, log_interval=10, hellaswag_interval=1))
    err = capsys.readouterr().err
    assert ended.value.code == 1 and re.fullmatch(r"error: HellaSwag's losses are NaN or inf at step \d\. Likely "
                                                  r"causes: a learning rate too high .*\n", err), err
    assert "weight decay too strong" in err and "float16" not in err  # (a float32 run)
    assert not hellaswag_rows(tmp_path) or all(r["step"] == 0 for r in hellaswag_rows(tmp_path))


def test_a_context_longer_than_block_size_loses_its_left_and_is_counted(tmp_path, capsys):
    enc = gpt2_encoding(verbose=False)
    ex = hellaswag.render("a b c d e f g h i j k l", ["m n", "o", "p q r", "s"], 2, enc.encode_ordinary, 8)
    # a row is at most 9 tokens (the model reads 8, as a training window of 9): 9 minus the longest ending's 3
    context = enc.encode_ordinary("a b c d e f g h i j k l")[-6:]
    assert ex.truncated and ex.start == 6 and ex.rows[2] == context + enc.encode_ordinary(" p q r")
    assert max(len(row) for row in ex.rows) == 9
    fits = hellaswag.render("a b c d e f", ["m n", "o", "p q r", "s"], 2, enc.encode_ordinary, 8)
    assert not fits.truncated and fits.start == 6  # 6 + 3 tokens: the model reads 8, which fit
    cut = hellaswag.render("a b c d e f", ["w " * 10, "x", "y", "z"], 0, enc.encode_ordinary, 4)
    assert cut.start == 1 and max(map(len, cut.rows)) == 5  # one context token kept; the long ending is cut
    one = hellaswag.render("a", ["w " * 10, "x", "y", "z"], 0, enc.encode_ordinary, 4)
    assert one.truncated and max(map(len, one.rows)) == 5  # (only its ending was cut: it went uncounted)
    exact = hellaswag.render("a", ["w w w w", "x", "y", "z"], 0, enc.encode_ordinary, 4)
    assert not exact.truncated and max(map(len, exact.rows)) == 5  # an ending of block_size tokens fits whole
    path = write_examples(tmp_path / "long.jsonl", 12, seed=1, ctx_words=(2, 40))
    examples = hellaswag.load(str(path), block_size=24)
    long = sum(len(enc.encode_ordinary(json.loads(line)["ctx"])) + max(len(enc.encode_ordinary(" " + e)) for e in
               json.loads(line)["endings"]) > 25 for line in open(path))
    assert 0 < long < 12 and sum(ex.truncated for ex in examples) == long
    # eval.py, on a GPT-2 of 24 positions, scores them all and says how many were cut
    short = tmp_path / "short-gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50257, n_positions=24, n_embd=32, n_layer=2, n_head=2)).save_pretrained(short)
    out = run_eval(["--init_from", short, "--hellaswag", path], capsys)
    assert out[-2] == (f"note: {long} examples did not fit block_size (24): contexts lost tokens from the left "
                       f"(an ending still too long, from its end)")
    assert LINE.fullmatch(out[-1]) and out[-1].endswith("over 12 examples")
    with pytest.raises(ConfigError, match="block_size of at least 2, not 1"):  # no ending token would be scored
        hellaswag.load(str(path), block_size=1)


# --- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("line, needle", [
    ("{not json", "is not JSON"),
    ("[" * 100_000, "is not JSON"),  # nested past the parser's recursion limit
    ('{"ctx": "a", "label": 0}', "lacks endings"),
    ('{"ctx": " ", "endings": ["b", "c", "d", "e"], "label": 0}', "ctx must be a non-empty string"),  # blank
    ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}', "endings must be a list of 4 strings, got 3 items"),
    ('{"ctx": "a", "endings": ["b", "c", "d", 5], "label": 0}', "of 4 strings, got 5 (int)"),  # (was "got 4 items")
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', "label must be 0, 1, 2 or 3"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": true}', "label must be 0, 1, 2 or 3"),  # not 1
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": "4"}', "label must be 0, 1, 2 or 3, got '4'"),
    ("{not json", "(each line is one JSON object, as in the official hellaswag_val.jsonl)"),
    ('["a", "b"]', "is not a JSON object"),
    (b'{"ctx": "\xff"}', "is not UTF-8 text (invalid start byte at byte 9 of the line)"),  # once the byte of a chunk
])
def test_a_malformed_line_is_one_error_naming_its_number(hf_folder, hs_file, tmp_path, capsys, line, needle):
    lines = open(hs_file, "rb").read().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\n".join(lines[:4] + [line if isinstance(line, bytes) else line.encode()] + lines[4:]) + b"\n")
    error = fails(["--init_from", hf_folder, "--hellaswag", bad, "--limit=2"], capsys)  # checked past the limit
    assert f"{bad}, line 5" in error and needle in error


def test_a_byte_order_mark_and_labels_written_as_strings_read_as_the_official_file(hs_file, tmp_path):
    """(Hugging Face's copy of HellaSwag writes label as "3"; an editor may add a byte-order mark)"""
    lines = open(hs_file, encoding="utf-8").read().splitlines()
    as_strings = [json.dumps({**json.loads(line), "label": str(json.loads(line)["label"])}) for line in lines]
    (tmp_path / "hf.jsonl").write_text("\ufeff" + "\n".join(as_strings) + "\n", encoding="utf-8")
    assert hellaswag.read_examples(tmp_path / "hf.jsonl") == hellaswag.read_examples(hs_file)


def test_a_missing_file_says_where_to_put_it_and_a_bad_download_is_refused(hf_folder, hs_file, tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(hellaswag, "URL", "http://127.0.0.1:9/hellaswag_val.jsonl")  # nothing listens there
    error = fails(["--init_from", hf_folder], capsys)
    assert str(hellaswag.cache_path()) in error and "--hellaswag=PATH" in error and "hellaswag_path" in error
    assert "does not exist" in fails(["--init_from", hf_folder, "--hellaswag", tmp_path / "nowhere.jsonl"], capsys)
    closed = "/dev/fd/1023"  # a shell's <(cat FILE) given to torchrun: its workers have no such descriptor
    assert fails(["--init_from", hf_folder, "--hellaswag", closed], capsys).endswith(
        f"{closed} does not exist (a shell's <(...) pipe reaches the program it started, not a launcher's workers: "
        f"give a file): give the path of a hellaswag_val.jsonl")
    assert f"HellaSwag file {tmp_path} is a folder" in fails(["--init_from", hf_folder, "--hellaswag", tmp_path], capsys)
    # what gets past that check and still cannot be read
    with pytest.raises(ConfigError, match=f"^cannot read {re.escape(str(tmp_path))}: Is a directory$"):
        hellaswag.read_examples(tmp_path)
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    assert "blank.jsonl holds no examples: give hellaswag_val.jsonl, one JSON object a line" in fails(
        ["--init_from", hf_folder, "--hellaswag", tmp_path / "blank.jsonl"], capsys)
    for bad, needle in [("--dist_timeout=-1", "--dist_timeout must be positive seconds"),
                        ("--dist_timeout=nan", "--dist_timeout must be positive seconds"),
                        ("--dist_timeout=0.0004", "--dist_timeout must be positive seconds, 1 to 1e6"),
                        ("--dist_timeout=inf", "--dist_timeout must be positive seconds, 1 to 1e6, got inf"),
                        ("--batch_size=0", "--batch_size must be positive, got 0"),
                        ("--val_windows=0", "--val_windows must be positive, got 0"),
                        ("--limit=-1", "--limit must be >= 0, got -1"),
                        ("--dtype=float8", "--dtype must be auto, float32, bfloat16 or float16, got 'float8'")]:
        assert needle in fails(["--init_from", hf_folder, bad], capsys)
    # a batch whose logits cannot fit: it was the allocator's traceback (or, just under the memory, a kill)
    assert re.search(r"^error: --batch_size=10000000 needs at least [\d,.]+ GB for one forward's logits, but cpu has "
                     r"[\d,.]+ GB available: give a smaller --batch_size$",
                     fails(["--init_from", hf_folder, "--hellaswag", hs_file, "--batch_size=10000000"], capsys))
    config, available = pretrained.load_gpt(str(hf_folder)).config, eval_py.available_memory
    four = 4 * 4 * config.block_size * config.padded_vocab_size  # (bytes: 4 sequences of float32 logits)
    monkeypatch.setattr(eval_py, "available_memory", lambda *a: four - 1)
    assert "--batch_size=1 needs at least" in fails(  # a batch under 4 still runs an example's 4 endings at once
        ["--init_from", hf_folder, "--hellaswag", hs_file, "--batch_size=1"], capsys)
    monkeypatch.setattr(eval_py, "available_memory", available)
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(tmp_path / "no.tiktoken"))  # was a traceback
    error = fails(["--init_from", hf_folder, "--hellaswag", hs_file], capsys)
    assert f"HellaSwag needs GPT-2's tokenizer: GPT-2 BPE file {tmp_path / 'no.tiktoken'}" in error
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(hs_file))  # not the BPE file: its whole line, not cut at 200
    error = fails(["--init_from", hf_folder, "--hellaswag", hs_file], capsys)
    assert error.endswith(f"the expected {GPT2_TIKTOKEN_SHA256}: point it at a gpt2.tiktoken file, or leave it "
                          f"out to use data/gpt2.tiktoken"), error
    monkeypatch.delenv("GPT2_TIKTOKEN_FILE")

    class Response:  # a download that is not the official file
        def __init__(self, *a, **k):
            pass
        __enter__ = lambda self: self
        __exit__ = lambda self, *exc: None
        read = lambda self: hs_file.read_bytes()
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", Response)
    assert "git blob id" in fails(["--init_from", hf_folder], capsys)
    assert not hellaswag.cache_path().exists()
    monkeypatch.setattr(hellaswag, "GIT_BLOB_SHA1", hellaswag.git_blob_sha1(hs_file.read_bytes()))  # now the official
    (tmp_path / "a file").touch()  # a cache that cannot be written (a read-only one, a full disk): was a traceback
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a file"))
    assert fails(["--init_from", hf_folder], capsys) == (
        f"error: the HellaSwag validation set is not at {hellaswag.cache_path()} and was downloaded but cannot be kept "
        f"there (NotADirectoryError: [Errno 20] Not a directory: '{tmp_path / 'a file' / 'gpt-train'}'): set "
        f"XDG_CACHE_HOME to a folder you can write, or point at your copy with --hellaswag=PATH (eval.py) or "
        f"--hellaswag_path=PATH (train.py)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    downloads = []
    monkeypatch.setattr(hellaswag.urllib.request, "urlopen", lambda *a, **k: downloads.append(a) or Response())
    assert hellaswag.locate() == hellaswag.cache_path() == hellaswag.locate() and len(downloads) == 1  # then cached
    assert hellaswag.cache_path().read_bytes() == hs_file.read_bytes()


# --- in training ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory, char_data):
    from data.shakespeare.prepare import prepare
    folder = tmp_path_factory.mktemp("bpe") / "data"
    prepare(out_dir=folder, input_path=char_data.parent / "input_text.txt", bpe_file=REPO_COPY)
    return folder


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    return write_examples(tmp_path_factory.mktemp("hs_small") / "hellaswag_val.jsonl", 10, seed=2,
                          ctx_words=(2, 8), end_words=(1, 4))


def bpe_args(bpe_data, small_file, out_dir, **overrides):
    return tiny_args(bpe_data, out_dir, **{
        "dataset": "shakespeare", "block_size": 16, "max_iters": 8, "lr_decay_iters": 8, "eval_interval": 4,
        "eval_iters": 1, "hellaswag_interval": 2, "hellaswag_path": small_file,
        **overrides})


def hellaswag_rows(out_dir) -> list:
    return [r for r in metrics(out_dir) if "hellaswag_acc" in r]


@pytest.fixture(scope="module")
def straight(bpe_data, small_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train.main(resolve(bpe_args(bpe_data, small_file, out)))
    return out


def test_training_evaluates_on_schedule_and_a_resume_neither_repeats_nor_skips(
        straight, bpe_data, small_file, tmp_path, monkeypatch):
    rows = hellaswag_rows(straight)
    assert [r["step"] for r in rows] == [0, 2, 4, 6, 8] and all(r["hellaswag_examples"] == 10 for r in rows)
    assert all(r.keys() == {"step", "hellaswag_acc", "hellaswag_acc_norm", "hellaswag_examples", "hellaswag_truncated"}
               for r in rows)  # the whole score, as eval.py prints it
    assert torch.load(straight / "last.pt", weights_only=True)["hellaswag_step"] == 8

    # The same run in three legs, stopped by SIGTERM during steps 4 and 6. Step 4 is an eval
    # step: the first leg evaluates both there before it saves and stops, and the second must
    # not evaluate it again. Step 6 is HellaSwag's only: the second saves it unevaluated, and
    # the third must then evaluate it.
    legs, step = tmp_path / "legs", train.optimizer_step

    def optimizer_step(run, sync=True):
        if run.step in (3, 5):
            os.kill(os.getpid(), signal.SIGTERM)
        return step(run, sync)
    monkeypatch.setattr(train, "optimizer_step", optimizer_step)
    for stop, evaluated in ((4, [0, 2, 4]), (6, [0, 2, 4])):
        result = train.main(resolve(bpe_args(bpe_data, small_file, legs, resume="auto")))
        assert (result["stopped"], result["step"]) == (signal.SIGTERM, stop)
        assert [r["step"] for r in hellaswag_rows(legs)] == evaluated
        if stop == 4:  # as a checkpoint from before hellaswag_step was kept: its step counts as evaluated
            older = torch.load(legs / "last.pt", weights_only=True)
            del older["hellaswag_step"]
            torch.save(older, legs / "last.pt")
    monkeypatch.setattr(train, "optimizer_step", step)
    train.main(resolve(bpe_args(bpe_data, small_file, legs, resume="auto")))
    assert hellaswag_rows(legs) == rows  # each step once, with the uninterrupted run's numbers
    evals = [(r["step"], r["val_loss"]) for r in metrics(legs) if "val_loss" in r]
    assert evals == [(r["step"], r["val_loss"]) for r in metrics(straight) if "val_loss" in r]
    assert torch.load(legs / "best.pt", weights_only=True)["step"] == \
        torch.load(straight / "best.pt", weights_only=True)["step"]
    # a last step off the interval is scored too
    train.main(resolve(bpe_args(bpe_data, small_file, legs, resume="auto", max_iters=9)))
    assert [r["step"] for r in hellaswag_rows(legs)] == [0, 2, 4, 6, 8, 9]
    # a resume with nothing left to train scores nothing, even where its checkpoint was not scored (as if
    # HellaSwag were newly asked for): it saves nothing, so a row went at the next resume, and each relaunch scored
    saved = torch.load(legs / "last.pt", weights_only=True)
    torch.save({**saved, "hellaswag_step": 8}, legs / "last.pt")
    train.main(resolve(bpe_args(bpe_data, small_file, legs, resume="auto", max_iters=9)))
    assert [r["step"] for r in hellaswag_rows(legs)] == [0, 2, 4, 6, 8, 9]


def test_eval_py_scores_a_checkpoint_with_its_dataset_loss(straight, bpe_data, small_file, capsys):
    out = run_eval(["--out_dir", straight, "--hellaswag", small_file, "--dataset=shakespeare",
                    "--data_dir", bpe_data, "--val_windows=8"], capsys)
    # the label names the data read: --data_dir overrides --dataset (it once said "shakespeare")
    assert any(re.fullmatch(rf"{re.escape(str(bpe_data))} val loss \d+\.\d{{4}} over 8 windows of 16 tokens", line)
               for line in out)
    final = hellaswag_rows(straight)[-1]
    assert out[-1] == (f"hellaswag: acc {final['hellaswag_acc']:.4f} acc_norm {final['hellaswag_acc_norm']:.4f} "
                       f"over 10 examples")
    # --data_dir alone is a dataset too (its loss was once skipped without a word)
    out = run_eval(["--out_dir", straight, "--hellaswag", small_file, "--limit=3", "--data_dir", bpe_data,
                    "--val_windows=8"], capsys)
    assert any(re.fullmatch(rf"{re.escape(str(bpe_data))} val loss \d+\.\d{{4}} over 8 windows of 16 tokens", line)
               for line in out)
    assert LINE.fullmatch(out[-1]) and out[-1].endswith("over 3 examples")


def test_eval_py_says_a_val_split_is_too_short_for_the_model_without_train_py_flags(straight, bpe_data, small_file,
                                                                                   tmp_path, capsys):
    short = Path(shutil.copytree(bpe_data, tmp_path / "short"))
    (short / "val.bin").write_bytes((short / "val.bin").read_bytes()[:2 * 10])  # 10 tokens; the model's block: 16
    (short / "meta.json").write_text(json.dumps({**json.loads((short / "meta.json").read_text()), "val_tokens": 10}))
    line = fails(["--out_dir", straight, "--hellaswag", small_file, "--data_dir", short], capsys)
    assert line.endswith("(10 tokens; it needs 17): use more data, or a model of a smaller block_size"), line
    # ... but a train split that short is no concern of an evaluation, which reads val alone (it was refused)
    short = Path(shutil.copytree(bpe_data, tmp_path / "short_train"))
    (short / "train.bin").write_bytes((short / "train.bin").read_bytes()[:2 * 10])
    (short / "meta.json").write_text(json.dumps({**json.loads((short / "meta.json").read_text()), "train_tokens": 10}))
    out = run_eval(["--out_dir", straight, "--no_hellaswag", "--data_dir", short, "--val_windows=2"], capsys)
    assert out[-1].startswith(f"{short} val loss "), out
    (short / "train.bin").unlink()  # nor a host's copy of val alone (it said "train.bin is missing")
    assert run_eval(["--out_dir", straight, "--no_hellaswag", "--data_dir", short, "--val_windows=2"], capsys) == out
    line = fails(["--out_dir", straight, "--hellaswag", small_file, "--data_dir", tmp_path / ("x" * 300)], capsys)
    assert line.startswith("error: data_dir is not a path a file system takes"), line  # as train.py says it
    line = fails(["--out_dir", straight, "--no_hellaswag", "--data_dir", straight], capsys)  # a run's out_dir (it
    assert line == f"error: {straight} is a training run's out_dir, not a dataset: give the dataset's folder"  # said:
    # prepare the dataset again there)


def test_a_character_level_model_or_dataset_is_refused(char_data, hf_folder, small_file, tmp_path, capsys):
    with pytest.raises(ConfigError, match="HellaSwag needs a model of GPT-2 BPE tokens.*'char' tokens: train with "
                                          "--hellaswag_interval=0, or"):
        train.main(resolve(tiny_args(char_data, tmp_path, hellaswag_interval=5, hellaswag_path=small_file)))
    train.main(resolve(tiny_args(char_data, tmp_path, max_iters=1)))
    assert "'char' tokens: evaluate --no_hellaswag with --dataset (the loss alone), or" in fails(
        ["--out_dir", tmp_path, "--hellaswag", small_file], capsys)
    # ... which gives the character model's loss alone (there was no way to skip HellaSwag)
    out = run_eval(["--out_dir", tmp_path, "--no_hellaswag", "--data_dir", char_data, "--val_windows=4"], capsys)
    assert re.fullmatch(rf"{re.escape(str(char_data))} val loss \d+\.\d{{4}} over 4 windows of 16 tokens", out[-1]), out
    assert "--no_hellaswag leaves nothing to evaluate" in fails(["--out_dir", tmp_path, "--no_hellaswag"], capsys)
    assert "not with --no_hellaswag" in fails(["--out_dir", tmp_path, "--no_hellaswag", "--data_dir", char_data,
                                               "--limit=5"], capsys)
    out = run_eval(["--out_dir", tmp_path, "--checkpoint=last", "--no_hellaswag", "--data_dir", char_data], capsys)
    assert out[-2].startswith(f"# {tmp_path / 'last.pt'} (step 1)"), out  # (best.pt without --checkpoint)
    # GPT-2's weights, and the loss on a character dataset: its ids are other tokens
    line = fails(["--init_from", hf_folder, "--hellaswag", small_file, "--data_dir", char_data], capsys)
    chars = json.loads((char_data / "meta.json").read_text())["vocab_size"]
    assert line == (f"error: {char_data} has another vocabulary (char of {chars} tokens) than the model (gpt2 of 50257 "
                    f"tokens): give a dataset of the model's tokenizer"), line
    # a dataset of as many characters, other ones: its ids are other characters (a loss was printed)
    other = Path(shutil.copytree(char_data, tmp_path / "other"))
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "chars": meta["chars"][::-1]}))
    assert fails(["--out_dir", tmp_path, "--no_hellaswag", "--data_dir", other], capsys) == (
        f"error: {other} has another vocabulary (char of {chars} tokens) than the model (char of {chars} tokens, other "
        f"characters): give a dataset of the model's tokenizer")


# --- several processes ---------------------------------------------------------------------

def _score_rank(rank, world_size, hf_folder, path, out):
    """One rank of a spawned world: the process group, the model, its share of the examples."""
    from collectives import process_group
    from world import place
    world = place("cpu", "float32", "gloo")
    with process_group(world, 60):
        examples = hellaswag.load(str(path), 64)
        model = pretrained.load_gpt(str(hf_folder))
        score, picks = hellaswag.evaluate(model, examples, world, torch.autocast("cpu", enabled=False), batch_size=20)
        # as under FSDP: a rank with fewer batches (24 examples are 5 batches) runs spare ones, counted nowhere
        same, _ = hellaswag.evaluate(model, examples, world, torch.autocast("cpu", enabled=False), batch_size=20,
                                     same_forwards=True)
    (out / f"w{world_size}r{rank}.json").write_text(json.dumps([score.__dict__, picks, same.__dict__]))


@pytest.mark.slow
def test_one_two_and_four_ranks_give_identical_counts(hf_folder, hs_file, tmp_path):
    examples = hellaswag.load(str(hs_file), 64)
    one, picks = hellaswag.evaluate(pretrained.load_gpt(str(hf_folder)), examples, World(),
                                    torch.autocast("cpu", enabled=False), batch_size=20)
    for world_size in (2, 4):
        run_ranks(_score_rank, world_size, hf_folder, hs_file, tmp_path)
        results = [json.loads((tmp_path / f"w{world_size}r{r}.json").read_text()) for r in range(world_size)]
        assert all(score == one.__dict__ == same for score, _, same in results)
        parts = [{int(i): tuple(p) for i, p in rank_picks.items()} for _, rank_picks, _ in results]
        assert sum(map(len, parts)) == len(examples) and {k: v for p in parts for k, v in p.items()} == picks


@pytest.mark.slow
def test_eval_py_under_torchrun_prints_the_one_process_line(hf_folder, hs_file):
    alone = subprocess.run([sys.executable, "eval.py", f"--init_from={hf_folder}", f"--hellaswag={hs_file}"],
                           cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    shared = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "eval.py", f"--init_from={hf_folder}", f"--hellaswag={hs_file}"],
                            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0 and shared.returncode == 0, alone.stderr + shared.stderr
    assert LINE.fullmatch(alone.stdout.splitlines()[-1])
    assert shared.stdout.splitlines()[-1] == alone.stdout.splitlines()[-1]
    assert "2 processes" in shared.stdout and ", 1 process\n" in alone.stdout  # (not "1 processes")


def _eval_rank(rank, world_size, args):
    import eval as eval_py
    eval_py.main(args[rank])
    return "scored"


@pytest.mark.slow
@pytest.mark.parametrize("differ", ["limit", "file"])
def test_eval_py_ranks_started_with_different_arguments_all_stop(hf_folder, hs_file, tmp_path, differ):
    """Another --limit, or another copy of the file on one host (here the first 5 lines of it): the
    ranks would score other examples, and their summed counts be neither's score."""
    short = tmp_path / "short.jsonl"
    short.write_text("".join(hs_file.read_text().splitlines(keepends=True)[:5]))
    args = [[f"--init_from={hf_folder}", "--device=cpu", f"--hellaswag={hs_file}", f"--limit={5 + 5 * r}"]
            if differ == "limit" else [f"--init_from={hf_folder}", "--device=cpu", f"--hellaswag={path}"]
            for r, path in enumerate((hs_file, short))]
    lines = ranks_say(_eval_rank, 2, tmp_path, args)
    assert lines[0] == lines[1]
    assert re.fullmatch(re.escape("rank 1 was started with limit=10 (rank 0: 5): give every rank the same config")
                        if differ == "limit" else r"rank 1 was started with examples='\w+' \(rank 0: '\w+'\): give "
                        r"every rank the same HellaSwag file \(each host's --hellaswag\)", lines[0]), lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("differ", ["model", "val split"])
def test_eval_py_ranks_that_loaded_another_model_or_val_split_all_stop(trained, char_data, tmp_path, differ):
    """Each host reads its own --out_dir and --data_dir: a rank that found another run's model there, or
    another val split, would score into the same sums (they once printed a loss or score neither gives)."""
    other = tmp_path / "other"
    if differ == "model":
        train.main(resolve(tiny_args(char_data, other, max_iters=1)))
    else:
        other = Path(shutil.copytree(char_data, other))
        (other / "val.bin").write_bytes((other / "val.bin").read_bytes()[:2000])
        meta = json.loads((other / "meta.json").read_text())
        (other / "meta.json").write_text(json.dumps({**meta, "val_tokens": 1000,  # (and from another text)
                                                     "source": {**meta["source"], "sha256": "0" * 64}}))
    out_dirs, data_dirs = ([trained, other], [char_data] * 2) if differ == "model" else \
        ([trained] * 2, [char_data, other])
    lines = ranks_say(_eval_rank, 2, tmp_path, [[f"--out_dir={o}", f"--data_dir={d}", "--no_hellaswag", "--device=cpu",
                                                 "--val_windows=4"] for o, d in zip(out_dirs, data_dirs)])
    assert lines[0] == lines[1]
    said = lines[0].split(": give")[0]
    found = re.fullmatch(r"rank 1 was started with model='\w+' \(rank 0: '\w+'\)" if differ == "model" else
                         r"rank 1 was started with val=\[1000, '(\w+)'\] \(rank 0: \[6002, '(\w+)'\]\)", said)
    assert found and (differ == "model" or found[1] != found[2]), lines[0]
    assert lines[0].endswith(": give every rank the same model and val split (each host's --out_dir or --init_from, "
                             "and --data_dir)")


def _load_rank(rank, world, paths):
    """One rank of train.py's HellaSwag start-up, reading its host's copy: paths[rank]."""
    hellaswag.load_on_every_rank(str(paths[rank]), {"tokenizer": "gpt2"}, 64, world)
    return "loaded"


@pytest.mark.slow
@pytest.mark.parametrize("change", ["a wrong ending", "the label"])
def test_training_ranks_with_copies_differing_in_one_example_all_stop(hs_file, tmp_path, change):
    """Rank 1's copy has as many examples, the same labels and right endings, one wrong ending
    changed (or the same endings, one label changed): its scores differ, and summed with rank 0's
    they are neither copy's. (The check once digested the label's row alone, and train.py's
    start-up did not compare the copies at all.)"""
    lines = hs_file.read_text().splitlines(keepends=True)
    example = json.loads(lines[3])
    wrong = (example["label"] + 1) % 4
    if change == "the label":
        example["label"] = wrong
    else:
        example["endings"][wrong] = example["endings"][wrong] + " slowly"
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(lines[:3] + [json.dumps(example) + "\n"] + lines[4:]))
    lines = ranks_say(_load_rank, 2, tmp_path, [hs_file, copy], in_group=True)
    assert lines[0] == lines[1]
    assert re.fullmatch(r"rank 1 was started with examples='\w+' \(rank 0: '\w+'\): give every rank the same "
                        r"HellaSwag file \(each host's hellaswag_path\)", lines[0]), lines[0]


@pytest.mark.slow
def test_hellaswag_in_training_under_fsdp(bpe_data, tmp_path):
    from harness import run_world
    nine = write_examples(tmp_path / "nine.jsonl", 9, seed=2, ctx_words=(2, 8), end_words=(1, 4))  # 5 and 4 forwards:
    run_world(2, bpe_args(bpe_data, nine, tmp_path / "fsdp", strategy="fsdp", dist_timeout=60),  # the second rank
              tmp_path / "results")  # makes one more, on nothing (FSDP's all-gathers: each rank's forwards alike)
    rows = hellaswag_rows(tmp_path / "fsdp")
    assert [r["step"] for r in rows] == [0, 2, 4, 6, 8] and all(r["hellaswag_examples"] == 9 for r in rows)
    train.main(resolve(bpe_args(bpe_data, nine, tmp_path / "alone", max_iters=0)))
    assert rows[0] == hellaswag_rows(tmp_path / "alone")[0]  # the same initial weights score the same


def test_plot_runs_adds_a_hellaswag_panel(straight, tmp_path):
    import matplotlib.image
    import plot_runs
    assert [s for s, _ in plot_runs.read_run(straight)["hellaswag"]] == [0, 2, 4, 6, 8]
    plot_runs.main([str(straight), f"--out={tmp_path / 'runs.png'}"])
    height, width, _ = matplotlib.image.imread(tmp_path / "runs.png").shape
    assert width > 2.5 * height  # three panels side by side (two are 11 x 4.2 inches)
