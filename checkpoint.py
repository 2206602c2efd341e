"""Checkpoints in two formats, written atomically, read without running code, checked.

file (default): NAME.pt, written by global rank 0 (hosts need no shared disk), read with
    torch.load(weights_only=True). sharded: NAME.dcp, a DCP folder (sharded.py).
last is the newest checkpoint, previous the one before it, best the lowest validation loss;
resume=auto takes the newest complete one of either format.
"""

import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import zipfile
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from config import Config
import sharded
from collectives import agree_or_raise, on_rank0
from data.dataset import has_shards
from data.files import (atomic_write, disk_full, enclosing, link_or_copy, lock_note, read_json,
                        remove_stale_temporaries, same_path, tensor_bytes, why_unreadable)
from errors import ConfigError, OutDirBusy, OutDirUnwritable, UnreadableCheckpoint, load_failure
from model import GPT, GPTConfig

FORMAT = 1
WRITTEN = ("run.lock", "config.json", "meta.json", "metrics.jsonl", "last.pt", "previous.pt", "best.pt")  # files


def save(state: dict, out_dir: Path, best: bool, rotate: bool = True):
    """Write last.pt atomically (temporary file, fsync, rename), keeping the one it replaces as
    previous.pt (a fallback if last.pt is later damaged; not if not rotate); best.pt is the same bytes if best.
    A write that fails (a full disk) changes neither last nor previous."""
    last = out_dir / "last.pt"

    def link(tmp):
        if best:  # before last.pt: killed in between, the resume redoes this step (best_val_loss is last.pt's)
            link_or_copy(tmp, out_dir / "best.pt")
        if last.exists() and rotate:  # last: a copy that fails (no hard links, a full disk) leaves previous as it was
            link_or_copy(last, out_dir / "previous.pt")
    write(state, last, link)


def write(state: dict, path: Path, before_rename=None):
    """torch.save `state` to `path` atomically (also scripts/convert_checkpoint.py); a full disk is an OSError."""
    try:
        atomic_write(path, lambda f: torch.save(state, f), before_rename=before_rename)
    except RuntimeError as e:  # torch's zip writer reports a full disk so
        if (full := disk_full(e, path.parent, tensor_bytes(state))) is None:
            raise
        raise OSError(errno.EFBIG if full.startswith("File too large") else errno.ENOSPC, full) from None


