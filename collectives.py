"""The process group, and rank-to-rank agreement and small transfers in it: every function is a
collective that every rank calls, and a no-op on a single process.

Why agree: a problem only some ranks see (rank 0's checkpoint, one host's data, a SIGTERM that
reached one process) must not be acted on by those ranks alone: a rank that raised by itself
would leave its peers blocked in their next collective until dist_timeout, reporting a lost peer
instead of the real problem. So all vote first (any_rank), then all raise the same message.
Messages travel as JSON over the world's gloo group, never as pickle.
"""

import errno
import gc
import json
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from errors import (SEE_OTHER_RANK, CollectiveFailed, ConfigError, GroupNotFormed, RunError, UnreadableCheckpoint,
                    say)


def agree_max(value: int, world) -> int:
    """The largest value over all ranks (an integer), in one all-reduce."""
    if world.size == 1:
        return int(value)
    vote = torch.tensor([int(value)])
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=world.group)
    return int(vote.item())


def any_rank(flag: bool, world) -> bool:
    """True on every rank when `flag` is True on any (also a barrier)."""
    return agree_max(flag, world) > 0


def broadcast_json(obj, world, src: int = 0):
    """`obj` (plain values: dicts, lists, strings, numbers) from rank `src` on every rank."""
    if world.size == 1:
        return obj
    data = json.dumps(obj).encode() if world.rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=world.group)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=world.group)
    return json.loads(buffer.numpy().tobytes())


def first_error(error, world) -> str:
    """The lowest failing rank's message on every rank (call it once all agreed one failed)."""
    src = -agree_max(-world.rank if error is not None else -world.size, world)
    return broadcast_json(error, world, src)


def agree_or_raise(error, world, elsewhere: str = None):
    """Raise ConfigError on every rank if any rank has an error: its own message where it has one, else
    "{elsewhere} on another rank: see its message", or (elsewhere=None) the lowest failing rank's message."""
    if any_rank(error is not None, world):
        raise ConfigError((error or f"{elsewhere} {SEE_OTHER_RANK}") if elsewhere else first_error(error, world))


def differs_from_rank0(settings: dict, world, per_host: tuple = (), what: str = "config"):
    """None where this rank's settings (plain values) equal rank 0's, but for the per_host names
    (paths, devices); else a message naming each that differs. Ranks started with different
    configs would train on silently apart, or fail later in a collective that does not match."""
    mine = json.loads(json.dumps({k: v for k, v in settings.items() if k not in per_host}))
    rank0 = broadcast_json(mine, world)
    diff = [f"{k}={v!r} (rank 0: {rank0.get(k)!r})" for k, v in mine.items() if v != rank0.get(k)]
    return f"rank {world.rank} was started with {', '.join(diff)}: give every rank the same {what}" if diff else None


def on_rank0(read, world, rank0_only: tuple = ()):
    """read() on rank 0 only; its result (plain values) or its ConfigError (UnreadableCheckpoint stays one), or
    its PermissionError of a file, on every rank. Keys of a dict result named in `rank0_only` (tensors) are None
    on the others."""
    result, error = None, None
    if world.is_master:
        try:
            result = read()
        except ConfigError as e:
            error = [str(e), isinstance(e, UnreadableCheckpoint)]
        except PermissionError as e:  # a file's mode or owner: on every rank, for errors.reported to word
            error = [str(e.filename), None] if e.filename is not None else [str(e), False]
    shared = {k: None if k in rank0_only else v for k, v in result.items()} if isinstance(result, dict) else result
    shared, error = broadcast_json([shared, error], world)
    if error and error[1] is None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), error[0])
    if error:
        raise (UnreadableCheckpoint if error[1] else ConfigError)(error[0])
    return result if world.is_master else shared


