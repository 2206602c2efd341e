"""Checkpoints in two formats, written atomically, read without running code, checked.

file (default): NAME.pt, one file that global rank 0 writes; a dict of tensors and plain Python
    values, so `torch.load(path, weights_only=True)` reads it. Hosts need no shared disk:
    train.py hands the state to the other ranks (parallel.py, collectives.py).
sharded: NAME.dcp, a torch.distributed.checkpoint (DCP) folder into which every rank writes
    its own shards in parallel (storage every rank sees), plus run.json, the plain values.
    Read back resharded to any world size and strategy; its .metadata (a pickle) is read by
    an unpickler that builds only DCP's own metadata classes, and holds tensors only.
last is the newest checkpoint, previous the one before it, best the one with the lowest
validation loss; resume=auto takes the newest complete one of either format.
"""

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from config import Config
from data.files import atomic_write, atomic_write_bytes, remove_stale_temporaries
from collectives import agree_or_raise, any_rank, broadcast_json, first_error
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
    """Bytes of the tensors in `obj` (this rank's shards of DTensors)."""
    if isinstance(obj, torch.Tensor):
        obj = obj.to_local() if hasattr(obj, "to_local") else obj
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in values)


def _disk_full(e: BaseException, out_dir: Path, need: int):
    """torch's zip writer reports a write cut short as "unexpected pos": the message, when the
    disk is full, that says so (else None)."""
    free = shutil.disk_usage(out_dir).free
    if "unexpected pos" in str(e) and free < need:
        return f"No space left on device: a checkpoint takes about {need / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free"
    return None


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
    except RuntimeError as e:
        full = _disk_full(e, out_dir, tensor_bytes(state))
        if full is None:
            raise
        raise OSError(errno.ENOSPC, full) from None
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


def newest(paths: list) -> list:
    """The checkpoints among `paths` that exist, the most recently written first (not the
    highest step: a fresh run into a used out_dir makes the old run's last its previous).
    An unreadable one is put last, so a readable one is preferred to it, saying so."""
    found, damaged = [], []
    for i, path in enumerate(p for p in paths if p.exists()):
        try:
            read(path, tensors=False)
            found.append((-(path / ".metadata" if path.is_dir() else path).stat().st_mtime_ns, i, path))
        except (UnreadableCheckpoint, OSError) as e:
            damaged.append((e, path))
    found = [path for *_, path in sorted(found)]
    for e, _ in damaged if found else ():
        print(f"warning: {e}\ntrying {found[0]} instead", file=sys.stderr, flush=True)
    return found + [path for _, path in damaged]


def find(cfg: Config) -> list:
    """The checkpoints to resume from, the one to try first first: with resume=auto, last and
    previous of either format in out_dir, the newest first; else the one named."""
    out = Path(cfg.out_dir)
    paths = ([] if cfg.resume == "never" else [Path(cfg.resume)] if cfg.resume != "auto" else
             [out / f"{kind}{suffix}" for kind in ("last", "previous") for suffix in (".pt", ".dcp")])
    paths = newest(paths)
    if not paths and (cfg.init_from == "resume" or cfg.resume not in ("auto", "never")):
        what = {"auto": f"no last.pt, last.dcp or previous one in {out}", "never": "resume=never forbids one"}
        raise ConfigError(f"nothing to resume from: {what.get(cfg.resume, f'{cfg.resume} does not exist')}")
    return paths


REQUIRED = ("model", "optimizer", "scaler", "step", "best_val_loss", "config", "model_args", "loader",
            "rng", "world_size")


class UnreadableCheckpoint(ConfigError):
    """The file is not a checkpoint torch can read as plain data."""


def read(path: Path, tensors: bool = True):
    """A checkpoint's dict: torch.load with weights_only=True (tensors and plain values only,
    never code), or a sharded folder read through DCP. tensors=False: a .pt is mapped, not read;
    a .dcp gives its plain values only."""
    if path.suffix == ".dcp":
        return read_sharded(path, tensors)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=not tensors)
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
    """Read and check a checkpoint against the run that wants to continue it (a .dcp folder's
    tensors are not read here: every rank loads its own shards)."""
    ckpt = read(path, tensors=path.suffix != ".dcp")
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
    """The checkpoint this run continues from, or None; with resume=auto, a damaged newest one
    falls back to the next newest (last -> previous)."""
    paths = find(cfg)
    return read_first(paths, lambda p: load(p, model_args, cfg)) if paths else None


