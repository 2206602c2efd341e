"""The sharded format: a torch.distributed.checkpoint (DCP) folder, NAME.dcp, into which every rank writes its own
shards (storage every rank sees), plus run.json, the plain values. A save goes to .last.dcp.tmp, then takes last.dcp's
place. DCP's .metadata is a pickle: an unpickler that builds only DCP's metadata classes reads it (no code runs)."""

import errno
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import socket
import threading
import warnings
import zipfile
from contextlib import suppress
from pathlib import Path

import torch

import parallel
from collectives import agree_or_raise, any_rank, broadcast_json, first_error, lost_peer
from data.files import atomic_write_bytes, disk_full, exchange, fsync_dir, link_or_copy, remove, tensor_bytes
from errors import DISK_FULL, ConfigError, UnreadableCheckpoint, first_line, load_failure


TMP = ".last.dcp.tmp"  # a save in progress; remove_stale_temporaries deletes one a kill left


# DCP in one process (no_dist=True, as asked) warns that it assumes one
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP writes .metadata with pickle; this builds DCP's own metadata classes, torch.Size,
    dtypes and layouts, and refuses every other global, so a crafted file cannot run code. (DCP
    stores non-tensor entries as pickles too: BytesStorageMetadata is refused, so none is read.)"""
    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath")}  # (DCP's checkpoint_id: Python 3.13 names its class so)

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

        def _slice_file(self, file, info):
            """One saved tensor's bytes (a torch.save zip), checked against the CRC-32 of each record,
            which neither DCP nor torch.load checks: a flipped bit is an unreadable checkpoint."""
            data = super()._slice_file(file, info).read()
            try:
                torch._C.PyTorchFileReader(io.BytesIO(data))  # the zip as torch.load reads it: zipfile forgives more
                damaged = zipfile.ZipFile(io.BytesIO(data)).testzip()
                reason = damaged and f"its record {damaged} fails its CRC-32 check"
            except (zipfile.BadZipFile, EOFError, OSError, ValueError, RuntimeError) as e:
                reason = f"not what torch.save writes ({first_line(e).split('. ')[0]})"  # (not miniz's advice)
            if reason:
                raise UnreadableCheckpoint(f"{info.relative_path} is damaged at byte {info.offset:,}: {reason}")
            return io.BytesIO(data)
    return SafeReader(path)


def _reason(e: BaseException, out_dir: Path = None, need: int = 0) -> str:
    """One line for a failed DCP save (in out_dir, `need` bytes in all) or load: the lowest failing rank's own."""
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, trace)}
    rank, exc = min(failures.items(), key=lambda item: item[0]) if failures else (None, (e, None))
    text = (out_dir and disk_full(exc[0], out_dir, need)) or load_failure(exc[0])
    return text if rank is None else f"rank {rank}: {text}"


def parts(path: Path):
    """(run.json's values, DCP metadata) of a complete sharded checkpoint (run.json, .metadata, and every file the
    metadata points into, at least as long as the data it expects there); else UnreadableCheckpoint naming why."""
    def unreadable(reason):
        return UnreadableCheckpoint(f"cannot read checkpoint {path}: {reason}")
    if not path.is_dir():  # a file or a pipe where the folder goes
        raise unreadable("it is not a folder")
    for name in ("run.json", ".metadata"):
        if not (path / name).is_file():
            raise unreadable(f"{name} is missing; the save that wrote it did not finish")
    try:
        metadata = _reader(path).read_metadata()
        run_state = json.loads((path / "run.json").read_text())
        if not (isinstance(run_state, dict) and "param_groups" in run_state):
            raise ValueError("run.json does not hold a run's state")
        ends = {}
        for info in metadata.storage_data.values():  # (the classes are DCP's; their values may be anything)
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        tensors_ok = all(isinstance(m.size, torch.Size) and isinstance(m.properties.dtype, torch.dtype)
                         and sum(math.prod(c.sizes) for c in m.chunks) == m.size.numel()  # (no part left unread)
                         and all(o + n <= d for c in m.chunks for o, n, d in zip(c.offsets, c.sizes, m.size))
                         for m in metadata.state_dict_metadata.values())
        if not tensors_ok or not all(isinstance(name, str) and Path(name).name == name for name in ends):
            raise ValueError("a tensor's entry is not a size, a dtype, the chunks of it and a file in the folder")
    except Exception as e:  # (a mode or an owner is no damage: errors.reported says so)
        raise e if isinstance(e, PermissionError) else unreadable(f"its metadata is damaged ({type(e).__name__}: "
                                                                  f"{first_line(e)})") from None
    for name, end in sorted(ends.items()):
        size = None
        with suppress(OSError):  # (gone since: a run's save replaced the folder)
            size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None:
            raise unreadable(f"{name} (one rank's part) is missing")
        if size < end:
            raise unreadable(f"{name} is cut short ({size} of {end} bytes)")
    return run_state, metadata


