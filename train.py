"""Train a GPT from scratch, the same way under every launcher.

    python train.py                                   # CPU-sized default: char-level Shakespeare
    python train.py configs/shakespeare_char.py       # the baby GPT, one GPU
    torchrun --standalone --nproc_per_node=4 train.py configs/gpt_small.py
    python train_spawn.py --nproc=2                   # torch.multiprocessing.spawn
    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py &
    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py
    # two hosts: on each, with --node_rank=0 on the first and 1 on the second
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST_A --master_port=29500 train.py

Arguments are config files (plain Python) and --name=value overrides; see config.py and the
table in README.md. Ranks come from the launcher's environment (launch.py finds them). Only
global rank 0 writes into out_dir.

One rule governs start-up: every problem is found before the process group forms, by every
rank alike, or, when only some ranks can see it (rank 0's checkpoint, one host's data), agreed
on by all ranks before anyone acts on it. So a mistake ends every rank at once with the same
message, and no rank is left waiting for a peer that has already given up.
"""

import math
import signal
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import parallel
import pretrained
from config import Config, resolve
from errors import ConfigError, Diverged, GlobalBatchIndivisible, RunError
from launch import (StopSignal, World, agree_max, agree_or_raise, collective_failures_explained, find_world,
                    first_error, mean_over_ranks, pick_backend, pick_device, pick_dtype, process_group,
                    strip_local_rank, use_device)
from data.dataset import split_shards
from loader import Dataset, ShardedTokenLoader, Tokens, dataset_dir, eval_starts, windows_to_batch
from logger import Logger
from model import GPT, GPTConfig


# -----------------------------------------------------------------------------
# schedule, evaluation, one optimizer step

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
    # FSDP gathers weights in every forward, so every rank runs as many as rank 0 (spares count 0)
    n = len(starts[::world.size]) if cfg.strategy == "fsdp" else len(mine)
    for i in range(0, n, cfg.batch_size):
        batch = mine[i:i + cfg.batch_size]
        x, y = windows_to_batch(tokens, batch if len(batch) else starts[:1], cfg.block_size, device)
        with autocast:
            _, loss = model(x, y)
        totals[0] += loss.to(totals.dtype) * y.numel() * (len(batch) > 0)
        totals[1] += y.numel() * (len(batch) > 0)
    if world.size > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    agree_or_raise(tokens.bad, world, "", share=True)  # an id past the vocabulary: all ranks stop
    model.train()
    return (totals[0] / totals[1]).item()


def accumulate_gradients(model, raw_model, loader, accum: int, autocast, scaler, sync: bool = True):
    """Forward and backward over `accum` micro-batches; return this rank's mean loss (a tensor).
    sync=False skips the gradient all-reduce altogether (bench.py times the step without it)."""
    step_loss = 0.0
    for micro in range(accum):
        x, y = loader.next_batch()
        # Gradients are communicated on the last micro-step only (DDP's no_sync, FSDP2's
        # set_requires_gradient_sync); they add up locally on the others.
        with parallel.skip_gradient_sync(model, raw_model, skip=not (sync and micro == accum - 1)):
            with autocast:
                _, loss = model(x, y)
            # Each loss is a mean over one micro-batch; dividing by the number of
            # micro-steps makes the summed gradient the mean over the global batch.
            scaler.scale(loss / accum).backward()
        step_loss += loss.detach() / accum
    return step_loss


def optimizer_step(run: "Run", sync: bool = True):
    """One optimizer step over the global batch: micro-steps, clip, step. Returns this rank's
    mean loss (a tensor: reading it would wait for the GPU) and the gradient norm (or None)."""
    if run.loader.epoch_done:
        run.loader.set_epoch(run.loader.epoch + 1)
    step_loss = accumulate_gradients(run.model, run.raw_model, run.loader, run.accum, run.autocast, run.scaler,
                                     sync)
    grad_norm = None
    if run.cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        grad_norm = parallel.clip_grad_norm(run.raw_model, run.cfg.grad_clip)  # over all shards
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return step_loss, grad_norm


