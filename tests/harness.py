"""Helpers that launch training the ways users do and watch what each rank writes."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch.multiprocessing as mp

from world import free_port  # noqa: F401  (the tests' port picker too)

REPO = Path(__file__).resolve().parent.parent


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


def run(cmd: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


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


def _rank_entry(rank: int, world_size: int, port: int, fn, args: tuple):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(rank, world_size, *args)


def run_ranks(fn, world_size: int, *args):
    """Call fn(rank, world_size, *args) in world_size spawned processes set up like torchrun's.

    fn must be a module-level function; it may call train.main or build its own process group.
    """
    mp.start_processes(_rank_entry, args=(world_size, free_port(), fn, args),
                       nprocs=world_size, start_method="spawn")


def _train_rank(rank: int, world_size: int, args: list, result_dir: Path, patch):
    import train
    from config import resolve
    if patch is not None:
        patch(rank)
    result = train.main(resolve(args))
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def run_world(world_size: int, args: list[str], result_dir: Path, patch=None) -> list[dict]:
    """train.main on world_size gloo processes; each rank's returned summary.

    `patch(rank)`, a module-level function, runs in each process before training: a test seam
    that lives outside train.py (e.g. to count DDP communication).
    """
    result_dir = Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    run_ranks(_train_rank, world_size, args, result_dir, patch)
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


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