def load(path: Path, state: dict, world=None):
    """Fill `state` (tensors, or DTensors holding this rank's shards) from a sharded checkpoint,
    resharded by DCP; every rank of `world` calls it (world=None: this process alone)."""
    import torch.distributed.checkpoint as dcp  # imported when first used, as in save
    alone = world is None or world.size == 1
    try:
        dcp.load(state, storage_reader=_reader(path), process_group=None if alone else world.group, no_dist=alone)
    except (Exception, dcp.api.CheckpointException) as e:  # the latter is a BaseException
        failures = [exc for exc, _ in getattr(e, "failures", {}).values()] or [e]  # (each rank's, DCP's)
        if stop := next((x for x in failures if isinstance(x, (KeyboardInterrupt, SystemExit, PermissionError))), None):
            raise stop from None  # Ctrl-C, a SIGTERM's unwinding (errors.signals_unwind), a mode: DCP packed them
        if not alone and (lost := next((x for x in failures if isinstance(x, RuntimeError) and lost_peer(x)), None)):
            raise lost from None  # not the checkpoint's fault: CollectiveFailed (exit 1, relaunch)
        raise UnreadableCheckpoint(f"cannot read checkpoint {path}: {_reason(e)}") from None


def read(path: Path, tensors: bool) -> dict:
    """A sharded checkpoint as the file format's dict (tensors=False: the plain values only,
    model/optimizer None and sharded=True, for a resume where every rank loads its shards). A run
    that saves meanwhile renames another folder to `path` (sample.py, say, reads a live run's last.dcp):
    read again, or its run.json and tensors would come from two steps, or one would be "missing"."""
    for attempt in range(3):
        before = _identity(path)
        try:
            result = _read(path, tensors)
        except UnreadableCheckpoint:
            if attempt == 2 or _identity(path) == before:
                raise
            continue
        if _identity(path) == before:
            return result
    raise UnreadableCheckpoint(f"cannot read checkpoint {path}: a run replaced it each time it was read")


def _identity(path: Path):
    """Which folder `path` names now (its device and inode), or None."""
    with suppress(OSError):
        return (found := os.stat(path)).st_dev, found.st_ino


def _read(path: Path, tensors: bool) -> dict:
    state, metadata = parts(path)
    if not tensors:
        return {**state, "model": None, "optimizer": None, "sharded": True}
    try:  # (a resume checks run.json against the model first; here a hand edit may reach this far)
        flat = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
        load(path, flat)
        model = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
        model["lm_head.weight"] = model["transformer.wte.weight"]  # tied: saved once
        optim = {}
        for key, value in flat.items():
            if key.startswith("optimizer."):
                name, stat = key.removeprefix("optimizer.").rsplit(".", 1)
                optim.setdefault(name, {})[stat] = value
        optimizer = parallel.by_position({"state": optim, "param_groups": json_groups(state.pop("param_groups"))})
    except (UnreadableCheckpoint, PermissionError):
        raise
    except Exception as e:  # e.g. param_groups that are not lists, a size no memory holds
        raise UnreadableCheckpoint(f"cannot read checkpoint {path}: its run.json or .metadata is not a checkpoint "
                                   f"of this repo's GPT ({type(e).__name__}: {first_line(e)})") from None
    return {**state, "model": model, "optimizer": optimizer}


