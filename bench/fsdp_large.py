"""GPT-2 large's shape under FSDP on 4 CPU processes: peak memory and checkpoint times per format.

    python bench/fsdp_large.py --report=bench/cpu-fsdp-large          # about 25 minutes on 2 cores
    python bench/fsdp_large.py --formats=sharded --report=/tmp/x       # one format
    python bench/fsdp_large.py --shape=24,16,1024 --report=bench/cpu-fsdp-medium   # GPT-2 medium's shape

For each format (file, sharded, sharded + async) run A starts fresh, saves at step 2, goes on
and is killed (SIGKILL to every process) once step 3 is logged; run B resumes from that
checkpoint and saves at step 4. Run U, first, trains the same 4 steps uninterrupted (sharded), and
every run B's step-4 checkpoint is compared with U's, tensor by tensor (weights and AdamW moments;
checkpoints keep no RNG state); a format's checkpoints are then deleted (--keep keeps them), so ~35 GB of disk suffice.

Each rank runs train.py's own cli through a thin wrapper (this file's --worker), which records
without touching train.py: peak RSS (VmHWM, reset through /proc/self/clear_refs) from process
start through build_run (start-up, or resume for run B, which loads the checkpoint there), over
the training steps, and over each save; the seconds each save blocked training, and for async
saves the seconds until the background write was committed; the seconds the resume's load took.
The model: n_layer=36 n_head=20 n_embd=1280 (GPT-2 large, 708M parameters with the 65-character
vocabulary), block 64, one sequence per process, float32, gloo. Needs ~20 GB of free memory
(GPT-2 medium's shape, --shape=24,16,1024: ~11 GB and about 13 minutes).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = ["--n_layer=36", "--n_head=20", "--n_embd=1280", "--block_size=64", "--batch_size=1",
         "--global_batch_size=4", "--max_iters=4", "--lr_decay_iters=4", "--warmup_iters=0", "--eval_interval=2",
         "--eval_iters=1", "--log_interval=1", "--dtype=float32", "--device=cpu", "--strategy=fsdp",
         "--compile=False", "--dropout=0.0"]
FORMATS = {"file": ["--checkpoint_format=file"], "sharded": ["--checkpoint_format=sharded"],
           "sharded+async": ["--checkpoint_format=sharded", "--async_checkpoint=True"]}
NPROC = 4


# -----------------------------------------------------------------------------
# in each rank: train.py's cli, with measurements around build_run, load_state_dict and save

def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS


def worker(record: str, args: list):
    import train
    out = open(f"{record}.{os.environ.get('RANK', '0')}", "a")

    def emit(**values):
        out.write(json.dumps(values) + "\n")
        out.flush()

    build_run, load_state_dict, save = train.build_run, train.Run.load_state_dict, train.Run.save

    def timed_build_run(cfg, world, meta):
        start = time.time()
        run = build_run(cfg, world, meta)
        emit(phase="resume" if run.resumed_from else "start-up", seconds=time.time() - start, peak=_status("VmHWM"))
        _reset_peak()
        return run

    def timed_load_state_dict(self, ckpt):
        start = time.time()
        load_state_dict(self, ckpt)
        emit(phase="load", seconds=time.time() - start)

    def timed_save(self, best):
        emit(phase="training", step=self.step, peak=_status("VmHWM"))
        _reset_peak()
        start = time.time()
        save(self, best)
        emit(phase="save", step=self.step, blocked=time.time() - start, peak=_status("VmHWM"))
        pending = self.pending
        if pending is not None:
            def written():
                pending.finished.wait()
                emit(phase="written", step=pending.step, seconds=time.time() - start, error=pending.error)
            threading.Thread(target=written, daemon=True).start()
        _reset_peak()

    train.build_run, train.Run.load_state_dict, train.Run.save = timed_build_run, timed_load_state_dict, timed_save
    train.cli(args)


# -----------------------------------------------------------------------------
# the parent: the runs, the comparison, the report

def launch(args: list, record: Path, log: Path, kill_after: str = None) -> int:
    """torchrun on NPROC processes; with kill_after, SIGKILL every process once that line is
    logged and the step-2 checkpoint is committed (an async save may still be writing)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           str(Path(__file__).resolve()), "--worker", str(record), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, cwd=REPO)
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if kill_after and line.startswith(kill_after):
                done = "written" if "--async_checkpoint=True" in args else "save"
                while proc.poll() is None and not any(x["phase"] == done and x["step"] == 2
                                                      for x in records(record, ranks=1)[0]):
                    time.sleep(0.5)  # the background write of step 2 is still going
                for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun and every rank (own sessions)
                    os.kill(pid, signal.SIGKILL)
                break
        proc.stdout.close()
        return proc.wait()


