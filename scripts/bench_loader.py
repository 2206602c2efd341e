"""How the token loader scales with the dataset: start-up time, memory and batches per second.

    python scripts/bench_loader.py [--sizes=4e6,4e8,4e9] [--block_size=1024] [--batch_size=12]

For each size (bytes of uint16 tokens) it makes a dataset twice in a temporary folder, as one
train.bin and as 20 shards in llm.c's format, both sparse files (all zeros: no disk is written,
so page reads cost what memory-mapping costs, not what a disk costs). Each variant is measured
in a fresh process, three times (the median is shown): the seconds from nothing to the first batch (opening, the epoch's order),
its resident memory after 200 batches (its own, and the mapped file pages the kernel keeps in
the page cache and can drop), and batches per second of `--batch_size` windows.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from errors import ArgumentParser, ConfigError, RunError, reported  # noqa: E402


def make(folder: Path, n_tokens: int, shards: int) -> list:
    """Sparse token files: one headerless train.bin, or `shards` llm.c shards."""
    from data.dataset import HEADER_INTS, SHARD_FORMATS
    import numpy as np
    if shards == 1:
        path = folder / "train.bin"
        with open(path, "wb") as f:
            f.truncate(2 * n_tokens)
        return [(str(path), 0, n_tokens)]
    files, per = [], n_tokens // shards
    for i in range(shards):
        path = folder / f"bench_train_{i:06d}.bin"
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = *SHARD_FORMATS["uint16"], per
        with open(path, "wb") as f:
            f.write(header.tobytes())
            f.truncate(HEADER_INTS * 4 + 2 * per)
        files.append((str(path), HEADER_INTS * 4, per))
    return files


def measure(files: list, block_size: int, batch_size: int, batches: int = 200) -> dict:
    """In this (fresh) process: start-up to the first batch, peak RSS, batches per second."""
    start = time.perf_counter()
    from data.dataset import Shard
    from loader import ShardedTokenLoader, Tokens
    imported = time.perf_counter()
    tokens = Tokens([Shard(Path(p), "uint16", offset, n) for p, offset, n in files])
    loader = ShardedTokenLoader(tokens, block_size, batch_size, batch_size, 0, 1, seed=0)
    loader.set_epoch(0)
    loader.next_batch()
    first_batch = time.perf_counter()
    for _ in range(batches):
        if loader.epoch_done:  # the smallest dataset holds fewer batches than are timed
            loader.set_epoch(loader.epoch + 1)
        loader.next_batch()
    done = time.perf_counter()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {"startup_s": first_batch - imported, "import_s": imported - start,
            "anon_mb": int(status["RssAnon"].split()[0]) / 1024,  # this process's own memory
            "file_mb": int(status["RssFile"].split()[0]) / 1024,  # mapped file pages (page cache)
            "batches_per_s": batches / (done - first_batch), "windows": loader.n_windows}


def main():
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4e6,4e8,4e9", help="dataset sizes in bytes, comma-separated")
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=12)
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one measurement, in a child
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure), args.block_size, args.batch_size)))
        return
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    except (ValueError, OverflowError):  # OverflowError: inf
        raise ConfigError(f"--sizes={args.sizes}: give sizes in bytes, e.g. --sizes=4e6,4e8") from None
    if args.block_size < 1 or args.batch_size < 1:
        raise ConfigError("--block_size and --batch_size must be positive")
    smallest = 2 * 20 * 2 * args.block_size  # uint16: each of 20 shards holds a window at any offset (loader.py)
    if max(sizes) > 10**12:  # sparse files, but past a terabyte the file system or the window index gives out
        raise ConfigError(f"--sizes: {max(sizes):,} bytes is more than this benchmark makes (at most 1e12)")
    if min(sizes) < smallest:
        raise ConfigError(f"--sizes: {min(sizes):,} bytes is too small for block_size={args.block_size} "
                          f"(20 shards of a window each): give at least {smallest:,}")
    import torch
    from world import available_memory
    # int64 windows, x, y of a batch; the epoch's window order (int64, twice while it is drawn)
    need = 24 * args.batch_size * (args.block_size + 1) + 16 * max(args.batch_size, max(sizes) // 2 // args.block_size)
    if need > available_memory(torch.device("cpu")):  # (it once grew for minutes, then ran out)
        raise ConfigError(f"--batch_size={args.batch_size:,} x --block_size={args.block_size:,} on --sizes up to "
                          f"{max(sizes):,} bytes needs {need / 1e9:,.1f} GB, more than this host has available")
    print(f"| dataset | layout | windows | start-up to first batch | RSS: own memory | RSS: mapped file pages | "
          f"batches/s ({args.batch_size} x {args.block_size + 1} tokens) |\n|---|---|---|---|---|---|---|")
    for size in sizes:
        for shards in (1, 20):
            runs = []
            for _ in range(3):  # fresh files and a fresh process each time; the median is shown
                with tempfile.TemporaryDirectory() as tmp:
                    files = make(Path(tmp), size // 2, shards)
                    out = subprocess.run([sys.executable, __file__, f"--measure={json.dumps(files)}",
                                          f"--block_size={args.block_size}", f"--batch_size={args.batch_size}"],
                                         capture_output=True, text=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
                    if out.returncode:  # e.g. the window order of a huge dataset does not fit in memory
                        said = ([f"killed by {signal.Signals(-out.returncode).name} (out of memory? a full TMPDIR?)"]
                                if out.returncode < 0 else out.stderr.strip().splitlines() or [f"exit {out.returncode}"])
                        raise RunError(f"measuring {size:,} bytes in {shards} shard(s) failed: {said[-1]}")
                    runs.append(json.loads(out.stdout))
            r = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            layout = "one train.bin" if shards == 1 else f"{shards} shards"
            mb = f"{size / 1e6:,.{0 if size >= 1e6 else 2}f}"  # (a size under 1 MB was printed as 0 MB)
            print(f"| {mb} MB | {layout} | {r['windows']:,} | {r['startup_s'] * 1e3:,.1f} ms | "
                  f"{r['anon_mb']:,.0f} MB | {r['file_mb']:,.0f} MB | {r['batches_per_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    with reported():
        main()
