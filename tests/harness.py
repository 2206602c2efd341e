"""The tests' one set of helpers: tiny configs and datasets, training launched the ways users
launch it (in this process, torchrun, spawned ranks, hand-set variables), a script's __main__ run
in this process, and what runs wrote (checkpoints, metrics, logs)."""

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from train_spawn import free_port  # noqa: F401  (the tests' port picker too)

REPO = Path(__file__).resolve().parent.parent
EXPECTED_FILES = ["best.pt", "config.json", "last.pt", "meta.json", "metrics.jsonl", "previous.pt", "run.lock"]
SEPARATOR = "---------------"  # between sample.py's samples

# Distributed comparisons (tests/test_distributed.py's docstring explains the tolerances)
LOG_RTOL, WEIGHT_ATOL = 1e-5, 1e-5
STEPS = 8


def make_char_dataset(folder: Path, n_chars: int = 60_000) -> Path:
    """Write a learnable text (short sentences from a small grammar) and prepare it."""
    from data.shakespeare_char.prepare import prepare
    rng = random.Random(0)
    who = ["the king", "a fool", "my lord", "the queen", "good sir"]
    verbs = ["speaks", "laughs", "sleeps", "fights", "sings"]
    how = ["softly", "at night", "in the hall", "for love", "again"]
    lines = []
    while sum(map(len, lines)) < n_chars:
        lines.append(f"{rng.choice(who)} {rng.choice(verbs)} {rng.choice(how)}.\n")
    text_file = folder / "input_text.txt"
    text_file.write_text("".join(lines))
    data_dir = folder / "data"
    prepare(out_dir=str(data_dir), input_path=str(text_file))
    return data_dir


def tiny_args(data_dir: Path, out_dir: Path, **overrides) -> list[str]:
    """Command-line overrides for a tiny float32 CPU run."""
    cfg = dict(data_dir=str(data_dir), out_dir=str(out_dir), dataset="shakespeare_char",
               n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0, batch_size=4,
               global_batch_size=8, max_iters=20, eval_interval=10, eval_iters=4, log_interval=1,
               learning_rate=3e-3, warmup_iters=2, device="cpu", dtype="float32", resume="never")
    cfg.update(overrides)
    return [f"--{k}={v}" for k, v in cfg.items()]


def args_for(data, out, **kw):
    """tiny_args for the distributed comparisons: STEPS steps of a bias-free model, global batch 16."""
    base = dict(bias=False, batch_size=4, global_batch_size=16, max_iters=STEPS, lr_decay_iters=STEPS,
                eval_interval=4, log_interval=1, dist_timeout=120)  # (a hang fails in minutes, not in 10)
    return tiny_args(data, out, **{**base, **kw})


def train_here(data_dir, out_dir, **overrides) -> dict:
    """train.main on a tiny_args config, in this process."""
    import train
    from config import resolve
    return train.main(resolve(tiny_args(data_dir, out_dir, **overrides)))


def train_run(world_size, data, out, patch=None, **kw) -> list[dict]:
    """One args_for run on world_size processes (in this process when it is 1)."""
    import train
    from config import resolve
    args = args_for(data, out, **kw)
    if world_size == 1:
        return [train.main(resolve(args))]
    return run_world(world_size, args, Path(str(out) + "-results"), patch)


def raising(error: BaseException):
    """A stand-in for any function: every call raises `error`."""
    def fail(*args, **kwargs):
        raise error
    return fail


