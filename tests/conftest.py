"""Shared fixtures: the repo on sys.path, one thread per process, a small char dataset and a run
trained on it, and scripts run in this process (tests/harness.py holds the helpers)."""

import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))  # (memory_guide, bench_loader, plot_runs)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long training or several processes (CI runs them)")
    config.addinivalue_line("markers", "multihost: two hosts as network namespaces joined by a veth "
                                       "pair (needs root and iproute2; skips without them)")
    config.addinivalue_line("markers", "slurm: runs srun on a local SLURM cluster "
                                       "(needs root, slurm-wlm and munge; skips without them)")
    config.addinivalue_line("filterwarnings", "ignore:torch.distributed is disabled")  # as sharded.py does
    # train.main gives its process a share of the host's cores (world.use_device: both of a 2-core machine for
    # one process). Here that process is pytest, shared by every later test, and two threads for a tiny model
    # on a busy machine make each op wait for the other: torch keeps one thread, also in a fixture shared by
    # several tests (the trained run took both cores for all later tests, when this patch was each test's)
    torch.set_num_threads(1)
    torch.set_num_threads = lambda n: None


@pytest.fixture(autouse=True)
def own_signal_handlers():
    """A stopped run's train.cli leaves Ctrl-C ignored as its process exits: here the process is pytest."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="session", autouse=True)
def child_tmpdir(tmp_path_factory):
    """Child processes' temporary files (torchrun leaves a torchelastic_* folder at every launch) go
    under pytest's temporary folder, which pytest prunes, not into /tmp for good. This process keeps
    the temporary folder it already has (slurm_cluster.py clears stale clusters there)."""
    tempfile.gettempdir()
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> Path:
    """A small, learnable character corpus prepared by the real prepare script."""
    from harness import make_char_dataset
    return make_char_dataset(tmp_path_factory.mktemp("char_data"))


@pytest.fixture(scope="session")
def trained(char_data, tmp_path_factory) -> Path:
    """A finished 10-step run (in this process): last.pt at step 10, previous.pt at step 5.
    Read it, or copy it before damaging anything."""
    import train
    from config import resolve
    from harness import tiny_args
    out = tmp_path_factory.mktemp("trained")
    train.main(resolve(tiny_args(char_data, out, max_iters=10, eval_interval=5)))
    return out


@pytest.fixture
def trained_copy(trained, tmp_path) -> Path:
    """tmp_path/out: a copy of the trained run, free to damage."""
    import shutil
    return Path(shutil.copytree(trained, tmp_path / "out"))


@pytest.fixture
def script(monkeypatch, capsys):
    """script("train.py", *args): the script's __main__ in this process (harness.run_main)."""
    from harness import run_main
    return lambda path, *args: run_main(path, args, monkeypatch, capsys)
