"""The dataset format: what prepare scripts write and what training reads.

A prepared dataset is a folder holding its tokens, either as
  train.bin, val.bin      flat token arrays (uint16, or uint32 when the vocabulary needs it), or
  NAME_{train,val}_NNNNNN.bin  shards in llm.c's format: a header of 256 little-endian int32
                          (magic 20240520, version 1, token count; magic 20240801, version 7 for
                          uint32 tokens), then the tokens,
and meta.json: vocab_size, dtype, tokenizer, chars (char only), source, token counts, format, and
for shards their file names, token counts and sha256 per split. meta.json is written last, so a
folder that has one holds a complete dataset. A folder of shards without meta.json (llm.c's
fineweb.py output, modded-nanogpt's pre-tokenized FineWeb) is read as GPT-2 BPE tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.files import atomic_write, not_a_folder, preparing, read_json, write_together

DATASET_FORMAT = 1
HEADER_INTS = 256  # an llm.c shard header: 256 int32, of which the first three are used
SHARD_FORMATS = {"uint16": (20240520, 1), "uint32": (20240801, 7)}  # dtype -> (magic, version)
GPT2_VOCAB_SIZE = 50257  # GPT-2 BPE: 50,000 merges, 256 bytes and <|endoftext|>
GPT2_META = {"vocab_size": GPT2_VOCAB_SIZE, "tokenizer": "gpt2"}  # what meta.json says of GPT-2 BPE ids
GPT2_EOT = 50256         # <|endoftext|>, the document separator


@dataclass(frozen=True)
class Shard:
    """One file of a split: `tokens` tokens of `dtype`, starting `offset` bytes into `path`."""
    path: Path
    dtype: str
    offset: int
    tokens: int


def write_shard(path, tokens: np.ndarray) -> str:
    """Write tokens (uint16 or uint32) as an llm.c shard, atomically; return the file's sha256."""
    magic, version = SHARD_FORMATS[tokens.dtype.name]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = magic, version, len(tokens)
    digest = hashlib.sha256()

    def write(f):
        for part in (header.tobytes(), tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()):
            f.write(part)
            digest.update(part)
    atomic_write(path, write)
    return digest.hexdigest()


def read_shard_header(path) -> tuple[str, int]:
    """(dtype, token count) of an llm.c shard; ValueError naming the file if it is not one."""
    path = Path(path)
    if not path.is_file():  # a pipe would hang the read below
        raise ValueError(f"{path} is named as a token shard but is not a file: move it out of {path.parent}")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(header) < HEADER_INTS:
        raise ValueError(f"{path} is {path.stat().st_size} bytes, too short for a shard header of "
                         f"{HEADER_INTS * 4} bytes: it was cut short or is not a token shard")
    magic, version, count = (int(v) for v in header[:3])
    dtype = next((d for d, (m, _) in SHARD_FORMATS.items() if m == magic), None)
    if dtype is None:
        raise ValueError(f"{path}: magic number {magic} is not a token shard's (20240520 for uint16, "
                         f"20240801 for uint32 tokens, as llm.c writes them)")
    if version != SHARD_FORMATS[dtype][1]:
        raise ValueError(f"{path}: version {version} with magic {magic}, expected {SHARD_FORMATS[dtype][1]}")
    held, part = divmod(path.stat().st_size - HEADER_INTS * 4, np.dtype(dtype).itemsize)
    if count < 0 or (held, part) != (count, 0):
        raise ValueError(f"{path}: its header says {count:,} tokens but the file holds {held:,}"
                         f"{' and a part of one' * (part > 0)}: it was cut short or appended to; prepare it again")
    return dtype, count


def refuse_shards(out_dir: Path) -> None:
    if has_shards(out_dir):
        raise ValueError(f"{out_dir} holds token shards (a sharded dataset, or one being prepared): train.bin "
                         f"and val.bin there would make its shards unread; choose another --out_dir")


