"""Measure training speed: throughput, step time, communication, memory, MFU and scaling.

    python bench.py                                        # the default config's shape on 1 and 2 processes
    python bench.py --nproc=1,2,4 --batch_size=8 --steps=20 --report=bench/cpu
    python bench.py configs/gpt_small.py --nproc=1 --steps=30 --warmup=10 --report=bench/h100
    python bench.py configs/gpt_small.py --nproc=1 --profile  # also: where a step's time goes

Arguments are train.py's (a config file, --name=value overrides) plus --nproc=N[,N...], --strategies=ddp,fsdp
(default: the config's strategy), --steps, --warmup, --report=DIR and --profile. Each combination of strategy
and process count is a real run, afresh (resume=never, no HellaSwag): torchrun starts `bench.py --worker`, which
builds it with train.py's build_run and times its optimizer step after untimed warm-up steps (compilation
included). On one process fsdp has nothing to shard and runs as ddp: its row repeats ddp's when ddp comes first.

Synthetic data by default (uniform random GPT-2 token ids, whatever a config file's dataset); --dataset=NAME or
--data_dir=DIR reads real data. Under another launcher (several hosts, SLURM), run the worker with it: `torchrun
... bench.py --worker --result=FILE ...`; rank 0 writes the run's figures to FILE (docs/performance.md).
"""

import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from collectives import agree_or_raise, any_rank, differs_from_rank0, process_group
from config import CHOICES, PER_HOST, REPO, Config, resolve
from data.dataset import GPT2_META, GPT2_VOCAB_SIZE as GPT2_VOCAB, write_dataset
from data.files import DISK_FULL, atomic_write_bytes, not_a_folder, write_together
from errors import TORCHRUN, ConfigError, RunError, reported, signals_unwind, wait_passing_signals, write_failure
from loader import Dataset
from logger import mfu_of
from model import GPTConfig
from parallel import memory_problem
import pretrained
from train import build_run, optimizer_step
from world import World, setup


# -----------------------------------------------------------------------------
# one measured run (every rank runs this)

def synthetic_data(cfg, world: World, folder: Path, n_train: int) -> Path:
    """Uniform random GPT-2 token ids, written once per host by its local rank 0."""
    folder = folder / f"synthetic-{n_train}"
    if world.local_rank == 0 and not (folder / "meta.json").exists():
        rng = np.random.default_rng(0)
        write_dataset(folder, rng.integers(0, GPT2_VOCAB, n_train), rng.integers(0, GPT2_VOCAB, 4 * cfg.block_size),
                      {**GPT2_META, "source": {"name": "synthetic: uniform random token ids"}})
    any_rank(False, world)  # a barrier: the data exists before any rank reads it
    return folder


def timed_steps(run, n: int, device, sync: bool = True) -> list:
    """Seconds per optimizer step, each ended by a device synchronisation."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        optimizer_step(run, sync)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def by_rank(values: list, world: World) -> list:
    """Every rank's `values`, one row per rank."""
    t = torch.zeros(world.size, len(values), dtype=torch.float64)
    t[world.rank] = torch.tensor(values, dtype=torch.float64)
    if world.size > 1:
        dist.all_reduce(t, group=world.group)
    return t.tolist()


def slowest_rank(times: list, world: World) -> list:
    """Per step, the slowest rank's time: a step is done when every rank is."""
    return [max(step) for step in zip(*by_rank(times, world))]


