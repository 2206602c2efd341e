"""What a user reads when a run cannot go on: two kinds of failure, and the long messages.

ConfigError: a config, command-line, data or checkpoint problem, found before training (or a bad
token id, as it is read); fix it and run again (exit status 2). RunError: the run started and failed
(a lost peer, a diverged loss, a checkpoint that could not be written); the last checkpoint holds
the last good step (exit status 1). errors.reported prints either as one line starting with "error:".

Messages longer than a line live here, each with the exception that carries it, so the code
that raises them reads as control flow.
"""

import argparse
import errno
import os
import shlex
import signal
import socket
import sys
import threading
import traceback
from contextlib import contextmanager

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the errnos of a full disk, or of a full quota


class ConfigError(ValueError):
    """A config problem the user can fix: the message says what and how."""


class RunError(RuntimeError):
    """A failed run the user must act on (a lost peer, a diverged loss): a message, exit status 1."""


def first_line(e: BaseException, limit: int = 200) -> str:
    line = next((line for line in str(e).splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[:limit] + "[...]"


def load_failure(e: BaseException) -> str:
    """Why torch.load could not read a file, in one line, never torch's advice to load it unsafely."""
    if isinstance(e, UnreadableCheckpoint):  # already says why
        return str(e)
    if str(e).startswith("Weights only load failed"):
        return "it is damaged, or holds objects that would run code when loaded, which weights_only=True refuses"
    return f"{type(e).__name__}: {first_line(e)}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the tools, whose mistakes (a value of the wrong type, an unknown option) are one ConfigError
    line like any other, not its usage text; a path option's ~ is the home folder (not --start's text)."""
    PATHS = ("bpe_file", "data_dir", "hellaswag", "init_from", "input", "out", "out_dir", "to")

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):  # (a shell leaves --out_dir=~/x: a folder ~ was made)
        args = sys.argv[1:] if args is None else list(args)
        for i, (name, eq, value) in enumerate(a.partition("=") for a in args):  # (--out_d=~/x: abbreviated)
            if name.startswith("--") and eq and any(path.startswith(name[2:]) for path in self.PATHS):
                args[i] = f"{name}={os.path.expanduser(value)}"
        return super().parse_known_args(args, namespace)


SEE_OTHER_RANK = "on another rank: see its message"  # collectives.agree_or_raise's; train_spawn.py drops it
LOST_PEER = "a collective timed out or failed"  # CollectiveFailed's; train_spawn.py drops it beside the cause


@contextmanager
def reported(debug: bool = False, also: tuple = ()):
    """Every entry point runs inside this: a ConfigError (or an exception of a class in `also`)
    exits 2, a RunError 1, Ctrl-C 130, each as one line starting with "error:"; the traceback
    only if debug. (train.py itself turns Ctrl-C into a stop with a checkpoint once it trains.)"""
    if hasattr(sys.stdout, "reconfigure"):  # a character stdout's encoding lacks: a \x.. escape, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        yield
    except BrokenPipeError:  # stdout's reader went away (`| head`): end as a pipe's writer ends, quietly
        _stdout_gone()
        sys.exit(128 + signal.SIGPIPE)
    except (ConfigError, RunError, KeyboardInterrupt, OSError, *also) as e:
        too_long = isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG  # a path no file system takes
        full = isinstance(e, OSError) and e.errno in DISK_FULL and e.filename is None and \
            not isinstance(e, also)  # stdout's (the tools that write files list OSError in `also`, with a message)
        denied = isinstance(e, PermissionError) and e.filename is not None  # a mode or an owner: not a bug
        if isinstance(e, OSError) and not (too_long or full or denied or isinstance(e, also)):
            raise
        if debug:
            traceback.print_exc()
        message = interrupted(signal.SIGINT) if isinstance(e, KeyboardInterrupt) else e
        if too_long:
            path = str(e.filename)
            message = (f"the path {path[:60]}{'[...]' * (len(path) > 60)} is too long for the file system (a name "
                       f"over 255 bytes or a path over 4096): give a shorter path")
        elif denied:
            message = (f"permission denied: {e.filename}: this user may not use it (check the mode and owner of it "
                       f"and its folders), or choose another path")
        elif full:
            _stdout_gone()
            message = f"the output could not be written ({e.strerror}): free disk space where stdout goes"
        say(f"error: {message}")
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1 if isinstance(e, RunError) or full else 2)
    except Exception as e:  # torch.compile's failures (no C++ compiler, an op it cannot lower): a failed run
        oom = out_of_memory(e)
        if debug or not (oom or any(c.__name__ == "TorchDynamoException" for c in type(e).__mro__)):
            raise
        if oom:
            say(f"error: {oom}: free memory on this host, or ask for less")
            sys.exit(1)
        inner = getattr(e, "inner_exception", None) or e  # what the compiler itself raised
        say(f"error: torch.compile failed ({type(inner).__name__}: {first_line(inner)}): run with --compile=False")
        sys.exit(1)


def out_of_memory(e: BaseException):
    """"out of memory (what could not be had)" for Python's, numpy's (naming the allocation: a ulimit -v, say),
    torch's CPU allocator's or CUDA's error; None for any other."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e):
        return f"out of memory ({first_line(e) or type(e).__name__})"
    return None


def interrupted(signum: int) -> str:
    """A signal's end, as the error line names it: "interrupted (Ctrl-C)" for SIGINT, else its name."""
    return f"interrupted ({'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name})"


@contextmanager
def signals_unwind(grace: float = 2.0, unwound: float = 30.0):
    """Ctrl-C and SIGTERM (a scheduler, `timeout`) unwind, each in one line, status 130 or 143 (a shard
    prepare's pool starts no more work and the shard being written goes; train.py leaves no out_dir holding
    only run.lock). Python runs a handler only once the main thread is back from C++, and a rank can wait
    there long (the store, for peers that have not started; a collective, for a peer that prepares data):
    if it has not run within `grace` seconds, a watchdog ends the process at once, as SIGTERM's default
    does; and so at once if it ran where Python drops its exception (a __del__ or a weakref callback,
    torch's many: "Exception ignored in ...", and the process went on), or after `unwound` seconds if
    code caught it (`except BaseException`) and went on. It stands aside while another handler holds the
    signal (train.py's StopSignal, which saves first). Only the main thread can set a handler; elsewhere
    the signals stay as they were."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken, left, signals, hook = threading.Event(), threading.Event(), (signal.SIGINT, signal.SIGTERM), \
        sys.unraisablehook

    def unwind(signum, frame):
        taken.set()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # (errors.reported's "interrupted (Ctrl-C)", 130)
        say(f"error: {interrupted(signum)}")
        raise SystemExit(128 + signum)

    def watch(read):  # the signals' numbers, as they come (set_wakeup_fd), until the pipe closes
        while data := os.read(read, 64):
            for signum in (s for s in signals if s in data and signal.getsignal(s) is unwind):
                if not taken.wait(grace) or not left.wait(unwound):
                    if not (taken.is_set() and signum == signal.SIGTERM):  # (its handler said it)
                        say(f"error: {interrupted(signum)}")
                    os._exit(128 + signum)
        os.close(read)

    def dropped(raised):  # sys.unraisablehook: unwind's exception, lost, ends the process as the watchdog does
        if taken.is_set() and isinstance(raised.exc_value, (KeyboardInterrupt, SystemExit)):
            if isinstance(raised.exc_value, KeyboardInterrupt):  # (SIGTERM's handler said its line)
                say(f"error: {interrupted(signal.SIGINT)}")
            os._exit(130 if isinstance(raised.exc_value, KeyboardInterrupt) else raised.exc_value.code)
        hook(raised)
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous, previous_fd = {s: signal.signal(s, unwind) for s in signals}, signal.set_wakeup_fd(write)
    threading.Thread(target=watch, args=(read,), daemon=True).start()
    sys.unraisablehook = dropped
    try:
        yield
    finally:
        left.set()
        sys.unraisablehook = hook
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():  # (None: a handler not set from Python)
            signal.signal(s, handler or signal.SIG_DFL)
        os.close(write)


# torchrun, ended by a signal passed on to it (wait_passing_signals): 128 + N; by a failed worker (it said why): 1
TORCHRUN = [sys.executable, "-c", "import sys, torch.distributed.elastic.multiprocessing as m, torch.distributed.run "
            "as r\ntry: r.main()\nexcept m.SignalException as e: sys.exit(128 + e.sigval)\n"
            "except m.errors.ChildFailedError: sys.exit(1)"]


def wait_passing_signals(child) -> int:
    """child's (a Popen's) exit status. SIGTERM and SIGINT (kill -INT) sent here go on to it (torchrun ends its
    workers then; a tool that ended alone left them running), and this process ends as the signal ends a tool."""
    received = []

    def pass_on(signum, frame):
        received.append(signum)
        child.send_signal(signum)
    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # (None: not set from Python)
    if received:
        say(f"error: {interrupted(received[0])}")
        sys.exit(128 + received[0])
    return status


def _stdout_gone():
    """Point stdout at /dev/null: the exit flushes it once more, which would fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def say(line: str):
    """An error line on stderr; in train_spawn.py's ranks, into its ERRORS_TO folder instead, from
    which it prints each distinct line once (every rank raises the same agreed message)."""
    if os.environ.get("ERRORS_TO"):  # whole, or not there (the launcher ends the other ranks)
        from data.files import atomic_write_bytes
        try:
            return atomic_write_bytes(os.path.join(os.environ["ERRORS_TO"], os.environ.get("RANK", "0")),
                                      line.encode("utf-8", "backslashreplace"))  # as stderr would write it
        except OSError:  # (a full /tmp) the line itself still goes out
            pass
    sys.stderr.write(line + "\n")  # one write: print's two interleaved ranks' lines under PYTHONUNBUFFERED
    sys.stderr.flush()