def write_dataset(out_dir, train_ids, val_ids, meta: dict) -> dict:
    """Write train.bin, val.bin and meta.json atomically; return the meta written.

    `meta` needs vocab_size, tokenizer and source (and chars for a char tokenizer); dtype,
    token counts and format are added here. All three files are written to temporary
    names first; the old meta.json is removed before the swap and the new one goes in last,
    so an interrupted run leaves either the old dataset or a folder without meta.json.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_shards(out_dir)  # at once, not after waiting for the lock a shard prepare there may hold for hours
    vocab_size = meta["vocab_size"]
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    arrays = {}
    for name, ids in (("train.bin", train_ids), ("val.bin", val_ids)):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{name}: token ids must lie in [0, {vocab_size})")
        arrays[name] = ids.astype(dtype)
    meta = {"vocab_size": vocab_size, "dtype": dtype.name, **meta, "train_tokens": arrays["train.bin"].size,
            "val_tokens": arrays["val.bin"].size, "format": DATASET_FORMAT}
    meta_bytes = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
    with preparing(out_dir):  # another preparation into out_dir waits; what a killed one left goes
        refuse_shards(out_dir)  # again: a shard prepare that held the lock may have finished meanwhile
        write_together({**{out_dir / name: lambda f, a=array: f.write(memoryview(a))  # (numpy's tofile: no errno)
                           for name, array in arrays.items()}, out_dir / "meta.json": lambda f: f.write(meta_bytes)},
                       before=lambda: (out_dir / "meta.json").unlink(missing_ok=True))  # the old one first, the new last
    return meta


def _prepare_again(data_dir, when: str = "again", meta: dict = None) -> str:
    """The command that prepares data_dir's dataset (`meta`'s: from the same local input)."""
    name = Path(data_dir).name  # data/NAME/prepare.py, if there and it makes meta's kind of tokens
    if isinstance(meta, dict) and (meta.get("tokenizer") == "char") != (name == "shakespeare_char"):
        name = ""  # (no script: of ours, only shakespeare_char's makes characters; data/shakespeare may hold them)
    script = Path(__file__).parent / name / "prepare.py"
    if when == "first" and not script.is_file() and Path(data_dir).resolve().parent == script.parent.parent:
        return f"no data/{script.parent.name}/prepare.py makes it: check the dataset's name"
    command = f"python data/{script.parent.name}/prepare.py" if script.is_file() else "the dataset's prepare.py"
    source = meta.get("source") if isinstance(meta, dict) and isinstance(meta.get("source"), dict) else {}
    local = source.get("path") or source.get("input")  # (without it, a prepare fetches its default corpus)
    given = f" --input {shlex.quote(local)}" if isinstance(local, str) else ""
    made = meta.get("prepared_with") if isinstance(meta, dict) and isinstance(meta.get("prepared_with"), dict) else {}
    given += "".join(f" --{key} {shlex.quote(made[key])}" for key in ("repo", "subset", "revision")
                     if isinstance(made.get(key), str))  # (a hub's: without them, another corpus is fetched)
    given += f" --shard_tokens {made['shard_tokens']}" if type(made.get("shard_tokens")) is int else ""
    first = f"remove {shlex.quote(str(data_dir))}, then " if made else ""  # (a shard prepare takes a finished one)
    return f"{first}prepare the dataset {when} ({command}{given} --out_dir {shlex.quote(str(data_dir))})"


def is_loose_shard(path: Path) -> bool:
    """A *train*.bin / *val*.bin shard file; our own headerless train.bin and val.bin are not."""
    return path.suffix == ".bin" and path.name not in ("train.bin", "val.bin") and (
        "train" in path.name or "val" in path.name)


PROGRESS = ".progress.json"  # data/streaming.py's record of a preparation under way; meta.json ends it


def has_tokens(data_dir) -> bool:
    """Whether the folder holds a dataset to read (meta.json, or shards without one), or the start
    of one, or is no folder at all (which load_meta refuses: neither is to be prepared over)."""
    return os.path.lexists(Path(data_dir) / "meta.json") or has_shards(data_dir) or bool(not_a_folder(data_dir))


def has_shards(data_dir) -> bool:
    """Whether the folder holds token shards, or a preparation of them under way."""
    data_dir = Path(data_dir)
    return os.path.lexists(data_dir / PROGRESS) or (data_dir.is_dir() and any(map(is_loose_shard, data_dir.iterdir())))


def meta_from_shards(data_dir, needed=("train", "val")) -> dict:
    """The meta of a folder of llm.c shards without meta.json: GPT-2 BPE tokens, split by name (eval.py
    needs only val's: llm.c's fineweb_val_000000.bin alone, say)."""
    data_dir = Path(data_dir)
    files = sorted(p for p in data_dir.iterdir() if is_loose_shard(p))
    later = lambda p: max(("train", "val"), key=p.name.rfind)  # (retrieval_train_0.bin trains, pretrain_val_0 not)
    splits = {split: [p for p in files if later(p) == split] for split in ("train", "val")}
    for split in needed:
        if not splits[split]:
            raise ValueError(f"{data_dir} has no meta.json and no *{split}*.bin shard: a folder of pre-tokenized "
                             f"shards needs files named {' and '.join(f'*{s}*.bin' for s in needed)}")
    headers = {p: read_shard_header(p) for p in files}
    dtypes = {dtype for dtype, _ in headers.values()}
    if len(dtypes) > 1:
        by_dtype = {d: next(p.name for p, (dd, _) in headers.items() if dd == d) for d in sorted(dtypes)}
        raise ValueError(f"{data_dir}: shards of mixed dtypes ({', '.join(f'{p} holds {d}' for d, p in by_dtype.items())}): "
                         f"one dataset has one token dtype")
    shards = {split: [{"file": p.name, "tokens": headers[p][1]} for p in paths] for split, paths in splits.items()}
    return {**GPT2_META, "dtype": dtypes.pop(),
            "source": {"name": "pre-tokenized shards in llm.c's format", "path": str(data_dir)},
            "train_tokens": sum(s["tokens"] for s in shards["train"]),
            "val_tokens": sum(s["tokens"] for s in shards["val"]), "shards": shards, "format": DATASET_FORMAT}


def other_source(meta: dict, input_path: str):
    """None if the dataset of `meta` was made from the text at input_path (by its sha256; a pipe, or a file
    gone or unreadable, by its path; shards by the --input given, and the files it matches, at their sizes,
    unless none is left), else what it was made from."""
    from data.documents import local_source
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    same = named = source.get("path") in (str(Path(input_path)), os.path.realpath(input_path)) or (
        source.get("input") == os.path.abspath(input_path))  # (data/streaming.py's shards: a pattern of files)
    if "input" in source:
        prepared = meta.get("prepared_with") if isinstance(meta.get("prepared_with"), dict) else {}
        try:
            now = local_source(input_path)
            same = named and [now.names, now.sizes] == [prepared.get("files"), prepared.get("file_sizes")]
        except OSError:  # (none left: the --input given decides)
            pass
        except ValueError:  # it matches a file a prepare refuses now: not the files it read
            same = False
    elif Path(input_path).is_file():
        try:
            with open(input_path, "rb") as f:  # (in pieces: the text may be gigabytes)
                same = hashlib.file_digest(f, "sha256").hexdigest() == source.get("sha256")
        except OSError:
            pass
    made = source.get("path") or source.get("input") or source.get("name") or "another text"
    return None if same else f"made from {input_path} before it changed" if named else \
        f"made from {made}, not from prepare_input {input_path}"


def text_sha256(meta: dict):
    """The sha256 of the text a train.bin/val.bin dataset was made from, the same on every host that
    prepared it from that text; else None (shards: a host may hold them without their meta.json)."""
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    return source.get("sha256")


def split_shards(data_dir, meta: dict, splits=("train", "val")) -> dict:
    """{"train": [Shard, ...], "val": [...]}: where each split's tokens are."""
    data_dir = Path(data_dir)
    if "shards" not in meta:
        return {split: [Shard(data_dir / f"{split}.bin", meta["dtype"], 0, meta[f"{split}_tokens"])]
                for split in splits}
    return {split: [Shard(data_dir / s["file"], meta["dtype"], HEADER_INTS * 4, s["tokens"])
                    for s in meta["shards"][split]] for split in splits}


