"""Train a GPT from scratch, the same way under every launcher.

    python train.py                                   # CPU-sized default: char-level Shakespeare
    python train.py configs/shakespeare_char.py       # the baby GPT, one GPU
    torchrun --standalone --nproc_per_node=4 train.py configs/gpt_small.py
    python train_spawn.py --nproc=2                   # torch.multiprocessing.spawn
    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py &
    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py
    # two hosts: on each, with --node_rank=0 on the first and 1 on the second
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST_A --master_port=29500 train.py

Arguments are config files (plain Python) and --name=value overrides; see
config.py and the table in README.md. Ranks come from the launcher's
environment (torchrun / manual RANK, WORLD_SIZE...), else SLURM's, else this
is a single process. Only global rank 0 writes into out_dir.
"""

import gc
import importlib
import json
import math
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
from config import Config, ConfigError, resolve
from data.common import atomic_write, check_token_files, load_meta
from loader import ShardedTokenLoader, eval_starts, open_tokens, windows_to_batch
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -----------------------------------------------------------------------------
# where this process stands in the world

@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    local_size: int = 1
    group: object = None  # a gloo group for small CPU messages (the default group unless NCCL)

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank when `flag` is True on any: one tiny all-reduce over the gloo group,
    which every rank must call (so it is also a barrier)."""
    if world.size == 1:
        return flag
    votes = torch.tensor([int(flag)])
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=world.group)
    return bool(votes.item())


def slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM node list, as `scontrol show hostnames` orders them:
    'gpu[03-05,07],cpu1' -> 'gpu03', 'rack[2-3]-n[1-4]' -> 'rack2-n1'."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]  # a comma inside brackets does not split
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", first)  # each range starts at its first value


def slurm_tasks_per_node(counts: str) -> list[int]:
    """SLURM's compressed task counts, one per node: '4(x2),3' -> [4, 4, 3]."""
    per_node = []
    for part in counts.split(","):
        n, _, repeat = part.partition("(x")
        per_node += [int(n)] * int(repeat.rstrip(")") or 1)
    return per_node


def find_world() -> World:
    """Read ranks from torchrun or manual variables, else from SLURM, else one process."""
    env = os.environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
             "SLURM_LOCALID", "SLURM_NODEID")
    bad = {k: env[k] for k in names if k in env and not env[k].isdigit()}
    if bad:
        raise ConfigError(f"rank variables must be whole numbers, got {bad}: check the launch command")
    if "RANK" in env and "WORLD_SIZE" in env:
        size = int(env["WORLD_SIZE"])
        return World(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), size,
                     int(env.get("LOCAL_WORLD_SIZE", size)))
    # Only inside a step that srun launched: an sbatch script itself also sees SLURM_PROCID=0
    # and SLURM_NTASKS=N, but no peer would ever join it.
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        # rank 0 runs on the step's first node, which need not be the job's first
        nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        env.setdefault("MASTER_ADDR", slurm_first_host(nodes))
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
        per_node = slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env["SLURM_NTASKS"]))
        return World(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)),
                     int(env["SLURM_NTASKS"]), per_node[int(env.get("SLURM_NODEID", 0))])
    return World()


def pick_device(cfg: Config, world: World) -> torch.device:
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", world.local_rank)
        if world.size == 1 and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device {cfg.device!r} is not one this trainer runs on: use auto, cpu, "
                          f"cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but CUDA is not available here: use --device=cpu")
        return torch.device("cuda", world.local_rank if device.index is None else device.index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but MPS is not available here: use --device=cpu")
    return device


def pick_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    dtype = DTYPES[cfg.dtype]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU cannot run bfloat16: use --dtype=float16")
    if dtype != torch.float32 and not autocast_runs(device, dtype):
        raise ConfigError(f"dtype={cfg.dtype} cannot run on {device} here (autocast does not support "
                          f"it): use --dtype=float32 or --dtype=auto")
    return dtype


def autocast_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matmul under autocast on `device` really computes in `dtype`. Where the dtype
    is unsupported, autocast warns and turns itself off rather than failing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device.type, dtype=dtype):
                a = torch.ones(2, 2, device=device)
                return (a @ a).dtype == dtype
    except (RuntimeError, TypeError, ValueError):
        return False


