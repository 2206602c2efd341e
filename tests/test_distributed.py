"""Distributed training is exact: the numbers do not depend on how a run was launched or stopped.

Every test runs real gloo process groups on the CPU with a tiny float32 model.

Tolerances. Runs on different world sizes add the same float32 numbers in another order
(per-rank partial sums, then an all-reduce), which moves each result by a few ulps. Logged
losses and gradient norms then agree to ~1e-7 relative; we allow 1e-5. Weights are compared
on the scale of an update, not of the weight: Adam divides each gradient element by its own
running magnitude, so an element whose gradient nearly cancels carries a large relative error
into a step of up to lr (3e-3). Observed differences are ~1e-6 absolute after 8 steps; we
allow 1e-5, a third of a percent of one step. The bugs these tests exist for (a loss scaled by
the wrong count shows in the gradient norm, one rank's data or a replayed batch in the loss)
move these numbers by 1e-2 or more. The models have no biases: the key bias has an exactly-zero
true gradient, so Adam turns pure rounding noise there into whole-learning-rate steps.
"""

import math
import os
import shutil
import sys
from contextlib import nullcontext
from functools import partialmethod
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parallel
import train
from config import resolve
from errors import ConfigError
from harness import (STEPS, args_for, assert_close_runs, ckpt, make_char_dataset, max_diff, metrics,
                     read_epochs, record_epochs, run_ranks, run_world, train_log, train_run)


@pytest.fixture(scope="module")
def world_runs(char_data, tmp_path_factory):
    """The same 8 steps as (W=1, accum=4), (W=2, accum=2), (W=4, accum=1)."""
    root = tmp_path_factory.mktemp("world_runs")
    results = {w: train_run(w, char_data, root / f"w{w}") for w in (1, 2, 4)}
    return root, results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_world_size_does_not_change_losses_or_weights(world_runs, world_size):
    root, _ = world_runs
    assert_close_runs(root / "w1", root / f"w{world_size}")
    assert len(train_log(root / "w1")) == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_reports_the_single_process_val_loss(world_runs, world_size):
    root, results = world_runs
    ranks = results[world_size]
    assert len({r["val_loss"] for r in ranks}) == 1  # all-reduced: bit-equal on every rank
    assert ranks[0]["val_loss"] == pytest.approx(results[1][0]["val_loss"], rel=1e-6)
    evals = lambda w: [(r["step"], r["val_loss"]) for r in metrics(root / f"w{w}") if "val_loss" in r]
    assert [s for s, _ in evals(world_size)] == [0, 4, 8]
    assert [v for _, v in evals(world_size)] == pytest.approx([v for _, v in evals(1)], rel=1e-6)


