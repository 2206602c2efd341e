"""Train a GPT from scratch, the same way under every launcher.

    python train.py                                   # CPU-sized default: char-level Shakespeare
    python train.py configs/shakespeare_char.py       # the baby GPT, one GPU
    torchrun --standalone --nproc_per_node=4 train.py configs/gpt_small.py
    python train_spawn.py --nproc=2                   # torch.multiprocessing.spawn
    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py &
    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py
    # two hosts: on each, with --node_rank=0 on the first and 1 on the second
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST_A --master_port=29500 train.py

Arguments are config files (plain Python) and --name=value overrides (docs/config.md); ranks come
from the launcher's environment (world.py). Only rank 0 writes into out_dir (each rank its shards of
a sharded checkpoint). A mistake ends every rank at once, with one message (docs/troubleshooting.md)."""

import math
import signal
import sys
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import checkpoint
import parallel
import pretrained
import sharded
from collectives import (Agreement, agree_or_raise, any_rank, collective_failures_explained, differs_from_rank0,
                         first_error, on_rank0, process_group)
from config import PER_HOST, Config, resolve
from data.files import LIBC, remove
from errors import (CheckpointNotWritten, ConfigError, Diverged, LogNotWritten, UnreadableCheckpoint, first_line,
                    reported, signals_unwind)
from evals import hellaswag
from evals.loss import val_loss
from loader import Dataset, ShardedTokenLoader, eval_starts, token_splits
from logger import Logger
from model import GPT, GPTConfig
from world import StopSignal, World, autocast, setup, strip_local_rank


# -----------------------------------------------------------------------------
# schedule, one optimizer step

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