def pick_backend(cfg: Config, device: torch.device) -> str:
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_backend_available(backend):
        raise ConfigError(f"backend '{backend}' is not available in this torch build: use gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("backend nccl needs CUDA devices: use --backend=gloo on CPU")
    return backend


def accumulation_steps(cfg: Config, world: World) -> int:
    # Derive, then assert: one optimizer step sees global_batch_size sequences,
    # split into micro-batches of batch_size on each of the world.size processes.
    per_round = cfg.batch_size * world.size
    if cfg.global_batch_size % per_round:
        near = max(per_round, round(cfg.global_batch_size / per_round) * per_round)
        raise ConfigError(
            f"global_batch_size ({cfg.global_batch_size}) must be divisible by batch_size "
            f"({cfg.batch_size}) x world size ({world.size}) = {per_round}: "
            f"try --global_batch_size={near}")
    return cfg.global_batch_size // per_round


# -----------------------------------------------------------------------------
# data

def dataset_dir(cfg: Config) -> Path:
    return Path(cfg.data_dir) if cfg.data_dir else REPO / "data" / cfg.dataset


def read_dataset(cfg: Config) -> dict:
    """meta.json, checked against the token files and against block_size."""
    data_dir = dataset_dir(cfg)
    try:
        meta = load_meta(data_dir)
        check_token_files(data_dir, meta)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    for split, needed in (("train", 2 * cfg.block_size), ("val", cfg.block_size + 1)):
        if meta[f"{split}_tokens"] < needed:  # train: a window at any epoch offset
            raise ConfigError(f"block_size ({cfg.block_size}) is too long for the {split} split of "
                              f"{data_dir} ({meta[f'{split}_tokens']:,} tokens; it needs {needed:,}): "
                              f"use a smaller --block_size or more data")
    return meta


def check_dataset(cfg: Config):
    """Fail before any process group exists when the data is broken, or missing and cannot be
    made. Returns the checked meta, or None when the data is yet to be prepared."""
    data_dir = dataset_dir(cfg)
    script = REPO / "data" / cfg.dataset / "prepare.py"
    if (data_dir / "meta.json").exists():
        return read_dataset(cfg)
    if not script.exists():
        raise ConfigError(f"no dataset in {data_dir} (meta.json missing) and no {script} to "
                          f"prepare it: check --dataset / --data_dir")
    elif cfg.prepare_input and not Path(cfg.prepare_input).is_file():
        raise ConfigError(f"prepare_input {cfg.prepare_input} does not exist: the dataset in "
                          f"{data_dir} is missing and would be prepared from it")
    return None


def ensure_dataset(cfg: Config, world: World, meta) -> dict:
    """`meta` is check_dataset's: None where the data is missing. Each host's local rank 0
    prepares missing data; its ranks wait, then check it. Every rank takes part in both
    agreements (a host with data cannot know another lacks it), so a failure on one host
    (no shared disk) stops every rank, not only that host's."""
    data_dir = dataset_dir(cfg)
    error = None
    if meta is None and world.local_rank == 0 and not (data_dir / "meta.json").exists():
        local_input = {"input_path": cfg.prepare_input} if cfg.prepare_input else {}
        try:
            importlib.import_module(f"data.{cfg.dataset}.prepare").prepare(out_dir=str(data_dir),
                                                                           **local_input)
        except (OSError, ValueError, RuntimeError) as e:  # no corpus, not UTF-8, a full disk...
            error = f"preparing {cfg.dataset} in {data_dir} failed: {e}"
    agree_or_raise(error, world, "preparing the dataset failed on another rank: see its message")
    if meta is None:
        try:
            meta = read_dataset(cfg)
        except ConfigError as e:
            error = str(e)
    agree_or_raise(error, world, "the dataset check failed on another rank: see its message")
    return meta


def agree_or_raise(error, world: World, elsewhere: str):
    """Raise ConfigError on every rank if any rank has an error; the others say `elsewhere`."""
    if any_rank(error is not None, world):
        raise ConfigError(error or elsewhere)


# -----------------------------------------------------------------------------
# failures and signals

class RunError(RuntimeError):
    """A failed run the user must act on (a lost peer, a diverged loss): a message, exit status 1."""


COMM_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "socket", "peer", "closed")