def _high_scale(rank=0):
    """float16's grad scaler starts at 2**24: its first steps overflow, each halving the scale, until one does not."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    for cls in (torch.amp.GradScaler, ShardedGradScaler):
        cls.__init__ = partialmethod(cls.__init__, init_scale=2.0 ** 24)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, worlds, batch", [("ddp", (1, 3), 12), ("fsdp", (2, 4), 16)])  # 4: HSDP
def test_float16_skips_the_same_overflowing_steps_on_any_world_size(char_data, tmp_path, monkeypatch, strategy,
                                                                     worlds, batch):
    """A rank's backward divides its losses by the whole world's micro-batch count, and the ranks sum: float16's
    scaled values, and so the steps that overflow, are one process's. (With each rank's own count and an average,
    1 process skipped 5 steps and 3 skipped 6; FSDP on 2 skipped 6 and HSDP on 4 skipped 7. 3 processes: a
    division by 3 that 16 bits round otherwise, in bfloat16 too.)"""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    for cls in (torch.amp.GradScaler, ShardedGradScaler):  # (the in-process run's, undone after the test)
        monkeypatch.setattr(cls, "__init__", cls.__init__)
    _high_scale()
    skipped = []
    for w in worlds:
        train_run(w, char_data, tmp_path / f"w{w}", patch=_high_scale, dtype="float16", strategy=strategy,
                  n_layer=1, max_iters=12, lr_decay_iters=12, fsdp_shard_size=2 if w == 4 else 0, global_batch_size=batch)
        skipped.append([step for step, _, grad_norm in train_log(tmp_path / f"w{w}") if not math.isfinite(grad_norm)])
    assert skipped[0] == skipped[1] and len(skipped[0]) >= 3, skipped
    assert max_diff(ckpt(tmp_path / f"w{worlds[0]}"), ckpt(tmp_path / f"w{worlds[1]}")) < 1e-4


# --- point 2: one gradient all-reduce per optimizer step ------------------------------------

def _count_allreduces(rank):
    """Patch DDP's gradient hook (parallel._summed) so every bucket all-reduce is counted into $COUNT_FILE.rank,
    and whether the gradients it sums are its bucket itself (1) or tensors of their own (0) into .views.rank;
    whether each optimizer step leaves them in place (zeroed) for the next, into .kept.rank."""
    import os
    path, summed, step = Path(os.environ["COUNT_FILE"] + f".{rank}"), parallel._summed, train.optimizer_step

    def recording_step(run, sync=True):
        done = step(run, sync)
        with open(f"{path}.kept", "a") as f:
            f.write(str(int(all(p.grad is not None and not p.grad.any() for p in run.raw_model.parameters()))))
        return done
    train.optimizer_step = recording_step

    def counting_hook(state, bucket):
        path.write_text(str(int(path.read_text() or 0) + 1) if path.exists() else "1")
        storage = bucket.buffer().untyped_storage().data_ptr()
        with open(f"{path}.views", "a") as f:
            f.write(str(int(all(p.grad is not None and p.grad.untyped_storage().data_ptr() == storage
                                for p in bucket.parameters()))))
        return summed(state, bucket)
    parallel._summed = counting_hook


@pytest.mark.slow
@pytest.mark.parametrize("batch_size, accum", [(16, 1), (4, 4)])
def test_gradients_are_all_reduced_once_per_optimizer_step(char_data, tmp_path, monkeypatch,
                                                            batch_size, accum):
    # W=2, global batch 32: one micro-step, or four with no_sync on the first three
    monkeypatch.setenv("COUNT_FILE", str(tmp_path / "allreduces"))
    args = args_for(char_data, tmp_path / "out", batch_size=batch_size, global_batch_size=32,
                    max_iters=3, eval_interval=3)
    run_world(2, args, tmp_path / "results", patch=_count_allreduces)
    counts = [int((tmp_path / f"allreduces.{r}").read_text()) for r in range(2)]
    assert counts == [3, 3]  # a 0.03M-parameter model fits one bucket: one call per step
    views = [(tmp_path / f"allreduces.{r}.views").read_text() for r in range(2)]
    kept = [(tmp_path / f"allreduces.{r}.kept").read_text() for r in range(2)]
    # no copy of every gradient beside DDP's buckets (4 bytes a parameter), also in no_sync's micro-steps
    assert views == kept == ["111", "111"], (views, kept)


def test_ranks_on_one_host_share_its_cores(monkeypatch):
    """Each CPU rank takes its share of the cores it may run on: more threads than cores would have
    the ranks' threads wait on one another (set only when it changes: even the same count costs)."""
    from world import World, use_device
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for local_size in (2, 3, 8, 16):
        use_device(World(local_size=local_size))
    assert calls == [4, 2]  # 8 // 2 and 8 // 3; one thread each for 8 or 16 ranks, the count it has


def test_each_rank_says_where_it_stands_in_one_write(monkeypatch):
    """(print's two writes, the line and its end, interleaved two ranks' lines under PYTHONUNBUFFERED=1)"""
    from collectives import process_group
    from world import World
    writes = []

    class Unbuffered:
        write, flush = writes.append, lambda self: None
    monkeypatch.setattr(sys, "stdout", Unbuffered())
    with process_group(World(), 60):
        pass
    writes = [w for w in writes if w]  # (print's end="": an empty write, which interleaves nothing)
    assert len(writes) == 1 and writes[0].startswith("host ") and writes[0].endswith(" | backend none\n"), writes


