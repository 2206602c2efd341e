"""Loaded by a process whose PYTHONPATH starts with this folder (tests/test_faults.py): the
process kills itself with SIGKILL inside its $FAULT_KILL_NTH-th write of last.pt, at the moment
$FAULT_KILL_AT names: "open" (about to create the temporary file) or
"rename" (written and fsynced, not yet renamed over last.pt)."""

import os
import signal
import sys

_at = os.environ.get("FAULT_KILL_AT")
_nth = int(os.environ.get("FAULT_KILL_NTH", "1"))
_seen = 0


def _hook(event, args):
    global _seen
    if not args:
        return
    try:
        path = os.fsdecode(args[0])
    except TypeError:  # a file descriptor
        return
    temp = os.path.basename(path).startswith(".last.pt.") and path.endswith(".tmp")
    if not temp:
        return
    if (_at == "open" and event == "open" and "w" in str(args[1])) or (_at == "rename" and event == "os.rename"):
        _seen += 1
        if _seen == _nth:
            os.kill(os.getpid(), signal.SIGKILL)


if _at:
    sys.addaudithook(_hook)
