"""Corpora as token shards: the FineWeb and OpenWebText prepare scripts on local files (the hub is
never touched), llm.c's shard format, and training over many shards with the loader's guarantees."""

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import train
from config import Config, resolve
from data import streaming
from data.dataset import Shard, meta_from_shards, other_source, read_shard_header, write_shard
from data.documents import local_source
from data.tokenizers import gpt2_encoding
from errors import ConfigError, interrupted
from harness import (REPO, assert_close_runs, children, ckpt, make_char_dataset, raising, read_epochs, record_epochs,
                     shard_dataset, small_disk, tiny_args, train_log, train_run, wait_for)
from loader import Dataset, ShardedTokenLoader, Tokens

WORDS = ("the king queen fool lord speaks laughs sleeps at night in the hall for love again softly "
         "what news, my good sir? none at all! 'tis cold; 42 ducats").split()


def documents(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 300))) + "\n" for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~1 MB of text in three files: two parquet (with another column beside `text`; the second's
    text dictionary-encoded, as pandas writes a categorical), one jsonl."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = documents(2400, seed=0)
    for i, part in enumerate((docs[:900], docs[900:1600])):
        text = pa.array(part).dictionary_encode() if i else part
        pq.write_table(pa.table({"id": list(range(len(part))), "text": text}), folder / f"part{i}.parquet",
                       row_group_size=128)
    with open(folder / "part2.jsonl", "w") as f:
        for d in docs[1600:]:
            f.write(json.dumps({"text": d, "url": "x"}) + "\n")
    return folder, docs


def encoded(docs) -> np.ndarray:
    enc = gpt2_encoding(verbose=False)
    return np.concatenate([[50256] + enc.encode_ordinary(d) for d in docs]).astype(np.uint16)


def shard_tokens(folder: Path, entries) -> np.ndarray:
    return np.concatenate([np.fromfile(folder / e["file"], dtype=np.uint16, offset=1024) for e in entries])


def prepare(script: str, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"data/{script}/prepare.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_fineweb_prepare_writes_llm_c_shards_of_every_document_after_an_eot(corpus, tmp_path):
    folder, docs = corpus
    out = tmp_path / "fineweb"
    proc = prepare("fineweb", f"--input={folder}/part*", f"--out_dir={out}", "--shard_tokens=40000", "--workers=2")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    entries = meta["shards"]["val"] + meta["shards"]["train"]
    assert [e["file"] for e in entries] == [f"fineweb_{'val' if i == 0 else 'train'}_{i:06d}.bin"
                                            for i in range(len(entries))]  # the first shard is val
    assert len(entries) >= 5 and all(e["tokens"] == 40000 for e in entries[:-1])
    for e in entries:
        header = np.fromfile(out / e["file"], dtype="<i4", count=256)
        assert header[:3].tolist() == [20240520, 1, e["tokens"]] and not header[3:].any()
        assert (out / e["file"]).stat().st_size == 1024 + 2 * e["tokens"]
        assert read_shard_header(out / e["file"]) == ("uint16", e["tokens"])
    expected = encoded(docs)  # tiktoken's tokens of the same documents, each after one EOT
    assert meta["train_tokens"] + meta["val_tokens"] == len(expected)
    assert np.array_equal(shard_tokens(out, entries), expected)
    assert meta["documents"] == len(docs) and meta["source"]["input"] == f"{folder}/part*"
    assert all(hashlib.sha256((out / e["file"]).read_bytes()).hexdigest() == e["sha256"] for e in entries)
    assert sorted(p.name for p in out.iterdir()) == sorted([e["file"] for e in entries] + ["meta.json"])
    # train.py --prepare_input takes the shards prepared as it advised (it said "made from local files, not from")
    Dataset(Config(dataset="fineweb", data_dir=str(out), block_size=16, prepare_input=f"{folder}/part*"))
    assert other_source(meta, f"{folder}/part0.parquet") == (f"made from {folder}/part*, not from prepare_input "
                                                            f"{folder}/part0.parquet")
    made = meta["prepared_with"]
    for edited in ({**made, "file_sizes": [1, 2, 3]}, {k: v[:2] if "file" in k else v for k, v in made.items()}):
        assert other_source({**meta, "prepared_with": edited}, f"{folder}/part*") == (  # (a file edited, or one
            f"made from {folder}/part* before it changed")  # that matches the pattern added since)


@pytest.mark.slow
def test_openwebtext_prepare_splits_documents_by_nanogpts_rule(corpus, tmp_path):
    folder, docs = corpus
    out = tmp_path / "owt"
    proc = prepare("openwebtext", f"--input={folder}/part*", f"--out_dir={out}", "--shard_tokens=100000",
                   "--workers=2")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    # datasets' train_test_split(test_size=0.0005, seed=2357): the first ceil(0.0005 n) of the permutation
    val = set(np.random.default_rng(2357).permutation(len(docs))[:2].tolist())
    assert np.array_equal(shard_tokens(out, meta["shards"]["val"]), encoded([d for i, d in enumerate(docs) if i in val]))
    assert np.array_equal(shard_tokens(out, meta["shards"]["train"]),
                          encoded([d for i, d in enumerate(docs) if i not in val]))
    assert meta["shards"]["val"][0]["file"] == "openwebtext_val_000000.bin"
    assert meta["prepared_with"]["split_seed"] == 2357 and meta["prepared_with"]["val_fraction"] == 0.0005  # (rerun)


def wait_for_shards(proc, out: Path, stream: str, count: int):
    """Until out/.progress.json lists `count` of `stream`'s shards, the prepare still running."""
    def listed():
        try:  # (written by rename; removed when the prepare finishes)
            return len(json.loads((out / ".progress.json").read_text())["streams"][stream]["shards"])
        except (FileNotFoundError, KeyError):
            return 0
    deadline = time.monotonic() + 60
    while listed() < count:
        assert proc.poll() is None and time.monotonic() < deadline, "the prepare finished before it could be killed"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_prepare_killed_or_out_of_disk_midway_continues_to_byte_identical_shards(corpus, tmp_path):
    folder = Path(shutil.copytree(corpus[0], tmp_path / "corpus"))  # (changed below)
    args = [f"--input={folder}/part*", "--shard_tokens=3000", "--workers=1"]
    assert prepare("fineweb", *args, f"--out_dir={tmp_path / 'straight'}").returncode == 0
    straight = {p.name: p.read_bytes() for p in (tmp_path / "straight").iterdir()}
    for sig, workers, whom in ((signal.SIGKILL, 1, "prepare"), (signal.SIGTERM, 2, "prepare"),
                               (signal.SIGKILL, 2, "worker"), (signal.SIGINT, 2, "group"), (signal.SIGTERM, 2, "group"),
                               (signal.SIGINT, 2, "group starting"), (signal.SIGTERM, 2, "group starting")):
        out = tmp_path / f"{sig.name}-{whom}"
        proc = subprocess.Popen([sys.executable, "data/fineweb/prepare.py", *args, f"--workers={workers}",
                                 f"--out_dir={out}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=whom.startswith("group"))
        if whom == "group starting":  # the workers still importing (each said a KeyboardInterrupt's traceback)
            wait_for(lambda: children(proc.pid, "spawn_main"), proc, what="a tokenizing process")
        else:
            wait_for_shards(proc, out, "stream", 5)
        if whom == "worker":  # a tokenizing process (the out-of-memory killer's choice): once a hang
            os.kill(children(proc.pid, "spawn_main")[0], sig)
        elif whom.startswith("group"):  # as a terminal's Ctrl-C (or `timeout`) reaches every process
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        err = proc.communicate(timeout=60)[1]
        assert not (out / "meta.json").exists()
        if whom == "worker":
            assert proc.returncode == 1 and err == (
                "error: a tokenizing process was killed (the out-of-memory killer?): run the same command again, "
                "which goes on from the last shard written (fewer --workers use less memory)\n"), err
        if sig != signal.SIGKILL:  # (a scheduler's, `timeout`'s): as Ctrl-C, not worker tracebacks, leaked semaphores
            assert (proc.returncode, err) == (128 + sig, f"error: {interrupted(sig)}\n"), err
            assert [p.name for p in out.iterdir() if ".tmp" in p.name] == []
        resumed = prepare("fineweb", *args, f"--out_dir={out}")
        assert resumed.returncode == 0 and ("resuming: " in resumed.stdout or whom == "group starting"), resumed.stderr
        assert {p.name: p.read_bytes() for p in out.iterdir()} == straight  # no temporaries, no progress file
    # openwebtext's val stream writes no shard before the end: a resume starts at its first document, not
    # at the train stream's resume point (the val documents before it were lost to the val split)
    assert prepare("openwebtext", *args, f"--out_dir={tmp_path / 'owt'}").returncode == 0
    proc = subprocess.Popen([sys.executable, "data/openwebtext/prepare.py", *args, f"--out_dir={tmp_path / 'owt-9'}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_shards(proc, tmp_path / "owt-9", "train", 60)  # (past part0, whose 502nd document is val's)
    proc.kill()
    proc.wait()
    assert prepare("openwebtext", *args, f"--out_dir={tmp_path / 'owt-9'}").returncode == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "owt-9").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "owt").iterdir()}
    # a disk that fills midway: one line naming the folder (once a bare "[Errno 28] No space left on
    # device"), and what was written goes on, once there is room, to the same bytes
    with small_disk(tmp_path / "tiny", f"{sum(map(len, straight.values())) // 2048}k") as disk:
        full = prepare("fineweb", *args, f"--out_dir={disk / 'out'}")
        assert full.returncode == 2 and full.stderr == (f"error: [Errno 28] No space left on device for the dataset in "
                                                        f"{disk / 'out'}: free space there, then prepare again\n")
        shutil.copytree(disk / "out", tmp_path / "moved")
    # a file the written shards hold documents of may not change (one replaced under its name mixed two
    # corpora); one not reached yet may (a bad line fixed)
    progress = json.loads((tmp_path / "moved" / ".progress.json").read_text())
    assert progress["counts"][:1] == [900] and progress["streams"]["stream"]["resume"][0] < 1600  # part1: in part
    originals = {name: (folder / name).read_bytes() for name in ("part0.parquet", "part2.jsonl")}
    (folder / "part2.jsonl").write_bytes(originals["part2.jsonl"] + b'{"text": "one more"}\n')
    later = prepare("fineweb", *args, f"--out_dir={shutil.copytree(tmp_path / 'moved', tmp_path / 'later')}")
    assert later.returncode == 0 and "resuming: " in later.stdout, later.stderr
    pq.write_table(pq.read_table(folder / "part0.parquet").slice(0, 899), folder / "part0.parquet")
    mixed = prepare("fineweb", *args, f"--out_dir={tmp_path / 'moved'}")
    assert mixed.returncode == 2 and mixed.stderr.startswith(f"error: {folder / 'part0.parquet'} is not the file the "
                                                             f"interrupted prepare in {tmp_path / 'moved'} read ("), \
        mixed.stderr
    for name, data in originals.items():
        (folder / name).write_bytes(data)
    resumed = prepare("fineweb", *args, f"--out_dir={tmp_path / 'moved'}")
    assert resumed.returncode == 0 and "resuming: " in resumed.stdout, resumed.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "moved").iterdir()} == straight