@contextmanager
def collective_failures_explained(world: World, cfg: Config, where):
    """Turn a timed-out or broken collective into a message that says what to do."""
    try:
        yield
    except RuntimeError as e:
        if world.size == 1 or isinstance(e, RunError) or not (
                isinstance(e, dist.DistError) or any(w in str(e).lower() for w in COMM_WORDS)):
            raise
        raise RunError(
            f"rank {world.rank} on {socket.gethostname()}, {where()}: a collective timed out or "
            f"failed ({checkpoint.first_line(e, 300)}). A peer process died or the network between "
            f"hosts is down (dist_timeout={cfg.dist_timeout:g}s). The last checkpoint is last.pt in "
            f"rank 0's out_dir, on rank 0's host: relaunch with resume=auto to continue.") from None


def diverged(what: str, cfg: Config, saved_step) -> str:
    kept = (f"last.pt holds step {saved_step}, the last good one" if saved_step is not None
            else "no checkpoint of this run was written yet")
    return (f"{what}. Likely causes: a learning rate too high (learning_rate={cfg.learning_rate:g}: "
            f"try a smaller one or a longer warmup), float16 overflow (try --dtype=bfloat16), or "
            f"bad data. Nothing was saved from this state: {kept}.")


class StopSignal:
    """SIGTERM (a scheduler's preemption, torchrun passing it on) asks the run to stop
    at the next step boundary; all ranks agree on it, so they stop together."""

    def __init__(self):
        self.received = False
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only there can it be set
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)

    def agreed(self, world: World) -> bool:
        return any_rank(self.received, world)


# -----------------------------------------------------------------------------
# checkpoints are in checkpoint.py; the run's own small files

def write_json(path: Path, obj):
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


# -----------------------------------------------------------------------------
# schedule, evaluation, logging

def get_lr(step: int, cfg: Config) -> float:
    if not cfg.decay_lr:
        return cfg.learning_rate
    min_lr = cfg.learning_rate / 10 if cfg.min_lr is None else cfg.min_lr
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= decay_iters:
        return min_lr
    progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - min_lr)


@torch.no_grad()
def evaluate(model, tokens, starts, cfg: Config, world: World, device, autocast) -> float:
    """Mean loss over fixed windows split across ranks; sums are all-reduced, so every rank agrees."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float32 if device.type == "mps" else torch.float64,
                         device=device)  # (sum of token losses, token count)
    mine = starts[world.rank::world.size]
    for i in range(0, len(mine), cfg.batch_size):
        x, y = windows_to_batch(tokens, mine[i:i + cfg.batch_size], cfg.block_size, device)
        with autocast:
            _, loss = model(x, y)
        totals[0] += loss.to(totals.dtype) * y.numel()
        totals[1] += y.numel()
    if world.size > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return (totals[0] / totals[1]).item()


def accumulate_gradients(model, loader, accum: int, autocast, scaler) -> torch.Tensor:
    """Forward and backward over `accum` micro-batches; return this rank's mean loss (a tensor)."""
    step_loss = 0.0
    for micro in range(accum):
        x, y = loader.next_batch()
        # Skip the gradient all-reduce on all but the last micro-step. no_sync must
        # cover forward too: DDP prepares its reduction during the forward pass.
        last = micro == accum - 1
        with model.no_sync() if isinstance(model, DDP) and not last else nullcontext():
            with autocast:
                _, loss = model(x, y)
            # Each loss is a mean over one micro-batch; dividing by the number of
            # micro-steps makes the summed gradient the mean over the global batch.
            scaler.scale(loss / accum).backward()
        step_loss += loss.detach() / accum
    return step_loss


