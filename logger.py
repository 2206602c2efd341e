"""Rank 0's voice: a tqdm bar on a terminal, plain lines otherwise, metrics.jsonl, wandb.

Every other rank holds a Logger too, one that says nothing, so the loop has no rank branches.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from collectives import agree_or_raise, any_rank, first_error
from data.files import atomic_write_bytes, holds_lock, parse_json
from errors import DISK_FULL, LogNotWritten, first_line


def mfu_of(run):
    """(optimizer steps, seconds) -> the run's MFU over them, or None where no peak is known: a GPU's from model.py's
    table or peak_flops, a CPU's only from peak_flops, which its local processes share (each has its cores)."""
    cfg, world, gpu = run.cfg, run.world, run.world.device.type == "cuda"
    peak = cfg.peak_flops / (1 if gpu else world.local_size) or None
    return (lambda steps, seconds: run.raw_model.estimate_mfu(cfg.batch_size * world.accum * steps, seconds, peak)
            ) if gpu or peak else None


def read_metrics(path: Path, verb: str) -> list:
    """metrics.jsonl's rows, each a dict with an integer step. A line that is not one (cut short
    by a full disk or a kill, or edited) is left out, with a warning: "{verb} 2 unreadable lines"."""
    rows, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = parse_json(line)
            row["step"] = int(row["step"])
            rows.append(row)
        except (ValueError, TypeError, KeyError, OverflowError):  # 1e999; [[[[...
            torn += 1
    if torn:
        print(f"warning: {verb} {torn} unreadable line{'s' * (torn > 1)} of {path} (a write cut short)", flush=True)
    return rows