def dropout_seed(seed: int, rank: int, step: int) -> int:
    """Each rank's own dropout stream at each step, a function of these alone: a resume at any step
    draws the masks the uninterrupted run drew, with no RNG state in the checkpoint."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


def accumulate_gradients(model, raw_model, loader, accum: int, autocast, scaler, sync: bool = True, ranks: int = 1):
    """Forward and backward over `accum` micro-batches (sync=False: no all-reduce, for bench.py); the mean loss."""
    step_loss = 0.0
    for micro in range(accum):
        x, y = loader.next_batch()
        # gradients are communicated on the last micro-step only (DDP's no_sync, FSDP2's set_requires_gradient_sync)
        with parallel.skip_gradient_sync(model, raw_model, skip=not (sync and micro == accum - 1)):
            with autocast:
                _, loss = model(x, y)
            # a micro-batch's mean loss / (accum x ranks): its gradient, summed over both, is the global mean
            scaler.scale(loss / (accum * ranks)).backward()
        step_loss += loss.detach() / accum
    return step_loss


def optimizer_step(run: "Run", sync: bool = True):
    """One optimizer step over the global batch: micro-steps, clip, step. Returns this rank's
    mean loss (a tensor: reading it would wait for the GPU) and the gradient norm (or None)."""
    if run.cfg.dropout > 0:  # (the only random draws in a step; torch.manual_seed takes 0.1 ms)
        torch.manual_seed(dropout_seed(run.cfg.seed, run.world.rank, run.step))
    step_loss = accumulate_gradients(run.model, run.raw_model, run.loader, run.world.accum, run.autocast,
                                     run.scaler, sync, run.world.size)
    grad_norm = None
    if run.cfg.grad_clip > 0:
        run.scaler.unscale_(run.optimizer)
        grad_norm = parallel.clip_grad_norm(run.raw_model, run.cfg.grad_clip)  # over all shards
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=not isinstance(run.model, parallel.DDP))  # (DDP's are views of its buckets)
    return step_loss, grad_norm


# -----------------------------------------------------------------------------
# the run: built once, with all loop state in one place

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
    hellaswag: list | None    # HellaSwag's examples, rendered (None when hellaswag_interval is 0)
    model_args: dict
    vocab: dict               # what the ids mean: meta.json's tokenizer (and chars), kept in every checkpoint
    autocast: object          # torch.autocast for bfloat16/float16, a null context for float32
    step: int = 0  # loop state from here on
    best_val_loss: float = math.inf
    val_loss: float | None = None
    resumed_from: str | None = None
    saved: tuple | None = None  # for messages: (name, step, True) this run wrote, or (path, step, False) resumed
    pending: sharded.Background | None = None  # async_checkpoint: the save being written
    hellaswag_step: int = -1  # the step HellaSwag was last evaluated at: a resume neither repeats nor skips one
    history: str | None = None  # rank 0's: the resumed checkpoint's log, which metrics.jsonl starts with

    def state_dict(self, tensors: bool = True, log: str = "") -> dict:
        """The file format's checkpoint, or (tensors=False) the plain values a sharded one keeps in
        run.json, `log` (metrics.jsonl so far) among them. Every rank calls it: FSDP gathers to rank 0."""
        state = dict(format=checkpoint.FORMAT, scaler=self.scaler.state_dict(), step=self.step, val_loss=self.val_loss,
                     tokens_seen=self.step * self.cfg.tokens_per_step, best_val_loss=self.best_val_loss,
                     hellaswag_step=self.hellaswag_step, config=self.cfg.to_dict(), model_args=self.model_args,
                     vocab=self.vocab, loader=self.loader.state_dict(), world_size=self.world.size, log=log)
        if tensors:
            state["model"], state["optimizer"] = parallel.full_state(self.raw_model, self.optimizer)
        return state

    def load_state_dict(self, ckpt: dict):
        """Every rank calls it. File format: only rank 0's ckpt holds the tensors (the others'
        are None). Sharded: every rank reads its own part, resharded to this world by DCP."""
        chosen = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        if ckpt.get("sharded"):  # every rank loads its own shards: resume=auto, from its own out_dir (by host)
            path = Path(self.cfg.out_dir) / Path(ckpt["path"]).name if self.cfg.resume == "auto" else ckpt["path"]
            sharded.load_run(Path(path), self.raw_model, self.optimizer, ckpt, self.world)
        else:
            parallel.load_full_state(self.raw_model, self.optimizer, self.world, ckpt)
        for group, mine in zip(self.optimizer.param_groups, chosen):  # AdamW as this run set it, not as saved
            group.update(mine)
        if not parallel.all_finite(self.raw_model, self.world, self.optimizer):  # (save() refuses them)
            raise UnreadableCheckpoint(f"cannot read checkpoint {ckpt['path']}: its weights or moments hold NaN or inf")
        self.step, self.best_val_loss, self.val_loss = ckpt["step"], ckpt["best_val_loss"], ckpt.get("val_loss")
        self.resumed_from, self.saved = ckpt["path"], (str(ckpt["path"]), ckpt["step"], False)
        if ckpt["scaler"] or not self.scaler.is_enabled():  # a disabled scaler ignores a saved one
            self.scaler.load_state_dict(ckpt["scaler"])
        elif self.world.is_master:  # the dtype changed to float16 on this resume
            print(f"note: {self.resumed_from} was not trained in float16: the loss scale starts afresh", flush=True)
        self.loader.load_state_dict(ckpt["loader"])
        self.hellaswag_step = ckpt.get("hellaswag_step", self.step)  # older files: as if evaluated there
        self.history = ckpt.get("log")  # (older files hold none: the log beside them is read)

    def save(self, best: bool, log: Logger):
        self.wait_for_save()  # at most one background save in flight (and the messages below name it)
        log.check(self.world, self.saved)  # no checkpoint past a log line that was lost (a resume would skip it)
        if not parallel.all_finite(self.raw_model, self.world, self.optimizer):  # the same answer on every rank
            raise Diverged(f"weights or moments are NaN or inf at step {self.step}", self, self.saved)
        out_dir, failure = Path(self.cfg.out_dir), None
        last = out_dir / f"last{'.dcp' if self.cfg.checkpoint_format == 'sharded' else '.pt'}"
        rotate, fresh = checkpoint.lineage(out_dir, last, self.resumed_from, self.saved, self.cfg.resume)
        try:
            if fresh and self.world.is_master:  # an earlier run's best would pass for this one's (sample.py)
                for name in ("best.pt", "best.dcp"):
                    remove(out_dir / name)
            if self.cfg.checkpoint_format == "sharded":  # every rank writes its own part
                self.pending = sharded.save_run(self.raw_model, self.optimizer, self.state_dict(False, log.text()),
                                                out_dir, best, self.world, self.cfg.async_checkpoint, rotate)
            else:
                state = self.state_dict(log=log.text())
                if self.world.is_master:
                    checkpoint.save(state, out_dir, best, rotate)
        except (OSError, RuntimeError) as e:  # a full disk surfaces as either
            failure = first_line(e)
        # also the barrier that keeps the other ranks from running ahead of the write
        if any_rank(failure is not None, self.world):
            raise CheckpointNotWritten(self.step, first_error(failure, self.world), self.saved)
        if self.pending is None:
            self.saved = (last.name, self.step, True)

    def wait_for_save(self) -> tuple:
        """Every rank: wait for the background save in flight (all stop if it failed); saved, up to date."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            failure = pending.failure(wait=True)
            if any_rank(failure is not None, self.world):
                raise CheckpointNotWritten(pending.step, first_error(failure, self.world), self.saved)
            self.saved = ("last.dcp", pending.step, True)
        return self.saved

    def close(self):
        """At the end, failed or not, a background save finishes (and may commit): else its part is unwritten."""
        if self.pending is not None:
            self.pending.failure(wait=True)