def child_env(audit_dir: Path = None, watch: Path = None, **extra) -> dict:
    """Environment for a launched process: one thread, and optionally a write audit."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if audit_dir is not None:  # tests/audit/sitecustomize.py records the child's writes
        env.update(PYTHONPATH=f"{REPO / 'tests' / 'audit'}{os.pathsep}{REPO}",
                   AUDIT_WATCH=str(Path(watch).resolve()),
                   AUDIT_LOG=str(audit_dir / "writes"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def audited_writes(audit_dir: Path) -> list[tuple[str, str, str]]:
    """(rank, event, path) for every write-like call under the watched folder."""
    rows = []
    for log in sorted(audit_dir.glob("writes.*")):
        rows += [tuple(line.split("\t")) for line in log.read_text().splitlines()]
    return rows


def run(cmd: list[str], env: dict = None, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a command to success (in the repo unless cwd is given, with child_env() unless env is given)."""
    proc = subprocess.run(cmd, cwd=cwd, env=child_env() if env is None else env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def python(*args, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """`python ARGS` in the repo, whatever its exit status."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=child_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def train_py(args) -> list[str]:
    return [sys.executable, "train.py", *args]


def torchrun(args, nproc: int = 2, extra=()) -> list[str]:
    """The command line of `torchrun --standalone --nproc_per_node=N train.py ARGS`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra,
            "train.py", *args]


def start(cmd, **env) -> subprocess.Popen:
    """Start a command in the repo; its stdout and stderr come together, as text."""
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(**env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def flip_a_bit(path: Path, weight: str = "transformer.wte.weight"):
    """One bit flipped in the middle of a weight's bytes in a .pt: torch.load reads it silently, its CRC-32 not."""
    data, tensor = bytearray(path.read_bytes()), torch.load(path, weights_only=True)["model"][weight].numpy().tobytes()
    data[data.find(tensor) + len(tensor) // 2] ^= 1
    path.write_bytes(data)


@contextlib.contextmanager
def started(cmd, **env):
    """start(cmd), killed at the end if it still runs: a failed assertion leaves no run training through the suite."""
    proc = start(cmd, **env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def children(pid: int, named: str = "") -> list[int]:
    """The pids of pid's child processes (those whose command line holds `named`)."""
    found = subprocess.run(["pgrep", "-P", str(pid), *(["-f", named] if named else [])], capture_output=True, text=True)
    return [int(child) for child in found.stdout.split()]


def wait_for_line(proc, prefix: str) -> list:
    """Read the process's output until a line starts with prefix (what it printed so far)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"the run ended (status {proc.wait()}) before printing {prefix!r}:\n{''.join(lines)}")


def wait_for(predicate, proc=None, timeout=60.0, what="condition"):
    """Poll predicate() until true; fail if proc ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert proc is None or proc.poll() is None, f"the run ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


def logged_step(out_dir) -> int:
    """The last step in metrics.jsonl, -1 before there is one; a line still being written is skipped."""
    path = Path(out_dir) / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=-1)


def run_manual_ranks(args: list[str], world_size: int, env: dict, timeout: float = 300) -> list:
    """Start world_size train.py processes with hand-set RANK/WORLD_SIZE/... like old tutorials."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "RANK": str(r), "WORLD_SIZE": str(world_size),
                                   "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for r in range(world_size)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}\n{out}"
    return outputs


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def train_log(out) -> list:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(out) if "loss" in r]


def ckpt(out_dir, name: str = "last.pt") -> dict:
    """A checkpoint as the file format's dict (a .dcp folder read whole through DCP)."""
    import checkpoint
    return checkpoint.read(Path(out_dir) / name)


def without_log(out_dir, name: str = "last.pt"):
    """Make out_dir's checkpoint one written before checkpoints kept their log (metrics.jsonl's rows)."""
    state = ckpt(out_dir, name)
    del state["log"]
    torch.save(state, Path(out_dir) / name)


def assert_same_weights(a: dict, b: dict):
    """Two checkpoints at the same step with bit-identical weights."""
    assert a["step"] == b["step"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def max_diff(a: dict, b: dict) -> float:
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


def assert_close_runs(a, b):
    """Two out dirs within the world-size tolerances: logged losses and grad norms, then weights."""
    la, lb = train_log(a), train_log(b)
    assert [r[0] for r in la] == [r[0] for r in lb]
    torch.testing.assert_close(torch.tensor([r[1:] for r in la]), torch.tensor([r[1:] for r in lb]),
                               rtol=LOG_RTOL, atol=0)
    wa, wb = ckpt(a)["model"], ckpt(b)["model"]
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=WEIGHT_ATOL,
                                   msg=lambda m: f"{name}: {m}")


def no_temporaries(out_dir) -> bool:
    return not [p.name for p in Path(out_dir).iterdir() if p.name.endswith(".tmp")]


def _rank_entry(rank: int, world_size: int, port: int, env: dict, fn, args: tuple):
    os.environ.clear()  # the test's environment now, not the fork server's at its start
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(rank, world_size, *args)


# Ranks are forked from a server that imported torch once, rather than spawned afresh: each
# would otherwise spend a second or two importing torch (and pytest), most of a tiny run.
# Only imports happen in the server (no thread pool starts), so forking it is safe.
mp.set_forkserver_preload(["torch", "torch.distributed", "numpy", "pytest", "train"])


def run_ranks(fn, world_size: int, *args, timeout: float = 600):
    """Call fn(rank, world_size, *args) in world_size new processes set up like torchrun's.

    fn must be a module-level function; it may call train.main or build its own process group.
    Ranks still running after `timeout` seconds are killed and the test fails (not the whole suite).
    """
    ranks = mp.start_processes(_rank_entry, args=(world_size, free_port(), dict(os.environ), fn, args),
                               nprocs=world_size, start_method="forkserver", join=False)
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            raise AssertionError(f"{world_size} ranks still running after {timeout} s: a hang")


def _saying(rank: int, world_size: int, fn, out: str, in_group: bool, args: tuple):
    from errors import ConfigError
    try:
        if in_group:  # fn(rank, world, ...) inside a gloo group of its own
            from collectives import process_group
            from world import place
            world = place("cpu", "float32", "gloo")
            with process_group(world, 60):
                said = fn(rank, world, *args)
        else:
            said = fn(rank, world_size, *args)
    except ConfigError as e:
        said = str(e)
    (Path(out) / f"rank{rank}.txt").write_text(said)


def ranks_say(fn, world_size: int, out, *args, in_group: bool = False) -> list[str]:
    """run_ranks(fn): what each rank ended with, fn's return value or the ConfigError it raised (the one
    line it would print), also in out/rankN.txt. in_group: fn(rank, world, *args) inside a process group."""
    run_ranks(_saying, world_size, fn, str(out), in_group, args)
    return [(Path(out) / f"rank{r}.txt").read_text() for r in range(world_size)]


def _train_rank(rank: int, world_size: int, args: list, result_dir: Path, patch):
    import train
    from config import resolve
    if patch is not None:
        patch(rank)
    with open(Path(result_dir) / f"rank{rank}.log", "w") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        result = train.main(resolve(args))
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps({**result, "threads": thread_names()}))


def thread_names() -> list[str]:
    """This process's threads as the OS names them (Linux; gloo's workers are named pt_gloo_runloop)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append(comm.read_text().strip())
    return names


def run_world(world_size: int, args: list[str], result_dir: Path, patch=None) -> list[dict]:
    """train.main on world_size gloo processes; each rank's returned summary (what it printed,
    warnings included, is in result_dir/rankN.log).

    `patch(rank)`, a module-level function, runs in each process before training: a test seam
    that lives outside train.py (e.g. to count DDP communication).
    """
    result_dir = Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    run_ranks(_train_rank, world_size, args, result_dir, patch)
    results = [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    for rank, result in enumerate(results):  # gloo's threads end with the group, else one can abort the exit
        assert not [t for t in result.pop("threads") if "gloo" in t], f"rank {rank} kept gloo's threads"
    return results


def shard_dataset(source: Path, folder: Path, parts=(0.5, 0.3, 0.2)) -> Path:
    """The train split of a prepared dataset cut into llm.c shards of these fractions (val kept
    as one shard), with a meta.json that lists them: a small multi-shard dataset."""
    import numpy as np
    from data.dataset import write_shard
    meta = json.loads((Path(source) / "meta.json").read_text())
    folder.mkdir(parents=True)
    splits = {}
    for split, fractions in (("train", parts), ("val", (1.0,))):
        tokens = np.fromfile(Path(source) / f"{split}.bin", dtype=meta["dtype"])
        cuts = [0, *np.cumsum([round(f * len(tokens)) for f in fractions[:-1]]), len(tokens)]
        splits[split] = []
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            name = f"chars_{split}_{i:06d}.bin"
            splits[split].append({"file": name, "tokens": int(b - a), "sha256": write_shard(folder / name, tokens[a:b])})
    (folder / "meta.json").write_text(json.dumps({**meta, "shards": splits}))
    return folder


def record_epochs(rank):
    """A run_world patch: log every set_epoch call and every micro-batch's window starts to
    $EPOCH_LOG.rank."""
    import loader as loader_module
    log = Path(os.environ["EPOCH_LOG"] + f".{rank}")
    original_set_epoch = loader_module.ShardedTokenLoader.set_epoch
    original_rank_starts = loader_module.ShardedTokenLoader.rank_starts

    def set_epoch(self, epoch):
        with open(log, "a") as f:
            f.write(json.dumps({"set_epoch": epoch}) + "\n")
        original_set_epoch(self, epoch)

    def rank_starts(self):
        starts = original_rank_starts(self)
        with open(log, "a") as f:
            f.write(json.dumps({"epoch": self.epoch, "starts": starts.tolist()}) + "\n")
        return starts

    loader_module.ShardedTokenLoader.set_epoch = set_epoch
    loader_module.ShardedTokenLoader.rank_starts = rank_starts


def read_epochs(log_prefix, world_size: int = 2):
    """What record_epochs logged: the (rank, epoch) set_epoch calls, and each epoch's window starts."""
    per_epoch, calls = {}, []
    for rank in range(world_size):
        for line in Path(f"{log_prefix}.{rank}").read_text().splitlines():
            event = json.loads(line)
            if "set_epoch" in event:
                calls.append((rank, event["set_epoch"]))
            else:
                per_epoch.setdefault(event["epoch"], []).extend(event["starts"])
    return calls, per_epoch


class Ran:
    """What a script run in this process did, read like subprocess.CompletedProcess."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_main(script: str, args, monkeypatch, capsys) -> Ran:
    """`python SCRIPT ARGS` without a new interpreter: the script's own __main__ block runs in this
    process (runpy), with sys.argv set; its exit status, stdout and stderr."""
    import runpy
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    capsys.readouterr()
    environ = dict(os.environ)
    try:
        runpy.run_path(str(REPO / script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:  # what the script set (train_spawn.py's MASTER_PORT) leaks into no later test
        os.environ.clear()
        os.environ.update(environ)
    out, err = capsys.readouterr()
    return Ran(code, out, err)


@contextlib.contextmanager
def mounted(folder: Path, *args: str):
    """`mount ARGS folder` while the block runs (root only): a small disk, one folder at two paths (--bind)."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *args, str(folder)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def small_disk(folder: Path, size: str):
    """A real tmpfs of `size` at folder (root only)."""
    return mounted(folder, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")
