"""Launch train.py on N local processes with torch.multiprocessing.spawn.

    python train_spawn.py [config.py] [--name=value ...] [--nproc=N] [--debug]

N defaults to the number of GPUs, or 2 on a machine without one. Each child
gets RANK / LOCAL_RANK / WORLD_SIZE like torchrun would set them and runs
train.py's own entry point, so there is no second copy of the training code.
"""

import logging
import os
import select
import signal
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

import train
from config import resolve
from errors import LOST_PEER, SEE_OTHER_RANK, ArgumentParser, ConfigError, interrupted, reported, signals_unwind
from world import World, setup, strip_local_rank


def free_port() -> int:
    """A TCP port free on this host right now (for MASTER_PORT on one host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, nproc: int, args: list[str], errors: str, ctrl_c):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), ERRORS_TO=errors)  # errors.say writes its line there
    with reported(), signals_unwind():  # both held while a rank imports torch (Ctrl-C printed a traceback)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))  # (blocked by run: inherited)
        if ctrl_c.is_set() or not mp.parent_process().is_alive():  # (or killed before mp set a death signal:
            raise KeyboardInterrupt  # an orphan trained on)
    train.cli(args)


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    with reported(debug="--debug" in args):
        if "-h" in args or "--help" in args:  # this launcher's usage, then train.py's settings
            print(__doc__, flush=True)
            return train.cli(["--help"])
        p = ArgumentParser(prog="train_spawn.py", add_help=False, allow_abbrev=False)  # the rest is train.py's
        p.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
        known, args = p.parse_known_args(args)
        if known.nproc < 1:
            raise ConfigError(f"--nproc must be a positive integer, got {known.nproc}")
        # a bad config or device fails here once, not in N children
        cfg = resolve(strip_local_rank([a for a in args if a != "--debug"]))
        setup(cfg, claim=False, world=World(size=known.nproc, local_size=known.nproc))  # as its rank 0 will see it
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its "Terminating process" lines
    with tempfile.TemporaryDirectory() as errors:  # each rank's error line, printed here once
        run(known.nproc, args, Path(errors))


def reader_gone() -> bool:
    """Whether stdout is a pipe whose reader went away (the kernel flags its writing end with POLLERR)."""
    try:
        (poll := select.poll()).register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poll.poll(0))
    except (AttributeError, ValueError, OSError):  # no stdout at all (>&-)
        return False


def run(nproc: int, args: list, errors: Path):
    ctrl_c = mp.get_context("spawn").Event()  # (before the mask below: this starts mp's resource tracker,
    # and starting it unblocks SIGINT and SIGTERM again)
    signals, context, held, sent = (signal.SIGTERM, signal.SIGINT), None, [], set()

    def forward(signum, frame):  # SIGTERM (a scheduler) and SIGINT (kill -INT), as torchrun does: each rank stops
        sent.add(signum)
        if signum == signal.SIGINT:  # at a step boundary and saves (a terminal's Ctrl-C reaches them too)
            ctrl_c.set()  # (a rank not yet in its worker reads this)
        if context is None:  # still spawning: passed on once the ranks exist
            return held.append(signum)
        for p in context.processes:
            if p.is_alive():
                os.kill(p.pid, signum)
    for sig in signals:  # in place before spawning: torch's own threads here would take a signal otherwise
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # inherited: the ranks start with both held (see worker)
    try:
        context = mp.spawn(worker, args=(nproc, args, str(errors), ctrl_c), nprocs=nproc, join=False)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    for signum in held:
        forward(signum, None)
    try:
        while not context.join():
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        if reader_gone():  # `| head`: a pipe's writer's end, quietly (the ranks' lines say only that it went;
            sys.exit(128 + signal.SIGPIPE)  # the rank that found it may still be exiting, or ended by mp: not 141)
        said = {rank: (errors / str(rank)).read_text("utf-8") for rank in range(nproc) if (errors / str(rank)).exists()}
        said = [line for rank, line in said.items() if rank == e.error_index or signal.SIGTERM in sent or
                line != f"error: {interrupted(signal.SIGTERM)}"]  # (mp.spawn ends the others so once one failed)
        own = [line for line in said if not line.endswith(SEE_OTHER_RANK)]  # (that message is here too)
        causes = [line for line in own if LOST_PEER not in line]  # a rank that lost its peer followed another's
        killed = getattr(e, "exit_code", 0) < 0  # end: not beside the cause (a line, or a signal named below)
        for line in dict.fromkeys(causes if causes or killed else own or said):  # each distinct one once, in rank order
            print(line, file=sys.stderr, flush=True)
        if not isinstance(e, mp.ProcessExitedException):  # a rank raised what no error names: its traceback
            raise
        if -e.exit_code in (signal.SIGTERM, signal.SIGINT):  # outside training (starting, or done): as one process
            sys.exit(128 - e.exit_code)
        # 1 and 2: the rank said why; 128 + SIGTERM/SIGINT: it stopped with a checkpoint
        if e.exit_code < 0:  # killed by a signal (SIGKILL: the out-of-memory killer, say): a failed run
            print(f"error: rank {e.error_index} was killed by {e.signal_name}: relaunch with resume=auto to "
                  f"continue from the last checkpoint", file=sys.stderr)
        elif e.exit_code not in (1, 2, 128 + signal.SIGTERM, 128 + signal.SIGINT):
            print(f"error: rank {e.error_index} exited with status {e.exit_code}", file=sys.stderr)
        sys.exit(max(e.exit_code, 1))


if __name__ == "__main__":
    main()
