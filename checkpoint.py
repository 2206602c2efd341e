"""Checkpoint files: written atomically by rank 0, read with weights_only=True, checked.

A checkpoint is a dict of tensors and plain Python values, so that
`torch.load(path, weights_only=True)` reads it and nothing in it can run code. Only global
rank 0 touches out_dir; train.py hands the state to the other ranks (parallel.py,
collectives.py), so hosts need no shared disk. last.pt is the newest, previous.pt the one
before it, best.pt the one with the lowest validation loss.
"""

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from config import Config
from data.files import atomic_write, remove_stale_temporaries
from errors import ConfigError, OutDirBusy, OutDirUnwritable, first_line
from model import GPT, GPTConfig

FORMAT = 1


def link_or_copy(src: Path, dst: Path):
    """Point `dst` at `src`'s bytes: a hard link costs no second write; else copy."""
    if dst.exists() and os.path.samefile(src, dst):
        return  # already one file; and rename() between two links of one file does nothing
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        tmp.unlink(missing_ok=True)
        with open(src, "rb") as source:  # streamed: a checkpoint can be gigabytes
            atomic_write(dst, lambda f: shutil.copyfileobj(source, f))


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in values)


def save(state: dict, out_dir: Path, best: bool):
    """Write last.pt atomically (temporary file, fsync, rename); make best.pt the same bytes if best.

    The last.pt it replaces stays as previous.pt, so one good checkpoint survives even if
    last.pt is later damaged (a disk fault, a copy cut short).
    """
    last = out_dir / "last.pt"
    if last.exists():
        link_or_copy(last, out_dir / "previous.pt")
    try:
        atomic_write(last, lambda f: torch.save(state, f))
    except RuntimeError:  # torch's zip writer reports a write cut short as "unexpected pos"
        need, free = tensor_bytes(state), shutil.disk_usage(out_dir).free
        if free < need:
            raise OSError(errno.ENOSPC, f"No space left on device: a checkpoint takes about "
                                        f"{need / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free") from None
        raise
    if best:
        link_or_copy(last, out_dir / "best.pt")


