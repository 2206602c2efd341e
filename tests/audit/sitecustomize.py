"""Loaded by every Python process whose PYTHONPATH starts with this folder (tests/harness.py's
child_env does that): records each write-like call under $AUDIT_WATCH, with the process's
RANK, into $AUDIT_LOG.<pid>, so a test can tell which rank wrote which file."""

import os
import sys

_watch = os.environ.get("AUDIT_WATCH")
_log = os.environ.get("AUDIT_LOG")
_busy = False  # the hook's own write to the log must not be recorded
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _hook(event, args):
    global _busy
    if _busy or not args:
        return
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE)
        if not writes:
            return
    elif event not in ("os.rename", "os.link", "os.mkdir", "os.remove", "os.symlink"):
        return
    paths = [os.fsdecode(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
    if not any(os.path.abspath(p).startswith(_watch) for p in paths):
        return
    _busy = True
    try:
        with open(f"{_log}.{os.getpid()}", "a") as f:
            f.write(f"{os.environ.get('RANK', '?')}\t{event}\t{paths[0]}\n")
    finally:
        _busy = False


if _watch and _log:
    sys.addaudithook(_hook)