class GlobalBatchIndivisible(ConfigError):
    def __init__(self, global_batch_size: int, batch_size: int, world_size: int):
        per_round = batch_size * world_size
        near = max(per_round, round(global_batch_size / per_round) * per_round)
        # the largest n <= most that splits the global batch, of the first million (a search to 10**10 took hours)
        largest = lambda most, split: next((n for n in range(min(most, 10**6), 0, -1) if split(n)), None)  # noqa: E731
        keep = largest(batch_size - 1, lambda b: global_batch_size % (b * world_size) == 0)
        fits = largest(world_size - 1, lambda w: global_batch_size % w == 0) if not keep else 0  # processes
        fits_batch = largest(batch_size, lambda b: global_batch_size % (b * fits) == 0) if fits else 0  # (1 splits)
        super().__init__(
            f"global_batch_size ({global_batch_size}) must be divisible by batch_size ({batch_size}) "
            f"x world size ({world_size}) = {per_round}: try --global_batch_size={near}"
            + (f", or --batch_size={keep}, which keeps the global batch (a resume must)" if keep else
               f" (a resume must keep {global_batch_size}: launch it on {fits} process{'es' * (fits > 1)}"
               + f" with --batch_size={fits_batch}" * (fits_batch != batch_size)
               + f", or another number that divides {global_batch_size})"))


