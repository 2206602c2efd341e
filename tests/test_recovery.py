"""Runs that are stopped, crash, or cannot find their peers: they end cleanly and resume exactly.

Signal-then-resume under torchrun is one test, over the signal (SIGTERM from a scheduler,
SIGINT from Ctrl-C) and the strategy (DDP, FSDP); each compares with one uninterrupted run of
its strategy. Single-process signals and kill -9 are in tests/test_faults.py."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from errors import interrupted
from harness import (REPO, assert_same_weights, child_env, children, ckpt, free_port, logged_step, python, run,
                     run_world, start, tiny_args, torchrun, train_py, wait_for, wait_for_line)

pytestmark = pytest.mark.slow
STEPS = 60


def recovery_args(data, out, strategy="ddp", **kw):
    return tiny_args(data, out, max_iters=STEPS, eval_interval=10, strategy=strategy, **kw)


@pytest.fixture(scope="module")
def uninterrupted(char_data, tmp_path_factory):
    """strategy -> the last.pt of an uninterrupted run of 2 processes (made when first asked)."""
    made = {}

    def get(strategy):
        if strategy not in made:
            out_dir = tmp_path_factory.mktemp(f"uninterrupted-{strategy}")
            run_world(2, recovery_args(char_data, out_dir, strategy), out_dir / "results")
            made[strategy] = ckpt(out_dir)
        return made[strategy]
    return get


@pytest.mark.parametrize("sig, strategy", [(signal.SIGTERM, "ddp"), (signal.SIGINT, "ddp"),
                                           (signal.SIGTERM, "fsdp")], ids=["SIGTERM", "SIGINT", "SIGTERM-fsdp"])
def test_a_signal_to_torchrun_stops_every_rank_at_a_step_and_resume_matches(char_data, tmp_path, uninterrupted,
                                                                             sig, strategy):
    # SIGTERM is what a scheduler sends before preempting; SIGINT what Ctrl-C sends torchrun
    args = recovery_args(char_data, tmp_path, strategy, resume="auto")
    proc = start(torchrun(args))
    wait_for(lambda: logged_step(tmp_path) >= 15, proc, what="step 15")
    signalled_at = logged_step(tmp_path)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out  # the launcher reports the preemption
    stopped = ckpt(tmp_path)
    assert signalled_at <= stopped["step"] < STEPS, out  # the next step boundary, not the last eval
    assert f"stopped by {sig.name} at step" in out, out
    if sig == signal.SIGINT:  # what follows a stop is the same for either signal: tested with SIGTERM
        return
    run(torchrun(args))
    final = ckpt(tmp_path)
    assert final["step"] == STEPS
    assert_same_weights(final, uninterrupted(strategy))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_train_spawn_reaches_every_rank_which_saves_and_stops(char_data, tmp_path, sig):
    """train_spawn.py passes SIGTERM and SIGINT on to its ranks, as torchrun does: without that the
    launcher died (or ignored the signal) and its ranks trained on, unsaved, with no one to wait for them."""
    proc = start([sys.executable, "train_spawn.py", "--nproc=2",
                  *tiny_args(char_data, tmp_path, max_iters=100_000, eval_interval=100_000)])
    ranks = []
    try:
        wait_for(lambda: logged_step(tmp_path) >= 1, proc, what="step 1")
        ranks = children(proc.pid)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:  # a launcher that did not pass the signal on leaves its ranks training
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, out
    assert f"stopped by {sig.name} at step" in out and ckpt(tmp_path)["step"] >= 1, out  # (no eval step saved it)


def test_ctrl_c_while_train_spawns_ranks_start_is_one_line(char_data, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: ranks still importing torch each printed a
    KeyboardInterrupt traceback. They start with SIGINT held, and take it where it is one line."""
    proc = subprocess.Popen([sys.executable, "train_spawn.py", "--nproc=2", *tiny_args(char_data, tmp_path)],
                            cwd=REPO, env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # (a group of its own, as a terminal's foreground job)
    wait_for(lambda: len(children(proc.pid, "spawn_main")) == 2, proc, what="two ranks")
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert out.endswith("error: interrupted (Ctrl-C)\n") or "stopped by SIGINT at step" in out, out  # (if begun)


def test_a_sigterm_before_the_first_step_is_one_line_and_leaves_no_out_dir(char_data, tmp_path):
    """A SIGTERM after the start, before the first step (while the model is built, say), killed the run
    where it stood: the new out_dir was left holding only run.lock. It now ends as Ctrl-C does (train.cli;
    under train_spawn.py each rank the same). Once training began, it stops and saves instead."""
    out_dir = tmp_path / "out"
    proc = start(train_py(tiny_args(char_data, out_dir)))
    out = "".join(wait_for_line(proc, "host "))  # (one process: no group to form)
    proc.send_signal(signal.SIGTERM)
    out += proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in out, out
    began = "stopped by SIGTERM at step" in out
    assert began or out.endswith("error: interrupted (SIGTERM)\n") and not out_dir.exists(), out


@pytest.mark.parametrize("signum, held", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True)],
                         ids=["unwinds", "held in C", "Ctrl-C held in C"])