@contextmanager
def locked_out_dir(out_dir, world, data_dir=None):
    """Rank 0's fcntl lock on out_dir/run.lock for the whole run (the OS drops it however the process
    ends; the file names its holder), taken before the group forms, with a check that out_dir is writable now,
    that no folder, pipe or device holds a name the run writes a file at (WRITTEN), and that it is no dataset's
    folder, nor data_dir. Yields the problem found (or None): train.py raises it on every rank."""
    fd, error, out_dir, gone = None, None, Path(out_dir), False
    created = world.is_master and not out_dir.exists()
    try:  # (a signal before the yield, as after it: a new folder holding only run.lock goes)
        if world.is_master:
            try:
                inside = enclosing(out_dir, ".dcp")  # (a checkpoint itself too: its files went at the next save)
                model = any((out_dir / name).is_file() for name in ("model.safetensors", "pytorch_model.bin"))  # (HF's)
                data = data_dir and same_path(out_dir, data_dir) or (out_dir / "train.bin").exists() or \
                    has_shards(out_dir)  # (data_dir: the run may prepare it there, then write its meta.json over it)
                if inside or model or data:  # its files would go, or be replaced
                    what = f"inside the checkpoint {inside}, which a save replaces" if inside else \
                        "a Hugging Face model's folder, whose config.json the run writes" if model else \
                        "a dataset folder, whose meta.json the run writes"
                    raise ConfigError(f"{out_dir} is {what}: choose another --out_dir")
                out_dir.mkdir(parents=True, exist_ok=True)
                for path in map(out_dir.joinpath, WRITTEN):  # (run.lock is written in place: not through a link)
                    if path.exists() and not path.is_file() or path.name == "run.lock" and path.is_symlink():
                        raise ConfigError(f"{path} is {'a link' if path.is_symlink() else 'not a file'}, but the run "
                                          f"writes a file of its own there: move it away or choose another --out_dir")
                fd = os.open(out_dir / "run.lock", os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another run's: closed now, so never unlinked below (two starts at once)
                    error = str(OutDirBusy(out_dir, os.read(fd, 4096).decode(errors="replace")))
                    os.close(fd)
                    fd = None
                else:
                    os.ftruncate(fd, 0)
                    os.write(fd, lock_note())
                    for path in remove_stale_temporaries(out_dir):
                        print(f"removed {path}, left by a run that was killed while writing", flush=True)
                    tempfile.TemporaryFile(dir=out_dir).close()  # (a probe: out_dir takes a new file)
            except OSError as e:
                error = str(OutDirUnwritable(out_dir, e))
            except ConfigError as e:
                error = str(e)
        if error and world.size == 1:
            raise ConfigError(error)  # alone: say it at once
        yield error
    except BaseException:  # a run that failed before writing anything leaves no folder behind (if still its own)
        lock = out_dir / "run.lock"
        if gone := created and fd is not None and lock.exists() and os.path.samestat(os.fstat(fd), lock.stat()) \
                and [p.name for p in out_dir.iterdir()] == ["run.lock"]:
            lock.unlink()
        raise
    finally:
        if fd is not None:
            os.close(fd)  # drops the lock; the file stays (unlinking it would race a new run)
        if gone:  # once closed: FUSE and NFS keep an unlinked open file (.fuse_hidden*, .nfs*) in the folder
            with suppress(OSError):
                out_dir.rmdir()


def newest(paths: list) -> list:
    """The checkpoints among `paths` that exist, the most recently written first (not the
    highest step: a fresh run into a used out_dir makes the old run's last its previous), but
    never a previous before its own format's last (a copy or a touch can make it look newer)."""
    def stamp(p):  # a .dcp's commit; a link to nothing (storage not mounted?) is tried, and reported; None: gone
        for stat, q in ((os.stat, p / ".metadata"), (os.stat, p), (os.lstat, p)):  # (renamed by a live run's save)
            with suppress(OSError):  # (also a link to itself: ELOOP, read as what it is later)
                return stat(q).st_mtime_ns
    stamps = {p: s for p in paths if (s := stamp(p)) is not None}

    def key(p):
        last = stamps.get(p.with_name(f"last{p.suffix}"), stamps[p])
        return (min(stamps[p], last) if p.name.startswith("previous") else stamps[p]), p.name.startswith("last")
    return sorted(stamps, key=key, reverse=True)


def find(cfg: Config) -> list:
    """The checkpoints to resume from, the one to try first first: with resume=auto, last and
    previous of either format in out_dir, the newest first; else the one named."""
    out = Path(cfg.out_dir)
    paths = newest([] if cfg.resume == "never" else [Path(cfg.resume)] if cfg.resume != "auto" else
                   [out / f"{kind}{suffix}" for kind in ("last", "previous") for suffix in (".pt", ".dcp")])
    if not paths and (cfg.init_from == "resume" or cfg.resume not in ("auto", "never")):  # (not both: config.py)
        what = (f"no last.pt, last.dcp or previous one in {out}" if cfg.resume == "auto" else
                f"{cfg.resume} {why_unreadable(cfg.resume)}")  # (in a folder this user may not enter: that)
        raise ConfigError(f"nothing to resume from: {what}")
    return paths


DATA_ORDER = ("global_batch_size", "seed")  # a resume keeps them: else the data order changes
REQUIRED = ("model", "optimizer", "scaler", "step", "best_val_loss", "config", "model_args", "loader", "world_size")


def read(path: Path, tensors: bool = True):
    """A checkpoint's dict: torch.load with weights_only=True (tensors and plain values only,
    never code), or a sharded folder read through DCP. tensors=False: a .pt is mapped, not read;
    a .dcp gives its plain values only."""
    if path.suffix == ".dcp":
        return sharded.read(path, tensors)
    if not path.is_file():  # a FIFO would hang the read
        raise UnreadableCheckpoint(f"cannot read checkpoint {path}: it is not a file")
    try:  # torch.load does not check the CRC-32 torch.save writes of each record: a flipped bit loads
        damaged = zipfile.ZipFile(path).testzip() if tensors else None
        if damaged is None:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=not tensors)
        reason = f"its bytes are damaged (record {damaged} fails its CRC-32 check)"
    except PermissionError:  # a mode or an owner (errors.reported says so), not a damage to fall back from
        raise
    except Exception as e:  # nothing in a bad file may end in a traceback
        truncated = isinstance(e, (EOFError, zipfile.BadZipFile)) or "zip archive" in str(e) or \
            getattr(e, "errno", None) == errno.EINVAL
        reason = "it is truncated or not a torch checkpoint at all" if truncated else load_failure(e)
    raise UnreadableCheckpoint(f"cannot read checkpoint {path}: {reason}")


