"""Two processes on gloo, started the ways users start them; only global rank 0 writes."""

import sys

import pytest

from harness import EXPECTED_FILES, audited_writes, child_env, metrics, run, run_manual_ranks, tiny_args, torchrun

pytestmark = pytest.mark.slow


def check_rank0_wrote_everything(out_dir, audit_dir, world_size=2):
    assert sorted(p.name for p in out_dir.iterdir()) == EXPECTED_FILES  # no temporary files left
    writes = audited_writes(audit_dir)
    assert writes, "the audit hook saw no writes: is it installed?"
    assert {rank for rank, _, _ in writes} == {"0"}, writes
    assert metrics(out_dir)[-1]["step"] == 10


@pytest.fixture
def launch(char_data, tmp_path):
    out_dir, audit_dir = tmp_path / "out", tmp_path / "audit"
    audit_dir.mkdir()
    args = tiny_args(char_data, out_dir, max_iters=10, eval_interval=5)
    return args, out_dir, audit_dir, child_env(audit_dir, watch=tmp_path)


def test_torchrun_standalone_two_processes(launch):
    args, out_dir, audit_dir, env = launch
    proc = run(torchrun(args), env)
    assert "world size 2" in proc.stdout
    check_rank0_wrote_everything(out_dir, audit_dir)


def test_train_spawn_two_processes(launch):
    args, out_dir, audit_dir, env = launch
    proc = run([sys.executable, "train_spawn.py", "--nproc=2", *args], env)
    assert proc.stdout.count("world size 2") == 2
    check_rank0_wrote_everything(out_dir, audit_dir)


def test_hand_set_environment_variables(launch):
    args, out_dir, audit_dir, env = launch
    outputs = run_manual_ranks(args, 2, env)
    assert "rank 1 | local rank 1 | world size 2" in outputs[1]
    check_rank0_wrote_everything(out_dir, audit_dir)


def test_legacy_torch_distributed_launch_passes_local_rank(launch):
    pytest.importorskip("torch.distributed.launch", reason="this torch no longer ships the launcher")
    args, out_dir, audit_dir, env = launch
    proc = run([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", "train.py", *args],
               env)
    assert "rank 1 | local rank 1 | world size 2" in proc.stdout
    check_rank0_wrote_everything(out_dir, audit_dir)