def load_model(out_dir: Path, device, prefer: str = "best") -> tuple:
    """(model in eval mode, meta.json, path, step) of a training run, for sample.py, eval.py and
    scripts/export_hf.py: best, else last (or the other way round), of either format."""
    kinds = ("best", "last") if prefer == "best" else ("last", "best")
    paths = [p for kind in kinds for p in newest([out_dir / f"{kind}.pt", out_dir / f"{kind}.dcp"])]
    if not paths:
        raise ConfigError(f"no best.pt or last.pt in {out_dir} (nor a .dcp folder): train first, or pass --out_dir")

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


# -----------------------------------------------------------------------------
# the sharded format: a torch.distributed.checkpoint folder, written by every rank

TMP = ".last.dcp.tmp"  # a save in progress; remove_stale_temporaries deletes one a kill left


@contextmanager
def _dcp():
    """DCP's module; in one process (no_dist=True, as asked) it still warns that it assumes one."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield dcp


class _MetadataUnpickler(pickle.Unpickler):
    """DCP writes .metadata with pickle; this builds DCP's own metadata classes, torch.Size,
    dtypes and layouts, and refuses every other global, so a crafted file cannot run code. (DCP
    stores non-tensor entries as pickles too: BytesStorageMetadata is refused, so none is read.)"""
    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a sharded checkpoint of this repo never holds")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            metadata.storage_meta = metadata.storage_meta or StorageMeta()  # as FileSystemReader does
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return SafeReader(path)


def _reason(e: BaseException, out_dir: Path = None, need: int = 0) -> str:
    """One line for a failed DCP save (in out_dir, `need` bytes a rank) or load: the lowest
    failing rank's own exception."""
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, trace)}
    rank, exc = min(failures.items(), key=lambda item: item[0]) if failures else (None, (e, None))
    text = (out_dir and _disk_full(exc[0], out_dir, need)) or f"{type(exc[0]).__name__}: {first_line(exc[0])}"
    return text if rank is None else f"rank {rank}: {text}"


def _sharded_parts(path: Path):
    """(run.json's values, DCP metadata) of a complete sharded checkpoint; else UnreadableCheckpoint
    naming what is missing. Complete: run.json, .metadata, and every file the metadata points
    into, at least as long as the data it expects there."""
    def unreadable(reason):
        return UnreadableCheckpoint(f"cannot read checkpoint {path}: {reason}")
    for name in ("run.json", ".metadata"):
        if not (path / name).is_file():
            raise unreadable(f"{name} is missing; the save that wrote it did not finish")
    try:
        metadata = _reader(path).read_metadata()
        run_state = json.loads((path / "run.json").read_text())
    except Exception as e:
        raise unreadable(f"its metadata is damaged ({type(e).__name__}: {first_line(e)})") from None
    ends = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if not (path / name).is_file():
            raise unreadable(f"{name} (one rank's part) is missing")
        if (path / name).stat().st_size < end:
            raise unreadable(f"{name} is cut short ({(path / name).stat().st_size} of {end} bytes)")
    return run_state, metadata


def load_sharded(path: Path, state: dict, world=None):
    """Fill `state` (tensors, or DTensors holding this rank's shards) from a sharded checkpoint,
    resharded by DCP; every rank of `world` calls it (world=None: this process alone)."""
    alone = world is None or world.size == 1
    try:
        with _dcp() as dcp:
            dcp.load(state, storage_reader=_reader(path), process_group=None if alone else world.group, no_dist=alone)
    except BaseException as e:  # DCP's CheckpointException is a BaseException; Ctrl-C goes on
        if not isinstance(e, Exception) and not hasattr(e, "failures"):
            raise
        raise UnreadableCheckpoint(f"cannot read checkpoint {path}: {_reason(e)}") from None


def read_sharded(path: Path, tensors: bool) -> dict:
    """A sharded checkpoint as the file format's dict (tensors=False: the plain values only,
    model/optimizer/rng None and sharded=True, for a resume where every rank loads its shards)."""
    state, metadata = _sharded_parts(path)
    if not tensors:
        return {**state, "model": None, "optimizer": None, "rng": None, "sharded": True}
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
    load_sharded(path, flat)
    model = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    model["lm_head.weight"] = model["transformer.wte.weight"]  # tied: saved once
    # optimizer: names -> positions, the layout of torch.optim's state_dict() (parallel.full_state)
    groups = state.pop("param_groups")
    position = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
    optim = {}
    for key, value in flat.items():
        if key.startswith("optimizer."):
            name, stat = key.removeprefix("optimizer.").rsplit(".", 1)
            optim.setdefault(position[name], {})[stat] = value
    groups = [{k: [position[n] for n in v] if k == "params" else tuple(v) if isinstance(v, list) else v
               for k, v in g.items()} for g in groups]
    state.pop("rng_shapes")
    return {**state, "model": model, "optimizer": {"state": dict(sorted(optim.items())), "param_groups": groups},
            "rng": {k.removeprefix("rng."): v for k, v in flat.items() if k.startswith("rng.")}}


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(src: Path, dst: Path):
    """Move folder src to dst, replacing it: renames (atomic each), the old dst deleted last."""
    trash = dst.with_name(f".{dst.name}.old.tmp")
    shutil.rmtree(trash, ignore_errors=True)
    if dst.exists():
        os.replace(dst, trash)
    os.replace(src, dst)
    shutil.rmtree(trash, ignore_errors=True)