# -----------------------------------------------------------------------------
# the run: built once, with all loop state in one place

def accumulation_steps(cfg: Config, world: World) -> int:
    # Derive, then assert: one optimizer step sees global_batch_size sequences,
    # split into micro-batches of batch_size on each of the world.size processes.
    if cfg.global_batch_size % (cfg.batch_size * world.size):
        raise GlobalBatchIndivisible(cfg.global_batch_size, cfg.batch_size, world.size)
    return cfg.global_batch_size // (cfg.batch_size * world.size)


@dataclass
class Run:
    """What one training run is made of (build_run makes it) and the loop state it carries:
    state_dict() is what a checkpoint holds, load_state_dict() the one place a resume restores."""
    cfg: Config
    world: World
    raw_model: GPT            # the module itself: its state_dict has no module./_orig_mod. prefixes
    model: torch.nn.Module    # what trains: compiled and/or wrapped for DDP (FSDP shards raw_model in place)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loader: ShardedTokenLoader
    eval_sets: dict           # split -> (tokens, fixed window starts)
    model_args: dict
    accum: int                # micro-steps per optimizer step on each rank
    autocast: object          # torch.autocast for bfloat16/float16, a null context for float32
    tokens_per_step: int
    # loop state
    step: int = 0
    best_val_loss: float = math.inf
    val_loss: Optional[float] = None
    resumed_from: Optional[str] = None
    saved_step: Optional[int] = None  # the step last.pt holds, for messages

    def state_dict(self) -> dict:
        """Every rank calls it: the RNG states are gathered from all ranks."""
        rng = checkpoint.gather_rng_states(self.world.size, self.world.group)
        model, optimizer = parallel.full_state(self.raw_model, self.optimizer)  # FSDP: on rank 0 only
        return dict(format=checkpoint.FORMAT, model=model, optimizer=optimizer, scaler=self.scaler.state_dict(),
                    step=self.step, tokens_seen=self.step * self.tokens_per_step,
                    val_loss=self.val_loss, best_val_loss=self.best_val_loss,
                    config=self.cfg.to_dict(), model_args=self.model_args,
                    loader=self.loader.state_dict(), rng=rng, world_size=self.world.size)

    def load_state_dict(self, ckpt: dict):
        parallel.load_full_state(self.raw_model, self.optimizer, ckpt["model"], ckpt["optimizer"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.loader.load_state_dict(ckpt["loader"])
        self.step = self.saved_step = ckpt["step"]
        self.best_val_loss, self.resumed_from = ckpt["best_val_loss"], ckpt["path"]
        if ckpt["world_size"] == self.world.size:
            checkpoint.restore_rng_states(ckpt["rng"], self.world.rank)
        elif self.world.is_master:
            print(f"note: {self.resumed_from} was written by {ckpt['world_size']} processes; the "
                  f"data order continues exactly, dropout streams are derived afresh", flush=True)

    def save(self, best: bool):
        if not parallel.all_finite(self.raw_model, self.world):  # the same answer on every rank
            raise Diverged(f"the weights hold NaN or inf at step {self.step}", self.cfg.learning_rate,
                           self.saved_step)
        checkpoint.save_on_rank0(self.state_dict(), Path(self.cfg.out_dir), best, self.world)
        self.saved_step = self.step


def build_run(cfg: Config, world: World, device: torch.device, dtype: torch.dtype, accum: int,
              meta: dict) -> Run:
    """Model (sharded for FSDP), optimizer, scaler, loader and eval windows; then the checkpoint,
    if one continues this run, or GPT-2's weights; then compile and DDP, which wrap the model."""
    data_dir = dataset_dir(cfg)
    # Same seed on every rank for the init, so weights do not depend on the world size.
    torch.manual_seed(cfg.seed)
    if pretrained.is_pretrained(cfg.init_from):  # the shape is GPT-2's; rank 0 reads its config
        model_args = checkpoint.on_rank0(lambda: pretrained.model_args(cfg.init_from, cfg, meta), world)
    else:
        model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, bias=cfg.bias,
                          block_size=cfg.block_size, vocab_size=meta["vocab_size"], dropout=cfg.dropout,
                          pad_vocab_to=cfg.pad_vocab_to)
    raw_model = GPT(GPTConfig(**model_args)).to(device)
    parallel.set_activation_checkpointing(raw_model, cfg.activation_checkpointing)
    strategy = cfg.strategy if world.size > 1 else "ddp"  # one process: nothing to shard
    parallel.shard(raw_model, strategy, world, device, dtype, cfg.fsdp_reshard)  # the optimizer sees the shards
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate,
                                               (cfg.beta1, cfg.beta2), device.type)
    scaler = parallel.make_scaler(device, dtype, strategy)
    splits = {split: Tokens(shards, meta["vocab_size"]) for split, shards in split_shards(data_dir, meta).items()}
    loader = ShardedTokenLoader(splits["train"], cfg.block_size, cfg.batch_size, cfg.global_batch_size,
                                world.rank, world.size, cfg.seed, device)
    n_eval = cfg.eval_iters * cfg.global_batch_size  # not per rank: the same windows for any launch
    eval_sets = {split: (tokens, eval_starts(tokens, cfg.block_size, n_eval))
                 for split, tokens in splits.items()}
    # Each rank gets its own dropout stream, derived from the one seed.
    torch.manual_seed(int(np.random.SeedSequence([cfg.seed, world.rank]).generate_state(1)[0]))
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    run = Run(cfg, world, raw_model, raw_model, optimizer, scaler, loader, eval_sets, model_args, accum,
              autocast, tokens_per_step=cfg.global_batch_size * cfg.block_size)
    ckpt = checkpoint.load_on_rank0(cfg, model_args, world)
    if ckpt is not None:
        run.load_state_dict(ckpt)
        del ckpt
    elif pretrained.is_pretrained(cfg.init_from):
        weights = checkpoint.on_rank0(lambda: pretrained.load_state(cfg.init_from, raw_model), world)
        parallel.load_full_state(raw_model, optimizer, weights)
    run.model = parallel.wrap(torch.compile(raw_model) if cfg.compile else raw_model, raw_model, world, device)
    return run


