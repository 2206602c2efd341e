"""Checkpoints: written by rank 0 atomically, read by rank 0, shared with every rank.

A checkpoint is a dict of tensors and plain Python values, so that
`torch.load(path, weights_only=True)` reads it and nothing in it can run code.
Only global rank 0 touches the file system; the other ranks receive the state
over the process group, so hosts need no shared disk. The cost: rank 0 sends
the whole checkpoint (weights, optimizer moments: about 12 bytes per parameter
for AdamW in float32) to every other rank once per resume, over the gloo
control group, and each rank briefly holds a second copy of it in memory.
"""

import dataclasses
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from config import Config
from data.files import atomic_write
from errors import CheckpointNotWritten, ConfigError, OutDirBusy, OutDirUnwritable, first_line
from launch import World, agree_or_raise, any_rank
from model import GPTConfig

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


def save_on_rank0(state: dict, out_dir: Path, best: bool, world: World):
    """Rank 0 writes `state`; every rank learns whether it could, and raises if not.

    Every rank calls this with the state it built (building it may itself be collective);
    the agreement at the end is also the barrier that keeps ranks from running ahead of
    the write.
    """
    failure = None
    if world.is_master:
        try:
            save(state, out_dir, best)
        except (OSError, RuntimeError) as e:  # a full disk surfaces as either
            failure = first_line(e)
    if any_rank(failure is not None, world):
        raise CheckpointNotWritten(state["step"], failure or "see rank 0's log")


def save(state: dict, out_dir: Path, best: bool):
    """Write last.pt atomically (temporary file, fsync, rename); make best.pt the same bytes if best.

    The last.pt it replaces stays as previous.pt, so one good checkpoint survives even if
    last.pt is later damaged (a disk fault, a copy cut short).
    """
    last = out_dir / "last.pt"
    if last.exists():
        link_or_copy(last, out_dir / "previous.pt")
    atomic_write(last, lambda f: torch.save(state, f))
    if best:
        link_or_copy(last, out_dir / "best.pt")


def prepare_out_dir(out_dir: Path, world: World, lock: "OutDirLock"):
    """Find out now, not at the first checkpoint, that rank 0 cannot write to out_dir, or that
    another run holds it (every rank raises the same message)."""
    error = lock.error
    if world.is_master and error is None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            for path in remove_stale_temporaries(out_dir):
                print(f"removed {path}, left by a run that was killed while writing", flush=True)
            with tempfile.TemporaryFile(dir=out_dir):
                pass
        except OSError as e:
            error = str(OutDirUnwritable(out_dir, e))
    agree_or_raise(error, world, "rank 0 cannot use out_dir: see its message", share=True)