def write_failure(e: OSError) -> str:
    """Why a file or folder could not be made (makedirs says "File exists" when a file is on the path)."""
    return "it is a file, or lies under one" if isinstance(e, (FileExistsError, NotADirectoryError)) else \
        str(e.strerror or e)


class OutDirUnwritable(ConfigError):
    def __init__(self, out_dir, e: OSError):
        if os.path.islink(out_dir) and not os.path.exists(out_dir):  # (makedirs: FileExistsError, as for a file)
            why, fix = "a link to nothing: is its storage mounted?", " or mount it"
        elif isinstance(e, (FileExistsError, NotADirectoryError)):
            why, fix = write_failure(e), ""
        else:
            why, fix = e.strerror or e, " or free disk space" if e.errno in DISK_FULL else " or fix its permissions"
        super().__init__(f"out_dir {out_dir} cannot be written ({why}): choose another --out_dir{fix}")


class OutDirBusy(ConfigError):
    def __init__(self, out_dir, holder: str):
        from data.files import parse_json
        try:
            h = parse_json(holder)
            who = f"the run started {h['started']} as pid {h['pid']} on {h['host']}"
        except (ValueError, KeyError, TypeError):
            who = "another run"
        super().__init__(f"out_dir {out_dir} is in use by {who} (it holds {out_dir}/run.lock): wait for "
                         f"it to end, stop it, or give this run another --out_dir")


