"""Two hosts for real: network namespaces joined by a veth pair, gloo over the link.

Host A (10.213.7.1) and host B (10.213.7.2) each run two ranks of a world of four (see
tests/netns.py). Every run is compared with the same config on one host (W=4, loopback):
the world is the same four ranks adding the same numbers in the same order, whichever host
each sits on, so the numbers agree within test_distributed's tolerances (in practice bit
for bit). Each host has its own out dir; only global rank 0, on host A, writes there.

What these hosts need that one host does not (and the README's "Multiple hosts" tells):
- GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME under NCCL) naming the interface that links the
  hosts. Without it gloo binds to the address the hostname resolves to, here 127.0.0.1 (as
  on Debian hosts that map their name to 127.0.1.1), and announces it to its peers: rank 0
  fails with "Connection refused, remote=[127.0.0.1]" and the ranks on the other host wait
  in connectFullMesh for ~76 s, whatever dist_timeout says. Host.env sets both variables.
  (Where the hostname resolves to the link's address, e.g. a per-namespace /etc/hosts via
  /etc/netns/NAME/hosts, gloo finds the interface by itself: tried, 4 ranks train.)
- The c10d rendezvous: `--rdzv-conf=is_host=1` on the host that serves the endpoint (torch
  decides it by comparing the endpoint with the addresses of the hostname, 127.0.0.1 here,
  so otherwise nobody hosts and both agents fail after read_timeout=60 s), and
  `--local-addr=<this host's address>`: rank 0's agent hands its workers MASTER_ADDR =
  local_addr, else socket.getfqdn() ("localhost" here), which the other host cannot reach.
  Nodes get their rank in the sorted order of (local_addr, pid), so host A (10.213.7.1) is
  node 0 and holds global rank 0.
- Bounded rendezvous: torchrun waits for a missing node 600 s by default; the static
  rendezvous honours `--rdzv-conf=timeout=S`, c10d `--rdzv-conf=join_timeout=S`.
"""

import itertools
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from harness import (REPO, STEPS, args_for, assert_close_runs, child_env, logged_step, metrics, train_log,
                     train_run)
from model import GPT, GPTConfig
from netns import multihost_possible, two_hosts  # noqa: F401  (fixtures)

# the module skips before its costly module fixtures where namespaces cannot be made
pytestmark = [pytest.mark.slow, pytest.mark.multihost, pytest.mark.usefixtures("multihost_possible")]

PORTS = itertools.count(29400)  # each namespace pair is new, so only reuse inside a test matters
RUN_TIMEOUT = 90.0              # a normal run here takes ~10 s; this only bounds a hang
TIMEOUT = 10                    # dist_timeout of a run that trains, then loses its network
WAIT = 5                        # dist_timeout / rendezvous timeout where a peer never comes
ERROR_BOUND = 40.0              # a failure must be reported within this many seconds


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    started: float
    ended: float = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Launcher:
    """Starts processes on the hosts, each logging to a file; none outlives the test."""
    hosts: object
    log_dir: Path
    procs: list = field(default_factory=list)

    def start(self, name: str, host, argv: list, env: dict) -> Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as f:
            popen = subprocess.Popen(host.cmd(*argv), cwd=REPO, env=env, stdout=f,
                                     stderr=subprocess.STDOUT)
        proc = Proc(name, popen, log, time.monotonic())
        self.procs.append(proc)
        return proc

    def finish(self, procs: list, timeout: float = RUN_TIMEOUT) -> list:
        """Wait for every process (polling, with a deadline); their exit statuses."""
        deadline = time.monotonic() + timeout
        while True:
            for p in procs:
                if p.ended is None and p.popen.poll() is not None:
                    p.ended = time.monotonic()
            if all(p.ended is not None for p in procs):
                return [p.popen.returncode for p in procs]
            if time.monotonic() > deadline:
                running = [p.name for p in procs if p.ended is None]
                self.close()
                pytest.fail(f"still running after {timeout:.0f} s: {running}\n" + tails(procs))
            time.sleep(0.05)

    def close(self):
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.kill()
            p.popen.wait()
        self.hosts.a.kill_all()  # torchrun's workers, orphaned when their agent was killed
        self.hosts.b.kill_all()


def tails(procs: list, chars: int = 3000) -> str:
    return "\n".join(f"--- {p.name} (status {p.popen.returncode}):\n{p.output()[-chars:]}"
                     for p in procs)