def build_run(cfg: Config, world: World, meta: dict) -> Run:
    """Model (sharded for FSDP), optimizer, scaler, loader and eval windows; then the checkpoint,
    if one continues this run, or GPT-2's weights; then compile and DDP, which wrap the model."""
    torch.manual_seed(cfg.seed)  # the same init on every rank: the weights do not depend on the world size
    model_args = on_rank0(lambda: pretrained.model_args(cfg, meta), world)  # (GPT-2's shape: rank 0 reads it)
    # an impossible size is refused before anything is allocated (hosts may differ: agree)
    agree_or_raise(parallel.memory_problem(GPTConfig(**model_args), cfg, world), world)
    # FSDP: only rank 0 builds the whole model; every rank gets its shard of rank 0's weights
    raw_model = parallel.build(lambda: GPT(GPTConfig(**model_args)), world, cfg.fsdp_reshard)
    parallel.set_activation_checkpointing(raw_model, cfg.activation_checkpointing)
    # (fused AdamW cannot take FSDP's float16 scaler: its inf flag has shape [1], not [])
    fused = world.strategy == "ddp" or world.dtype != torch.float16
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                               world.device.type, fused)
    splits = token_splits(cfg, meta, world=world)
    n_eval = cfg.eval_iters * cfg.global_batch_size  # not per rank: the same windows for any launch
    run = Run(cfg=cfg, world=world, raw_model=raw_model, model=raw_model, optimizer=optimizer,
              scaler=parallel.make_scaler(world), model_args=model_args,
              vocab={k: meta[k] for k in ("tokenizer", "chars") if k in meta},
              loader=ShardedTokenLoader(splits["train"], cfg.block_size, cfg.batch_size, cfg.global_batch_size,
                                        world.rank, world.size, cfg.seed, world.device),
              eval_sets={split: (tokens, eval_starts(tokens, cfg.block_size, n_eval))
                         for split, tokens in splits.items()},
              hellaswag=(hellaswag.load_on_every_rank(cfg.hellaswag_path, meta, cfg.block_size, world)
                         if cfg.hellaswag_interval else None),
              autocast=autocast(world))
    # rank 0 reads and checks the file (other hosts need no copy); the others get its run state
    ckpt = checkpoint.resume(cfg, model_args, world, run.load_state_dict, meta)
    if ckpt is not None and cfg.init_from == "resume":  # the run it continues began there (export_hf guards it)
        cfg.init_from = ckpt["config"].get("init_from", "resume")
    if ckpt is None and pretrained.is_pretrained(cfg.init_from):
        ckpt = on_rank0(lambda: {"model": pretrained.load_state(cfg.init_from, raw_model)}, world, ("model",))
        parallel.load_full_state(raw_model, optimizer, world, ckpt)
    del ckpt  # rank 0's whole copy, and under FSDP its whole first model, are garbage now:
    LIBC and LIBC.malloc_trim(0)  # back to the OS (glibc's freed buffers under 4 MB), or resident through training
    run.model = parallel.wrap(torch.compile(raw_model) if cfg.compile else raw_model, raw_model, world)
    return run


# -----------------------------------------------------------------------------
# the loop

def eval_and_save(run: Run, log: Logger, at_end: bool, start_step: int):
    """Both splits' loss; then a checkpoint when one is due (never for the step a resume began at)."""
    cfg, world = run.cfg, run.world
    losses = {split: val_loss(run.model, tokens, starts, cfg.block_size, cfg.batch_size, world, run.autocast,
                              parallel.is_fsdp(run.raw_model))
              for split, (tokens, starts) in run.eval_sets.items()}
    run.val_loss = losses["val"]
    if not math.isfinite(run.val_loss):
        raise Diverged(f"the validation loss is {run.val_loss} at step {run.step}", run, run.wait_for_save())
    improved, run.best_val_loss = run.val_loss < run.best_val_loss, min(run.best_val_loss, run.val_loss)
    log.log({"step": run.step, "train_eval_loss": losses["train"], "val_loss": run.val_loss,
             "tokens_seen": run.step * cfg.tokens_per_step},
            f"step {run.step}: train loss {losses['train']:.4f}, val loss {run.val_loss:.4f}")
    if run.step > start_step and (cfg.always_save_checkpoint or improved or at_end):
        run.save(improved, log)
    log.restart_clock(run.step)


