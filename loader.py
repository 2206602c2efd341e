"""Token data for training and evaluation, read through np.memmap.

An epoch cuts the token file into windows of block_size + 1 tokens at a stride
of block_size, starting from an offset in [0, block_size) drawn for that
epoch. The windows are shuffled by a permutation seeded by (seed, epoch), and,
like torch's DistributedSampler, rank r of W takes positions r, r+W, r+2W, ...
of that order. Each optimizer step consumes the next global_batch_size
positions, whatever the world size and the number of micro-steps, so a run on
1 process with 4 accumulation steps sees exactly the windows a run on 4
processes with 1 step sees. The tail of an epoch too short for a whole
optimizer step is dropped. A dataset with fewer windows than one optimizer
step makes each epoch of several shuffled passes, so a step can still be full.

Dataset, at the end, is the run's view of its data folder: checked before the
process group forms, and prepared inside it (by each host's local rank 0) when
it is missing.
"""

import importlib
from pathlib import Path

import numpy as np
import torch

from config import Config
from data.dataset import check_token_files, load_meta
from errors import ConfigError
from launch import World, agree_or_raise

REPO = Path(__file__).resolve().parent


def open_tokens(path, dtype: str) -> np.memmap:
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def windows_to_batch(tokens: np.ndarray, starts, block_size: int, device) -> tuple:
    """Stack windows of block_size + 1 tokens into inputs x and next-token targets y."""
    rows = np.stack([tokens[s:s + block_size + 1] for s in starts]).astype(np.int64)
    batch = torch.from_numpy(rows)  # (B, T+1)
    if device.type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    else:
        batch = batch.to(device)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T), (B, T)


class ShardedTokenLoader:
    """Rank-strided, epoch-seeded batches of windows; resumable to the next batch."""

    def __init__(self, path, dtype: str, block_size: int, batch_size: int,
                 global_batch_size: int, rank: int, world_size: int, seed: int, device="cpu"):
        if global_batch_size % (batch_size * world_size):
            raise ValueError(f"global_batch_size ({global_batch_size}) is not a multiple of "
                             f"batch_size ({batch_size}) x world_size ({world_size})")
        self.tokens = open_tokens(path, dtype)
        self.block_size, self.batch_size = block_size, batch_size
        self.global_batch_size = global_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.device = torch.device(device)
        self.n_windows = len(self.tokens) // block_size - 1  # fits for any offset < block_size
        if self.n_windows < 1:
            raise ValueError(f"{path} has {len(self.tokens)} tokens: too few for a window "
                             f"of {block_size + 1} tokens at any offset")
        self.passes = -(-global_batch_size // self.n_windows)  # 1 unless the data is tiny
        self.steps_per_epoch = self.passes * self.n_windows // global_batch_size
        self.windows_per_epoch = self.steps_per_epoch * global_batch_size
        self.epoch, self.position = -1, 0  # position: windows consumed by all ranks this epoch

    def set_epoch(self, epoch: int):
        """Start epoch `epoch`: a fresh offset and order, the same on every rank."""
        rng = np.random.default_rng([self.seed, epoch])
        passes = []
        for _ in range(self.passes):
            offset = int(rng.integers(self.block_size))
            passes.append(offset + rng.permutation(self.n_windows) * self.block_size)
        # every window may be drawn; the epoch's tail that cannot fill a step is left out
        self.starts = np.concatenate(passes)[:self.windows_per_epoch]
        self.epoch, self.position = epoch, 0

    @property
    def epoch_done(self) -> bool:
        """True when this epoch's steps are all consumed: call set_epoch(epoch + 1)."""
        return self.epoch < 0 or self.position >= self.windows_per_epoch

    def rank_starts(self) -> np.ndarray:
        """Start offsets of this rank's next micro-batch (does not advance)."""
        span = self.batch_size * self.world_size
        if self.epoch < 0 or self.position + span > self.windows_per_epoch:
            raise RuntimeError("epoch exhausted: call set_epoch(epoch + 1) before the next batch")
        return self.starts[self.position + self.rank:self.position + span:self.world_size]

    def next_batch(self) -> tuple:
        """This rank's next micro-batch (x, y); every rank advances past all ranks' windows."""
        starts = self.rank_starts()
        self.position += self.batch_size * self.world_size
        return windows_to_batch(self.tokens, starts, self.block_size, self.device)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict):
        epoch, position = int(state["epoch"]), int(state["position"])
        if position % (self.batch_size * self.world_size):
            raise ValueError(f"loader position {position} is not a multiple of batch_size "
                             f"({self.batch_size}) x world_size ({self.world_size})")
        if epoch >= 0:
            self.set_epoch(epoch)
        self.epoch, self.position = epoch, position