def _accumulate(rank, world_size, data_dir, out_file, variant):
    """Build the tiny model under DDP, run one step's micro-batches, save the gradients."""
    import torch.distributed.nn  # noqa: F401  (before the group, as collectives._join does)
    dist.init_process_group("gloo")
    from loader import ShardedTokenLoader, Tokens
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = parallel.DDP(GPT(GPTConfig(block_size=16, vocab_size=23, n_layer=2, n_head=2, n_embd=32,
                                    bias=False)))
    loader = ShardedTokenLoader(Tokens.file(Path(data_dir) / "train.bin", "uint16"), 16, 2, 16, rank,
                                world_size, 0)
    loader.set_epoch(0)
    accum = 16 // (2 * world_size)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    calls = []
    model.register_comm_hook(None, lambda state, bucket: (calls.append(1), _allreduce(bucket))[1])
    if variant == "train.py":
        train.accumulate_gradients(model, model.module, loader, accum, nullcontext(), scaler)
    else:  # the classic bug: no_sync entered after the forward pass
        for micro in range(accum):
            x, y = loader.next_batch()
            _, loss = model(x, y)
            with model.no_sync() if micro < accum - 1 else nullcontext():
                (loss / accum).backward()
    if rank == 0:
        grads = {n: p.grad for n, p in model.module.named_parameters()}
        torch.save({"grads": grads, "calls": len(calls)}, out_file)
    del model  # DDP's reducer must go before its process group, or gloo may abort at exit
    dist.barrier()
    dist.destroy_process_group()


def _allreduce(bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    return allreduce_hook(None, bucket)


def _first_error(rank: int, world_size: int, out):
    from collectives import first_error, process_group
    from world import place
    world = place("cpu", "float32", "gloo")
    with process_group(world, 60):
        (out / f"rank{rank}.txt").write_text(first_error(None if rank == 0 else f"rank {rank}'s problem", world))


@pytest.mark.slow
def test_every_rank_reports_the_lowest_failing_ranks_message(tmp_path):
    run_ranks(_first_error, 3, tmp_path)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)] == ["rank 1's problem"] * 3


@pytest.mark.slow
def test_ddp_gradients_equal_single_process_gradients_of_the_global_batch(char_data, tmp_path):
    run_ranks(_accumulate, 1, str(char_data), tmp_path / "w1.pt", "train.py")
    run_ranks(_accumulate, 2, str(char_data), tmp_path / "w2.pt", "train.py")
    run_ranks(_accumulate, 2, str(char_data), tmp_path / "late.pt", "no_sync after forward")
    single, ddp, late = (torch.load(tmp_path / f, weights_only=True) for f in ("w1.pt", "w2.pt", "late.pt"))
    for name, grad in single["grads"].items():
        torch.testing.assert_close(ddp["grads"][name], grad, rtol=1e-5, atol=1e-7)
    assert ddp["calls"] == 1
    # Entering no_sync after the forward pass is too late: DDP arms its reducer in the forward,
    # so every micro-step's backward is all-reduced anyway: 4 all-reduces instead of 1. The
    # gradients still agree here (averaging is linear, so early averages add up to the same
    # mean); what the late no_sync costs is accum-times the gradient communication.
    assert late["calls"] == 4
    for name, grad in single["grads"].items():
        torch.testing.assert_close(late["grads"][name], grad, rtol=1e-5, atol=1e-7)


# --- points 5-7: resume exactly, on the same or another world size ---------------------------