def assert_succeeded(procs: list, statuses: list):
    assert statuses == [0] * len(procs), tails(procs)


@pytest.fixture
def launch(two_hosts, tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    launcher = Launcher(two_hosts, log_dir)
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory) -> Path:
    """The out dir of the same STEPS on one host: 4 gloo processes over loopback."""
    out = tmp_path_factory.mktemp("multihost_reference") / "w4"
    train_run(4, char_data, out)
    return out


def files_under(folder: Path) -> list:
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def torchrun(hosts, node_rank: int, port: int, rdzv: str, args: list, **rdzv_conf) -> list:
    """The two-host torchrun command line for node `node_rank` (0 = host A)."""
    host = (hosts.a, hosts.b)[node_rank]
    if rdzv == "static":
        how = [f"--node_rank={node_rank}", f"--master_addr={hosts.a.addr}", f"--master_port={port}"]
    else:
        how = ["--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.a.addr}:{port}",
               f"--rdzv-id=gpttest{port}", f"--local-addr={host.addr}"]
        rdzv_conf = {"is_host": int(node_rank == 0), **rdzv_conf}
    if rdzv_conf:
        how.append("--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()))
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", *how,
            "train.py", *args]


def host_dirs(tmp_path: Path, data: Path) -> dict:
    """Each host's own data dir (a copy: no shared disk) and out dir."""
    dirs = {}
    for name in ("A", "B"):
        disk = tmp_path / f"host{name}"
        shutil.copytree(data, disk / "data")
        dirs[name] = (disk / "data", disk / "out")
    return dirs


def launch_two_hosts(launch, hosts, dirs: dict, rdzv="static", **kw) -> list:
    port = next(PORTS)
    procs = []
    for node, (name, host) in enumerate((("A", hosts.a), ("B", hosts.b))):
        data, out = dirs[name]
        procs.append(launch.start(f"torchrun-{name}-{port}", host,
                                  torchrun(hosts, node, port, rdzv, args_for(data, out, **kw)),
                                  host.env(child_env())))
    return procs


# --- 1, 2: a run over two hosts gives the numbers of a run on one ------------------------------

@pytest.mark.parametrize("rdzv, strategy", [("static", {}), ("c10d", {}),
                                            # HSDP: shards within each host, replicas across the two
                                            ("static", {"strategy": "fsdp", "fsdp_shard_size": 2})],
                         ids=["static", "c10d", "hsdp"])
def test_two_host_torchrun_matches_one_host(two_hosts, launch, char_data, reference, tmp_path, rdzv, strategy):
    dirs = host_dirs(tmp_path, char_data)
    procs = launch_two_hosts(launch, two_hosts, dirs, rdzv=rdzv, **strategy)
    assert_succeeded(procs, launch.finish(procs))
    a, b = (p.output() for p in procs)
    assert "rank 0 | local rank 0 | world size 4" in a and "rank 1 | local rank 1 | world size 4" in a
    assert "rank 2 | local rank 0 | world size 4" in b and "rank 3 | local rank 1 | world size 4" in b
    assert_close_runs(reference, dirs["A"][1])
    assert files_under(dirs["B"][1]) == []  # only global rank 0 (on host A) writes


def test_manual_ranks_across_hosts_match_one_host(two_hosts, launch, char_data, reference, tmp_path):
    dirs = host_dirs(tmp_path, char_data)
    port = next(PORTS)
    procs = []
    for rank in range(4):
        name, host = ("A", two_hosts.a) if rank < 2 else ("B", two_hosts.b)
        env = host.env(child_env(RANK=rank, WORLD_SIZE=4, LOCAL_RANK=rank % 2, LOCAL_WORLD_SIZE=2,
                                 MASTER_ADDR=two_hosts.a.addr, MASTER_PORT=port))
        argv = [sys.executable, "train.py", *args_for(*dirs[name])]
        procs.append(launch.start(f"rank{rank}", host, argv, env))
    assert_succeeded(procs, launch.finish(procs))
    for rank, p in enumerate(procs):
        assert f"rank {rank} | local rank {rank % 2} | world size 4" in p.output()
    assert_close_runs(reference, dirs["A"][1])
    assert files_under(dirs["B"][1]) == []


# --- 3: no shared file system ------------------------------------------------------------------