# -----------------------------------------------------------------------------
# the loop

def train(cfg: Config, world: World, device: torch.device, dtype: torch.dtype, backend: str,
          accum: int, dataset: Dataset, lock: checkpoint.OutDirLock) -> dict:
    checkpoint.prepare_out_dir(Path(cfg.out_dir), world, lock)
    meta = dataset.ready(world)
    run = build_run(cfg, world, device, dtype, accum, meta)
    start_step, raw_model = run.step, run.raw_model
    mfu = ((lambda sequences, seconds: raw_model.estimate_mfu(sequences, seconds, cfg.peak_flops or None))
           if device.type == "cuda" else None)
    log = Logger(cfg, run.step if run.resumed_from else None, world.is_master, run.tokens_per_step, mfu)
    log.write_run_files(cfg, meta, dict(
        torch=torch.__version__, python=sys.version.split()[0], world_size=world.size,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        backend=backend, dtype=str(dtype).removeprefix("torch."), accumulation_steps=accum,
        tokens_per_step=run.tokens_per_step, model=run.model_args))
    log.say(f"{raw_model.get_num_params() / 1e6:.2f}M parameters | tokens per optimizer step: "
            f"{run.tokens_per_step:,} = {cfg.global_batch_size} sequences x {cfg.block_size} tokens "
            f"({cfg.batch_size} per micro-batch x {world.size} processes x {accum} accumulation steps)")
    if run.resumed_from:
        log.say(f"resuming from {run.resumed_from} at step {run.step}")
    elif pretrained.is_pretrained(cfg.init_from):
        log.say(f"weights from {cfg.init_from}: {run.model_args['n_layer']} layers, {run.model_args['n_head']} "
                f"heads, {run.model_args['n_embd']} wide, positions cropped to {cfg.block_size}")

    stopped = 0  # the signal that stopped the run
    with StopSignal() as stop, collective_failures_explained(world, cfg.dist_timeout,
                                                             lambda: f"step {run.step}"):
        while True:
            lr = get_lr(run.step, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            at_end = run.step >= cfg.max_iters
            if (run.step % cfg.eval_interval == 0 or at_end) and not (
                    run.step == start_step and run.resumed_from):
                losses = {s: evaluate(run.model, *run.eval_sets[s], cfg, world, device, run.autocast)
                          for s in run.eval_sets}
                run.val_loss = losses["val"]
                if not math.isfinite(run.val_loss):
                    raise Diverged(f"the validation loss is {run.val_loss} at step {run.step}",
                                   cfg.learning_rate, run.saved_step)
                improved = run.val_loss < run.best_val_loss
                run.best_val_loss = min(run.best_val_loss, run.val_loss)
                log.log({"step": run.step, "train_eval_loss": losses["train"], "val_loss": run.val_loss,
                         "tokens_seen": run.step * run.tokens_per_step},
                        f"step {run.step}: train loss {losses['train']:.4f}, val loss {run.val_loss:.4f}")
                if run.step > start_step and (cfg.always_save_checkpoint or improved or at_end):
                    run.save(best=improved)
                log.restart_clock(run.step)
            if at_end:
                break

            step_loss, grad_norm = optimizer_step(run)  # micro-steps, clip, step

            if run.step % cfg.log_interval == 0 or run.step == cfg.max_iters:
                loss = mean_over_ranks(step_loss, world)
                if not math.isfinite(loss):
                    raise Diverged(f"the training loss is {loss} at step {run.step}", cfg.learning_rate,
                                   run.saved_step)
                log.train_step(run.step, loss, lr, None if grad_norm is None else grad_norm.item(),
                               cfg.batch_size * accum)
            log.advance(run.step)
            # one all-reduce: a stop signal, or a token id past the vocabulary, on any rank
            signum, bad_tokens = agree_max([stop.received, run.loader.tokens.bad is not None], world)
            if bad_tokens:
                raise ConfigError(first_error(run.loader.tokens.bad, world))
            # the last step still evaluates; a signal then changes nothing
            if run.step < cfg.max_iters and (stopped := signum):
                run.save(best=False)
                log.say(f"stopped by {signal.Signals(stopped).name} at step {run.step}; {cfg.out_dir}/last.pt "
                        f"holds it: relaunch with resume=auto to continue")
                break

    log.close()
    return {"step": run.step, "val_loss": run.val_loss, "best_val_loss": run.best_val_loss,
            "stopped": stopped}


def main(cfg: Config) -> dict:
    """Find this process's place, check everything it can alone, then train inside the group."""
    world = find_world()
    device = pick_device(cfg.device, world)
    dtype = pick_dtype(cfg.dtype, device)
    backend = pick_backend(cfg.backend, device)
    dataset = Dataset(cfg)
    accum = accumulation_steps(cfg, world)
    use_device(device, dtype, world)
    # rank 0 locks out_dir before the group forms (a second run into it stops at the first agreement)
    with checkpoint.OutDirLock(cfg.out_dir, world) as lock, \
            process_group(world, device, backend, cfg.dist_timeout):
        return train(cfg, world, device, dtype, backend, accum, dataset, lock)


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
    if result["stopped"]:  # like any process ended by the signal, but only after saving
        sys.exit(128 + result["stopped"])


if __name__ == "__main__":
    cli()