def descendants(pid: int) -> list:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children] + [d for c in children for d in descendants(int(c))]


def records(record: Path, ranks: int = NPROC) -> list:
    return [[json.loads(line) for line in open(f"{record}.{r}")] for r in range(ranks)]


def compare(a: Path, b: Path) -> str:
    """'identical' when two step-4 checkpoints hold the same tensors bit for bit, else the first difference.
    Read in groups (the weights, then each AdamW statistic) to keep two copies of one group in memory."""
    import torch
    import checkpoint
    import sharded

    def load(path: Path, keys: list) -> dict:
        if path.suffix == ".pt":  # mapped: pages are read as they are compared
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            flat = {f"model.{k}": v for k, v in state["model"].items()}
            # positions -> names: the sharded checkpoint's param_groups list the same parameters in order
            order = [n for g in checkpoint.read(b, tensors=False)["param_groups"] for n in g["params"]]
            for i, stats in state["optimizer"]["state"].items():
                flat.update({f"optimizer.{order[i]}.{s}": v for s, v in stats.items()})
            return {k: flat[k] for k in keys}
        metadata = sharded.parts(path)[1].state_dict_metadata
        tensors = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
        sharded.load(path, tensors)
        return tensors

    keys, compared = list(sharded.parts(b)[1].state_dict_metadata), 0
    for group in ("model.", ".exp_avg", ".exp_avg_sq", ".step"):
        chosen = [k for k in keys if (k.startswith(group) if group.endswith(".") else k.endswith(group))]
        left, right = load(a, chosen), load(b, chosen)
        for k in chosen:
            if not torch.equal(left[k], right[k]):
                return f"differs at {k}"
        compared += len(chosen)
    return f"identical ({compared} tensors)"  # (the metadata's other entries: no tensors of the training state)


def table(results: dict) -> str:
    gb = lambda x: f"{x / 2**30:.2f}"
    lines = ["| format | phase | peak RSS per rank (GiB, ranks 0-3) | summed | seconds |", "|---|---|---|---|---|"]
    for name, r in results.items():
        if "failed" in r:
            lines.append(f"| {name} | {r['failed']} | | | |")
        for phase, peaks, seconds in r.get("rows", ()):
            lines.append(f"| {name} | {phase} | {' / '.join(gb(p) for p in peaks)} | {gb(sum(peaks))} | {seconds} |")
    return "\n".join(lines)