@pytest.mark.slow
def test_preparing_again_leaves_a_finished_dataset_alone(corpus, tmp_path):
    folder, _ = corpus
    source, out = tmp_path / "part2.jsonl", tmp_path / "out"
    shutil.copy(folder / "part2.jsonl", source)
    args = [f"--input={source}", f"--out_dir={out}", "--shard_tokens=50000", "--workers=1"]
    assert prepare("fineweb", *args).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = prepare("fineweb", f"--input={os.path.relpath(source, REPO)}", *args[1:])  # the same file, named so
    assert again.returncode == 0 and "is already prepared" in again.stdout, again.stderr
    source.write_bytes(source.read_bytes()[:5000].rsplit(b"\n", 1)[0] + b"\n")  # other text under the same name
    mixed = prepare("fineweb", *args)
    assert mixed.returncode == 2 and "prepared with other settings (input file sizes)" in mixed.stderr, mixed.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.copy(folder / "part2.jsonl", source)
    meta = json.loads((out / "meta.json").read_text())  # as prepares wrote it before sizes were recorded
    made = {k: v for k, v in meta["prepared_with"].items() if k != "file_sizes"}
    (out / "meta.json").write_text(json.dumps({**meta, "prepared_with": {
        **made, "files": [os.path.relpath(source, REPO)], "input": os.path.relpath(source, REPO)}}))
    assert "is already prepared" in prepare("fineweb", *args).stdout  # (it said: remove it)


