"""The dataset format: what prepare scripts write and what training reads.

A prepared dataset is a folder holding
  train.bin, val.bin  flat token arrays (uint16, or uint32 when the vocabulary needs it)
  meta.json           vocab_size, dtype, tokenizer, chars (char only), source, token counts, format
meta.json is written last, so a folder that has one holds a complete dataset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from data.files import write_temp

DATASET_FORMAT = 1


def write_dataset(out_dir, train_ids, val_ids, meta: dict) -> dict:
    """Write train.bin, val.bin and meta.json atomically; return the meta written.

    `meta` needs vocab_size, tokenizer and source (and chars for a char tokenizer); dtype,
    token counts and format are added here. All three files are written to temporary
    names first; the old meta.json is removed before the swap and the new one goes in last,
    so an interrupted run leaves either the old dataset or a folder without meta.json.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
    meta_bytes = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    temps = {}
    try:
        for name, array in arrays.items():
            temps[name] = write_temp(out_dir / name, array.tofile)
        temps["meta.json"] = write_temp(out_dir / "meta.json", lambda f: f.write(meta_bytes))
        (out_dir / "meta.json").unlink(missing_ok=True)
        for name, tmp in temps.items():  # meta.json last
            os.replace(tmp, out_dir / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return meta


def _prepare_again(data_dir) -> str:
    return f"prepare the dataset again (python data/<dataset>/prepare.py --out_dir {data_dir})"


def load_meta(data_dir) -> dict:
    """meta.json of a prepared dataset; a clear error when the dataset is missing or incomplete."""
    path = Path(data_dir) / "meta.json"
    again = _prepare_again(data_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the dataset first "
                                f"(python data/{Path(data_dir).name}/prepare.py)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): {again}") from None
    if not isinstance(meta, dict) or meta.get("format") != DATASET_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: format {found!r}, not {DATASET_FORMAT}: {again}")
    for key, ok in (("vocab_size", lambda v: type(v) is int and v > 0),
                    ("dtype", lambda v: v in ("uint16", "uint32")),
                    ("train_tokens", lambda v: type(v) is int and v >= 0),
                    ("val_tokens", lambda v: type(v) is int and v >= 0),
                    ("tokenizer", lambda v: v in ("char", "gpt2"))):
        if not ok(meta.get(key)):
            raise ValueError(f"{path}: {key} is {meta.get(key)!r}, which is missing or invalid: {again}")
    if meta["tokenizer"] == "char" and len(meta.get("chars", "")) != meta["vocab_size"]:
        raise ValueError(f"{path}: a char vocabulary of {len(meta.get('chars', ''))} characters, but "
                         f"vocab_size {meta['vocab_size']}: {again}")
    return meta


def check_token_files(data_dir, meta: dict, n_windows: int = 16, window: int = 4096) -> None:
    """Check train.bin and val.bin against meta.json: whole tokens of its dtype, its token
    counts, and no token id >= vocab_size in n_windows windows spread over each file
    (a sample: reading every token of a large corpus would take minutes)."""
    dtype = np.dtype(meta["dtype"])
    again = _prepare_again(data_dir)
    for split in ("train", "val"):
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing, though meta.json is there: {again}")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{path} is {size} bytes, not a whole number of {dtype.name} tokens "
                             f"({dtype.itemsize} bytes each): it was cut short or written with "
                             f"another dtype; {again}")
        count = size // dtype.itemsize
        if count != meta[f"{split}_tokens"]:
            raise ValueError(f"{path} holds {count:,} tokens, but meta.json says "
                             f"{meta[f'{split}_tokens']:,}: the files come from different "
                             f"preparations; {again}")
        if count == 0:
            continue
        tokens = np.memmap(path, dtype=dtype, mode="r")
        for start in np.unique(np.linspace(0, max(0, count - window), n_windows).astype(np.int64)):
            chunk = tokens[start:start + window]
            bad = np.flatnonzero(chunk >= meta["vocab_size"])
            if bad.size:
                raise ValueError(f"{path}: token id {int(chunk[bad[0]])} at position "
                                 f"{int(start + bad[0]):,} is >= vocab_size {meta['vocab_size']} "
                                 f"from meta.json: the files come from different preparations; {again}")