class OutDirLock:
    """Rank 0's exclusive lock on out_dir for the whole run: an fcntl lock on out_dir/run.lock,
    which the OS drops when the process ends, however it ends, so a dead run never blocks. The
    file names its holder (host, pid, start time). sample.py and other readers never lock.

    Rank 0 tries it before the process group forms; a failure is kept and raised on every rank
    at the group's first agreement (prepare_out_dir), since only rank 0 sees its out_dir."""

    def __init__(self, out_dir, world: World):
        self.fd, self.error = None, None
        if not world.is_master:
            return
        path = Path(out_dir) / "run.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self.error = str(OutDirUnwritable(out_dir, e))
        else:
            self._take(out_dir)
        if self.error and world.size == 1:
            raise ConfigError(self.error)  # alone: say it at once

    def _take(self, out_dir):
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 4096).decode(errors="replace")
            self.release()
            self.error = str(OutDirBusy(out_dir, holder))
            return
        os.ftruncate(self.fd, 0)
        os.write(self.fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                      "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # drops the lock; the file stays (unlinking it would race a new run)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def remove_stale_temporaries(out_dir: Path) -> list:
    """Delete temporary files a killed run left behind (they never replaced a real file)."""
    stale = sorted(out_dir.glob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def gather_rng_states(world_size: int, group=None) -> dict:
    """Every rank's RNG states, stacked by rank. A collective: every rank calls it."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()  # a CPU tensor, like the CPU state
    if world_size == 1:
        return {k: v[None] for k, v in states.items()}
    gathered = {}
    for key, state in states.items():
        parts = [torch.empty_like(state) for _ in range(world_size)]
        dist.all_gather(parts, state, group=group)
        gathered[key] = torch.stack(parts)
    return gathered


def restore_rng_states(rng: dict, rank: int):
    # clone: a row of the stacked states is a view at an offset, and set_rng_state reads
    # such a view from the start of its storage (rank > 0 crashed on it)
    torch.set_rng_state(rng["cpu"][rank].clone())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"][rank].clone())


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


def load_for_resume(cfg: Config, model_args: dict):
    """The checkpoint this run continues from, or None; with resume=auto, a damaged
    last.pt falls back to previous.pt, saying so."""
    path = find(cfg)
    if path is None:
        return None
    try:
        return load(path, model_args, cfg)
    except UnreadableCheckpoint as e:
        previous = path.with_name("previous.pt")
        if cfg.resume != "auto" or not previous.exists():
            raise
        print(f"warning: {e}\nresuming from {previous}, the checkpoint before it", flush=True)
        return load(previous, model_args, cfg)


def load_on_rank0(cfg: Config, model_args: dict, world: World):
    """The checkpoint this run continues from, or None, on every rank: rank 0 reads and checks
    it (other hosts need no copy of the file) and sends it, or its error, to the others."""
    return on_rank0(lambda: load_for_resume(cfg, model_args), world)


def on_rank0(read, world: World):
    """read() on rank 0; its result (tensors and plain values) or its ConfigError on every rank."""
    result, error = None, None
    if world.is_master:
        try:
            result = read()
        except ConfigError as e:
            error = str(e)
    if world.size > 1:
        result, error = share_from_rank0(result, error, world.group)
    if error:
        raise ConfigError(error)
    return result


def _pack(obj, tensors: list):
    """A JSON-able description of `obj` with its tensors moved out into `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"tensor": len(tensors) - 1}
    if isinstance(obj, dict):  # keys keep their type (optimizer state is keyed by int)
        return {"dict": [[_pack(k, tensors), _pack(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_pack(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"a checkpoint holds only tensors and plain values, not {type(obj).__name__}")


def _unpack(desc: dict, tensors: list):
    kind, body = next(iter(desc.items()))
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {_unpack(k, tensors): _unpack(v, tensors) for k, v in body}
    if kind in ("list", "tuple"):
        items = [_unpack(v, tensors) for v in body]
        return items if kind == "list" else tuple(items)
    return body


def _broadcast_bytes(data: torch.Tensor, group) -> torch.Tensor:
    """Broadcast a uint8 tensor of any length from rank 0 (others pass an empty one)."""
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    if dist.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return data


def share_from_rank0(ckpt, error, group=None):
    """Send rank 0's checkpoint (or its error) to every rank: tensors as raw bytes, the rest as JSON.

    No pickle: the structure travels as JSON, the tensors as one flat byte buffer.
    Returns (ckpt, error) on every rank.
    """
    tensors: list = []
    if dist.get_rank() == 0:
        desc = {"error": error} if error is not None else {"ckpt": _pack(ckpt, tensors)}
        desc["tensors"] = [(str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size())
                           for t in tensors]
        header = torch.frombuffer(bytearray(json.dumps(desc).encode()), dtype=torch.uint8)
        payload = (torch.cat([t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
                   if tensors else torch.empty(0, dtype=torch.uint8))
    else:
        header = payload = torch.empty(0, dtype=torch.uint8)
    desc = json.loads(_broadcast_bytes(header, group).numpy().tobytes())
    payload = _broadcast_bytes(payload, group)
    if "error" in desc:
        return None, desc["error"]
    if dist.get_rank() == 0:
        return ckpt, None
    received, offset = [], 0
    for dtype, shape, nbytes in desc["tensors"]:
        chunk = payload[offset:offset + nbytes].clone()  # clone: aligned memory for the view
        received.append(chunk.view(getattr(torch, dtype)).reshape(shape))
        offset += nbytes
    return _unpack(desc["ckpt"], received), None