def shape_diff(saved: dict, model_args: dict) -> dict:
    """{name: (saved, now)} where a checkpoint's model_args build another model (dropout aside; a field
    older files lack has its default)."""
    saved, now = ({**dataclasses.asdict(GPTConfig()), **args} for args in (saved, model_args))
    return {k: (saved.get(k), v) for k, v in now.items() if k != "dropout" and saved.get(k) != v}


def check_format(ckpt, path: Path) -> dict:
    version = ckpt.get("format") if isinstance(ckpt, dict) else None
    if version != FORMAT:
        raise ConfigError(f"{path}: checkpoint format {version} is not {FORMAT}, which this train.py reads")
    return ckpt


def load(path: Path, model_args: dict, cfg: Config, meta: dict = None) -> dict:
    """Read and check a checkpoint against the run that wants to continue it and its dataset's
    `meta` (a .dcp folder's tensors are not read here: every rank loads its own shards)."""
    ckpt = check_format(read(path, tensors=path.suffix != ".dcp"), path)
    ckpt.pop("rng", None)  # older files' RNG states: dropout's masks now derive from the step (train.py)
    missing = [k for k in REQUIRED if k not in ckpt]
    if missing or not isinstance(ckpt["model_args"], dict) or not isinstance(ckpt["config"], dict):
        raise ConfigError(f"{path} lacks {missing or 'a valid model_args/config'}: it was not written by this train.py")
    if ckpt["model_args"].get("vocab_size") != model_args["vocab_size"]:
        raise ConfigError(f"{path} was trained on a vocabulary of {ckpt['model_args'].get('vocab_size')} tokens, "
                          f"but the dataset now has {model_args['vocab_size']} (its meta.json): resume with the data "
                          f"it was trained on (dataset={ckpt['config'].get('dataset')!r}, data_dir="
                          f"{ckpt['config'].get('data_dir')!r}) or start afresh with --resume=never")
    vocab = ckpt.get("vocab")
    if "vocab" not in ckpt:  # older files: that of the meta.json beside it (a later run's?), if any
        with suppress(OSError, ValueError, AttributeError):  # (none there, copied elsewhere, not a dict)
            vocab = {k: v for k, v in read_json(path.parent / "meta.json").items() if k in ("tokenizer", "chars")}
    if meta is not None and isinstance(vocab, dict) and any(vocab[k] != meta.get(k) for k in vocab):
        raise ConfigError(f"{path} was trained on another vocabulary than the dataset's (same size, other tokens): "
                          f"resume with the data it was trained on (data_dir={ckpt['config'].get('data_dir')!r}) "
                          f"or start afresh with --resume=never")
    if diff := shape_diff(ckpt["model_args"], model_args):
        raise ConfigError(f"{path} holds another model shape (checkpoint, now): {diff}: resume with the shape it was "
                          f"trained with, or start afresh with --resume=never (or another --out_dir)")
    for name in DATA_ORDER:
        if ckpt["config"].get(name) != getattr(cfg, name):
            raise ConfigError(f"{path} was trained with {name}={ckpt['config'].get(name)}; resuming with "
                              f"{getattr(cfg, name)} would change the data order: keep {name} or use --resume=never")
    if problem := malformed(ckpt, model_args, cfg):
        raise ConfigError(f"{path}: {problem}: it was not written by this train.py as it is (edited by hand?)")
    ckpt["path"] = str(path)
    return ckpt


