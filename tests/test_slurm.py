"""SLURM: srun's variables become ranks, for real on a one-host cluster and as unit tests."""

import os
import re
import subprocess
import sys

import pytest

from errors import ConfigError
from world import World, find_world, slurm_first_host
from harness import EXPECTED_FILES, REPO, child_env, ckpt, metrics, tiny_args, wait_for
from slurm_cluster import SlurmCluster, missing


@pytest.fixture(scope="module")
def slurm():
    """munged + slurmctld + slurmd on this host, in a temp folder; stopped after the module."""
    if reason := missing():
        pytest.skip(f"no local SLURM cluster: {reason}")
    with SlurmCluster() as cluster:
        yield cluster


@pytest.mark.slow
@pytest.mark.slurm
def test_srun_two_tasks_train_as_two_ranks(slurm, char_data, tmp_path):
    out_dir = tmp_path / "out"
    # No RANK, WORLD_SIZE or MASTER_*: train.py must find its place from SLURM_* alone.
    env = slurm.env(child_env())
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} & env.keys()
    cmd = ["srun", "-n", "2", "--cpus-per-task=1", "--label", "--kill-on-bad-exit=1",
           "--job-name=gpt-train-test", sys.executable, "train.py",
           *tiny_args(char_data, out_dir, max_iters=10, eval_interval=5)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"srun exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    for task in (0, 1):  # --label prefixes each line with the SLURM task id
        assert re.search(rf"^{task}: .*\| rank {task} \| local rank {task} \| world size 2 \|",
                         proc.stdout, re.M), proc.stdout
    assert metrics(out_dir)[-1]["step"] == 10
    assert sorted(p.name for p in out_dir.iterdir()) == EXPECTED_FILES


def job_end(slurm, job: str) -> str:
    """Wait for a job to end and return its state (sbatch --wait polls every few seconds)."""
    def state():
        line = slurm.run("scontrol", "-o", "show", "job", job).stdout
        found = re.search(r"JobState=(\S+)", line).group(1)
        return found if found not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") else None
    return wait_for(state, what=f"job {job} to end")


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_script_stops_on_sigterm_and_resumes(slurm, char_data, tmp_path):
    """scripts/sbatch_two_nodes.sh on one node: srun + torchrun with 2 CPU processes. SIGTERM to
    the job's steps (what --signal=TERM@120 sends) stops every rank with last.pt saved; the
    same script submitted again continues from it."""
    out_dir, log = tmp_path / "out", tmp_path / "job.out"
    # torchrun from the same environment as this Python; 2 CPU processes instead of 8 GPUs
    env = slurm.env(child_env(NPROC_PER_NODE=2))
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    args = tiny_args(char_data, out_dir, max_iters=100_000, eval_interval=100_000,
                     log_interval=100_000, resume="auto")

    def sbatch():
        return subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0",
                               "--cpus-per-task=2", f"--output={log}", "scripts/sbatch_two_nodes.sh",
                               *args], cwd=REPO, env=env, capture_output=True, text=True, check=True)

    job = sbatch().stdout.strip()
    wait_for(lambda: log.exists() and "step 0: train loss" in log.read_text(), what="training to start")
    slurm.run("scancel", "--signal=TERM", job)
    job_end(slurm, job)
    text = log.read_text()
    assert text.count("world size 2") == 2 and "stopped by SIGTERM" in text, text
    stopped = ckpt(out_dir)["step"]

    args[args.index("--max_iters=100000")] = f"--max_iters={stopped + 2}"
    state = job_end(slurm, sbatch().stdout.strip())
    text = log.read_text()
    assert state == "COMPLETED", text
    assert f"resuming from {out_dir / 'last.pt'} at step {stopped}" in text, text
    assert metrics(out_dir)[-1]["step"] == stopped + 2


# Each expected host is what `scontrol show hostnames LIST | head -1` prints (slurm 22.05).
@pytest.mark.parametrize("nodelist, first", [
    ("node[01-03,07],gpu1", "node01"),
    ("gpu7", "gpu7"),
    ("a-b[9]", "a-b9"),
    ("n[001-002]", "n001"),
    ("node[07,01-03]", "node07"),        # the order given, not sorted
    ("a1,b[2-3]", "a1"),
    ("gpu-[10-11]", "gpu-10"),
    ("rack[2-3]-n[1-4],x", "rack2-n1"),  # one range per dimension
])
def test_slurm_first_host_is_the_first_of_the_expanded_list(nodelist, first):
    assert slurm_first_host(nodelist) == first


# What `srun -n 2` sets for task 1 on the test cluster (slurm 22.05), less what train.py ignores.
SRUN_TASK_1_OF_2 = dict(
    SLURM_JOB_ID="7", SLURM_JOB_NODELIST="vm", SLURM_STEP_NODELIST="vm", SLURM_STEP_ID="0",
    SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_TASKS_PER_NODE="2",
    SLURM_STEP_TASKS_PER_NODE="2", SLURM_NODEID="0", SLURM_PROCID="1", SLURM_LOCALID="1")