class Agreement:
    """train.py's agreement on rare events, piggy-backed on the log step's loss all-reduce: at each
    log step, and in between every EVERY steps, or sooner when steps are slow, so a stop signal
    waits about SECONDS at most (torchrun kills its workers 30 s after passing SIGTERM on). The
    cadence comes out of the all-reduce itself, so every rank agrees at the same steps. A single
    process has no one to wait for: it agrees every EVERY steps, and at once when sent a signal."""
    EVERY, SECONDS = 10, 2.0

    def __init__(self, world, step: int):
        self.world, self.next, self.since = world, step + 1, (step, time.perf_counter())

    def due(self, step: int, signum: int) -> bool:
        return step >= self.next or (self.world.size == 1 and signum > 0)

    def __call__(self, loss: torch.Tensor, signum: int, problems: list, step: int) -> tuple:
        """In one all-reduce, the same answer on every rank at the same step (so all stop together):
        (the loss averaged over ranks, the signal any rank was sent or 0, for each of `problems` (this
        rank's message or None) the lowest failing rank's message or None)."""
        signals = (signal.SIGTERM, signal.SIGINT)  # SIGTERM first when both came
        seconds_per_step = (time.perf_counter() - self.since[1]) / max(1, step - self.since[0])
        flags = [seconds_per_step] + [float(signum == s) for s in signals] + [float(p is not None) for p in problems]
        votes = torch.cat([loss.detach().float().reshape(1), torch.tensor(flags, device=loss.device)])
        if self.world.size > 1:
            dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        votes = votes.tolist()
        seconds_per_step = votes[1] / self.world.size
        every = int(self.SECONDS / max(seconds_per_step, 1e-6)) if self.world.size > 1 else self.EVERY
        self.next = step + max(1, min(self.EVERY, every))
        self.since = (step, time.perf_counter())
        stop = next((int(s) for s, v in zip(signals, votes[2:4]) if v > 0), 0)
        return votes[0] / self.world.size, stop, [first_error(p, self.world) if v > 0 else None
                                                  for p, v in zip(problems, votes[4:])]


# -----------------------------------------------------------------------------
# the process group

COMM_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "socket", "peer", "closed")


def lost_peer(e: BaseException) -> bool:
    """Whether `e` is a timed-out or broken collective (a peer gone, a network down)."""
    return not isinstance(e, RunError) and (
        isinstance(e, dist.DistError) or any(word in str(e).lower() for word in COMM_WORDS))


@contextmanager
def collective_failures_explained(world, dist_timeout: float, where):
    """Turn a timed-out or broken collective into a message that says what to do.
    `where()` names the moment (it is called only on failure)."""
    try:
        yield
    except RuntimeError as e:
        if world.size == 1 or not lost_peer(e):
            raise
        raise CollectiveFailed(world.rank, where(), dist_timeout, e) from None


def _watch(world, address: str, dist_timeout: float, answered: threading.Event, joined: threading.Event):
    """_join's watchdog thread: ends the process when the join has not ended for 2 x dist_timeout + 2 s.
    (A signal meanwhile: errors.signals_unwind's watchdog, as the store's C++ wait holds the main thread.)"""
    if not joined.wait(2 * dist_timeout + 2):
        silent = TimeoutError(f"the store at {address} answered, but not every rank joined the group in "
                              f"{2 * dist_timeout + 2:.10g}s: a peer stopped while joining, or cannot reach this "
                              f"host at the address gloo gave it" if answered.is_set() else f"nothing answered at "
                              f"{address} in {2 * dist_timeout + 2:.10g}s: is another program listening on MASTER_PORT?")
        say(f"error: {GroupNotFormed(world.rank, world.size, address, dist_timeout, silent)}")  # (under
        os._exit(1)  # train_spawn.py, into its folder of ranks' lines: printed once)