def malformed(ckpt: dict, model_args: dict, cfg: Config):
    """What among a checkpoint's values a resume could not take (a hand edit), or None: checked
    here, on rank 0, so it is one line on every rank, not a traceback in Run.load_state_dict (or
    worse: fused AdamW writes past the end of a state tensor that is too short)."""
    loader, number, world_size = ckpt["loader"], lambda v: type(v) in (int, float), ckpt["world_size"]
    if type(ckpt["step"]) is not int or ckpt["step"] < 0 or type(world_size) is not int or world_size < 1:
        return f"step {ckpt['step']!r} or world_size {world_size!r} is not a whole number"
    if type(ckpt.get("hellaswag_step", 0)) is not int:
        return f"hellaswag_step {ckpt['hellaswag_step']!r} is not a whole number"
    if not isinstance(ckpt.get("log", ""), str):
        return f"log {ckpt['log']!r:.60} is not metrics.jsonl's text"
    s, keys = ckpt["scaler"], {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    scaler_ok = s == {} or isinstance(s, dict) and set(s) == keys and all(map(number, s.values())) and \
        type(s["growth_interval"]) is type(s["_growth_tracker"]) is int and 0 < s["scale"] < float("inf") and \
        0 < s["backoff_factor"] < 1 < s["growth_factor"] and s["growth_interval"] >= 1 and s["_growth_tracker"] >= 0
    if not number(ckpt["best_val_loss"]) or not scaler_ok:
        return f"best_val_loss {ckpt['best_val_loss']!r} or the scaler's state {s!r} is not one (GradScaler's)"
    if not (isinstance(loader, dict) and all(type(loader.get(k)) is int for k in ("epoch", "position"))
            and loader["epoch"] >= -1 and loader["position"] >= 0 and loader["position"] % cfg.global_batch_size == 0):
        return (f"loader {loader!r} is not an epoch (-1 before the first) and a position that is a multiple "
                f"of global_batch_size")
    try:  # what is not a tensor goes from rank 0 to the other ranks as JSON
        json.dumps({k: v for k, v in ckpt.items() if k not in ("model", "optimizer")})
    except (TypeError, ValueError):
        return "a value beside the tensors is not plain data (numbers, strings, lists and dicts)"
    with torch.device("meta"):  # shapes only: no memory, whatever the size
        model = GPT(GPTConfig(**model_args))
    # AdamW's two groups, as configure_optimizers makes them: matrices and embeddings, then the rest
    groups = [[(n, p.shape) for n, p in model.named_parameters() if (p.dim() >= 2) == decay] for decay in (1, 0)]
    if ckpt["model"] is None:  # sharded: DCP checks the tensors as it reads them, run.json the rest
        if _params_of(ckpt["param_groups"]) != [[n for n, _ in g] for g in groups]:
            return "param_groups are not AdamW's two groups of this model's parameters"
        return None
    expected, weights = model.state_dict(), ckpt["model"] if isinstance(ckpt["model"], dict) else {}
    wrong = [k for k, v in expected.items() if not isinstance(weights.get(k), torch.Tensor) or weights[k].shape
             != v.shape or not weights[k].is_floating_point()] + sorted(map(str, set(weights) - set(expected)))
    if wrong:
        return f"model weight {wrong[0]} is missing, not this model's, or of another shape or no floats"
    optimizer, shapes = ckpt["optimizer"], [shape for g in groups for _, shape in g]
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    positions = [list(range(len(groups[0]))), list(range(len(groups[0]), len(shapes)))]
    count = lambda v: (number(v) or isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()) \
        and 0 <= float(v) < float("inf")  # noqa: E731 (AdamW's step: a bad one failed inside its update)
    adamw = lambda s, shape: isinstance(s, dict) and count(s.get("step")) and all(  # noqa: E731
        isinstance(s.get(k), torch.Tensor) and s[k].shape == shape for k in ("exp_avg", "exp_avg_sq"))
    if not (isinstance(state, dict) and _params_of(optimizer.get("param_groups")) == positions
            and all(adamw(state.get(i), shape) for i, shape in enumerate(shapes))):
        return "optimizer is not AdamW's state of two parameter groups, for each of this model's parameters"
    return None


def _params_of(param_groups):
    """The parameters (names or positions) of each saved optimizer group, or None if they are not lists."""
    if isinstance(param_groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                              for g in param_groups):
        return [g["params"] for g in param_groups]
    return None


def read_first(paths: list, use, say: bool = True):
    """use(path) for the first of `paths` that is not an UnreadableCheckpoint (None if there is no path);
    each damaged one is reported (if say) and the next tried (last -> previous; best -> last)."""
    for i, path in enumerate(paths):
        try:
            return use(path)
        except UnreadableCheckpoint as e:
            if i == len(paths) - 1:
                raise
            if say:
                print(f"warning: {e}\ntrying {paths[i + 1]} instead", file=sys.stderr, flush=True)


def lineage(out_dir: Path, last: Path, resumed_from, saved: tuple, resume: str) -> tuple:
    """(rotate, fresh) for a run's next save into out_dir as `last` (Run.saved: None, or (.., .., whether
    this run wrote it)). Resumed from another of out_dir's checkpoints, nothing saved since, a damaged last
    (or older than the other format's) must not become previous; a readable one a rollback replaces does.
    fresh: the first save of a run that did not continue one of out_dir's (started afresh, or elsewhere)."""
    if resumed_from is None:  # started afresh: an earlier run's last becomes previous if it reads
        return saved is not None or resume_step([last], 0) >= 0, saved is None
    resumed = Path(resumed_from)
    elsewhere = not same_path(resumed.parent, out_dir)
    rotate = same_path(resumed, last) or elsewhere or saved[2] or resume != "auto" and resume_step([last], 0) >= 0
    return rotate, not saved[2] and elsewhere


def resume(cfg: Config, model_args: dict, world, restore, meta: dict = None):
    """The checkpoint this run continues from (rank 0's; the others get its plain values), once restore(ckpt)
    took it on every rank; or None. A damaged one falls back to the next newest (last -> previous): a .pt
    as rank 0 reads and checks it, a .dcp also when a rank cannot read its shards (in restore)."""
    def use(path):
        ckpt = on_rank0(lambda: load(Path(path), model_args, cfg, meta), world, ("model", "optimizer", "log"))
        restore(ckpt)
        return ckpt
    paths = on_rank0(lambda: [str(p) for p in find(cfg)], world)
    if cfg.resume == "auto" and world.size > 1:  # an out_dir each host keeps: does rank 0's hold the newest?
        agree_or_raise(newer_than_rank0(cfg, world, on_rank0(lambda: resume_step(paths), world)), world)
    try:
        return read_first(paths, use, world.is_master)
    except UnreadableCheckpoint as e:  # none there reads: what to do (init_from=resume cannot start afresh)
        best = cfg.resume == "auto" and any(Path(cfg.out_dir, name).exists() for name in ("best.pt", "best.dcp"))
        raise UnreadableCheckpoint(f"{e}: give --resume=PATH of one that reads{' (best?)' * best}, "
                                   f"or --resume=never{' --init_from=scratch' * (cfg.init_from == 'resume')}") from None


def resume_step(paths: list, denied: int = None) -> int:
    """The step a resume takes: the first of `paths` that reads (a rollback's previous has a later one), or -1.
    One this user may not read (no damage: kept, as previous if it was last) raises, or counts as step `denied`."""
    def step(path):
        try:
            ckpt = read(Path(path), tensors=False)
        except PermissionError:
            if denied is None:
                raise
            return denied
        except ConfigError:  # (UnreadableCheckpoint among them)
            return -1
        return ckpt["step"] if isinstance(ckpt, dict) and type(ckpt.get("step")) is int else -1
    return next((s for s in map(step, paths) if s >= 0), -1)


def newer_than_rank0(cfg: Config, world, rank0_step: int):
    """Why this host's own out_dir holds a newer checkpoint than rank 0's, or None. (A c10d rendezvous
    may make another host's process rank 0 on a relaunch: the run started again from step 0.)"""
    own = [] if world.is_master or world.local_rank else newest([Path(cfg.out_dir, f"last.{s}") for s in ("pt", "dcp")])
    mine, path = next(((s, p) for p in own if (s := resume_step([p], -1)) >= 0), (-1, None))  # (the one that reads)
    return None if mine <= rank0_step else (
        f"{path} on {socket.gethostname()} (rank {world.rank}) is of step {mine}, but rank 0's out_dir holds "
        f"{f'step {rank0_step}' if rank0_step >= 0 else 'none'}: relaunch with that host's processes as ranks 0.. "
        f"(torchrun's static rendezvous, --node_rank=0 there), or copy its out_dir to rank 0's host")