class Logger:

    def __init__(self, cfg, step: int, resumed_from, enabled: bool, estimate_mfu=None, history: str = None):
        """`step`: where the run starts; `resumed_from`: the checkpoint it continues (None for a fresh run),
        `history` the log it holds. `estimate_mfu(steps, seconds)`: the model's MFU for that many optimizer
        steps, or None."""
        self.enabled, self.max_iters = enabled, cfg.max_iters
        self.tokens_per_step, self.estimate_mfu = cfg.tokens_per_step, estimate_mfu
        self.bar = self.wandb = self.failure = None  # failure: why metrics.jsonl could not be written
        self.start_failure = None  # why wandb could not start, or the history not be read: agreed in start()
        self.idle = bool(resumed_from) and step >= cfg.max_iters  # nothing to train: no run files, no wandb run
        self.restart_clock(step)
        self.lines = []  # metrics.jsonl's lines, which each checkpoint keeps (text())
        if not enabled:
            return
        if cfg.wandb_log and not self.idle:
            try:
                import wandb
                self.wandb = wandb.init(project=cfg.wandb_project, config=cfg.to_dict(), dir=cfg.out_dir,
                                        name=cfg.wandb_run_name or Path(os.path.realpath(cfg.out_dir)).name)
            except Exception as e:  # no API key, no network, not installed, a project name wandb refuses
                named = "name" in str(e).lower() and "api key" not in str(e).lower()  # (a login would not help)
                offline = os.environ.get("WANDB_MODE") in ("offline", "disabled")  # (already: say it not)
                fix = "run pip install wandb" if isinstance(e, ImportError) else "check --wandb_project and " \
                    "--wandb_run_name" if named else f"check {e.filename}" if getattr(e, "filename", None) else \
                    "run `wandb login`" + ", or set WANDB_MODE=offline" * (not offline)
                self.start_failure = (f"wandb could not start ({type(e).__name__}: {first_line(e)}): {fix}, "
                                      f"or use --wandb_log=false")
                return  # a run refused leaves out_dir's log as it was
        self.metrics, self.lock = Path(cfg.out_dir) / "metrics.jsonl", Path(cfg.out_dir) / "run.lock"
        # a fresh run starts a new log; a resumed one keeps the history its checkpoint holds (written
        # before any later run, killed or not, rewrote the file), or in older files the log beside it
        # (here or in the folder it came from) up to its step, dropping the steps it runs again
        beside = Path(resumed_from).parent / "metrics.jsonl" if resumed_from and history is None else None
        try:
            rows = read_metrics(beside, "dropped") if beside and beside.is_file() else []  # (a FIFO would hang)
        except OSError as e:  # another user's
            self.start_failure = f"cannot read {beside}, the log this run continues ({e.strerror or e})"
            return
        self.lines = [history] if history else [json.dumps(row) + "\n" for row in rows if row["step"] <= step]
        if self.metrics.exists() or self.lines:  # (not a folder or a pipe: checkpoint.locked_out_dir)
            self._write(self.metrics, self.text())

    def text(self) -> str:
        """metrics.jsonl as this run has written it (on rank 0; "" on the others)."""
        return "".join(self.lines)

    def __enter__(self):
        """The progress bar, on a terminal (on stdout, with the log lines: stderr keeps one error line)."""
        if self.enabled and sys.stdout and sys.stdout.isatty():  # (None: started with stdout closed)
            from tqdm import tqdm
            self.bar = tqdm(total=self.max_iters, initial=self.clock_step, dynamic_ncols=True, file=sys.stdout)
        return self

    def __exit__(self, failed, *exc):
        """Closed, failed or not: an error line then starts a line of its own."""
        if self.bar:
            self.bar.close()
        if self.wandb:
            self.finish_wandb(1 if failed else 0)

    def finish_wandb(self, code: int):
        """End wandb's run; when its process is gone, its connection too (else a traceback at exit)."""
        import wandb
        try:
            self.wandb.finish(exit_code=code)
        except Exception:
            with contextlib.suppress(Exception):
                wandb.teardown()
        self.wandb = None

    @classmethod
    def start(cls, run, meta: dict) -> "Logger":
        """A run's log (silent on ranks other than 0), its files beside the checkpoints, a summary."""
        import torch
        from pretrained import is_pretrained
        cfg, world, raw_model = run.cfg, run.world, run.raw_model
        on_gpu = world.device.type == "cuda"
        log = cls(cfg, run.step, run.resumed_from, world.is_master, mfu_of(run), run.history)
        agree_or_raise(log.start_failure, world)
        log.write_run_files(cfg, meta, dict(
            torch=torch.__version__, python=sys.version.split()[0], world_size=world.size,
            device=torch.cuda.get_device_name(world.device) if on_gpu else world.device.type,
            backend=world.backend if world.size > 1 else None, dtype=str(world.dtype).removeprefix("torch."),
            accumulation_steps=world.accum, tokens_per_step=cfg.tokens_per_step, model=run.model_args,
            cwd=os.getcwd()))  # (relative paths: from it)
        log.say(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | tokens per optimizer step: "
                f"{cfg.tokens_per_step:,} = {cfg.global_batch_size} sequences x {cfg.block_size} tokens "
                f"({cfg.batch_size} per micro-batch x {world.size} process{'es' * (world.size > 1)} x {world.accum} "
                f"accumulation steps)")
        if run.resumed_from:
            log.say(f"resuming from {run.resumed_from} at step {run.step}" + (run.step >= cfg.max_iters) *
                    f", max_iters={cfg.max_iters}: nothing is left to train (raise --max_iters to go on)")
        elif is_pretrained(cfg.init_from):
            log.say(f"weights from {cfg.init_from}: {run.model_args['n_layer']} layers, {run.model_args['n_head']} "
                    f"heads, {run.model_args['n_embd']} wide, its first {cfg.block_size} positions")
        log.restart_clock(run.step)  # (a resumed run's first interval, with no eval before it, was the start-up's)
        return log

    def write_run_files(self, cfg, meta: dict, run_info: dict):
        """config.json (the resolved config and how the run was launched) and the dataset's
        meta.json beside the checkpoints, so a run explains itself; and the config, printed."""
        if not self.enabled or self.idle:  # (a relaunch with nothing to train keeps the run's record)
            return
        for name, obj in (("config.json", {"config": cfg.to_dict(), "run": run_info}), ("meta.json", meta)):
            self._write(Path(cfg.out_dir) / name, json.dumps(obj, indent=2) + "\n")
        self.say(json.dumps(cfg.to_dict(), indent=1))

    def _write(self, path: Path, text: str, append: bool = False):
        """Write (atomically) or append; a failure (a full disk) is kept in self.failure, which
        train.py agrees on with the other ranks and ends the run with. Nothing is written after it."""
        if self.failure is not None or self._lost():
            return
        try:
            if append:
                with open(path, "a") as f:
                    f.write(text)
            else:
                atomic_write_bytes(path, text.encode())
        except OSError as e:
            fix = "free disk space" if e.errno in DISK_FULL else "make it writable"
            self.failure = f"could not write {path} ({e.strerror or e}): {fix}, then relaunch (a line cut short is " \
                           f"dropped)"

    def _lost(self) -> bool:
        """Whether out_dir's run.lock no longer names this process: the folder was deleted, moved or
        replaced under the run, and another run may write there now (kept in self.failure)."""
        if holds_lock(self.lock):
            return False
        self.failure = (f"stopped writing: {self.lock} is no longer this run's lock ({self.lock.parent} was deleted, "
                        f"moved or replaced while the run wrote into it, and another run may use it now): relaunch "
                        f"with an out_dir of its own")
        return True

    def check(self, world, saved):
        """Every rank: all stop, with one message, when rank 0 could not write its log files or lost
        out_dir (checked here too: a save follows)."""
        if any_rank(self.failure is not None or self.enabled and self._lost(), world):
            raise LogNotWritten(first_error(self.failure, world), saved)

    def say(self, text: str):
        if self.bar:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def log(self, record: dict, text: str):
        if not self.enabled:
            return
        self.lines.append(json.dumps(record) + "\n")
        self._write(self.metrics, self.lines[-1], append=True)
        self.say(text)
        try:
            if self.wandb:
                self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        except Exception as e:  # its own process was killed (out of memory, say): metrics.jsonl goes on
            self.say(f"warning: wandb stopped ({type(e).__name__}: {first_line(e)}): metrics.jsonl goes on alone")
            self.finish_wandb(1)

    def restart_clock(self, step: int):
        """Throughput counts training time only: call after anything else (an eval, a save)."""
        self.clock, self.clock_step = time.time(), step

    def train_step(self, step: int, loss: float, lr: float, grad_norm):
        """Log a step's loss (already reduced over ranks) with the throughput since the last log;
        grad_norm: a tensor or None (no clipping)."""
        elapsed, steps = time.time() - self.clock, step - self.clock_step
        self.restart_clock(step)
        record = {"step": step, "loss": loss, "lr": lr, "tokens_per_sec": steps * self.tokens_per_step / elapsed}
        if grad_norm is not None:
            record["grad_norm"] = grad_norm.item()
        text = f"step {step}: loss {loss:.4f}, lr {lr:.2e}, {record['tokens_per_sec']:,.0f} tok/s"
        mfu = self.estimate_mfu(steps, elapsed) if self.estimate_mfu else None
        if mfu is not None:
            record["mfu"] = mfu
            text += f", mfu {mfu * 100:.1f}%"
        self.log(record, text)

    def hellaswag(self, step: int, score):
        self.log({"step": step, "hellaswag_acc": score.acc, "hellaswag_acc_norm": score.acc_norm,
                  "hellaswag_examples": score.examples, "hellaswag_truncated": score.truncated},
                 f"step {step}: {score.line()}" + (f" ({score.truncated} example{'s' * (score.truncated != 1)} cut "
                                                   f"to block_size)" if score.truncated else ""))
        self.restart_clock(step)

    def advance(self, step: int):
        if self.bar:
            self.bar.update(step - self.bar.n)