class Logger:
    """Rank 0's voice: a tqdm bar on a terminal, plain lines otherwise, metrics.jsonl, wandb."""

    def __init__(self, cfg: Config, resumed_step, enabled: bool):
        self.enabled = enabled
        self.bar = self.wandb = None
        if not enabled:
            return
        self.metrics = Path(cfg.out_dir) / "metrics.jsonl"
        if self.metrics.exists():  # a fresh run starts a new log; a resumed one drops the
            # steps after its checkpoint, which it is about to run again
            kept = [line for line in self.metrics.read_text().splitlines() if resumed_step is not None
                    and line and json.loads(line)["step"] <= resumed_step]
            atomic_write(self.metrics, lambda f: f.write("".join(l + "\n" for l in kept).encode()))
        if sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.max_iters, initial=resumed_step or 0, dynamic_ncols=True)
        if cfg.wandb_log:
            import wandb
            self.wandb = wandb.init(project=cfg.wandb_project, config=cfg.to_dict(), dir=cfg.out_dir,
                                    name=cfg.wandb_run_name or Path(cfg.out_dir).name)

    def say(self, text: str):
        if self.bar:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def log(self, record: dict, text: str):
        if not self.enabled:
            return
        with open(self.metrics, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        self.say(text)

    def advance(self, step: int):
        if self.bar:
            self.bar.update(step - self.bar.n)

    def close(self):
        if self.bar:
            self.bar.close()
        if self.wandb:
            self.wandb.finish()


# -----------------------------------------------------------------------------
# the run

def train(cfg: Config, world: World, device: torch.device, dtype: torch.dtype, backend: str,
          accum: int, meta) -> dict:
    """`meta` is check_dataset's result (None: the data is yet to be prepared)."""
    meta = ensure_dataset(cfg, world, meta)
    data_dir = dataset_dir(cfg)
    out_dir = Path(cfg.out_dir)
    error = None
    if world.is_master:  # find out now, not at the first checkpoint, that out_dir is unusable
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            for path in checkpoint.remove_stale_temporaries(out_dir):
                print(f"removed {path}, left by a run that was killed while writing", flush=True)
            with tempfile.TemporaryFile(dir=out_dir):
                pass
        except OSError as e:
            error = (f"out_dir {out_dir} cannot be written ({e.strerror or e}): choose another "
                     f"--out_dir or fix its permissions")
    agree_or_raise(error, world, "rank 0 cannot write to out_dir: see its message")
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    tokens_per_step = cfg.global_batch_size * cfg.block_size

    # Same seed on every rank for the init, so weights do not depend on the world size.
    torch.manual_seed(cfg.seed)
    model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, bias=cfg.bias,
                      block_size=cfg.block_size, vocab_size=meta["vocab_size"], dropout=cfg.dropout)
    raw_model = GPT(GPTConfig(**model_args)).to(device)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate,
                                               (cfg.beta1, cfg.beta2), device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    loader = ShardedTokenLoader(data_dir / "train.bin", meta["dtype"], cfg.block_size, cfg.batch_size,
                                cfg.global_batch_size, world.rank, world.size, cfg.seed, device)
    n_eval = cfg.eval_iters * cfg.global_batch_size  # not per rank: the same windows for any launch
    eval_sets = {}
    for split in ("train", "val"):
        tokens = open_tokens(data_dir / f"{split}.bin", meta["dtype"])
        eval_sets[split] = (tokens, eval_starts(len(tokens), cfg.block_size, n_eval))
    # Each rank gets its own dropout stream, derived from the one seed.
    torch.manual_seed(int(np.random.SeedSequence([cfg.seed, world.rank]).generate_state(1)[0]))

    step, best_val, ckpt, error = 0, float("inf"), None, None
    if world.is_master:  # only rank 0 reads: other hosts need no copy of the file
        try:
            ckpt = checkpoint.load_for_resume(cfg, model_args)
        except ConfigError as e:
            error = str(e)
    if world.size > 1:
        ckpt, error = checkpoint.share_from_rank0(ckpt, error, world.group)
    if error:
        raise ConfigError(error)
    resumed_from = ckpt and ckpt["path"]
    if ckpt is not None:
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        loader.load_state_dict(ckpt["loader"])
        step, best_val = ckpt["step"], ckpt["best_val_loss"]
        if ckpt["world_size"] == world.size:
            checkpoint.restore_rng_states(ckpt["rng"], world.rank)
        elif world.is_master:
            print(f"note: {resumed_from} was written by {ckpt['world_size']} processes; the data "
                  f"order continues exactly, dropout streams are derived afresh", flush=True)
        del ckpt
    start_step = step

    model = torch.compile(raw_model) if cfg.compile else raw_model
    eval_model = model
    if world.size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    log = Logger(cfg, start_step if resumed_from else None, world.is_master)
    if world.is_master:
        run_info = dict(torch=torch.__version__, python=sys.version.split()[0], world_size=world.size,
                        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
                        backend=backend, dtype=str(dtype).removeprefix("torch."),
                        accumulation_steps=accum, tokens_per_step=tokens_per_step)
        write_json(out_dir / "config.json", {"config": cfg.to_dict(), "run": run_info})
        write_json(out_dir / "meta.json", meta)
        log.say(json.dumps(cfg.to_dict(), indent=1))
        log.say(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | tokens per optimizer step: "
                f"{tokens_per_step:,} = {cfg.global_batch_size} sequences x {cfg.block_size} tokens "
                f"({cfg.batch_size} per micro-batch x {world.size} processes x {accum} accumulation steps)")
        if resumed_from:
            log.say(f"resuming from {resumed_from} at step {step}")

    saved_step = start_step if resumed_from else None  # the step last.pt holds

    def save_checkpoint(val_loss, best: bool):
        nonlocal saved_step
        # Weights are the same on every rank, so every rank makes the same decision.
        if not all(torch.isfinite(p).all() for p in raw_model.parameters()):
            raise RunError(diverged(f"the weights hold NaN or inf at step {step}", cfg, saved_step))
        rng = checkpoint.gather_rng_states(world.size, world.group)
        failure = None
        if world.is_master:
            state = dict(format=checkpoint.FORMAT, model=raw_model.state_dict(),
                         optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), step=step,
                         tokens_seen=step * tokens_per_step, val_loss=val_loss, best_val_loss=best_val,
                         config=cfg.to_dict(), model_args=model_args, loader=loader.state_dict(),
                         rng=rng, world_size=world.size)
            try:
                checkpoint.save(state, out_dir, best)
            except (OSError, RuntimeError) as e:  # a full disk surfaces as either
                failure = checkpoint.first_line(e)
        # also the barrier that keeps ranks from running ahead of the write
        if any_rank(failure is not None, world):
            failure = failure or "see rank 0's log"
            raise RunError(f"rank 0 could not write a checkpoint at step {step} ({failure}). The "
                           f"previous last.pt is intact: free disk space or choose another out_dir, "
                           f"then relaunch with resume=auto.")
        saved_step = step

    val_loss, t_last, last_log_step, stopped = None, time.time(), step, False
    with StopSignal() as stop, collective_failures_explained(world, cfg, lambda: f"step {step}"):
        while True:
            at_end = step >= cfg.max_iters
            if (step % cfg.eval_interval == 0 or at_end) and not (step == start_step and resumed_from):
                losses = {s: evaluate(eval_model, *eval_sets[s], cfg, world, device, autocast)
                          for s in eval_sets}
                val_loss = losses["val"]
                if not math.isfinite(val_loss):
                    raise RunError(diverged(f"the validation loss is {val_loss} at step {step}", cfg,
                                            saved_step))
                improved = val_loss < best_val
                best_val = min(best_val, val_loss)
                log.log({"step": step, "train_eval_loss": losses["train"], "val_loss": val_loss,
                         "tokens_seen": step * tokens_per_step},
                        f"step {step}: train loss {losses['train']:.4f}, val loss {val_loss:.4f}")
                if step > start_step and (cfg.always_save_checkpoint or improved or at_end):
                    save_checkpoint(val_loss, improved)
                t_last, last_log_step = time.time(), step  # throughput counts training time only
            if at_end:
                break
            if stop.agreed(world):
                save_checkpoint(val_loss, best=False)
                log.say(f"stopped by SIGTERM at step {step}; {out_dir}/last.pt holds it: "
                        f"relaunch with resume=auto to continue")
                stopped = True
                break

            if loader.epoch_done:
                loader.set_epoch(loader.epoch + 1)
            lr = get_lr(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = accumulate_gradients(model, loader, accum, autocast, scaler)
            grad_norm = None
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_interval == 0 or step == cfg.max_iters:
                if world.size > 1:  # reduce at log time only: one small all-reduce per log line
                    dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
                    step_loss /= world.size
                loss_value = step_loss.item()
                if not math.isfinite(loss_value):
                    raise RunError(diverged(f"the training loss is {loss_value} at step {step}", cfg,
                                            saved_step))
                elapsed, t_last = time.time() - t_last, time.time()
                steps_done, last_log_step = step - last_log_step, step
                record = {"step": step, "loss": loss_value, "lr": lr,
                          "tokens_per_sec": steps_done * tokens_per_step / elapsed}
                if grad_norm is not None:
                    record["grad_norm"] = grad_norm.item()
                text = (f"step {step}: loss {loss_value:.4f}, lr {lr:.2e}, "
                        f"{record['tokens_per_sec']:,.0f} tok/s")
                mfu = raw_model.estimate_mfu(cfg.batch_size * accum * steps_done, elapsed,
                                             cfg.peak_flops or None) if device.type == "cuda" else None
                if mfu is not None:
                    record["mfu"] = mfu
                    text += f", mfu {mfu * 100:.1f}%"
                log.log(record, text)
            log.advance(step)

    log.close()
    return {"step": step, "val_loss": val_loss, "best_val_loss": best_val, "stopped": stopped}


def join_process_group(cfg: Config, world: World, backend: str):
    """init_process_group, with a message that says what to check when peers never come."""
    address = f"{os.environ.get('MASTER_ADDR', '(MASTER_ADDR unset)')}:{os.environ.get('MASTER_PORT', '(MASTER_PORT unset)')}"
    timeout = timedelta(seconds=cfg.dist_timeout)
    try:
        store, _, _ = next(dist.rendezvous("env://", world.rank, world.size, timeout=timeout))
        # torchrun restarts a failed group against the same store, where the previous attempt's
        # addresses linger: a new rank could read a dead peer's and fail. A prefix per attempt
        # keeps each attempt's keys apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                                rank=world.rank, world_size=world.size, timeout=timeout)
    except (RuntimeError, ValueError) as e:  # torch's DistError family is RuntimeError
        raise RunError(
            f"rank {world.rank} on {socket.gethostname()} could not form the process group of "
            f"{world.size} ranks at {address} within dist_timeout={cfg.dist_timeout:g}s "
            f"({checkpoint.first_line(e, 300)}). Check that every host started its ranks with the "
            f"same MASTER_ADDR, MASTER_PORT and WORLD_SIZE; that {address} is reachable from every "
            f"host (address, port, firewall); and that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name "
            f"the network interface that links the hosts.") from None
    # Small CPU messages (stop flags, RNG states, checkpoint bytes) go through gloo, also under NCCL.
    world.group = dist.new_group(backend="gloo") if backend != "gloo" else None


def check_group(world: World, device: torch.device, backend: str):
    """One small all-reduce with a known answer, so a broken fabric fails now, not at step 500."""
    if world.size == 1:
        return
    probe = torch.tensor([world.rank + 1.0], device=device)
    dist.all_reduce(probe)
    expected = world.size * (world.size + 1) / 2
    if probe.item() != expected:
        raise RunError(f"the startup all-reduce over {backend} gave {probe.item()}, not "
                          f"{expected}: the connection between ranks is broken")


def main(cfg: Config) -> dict:
    """Set up the process group for this launch, train, and always tear it down."""
    world = find_world()
    device = pick_device(cfg, world)
    dtype = pick_dtype(cfg, device)
    backend = pick_backend(cfg, device)
    meta = check_dataset(cfg)
    accum = accumulation_steps(cfg, world)  # fail on every rank before anyone waits for a peer
    if device.type == "cpu":  # ranks on one host share its cores
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // world.local_size))
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    if world.size > 1:
        join_process_group(cfg, world, backend)
    print(f"host {socket.gethostname()} | rank {world.rank} | local rank {world.local_rank} | "
          f"world size {world.size} | device {device} | backend {backend if world.size > 1 else 'none'}",
          flush=True)
    try:
        with collective_failures_explained(world, cfg, lambda: "before the first step"):
            check_group(world, device, backend)
            return train(cfg, world, device, dtype, backend, accum, meta)
    finally:
        if dist.is_initialized():
            # DDP sits in reference cycles; if it outlives the group, gloo's threads can
            # abort the process at exit ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()


def strip_local_rank(argv: list[str]) -> list[str]:
    """Accept torch.distributed.launch's --local-rank=N / --local_rank N and export LOCAL_RANK."""
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in ("--local-rank", "--local_rank"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if not value.isdigit():
                raise ConfigError(f"{name} needs a number, e.g. {name}=0, got {value!r}")
            i += 1 if "=" in arg else 2
            os.environ.setdefault("LOCAL_RANK", value)
            continue
        rest.append(arg)
        i += 1
    return rest


def cli(argv=None):
    """Exit 2 for a config or data problem, 1 for a failed run: one line saying what to do,
    with the traceback only under --debug."""
    args = sys.argv[1:] if argv is None else list(argv)
    if "-h" in args or "--help" in args:
        defaults = "\n".join(f"  --{k}={v if isinstance(v, str) else repr(v)}"
                             for k, v in Config().to_dict().items())
        print(f"{__doc__}\n--debug shows the traceback of an error.\n\nConfig names and their defaults "
              f"(README.md explains each):\n{defaults}")
        return
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        result = main(resolve(strip_local_rank(args)))
    except (ConfigError, RunError) as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    if result["stopped"]:  # like any process ended by SIGTERM, but only after saving
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    cli()