def state_bytes(run) -> dict:
    """Bytes of model state this rank holds: parameters, their gradients, optimizer moments."""
    size = lambda t: (u := t.to_local() if hasattr(t, "to_local") else t).numel() * u.element_size()  # (a shard)
    params = sum(size(p) for p in run.raw_model.parameters())
    optimizer = sum(size(v) for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return {"parameters": params, "gradients": params, "optimizer": optimizer}


def profile_steps(run, device, out: Path, name: str, write: bool, steps: int = 3):
    """A table of the ops and kernels of a few steps, by device time, and totals by kind. Every
    rank runs the steps (they communicate); the one that writes is rank 0."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_steps(run, steps, device)
    if not write:
        return
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
    kinds = {}
    for event in prof.key_averages():
        if device.type == "cuda" and event.device_type != DeviceType.CUDA:
            continue  # on a GPU, count the kernels themselves (an op's time is its kernels')
        time_us = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        kind = next((k for k, words in KERNEL_KINDS if any(w in event.key.lower() for w in words)), "other")
        kinds[kind] = kinds.get(kind, 0) + time_us
    summary = "\n".join(f"{k:>14}: {v / 1e3 / steps:9.2f} ms/step  {v / (sum(kinds.values()) or 1):6.1%}"
                        for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    text = f"{table}\n\ndevice time by kind, per optimizer step:\n{summary}\n"
    print(text, end="", flush=True)
    try:  # (worker mode's --report is made here)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{name}.txt").write_text(text)
    except OSError as e:  # the run's figures are measured: keep them
        print(f"warning: could not write {out}/profile-{name}.txt ({write_failure(e)}): it is above", file=sys.stderr)


# Kernel and op names by kind, for the profile summary (the first match wins).
KERNEL_KINDS = [
    ("memcpy/fill", ("copy_in", "copy_out")),  # FSDP's copies into and out of its all-gather (named after it)
    ("communication", ("nccl", "gloo", "c10d", "all_reduce", "all_gather", "reduce_scatter", "backward_reduce")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "linear")),
    ("loss", ("cross_entropy", "log_softmax", "nll")),
    ("fused (triton)", ("triton",)),
    ("memcpy/fill", ("memcpy", "memset", "fill", "copy")),
]

FIXED = ["--resume=never", "--hellaswag_interval=0"]  # every measured run starts afresh and evaluates nothing
AS_DDP = ["--fsdp_reshard=True", "--fsdp_shard_size=0"]  # a ddp run's: FSDP's own settings are the fsdp runs


def worker(cfg_args: list, steps: int, warmup: int, result: Path, synthetic_dir, profile_dir):
    cfg = resolve(cfg_args + FIXED + [f"--out_dir={tempfile.gettempdir()}/gpt-train-bench-out"])
    world = setup(cfg)
    device, accum, gpu = world.device, world.accum, world.device.type == "cuda"
    with process_group(world, cfg.dist_timeout):  # each rank's settings rank 0's (else a C++ abort, or its shape)
        agree_or_raise(differs_from_rank0({**cfg.to_dict(), "steps": steps, "warmup": warmup, "synthetic": bool(
            synthetic_dir), "profile": bool(profile_dir)}, world, PER_HOST), world)
        if synthetic_dir:
            # at most 2^27 tokens: then the loader's epochs roll over (or repeat the data within a step)
            n_train = min((warmup + 2 * steps + 2) * cfg.tokens_per_step, 2**27) + cfg.block_size
            cfg.data_dir = str(synthetic_data(cfg, world, Path(synthetic_dir), n_train))
        meta = Dataset(cfg).ready(world)
        run = build_run(cfg, world, meta)
        timed_steps(run, warmup, device)
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        times = slowest_rank(timed_steps(run, steps, device), world)
        peak = (torch.cuda.max_memory_allocated(device) if gpu
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
        # the same steps with no gradient communication at all, after one of their own to warm up
        nosync = slowest_rank(timed_steps(run, steps + 1, device, sync=False)[1:], world) if world.size > 1 else None
        if profile_dir:
            profile_steps(run, device, Path(profile_dir), f"{world.strategy}-{world.size}", world.is_master)
        figures = dict(
            world_size=world.size, accumulation_steps=accum, tokens_per_step=cfg.tokens_per_step,
            step_times=times, step_times_nosync=nosync, peak_memory=[row[0] for row in by_rank([peak], world)],
            memory_kind="cuda max allocated" if gpu else "peak RSS",
            state_bytes=state_bytes(run), sequences_per_rank_step=cfg.batch_size * accum,
            mfu=(estimate := mfu_of(run)) and estimate(1, statistics.mean(times)),  # (logger.py's)
            device=torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu",
            dtype=str(world.dtype).removeprefix("torch."), backend=world.backend, compile=cfg.compile,
            config=cfg.to_dict(), data="synthetic" if synthetic_dir else str(cfg.data_dir or cfg.dataset),
            vocab_size=run.model_args["vocab_size"], n_params=run.raw_model.get_num_params())
        if world.is_master:
            atomic_write_bytes(result, json.dumps(figures, indent=1).encode())  # (its folder made, if need be)


# -----------------------------------------------------------------------------
# the benchmark: one torchrun per combination, then the report

def summarise(strategy: str, nproc: int, f: dict) -> dict:
    mean, nosync = statistics.mean(f["step_times"]), f["step_times_nosync"]
    return dict(strategy=strategy, nproc=nproc, global_batch_size=f["config"]["global_batch_size"],
                batch_size=f["config"]["batch_size"], accumulation_steps=f["accumulation_steps"],
                tokens_per_step=f["tokens_per_step"], step_time_s=mean,
                step_time_std_s=statistics.pstdev(f["step_times"]), step_time_min_s=min(f["step_times"]),
                step_time_max_s=max(f["step_times"]), tokens_per_sec=f["tokens_per_step"] / mean,
                comm_share=max(0.0, 1 - statistics.mean(nosync) / mean) if nosync else 0.0,
                peak_memory_bytes=max(f["peak_memory"]), memory_kind=f["memory_kind"],
                state_bytes=f["state_bytes"], mfu=f["mfu"], raw=f)


def add_scaling(rows: list):
    for row in rows:
        base = next((r for r in rows if r["strategy"] == row["strategy"] and r["nproc"] == 1), None)
        row["scaling_efficiency"] = row["tokens_per_sec"] / (row["nproc"] * base["tokens_per_sec"]) if base else None


def markdown(rows: list, info: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    pct = lambda v: "-" if v is None else f"{v * 100:.1f}%"
    lines = [f"{info['device']} | torch {info['torch']} | {info['host']} | {info['data']} data (vocabulary "
             f"{info['vocab_size']:,}) | {info['n_params'] / 1e6:.2f}M parameters | dtype {info['dtype']} | "
             f"compile {info['compile']}", "",
             "| strategy | processes | global batch (accum) | tokens/s | step time | comm share | "
             f"memory per rank ({info['memory_kind']}) | model state per rank | MFU | scaling efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['nproc']} | {r['global_batch_size']} ({r['accumulation_steps']}) | "
                     f"{r['tokens_per_sec']:,.0f} | {r['step_time_s'] * 1e3:,.1f} ms ± "
                     f"{r['step_time_std_s'] * 1e3:,.1f} | {pct(r['comm_share'])} | "
                     f"{gib(r['peak_memory_bytes'])} | {gib(sum(r['state_bytes'].values()))} | {pct(r['mfu'])} | "
                     f"{pct(r['scaling_efficiency'])} |")
    return "\n".join(lines) + "\n"


def plot(rows: list, out, info: dict):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["nproc"])
        n = [r["nproc"] for r in mine]
        ax1.plot(n, [r["tokens_per_sec"] for r in mine], "o-", label=strategy)
        if all(r["scaling_efficiency"] is not None for r in mine):
            ax2.plot(n, [r["scaling_efficiency"] * 100 for r in mine], "o-", label=strategy)
    ax2.axhline(100, color="grey", linestyle=":", label="ideal")  # (efficiency may pass it: no upper ylim)
    for ax, ylabel in ((ax1, "tokens / s"), (ax2, "scaling efficiency (%)")):
        ax.set(xlabel="processes", ylabel=ylabel, xticks=sorted({r["nproc"] for r in rows}), ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{info['device']}, {info['dtype']}, global batch {rows[0]['global_batch_size']} x "
                 f"{rows[0]['raw']['config']['block_size']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120, format="png")
    plt.close(fig)


def parse_list(name: str, text: str, parse, allowed=None, minimum: int = 1, one: bool = False) -> list:
    try:
        values = [parse(v) for v in ([text] if one else text.split(","))]
    except ValueError:
        raise ConfigError(f"--{name}={text}: give a number" + ("" if one else ", or a comma-separated list")) from None
    if bad := [v for v in values if (allowed is not None and v not in allowed) or (parse is int and v < minimum)]:
        raise ConfigError(f"--{name}={text}: {bad} not allowed" +
                          (f" (choose from {', '.join(allowed)})" if allowed else f" (at least {minimum})"))
    if len(set(values)) < len(values):  # the report would hold the same row twice
        raise ConfigError(f"--{name}={text} repeats a value: give each once")
    return values


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if "-h" in args or "--help" in args:
        return print(f"{__doc__}\n{Config.defaults()}")  # this tool's usage, then train.py's settings
    opts = dict(nproc="1,2", strategies=None, steps="10", warmup="3", report="out-bench", result="", synthetic_dir="")
    flags, cfg_args = {"--worker": False, "--profile": False}, []
    for arg in args:
        name, eq, value = arg[2:].partition("=")
        if arg in flags:
            flags[arg] = True
        elif arg.startswith("--") and name in opts and eq:
            opts[name] = value
        elif arg.startswith("--") and (name in opts or "--" + name in flags):  # (--steps 20, --profile=True)
            raise ConfigError(f"'{arg}': write --{name}=VALUE" if name in opts else f"'{arg}': --{name} takes no value")
        else:
            cfg_args.append(arg)
    (steps,), (warmup,) = (parse_list(k, opts[k], int, minimum=m, one=True) for k, m in (("steps", 1), ("warmup", 0)))
    if flags["--worker"]:
        synthetic_dir = opts["synthetic_dir"] or (tempfile.gettempdir() if synthetic(cfg_args) else None)
        return worker(cfg_args, steps, warmup, Path(opts["result"] or "bench-result.json"), synthetic_dir,
                      opts["report"] if flags["--profile"] else None)

    nprocs = parse_list("nproc", opts["nproc"], int)
    chosen = opts["strategies"] is not None and parse_list("strategies", opts["strategies"], str, CHOICES["strategy"])
    cfg = resolve(cfg_args + ["--strategy=fsdp"] * ("fsdp" in (chosen or ())))  # (fsdp takes ddp's and its own)
    if cfg.init_from == "resume":  # a bad config, device, dataset or size fails here, once, not in every worker
        raise ConfigError("bench.py times a run from scratch or from GPT-2's weights: leave init_from=resume out")
    strategies = chosen or [cfg.strategy]
    meta = (Dataset(cfg).meta if not synthetic(cfg_args) else None) or GPT2_META
    for strategy in strategies:
        try:
            cfg = resolve(cfg_args + FIXED + [f"--strategy={strategy}"] + AS_DDP * (strategy == "ddp"))  # as run
        except ConfigError as e:
            raise ConfigError(f"the {strategy} run: {e}") from None
        shape = GPTConfig(**pretrained.model_args(cfg, meta))  # (GPT-2's is read here: offline, it fails now)
        for n in nprocs:  # as rank 0 of n processes will see it: the global batch and fsdp_shard_size must split
            if problem := memory_problem(shape, cfg, setup(cfg, claim=False, world=World(size=n, local_size=n))):
                raise ConfigError(problem)
    if not opts["report"] or not_a_folder(report := Path(opts["report"]).expanduser()):  # (empty: an unset variable)
        raise ConfigError(f"--report={opts['report']} is no folder: give one for bench.json, bench.md and bench.png")
    report.mkdir(parents=True, exist_ok=True)  # (one that cannot be written loses no figure: write_report)
    rows = measure(strategies, nprocs, cfg_args, steps, warmup, report, flags["--profile"])
    write_report(rows, report, steps, warmup, args)
    return rows


def synthetic(cfg_args: list) -> bool:
    return not any(a.startswith(("--dataset=", "--data_dir=")) for a in cfg_args)


def measure(strategies: list, nprocs: list, cfg_args: list, steps: int, warmup: int, report: Path,
            profile: bool) -> list:
    """One torchrun of bench.py --worker per strategy and process count; their summaries."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, n in ((s, n) for s in strategies for n in nprocs):
            if n == 1 and (same := next((r for r in rows if r["strategy"] == "ddp" and r["nproc"] == 1), None)):
                rows.append({**same, "strategy": strategy, "measured_as": "ddp"})  # 1 process: fsdp is ddp
                continue
            result = Path(tmp) / f"{strategy}-{n}.json"
            cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={n}", str(REPO / "bench.py"), "--worker",
                   f"--result={result}", f"--steps={steps}", f"--warmup={warmup}", f"--report={report}", *cfg_args,
                   f"--strategy={strategy}", *AS_DDP * (strategy == "ddp"), *["--profile"] * profile,
                   *[f"--synthetic_dir={tmp}"] * synthetic(cfg_args), *["--debug"] * ("--debug" in sys.argv)]
            print(f"--- {strategy}, {n} process{'es' if n > 1 else ''}", flush=True)
            status = wait_passing_signals(subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            if status:  # (cwd: here, so relative paths hold)
                raise RunError(f"the {strategy} run on {n} process{'es' * (n > 1)} failed "
                               f"(exit {status}): see its output above")
            rows.append(summarise(strategy, n, json.loads(result.read_text())))
    add_scaling(rows)
    return rows


def write_report(rows: list, report: Path, steps: int, warmup: int, args: list):
    first = next((r["raw"] for r in rows if r.get("measured_as", r["strategy"]) != "ddp"), rows[0]["raw"])
    info = dict(torch=torch.__version__, host=socket.gethostname(), steps=steps, warmup=warmup, cpus=os.cpu_count(),
                **{k: first[k] for k in ("device", "data", "vocab_size", "n_params", "dtype", "compile", "memory_kind")},
                command=" ".join(["python", "bench.py", *args]))
    table, report_json = markdown(rows, info), dict(info=info, config=first["config"], runs=rows)
    print(table, flush=True)  # first: a report that cannot be written loses no figure
    try:  # all whole, or none replaced (a full disk left an empty bench.json; later, a mix of two runs' files)
        write_together({report / "bench.json": lambda f: f.write(f"{json.dumps(report_json, indent=1)}\n".encode()),
                        report / "bench.md": lambda f: f.write(f"`{info['command']}`\n\n{table}".encode()),
                        report / "bench.png": lambda f: plot(rows, f, info)})
    except OSError as e:
        fix = "free disk space or give" if e.errno in DISK_FULL else "give"  # (a folder in a file's place: named)
        raise RunError(f"could not write {e.filename or report} ({write_failure(e)}): {fix} another --report (the "
                       f"table above holds its figures)") from None
    print(f"report: {report}/bench.json, bench.md, bench.png", flush=True)


if __name__ == "__main__":
    with reported(debug="--debug" in sys.argv, also=(OSError,)), signals_unwind():  # (OSError: the report's)
        main([a for a in sys.argv[1:] if a != "--debug"])