def _valid_shard_list(meta: dict) -> str:
    """What is wrong with meta["shards"], or "" when nothing is."""
    shards = meta["shards"]
    if not isinstance(shards, dict):
        return "shards is not a mapping of split to shards"
    for split in ("train", "val"):
        entries = shards.get(split)
        if not isinstance(entries, list) or not entries:
            return f"the {split} split has no shard"
        for entry in entries:
            if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
                    and Path(entry["file"]).name == entry["file"] and type(entry.get("tokens")) is int
                    and entry["tokens"] >= 0):
                return f"a {split} shard entry is not {{'file': NAME, 'tokens': COUNT}}: {entry!r}"
        if sum(e["tokens"] for e in entries) != meta[f"{split}_tokens"]:
            return f"the {split} shards add up to another count than {split}_tokens"
    return ""


def load_meta(data_dir, fix: str = "", splits=("train", "val")) -> dict:
    """meta.json of a prepared dataset (or the meta of a folder of shards without one); a clear
    error when the dataset is missing or incomplete, ending in `fix` (default: prepare it again)."""
    path = Path(data_dir) / "meta.json"
    again = fix or _prepare_again(data_dir)
    if not_a_folder(data_dir):
        raise ValueError(f"data_dir {data_dir} is not a folder (a file, a link to nothing, or under a file): "
                         f"give the dataset's folder")
    # (a folder is no dataset's, nor the loose files' of nanoGPT; a link to nothing was read as no meta.json at all)
    if os.path.lexists(path) and not path.is_file():
        raise ValueError(f"{path} is {'a link to nothing (or a loop)' if path.is_symlink() else 'not a file'}: move "
                         f"it out of the way, then {again}")
    if not path.is_file():
        if os.path.lexists(Path(data_dir) / PROGRESS):  # its shards are not the whole corpus
            raise ValueError(f"{data_dir} holds an unfinished preparation ({PROGRESS} and no meta.json): run the "
                             f"dataset's prepare.py with the same arguments again, which finishes it")
        if has_tokens(data_dir):
            return meta_from_shards(data_dir, splits)
        raise FileNotFoundError(f"{path} not found: {fix or _prepare_again(data_dir, 'first')}")
    try:
        meta = read_json(path)
    except ValueError as e:  # not UTF-8, not JSON
        raise ValueError(f"{path} is not valid JSON ({e}): {again}") from None
    again = fix or _prepare_again(data_dir, meta=meta)  # (from the local input meta names: not the default corpus)
    if not isinstance(meta, dict) or meta.get("format") != DATASET_FORMAT:
        found = f"format {meta['format']!r}" if isinstance(meta, dict) and "format" in meta else "no format"
        raise ValueError(f"{path} has {found}; this train.py reads format {DATASET_FORMAT}: {again}")
    for key, ok in (("vocab_size", lambda v: type(v) is int and v > 0),
                    ("dtype", lambda v: v in ("uint16", "uint32")),
                    ("train_tokens", lambda v: type(v) is int and v >= 0),
                    ("val_tokens", lambda v: type(v) is int and v >= 0),
                    ("tokenizer", lambda v: v in ("char", "gpt2"))):
        if not ok(meta.get(key)):
            raise ValueError(f"{path}: {key} is {meta.get(key)!r}, which is missing or invalid: {again}")
    chars = meta.get("chars", "")
    if meta["tokenizer"] == "char" and (not isinstance(chars, str) or len(set(chars)) < len(chars)):
        raise ValueError(f"{path}: chars is {chars!r:.80}, not the vocabulary's characters, each once: {again}")
    if meta["tokenizer"] == "char" and len(chars) != meta["vocab_size"]:
        raise ValueError(f"{path}: a char vocabulary of {len(chars)} characters, but vocab_size {meta['vocab_size']}: "
                         f"{again}")
    if meta["tokenizer"] == "gpt2" and meta["vocab_size"] != GPT2_VOCAB_SIZE:
        raise ValueError(f"{path}: tokenizer gpt2, but vocab_size {meta['vocab_size']} (GPT-2's BPE has "
                         f"{GPT2_VOCAB_SIZE} tokens): {again}")
    if "shards" in meta and (problem := _valid_shard_list(meta)):
        raise ValueError(f"{path}: {problem}: {again}")
    return meta