@contextmanager
def locked_out_dir(out_dir, world):
    """Rank 0's exclusive lock on out_dir for the whole run; yields the problem it found (or None).

    The lock is an fcntl lock on out_dir/run.lock, which the OS drops when the process ends,
    however it ends, so a dead run never blocks; the file names its holder (host, pid, start
    time). Readers (sample.py) never lock. Rank 0 takes it before the process group forms and
    checks that it can write there now, not at the first checkpoint; train.py raises the
    problem on every rank at the group's first agreement, since only rank 0 sees its out_dir."""
    fd, error, out_dir = None, None, Path(out_dir)
    created = world.is_master and not out_dir.exists()
    if world.is_master:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(out_dir / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                error = str(OutDirBusy(out_dir, os.read(fd, 4096).decode(errors="replace")))
            else:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                         "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())
                for path in remove_stale_temporaries(out_dir):
                    print(f"removed {path}, left by a run that was killed while writing", flush=True)
                with tempfile.TemporaryFile(dir=out_dir):
                    pass
        except OSError as e:
            error = str(OutDirUnwritable(out_dir, e))
    try:
        if error and world.size == 1:
            raise ConfigError(error)  # alone: say it at once
        yield error
    except BaseException:  # a run that failed before writing anything leaves no folder behind
        if created and fd is not None and [p.name for p in out_dir.iterdir()] == ["run.lock"]:
            (out_dir / "run.lock").unlink()
            out_dir.rmdir()
        raise
    finally:
        if fd is not None:
            os.close(fd)  # drops the lock; the file stays (unlinking it would race a new run)


def find(cfg: Config):
    """The checkpoint to resume from on this host, or None."""
    if cfg.resume == "never":
        path = None
    elif cfg.resume == "auto":
        path = Path(cfg.out_dir) / "last.pt"
    else:
        path = Path(cfg.resume)
    if path is not None and path.exists():
        return path
    if cfg.init_from == "resume" or cfg.resume not in ("auto", "never"):
        raise ConfigError(f"nothing to resume from: {path or 'resume=never'} does not exist")
    return None


REQUIRED = ("model", "optimizer", "scaler", "step", "best_val_loss", "config", "model_args", "loader",
            "rng", "world_size")


class UnreadableCheckpoint(ConfigError):
    """The file is not a checkpoint torch can read as plain data."""


def read(path: Path):
    """torch.load with weights_only=True: tensors and plain values only, never code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # nothing in a bad file may end in a traceback
        if isinstance(e, EOFError) or "zip archive" in str(e):
            reason = "it is truncated or not a torch checkpoint at all"
        elif str(e).startswith("Weights only load failed"):  # torch's advice to load it unsafely: no
            reason = ("it is damaged, or holds objects that would run code when loaded, which "
                      "weights_only=True refuses")
        else:
            reason = f"{type(e).__name__}: {first_line(e)}"
    raise UnreadableCheckpoint(f"cannot read checkpoint {path}: {reason}")


def load(path: Path, model_args: dict, cfg: Config) -> dict:
    """Read and check a checkpoint against the run that wants to continue it."""
    ckpt = read(path)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        version = ckpt.get("format") if isinstance(ckpt, dict) else None
        raise ConfigError(f"{path}: checkpoint format {version} is not {FORMAT}, "
                          f"which this train.py reads")
    missing = [k for k in REQUIRED if k not in ckpt]
    if missing or not isinstance(ckpt["model_args"], dict) or not isinstance(ckpt["config"], dict):
        raise ConfigError(f"{path} lacks {missing or 'a valid model_args/config'}: it was not "
                          f"written by this train.py")
    if ckpt["model_args"].get("vocab_size") != model_args["vocab_size"]:
        raise ConfigError(
            f"{path} was trained on a vocabulary of {ckpt['model_args'].get('vocab_size')} tokens, "
            f"but the dataset now has {model_args['vocab_size']} (its meta.json): resume with the "
            f"data it was trained on (dataset={ckpt['config'].get('dataset')!r}, "
            f"data_dir={ckpt['config'].get('data_dir')!r}) or start afresh with --resume=never")
    saved = {**dataclasses.asdict(GPTConfig()), **ckpt["model_args"]}  # older files lack newer fields
    diff = {k: (saved.get(k), v) for k, v in model_args.items() if k != "dropout" and saved.get(k) != v}
    if diff:
        raise ConfigError(f"{path} holds another model shape (checkpoint, now): {diff}")
    for name in ("global_batch_size", "seed"):
        if ckpt["config"].get(name) != getattr(cfg, name):
            raise ConfigError(
                f"{path} was trained with {name}={ckpt['config'].get(name)}; resuming with "
                f"{getattr(cfg, name)} would change the data order: keep {name} or use --resume=never")
    ckpt["path"] = str(path)
    return ckpt


def read_first(paths: list, use):
    """use(path) for the first of `paths` that is not an UnreadableCheckpoint; each damaged
    one is reported and the next tried (last.pt -> previous.pt; best.pt -> last.pt)."""
    for i, path in enumerate(paths):
        try:
            return use(path)
        except UnreadableCheckpoint as e:
            if i == len(paths) - 1:
                raise
            print(f"warning: {e}\ntrying {paths[i + 1]} instead", file=sys.stderr, flush=True)


def load_for_resume(cfg: Config, model_args: dict):
    """The checkpoint this run continues from, or None; with resume=auto, a damaged
    last.pt falls back to previous.pt."""
    path = find(cfg)
    if path is None:
        return None
    previous = path.with_name("previous.pt")
    paths = [path, previous] if cfg.resume == "auto" and previous.exists() else [path]
    return read_first(paths, lambda p: load(p, model_args, cfg))


def load_model(out_dir: Path, device, prefer: str = "best") -> tuple:
    """(model in eval mode, meta.json, path, step) of a training run, for sample.py and
    scripts/export_hf.py: best.pt, else last.pt (or the other way round)."""
    names = ("best.pt", "last.pt") if prefer == "best" else ("last.pt", "best.pt")
    paths = [out_dir / name for name in names if (out_dir / name).exists()]
    if not paths:
        raise ConfigError(f"no best.pt or last.pt in {out_dir}: train first, or pass --out_dir")

    def build(path):
        ckpt = read(path)
        try:
            model = GPT(GPTConfig(**{**ckpt["model_args"], "dropout": 0.0}))
            model.load_state_dict(ckpt["model"])
        except Exception as e:  # plain data, but not a checkpoint of this repo's GPT
            raise UnreadableCheckpoint(f"{path} is not a GPT checkpoint of this repo "
                                       f"({type(e).__name__}: {first_line(e)})") from None
        return model, ckpt["step"], path

    model, step, path = read_first(paths, build)
    from data.dataset import load_meta
    meta_path = out_dir / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"{meta_path} is missing: train.py writes it beside the checkpoint; copy "
                          f"the dataset's meta.json there")
    try:
        meta = load_meta(out_dir)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if meta["vocab_size"] != model.config.vocab_size:
        raise ConfigError(f"{meta_path} has a vocabulary of {meta['vocab_size']} tokens but {path} was "
                          f"trained with {model.config.vocab_size}: they come from different runs")
    return model.eval().to(device), meta, path, step