def json_groups(groups: list) -> list:
    """param_groups as run.json gives them back: JSON made the tuples (betas) lists."""
    return [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]


def _replace_dir(src: Path, dst: Path, keep: Path = None) -> Path:
    """Move folder src to dst, swapped in one step where the system can (else by two renames, with a moment without
    dst for a live run's readers); the old dst becomes `keep` if given, else is returned for the caller to delete."""
    if exchange(src, dst):
        old = src  # (which now holds the old dst)
    else:
        remove(old := dst.with_name(f".{dst.name}.old.tmp"))
        if os.path.lexists(dst):  # whatever it is: a damaged folder, a file, a pipe, a link to nothing
            _rename(dst, old)
        _rename(src, dst)
    return _replace_dir(old, keep) if keep else old


def _rename(src: Path, dst: Path):
    try:
        os.replace(src, dst)
    except OSError as e:  # overlayfs renames no folder of a lower layer (a container image's): moved by a copy
        if e.errno != errno.EXDEV:
            raise
        shutil.copytree(src, dst, symlinks=True, copy_function=lambda s, d: link_or_copy(Path(s), Path(d)))
        remove(src)


def _commit(out_dir: Path, best: bool, rotate: bool):
    """Rank 0, once every rank's part and the metadata are written: the new folder becomes last.dcp and
    the one it replaces previous.dcp (unless not rotate). A kill at any moment leaves a complete last.dcp or
    previous.dcp (resume=auto takes the newest complete one); best.dcp is hard links to last.dcp's files,
    made first: killed before last.dcp is committed, the resume redoes the step and best is not lost."""
    last, tmp, old = out_dir / "last.dcp", out_dir / ".best.dcp.tmp", []
    try:
        if best:
            remove(tmp)
            tmp.mkdir()
            for part in (out_dir / TMP).iterdir():  # (copytree: a full disk would be shutil.Error's list)
                link_or_copy(part, tmp / part.name)
            old.append(_replace_dir(tmp, out_dir / "best.dcp"))
        keep = out_dir / "previous.dcp" if last.exists() and rotate else None  # (else the old last.dcp goes)
        old.append(_replace_dir(out_dir / TMP, last, keep))
        for folder in old:  # once last.dcp is back: a reader of a live run found none while they were deleted
            remove(folder)
    except OSError:  # the parts written go now, not at the next start (a full disk stays full)
        remove(tmp)
        remove(out_dir / TMP)
        raise
    fsync_dir(out_dir)


class Background:
    """A sharded save that DCP's thread is writing; rank 0 commits it as soon as it completes."""

    def __init__(self, future, out_dir: Path, commit, step: int, need: int):
        self.step, self.error, self.finished = step, None, threading.Event()

        def done(f):
            try:
                f.result()
                if commit:
                    commit()
            except BaseException as e:
                self.error = f"{type(e).__name__}: {first_line(e)}"  # should explaining it fail too
                self.error = _reason(e, out_dir, need)
                if commit:  # rank 0: the part written goes now, not at the next start (a full disk stays full)
                    remove(out_dir / TMP)
            finally:  # else failure(wait=True) would wait for ever
                self.finished.set()
        future.add_done_callback(done)

    def failure(self, wait: bool):
        """Why it failed, once it has; None while it runs or after it succeeded (wait: block until done)."""
        if wait:
            self.finished.wait()
        return self.error


