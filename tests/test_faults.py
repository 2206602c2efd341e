"""A user's bad day, done on purpose: kill -9 at any moment (inside a checkpoint write too),
Ctrl-C, the same command started twice, a corrupt token id deep in a file. Each case checks that
nothing was lost: last.pt stays readable, and a resume ends with the weights of a run that was
never disturbed. (Signals to torchrun: tests/test_recovery.py; a prompt longer than the context:
tests/test_sample.py.)"""

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness import (REPO, assert_same_weights, child_env, ckpt, make_char_dataset, no_temporaries, python, run,
                     start, started, tiny_args, torchrun, train_here, train_py, wait_for_line)

STEPS = 40


def args_for(data, out, **kw):
    # a checkpoint every 2 steps: a kill often lands inside a write
    return tiny_args(data, out, **{"max_iters": STEPS, "eval_interval": 2, "lr_decay_iters": STEPS,
                                   "resume": "auto", **kw})


@pytest.fixture(scope="module")
def uninterrupted(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    run(train_py(args_for(char_data, out, resume="never")))
    return ckpt(out)


# --- kill -9 ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_at_a_random_moment_then_resume(char_data, tmp_path, uninterrupted, seed):
    proc = start(train_py(args_for(char_data, tmp_path)))
    wait_for_line(proc, "step 1:")
    time.sleep(random.Random(seed).uniform(0, 0.6))  # the fault's moment, not a wait for an event
    proc.kill()
    proc.wait()
    if (tmp_path / "last.pt").exists():
        assert ckpt(tmp_path)["step"] <= STEPS  # readable whenever it exists
    run(train_py(args_for(char_data, tmp_path)))
    assert_same_weights(ckpt(tmp_path), uninterrupted)
    assert no_temporaries(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["open", "rename"])
def test_sigkill_inside_a_checkpoint_write_then_resume(char_data, tmp_path, uninterrupted, moment):
    faults = REPO / "tests" / "faults"
    proc = start(train_py(args_for(char_data, tmp_path)), FAULT_KILL_AT=moment,
                 FAULT_KILL_NTH=3, PYTHONPATH=f"{faults}:{REPO}")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, out
    assert ckpt(tmp_path)["step"] == 4  # the 3rd write (step 6) died; step 4's last.pt is whole
    resumed = run(train_py(args_for(char_data, tmp_path))).stdout
    if moment == "rename":  # the whole temporary file was left behind, until the next start
        assert "left by a run that was killed while writing" in resumed
    assert_same_weights(ckpt(tmp_path), uninterrupted)
    assert no_temporaries(tmp_path)


# --- Ctrl-C -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigint_stops_a_single_process_at_a_step_with_a_checkpoint(char_data, tmp_path, uninterrupted):
    proc = start(train_py(args_for(char_data, tmp_path)))
    wait_for_line(proc, "step 5:")
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "stopped by SIGINT at step" in out and "Traceback" not in out
    stopped = int(re.search(r"stopped by SIGINT at step (\d+)", out).group(1))
    assert 5 <= ckpt(tmp_path)["step"] == stopped < STEPS  # the step it stopped at was saved
    run(train_py(args_for(char_data, tmp_path)))
    assert_same_weights(ckpt(tmp_path), uninterrupted)


def test_a_stopped_or_finished_run_ignores_ctrl_c_as_it_exits(monkeypatch):
    """(A second Ctrl-C while Python exited, after the stop's save, printed an atexit callback's traceback.)"""
    import train
    monkeypatch.setattr(train, "main", lambda cfg: {"stopped": signal.SIGINT})
    with pytest.raises(SystemExit) as exit_info:
        train.cli([])  # (conftest restores pytest's own handler)
    assert exit_info.value.code == 130 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(train, "main", lambda cfg: {"stopped": 0})  # finished: the same
    assert train.cli([]) is None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


# --- two runs, one out_dir ----------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_run_into_a_busy_out_dir_stops_and_the_first_goes_on(char_data, tmp_path):
    args = args_for(char_data, tmp_path, max_iters=100_000, eval_interval=5, lr_decay_iters=100_000)
    with started(train_py(args)) as first:
        wait_for_line(first, "step 6:")  # last.pt exists
        second = python("train.py", *args, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        line, = second.stderr.strip().splitlines()
        assert f"out_dir {tmp_path} is in use by the run started" in line and f"pid {first.pid} " in line
        assert "another --out_dir" in line
        both = subprocess.run(torchrun(args), cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
        assert both.returncode != 0
        assert both.stderr.count(f"error: out_dir {tmp_path} is in use by the run started") == 2  # every rank
        # a reader needs no lock
        run([sys.executable, "sample.py", f"--out_dir={tmp_path}", "--num_samples=1", "--max_new_tokens=5"])
        assert first.poll() is None  # the first run never noticed
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=60)  # (read: a full pipe would block its step lines, and its stop)
        assert first.returncode == 128 + signal.SIGTERM, out
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == sorted(set(steps))  # one writer: no step twice


@pytest.mark.slow
def test_a_lock_left_by_a_killed_run_does_not_block(char_data, tmp_path):
    with started([sys.executable, "-c", "import sys, time, checkpoint, world\n"
                  f"with checkpoint.locked_out_dir({str(tmp_path)!r}, world.World()):\n"
                  "    print('held', flush=True); time.sleep(600)"]) as holder:
        wait_for_line(holder, "held")
        blocked = python("train.py", *args_for(char_data, tmp_path, max_iters=2), timeout=120)
        assert blocked.returncode == 2 and f"pid {holder.pid} " in blocked.stderr
    assert (tmp_path / "run.lock").exists()  # the file stays; the OS dropped the lock
    run(train_py(args_for(char_data, tmp_path, max_iters=2)))


# --- a corrupt token id past the sampled check ------------------------------------------------

@pytest.fixture(scope="module")
def big_data(tmp_path_factory):
    """~270k training tokens: the start-up check samples 16 windows of 4096 of them."""
    return make_char_dataset(tmp_path_factory.mktemp("big"), n_chars=300_000)


def unsampled_positions(count: int, n: int = 2) -> list:
    """Positions outside the windows data/dataset.py's check_token_files reads."""
    starts = np.unique(np.linspace(0, count - 4096, 16).astype(np.int64))
    gaps = [(a + 4096, b) for a, b in zip(starts, starts[1:]) if b > a + 4096]
    return [int((a + b) // 2) for a, b in gaps[len(gaps) // 2:len(gaps) // 2 + n]]


def corrupt(path: Path, positions: list, value: int = 999):
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    tokens[positions] = value
    tokens.flush()


def big_overrides(**kw):
    return {"batch_size": 32, "global_batch_size": 64, "max_iters": 400, "eval_interval": 1000, "resume": "auto", **kw}


def big_args(data, out, **kw):
    return tiny_args(data, out, **big_overrides(**kw))


@pytest.fixture(scope="module")
def big_run(big_data, tmp_path_factory):
    """10 good steps on big_data, saved: what a corrupt file later interrupts."""
    out = tmp_path_factory.mktemp("big_run") / "out"
    train_here(big_data, out, **big_overrides(max_iters=10, eval_interval=10))
    return out


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_bad_token_id_anywhere_in_train_ends_every_rank_with_one_line(big_data, big_run, tmp_path, script, nproc):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "val.bin", "meta.json"):
        (data / name).write_bytes((big_data / name).read_bytes())
    shutil.copytree(big_run, tmp_path / "out")
    saved = (tmp_path / "out" / "last.pt").read_bytes()
    positions = unsampled_positions((data / "train.bin").stat().st_size // 2)
    corrupt(data / "train.bin", positions)
    args = big_args(data, tmp_path / "out")  # one process runs in this one, two under torchrun
    proc = script("train.py", *args) if nproc == 1 else subprocess.run(
        torchrun(args), cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == nproc and len(set(errors)) == 1, proc.stderr  # every rank, the same line
    assert f"{data / 'train.bin'} holds token id 999 at token position" in errors[0]
    assert any(f"position {p:,}," in errors[0] for p in positions)
    assert "prepare the dataset again" in errors[0] and "[rank" not in proc.stderr  # no rank's traceback
    if nproc == 1:
        assert proc.returncode == 2 and proc.stderr.strip() == errors[0]
    assert (tmp_path / "out" / "last.pt").read_bytes() == saved  # nothing was saved after the bad batch
    # found where the bad window was read, in the first epoch, not by the end of the run's eval of train
    epoch = json.loads((data / "meta.json").read_text())["train_tokens"] // (64 * 16)
    assert max(map(int, re.findall(r"^step (\d+): loss", proc.stdout, re.M))) <= 10 + epoch + 10


def test_a_bad_token_id_in_val_is_found_at_the_first_eval(big_data, tmp_path, script):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes((big_data / "train.bin").read_bytes())
    (data / "val.bin").write_bytes((big_data / "train.bin").read_bytes())  # a val split the check samples
    meta = json.loads((big_data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "val_tokens": meta["train_tokens"]}))
    positions = unsampled_positions(meta["train_tokens"], 1)
    corrupt(data / "val.bin", positions)
    # 300 x 64 eval windows exceed the 16,900 windows val holds: the eval reads all of it
    proc = script("train.py", *big_args(data, tmp_path / "out", eval_iters=300))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: {data / 'val.bin'} holds token id 999 at token position {positions[0]:,}")
    assert not (tmp_path / "out" / "last.pt").exists()