def write_llm_c_shard(path: Path, tokens, magic=20240520, version=1, dtype=np.uint16):
    """An independent writer of llm.c's format: header of 256 int32, then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=dtype).tobytes())


def test_shards_from_another_writer_train_as_they_are(tmp_path, monkeypatch, script):
    data = tmp_path / "pretokenized"  # no meta.json: read as GPT-2 BPE tokens
    data.mkdir()
    rng = np.random.default_rng(0)
    write_llm_c_shard(data / "mini_val_000000.bin", rng.integers(0, 50257, 3000))
    for i in (1, 2):
        write_llm_c_shard(data / f"mini_train_{i:06d}.bin", rng.integers(0, 50257, 5000))
    result = train.main(resolve(tiny_args(data, tmp_path / "out", max_iters=4, eval_interval=2)))
    assert result["step"] == 4 and np.isfinite(result["val_loss"])
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["train_tokens"] == 10000
    assert sorted(p.name for p in data.iterdir()) == ["mini_train_000001.bin", "mini_train_000002.bin",
                                                      "mini_val_000000.bin"]  # nothing written there
    # a prepare pointed at them (to get a meta.json, say) wrote its shards over theirs: llm.c's names are its own
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    (tmp_path / "c.jsonl").write_text("".join(f'{{"text": "hello world {i}"}}\n' for i in range(300)))
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 cut short")  # (refused before any file is read: or downloaded)
    for corpus in ("fineweb", "openwebtext"):
        proc = script(f"data/{corpus}/prepare.py", f"--input={tmp_path}/c*", f"--out_dir={data}", "--workers=1",
                      "--shard_tokens=500")
        assert proc.returncode == 2 and proc.stderr == (
            f"error: {data} holds token shards no prepare of this repo is writing (no .progress.json): they train "
            f"as they are (docs/data.md); choose another --out_dir to prepare anew\n"), proc.stderr
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before
    write_llm_c_shard(tmp_path / "wide.bin", [70000, 1], magic=20240801, version=7, dtype=np.uint32)
    assert read_shard_header(tmp_path / "wide.bin") == ("uint32", 2)
    nano = tmp_path / "nanogpt"  # nanoGPT's train.bin and val.bin: bare uint16 GPT-2 ids, no meta.json
    nano.mkdir()
    for split, n in (("train", 6000), ("val", 3000)):
        rng.integers(0, 50257, n).astype(np.uint16).tofile(nano / f"{split}.bin")
    with pytest.raises(ConfigError, match="nanoGPT's GPT-2 token files train once a meta.json describes them"):
        train.main(resolve(tiny_args(nano, tmp_path / "nano_out")))
    monkeypatch.chdir(nano)  # the meta.json docs/data.md gives, written as it says: then they train
    exec(re.search(r"python -c '(.+)'", (REPO / "docs" / "data.md").read_text()).group(1), {})
    result = train.main(resolve(tiny_args(nano, tmp_path / "nano_out", max_iters=2, eval_interval=2)))
    assert result["step"] == 2 and json.loads((nano / "meta.json").read_text())["train_tokens"] == 6000


def test_a_window_never_crosses_a_shard_end(tmp_path):
    lengths, offset = (100, 37, 260, 5, 81), 0
    shards = []
    for i, n in enumerate(lengths):  # token value = its position in the split, unique across shards
        write_shard(tmp_path / f"s{i}.bin", np.arange(offset, offset + n, dtype=np.uint16))
        shards.append(Shard(tmp_path / f"s{i}.bin", "uint16", 1024, n))
        offset += n
    ends = np.cumsum(lengths)
    loader = ShardedTokenLoader(Tokens(shards), 8, 4, 8, 0, 1, seed=0)
    for epoch in range(8):
        loader.set_epoch(epoch)
        seen = []
        while not loader.epoch_done:
            x, y = loader.next_batch()
            rows = torch.cat([x, y[:, -1:]], dim=1).numpy()
            assert (np.diff(rows, axis=1) == 1).all()  # consecutive tokens of one shard
            shard_of = np.searchsorted(ends, rows, side="right")
            assert (shard_of == shard_of[:, :1]).all()
            seen += rows[:, 0].tolist()
        assert len(seen) == len(set(seen)) == loader.windows_per_epoch
    assert loader.n_windows == sum(max(n // 8 - 1, 0) for n in lengths)


@pytest.fixture(scope="module")
def sharded(char_data, tmp_path_factory):
    return shard_dataset(char_data, tmp_path_factory.mktemp("sharded") / "data")


@pytest.mark.slow
def test_world_size_invariance_and_exact_resume_hold_over_shards(sharded, tmp_path):
    for w in (1, 2):
        train_run(w, sharded, tmp_path / f"w{w}")
    assert_close_runs(tmp_path / "w1", tmp_path / "w2")
    legs = tmp_path / "legs"
    train_run(2, sharded, legs, max_iters=4)
    train_run(2, sharded, legs, resume="auto")
    a, b = ckpt(tmp_path / "w2"), ckpt(legs)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert train_log(tmp_path / "w2") == train_log(legs)


@pytest.mark.slow
def test_epochs_over_shards_never_repeat_a_window_and_resume_on_the_boundary(char_data, tmp_path, monkeypatch):
    (tmp_path / "small").mkdir()
    small = shard_dataset(make_char_dataset(tmp_path / "small", n_chars=3000), tmp_path / "sharded")
    meta = json.loads((small / "meta.json").read_text())
    ends = np.cumsum([s["tokens"] for s in meta["shards"]["train"]])
    monkeypatch.setenv("EPOCH_LOG", str(tmp_path / "epochs"))
    common = dict(max_iters=20, lr_decay_iters=20, eval_interval=10)
    train_run(2, small, tmp_path / "straight", patch=record_epochs, **common)
    _, per_epoch = read_epochs(tmp_path / "epochs")
    assert len(per_epoch) >= 2
    for starts in per_epoch.values():
        assert len(starts) == len(set(starts))
        starts = np.array(starts)
        assert (np.searchsorted(ends, starts, side="right") == np.searchsorted(ends, starts + 16, side="right")).all()
    steps_per_epoch = len(per_epoch[0]) // 16
    legs = tmp_path / "legs"
    train_run(2, small, legs, **{**common, "max_iters": steps_per_epoch, "eval_interval": steps_per_epoch})
    assert ckpt(legs)["loader"]["position"] == steps_per_epoch * 16
    train_run(2, small, legs, **common, resume="auto")
    a, b = ckpt(tmp_path / "straight"), ckpt(legs)
    assert a["loader"] == b["loader"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


# ----------------------------------------------------------------------------- bad input

def damaged_inside(folder: Path):
    """c.parquet, its footer whole (it opens) and bytes of its data pages overwritten."""
    pq.write_table(pa.table({"text": [f"word {i} " * 20 for i in range(3000)]}), folder / "c.parquet")
    data = bytearray((folder / "c.parquet").read_bytes())
    data[len(data) // 3:len(data) // 3 + 200] = b"Z" * 200
    (folder / "c.parquet").write_bytes(data)


def damaged_footer(folder: Path):
    """c.parquet, the start of its footer overwritten: pyarrow's message ends in a newline."""
    pq.write_table(pa.table({"text": ["a document"]}), folder / "c.parquet")
    data = bytearray((folder / "c.parquet").read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[footer:footer + 8] = b"\xff" * 8
    (folder / "c.parquet").write_bytes(data)


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "c.jsonl").write_text('{"body": "no text here"}\n'), "c.jsonl, line 1: no 'text' field"),
    (lambda d: (d / "c.jsonl").write_text('{"text": "a"}\n{"text": "b\n'), "c.jsonl, line 2: not a line of UTF-8 JSON"),
    (lambda d: (d / "c.jsonl").write_bytes(b'{"text": "caf\xe9"}\n'), "c.jsonl, line 1: not a line of UTF-8 JSON"),
    (lambda d: (d / "c.jsonl").write_text("[" * 100_000), "c.jsonl, line 1: not a line of UTF-8 JSON"),
    (lambda d: (d / "c.txt").write_bytes(b"caf\xe9 au lait"),
     "c.txt is not UTF-8 text (invalid continuation byte at byte 3)"),
    (lambda d: pq.write_table(pa.table({"content": ["x"]}), d / "c.parquet"), "c.parquet has no 'text' column"),
    (lambda d: pq.write_table(pa.table({"text": [1, 2]}), d / "c.parquet"),
     "c.parquet: its 'text' column holds int64, not strings"),
    (lambda d: pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), 2, pa.array(
        [b"ok", b"\xff\xfe bad"], pa.binary()).buffers())}), d / "c.parquet"),  # (pyarrow writes what it is given)
     "c.parquet: a document in its 'text' column is not UTF-8 (invalid start byte, byte 0xff): give the documents"),
    (lambda d: pq.write_table(pa.table([["a"], ["b"]], names=["text", "text"]), d / "c.parquet"),
     "c.parquet has 2 'text' columns"),
    (lambda d: (d / "c.parquet").write_bytes(b"PAR1 cut short"), "c.parquet is not a readable parquet file ("),
    (damaged_inside, "c.parquet is not a readable parquet file (Corrupt snappy compressed data"),  # once unnamed
    (damaged_footer, "c.parquet is not a readable parquet file (Couldn't deserialize thrift"),  # once two lines
    (lambda d: (d / "c.jsonl").write_text(""), "the corpus holds no documents"),
    (lambda d: (d / "c.txt").write_text("a short corpus"),  # the count once came from the progress bar: 0 here
     "the corpus (1 document, 4 tokens) gives no train shard: too small for --shard_tokens"),
])
def test_a_bad_corpus_exits_2_with_one_line_and_writes_nothing(tmp_path, script, make, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    make(corpus)
    out = tmp_path / "out"
    proc = script("data/fineweb/prepare.py", f"--input={corpus}/*", f"--out_dir={out}", "--workers=1")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not list(out.glob("*.bin")) and not (out / "meta.json").exists() and not (out / ".progress.json").exists()
    if "readable parquet" in message or "columns" in message:  # openwebtext counts the documents first: named too
        proc = script("data/openwebtext/prepare.py", f"--input={corpus}/*", f"--out_dir={out}", "--workers=1")
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    if "gives no train shard" in message:  # (one case): a shard past what its header counts, refused before a buffer
        proc = script("data/fineweb/prepare.py", f"--input={corpus}/*", f"--out_dir={out}", f"--shard_tokens={2**31}")
        assert proc.returncode == 2 and "must be 1 to 2**31 - 1" in proc.stderr, proc.stderr
        for workers in (0, 100_000):  # not all the cores; not processes started one by one for minutes
            proc = script("data/fineweb/prepare.py", f"--input={corpus}/*", f"--out_dir={out}", f"--workers={workers}")
            assert proc.returncode == 2 and proc.stderr.startswith(f"error: --workers ({workers}) must be 1 to 4 x this "
                                                                   f"host's"), proc.stderr  # (not both options)
        # exactly one shard's tokens: its val shard and .progress.json stayed, a rerun ended so again, and a
        # smaller --shard_tokens (the advice) was refused as other settings
        proc = script("data/fineweb/prepare.py", f"--input={corpus}/*", f"--out_dir={out}", "--shard_tokens=4",
                      "--workers=1")
        assert proc.returncode == 2 and "(1 document, 4 tokens) gives no train shard" in proc.stderr, proc.stderr
        assert not list(out.iterdir())
        proc = script("data/fineweb/prepare.py", f"--input={corpus}/*", f"--out_dir={out}", "--shard_tokens=2",
                      "--workers=1")
        assert proc.returncode == 0, proc.stderr
        shards = json.loads((out / "meta.json").read_text())["shards"]  # 4 tokens, 2 a shard: no empty third
        assert [e["tokens"] for e in shards["val"] + shards["train"]] == [2, 2]


def test_blank_jsonl_lines_are_skipped_and_a_null_parquet_text_is_an_empty_document(tmp_path, script):
    (tmp_path / "corpus").mkdir()  # (a byte-order mark starting a .jsonl or a .txt file is no text; a text that
    # names the end-of-text token is text: it was the token, a document boundary that is none)
    (tmp_path / "corpus" / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a <|endoftext|> b"}\n\n{"text": "c"}\n\n')
    pq.write_table(pa.table({"text": pa.array(["d", None], pa.large_string())}),  # (Polars' strings)
                   tmp_path / "corpus" / "b.parquet")
    (tmp_path / "corpus" / "c.txt").write_bytes(b"\xef\xbb\xbfe f")
    pq.write_table(pa.table({"text": pa.array(["g", "g h"]).dictionary_encode()}), tmp_path / "corpus" / "d.parquet")
    out = tmp_path / "out"  # (d: a pandas categorical column's strings)
    proc = script("data/fineweb/prepare.py", f"--input={tmp_path}/corpus/*", f"--out_dir={out}", "--shard_tokens=2",
                  "--workers=1")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 7 and np.array_equal(shard_tokens(out, meta["shards"]["val"] + meta["shards"]["train"]),
                                                     encoded(["a <|endoftext|> b", "c", "d", "", "e f", "g", "g h"]))


def test_the_pool_holds_the_stop_signals_only_in_the_main_thread():
    """Called from another thread, encode_all failed (only the main thread sets handlers) and left them blocked."""
    from data import workers
    seen = {}

    def hold():
        with workers._stops_held():
            seen["inside"] = True
        seen["blocked"] = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    thread = threading.Thread(target=hold)
    thread.start()
    thread.join()
    assert seen == {"inside": True, "blocked": set()}
    with workers._stops_held():  # the main thread: blocked inside, as before after
        assert set(workers.STOPS) <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert not set(workers.STOPS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_tokenizing_worker_leaves_ctrl_c_to_the_main_process_and_reports_a_failed_start(monkeypatch):
    # each worker once printed a KeyboardInterrupt traceback, and the main process could hang on the dead pool
    import signal

    from data import workers
    monkeypatch.setattr(workers, "gpt2_encoding", lambda verbose: None)
    monkeypatch.setattr(workers, "_encoder", None)  # (restored after)
    previous = signal.getsignal(signal.SIGINT)
    try:
        workers._start_worker()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        # a worker whose start failed raises at its first document: a pool restarts a failed start for ever
        monkeypatch.setattr(workers, "gpt2_encoding", raising(ValueError("not GPT-2's vocabulary")))
        workers._start_worker()
        with pytest.raises(ValueError, match="^not GPT-2's vocabulary$"):
            workers._encode((0, "a document"))
    finally:
        signal.signal(signal.SIGINT, previous)


def test_signals_unwind_only_where_a_handler_can_be_set():
    """(a prepare's SIGTERM handler: prepare() called from a thread raised "signal only works in main thread")"""
    import signal
    import threading

    from errors import signals_unwind
    before, seen = signal.getsignal(signal.SIGTERM), []
    with signals_unwind():
        assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) == before

    def in_a_thread():
        with signals_unwind():
            seen.append(signal.getsignal(signal.SIGTERM))
    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [before]



# a meta.json whose shard list is well formed, but whose train shards hold one token more than train_tokens
MISCOUNTED = {"format": 1, "vocab_size": 50257, "dtype": "uint16", "tokenizer": "gpt2", "train_tokens": 10,
              "val_tokens": 5, "shards": {"train": [{"file": "x_train_000001.bin", "tokens": 11}],
                                          "val": [{"file": "x_val_000000.bin", "tokens": 5}]}}


@pytest.mark.parametrize("name, text", [("meta.json", "[]"), (".progress.json", "[]"),
                                        (".progress.json", '{"settings": {}, "counts": [], "streams": {"s": {}}}'),
                                        (".progress.json", ""),
                                        (".progress.json", '{"settings": {}, "counts": ["9"], "streams": {}}'),
                                        (".progress.json", '{"settings": {}, "counts": [], "streams": {"s": {'
                                                           '"shards": [{"split": "Val", "file": "x.bin", '
                                                           '"tokens": 1, "sha256": "0"}], "resume": [0, 0]}}}'),
                                        # and nested past what the parser takes:
                                        pytest.param("meta.json", "[" * 100_000, id="meta.json-nested"),
                                        pytest.param(".progress.json", "[" * 100_000, id="progress-nested"),
                                        pytest.param("meta.json", json.dumps(MISCOUNTED), id="meta.json-miscounted")])
def test_a_damaged_meta_or_progress_file_is_one_line_naming_it(corpus, tmp_path, script, name, text):
    folder, _ = corpus
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text(text)
    proc = script("data/fineweb/prepare.py", f"--input={folder}/part2.jsonl", f"--out_dir={out}", "--workers=1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"error: {out / name}" in proc.stderr and f"remove {out} and prepare again" in proc.stderr, proc.stderr
    if "train_tokens" in text:
        assert "the train shards add up to another count than train_tokens" in proc.stderr, proc.stderr


def test_a_resume_lets_change_only_the_files_its_shards_hold_nothing_of(tmp_path):
    # sizes then, sizes now, documents per file read whole, the first document not in a written shard
    assert streaming._changed_in_shards([5, 6, 7], [5, 6, 8], [10, 10], 15) is None  # the third is not reached
    assert streaming._changed_in_shards([5, 6, 7], [5, 9, 7], [10], 15) == 1  # read in part: its start is in shards
    assert streaming._changed_in_shards([5, 6, 7], [5, 9, 7], [10], 10) is None  # ... not when a shard ends before it
    assert streaming._changed_in_shards([5, 6, 7], [5, 6, 8], [10, 10, 10], float("inf")) == 2  # openwebtext: any
    assert streaming._changed_in_shards(None, [5], [], 3) is None  # (the hub's files: no sizes)
    (tmp_path / ".progress.json").write_text(json.dumps({  # a prepare stopped in the first file: no shard written
        "settings": {"files": ["a", "b", "c"], "file_sizes": [5, 6, 7]}, "counts": [10, 10, 10],
        "streams": {"all": {"resume": [5, 0], "shards": []}}}))
    now = {"files": ["a", "b", "c"], "file_sizes": [5, 6, 8]}
    assert streaming.read_progress(tmp_path, now)["counts"] == [10, 10, 10]  # fineweb: "c" is not read yet
    with pytest.raises(ValueError, match="^c is not the file the interrupted prepare"):  # openwebtext's split counts it
        streaming.read_progress(tmp_path, now, every_file=True)
    for used, refused in ((0, False), (3, True)):  # stopped as the second file begins: "b" may change if no token
        (tmp_path / ".progress.json").write_text(json.dumps({  # of it is in a shard (a .txt file: one document)
            "settings": {"files": ["a", "b", "c"], "file_sizes": [5, 6, 7]}, "counts": [10],
            "streams": {"all": {"resume": [10, used], "shards": []}}}))
        with pytest.raises(ValueError, match="^b is not the file") if refused else contextlib.nullcontext():
            streaming.read_progress(tmp_path, {"files": ["a", "b", "c"], "file_sizes": [5, 9, 7]})  # (it was not)
    for sizes in (5, 0, ["5", "6", "7"]):  # edited by hand: was a TypeError's traceback
        progress = json.loads((tmp_path / ".progress.json").read_text())
        progress["settings"]["file_sizes"] = sizes
        (tmp_path / ".progress.json").write_text(json.dumps(progress))
        with pytest.raises(ValueError, match=f"^{tmp_path / '.progress.json'} is damaged \\(it is not what a prepare"):
            streaming.read_progress(tmp_path, now)


def test_a_prepare_takes_up_only_its_own_settings_and_its_shards_as_written(tmp_path, capsys):
    """finished() and read_progress(), which every prepare runs before any work, word for word (the slow
    prepares above run them from the command line)."""
    settings = {"files": [str(tmp_path / "a.jsonl")], "file_sizes": [10], "shard_tokens": 5000, "prefix": "x"}
    write_llm_c_shard(tmp_path / "x_train_000001.bin", np.arange(5000))
    write_llm_c_shard(tmp_path / "x_val_000000.bin", np.arange(3000))
    listing(tmp_path)
    meta = {**json.loads((tmp_path / "meta.json").read_text()), "prepared_with": settings, "documents": 7}
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "documents": "7"}))  # edited by hand (were tracebacks)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'meta.json'}: documents is '7', not a count: remove "):
        streaming.finished(tmp_path, settings)
    assert streaming.differs({k: v for k, v in settings.items() if k != "files"}, settings) == "input files"
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert streaming.finished(tmp_path, settings)["train_tokens"] == 5000
    assert capsys.readouterr().out == f"{tmp_path} is already prepared (8,000 tokens)\n"
    with pytest.raises(ValueError) as other:
        streaming.finished(tmp_path, {**settings, "shard_tokens": 4000, "file_sizes": [11]})
    assert str(other.value) == (f"{tmp_path} already holds a dataset prepared with other settings (input file "
                                f"sizes, shard_tokens): remove it or choose another --out_dir")
    shard = {"file": "x_train_000001.bin", "tokens": 5000, "split": "train", "sha256": ""}
    (tmp_path / ".progress.json").write_text(json.dumps({"settings": settings, "counts": [10], "streams": {
        "stream": {"resume": [5, 0], "shards": [shard]}}}))
    assert streaming.finished(tmp_path, settings) is None  # interrupted: not finished
    assert streaming.read_progress(tmp_path, settings)["counts"] == [10]
    assert capsys.readouterr().out == f"resuming: 1 shard already written in {tmp_path}\n"
    with pytest.raises(ValueError) as other:
        streaming.read_progress(tmp_path, {**settings, "shard_tokens": 4000})
    assert str(other.value) == (f"{tmp_path} holds an interrupted prepare with other settings (shard_tokens; "
                                f"{tmp_path / '.progress.json'}): rerun it with the same options and input, or "
                                f"remove {tmp_path}")

    def refused(read):
        with pytest.raises(ValueError) as changed:
            read(tmp_path, settings)
        assert str(changed.value) == (f"{tmp_path / 'x_train_000001.bin'} is missing or changed since it was "
                                      f"written: remove {tmp_path} and prepare again")
    with open(tmp_path / "x_train_000001.bin", "ab") as f:  # appended to: not as written
        f.write(b"\0\0")
    refused(streaming.read_progress)
    (tmp_path / ".progress.json").unlink()
    refused(streaming.finished)
    (tmp_path / "x_train_000001.bin").unlink()  # gone
    refused(streaming.finished)