def measure(name: str, flags: list, folder: Path, data: list) -> dict:
    out = folder / name.replace("+", "-")
    common = [*MODEL, *data, *flags, f"--out_dir={out}"]
    a_rec, b_rec = folder / f"{out.name}.A", folder / f"{out.name}.B"
    code = launch([*common, "--resume=never"], a_rec, folder / f"{out.name}.A.log", kill_after="step 3:")
    if code != -signal.SIGKILL or not (out / ("last.pt" if name == "file" else "last.dcp")).exists():
        return {"failed": f"run A ended (torchrun exit {code}) before its step-2 checkpoint and step 3: see "
                          f"{folder / out.name}.A.log, where a rank the OOM killer ended shows as exitcode -9",
                "records": {"A": records(a_rec)}}
    code = launch([*common, "--resume=auto"], b_rec, folder / f"{out.name}.B.log")
    a, b = records(a_rec), records(b_rec)
    pick = lambda recs, phase, key="peak": [next(x[key] for x in rank if x["phase"] == phase) for rank in recs]
    save_a = [next(x for x in rank if x["phase"] == "save" and x["step"] == 2) for rank in a]
    written = [next((x for x in rank if x["phase"] == "written" and x["step"] == 2), None) for rank in a]
    seconds = f"blocked {max(s['blocked'] for s in save_a):.1f}" + (
        f", written after {max(w['seconds'] for w in written):.1f}" if written[0] else "")
    rows = [("start-up (run A)", pick(a, "start-up"), f"{max(pick(a, 'start-up', 'seconds')):.1f}"),
            ("training steps 1-2", [next(x["peak"] for x in rank if x["phase"] == "training") for rank in a], ""),
            ("save at step 2", [s["peak"] for s in save_a], seconds),
            ("resume (run B, start-up + load)", pick(b, "resume"),
             f"load {max(pick(b, 'load', 'seconds')):.1f} of {max(pick(b, 'resume', 'seconds')):.1f}")]
    resumed = [l.strip() for l in open(folder / f"{out.name}.B.log") if l.startswith("resuming from")]
    return {"rows": rows, "exit_b": code, "resumed": resumed, "out": str(out), "records": {"A": a, "B": b}}


def main(argv=None):
    import world
    from errors import ConfigError
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", required=True, type=Path, help="folder for report.json, report.md and the runs")
    p.add_argument("--formats", default=",".join(FORMATS), help="which of " + ", ".join(FORMATS))
    p.add_argument("--data_dir", default=str(REPO / "data" / "shakespeare_char"))
    p.add_argument("--small", action="store_true", help="a 2-layer model: check this script in a minute")
    p.add_argument("--shape", default="36,20,1280", help="n_layer,n_head,n_embd (GPT-2 medium: 24,16,1024)")
    p.add_argument("--keep", action="store_true", help="keep each format's checkpoints (deleted once compared)")
    args = p.parse_args(argv)
    try:
        shape = [int(v) for v in ("2,2,64" if args.small else args.shape).split(",")]
        MODEL[:3] = [f"--n_layer={shape[0]}", f"--n_head={shape[1]}", f"--n_embd={shape[2]}"]
    except (ValueError, IndexError):
        raise ConfigError(f"--shape={args.shape}: give n_layer,n_head,n_embd, e.g. 24,16,1024") from None
    unknown = [f for f in args.formats.split(",") if f not in FORMATS]
    if unknown:
        raise ConfigError(f"--formats: {unknown} are not among {list(FORMATS)}")
    args.report.mkdir(parents=True, exist_ok=True)
    world.keep_cpu_memory_lean()  # or the comparisons' freed gigabytes stay with this process
    runs = args.report / "runs"
    runs.mkdir(exist_ok=True)
    data = [f"--data_dir={args.data_dir}"]
    straight = runs / "uninterrupted"  # first, so each format's checkpoints can go once compared
    launch([*MODEL, *data, *FORMATS["sharded"], f"--out_dir={straight}", "--resume=never"],
           runs / "uninterrupted.rec", runs / "uninterrupted.log")
    results = {}
    for name in args.formats.split(","):
        r = results[name] = measure(name, FORMATS[name], runs, data)
        if "failed" not in r:
            resumed = Path(r["out"]) / ("last.pt" if name == "file" else "last.dcp")
            r["resumed_vs_uninterrupted"] = (compare(resumed, straight / "last.dcp") if r["exit_b"] == 0 else
                                             "not compared: run B did not finish")
            if not args.keep:  # 17 GB a format at full size
                shutil.rmtree(r["out"])
        report = table(results) + "\n\n" + "\n".join(
            f"- {name}: run B exited {r['exit_b']} ({'; '.join(r['resumed']) or 'did not resume'}); its step-4 "
            f"checkpoint against the uninterrupted run's: {r['resumed_vs_uninterrupted']}"
            for name, r in results.items() if "failed" not in r)
        (args.report / "report.md").write_text(report + "\n")  # after each format: a later one may be killed
        (args.report / "report.json").write_text(json.dumps(results, indent=1))
        print(report, flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3:])
    else:
        from errors import reported
        with reported():
            main()