class BadTokenId(ConfigError):
    def __init__(self, token: int, vocab_size: int, path, position: int):
        super().__init__(f"{path} holds token id {token} at token position {position:,}, past the vocabulary "
                         f"({vocab_size} ids): the file is damaged or was made with another tokenizer; "
                         f"prepare the dataset again (its prepare.py). The checkpoints were not touched")


class GroupNotFormed(RunError):
    def __init__(self, rank: int, world_size: int, address: str, dist_timeout: float, e: Exception):
        super().__init__(
            f"rank {rank} on {socket.gethostname()} could not form the process group of {world_size} ranks at "
            f"{address} within dist_timeout={dist_timeout:.10g}s ({first_line(e, 300)}). Check that no rank stopped "
            f"before joining (an error only it saw, such as a config given to it alone: see its output); that every "
            f"host started its ranks with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE; that {address} is "
            f"reachable from every host (address, port, firewall); and that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME "
            f"name the network interface that links the hosts.")


class CollectiveFailed(RunError):
    def __init__(self, rank: int, where: str, dist_timeout: float, e: Exception):
        super().__init__(
            f"rank {rank} on {socket.gethostname()}, {where}: {LOST_PEER} "
            f"({first_line(e, 300)}). A peer process died or the network between hosts is down "
            f"(dist_timeout={dist_timeout:.10g}s): relaunch every rank (training with resume=auto continues "
            f"from the newest checkpoint written, last.pt on rank 0's host or the shared last.dcp).")


def _kept(saved) -> str:
    """saved: train.Run.saved. resume=auto continues from what this run wrote, not always from what it
    resumed: a rollback to previous.pt (last.pt is newer), a checkpoint of another folder."""
    if saved is None:
        return "no checkpoint of this run was written yet"
    how = "resume=auto" if saved[2] else f"--resume={shlex.quote(saved[0])}"
    return f"{saved[0]} holds step {saved[1]}, the last good one ({how} continues from it)"


class Diverged(RunError):
    """`run`: train.Run; the causes named are those its settings make possible."""
    def __init__(self, what: str, run, saved):
        lr, decay = run.cfg.learning_rate, run.cfg.learning_rate * run.cfg.weight_decay
        causes = [f"a learning rate too high (learning_rate={lr:g}: try a smaller one or a longer warmup)" if run.step
                  else f"the weights it started from (init_from={run.cfg.init_from}: out of range? a damaged file?)"]
        if decay >= 1 and run.step:  # AdamW scales the weights by 1 - lr x weight_decay each step
            causes.append(f"a weight decay too strong for it (learning_rate x weight_decay = {decay:g}: keep it "
                          f"below 1)")
        if str(run.world.dtype) == "torch.float16":  # (by name: this module imports no torch)
            causes.append("float16 overflow (try --dtype=bfloat16)")
        super().__init__(f"{what}. Likely causes: {', '.join(causes)}, or bad data. Nothing was saved from this "
                         f"state: {_kept(saved)}.")


class CheckpointNotWritten(RunError):
    def __init__(self, step: int, failure: str, saved):
        fix = "free disk space" if "No space left" in failure or "Disk quota" in failure else "raise the file-size " \
            "limit (ulimit -f)" if "File too large" in failure else "make out_dir writable"  # (maybe another rank's)
        super().__init__(f"could not write a checkpoint at step {step} ({failure}); {_kept(saved)}: {fix} or choose "
                         f"another out_dir, then relaunch.")


class LogNotWritten(RunError):
    def __init__(self, failure: str, saved):
        super().__init__(f"rank 0 {failure}; {_kept(saved)}.")


class UnreadableCheckpoint(ConfigError):
    """The file or folder is not a checkpoint that can be read as plain data."""


class HellaSwagMissing(ConfigError):
    def __init__(self, cache, url: str, e: Exception, downloaded: bool = False):  # (downloaded: the cache refused it)
        how, fix = ("was downloaded but cannot be kept there", "set XDG_CACHE_HOME to a folder you can write") \
            if downloaded else ("cannot be downloaded here", f"on a machine with a network download {url} and put "
                                                             f"it at {cache}")
        super().__init__(
            f"the HellaSwag validation set is not at {cache} and {how} ({type(e).__name__}: {first_line(e, 120)}): "
            f"{fix}, or point at your copy with --hellaswag=PATH (eval.py) or --hellaswag_path=PATH (train.py)")