TWO_NODES_4_EACH = dict(  # srun -N 2 --ntasks-per-node=4, task 5 (second node, second task)
    SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu[03-04]", SLURM_STEP_NODELIST="gpu[03-04]",
    SLURM_STEP_ID="0", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="8", SLURM_NTASKS_PER_NODE="4",
    SLURM_TASKS_PER_NODE="4(x2)", SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_NODEID="1",
    SLURM_PROCID="5", SLURM_LOCALID="1")


@pytest.mark.parametrize("env, world, master", [
    (SRUN_TASK_1_OF_2, World(1, 1, 2, 2), ("vm", "29507")),
    (TWO_NODES_4_EACH, World(5, 1, 8, 4), ("gpu03", "30742")),
    # srun -n 8 without --ntasks-per-node sets no SLURM_NTASKS_PER_NODE, only the "(xN)" form
    ({**TWO_NODES_4_EACH, "SLURM_NTASKS_PER_NODE": None}, World(5, 1, 8, 4), ("gpu03", "30742")),
    # 7 tasks on 3 nodes as 3,2,2: the last task is the second of the third node
    ({**TWO_NODES_4_EACH, "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_STEP_NODELIST": "n[1-3]",
      "SLURM_NTASKS": "7", "SLURM_STEP_NUM_TASKS": "7", "SLURM_NTASKS_PER_NODE": None,
      "SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)",
      "SLURM_NODEID": "2", "SLURM_PROCID": "6"}, World(6, 1, 7, 2), ("n1", "30742")),
    # a step on the second node of a two-node job: rank 0 lives on the step's first node
    ({**SRUN_TASK_1_OF_2, "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_STEP_NODELIST": "gpu04"},
     World(1, 1, 2, 2), ("gpu04", "29507")),
    # a second step of the job running beside the first: another port (steps 0 and 10 once shared one)
    ({**SRUN_TASK_1_OF_2, "SLURM_STEP_ID": "1"}, World(1, 1, 2, 2), ("vm", "30516")),
    ({**SRUN_TASK_1_OF_2, "SLURM_STEP_ID": "10"}, World(1, 1, 2, 2), ("vm", "30597")),
    # an address set by hand wins over the node list
    ({**SRUN_TASK_1_OF_2, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"},
     World(1, 1, 2, 2), ("10.0.0.1", "1234")),
    # torchrun inside srun (one task per node): torchrun's variables win
    ({**SRUN_TASK_1_OF_2, "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
      "MASTER_ADDR": "gpu03", "MASTER_PORT": "29500"}, World(3, 1, 8, 4), ("gpu03", "29500")),
    # `python train.py` in an sbatch -n 2 script: SLURM_PROCID=0 and SLURM_NTASKS=2 are set
    # there too, but no step was launched, so this is one process, not rank 0 waiting for rank 1
    ({k: v for k, v in SRUN_TASK_1_OF_2.items() if "STEP" not in k} | {"SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, World(), (None, None)),
    # a one-task step that keeps the job's SLURM_NTASKS (srun --preserve-env, salloc's shell): one process
    # (it was rank 0 of 2, waiting out dist_timeout for a peer)
    ({**SRUN_TASK_1_OF_2, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, World(), (None, None)),
], ids=["srun-one-host", "two-nodes", "two-nodes-no-ntasks-per-node", "uneven-nodes",
        "step-on-second-node", "second-step", "eleventh-step", "master-set-by-hand", "torchrun-in-srun",
        "sbatch-script-itself", "one-task-step-of-a-larger-job"])
def test_find_world_maps_slurm_variables(monkeypatch, env, world, master):
    fake = private_env(monkeypatch, env)
    assert find_world() == world
    assert (fake.get("MASTER_ADDR"), fake.get("MASTER_PORT")) == master


def private_env(monkeypatch, env: dict) -> dict:
    """A private environment: find_world may fill in MASTER_ADDR/PORT, and that must not leak."""
    fake = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                        "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    fake.update({k: v for k, v in env.items() if v is not None})
    monkeypatch.setattr(os, "environ", fake)
    return fake


@pytest.mark.parametrize("env, message", [
    ({**TWO_NODES_4_EACH, "SLURM_STEP_TASKS_PER_NODE": "abc"}, "SLURM_STEP_TASKS_PER_NODE='abc'): launch with srun"),
    ({**TWO_NODES_4_EACH, "SLURM_STEP_TASKS_PER_NODE": "4(x2)junk"}, "SLURM_STEP_TASKS_PER_NODE='4(x2)junk')"),
    ({**TWO_NODES_4_EACH, "SLURM_NODEID": "2"}, "SLURM_NODEID=2, SLURM_STEP_TASKS_PER_NODE='4(x2)'"),
    ({**TWO_NODES_4_EACH, "SLURM_PROCID": None}, "(SLURM_PROCID=None,"),
    ({**TWO_NODES_4_EACH, "SLURM_JOB_ID": "abc"}, "got {'SLURM_JOB_ID': 'abc'}"),
    ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not: set both"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
])
def test_bad_rank_variables_are_one_line_not_a_traceback_or_one_process(monkeypatch, env, message):
    private_env(monkeypatch, env)
    with pytest.raises(ConfigError, match=re.escape(message)):
        find_world()