def save_run(raw_model, optimizer, run_state: dict, out_dir: Path, best: bool, world, background=False,
             rotate=True):
    """Every rank writes its shards of the model and optimizer (rank 0 also run.json: run_state and the optimizer's
    param_groups) into out_dir/.last.dcp.tmp; then rank 0 commits it (_commit). background (async_checkpoint): DCP
    copies the tensors now and writes them from a thread over world.save_group (a gloo group of its own, made at
    the first such save); returns a Background, which commits when the write completes. Raises OSError on every
    rank when any rank's write failed (a failed commit: on rank 0; the caller agrees)."""
    import torch.distributed.checkpoint as dcp  # imported when first used: it takes 0.7 s
    tensors, param_groups = parallel.sharded_state(raw_model, optimizer)
    run_state = dict(run_state, param_groups=param_groups)
    tmp, failure = out_dir / TMP, None
    if world.is_master:
        try:
            remove(tmp)
            tmp.mkdir()
            atomic_write_bytes(tmp / "run.json", json.dumps(run_state).encode())
        except OSError as e:
            failure = first_line(e)
    if any_rank(failure is not None, world):
        raise OSError(first_error(failure, world))
    alone, writer = world.size == 1, dcp.FileSystemWriter(tmp)
    if background:
        if not alone and world.save_group is None:
            world.save_group = torch.distributed.new_group(backend="gloo", timeout=world.timeout)
        future = dcp.async_save(tensors, storage_writer=writer, no_dist=alone,
                                process_group=None if alone else world.save_group)
        return Background(future, out_dir, world.is_master and (lambda: _commit(out_dir, best, rotate)),
                          run_state["step"], tensor_bytes(tensors))
    try:
        dcp.save(tensors, storage_writer=writer, process_group=world.group, no_dist=alone)
        if world.is_master:
            _commit(out_dir, best, rotate)
    except (dcp.api.CheckpointException, OSError) as e:
        reason = _reason(e, out_dir, tensor_bytes(tensors))  # (before the part written goes: it holds the space)
        if world.is_master:  # (every rank's write has ended: DCP gathered their results)
            remove(tmp)
        raise OSError(reason) from None


def check_shared(folder: Path, world, what: str):
    """Stop every rank, with one message, unless each sees rank 0's `folder` (the sharded format needs storage every
    rank sees), by content, not name (a host's old copy at the same path): a checkpoint folder's run.json and its
    files' sizes (a part missing, or cut short, in a host's copy), else a fresh probe file."""
    if world.size == 1:
        return
    probe, error = None, None

    def digest(p):
        sizes = [[q.name, q.stat().st_size] for q in sorted(p.parent.iterdir())] if p.name == "run.json" else []
        return [hashlib.sha256(p.read_bytes()).hexdigest(), sizes]
    try:
        if world.is_master:
            probe = folder / "run.json" if (folder / "run.json").is_file() else folder / f".shared.{os.getpid()}.tmp"
            try:
                if probe.suffix == ".tmp":
                    probe.write_text(os.urandom(16).hex())
            except OSError as e:  # a full disk (out_dir's check made an empty file only)
                error = f"rank 0 could not write {probe} ({e.strerror or e}): " + \
                    ("free disk space" if e.errno in DISK_FULL else f"make {folder} writable")
        shared = broadcast_json(error or probe and [probe.name, digest(probe), str(folder)], world)
        if isinstance(shared, str):
            raise ConfigError(shared)
        name, expected, where = shared
        seen = False
        with suppress(OSError):
            seen = digest(folder / name) == expected
        fix = (f"make it a file that rank 0 alone reads, on rank 0's host: python scripts/convert_checkpoint.py "
               f"{where} {Path(where).parent}/converted.pt, then pass --resume= that file" if folder.suffix == ".dcp"
               else "use --checkpoint_format=file, which needs none")
        looked = "" if str(folder) == where else f"; it looked at {folder}"  # (out_dir may differ by host)
        agree_or_raise(None if seen else
                       f"rank {world.rank} on {socket.gethostname()} does not see rank 0's {where} ({what}{looked}): "
                       f"a sharded checkpoint needs storage every rank sees (a shared filesystem); {fix}", world)
    finally:
        if probe is not None and probe.suffix == ".tmp":
            probe.unlink(missing_ok=True)


def load_run(path: Path, raw_model, optimizer, ckpt: dict, world):
    """Every rank: load this world's shards of the .dcp at `path` (ckpt: its run.json) into the model and optimizer."""
    check_shared(path, world, "to resume from it")
    tensors, _ = parallel.sharded_state(raw_model, optimizer)  # this world's shards, to fill
    load(path, tensors, world)
    parallel.load_sharded_state(raw_model, optimizer, tensors, json_groups(ckpt["param_groups"]))