def train(cfg: Config, world: World, dataset: Dataset) -> dict:
    if cfg.checkpoint_format == "sharded":
        sharded.check_shared(Path(cfg.out_dir), world, "to write sharded checkpoints")
    meta = dataset.ready(world)
    run = build_run(cfg, world, meta)
    start_step, stopped, agree = run.step, 0, Agreement(world, run.step)  # stopped: the signal that stopped the run
    with Logger.start(run, meta) as log, StopSignal() as stop, \
            collective_failures_explained(world, cfg.dist_timeout, lambda: f"step {run.step}"), closing(run):
        log.check(world, run.saved)
        while True:
            lr = get_lr(run.step, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            at_end, resumed_here = run.step >= cfg.max_iters, run.step == start_step and run.resumed_from
            every = cfg.hellaswag_interval  # HellaSwag before eval_and_save, so a checkpoint there records it
            if every and (run.step % every == 0 or at_end) and run.step > run.hellaswag_step and not (
                    at_end and resumed_here):  # (nothing left to train: nothing saved, so eval.py's to do)
                # (the unwrapped model: an eval forward needs no DDP; under FSDP it is the sharded module)
                score, _ = hellaswag.evaluate(run.raw_model, run.hellaswag, world, run.autocast, cfg.batch_size,
                                              parallel.is_fsdp(run.raw_model))
                if score.not_finite:  # (NaN's argmin is ending 0: a diverged model scored 1 in 4)
                    raise Diverged(f"HellaSwag's losses are NaN or inf at step {run.step}", run, run.wait_for_save())
                run.hellaswag_step = run.step
                log.hellaswag(run.step, score)
            if (run.step % cfg.eval_interval == 0 or at_end) and not resumed_here:
                eval_and_save(run, log, at_end or stopped > 0, start_step)  # a stop's step is always saved
            if at_end or stopped:
                break

            step_loss, grad_norm = optimizer_step(run)  # micro-steps, clip, step
            run.step += 1

            at_log = run.step % cfg.log_interval == 0 or run.step == cfg.max_iters
            if at_log or agree.due(run.step, stop.received):  # a stop waits about 2 s, or 10 quick steps
                # one all-reduce: the loss, any rank's stop signal, bad token id, log failure, failed background save
                loss, signum, (bad_tokens, log_failure, save_failure) = agree(
                    step_loss, stop.received, [run.loader.tokens.bad, log.failure,
                                               run.pending and run.pending.failure(wait=False)], run.step)
                if bad_tokens:
                    raise ConfigError(bad_tokens)
                if log_failure:
                    raise LogNotWritten(log_failure, run.wait_for_save())
                if save_failure:
                    raise CheckpointNotWritten(run.pending.step, save_failure, run.saved)
                if not math.isfinite(loss):
                    raise Diverged(f"the training loss is {loss} at step {run.step}", run, run.wait_for_save())
                if at_log:
                    log.train_step(run.step, loss, lr, grad_norm)
                if signum and run.step < cfg.max_iters:  # the last step still evaluates and saves
                    stopped = signum
                    if run.step % cfg.eval_interval:  # (an eval step is evaluated at the loop's top, then saved)
                        run.save(False, log)
                        break
            log.advance(run.step)
        run.wait_for_save()
        if stopped:
            log.say(f"stopped by {signal.Signals(stopped).name} at step {run.step}; {cfg.out_dir}/"
                    f"{run.saved[0]} holds it: relaunch with resume=auto to continue")
        log.check(world, run.saved)  # the last lines were written after the last log step's check
    return {"step": run.step, "val_loss": run.val_loss, "best_val_loss": run.best_val_loss, "stopped": stopped}


def main(cfg: Config) -> dict:
    """Find this process's place, check everything it can alone, then train inside the group."""
    world = setup(cfg)  # ranks, device, dtype, backend, accumulation: checked before any group
    dataset = Dataset(cfg)
    # rank 0 locks out_dir before the group forms (a second run into it stops at the first agreement)
    with checkpoint.locked_out_dir(cfg.out_dir, world, dataset.dir) as unusable, process_group(world, cfg.dist_timeout):
        # rank 0 cannot use out_dir (busy, unwritable), or a rank's config is not rank 0's: every rank stops
        agree_or_raise(differs_from_rank0(cfg.to_dict(), world, PER_HOST) or unusable, world)
        return train(cfg, world, dataset)


def cli(argv=None):
    """Exit 2 for a config or data problem, 1 for a failed run: one line saying what to do, with the
    traceback only under --debug. SIGTERM outside training ends as Ctrl-C does (not leaving run.lock)."""
    args = sys.argv[1:] if argv is None else list(argv)
    with reported(debug="--debug" in args), signals_unwind():  # (also --help | head: a reader that went away)
        if "-h" in args or "--help" in args:
            return print(f"{__doc__}\n--debug shows the traceback of an error.\n\n{Config.defaults()}", flush=True)
        result = main(resolve(strip_local_rank([a for a in args if a != "--debug"])))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # all saved: a Ctrl-C as Python exits changes nothing (a traceback)
    if result["stopped"]:  # like any process ended by the signal, but only after saving
        sys.exit(128 + result["stopped"])


if __name__ == "__main__":
    cli()