def test_a_glob_may_name_folders_too(tmp_path):
    for folder in ("a", "b", "b/c"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.jsonl").write_text('{"text": "x"}\n')
    assert local_source(f"{tmp_path}/*/*.jsonl").names == [f"{tmp_path}/{f}/x.jsonl" for f in "ab"]
    assert local_source(f"{tmp_path}/**/*.jsonl").names == [f"{tmp_path}/{f}/x.jsonl"
                                                            for f in ("a", "b/c", "b")]  # sorted
    # a file whose name holds glob characters is that file; a folder is named as one
    (tmp_path / "notes [v1].jsonl").write_text('{"text": "x"}\n')
    assert local_source(f"{tmp_path}/notes [v1].jsonl").names == [f"{tmp_path}/notes [v1].jsonl"]
    with pytest.raises(FileNotFoundError, match=re.escape(f"--input {tmp_path}/b is a folder: give its files "
                                                          f"({tmp_path}/b/*.jsonl, say)")):
        local_source(f"{tmp_path}/b")
    # a link to a folder reaches its files twice: once each (its documents were in both val and train)
    (tmp_path / "latest").symlink_to(tmp_path / "b")
    assert local_source(f"{tmp_path}/**/*.jsonl").names == [*(f"{tmp_path}/{f}/x.jsonl" for f in ("a", "b/c", "b")),
                                                            f"{tmp_path}/notes [v1].jsonl"]
    # a link back to a folder that holds it: ** followed it 40 deep (two: 2^40 paths, a hang), now one line; also
    # two folders linked to each other, where no file matches (glob walked them for ever, matching nothing)
    def refused(*links):
        for link, target in links:
            (tmp_path / link).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / link).symlink_to(target)
        with pytest.raises(ValueError, match=re.escape(f"--input {tmp_path}/loop/**/*.jsonl: {tmp_path}/loop/") +
                           r"\S+ is a link to a folder that holds it, which \*\* would follow for ever: remove the link"):
            local_source(f"{tmp_path}/loop/**/*.jsonl")
        for link, _ in links:
            (tmp_path / link).unlink()
    (tmp_path / "loop" / "y").mkdir(parents=True)
    (tmp_path / "loop" / "y" / "a.jsonl").write_text('{"text": "x"}\n')
    refused(("loop/x/current", ".."))
    refused(("loop/x/z/to_w", "../../w"), ("loop/w/to_x", "../x"))
    (tmp_path / "loop" / "current").symlink_to(".")  # (above where ** starts: followed once, as named)
    assert local_source(f"{tmp_path}/loop/current/y/**/*.jsonl").names == [f"{tmp_path}/loop/current/y/a.jsonl"]
    shutil.rmtree(tmp_path / "loop")
    os.mkfifo(tmp_path / "pipe.jsonl")  # (it "matches no file")
    with pytest.raises(FileNotFoundError, match=re.escape(f"--input {tmp_path}/pipe.jsonl is not a regular file")):
        local_source(f"{tmp_path}/pipe.jsonl")
    # a glob's match that is neither a file nor a folder is refused, not dropped with its documents
    with pytest.raises(ValueError, match=re.escape(f"--input {tmp_path}/*.jsonl matches {tmp_path}/pipe.jsonl, which "
                                                   f"is not a readable regular file (a link to nothing, a pipe")):
        local_source(f"{tmp_path}/*.jsonl")
    (tmp_path / "pipe.jsonl").unlink()
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "nothing")
    with pytest.raises(ValueError, match=re.escape(f"matches {tmp_path}/gone.jsonl, which is not a readable")):
        local_source(f"{tmp_path}/*.jsonl")
    made = {"source": {"input": f"{tmp_path}/*.jsonl"}, "prepared_with": {"files": [], "file_sizes": []}}
    assert other_source(made, f"{tmp_path}/*.jsonl") == f"made from {tmp_path}/*.jsonl before it changed"  # train.py's