def _commit(out_dir: Path, best: bool):
    """Rank 0, once every rank's part and the metadata are written: last.dcp becomes previous.dcp
    and the new folder last.dcp. A kill at any moment leaves a complete last.dcp or previous.dcp
    (resume=auto takes the newest complete one); best.dcp is hard links to last.dcp's files."""
    last = out_dir / "last.dcp"
    if last.exists():
        _replace_dir(last, out_dir / "previous.dcp")
    os.replace(out_dir / TMP, last)
    if best:
        tmp = out_dir / ".best.dcp.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(last, tmp, copy_function=lambda s, d: link_or_copy(Path(s), Path(d)))
        _replace_dir(tmp, out_dir / "best.dcp")
    _fsync_dir(out_dir)


class Background:
    """A sharded save that DCP's thread is writing; rank 0 commits it as soon as it completes."""

    def __init__(self, future, out_dir: Path, best: bool, commit: bool, step: int, need: int):
        self.step, self.error, self.finished = step, None, threading.Event()

        def done(f):
            try:
                f.result()
                if commit:
                    _commit(out_dir, best)
            except BaseException as e:
                self.error = _reason(e, out_dir, need)
            self.finished.set()
        future.add_done_callback(done)

    def failure(self, wait: bool):
        """Why it failed, once it has; None while it runs or after it succeeded (wait: block until done)."""
        if wait:
            self.finished.wait()
        return self.error


def save_sharded(tensors: dict, run_state: dict, out_dir: Path, best: bool, world, background=False, group=None):
    """Every rank writes its shards of `tensors` (rank 0 also run.json, the plain values) into
    out_dir/.last.dcp.tmp; then rank 0 commits it (_commit). background (async_checkpoint): DCP
    copies the tensors now and writes them from a thread, over `group` (a gloo group of its own);
    returns a Background, which commits when the write completes. Raises OSError on every rank
    when any rank failed."""
    from torch.distributed.checkpoint import FileSystemWriter
    tmp, failure = out_dir / TMP, None
    if world.is_master:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            atomic_write_bytes(tmp / "run.json", json.dumps(run_state).encode())
        except OSError as e:
            failure = first_line(e)
    if any_rank(failure is not None, world):
        raise OSError(first_error(failure, world))
    alone = world.size == 1
    with _dcp() as dcp:
        if background:
            future = dcp.async_save(tensors, storage_writer=FileSystemWriter(tmp), no_dist=alone,
                                    process_group=None if alone else group)
            return Background(future, out_dir, best, world.is_master, run_state["step"], tensor_bytes(tensors))
        try:
            dcp.save(tensors, storage_writer=FileSystemWriter(tmp), process_group=world.group, no_dist=alone)
        except dcp.api.CheckpointException as e:
            raise OSError(_reason(e, out_dir, tensor_bytes(tensors))) from None
    if world.is_master:
        _commit(out_dir, best)


def check_shared(folder: Path, world, what: str):
    """Stop every rank, with one message, unless each sees rank 0's `folder`: the sharded format
    needs storage every rank sees. Checked by content, not by name (another host may hold an old
    copy at the same path): a checkpoint folder's run.json, else a fresh probe file."""
    if world.size == 1:
        return
    probe, digest = None, lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
    if world.is_master:
        probe = folder / "run.json" if (folder / "run.json").is_file() else folder / f".shared.{os.getpid()}.tmp"
        if probe.suffix == ".tmp":
            probe.write_text(os.urandom(16).hex())
    try:
        name, expected = broadcast_json(probe and [probe.name, digest(probe)], world)
        try:
            seen = digest(folder / name) == expected
        except OSError:
            seen = False
        agree_or_raise(None if seen else
                       f"rank {world.rank} on {socket.gethostname()} does not see rank 0's {folder} ({what}): "
                       f"checkpoint_format=sharded needs storage every rank sees (a shared filesystem); "
                       f"use --checkpoint_format=file, which needs none", world)
    finally:
        if probe is not None and probe.suffix == ".tmp":
            probe.unlink(missing_ok=True)