def eval_starts(n_tokens: int, block_size: int, n_windows: int) -> np.ndarray:
    """A fixed set of evaluation windows: evenly spread, the same every eval and every run."""
    available = (n_tokens - 1) // block_size
    if available < 1:
        raise ValueError(f"{n_tokens} tokens hold no window of {block_size + 1} tokens")
    picks = np.unique(np.linspace(0, available - 1, min(n_windows, available)).round().astype(np.int64))
    return picks * block_size


# -----------------------------------------------------------------------------
# the dataset: checked before the process group forms, prepared inside it when missing

def dataset_dir(cfg: Config) -> Path:
    return Path(cfg.data_dir) if cfg.data_dir else REPO / "data" / cfg.dataset


def read_dataset(cfg: Config) -> dict:
    """meta.json, checked against the token files and against block_size."""
    data_dir = dataset_dir(cfg)
    try:
        meta = load_meta(data_dir)
        check_token_files(data_dir, meta)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    for split, needed in (("train", 2 * cfg.block_size), ("val", cfg.block_size + 1)):
        if meta[f"{split}_tokens"] < needed:  # train: a window at any epoch offset
            raise ConfigError(f"block_size ({cfg.block_size}) is too long for the {split} split of "
                              f"{data_dir} ({meta[f'{split}_tokens']:,} tokens; it needs {needed:,}): "
                              f"use a smaller --block_size or more data")
    return meta


class Dataset:
    """The run's data. Made before the process group: a broken dataset, or a missing one that
    cannot be made, fails here. `ready()`, inside the group, prepares missing data."""

    def __init__(self, cfg: Config):
        self.cfg, self.dir = cfg, dataset_dir(cfg)
        self.meta = read_dataset(cfg) if (self.dir / "meta.json").exists() else None
        script = REPO / "data" / cfg.dataset / "prepare.py"
        if self.meta is None and not script.exists():
            raise ConfigError(f"no dataset in {self.dir} (meta.json missing) and no {script} to "
                              f"prepare it: check --dataset / --data_dir")
        if self.meta is None and cfg.prepare_input and not Path(cfg.prepare_input).is_file():
            raise ConfigError(f"prepare_input {cfg.prepare_input} does not exist: the dataset in "
                              f"{self.dir} is missing and would be prepared from it")

    def ready(self, world: World) -> dict:
        """The checked meta on every rank. Each host's local rank 0 prepares missing data; every
        rank takes part in both agreements (a host with data cannot know another lacks it), so
        a failure on one host (no shared disk) stops every rank, not only that host's."""
        error = None
        if self.meta is None and world.local_rank == 0 and not (self.dir / "meta.json").exists():
            local_input = {"input_path": self.cfg.prepare_input} if self.cfg.prepare_input else {}
            try:
                importlib.import_module(f"data.{self.cfg.dataset}.prepare").prepare(
                    out_dir=str(self.dir), **local_input)
            except (OSError, ValueError, RuntimeError) as e:  # no corpus, not UTF-8, a full disk...
                error = f"preparing {self.cfg.dataset} in {self.dir} failed: {e}"
        agree_or_raise(error, world, "preparing the dataset failed on another rank: see its message")
        if self.meta is None:
            try:
                self.meta = read_dataset(self.cfg)
            except ConfigError as e:
                error = str(e)
        agree_or_raise(error, world, "the dataset check failed on another rank: see its message")
        return self.meta