@pytest.mark.slow
def test_a_wrong_vocabulary_file_is_one_line_and_not_a_hang(corpus, tmp_path, monkeypatch):
    # once only the workers loaded it, and a Pool restarts a worker whose initializer raised forever
    junk = tmp_path / "junk.tiktoken"
    junk.write_text("junk\n")
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(junk))
    folder, _ = corpus
    proc = prepare("fineweb", f"--input={folder}/part2.jsonl", f"--out_dir={tmp_path / 'out'}", "--workers=1",
                   timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {junk} (from $GPT2_TIKTOKEN_FILE; should be "
                                                           f"GPT-2's gpt2.tiktoken"), proc.stderr
    assert proc.stderr.count("\n") == 1
    # openwebtext checks it before it counts every document (it reported this file's bad line first)
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    proc = prepare("openwebtext", f"--input={tmp_path / 'bad.jsonl'}", f"--out_dir={tmp_path / 'owt'}", timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {junk} (from $GPT2_TIKTOKEN_FILE"), proc.stderr
    # a worker that cannot load it fails its task (the main process reports it) and is not restarted
    from data import workers
    monkeypatch.setattr(workers, "_encoder", None)
    workers._start_worker()
    with pytest.raises(ValueError, match="junk.tiktoken"):
        workers._encode((0, "some text"))


class ConnectError(Exception):
    """What huggingface_hub's HTTP client raises offline (httpx's errors are no OSError)."""


def offline(*args, **kwargs):
    raise ConnectError("[Errno -2] Name or service not known")


def test_a_hub_that_cannot_be_reached_is_one_line(tmp_path, script, monkeypatch):
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", offline)
    for prepare in ("fineweb", "openwebtext"):
        proc = script(f"data/{prepare}/prepare.py", f"--out_dir={tmp_path / prepare}")
        assert proc.returncode == 2 and proc.stderr.startswith("error: could not list the files of ") and \
            "(ConnectError: [Errno -2] Name or service not known): check the network" in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1
    # listed, then the download fails
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **k: ["sample/10BT/000_00000.parquet"])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    proc = script("data/fineweb/prepare.py", f"--out_dir={tmp_path / 'fineweb'}")
    assert proc.returncode == 2 and proc.stderr.startswith(
        "error: could not download sample/10BT/000_00000.parquet of HuggingFaceFW/fineweb-edu on the Hugging Face "
        "hub (ConnectError"), proc.stderr
    assert not list((tmp_path / "fineweb").glob("*.bin"))



@pytest.mark.slow
def test_a_finished_hub_prepare_run_again_offline_downloads_nothing(corpus, tmp_path, script, monkeypatch):
    """Run again on a finished folder, a prepare from the hub checks it and says so, offline too:
    nothing is listed, downloaded (OpenWebText: 25 GB) or counted again."""
    import huggingface_hub
    folder, _ = corpus

    def download(repo_id, filename, local_dir, **kwargs):
        (Path(local_dir) / filename).parent.mkdir(parents=True, exist_ok=True)
        return shutil.copy(folder / Path(filename).name, Path(local_dir) / filename)
    for prepare, name in (("fineweb", "sample/10BT/part0.parquet"), ("openwebtext", "plain_text/part0.parquet")):
        monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **k: [name])
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
        args = (f"data/{prepare}/prepare.py", f"--out_dir={tmp_path / prepare}", "--shard_tokens=3000", "--workers=1")
        assert script(*args).returncode == 0
        monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", offline)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
        again = script(*args)
        assert again.returncode == 0 and "is already prepared" in again.stdout, again.stderr
        assert not list((tmp_path / prepare).rglob("*.parquet"))
    other = script("data/fineweb/prepare.py", f"--out_dir={tmp_path / 'fineweb'}", "--shard_tokens=3000",
                   "--subset=sample-100BT")  # (another subset was "already prepared": the wrong data trained on)
    assert other.returncode == 2 and "other settings" in other.stderr and "subset" in other.stderr, other.stderr

def bad_length(d):
    write_llm_c_shard(d / "x_train_000001.bin", np.arange(5000))
    with open(d / "x_train_000001.bin", "ab") as f:
        f.write(b"\0\0")  # one token more than the header says


def listing(d, val=None, shards=None):
    """A meta.json listing the folder's shards (`val` in place of its val shard, `shards` of the whole listing)."""
    val = [{"file": "x_val_000000.bin", "tokens": 3000}] if val is None else val
    shards = {"train": [{"file": "x_train_000001.bin", "tokens": 5000}], "val": val} if shards is None else shards
    (d / "meta.json").write_text(json.dumps({**MISCOUNTED, "train_tokens": 5000, "shards": shards,
                                             "val_tokens": sum(e["tokens"] for e in val)}))


def seventeen_train_shards(d):
    """more shards than the 16 windows sampled: each still gets one (its first 4096 tokens)"""
    for i in range(2, 18):
        write_llm_c_shard(d / f"x_train_{i:06d}.bin", [60000] * (i == 17) + [1] * 100)


def a_pipe_named_as_a_shard(d):
    """(its header read waited for a writer forever; this writer makes such a regression fail, not hang)"""
    os.mkfifo(d / "x_train_000002.bin")
    threading.Thread(target=lambda: open(d / "x_train_000002.bin", "wb").close(), daemon=True).start()


def test_a_train_shard_whose_name_holds_val_is_not_validated_on(tmp_path):
    """("retrieval" holds "val": validation must not read training data; "pretrain" holds "train".)"""
    (tmp_path / "pre").mkdir()
    write_llm_c_shard(tmp_path / "pre" / "pretrain_val_000000.bin", np.arange(3000))
    write_llm_c_shard(tmp_path / "pre" / "pretrain_train_000001.bin", np.arange(5000))
    shards = meta_from_shards(tmp_path / "pre")["shards"]  # (its val shard was read as training data)
    assert [[e["file"] for e in shards[s]] for s in ("train", "val")] == [["pretrain_train_000001.bin"],
                                                                          ["pretrain_val_000000.bin"]]
    write_llm_c_shard(tmp_path / "retrieval_train_000000.bin", np.arange(5000))
    write_llm_c_shard(tmp_path / "retrieval_val_000000.bin", np.arange(3000))
    shards = meta_from_shards(tmp_path)["shards"]
    assert [[e["file"] for e in shards[s]] for s in ("train", "val")] == [["retrieval_train_000000.bin"],
                                                                          ["retrieval_val_000000.bin"]]
    # eval.py reads val alone: llm.c's val shard by itself is a dataset to it (it wanted a *train*.bin too)
    (tmp_path / "retrieval_train_000000.bin").unlink()
    from loader import read_dataset
    meta = read_dataset(Config(data_dir=str(tmp_path), block_size=64), ("val",))
    assert meta["val_tokens"] == 3000 and meta["tokenizer"] == "gpt2"
    with pytest.raises(ConfigError, match="no meta.json and no \\*train\\*.bin shard: a folder of pre-tokenized "
                                          "shards needs files named \\*train\\*.bin and \\*val\\*.bin"):
        read_dataset(Config(data_dir=str(tmp_path), block_size=64))


@pytest.mark.parametrize("make, message", [
    (bad_length, "x_train_000001.bin: its header says 5,000 tokens but the file holds 5,001: it was cut short"),
    (lambda d: (d / "x_val_000000.bin").write_bytes((d / "x_val_000000.bin").read_bytes() + b"\0"),  # half a token
     "x_val_000000.bin: its header says 3,000 tokens but the file holds 3,000 and a part of one: it was cut"),
    (a_pipe_named_as_a_shard, "x_train_000002.bin is named as a token shard but is not a file: move it out of"),
    (lambda d: (d / "x_val_000001.bin").mkdir(), "x_val_000001.bin is named as a token shard but is not a file"),
    (lambda d: shutil.rmtree(d) or d.write_bytes(b""), "is not a folder (a file, a link to nothing, or under a file)"),
    (lambda d: shutil.rmtree(d) or d.symlink_to(d.parent / "unmounted"), "is not a folder (a file, a link to nothing"),
    (lambda d: write_llm_c_shard(d / "x_train_000001.bin", np.arange(5000), magic=20240801, version=7,
                                 dtype=np.uint32), "shards of mixed dtypes (x_val_000000.bin holds uint16, "
                                                   "x_train_000001.bin holds uint32): one dataset has one token dtype"),
    (lambda d: (d / "x_train_000001.bin").unlink(), "has no meta.json and no *train*.bin shard"),
    (lambda d: write_llm_c_shard(d / "x_train_000001.bin", np.arange(5000), magic=12345),
     "x_train_000001.bin: magic number 12345 is not a token shard's"),
    (lambda d: write_llm_c_shard(d / "x_train_000001.bin", np.full(5000, 60000)),  # another tokenizer's ids
     "is >= vocab_size 50257: shards without a meta.json are read as GPT-2 BPE tokens, and these are not"),
    (lambda d: (d / "x_train_000001.bin").write_bytes(np.array([20240520, 1, 0] + [0] * 22, "<i4").tobytes()),
     "x_train_000001.bin is 100 bytes, too short for a shard header of 1024 bytes"),  # (its magic and version good)
    (lambda d: write_llm_c_shard(d / "x_train_000001.bin", np.arange(5000), version=7),
     "x_train_000001.bin: version 7 with magic 20240520, expected 1"),
    (seventeen_train_shards, "x_train_000017.bin: token id 60000 at position 0 is >= vocab_size 50257"),
    (lambda d: [write_llm_c_shard(d / f"x_train_{i:06d}.bin", np.arange(20)) for i in (1, 2)],  # (it said "use
     "(20 tokens in its longest shard; it needs 32): use longer shards (a larger prepare.py --shard_tokens), or a "
     "model of a smaller block_size"),  # more data", which adds only more short shards)
    (lambda d: listing(d) or write_llm_c_shard(d / "x_train_000001.bin", np.arange(5000), magic=20240801, version=7,
                                               dtype=np.uint32),
     "x_train_000001.bin holds uint32 tokens, but the dataset is uint16: shards of mixed dtypes"),
    (lambda d: listing(d, val=[]), "meta.json: the val split has no shard"),
    (lambda d: listing(d, shards=[]), "meta.json: shards is not a mapping of split to shards"),
    (lambda d: write_llm_c_shard(d.parent / "outside_val.bin", np.arange(3000)) or
     listing(d, val=[{"file": "../outside_val.bin", "tokens": 3000}]),  # a name, not a path outside data_dir
     "meta.json: a val shard entry is not {'file': NAME, 'tokens': COUNT}: {'file': '../outside_val.bin'"),
])
def test_broken_shards_are_one_line_errors_before_training(tmp_path, capsys, make, message):
    data = tmp_path / "data"
    data.mkdir()
    write_llm_c_shard(data / "x_val_000000.bin", np.arange(3000))
    write_llm_c_shard(data / "x_train_000001.bin", np.arange(5000))
    make(data)
    with pytest.raises(SystemExit) as exit_info:
        train.cli(tiny_args(data, tmp_path / "out"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_prepare_given_no_documents_it_can_read_says_so(tmp_path, script, monkeypatch):
    """A pattern matching no file, a folder, a local file of another kind; a hub revision without the subset's
    parquet files (listed, not fetched)."""
    import huggingface_hub
    for given, said in ((f"{tmp_path}/*.parquet", "matches no file"),
                        (f"{tmp_path}/", f"is a folder: give its files ({tmp_path}/*.jsonl, say)")):
        ran = script("data/fineweb/prepare.py", f"--input={given}", f"--out_dir={tmp_path / 'a'}")
        assert (ran.returncode, ran.stderr) == (2, f"error: --input {given} {said}\n")
    (tmp_path / "corpus.csv").write_text("text\nhello\n")
    ran = script("data/fineweb/prepare.py", f"--input={tmp_path / 'corpus.csv'}", f"--out_dir={tmp_path / 'a'}")
    assert (ran.returncode, ran.stderr) == (2, f"error: {tmp_path / 'corpus.csv'}: not a .parquet, .jsonl or .txt "
                                               f"file\n")
    (tmp_path / "c").mkdir()  # among others, refused before any is read (shards and their progress were left)
    (tmp_path / "c" / "a.jsonl").write_text('{"text": "a document before it"}\n' * 300)  # (blocks of 64 in flight)
    (tmp_path / "c" / "notes.md").write_text("not a document")
    ran = script("data/fineweb/prepare.py", f"--input={tmp_path}/c/*", f"--out_dir={tmp_path / 'a'}",
                 "--shard_tokens=100", "--workers=1")
    assert (ran.returncode, ran.stderr) == (2, f"error: {tmp_path / 'c' / 'notes.md'}: not a .parquet, .jsonl or .txt "
                                               f"file\n")
    assert not os.path.lexists(tmp_path / "a" / ".progress.json")
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **k: ["README.md", "other/0.parquet"])
    ran = script("data/fineweb/prepare.py", f"--out_dir={tmp_path / 'b'}")
    assert (ran.returncode, ran.stderr) == (2, "error: HuggingFaceFW/fineweb-edu has no parquet files in sample/10BT/ "
                                               "at revision main: check --subset\n")
    assert not os.path.lexists(tmp_path / "a") and not (tmp_path / "b").exists()  # nothing written, no folder even


@pytest.mark.parametrize("corpus", ["fineweb", "openwebtext"])
def test_a_large_corpus_missing_is_to_be_prepared_first_not_downloaded_at_start_up(tmp_path, capsys, corpus):
    with pytest.raises(SystemExit) as exit_info:
        train.cli(tiny_args(tmp_path / "data", tmp_path / "out", dataset=corpus))
    assert exit_info.value.code == 2 and capsys.readouterr().err == (
        f"error: no dataset in {tmp_path / 'data'}: this corpus is too large to prepare at start-up; run python "
        f"data/{corpus}/prepare.py --out_dir {tmp_path / 'data'} first (see docs/data.md)\n")
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()
    # with --prepare_input the command prepares that file (it left --input out: the whole download)
    (tmp_path / "my text.txt").write_text("hello")
    with pytest.raises(SystemExit):
        train.cli(tiny_args(tmp_path / "data", tmp_path / "out", dataset=corpus,
                            prepare_input=tmp_path / "my text.txt"))
    assert f"prepare.py --input='{tmp_path / 'my text.txt'}' --out_dir" in capsys.readouterr().err


def test_a_data_dir_under_a_file_is_said_so_not_prepared(tmp_path, capsys):
    (tmp_path / "f").write_text("")  # was: a download, then "[Errno 20] Not a directory" from the prepare
    with pytest.raises(SystemExit) as exit_info:
        train.cli(tiny_args(tmp_path / "f" / "data", tmp_path / "out", prepare_input=tmp_path / "missing.txt"))
    assert exit_info.value.code == 2 and capsys.readouterr().err == (
        f"error: data_dir {tmp_path / 'f' / 'data'} is not a folder (a file, a link to nothing, or under a file): "
        f"give the dataset's folder\n")


def test_a_meta_json_link_to_nothing_is_refused_not_read_as_gpt2_shards(char_data, tmp_path):
    """A shard folder whose meta.json was a link to nothing trained as llm.c's GPT-2 BPE shards (50,257 tokens),
    without a word; a flat folder's said "no meta.json", and writing one as advised failed ("File exists")."""
    from data.dataset import load_meta
    shards, flat = shard_dataset(char_data, tmp_path / "shards"), Path(shutil.copytree(char_data, tmp_path / "flat"))
    for folder in (shards, flat):
        (folder / "meta.json").unlink()
        (folder / "meta.json").symlink_to(tmp_path / "gone.json")
        with pytest.raises(ValueError, match=f"^{folder / 'meta.json'} is a link to nothing \\(or a loop\\): move it "
                                             f"out of the way, then"):
            load_meta(folder)
    (shards / "meta.json").unlink()
    (shards / ".progress.json").symlink_to(tmp_path / "gone.json")  # an unfinished preparation's, all the same
    with pytest.raises(ValueError, match="holds an unfinished preparation"):
        load_meta(shards)


def test_a_prepare_killed_at_its_first_shard_goes_on_and_one_that_waited_looks_again(corpus, tmp_path, monkeypatch):
    """.progress.json comes before the first shard: a kill between the two left a shard with no progress
    file, which the rerun refused as another writer's ("no prepare of this repo is writing")."""
    import data.fineweb.prepare as fineweb
    from data import streaming

    class Killed(BaseException):
        pass
    real = streaming.write_shard

    def killed_after_the_first(path, tokens):
        real(path, tokens)
        raise Killed()
    monkeypatch.setattr(streaming, "write_shard", killed_after_the_first)
    args = dict(out_dir=tmp_path / "out", input_pattern=f"{corpus[0]}/part2.jsonl", shard_tokens=3000, workers=1)
    with pytest.raises(Killed):
        fineweb.prepare(**args)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".progress.json", "fineweb_val_000000.bin"]
    monkeypatch.setattr(streaming, "write_shard", real)
    assert fineweb.prepare(**args)["shards"]["val"][0]["file"] == "fineweb_val_000000.bin"
    # one that waited for another's lock looks again once it has it: that one may have finished meanwhile
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    monkeypatch.setattr(fineweb, "finished", lambda out_dir, settings: None)  # (still under way when it first looked)
    with pytest.raises(ValueError, match="already holds a dataset prepared with other settings"):
        fineweb.prepare(**{**args, "shard_tokens": 2000})  # (it prepared again, over the finished dataset)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