def test_a_signal_the_main_thread_cannot_take_ends_the_process_after_a_grace(signum, held):
    """A rank waiting in a collective for a peer (one preparing data, say) took a SIGTERM or Ctrl-C only
    when the wait ended, up to dist_timeout later (errors.signals_unwind's handlers run on the main thread).
    A locked pthread mutex stands in for that C++ wait; a handler that runs still unwinds, cleanup and all."""
    wait = ("libc.pthread_mutex_lock(mutex)" if held else "time.sleep(60)")  # (the mutex is locked already)
    code = (f"import ctypes, sys, time\nsys.path.insert(0, {str(REPO)!r})\nfrom errors import signals_unwind\n"
            f"libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)\nlibc.pthread_mutex_lock(mutex)\n"
            f"with signals_unwind(grace=1):\n    try:\n        print('ready', ctypes.addressof(mutex), flush=True)\n"
            f"        {wait}\n    finally:\n        time.sleep(2)  # longer than the grace\n"
            f"        print('cleaned up', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready, mutex = proc.stdout.readline().split()
    assert ready == "ready"
    if held:  # the main thread waits on the mutex's futex (a signal before that ran the handler: a traceback here)
        wait_for(lambda: Path(f"/proc/{proc.pid}/syscall").read_text().split()[1:2] == [hex(int(mutex))], proc,
                 what="the main thread to wait in C")
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (128 + signum, f"error: {interrupted(signum)}\n")
    assert out == ("" if held else "cleaned up\n")  # held: ended at once after the grace, as SIGTERM's default


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_whose_exception_was_lost_still_ends_the_process(signum):
    """A handler that runs in a __del__ (or a weakref callback: torch has many) raises into nothing:
    Python printed "Exception ignored" and a traceback, and went on (training, to exit 0). It ends now."""
    code = (f"import os, signal, sys, time\nsys.path.insert(0, {str(REPO)!r})\nfrom errors import signals_unwind\n"
            f"class Dying:\n    def __del__(self):\n        os.kill(os.getpid(), {int(signum)})\n"
            f"        time.sleep(0.5)  # the handler runs here\n"
            f"with signals_unwind():\n    Dying()\n    print('went on', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (128 + signum, "", f"error: {interrupted(signum)}\n")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_whose_exception_was_caught_still_ends_the_process(signum):
    """(DCP's load caught every rank's exception, Ctrl-C's and SIGTERM's too: the resume went on from another
    checkpoint, to exit 0; a library that does so elsewhere is not stopped by the process's own code)"""
    code = (f"import sys, time\nsys.path.insert(0, {str(REPO)!r})\nfrom errors import signals_unwind\n"
            f"with signals_unwind(unwound=1):\n    try:\n        print('ready', flush=True)\n        time.sleep(60)\n"
            f"    except BaseException:\n        pass\n    print('went on', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (128 + signum, "went on\n", f"error: {interrupted(signum)}\n")


def test_killed_worker_is_restarted_by_torchrun_and_resumes_exactly(char_data, tmp_path, uninterrupted):
    proc = start(torchrun(recovery_args(char_data, tmp_path, resume="auto"), extra=["--max-restarts=1"]))
    wait_for(lambda: (tmp_path / "last.pt").exists() and logged_step(tmp_path) >= 15, proc, what="a checkpoint")
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "resuming from" in out
    final = ckpt(tmp_path)
    assert final["step"] == STEPS
    assert_same_weights(final, uninterrupted("ddp"))


def test_a_missing_peer_fails_within_dist_timeout_with_advice(char_data, tmp_path):
    # rank 0 of 2, and rank 1 never comes: no hang, one clear message, exit status 1
    started = time.monotonic()
    proc = python("train.py", *tiny_args(char_data, tmp_path, dist_timeout=3), timeout=90, RANK=0, WORLD_SIZE=2,
                  LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    assert proc.returncode == 1 and time.monotonic() - started < 45  # (start-up on a busy machine, and 3 s)
    assert "could not form the process group of 2 ranks at 127.0.0.1:" in proc.stderr
    assert "GLOO_SOCKET_IFNAME" in proc.stderr and "Traceback" not in proc.stderr
    # MASTER_PORT held by a program that takes connections and never answers: the store's
    # handshake has no timeout of its own; and a MASTER_ADDR that does not resolve
    with socket.create_server(("127.0.0.1", 0)) as silent:
        for addr, port, says in (("127.0.0.1", silent.getsockname()[1], "is another program listening"),
                                 ("no-such-host.invalid", free_port(), "Name or service not known")):
            started = time.monotonic()
            proc = python("train.py", *tiny_args(char_data, tmp_path, dist_timeout=2), timeout=90, RANK=1,
                          WORLD_SIZE=2, LOCAL_RANK=1, MASTER_ADDR=addr, MASTER_PORT=port)
            assert proc.returncode == 1 and time.monotonic() - started < 40, proc.stderr
            line, = proc.stderr.splitlines()
            assert line.startswith(f"error: rank 1 on {socket.gethostname()} could not form the process group "
                                   f"of 2 ranks at {addr}:{port}") and says in line, line


def _corrupt_first_all_reduce(rank, change=lambda tensor: tensor.add_(1000)):
    """Make rank 1's first all-reduce contribute garbage, like a broken link or driver would."""
    import torch.distributed as dist
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if rank == 1 and not getattr(all_reduce, "done", False):
            all_reduce.done = True
            change(tensor)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


def _drop_first_all_reduce(rank):
    """Rank 1's contribution lost (each rank left with its own value, the commoner failure): a sum too small."""
    _corrupt_first_all_reduce(rank, lambda tensor: tensor.zero_())


@pytest.mark.parametrize("patch, got", [(_corrupt_first_all_reduce, "1003.0"), (_drop_first_all_reduce, "1.0")])
def test_the_startup_all_reduce_catches_a_broken_fabric_before_training(char_data, tmp_path, patch, got):
    # its own RunError, not a lost peer's message
    with pytest.raises(Exception, match=f"RunError: the startup all-reduce over gloo gave {got}, not 3.0"):
        run_world(2, tiny_args(char_data, tmp_path / "out"), tmp_path / "results", patch=patch)
    assert not (tmp_path / "out" / "last.pt").exists()
