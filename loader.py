"""Token data for training and evaluation, read through np.memmap.

A split is one token file or many shards, end to end; no window crosses a shard end. An epoch
cuts each shard into windows of block_size + 1 tokens at a stride of block_size from an offset
drawn for that epoch, and shuffles them all by one permutation seeded by (seed, epoch).
Each optimizer step consumes the next global_batch_size positions of that order, a micro-batch
of batch_size at a time, rank r of W taking the r-th of each W: 1 process with 4 accumulation
steps sees exactly the micro-batches 4 processes with 1 step see. An epoch's tail too
short for a whole step is dropped (a dataset smaller than one step makes each epoch of several
passes). Memory: 8 bytes a window for the order; the tokens stay on disk until read.
"""

import importlib
import os
import shlex
from contextlib import suppress
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from config import REPO, Config
from data.dataset import Shard, check_token_files, has_tokens, load_meta, other_source, split_shards, text_sha256
from data.files import allow_open_files, preparing, why_unreadable
from errors import BadTokenId, ConfigError, out_of_memory
from collectives import agree_or_raise, differs_from_rank0
from world import World


class Tokens:
    """The tokens of one split: its shards, memory-mapped past their headers, end to end."""

    def __init__(self, shards: list, vocab_size: Optional[int] = None):
        shards = [s for s in shards if s.tokens > 0]
        self.paths = [s.path for s in shards]
        self.vocab_size = vocab_size  # when given, every window read is checked against it
        self.bad = None               # the first id past the vocabulary: a BadTokenId message
        self.arrays = [np.memmap(s.path, dtype=np.dtype(s.dtype), mode="r", offset=s.offset,
                                 shape=(s.tokens,)) for s in shards]
        self.lengths = np.array([s.tokens for s in shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])  # where each shard begins

    @classmethod
    def file(cls, path, dtype: str) -> "Tokens":
        """A flat file of tokens (train.bin / val.bin) as a split of one shard."""
        return cls([Shard(Path(path), dtype, 0, Path(path).stat().st_size // np.dtype(dtype).itemsize)])

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The `length` tokens from each global start position, as int64 rows. An id past the
        vocabulary is recorded in self.bad (file and position) and read as 0, so the model never
        indexes past its table (on a GPU, a device-side assert); the caller agrees on self.bad."""
        shard = np.searchsorted(self.offsets, starts, side="right") - 1
        local = starts - self.offsets[shard]
        rows = np.stack([self.arrays[s][i:i + length] for s, i in zip(shard, local)])
        if self.vocab_size is not None and rows.size and rows.max() >= self.vocab_size:  # 13 us for 32 x 1025
            r, c = np.argwhere(rows >= self.vocab_size)[0]
            if self.bad is None:
                self.bad = str(BadTokenId(int(rows[r, c]), self.vocab_size, self.paths[shard[r]], int(local[r] + c)))
            rows = np.where(rows >= self.vocab_size, 0, rows)
        return rows.astype(np.int64)

    def grid(self, per_shard: np.ndarray, stride: int, offset: int, ids: np.ndarray) -> np.ndarray:
        """Global start positions of windows numbered `ids` (int64, overwritten) over all shards, shard
        by shard, when shard s holds per_shard[s] windows at `offset + k * stride`. In place, 65,536
        at a time: whole-length temporaries made an epoch's order peak at 40 bytes a window, not 8."""
        first = np.concatenate([[0], np.cumsum(per_shard)])
        for i in range(0, len(ids), 1 << 16):
            chunk = ids[i:i + (1 << 16)]  # (a view)
            shard = np.searchsorted(first, chunk, side="right") - 1
            chunk -= first[shard]
            chunk *= stride
            chunk += self.offsets[shard] + offset
        return ids


def windows_to_batch(tokens: Tokens, starts, block_size: int, device) -> tuple:
    """Stack windows of block_size + 1 tokens into inputs x and next-token targets y."""
    batch = torch.from_numpy(tokens.windows(np.asarray(starts, dtype=np.int64), block_size + 1))  # (B, T+1)
    cuda = device.type == "cuda"  # pinned memory: the copy overlaps the GPU's work
    batch = (batch.pin_memory() if cuda else batch).to(device, non_blocking=cuda)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T), (B, T)


class ShardedTokenLoader:
    """Epoch-seeded batches of windows, the same micro-batches on any world size; resumable to the next batch."""

    def __init__(self, tokens: Tokens, block_size: int, batch_size: int, global_batch_size: int,
                 rank: int, world_size: int, seed: int, device="cpu"):
        assert global_batch_size % (batch_size * world_size) == 0, "world.setup checks this first"
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.device = torch.device(device)
        # windows that fit in each shard for any epoch offset < block_size
        self.per_shard = np.maximum(tokens.lengths // block_size - 1, 0)
        self.n_windows = int(self.per_shard.sum())  # >= 1: read_dataset checked the longest shard
        self.passes = -(-global_batch_size // self.n_windows)  # 1 unless the data is tiny
        self.steps_per_epoch = self.passes * self.n_windows // global_batch_size
        self.windows_per_epoch = self.steps_per_epoch * global_batch_size
        self.epoch, self.position = -1, 0  # position: windows consumed by all ranks this epoch

    def set_epoch(self, epoch: int):
        """Start epoch `epoch`: a fresh offset and order, the same on every rank. next_batch()
        calls it when an epoch is used up (always at an optimizer step's end, since an epoch
        holds whole steps), so a resumed loader rolls over exactly where the first would have."""
        rng = np.random.default_rng([self.seed, epoch])
        passes = []
        for _ in range(self.passes):
            offset = int(rng.integers(self.block_size))
            order = rng.permutation(self.n_windows)
            passes.append(self.tokens.grid(self.per_shard, self.block_size, offset, order))
        # every window may be drawn; the epoch's tail that cannot fill a step is left out
        self.starts = (np.concatenate(passes) if len(passes) > 1 else passes[0])[:self.windows_per_epoch]
        self.epoch, self.position = epoch, 0

    @property
    def epoch_done(self) -> bool:
        return self.epoch < 0 or self.position >= self.windows_per_epoch

    def rank_starts(self) -> np.ndarray:
        """Start offsets of this rank's next micro-batch (does not advance)."""
        first = self.position + self.rank * self.batch_size  # one process's micro-batch m x world_size + rank
        return self.starts[first:first + self.batch_size]

    def next_batch(self) -> tuple:
        """This rank's next micro-batch (x, y); every rank advances past all ranks' windows."""
        if self.epoch_done:
            self.set_epoch(self.epoch + 1)
        starts = self.rank_starts()
        self.position += self.batch_size * self.world_size
        return windows_to_batch(self.tokens, starts, self.block_size, self.device)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict):
        epoch, position = int(state["epoch"]), int(state["position"])  # (checkpoint.malformed checked them)
        if epoch >= 0:
            self.set_epoch(epoch)
        self.epoch, self.position = epoch, position


def token_splits(cfg: Config, meta: dict, splits=("train", "val"), world=World()) -> dict:
    """The dataset's train and val splits (or those in `splits`), each over its shards. `world`'s ranks agree
    on an open-file limit too low (eval.py's, given none, later: with all they check)."""
    shards = split_shards(dataset_dir(cfg), meta, splits)
    agree_or_raise(allow_open_files(sum(len(s) for s in shards.values())), world)  # (a map keeps a descriptor)
    return {split: Tokens(shards[split], meta["vocab_size"]) for split in splits}


def eval_starts(tokens: Tokens, block_size: int, n_windows: int) -> np.ndarray:
    """A fixed set of evaluation windows: evenly spread, the same every eval and every run."""
    per_shard = (tokens.lengths - 1) // block_size  # windows at offset 0
    available = int(per_shard.sum())  # >= 1: read_dataset checked the longest shard
    picks = np.unique(np.linspace(0, available - 1, min(n_windows, available)).round().astype(np.int64))
    return tokens.grid(per_shard, block_size, 0, picks)


# -----------------------------------------------------------------------------
# the dataset: checked before the process group forms, prepared inside it when missing

def dataset_dir(cfg: Config) -> Path:
    return Path(cfg.data_dir) if cfg.data_dir else REPO / "data" / cfg.dataset


def read_dataset(cfg: Config, splits=("train", "val")) -> dict:
    """meta.json, checked against the token files of `splits` (eval.py reads val's) and against block_size."""
    data_dir = dataset_dir(cfg)
    try:
        meta = load_meta(data_dir, splits=splits)
        check_token_files(data_dir, meta, splits=splits)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if cfg.prepare_input and (other := other_source(meta, cfg.prepare_input)):  # else it would go unused
        raise ConfigError(f"{data_dir} holds a dataset {other}: leave --prepare_input out to train on it as it "
                          f"is, or give the new text a --data_dir of its own (a new folder)")
    for split, shards in split_shards(data_dir, meta, splits).items():
        needed = 2 * cfg.block_size if split == "train" else cfg.block_size + 1  # train: any offset
        longest = max(s.tokens for s in shards)  # a window never crosses a shard end
        if longest < needed:
            where = "" if len(shards) == 1 else " in its longest shard"
            more = "more data" if len(shards) == 1 else "longer shards (a larger prepare.py --shard_tokens)"
            raise ConfigError(f"block_size ({cfg.block_size}) is too long for the {split} split of "
                              f"{data_dir} ({longest:,} tokens{where}; it needs {needed:,}): use {more}"
                              + (", or a model of a smaller block_size" if cfg.block_size > 1 else ""))
    return meta


class Dataset:
    """The run's data. Made before the process group: a broken dataset, or a missing one that
    cannot be made, fails here. `ready()`, inside the group, prepares missing data."""

    def __init__(self, cfg: Config):
        self.cfg, self.dir = cfg, dataset_dir(cfg)
        if not has_tokens(self.dir) and self.dir.is_dir():  # a run preparing it now: what it holds once that is done
            preparing(self.dir, clean=False).close()
        self.meta = read_dataset(cfg) if has_tokens(self.dir) else None
        if self.meta is not None:
            return
        loose = [name for name in ("train.bin", "val.bin") if (self.dir / name).exists()]
        if loose:  # nanoGPT's layout (its meta.pkl, a pickle, is not read): preparing would overwrite them
            how = ("character-level ones (meta.pkl) train once their text is prepared again (python data/"
                   "shakespeare_char/prepare.py --input TEXT --out_dir DIR)" if (self.dir / "meta.pkl").exists() else
                   "GPT-2 token files train once a meta.json describes them (docs/data.md gives it)")
            raise ConfigError(f"{self.dir} holds {' and '.join(loose)} but no meta.json: train.py will not prepare "
                              f"over them; nanoGPT's {how}, else delete them (a preparation killed as it ended "
                              f"leaves them too) or choose another --data_dir")
        script = REPO / "data" / cfg.dataset / "prepare.py"  # imported: a folder's name, in its letter case
        if not (cfg.dataset.isidentifier() and cfg.dataset in os.listdir(REPO / "data") and script.exists()):
            raise ConfigError(f"no dataset in {self.dir} (meta.json missing), and dataset={cfg.dataset!r} names no "
                              f"data/NAME/prepare.py to prepare it: check --dataset and --data_dir")
        given = f" --input={shlex.quote(cfg.prepare_input)}" if cfg.prepare_input else ""  # (else: the download)
        command = f"python data/{cfg.dataset}/prepare.py{given} --out_dir {shlex.quote(str(self.dir))}"
        if not getattr(importlib.import_module(f"data.{cfg.dataset}.prepare"), "PREPARE_IN_TRAIN", True):
            raise ConfigError(f"no dataset in {self.dir}: this corpus is too large to prepare at start-up; run "
                              f"{command} first (see docs/data.md)")
        here, text = os.path.realpath(self.dir), os.path.realpath(cfg.prepare_input or "/")  # (text: DIR/book.txt?)
        ours = {"input.txt", "lost+found", os.path.basename(text) * (os.path.dirname(text) == here)}
        own = here == os.path.realpath(script.parent)  # data/NAME, which holds its prepare.py
        others = [] if own or not self.dir.is_dir() else sorted(
            p.name for p in self.dir.iterdir() if not p.name.startswith(".") and p.name not in ours)
        if others:  # a mistyped --data_dir: data/shakespeare once got characters, a home folder a dataset
            raise ConfigError(f"no dataset in {self.dir} (meta.json missing), and it holds other files ("
                              f"{', '.join(others[:3])}{', ...' * (len(others) > 3)}): train.py prepares {cfg.dataset} "
                              f"only into a new or empty folder: check --data_dir, or prepare it there yourself "
                              f"({command})")
        if cfg.prepare_input and not Path(cfg.prepare_input).exists():  # (a pipe reads; a folder is refused there)
            raise ConfigError(f"prepare_input {cfg.prepare_input} {why_unreadable(cfg.prepare_input)}: the dataset "
                              f"in {self.dir} is missing and would be prepared from it")

    def ready(self, world) -> dict:
        """The checked meta on every rank. Each host's local rank 0 prepares missing data; every
        rank takes part in all three agreements (a host with data cannot know another lacks it), so
        a failure on one host (no shared disk) stops every rank, not only that host's."""
        error = None
        if self.meta is None and world.local_rank == 0 and not has_tokens(self.dir):
            local_input = {"input_path": self.cfg.prepare_input} if self.cfg.prepare_input else {}
            made = not self.dir.exists()
            try:  # a run starting beside into the same new folder waits, and then finds its dataset there
                self.dir.mkdir(parents=True, exist_ok=True)  # (read_dataset: refused if of another prepare_input)
                with preparing(self.dir):
                    if not has_tokens(self.dir):
                        importlib.import_module(f"data.{self.cfg.dataset}.prepare").prepare(
                            out_dir=str(self.dir), **local_input)
            except (OSError, ValueError, RuntimeError, MemoryError) as e:  # no corpus, not UTF-8, a full disk...
                error = f"preparing {self.cfg.dataset} in {self.dir} failed: {out_of_memory(e) or e}"
                if made:  # a folder made here for nothing goes (rmdir: only if it is empty)
                    with suppress(OSError):
                        self.dir.rmdir()
        agree_or_raise(error, world, "preparing the dataset failed")
        if self.meta is None:
            try:
                self.meta = read_dataset(self.cfg)
            except ConfigError as e:
                error = str(e)
        agree_or_raise(error, world, "the dataset check failed")
        same = {k: self.meta.get(k) for k in ("vocab_size", "tokenizer", "chars", "train_tokens", "val_tokens")}
        same["text_sha256"] = text_sha256(self.meta)  # (the same sizes of another text: a shuffle of its lines)
        agree_or_raise(differs_from_rank0(same, world, what="dataset (each host's data_dir)"), world)
        return self.meta