def test_data_missing_on_host_b_is_prepared_there(two_hosts, launch, char_data, reference, tmp_path):
    dirs = {}
    for name in ("A", "B"):  # each host holds the corpus text and an empty data dir
        disk = tmp_path / f"host{name}"
        disk.mkdir()
        shutil.copy(char_data.parent / "input_text.txt", disk / "corpus.txt")
        dirs[name] = (disk / "data", disk / "out")
    port = next(PORTS)
    procs = []
    for node, (name, host) in enumerate((("A", two_hosts.a), ("B", two_hosts.b))):
        data, out = dirs[name]
        args = args_for(data, out, prepare_input=str(data.parent / "corpus.txt"))
        procs.append(launch.start(f"torchrun-{name}", host,
                                  torchrun(two_hosts, node, port, "static", args), host.env(child_env())))
    assert_succeeded(procs, launch.finish(procs))
    for name in ("A", "B"):  # each host prepared its own copy, from its own corpus file
        data = dirs[name][0]
        assert {"meta.json", "train.bin", "val.bin"} <= set(files_under(data))
        source = json.loads((data / "meta.json").read_text())["source"]
        assert source["path"] == str(data.parent / "corpus.txt")
    assert train_log(dirs["A"][1]) == train_log(reference)  # the same tokens: the same run
    assert files_under(dirs["B"][1]) == []