def _join(world, dist_timeout: float):
    """init_process_group, with a message that says what to check when peers never come."""
    # Each binds dist.group.WORLD as a default argument when first imported (DDP imports the first through
    # torch._dynamo; FSDP's float16 scaler is the second): imported once the group exists, they would hold
    # it past destroy_process_group, and gloo's threads with it, which can abort the process at exit.
    import torch.distributed.nn  # noqa: F401
    if world.strategy == "fsdp":
        import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401
    address = ":".join(os.environ.get(k, f"({k} unset)") for k in ("MASTER_ADDR", "MASTER_PORT"))
    timeout = timedelta(seconds=dist_timeout)
    # The store's handshake has no timeout: a program that accepts on MASTER_PORT and never
    # answers (not a torch store) would hold this rank forever. The rendezvous, and then the
    # world-size read and init_process_group (which wait on the same peers), take at most
    # dist_timeout each, so past twice that nothing will come.
    answered, joined = threading.Event(), threading.Event()
    threading.Thread(target=_watch, args=(world, address, dist_timeout, answered, joined), daemon=True).start()
    try:
        socket.getaddrinfo(os.environ.get("MASTER_ADDR") or "localhost", None)  # fails in 2 x dist_timeout else
        store, _, _ = next(dist.rendezvous("env://", world.rank, world.size, timeout=timeout))
        answered.set()
        # torchrun restarts a failed group against the same store, where a dead peer's address
        # lingers for a new rank to read: a prefix per attempt keeps each attempt's keys apart.
        store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        # a rank started by hand with another WORLD_SIZE would wait out dist_timeout for peers that never come
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # (torchrun's ranks agree; its restarts share the store)
            if world.rank == 0:
                store.set("world_size", str(world.size))
            if (size := int(store.get("world_size"))) != world.size:
                raise ConfigError(f"WORLD_SIZE is {world.size} here but {size} on rank 0: start every rank with "
                                  f"the same")
            if store.add(f"rank-{world.rank}", 1) > 1:  # (it would wait out the join, then blame the network)
                raise ConfigError(f"another process joined {address} as rank {world.rank} first: RANK was given "
                                  f"twice, or another job uses this MASTER_PORT; give each rank its own RANK, "
                                  f"and each job its own MASTER_PORT")
        dist.init_process_group(world.backend, store=store, rank=world.rank, world_size=world.size, timeout=timeout)
    except ConfigError:
        raise
    except (RuntimeError, ValueError, socket.gaierror) as e:  # torch's DistError family is RuntimeError
        if "EADDRINUSE" in str(e):  # rank 0's store cannot listen: relaunching as it is would fail again
            raise ConfigError(f"MASTER_PORT {os.environ['MASTER_PORT']} is in use on {socket.gethostname()} (another "
                              f"program, or another job's rank 0, listens there): give every rank another") from None
        raise GroupNotFormed(world.rank, world.size, address, dist_timeout, e) from None
    finally:
        joined.set()
    # Small CPU messages (votes, JSON, sharded checkpoints' coordination) go through gloo, also under NCCL.
    world.timeout = timeout  # (new_group's own default is 30 minutes, whatever dist_timeout says)
    world.group = dist.new_group(backend="gloo", timeout=timeout) if world.backend != "gloo" else None


@contextmanager
def process_group(world, dist_timeout: float):
    """The process group for this launch, checked, and always torn down (a single process
    forms none). Every rank prints one line saying where it stands."""
    if world.size > 1:
        _join(world, dist_timeout)
    print(f"host {socket.gethostname()} | rank {world.rank} | local rank {world.local_rank} | world size {world.size} | "
          f"device {world.device} | backend {world.backend if world.size > 1 else 'none'}\n", end="", flush=True)
    try:
        with collective_failures_explained(world, dist_timeout, lambda: "before the first step"):
            if world.size > 1:  # an all-reduce with a known answer: a broken fabric fails now, not at step 500
                dist.all_reduce(probe := torch.tensor([world.rank + 1.0], device=world.device))
                if probe.item() != (expected := world.size * (world.size + 1) / 2):
                    raise RunError(f"the startup all-reduce over {world.backend} gave {probe.item()}, not "
                                   f"{expected}: the connection between ranks is broken")
            yield
    finally:
        if dist.is_initialized():
            # A group that outlives destroy_process_group keeps gloo's threads, which can abort the
            # process at exit ("terminate called without an active exception"): DDP holds it from
            # reference cycles, and FSDP's mesh, which DTensor's caches keep, from its registry
            gc.collect()
            getattr(world.mesh, "_pg_registry", {}).clear()  # (torch 2.13's name: a test checks it works)
            dist.destroy_process_group()
