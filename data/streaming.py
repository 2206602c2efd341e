"""Large corpora as token shards, in bounded memory and resumably.

Documents stream from local files or the Hugging Face hub (data/documents.py). Worker processes
(data/workers.py) encode them with GPT-2's BPE (tiktoken's encode_ordinary), each document prefixed by
the end-of-text token 50256 as llm.c does, and the tokens are cut into shards of `shard_tokens` in
llm.c's format (data/dataset.py). A document may continue from one shard into the next.

Memory: one shard buffer per stream and a few chunks of documents in flight (a .txt file: read whole).
Interruption: a shard is written under a temporary name and renamed when complete, and .progress.json
(rewritten after every shard) records where the next shard of each stream starts in the document
stream. A rerun with the same options continues from there and writes byte-identical shards; meta.json last.
"""

import argparse
import json
import math
import multiprocessing as mp
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from data.documents import Source, read_documents
from data.dataset import DATASET_FORMAT, GPT2_META, PROGRESS, has_shards, load_meta, write_shard
from data.corpora import prepare_parser
from data.files import atomic_write_bytes, preparing, read_json
from data.tokenizers import gpt2_encoding
from data.workers import encode_all


def shard_arguments(doc: str, repo_id: str) -> argparse.ArgumentParser:
    """The options of every prepare script that writes shards; a script adds its own."""
    parser = prepare_parser(doc, "local .parquet/.jsonl/.txt files (a glob) instead of the hub")
    parser.add_argument("--repo", default=repo_id, help="the dataset repo on the Hugging Face hub")
    parser.add_argument("--revision", default="main", help="a branch, tag or commit of the repo")
    parser.add_argument("--shard_tokens", type=int, default=10**8, help="tokens per shard")
    parser.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: cores)")
    return parser


# ----------------------------------------------------------------------------- writing shards