@pytest.fixture(scope="module")
def half_w2(world_runs, char_data):
    """The first 4 of world_runs' W=2 steps, stopped there: each resume test continues a copy."""
    root, _ = world_runs
    train_run(2, char_data, root / "half-w2", max_iters=4)
    return root / "half-w2"


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_ddp_resume_is_bit_identical(world_runs, half_w2, char_data, tmp_path, dropout):
    # with dropout, each rank's masks must be drawn again as they were (train.dropout_seed);
    # those legs write the sharded format (DCP, every rank its part), the straight run a file
    legs, fmt = tmp_path / "legs", {"checkpoint_format": "sharded"} if dropout else {}
    if dropout == 0.0:  # world_runs' W=2 run is the straight run, half_w2 its first leg
        straight = world_runs[0] / "w2"
        shutil.copytree(half_w2, legs)
    else:
        straight = tmp_path / "straight"
        train_run(2, char_data, straight, dropout=dropout)
        train_run(2, char_data, legs, dropout=dropout, max_iters=4, **fmt)
    train_run(2, char_data, legs, dropout=dropout, resume="auto", **fmt)
    a, b = ckpt(straight), ckpt(legs, "last.dcp" if fmt else "last.pt")
    assert b["step"] == STEPS and a["loader"] == b["loader"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for pid, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][key]), (pid, key)
    assert train_log(straight) == train_log(legs)  # bit for bit, and no step logged twice


@pytest.mark.slow
@pytest.mark.parametrize("resume_world", [1, 4])
def test_resume_on_another_world_size_continues_with_the_next_global_batch(
        world_runs, half_w2, char_data, tmp_path, resume_world):
    root, _ = world_runs  # root / "w2": the uninterrupted 8 steps on W=2
    legs = tmp_path / "legs"
    shutil.copytree(half_w2, legs)  # 4 steps on W=2
    train_run(resume_world, char_data, legs, resume="auto")
    assert ckpt(legs)["world_size"] == resume_world
    assert_close_runs(root / "w2", legs)


def test_resume_on_a_world_size_that_cannot_hold_the_global_batch_stops(char_data, tmp_path,
                                                                          monkeypatch):
    train_run(1, char_data, tmp_path, max_iters=4)
    # global batch 16 of micro-batches of 4 cannot be split over 3 processes: stop, say so,
    # and never silently change the data order (this fails before any process group exists)
    for name, value in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"global_batch_size \(16\).*batch_size \(4\) x world size \(3\)"):
        train.main(resolve(args_for(char_data, tmp_path, resume="auto")))
    assert ckpt(tmp_path)["step"] == 4


# --- point 8: epochs ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    # 2,700 training characters: 167 windows of 16, so 10 steps of 16 windows per epoch
    return make_char_dataset(tmp_path_factory.mktemp("small"), n_chars=3000)


@pytest.mark.slow
def test_epochs_call_set_epoch_and_never_repeat_a_window(small_data, tmp_path, monkeypatch):
    monkeypatch.setenv("EPOCH_LOG", str(tmp_path / "epochs"))
    train_run(2, small_data, tmp_path / "out", patch=record_epochs, max_iters=25, lr_decay_iters=25,
              eval_interval=25)
    calls, per_epoch = read_epochs(tmp_path / "epochs")
    assert sorted(calls) == [(r, e) for r in range(2) for e in range(3)]  # 25 steps: epochs 0, 1, 2
    assert sorted(per_epoch) == [0, 1, 2]
    for epoch, starts in per_epoch.items():
        assert len(starts) == len(set(starts)), f"a window repeats within epoch {epoch}"
    assert len(per_epoch[0]) == len(per_epoch[1]) == 160 and len(per_epoch[2]) == 80
    assert set(per_epoch[0]) != set(per_epoch[1])  # a fresh offset and order each epoch


@pytest.mark.slow
def test_resume_exactly_on_an_epoch_boundary(small_data, tmp_path):
    straight, legs = tmp_path / "straight", tmp_path / "legs"
    common = dict(max_iters=20, lr_decay_iters=20, eval_interval=10)
    train_run(2, small_data, straight, **common)
    train_run(2, small_data, legs, **{**common, "max_iters": 10})  # stops at the end of epoch 0
    assert ckpt(legs)["loader"] == {"epoch": 0, "position": 160}
    train_run(2, small_data, legs, **common, resume="auto")
    a, b = ckpt(straight), ckpt(legs)
    assert b["loader"] == a["loader"] == {"epoch": 1, "position": 160}
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
