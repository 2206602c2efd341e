"""Runs that are stopped, crash, or cannot find their peers: they end cleanly and resume exactly."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import REPO, child_env, free_port, metrics, run, tiny_args

STEPS = 120


def last_step(out_dir) -> int:
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return -1
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    return max((r["step"] for r in lines), default=-1)


def wait_for(predicate, proc, timeout=60.0, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def torchrun(args, extra=(), **popen):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            *extra, "train.py", *args]


@pytest.fixture(scope="module")
def uninterrupted(char_data, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    run(torchrun(tiny_args(char_data, out_dir, max_iters=STEPS, eval_interval=20)), child_env())
    return torch.load(out_dir / "last.pt", weights_only=True)


def assert_same_weights(a, b):
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def test_sigterm_to_torchrun_stops_every_rank_at_a_step_and_resume_matches(char_data, tmp_path,
                                                                            uninterrupted):
    args = tiny_args(char_data, tmp_path, max_iters=STEPS, eval_interval=20, resume="auto")
    proc = subprocess.Popen(torchrun(args), cwd=REPO, env=child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: last_step(tmp_path) >= 25, proc, what="step 25")
    signalled_at = last_step(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out  # the launcher reports the preemption
    stopped = torch.load(tmp_path / "last.pt", weights_only=True)
    assert signalled_at <= stopped["step"] < STEPS, out  # the next step boundary, not the last eval
    assert "stopped by SIGTERM at step" in out
    run(torchrun(args), child_env())
    final = torch.load(tmp_path / "last.pt", weights_only=True)
    assert final["step"] == STEPS
    assert_same_weights(final, uninterrupted)


def test_killed_worker_is_restarted_by_torchrun_and_resumes_exactly(char_data, tmp_path,
                                                                     uninterrupted):
    args = tiny_args(char_data, tmp_path, max_iters=STEPS, eval_interval=20, resume="auto")
    proc = subprocess.Popen(torchrun(args, ["--max-restarts=1"]), cwd=REPO, env=child_env(),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: (tmp_path / "last.pt").exists() and last_step(tmp_path) >= 25, proc,
             what="a checkpoint")
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    subprocess.run(["kill", "-9", workers[1]], check=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "resuming from" in out
    final = torch.load(tmp_path / "last.pt", weights_only=True)
    assert final["step"] == STEPS
    assert_same_weights(final, uninterrupted)


def test_a_missing_peer_fails_within_dist_timeout_with_advice(char_data, tmp_path):
    # rank 0 of 2, and rank 1 never comes: no hang, one clear message, exit status 1
    env = child_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    started = time.time()
    proc = subprocess.run([sys.executable, "train.py", *tiny_args(char_data, tmp_path, dist_timeout=3)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and time.time() - started < 30
    assert "could not form the process group of 2 ranks at 127.0.0.1:" in proc.stderr
    assert "GLOO_SOCKET_IFNAME" in proc.stderr and "Traceback" not in proc.stderr


def _corrupt_first_all_reduce(rank):
    """Make rank 1's first all-reduce contribute garbage, like a broken link or driver would."""
    import torch.distributed as dist
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if rank == 1 and not getattr(all_reduce, "done", False):
            all_reduce.done = True
            tensor += 1000
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce


def test_the_startup_all_reduce_catches_a_broken_fabric_before_training(char_data, tmp_path):
    from harness import run_world
    with pytest.raises(Exception, match="startup all-reduce over gloo gave 1003.0, not 3.0"):
        run_world(2, tiny_args(char_data, tmp_path / "out"), tmp_path / "results",
                  patch=_corrupt_first_all_reduce)
    assert not (tmp_path / "out" / "last.pt").exists()