class ShardStream:
    """The shards of one split stream (or of all, when `split_of_shard` names each shard)."""

    def __init__(self, out_dir: Path, prefix: str, shard_tokens: int, split_of_shard, state=None):
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
        self.split_of_shard = split_of_shard  # shard number -> "train" or "val"
        state = state or {"shards": [], "resume": [0, 0]}
        self.shards = state["shards"]           # written: [{"file", "split", "tokens", "sha256"}]
        self.resume = tuple(state["resume"])     # (document, token offset) where the next shard starts
        self.buffer, self.filled = np.empty(shard_tokens, dtype=np.uint16), 0

    def state(self) -> dict:
        return {"shards": self.shards, "resume": list(self.resume)}

    def add(self, doc: int, tokens: np.ndarray, on_shard):
        """Append a document's tokens (those not yet in a written shard); write full shards."""
        used = self.resume[1] if doc == self.resume[0] else 0
        while used < len(tokens):
            take = min(len(tokens) - used, self.shard_tokens - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[used:used + take]
            self.filled, used = self.filled + take, used + take
            if self.filled == self.shard_tokens:
                self._write(doc, used, on_shard)

    def finish(self, end_doc: int, on_shard):
        if self.filled:
            self._write(end_doc, 0, on_shard)

    def _write(self, doc: int, used: int, on_shard):
        split = self.split_of_shard(len(self.shards))
        name = f"{self.prefix}_{split}_{len(self.shards):06d}.bin"
        if not (self.out_dir / PROGRESS).is_file():  # (the first shard: killed after it, a prepare under way)
            on_shard()
        sha = write_shard(self.out_dir / name, self.buffer[:self.filled])
        self.shards.append({"file": name, "split": split, "tokens": self.filled, "sha256": sha})
        self.resume, self.filled = (doc, used), 0
        on_shard()


def read_progress(out_dir, settings: dict = None, every_file: bool = False) -> dict:
    """out_dir's .progress.json (empty without one), checked to be what write_shards writes there,
    and (given `settings`) to be a prepare with these settings whose shards are all in place, over
    the same files (those not read into shards yet may change, unless `every_file`)."""
    path = Path(out_dir) / PROGRESS
    if not path.is_file():
        return {"counts": [], "streams": {}}
    try:
        progress = read_json(path)
        ok = isinstance(progress["settings"], dict) and all(type(c) is int for c in progress["counts"]) and all(
            len(s["resume"]) == 2 and all(type(v) is int for v in s["resume"]) and all(
                type(sh["file"]) is str and type(sh["tokens"]) is int and sh["split"] in ("train", "val")
                and "sha256" in sh for sh in s["shards"]) for s in progress["streams"].values())
        sizes = progress["settings"].get("file_sizes")  # (the hub's files: None)
        ok = ok and (sizes is None or all(type(n) is int for n in sizes))
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, or not of the shape written here
        ok = False
    if not ok:
        raise ValueError(f"{path} is damaged (it is not what a prepare writes there): remove {out_dir} and "
                         f"prepare again")
    if settings is None:
        return progress
    if other := differs(progress["settings"], {k: v for k, v in settings.items() if k != "file_sizes"}):
        raise ValueError(f"{out_dir} holds an interrupted prepare with other settings ({other}; {path}): "
                         f"rerun it with the same options and input, or remove {out_dir}")
    before, now = progress["settings"].get("file_sizes"), settings.get("file_sizes")
    # the documents in written shards: those before each stream's resume point, and the one it is in, if begun
    start_doc = math.inf if every_file else min((doc + (used > 0) for doc, used in (
        s["resume"] for s in progress["streams"].values())), default=0)
    if (changed := _changed_in_shards(before, now, progress["counts"], start_doc)) is not None:
        raise ValueError(f"{settings['files'][changed]} is not the file the interrupted prepare in {out_dir} read "
                         f"({before[changed]:,} bytes then, {now[changed]:,} now): put it back, or remove "
                         f"{out_dir} and prepare again")
    _check_shards(out_dir, [shard for stream in progress["streams"].values() for shard in stream["shards"]])
    shards = sum(len(s["shards"]) for s in progress["streams"].values())
    print(f"resuming: {shards} shard{'s' * (shards != 1)} already written in {out_dir}")
    return progress


def checked_workers(shard_tokens: int, workers) -> int:
    """--workers (None: this host's cores), once it, --shard_tokens and the vocabulary file are checked: before
    any document is read or downloaded."""
    workers = mp.cpu_count() if workers is None else workers
    if not 1 <= shard_tokens < 2**31:  # a header's count is an int32
        raise ValueError(f"--shard_tokens ({shard_tokens}) must be 1 to 2**31 - 1")
    if not 1 <= workers <= 4 * mp.cpu_count():
        raise ValueError(f"--workers ({workers}) must be 1 to 4 x this host's {mp.cpu_count()} cores")
    gpt2_encoding(verbose=False)  # a bad vocabulary file is one line here, not in every worker
    return workers


def write_shards(source: Source, out_dir, prefix: str, shard_tokens: int, workers: int,
                 route: Callable[[int], str], split_of_shard: dict, settings: dict, counts: list = None) -> dict:
    """Tokenize every document of `source` into shards; return the meta.json written. route(doc)
    names a document's stream, split_of_shard[stream](n) the split of its n-th shard. `settings`
    (whatever decides the output) must match to resume. `counts`: documents per file, if known.
    checked_workers() has checked the options."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with preparing(out_dir):  # another preparation waits; a killed one's shard goes; a full disk is named
        settings = recorded(settings, prefix, shard_tokens, source)
        if (meta := finished(out_dir, settings)) is not None:
            return meta
        progress = read_progress(out_dir, settings, every_file=counts is not None)  # (openwebtext's split counts all)
        streams = {name: ShardStream(out_dir, prefix, shard_tokens, split_of_shard[name],
                                     progress["streams"].get(name)) for name in split_of_shard}
        counts = list(counts or progress["counts"])  # documents per file, as far as known
        start_doc = min(s.resume[0] for s in streams.values())
        bar = tqdm(unit="tok", unit_scale=True, desc=f"{prefix} shards", disable=None,
                   initial=sum(sh["tokens"] for s in streams.values() for sh in s.shards))

        def on_shard():
            atomic_write_bytes(out_dir / PROGRESS, json.dumps({"settings": settings, "counts": counts, "streams": {
                name: s.state() for name, s in streams.items()}}).encode())
            bar.set_postfix(shards=sum(len(s.shards) for s in streams.values()))

        def documents() -> Iterator[tuple]:
            first = 0
            for i, name in enumerate(source.names):
                if i < len(counts) and first + counts[i] <= start_doc:
                    first += counts[i]  # every document of this file is in written shards already
                    continue
                n = 0
                for n, text in enumerate(read_documents(source.fetch(i)), 1):
                    doc = first + n - 1
                    if doc >= streams[route(doc)].resume[0]:  # not in a written shard yet
                        yield doc, text
                source.release(i)
                counts[i:i + 1] = [n]  # known before, or the next file read
                first += n

        def take(encoded):
            for doc, tokens in encoded:
                streams[route(doc)].add(doc, tokens, on_shard)
                bar.update(len(tokens))

        encode_all(documents(), workers, take)
        bar.close()
        return _finish(source, out_dir, streams, counts, settings, shard_tokens, on_shard)


def _finish(source: Source, out_dir: Path, streams: dict, counts: list, settings: dict, shard_tokens: int,
            on_shard) -> dict:
    """Write each stream's last shard and meta.json, once the corpus is known to give both splits."""
    end_doc = sum(counts)
    tokens = sum(sh["tokens"] for s in streams.values() for sh in s.shards) + sum(s.filled for s in streams.values())
    if not end_doc:
        raise ValueError(f"the corpus holds no documents ({', '.join(source.names)})")
    splits = {sh["split"] for s in streams.values() for sh in s.shards} | {
        s.split_of_shard(len(s.shards)) for s in streams.values() if s.filled}
    for split in sorted({"train", "val"} - splits):  # checked before the last shards are written
        if not os.path.lexists(out_dir / "meta.json"):  # a rerun would end here again: what it wrote goes, so that
            (out_dir / PROGRESS).unlink(missing_ok=True)  # a smaller --shard_tokens is not "other settings"
            for shard in (sh for s in streams.values() for sh in s.shards):
                (out_dir / shard["file"]).unlink(missing_ok=True)
        raise ValueError(f"the corpus ({end_doc:,} document{'s' * (end_doc != 1)}, {tokens:,} tokens) gives no "
                         f"{split} shard: too small for --shard_tokens={shard_tokens}")
    for stream in streams.values():
        stream.finish(end_doc, on_shard)
    shards = [sh for s in streams.values() for sh in s.shards]
    split_list = {split: [{k: sh[k] for k in ("file", "tokens", "sha256")} for sh in shards
                          if sh["split"] == split] for split in ("train", "val")}
    meta = {**GPT2_META, "dtype": "uint16",
            "source": {**source.description, **{k: v for k, v in settings.items() if "file" not in k}},
            "documents": end_doc, "train_tokens": sum(e["tokens"] for e in split_list["train"]),
            "val_tokens": sum(e["tokens"] for e in split_list["val"]), "shards": split_list,
            "prepared_with": settings, "format": DATASET_FORMAT}
    atomic_write_bytes(out_dir / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    (out_dir / PROGRESS).unlink(missing_ok=True)
    return meta


def recorded(settings: dict, prefix: str, shard_tokens: int, source: Source = None) -> dict:
    """What a prepare records as prepared_with; the file names only given the source (a hub's: once listed)."""
    files = {"files": source.names, "file_sizes": source.sizes} if source else {}
    return {**settings, **files, "shard_tokens": shard_tokens, "prefix": prefix}


def finished(out_dir, settings: dict):
    """meta.json of a prepare that finished in out_dir, or None. Checked: the same `settings` (those
    given, recorded()'s) and its shards in place; other settings would overwrite it, as would any
    prepare another writer's shards (refused before a file is read or downloaded)."""
    out_dir = Path(out_dir)
    if (out_dir / PROGRESS).is_file():
        return None
    if not (out_dir / "meta.json").is_file():  # its shards would go over another writer's (llm.c's names)
        if has_shards(out_dir):
            raise ValueError(f"{out_dir} holds token shards no prepare of this repo is writing (no {PROGRESS}): they "
                             f"train as they are (docs/data.md); choose another --out_dir to prepare anew")
        return None
    meta = load_meta(out_dir, fix=f"remove {out_dir} and prepare again")
    other = differs(meta.get("prepared_with"), settings) if "shards" in meta else "not as shards"
    if other:
        raise ValueError(f"{out_dir} already holds a dataset prepared with other settings ({other}): remove it "
                         f"or choose another --out_dir")
    if type(meta.get("documents")) is not int:  # (edited by hand: the scripts print it)
        raise ValueError(f"{out_dir / 'meta.json'}: documents is {meta.get('documents')!r}, not a count: remove "
                         f"{out_dir} and prepare again")
    _check_shards(out_dir, meta["shards"]["train"] + meta["shards"]["val"])
    print(f"{out_dir} is already prepared ({meta['train_tokens'] + meta['val_tokens']:,} tokens)")
    return meta


def differs(made, settings: dict) -> str:
    """Which of `settings` a recorded prepare (`made`) had otherwise ("shard_tokens, input file sizes"), or "".
    Prepares before file sizes were recorded named the files as given: the same files by absolute path."""
    def same(key, value):
        if key == "file_sizes" and key not in made or made.get(key) == value:
            return True
        return key == "files" and isinstance(made.get(key), list) and \
            [os.path.abspath(str(f)) for f in made[key]] == value
    labels = {"files": "input files", "file_sizes": "input file sizes"}
    return ", ".join(labels.get(k, k) for k, v in settings.items() if not same(k, v)) if isinstance(made, dict) \
        else "none recorded"


def _changed_in_shards(before, now, counts: list, start_doc: int):
    """The first local file of another size than when an interrupted prepare read it, of those with documents
    in its written shards (before start_doc), or None: a file not reached yet may change (a bad line fixed)."""
    first = 0
    for i, (was, size) in enumerate(zip(before or [], now or [])):
        if first >= start_doc:
            return None
        if was != size:
            return i
        if i == len(counts):  # read in part: the files after it were not reached
            return None
        first += counts[i]
    return None


def _check_shards(out_dir: Path, shards: list):
    """Each shard written is there, of the size it was written with (hashing them would read the corpus)."""
    for shard in shards:
        file = out_dir / shard["file"]
        if not file.is_file() or file.stat().st_size != 1024 + 2 * shard["tokens"]:
            raise ValueError(f"{file} is missing or changed since it was written: remove {out_dir} and prepare again")