def test_resume_needs_the_checkpoint_on_host_a_only(two_hosts, launch, char_data, reference, tmp_path):
    dirs = host_dirs(tmp_path, char_data)
    first = launch_two_hosts(launch, two_hosts, dirs, max_iters=STEPS // 2)
    assert_succeeded(first, launch.finish(first))
    assert torch.load(dirs["A"][1] / "last.pt", weights_only=True)["step"] == STEPS // 2
    assert files_under(dirs["B"][1]) == []  # host B has no last.pt: rank 0 sends it the state
    second = launch_two_hosts(launch, two_hosts, dirs, resume="auto")
    assert_succeeded(second, launch.finish(second))
    assert f"resuming from {dirs['A'][1] / 'last.pt'} at step {STEPS // 2}" in second[0].output()
    # Not bit-equal to the uninterrupted run, on one host either: DDP reorders its gradient
    # bucket after the first step of each process, so the resumed run's first step (5) reduces
    # in another layout, and gloo's ring all-reduce over 4 ranks then adds some elements in
    # another order (a few ulps; with 2 ranks a + b = b + a, hence the bit-exact test there).
    assert_close_runs(reference, dirs["A"][1])
    assert files_under(dirs["B"][1]) == []


# --- 4: a missing peer ends the run, it does not hang ------------------------------------------

def test_a_missing_host_fails_within_dist_timeout_with_advice(two_hosts, launch, char_data, tmp_path):
    port = next(PORTS)
    address = f"{two_hosts.a.addr}:{port}"
    procs = [launch.start(f"rank{rank}", two_hosts.a,
                          [sys.executable, "train.py", *args_for(char_data, tmp_path / "out",
                                                                 dist_timeout=WAIT)],
                          two_hosts.a.env(child_env(RANK=rank, WORLD_SIZE=4, LOCAL_RANK=rank,
                                                    LOCAL_WORLD_SIZE=2, MASTER_ADDR=two_hosts.a.addr,
                                                    MASTER_PORT=port)))
             for rank in range(2)]  # host B never starts ranks 2 and 3
    statuses = launch.finish(procs, timeout=ERROR_BOUND + 30)
    assert statuses == [1, 1], tails(procs)
    for p in procs:
        print(f"{p.name}: status {p.popen.returncode} after {p.ended - p.started:.1f} s")
        assert p.ended - p.started < ERROR_BOUND, f"{p.name} took {p.ended - p.started:.1f} s"
        output = p.output()
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, output
        assert "could not form the process group" in errors[0] and address in errors[0]
        assert re.search(r"\b4\b", errors[0]), errors[0]  # the world size
        assert "GLOO_SOCKET_IFNAME" in errors[0] and "NCCL_SOCKET_IFNAME" in errors[0]
        assert "Traceback" not in output, output


def test_torchrun_alone_is_bounded_by_its_rendezvous_timeout(two_hosts, launch, char_data, tmp_path):
    # torchrun waits 600 s for a missing node unless told otherwise; the bound is a rendezvous
    # option, not dist_timeout (no worker starts): static takes timeout=, c10d join_timeout=
    args = args_for(char_data, tmp_path / "out", dist_timeout=WAIT)
    static = torchrun(two_hosts, 0, next(PORTS), "static", args, timeout=WAIT)
    c10d = torchrun(two_hosts, 0, next(PORTS), "c10d", args, join_timeout=WAIT)
    env = two_hosts.a.env(child_env())
    procs = [launch.start("static", two_hosts.a, static, env),
             launch.start("c10d", two_hosts.a, c10d, env)]
    statuses = launch.finish(procs, timeout=ERROR_BOUND + 30)  # both wait at once
    assert all(s != 0 for s in statuses), tails(procs)
    for p in procs:
        print(f"torchrun {p.name}: status {p.popen.returncode} after {p.ended - p.started:.1f} s")
        assert p.ended - p.started < ERROR_BOUND, f"{p.name} took {p.ended - p.started:.1f} s"
        assert "| rank " not in p.output()  # no worker was started
    assert "waiting for clients. 1/2 clients joined" in procs[0].output(), tails(procs)
    assert "RendezvousTimeoutError" in procs[1].output(), tails(procs)


# --- 5: the network goes down mid-run ---------------------------------------------------------

CUT_STEPS, CUT_EVAL = 200, 20  # ~25 steps/s here: the cut comes ~2 s into a ~8 s run
CUT_BOUND = 60.0                # observed: every process ends ~13 s after the cut (dist_timeout=10)


def test_network_cut_fails_every_process_and_relaunch_resumes(two_hosts, launch, char_data, tmp_path):
    dirs = host_dirs(tmp_path, char_data)
    kw = dict(max_iters=CUT_STEPS, lr_decay_iters=CUT_STEPS, eval_interval=CUT_EVAL,
              dist_timeout=TIMEOUT)
    procs = launch_two_hosts(launch, two_hosts, dirs, **kw)
    out_a = dirs["A"][1]

    # a train log after step 2 x CUT_EVAL means rank 0 has written that step's checkpoint
    deadline = time.monotonic() + RUN_TIMEOUT
    while logged_step(out_a) <= 2 * CUT_EVAL:
        assert all(p.popen.poll() is None for p in procs), "a host stopped early\n" + tails(procs)
        assert time.monotonic() < deadline, "no checkpoint before the deadline\n" + tails(procs)
        time.sleep(0.05)
    two_hosts.link_down()
    cut = time.monotonic()
    statuses = launch.finish(procs, timeout=CUT_BOUND + 30)
    assert all(s != 0 for s in statuses), tails(procs)
    assert two_hosts.a.pids() == [] and two_hosts.b.pids() == []  # no worker is left behind
    ckpt = torch.load(out_a / "last.pt", weights_only=True)  # intact: written before the cut
    assert ckpt["step"] >= 2 * CUT_EVAL and ckpt["step"] % CUT_EVAL == 0
    for p in procs:
        print(f"{p.name}: status {p.popen.returncode}, {p.ended - cut:.1f} s after the cut")
        assert p.ended - cut < CUT_BOUND, f"{p.name} ended {p.ended - cut:.1f} s after the cut"
        errors = [line for line in p.output().splitlines() if line.startswith("error: ")]
        assert errors, p.output()[-3000:]  # at least one worker per host explains itself
        for line in errors:
            assert "collective" in line and "timed out or failed" in line, line
            assert int(re.search(r"step (\d+)", line).group(1)) >= ckpt["step"], line

    tokens_per_step = ckpt["config"]["global_batch_size"] * ckpt["config"]["block_size"]
    assert ckpt["world_size"] == 4 and ckpt["tokens_seen"] == ckpt["step"] * tokens_per_step
    evals = {r["step"]: r["val_loss"] for r in metrics(out_a) if "val_loss" in r}
    assert ckpt["val_loss"] == evals[ckpt["step"]]
    GPT(GPTConfig(**ckpt["model_args"])).load_state_dict(ckpt["model"])  # every weight, right shapes

    two_hosts.link_up()
    relaunch = launch_two_hosts(launch, two_hosts, dirs, resume="auto", **kw)
    assert_succeeded(relaunch, launch.finish(relaunch))
    assert f"at step {ckpt['step']}" in relaunch[0].output()
    assert metrics(out_a)[-1]["step"] == CUT_STEPS
    assert files_under(dirs["B"][1]) == []