def check_token_files(data_dir, meta: dict, n_windows: int = 16, window: int = 4096, splits=("train", "val")) -> None:
    """Check the token files against meta.json: whole tokens of its dtype (for shards: a valid
    header of that dtype), its token counts, and no token id >= vocab_size in n_windows windows
    spread over each split (a sample: reading every token of a large corpus takes minutes)."""
    dtype = np.dtype(meta["dtype"])
    again = _prepare_again(data_dir, meta=meta)
    foreign = f"the files come from different preparations; {again}"
    if not (Path(data_dir) / "meta.json").is_file():  # meta_from_shards: read as GPT-2's tokens
        foreign = ("shards without a meta.json are read as GPT-2 BPE tokens, and these are not: tokenize "
                   "the text with GPT-2's BPE (python data/fineweb/prepare.py --input=FILES)")
    for split, shards in split_shards(data_dir, meta, splits).items():
        for shard in shards:
            path = shard.path
            if not path.is_file():  # (a run's out_dir holds run.lock and meta.json, the dataset's copy)
                raise FileNotFoundError(
                    f"{data_dir} is a training run's out_dir, not a dataset: give the dataset's folder"
                    if (Path(data_dir) / "run.lock").exists() else
                    f"{path} is {'no file' if os.path.lexists(path) else 'missing'}, though meta.json is there: "
                    f"{again}")
            if shard.offset:  # an llm.c shard: its header must agree
                found, count = read_shard_header(path)
                if found != dtype.name:
                    raise ValueError(f"{path} holds {found} tokens, but the dataset is {dtype.name}: "
                                     f"shards of mixed dtypes; {again}")
            else:
                size = path.stat().st_size
                if size % dtype.itemsize:
                    raise ValueError(f"{path} is {size} bytes, not a whole number of {dtype.name} tokens "
                                     f"({dtype.itemsize} bytes each): it was cut short or written with "
                                     f"another dtype; {again}")
                count = size // dtype.itemsize
            if count != shard.tokens:
                raise ValueError(f"{path} holds {count:,} tokens, but meta.json says {shard.tokens:,}: "
                                 f"the files come from different preparations; {again}")
            if count == 0:
                continue
            tokens = np.memmap(path, dtype=dtype, mode="r", offset=shard.offset, shape=(count,))
            per_shard = max(1, n_windows // len(shards))
            for start in np.unique(np.linspace(0, max(0, count - window), per_shard).astype(np.int64)):
                chunk = tokens[start:start + window]
                bad = np.flatnonzero(chunk >= meta["vocab_size"])
                if bad.size:
                    raise ValueError(f"{path}: token id {int(chunk[bad[0]])} at position "
                                     f"{int(start + bad[0]):,} is >= vocab_size {meta['vocab_size']}: {foreign}")
