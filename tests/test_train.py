"""Single-process training in this pytest process: learning, exact resume, AMP."""

import shutil
import signal
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

import loader
from errors import ConfigError
from harness import EXPECTED_FILES, ckpt, metrics, python, raising, tiny_args, train_here


def test_single_process_run_lowers_val_loss(char_data, tmp_path, monkeypatch):
    import train
    handlers, picks, pick = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)), [], train.eval_starts
    monkeypatch.setattr(train, "eval_starts", lambda tokens, block, n: picks.append(n) or pick(tokens, block, n))
    train_here(char_data, tmp_path, max_iters=60, eval_interval=30, log_interval=25, peak_flops=1e9)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # the run's are gone
    assert picks == [4 * 8, 4 * 8]  # eval_iters x global_batch_size windows of each split, whatever batch_size is
    evals = [r for r in metrics(tmp_path) if "val_loss" in r]
    assert [(r["step"], r["tokens_seen"]) for r in evals] == [(0, 0), (30, 30 * 8 * 16), (60, 60 * 8 * 16)]
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [25, 50, 60]  # and the last step's
    assert all(r["mfu"] > 0 for r in metrics(tmp_path) if "loss" in r)  # a CPU's peak_flops, given (it was ignored)
    from config import resolve
    from train import get_lr
    cfg = resolve(tiny_args(char_data, tmp_path, max_iters=60))
    assert [r["lr"] for r in metrics(tmp_path) if "loss" in r] == [get_lr(s - 1, cfg) for s in (25, 50, 60)]  # its own
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == EXPECTED_FILES
    saved = ckpt(tmp_path)
    assert saved["step"] == 60 and saved["loader"]["position"] > 0 and saved["tokens_seen"] == 60 * 8 * 16
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in saved["model"])


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # float16: the loss scaler's state resumes too
def test_resume_ends_bit_identical_to_an_uninterrupted_run(char_data, tmp_path, dtype):
    # dropout on, so the masks must be drawn again as they were; lr_decay_iters pinned so the
    # schedule of the short first leg is the schedule of the whole run
    common = dict(max_iters=24, lr_decay_iters=24, eval_interval=8, dropout=0.1, dtype=dtype)
    straight, legs = tmp_path / "straight", tmp_path / "legs"
    train_here(char_data, straight, **common)
    train_here(char_data, legs, **{**common, "max_iters": 8})
    # as older files were: with every rank's RNG states, which a resume now reads past, and (float16's)
    # without the log, which the resume then takes from metrics.jsonl up to the checkpoint's step
    older = {**ckpt(legs), "rng": {"cpu": torch.get_rng_state()[None]}}
    if dtype == "float16":
        del older["log"]
    torch.save(older, legs / "last.pt")
    train_here(char_data, legs, **{**common, "resume": "auto"})

    a, b = ckpt(straight), ckpt(legs)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for pid, state in a["optimizer"]["state"].items():
        for key in state:
            assert torch.equal(state[key], b["optimizer"]["state"][pid][key]), (pid, key)
    assert a["loader"] == b["loader"] and b["step"] == 24 and a["scaler"] == b["scaler"]
    losses = lambda d: [(r["step"], r["loss"]) for r in metrics(d) if "loss" in r]
    assert losses(straight) == losses(legs)  # the resumed log continues, no replayed steps
    again = train_here(char_data, legs, **{**common, "resume": "auto"})  # at max_iters: nothing left to do
    assert again["step"] == 24 and again["val_loss"] == b["val_loss"] is not None  # as the checkpoint says


def test_a_resume_into_float16_starts_the_loss_scale_afresh(char_data, tmp_path, capsys):
    """A float32 checkpoint holds no loss scale (test_reliability: every dtype change, through the CLI)."""
    train_here(char_data, tmp_path, max_iters=2)
    capsys.readouterr()
    assert train_here(char_data, tmp_path, max_iters=4, dtype="float16", resume="auto")["step"] == 4
    assert f"note: {tmp_path / 'last.pt'} was not trained in float16: the loss scale starts afresh\n" in \
        capsys.readouterr().out
    assert ckpt(tmp_path)["scaler"]["scale"] > 0  # float16's own, saved from here on


def test_each_rank_draws_its_own_dropout_masks_at_each_step():
    from train import dropout_seed
    seeds = {dropout_seed(1337, rank, step) for rank in range(4) for step in range(100)}
    assert len(seeds) == 400 and dropout_seed(1337, 3, 7) == dropout_seed(1337, 3, 7) != dropout_seed(7, 3, 7)


def test_a_resume_from_another_folder_keeps_that_runs_log(char_data, tmp_path):
    """--resume=A/last.pt into an out_dir holding another run's log: the log is A's history, not a splice;
    and the last.pt that the first save replaces stays as previous.pt, as any save's does (a rollback too)."""
    a, b = tmp_path / "a", tmp_path / "b"
    train_here(char_data, b, max_iters=4, eval_interval=2, seed=7)  # b's own run, another seed
    train_here(char_data, a, max_iters=2, eval_interval=2)
    train_here(char_data, b, max_iters=4, eval_interval=2, resume=str(a / "last.pt"))
    assert [r for r in metrics(b) if r["step"] <= 2] == metrics(a)
    assert [r["step"] for r in metrics(b) if "val_loss" in r] == [0, 2, 4]
    previous = ckpt(b, "previous.pt")
    assert (previous["step"], previous["config"]["seed"]) == (4, 7)
    # a rollback to a's own previous.pt (step 2, say to lower the rate): the newest last.pt was lost
    train_here(char_data, a, max_iters=4, eval_interval=2)
    newest = (a / "last.pt").read_bytes()
    train_here(char_data, a, max_iters=4, eval_interval=2, resume=str(a / "previous.pt"), learning_rate=5e-4)
    assert (a / "previous.pt").read_bytes() == newest and ckpt(a)["config"]["learning_rate"] == 5e-4


def test_the_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    from config import resolve
    from train import get_lr
    cfg = resolve(["--learning_rate=1.0", "--warmup_iters=4", "--max_iters=14", "--min_lr=0.2"])
    assert [get_lr(step, cfg) for step in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])  # never 0
    assert [get_lr(step, cfg) for step in (4, 9, 14, 20)] == pytest.approx([1.0, 0.6, 0.2, 0.2])
    assert get_lr(1500, resolve(["--learning_rate=1.0"])) == pytest.approx(0.1)  # min_lr None: a tenth
    assert get_lr(20, resolve(["--learning_rate=1.0", "--decay_lr=false"])) == 1.0
    hold = resolve(["--learning_rate=1.0", "--warmup_iters=4", "--lr_decay_iters=4", "--min_lr=0.2"])
    assert [get_lr(step, hold) for step in (3, 4, 5)] == pytest.approx([0.8, 0.2, 0.2])  # warm up, then hold


def test_a_step_seeds_dropout_from_the_seed_this_rank_and_this_step(monkeypatch):
    import train
    from types import SimpleNamespace as Namespace
    seeds = []
    monkeypatch.setattr(train, "accumulate_gradients", lambda *args: seeds.append(torch.initial_seed()) or 0.0)
    weight = torch.nn.Parameter(torch.zeros(1))
    run = Namespace(cfg=Namespace(dropout=0.1, seed=5, grad_clip=0), step=11,
                    world=Namespace(rank=3, local_rank=1, accum=1, size=4, strategy="ddp"), model=None,
                    raw_model=None, loader=None,
                    autocast=None, optimizer=torch.optim.SGD([weight]), scaler=torch.amp.GradScaler("cpu", enabled=False))
    train.optimizer_step(run)
    assert seeds == [train.dropout_seed(5, 3, 11)]


def test_micro_batches_give_the_whole_batch_gradient_and_mean_loss(monkeypatch):
    """Each micro-batch's loss is its own mean: / accum makes the summed gradient the whole batch's. Each
    forward runs inside its micro-step's skip_gradient_sync (DDP arms its reducer in the forward: a no_sync
    entered after it is too late, test_distributed), which skips all but the last (bench.py's sync=False: all)."""
    import train
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11))
    batch = torch.randint(11, (8, 9))
    skipping, skips = [None], []  # the context's skip while each forward runs

    @contextmanager
    def recorded(model, raw_model, skip):
        skipping[0] = skip
        yield
        skipping[0] = None
    monkeypatch.setattr(train.parallel, "skip_gradient_sync", recorded)
    model.register_forward_pre_hook(lambda module, args: skips.append(skipping[0]))

    class Batches:  # the batch whole, or in `accum` parts
        def __init__(self, accum):
            self.parts = iter(batch.chunk(accum))

        def next_batch(self):
            part = next(self.parts)
            return part[:, :-1], part[:, 1:]
    seen = []
    for accum in (1, 2, 4):
        loss = train.accumulate_gradients(model, model, Batches(accum), accum, nullcontext(),
                                          torch.amp.GradScaler("cpu", enabled=False))
        seen.append((loss, [p.grad for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    for loss, grads in seen[1:]:
        # (summed in another order, under 2 threads an entry near 0 differs by 3e-8, past allclose's atol of 1e-8)
        assert torch.allclose(loss, seen[0][0])
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(grads, seen[0][1]))
    assert skips == [False, True, False, True, True, True, False]  # accum 1, 2, 4: the last micro-step syncs
    train.accumulate_gradients(model, model, Batches(2), 2, nullcontext(), torch.amp.GradScaler("cpu", enabled=False),
                               sync=False)
    assert skips[-2:] == [True, True]


@pytest.mark.parametrize("stop_at", [None, 8, 10])
def test_without_always_save_an_eval_saves_when_it_improves_at_the_end_and_at_a_stop(
        char_data, tmp_path, monkeypatch, stop_at):
    """always_save_checkpoint=False (configs/shakespeare_char.py): validation losses 5, 1, 3, 4 at steps
    0, 4, 8, 10. Step 4 improves (last and best); 8 does not (not saved), unless a stop ends the run
    there; the last step is always saved. best.pt stays step 4's, also after a resume from the stop.
    A stop during the last step changes nothing: the run ends, evaluated, as one never sent it."""
    import os
    import train
    losses, step = iter([5.0, 5.0, 1.0, 1.0, 3.0, 3.0, 4.0, 4.0]), train.optimizer_step  # (train, val) per eval
    monkeypatch.setattr(train, "val_loss", lambda *args: next(losses))

    def stopped_during_step(run):
        if run.step == (stop_at or 0) - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(run)
    monkeypatch.setattr(train, "optimizer_step", stopped_during_step)
    results, main, code = [], train.main, 0
    monkeypatch.setattr(train, "main", lambda cfg: results.append(main(cfg)) or results[0])
    try:
        train.cli(tiny_args(char_data, tmp_path, max_iters=10, eval_interval=4, always_save_checkpoint=False,
                            log_interval=5))  # (a single process stops at once, not at its next log step)
    except SystemExit as e:  # a stopped run ends as the signal would have ended it, once saved
        code = e.code
    assert (results[0]["step"], results[0]["stopped"], code) == \
        ((8, signal.SIGTERM, 128 + signal.SIGTERM) if stop_at == 8 else (10, 0, 0))
    assert (ckpt(tmp_path)["step"], ckpt(tmp_path, "best.pt")["step"]) == (stop_at or 10, 4)
    assert [r["step"] for r in metrics(tmp_path) if "val_loss" in r] == [0, 4, 8] + [10] * (stop_at != 8)
    if stop_at == 8:  # resumed: step 10's 4 does not improve on the best loss the checkpoint carries, step 4's 1
        train_here(char_data, tmp_path, max_iters=10, eval_interval=4, always_save_checkpoint=False, resume="auto")
        last = ckpt(tmp_path)
        assert (last["step"], last["best_val_loss"], ckpt(tmp_path, "best.pt")["step"]) == (10, 1, 4)


def test_the_gradient_norm_is_within_float32_rounding():
    """torch's float32 norm on a CPU rounds a shard otherwise than the whole tensor: DDP's and FSDP's
    logged grad_norm were 1.6e-4 apart on GPT-2's vocabulary (the guarantee is 1e-5), and clipped apart."""
    import parallel
    model = torch.nn.Sequential(torch.nn.Embedding(50257, 32), torch.nn.Linear(32, 32))
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-4 for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    exact = torch.stack([g.double().norm() for g in grads]).norm().item()
    norm = parallel.clip_grad_norm(model, max_norm=0.01).item()
    assert abs(norm - exact) / exact < 1e-6  # torch's norm was 2.3e-5 off here
    clipped = torch.stack([p.grad.double().norm() for p in model.parameters()]).norm().item()
    assert abs(clipped - 0.01) < 1e-7
    model.zero_grad(set_to_none=True)  # no gradients (bench.py's FSDP step without sync): 0, as torch's gives
    assert parallel.clip_grad_norm(model, max_norm=0.01).item() == 0


def test_throughput_counts_every_step_since_the_last_log(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    import logger
    from config import Config
    clock = iter([100.0, 102.0, 102.0])  # the start, the log step 2 s later (and its clock restart)
    monkeypatch.setattr(logger, "time", SimpleNamespace(time=lambda: next(clock)))
    log = logger.Logger(Config(out_dir=str(tmp_path)), 10, None, True)
    log.train_step(15, 2.0, 1e-3, None)
    assert json.loads(log.lines[-1])["tokens_per_sec"] == 5 * 32 * 64 / 2  # 5 steps of 32 x 64 tokens in 2 s
    clock = iter([160.0, 161.0, 161.0])  # a HellaSwag evaluation at step 15 ended at 160 s (not training time)
    log.hellaswag(15, SimpleNamespace(acc=0.3, acc_norm=0.3, examples=4, truncated=0, line=lambda: "hellaswag"))
    log.train_step(20, 2.0, 1e-3, None)
    assert json.loads(log.lines[-1])["tokens_per_sec"] == 5 * 32 * 64 / 1


def test_a_cpus_mfu_is_each_process_against_its_share_of_the_given_peak(tmp_path, monkeypatch, capsys):
    """A CPU's processes split its cores (world.use_device): each of 2 showed half the CPU's MFU."""
    import re
    from types import SimpleNamespace

    import logger
    from config import Config
    from model import GPT, GPTConfig
    from world import World
    monkeypatch.setattr(logger, "agree_or_raise", lambda failure, world: None)  # (no group to agree in)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=65))
    cfg = Config(out_dir=str(tmp_path), peak_flops=1e9, block_size=16, batch_size=4, global_batch_size=8)
    mfu = {}
    for size in (1, 2):  # the same global batch of 8: one process in 2 micro-steps, or two in one each
        world = World(rank=1, size=size, local_size=size, accum=2 // size) if size > 1 else World(accum=2)
        run = SimpleNamespace(cfg=cfg, world=world, raw_model=model, step=0, resumed_from=None, history=None,
                              model_args={})
        mfu[size] = logger.Logger.start(run, {}).estimate_mfu(10, 5.0)  # 10 steps in 5 s, on 1 or on 2 processes
    assert mfu[1] == mfu[2] == pytest.approx(model.estimate_mfu(8 * 10, 5.0, 1e9))  # all the CPU's work, 1e9 FLOP/s
    run.world = World(rank=1, size=2, local_size=1, accum=1)  # two hosts, one process each: each has its whole CPU
    assert logger.Logger.start(run, {}).estimate_mfu(10, 5.0) == pytest.approx(model.estimate_mfu(4 * 10, 5.0, 1e9))
    from data.files import lock_note
    (tmp_path / "run.lock").write_bytes(lock_note())  # (this process's run: its log is written)
    capsys.readouterr()
    logger.Logger(cfg, 0, None, True, lambda steps, seconds: 0.4).train_step(10, 2.0, 6e-4, None)
    assert re.fullmatch(r"step 10: loss 2\.0000, lr 6\.00e-04, [\d,]+ tok/s, mfu 40\.0%\n", capsys.readouterr().out)


def test_wandb_that_stops_mid_run_leaves_the_run_going_and_a_relaunch_with_nothing_to_train_starts_none(
        tmp_path, monkeypatch, capsys):
    """Its own process killed (out of memory) ended the run in a traceback from wandb.log, then one at exit;
    a relaunch at max_iters started a wandb run and rewrote config.json with its own settings."""
    import json
    import sys
    from types import SimpleNamespace

    import logger
    from config import Config
    from harness import raising
    started, ended = [], []
    run = SimpleNamespace(log=raising(ConnectionResetError("Connection lost")),
                          finish=raising(ConnectionResetError("Connection lost")))
    fake = SimpleNamespace(init=lambda **kw: started.append(kw) or run, teardown=lambda: ended.append(True))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.chdir(tmp_path)
    from data.files import lock_note
    (tmp_path / "run.lock").write_bytes(lock_note())  # (this process's run: its log is written)
    cfg = Config(out_dir=".", wandb_log=True, max_iters=20)
    with logger.Logger(cfg, 10, None, True) as log:
        log.train_step(12, 2.0, 1e-3, None)
        log.train_step(14, 1.9, 1e-3, None)
    assert started[0]["name"] == tmp_path.name  # out_dir's name, also when given as "." (it was "")
    assert capsys.readouterr().out.count("warning: wandb stopped (ConnectionResetError: Connection lost): "
                                         "metrics.jsonl goes on alone\n") == 1
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [12, 14]
    assert ended == [True]  # its connection closed: nothing left for its exit hook to fail on
    import errno
    opened = []  # a write that fails (a full disk) ends the log's writing: no row after a line cut short
    monkeypatch.setattr(logger, "open", lambda *a, **k: opened.append(1) or (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")), raising=False)
    log.train_step(16, 1.8, 1e-3, None)
    log.train_step(18, 1.7, 1e-3, None)
    assert opened == [1] and log.failure.startswith("could not write metrics.jsonl (No space left on device)")
    monkeypatch.delattr(logger, "open")
    (tmp_path / "config.json").write_text("the run's")
    log = logger.Logger(Config(out_dir=".", wandb_log=True, max_iters=20), 20, "./last.pt", True)
    log.write_run_files(cfg, {}, {"world_size": 2})
    assert len(started) == 1 and (tmp_path / "config.json").read_text() == "the run's"


def test_a_resumed_runs_first_throughput_leaves_out_the_start_up(tmp_path, monkeypatch):
    """A resumed run evaluates nothing before its first step: wandb's start-up, the run files and the model's
    summary counted as training time (32 tok/s, then 17,667 in the next interval)."""
    from types import SimpleNamespace

    import logger
    from config import Config
    from model import GPT, GPTConfig
    clock = iter([100.0, 105.0, 107.0, 107.0])  # the logger made; start() done (5 s later); 5 steps in 2 s
    monkeypatch.setattr(logger, "time", SimpleNamespace(time=lambda: next(clock)))
    cfg = Config(out_dir=str(tmp_path), max_iters=20, block_size=16)
    run = SimpleNamespace(cfg=cfg, world=__import__("world").World(), step=10, resumed_from=str(tmp_path / "last.pt"),
                          history=None, model_args={}, raw_model=GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8,
                                                                                block_size=16, vocab_size=9)))
    log = logger.Logger.start(run, {})
    log.train_step(15, 2.0, 1e-3, None)
    assert log.lines[-1].count(f'"tokens_per_sec": {5 * cfg.tokens_per_step / 2}') == 1


def test_a_logger_on_another_rank_writes_and_prints_nothing(tmp_path, capsys):
    """Every rank makes the same logging calls; only rank 0's do anything (test_launchers: a run's files)."""
    from types import SimpleNamespace

    import logger
    from config import Config
    from world import World
    cfg = Config(out_dir=str(tmp_path), wandb_log=True)  # (wandb starts on rank 0 alone)
    rows = '{"step": 0, "val_loss": 4.0}\n{"step": 5, "loss": 3.0}\n'  # rank 0's: a resume at 0 keeps the first
    (tmp_path / "metrics.jsonl").write_text(rows)
    log = logger.Logger(cfg, 0, str(tmp_path / "last.pt"), False)
    log.write_run_files(cfg, {"vocab_size": 65}, {})
    log.train_step(10, 2.0, 1e-3, torch.tensor(0.5))
    log.hellaswag(10, SimpleNamespace(acc=0.3, acc_norm=0.3, examples=4, truncated=1, line=lambda: "hellaswag"))
    log.say("a line")
    log.check(World(), None)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"] and capsys.readouterr().out == ""
    assert (tmp_path / "metrics.jsonl").read_text() == rows
    assert (log.text(), log.failure, log.start_failure) == ("", None, None)


def test_a_resume_from_an_older_checkpoint_keeps_the_readable_rows_of_the_log_beside_it_up_to_its_step(
        tmp_path, capsys):
    """Such a checkpoint holds no log; the rows past its step are run again, and a line cut short or
    edited is dropped with one warning (test_reliability: cut at random bytes, in whole runs)."""
    import json

    import logger
    from config import Config
    rows = [{"step": s, "loss": 1.0} for s in (5, 10, 15)]
    edited_or_cut = '{"step": null}\n{"step": "x"}\n{"loss": 2.0}\n[]\n{"step": 1e999}\n\xff{"st'
    beside = "".join(json.dumps(r) + "\n" for r in rows) + edited_or_cut
    (tmp_path / "metrics.jsonl").write_bytes(beside.encode("latin-1"))
    log = logger.Logger(Config(out_dir=str(tmp_path)), 10, str(tmp_path / "last.pt"), True)
    assert [json.loads(line) for line in log.text().splitlines()] == rows[:2]
    warning = f"warning: dropped 6 unreadable lines of {tmp_path / 'metrics.jsonl'} (a write cut short)\n"
    assert capsys.readouterr().out == warning
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + '\n{"st')  # the usual case: a kill mid-line
    assert logger.Logger(Config(out_dir=str(tmp_path)), 10, str(tmp_path / "last.pt"), True).text().count("\n") == 1
    assert capsys.readouterr().out == warning.replace("6 unreadable lines", "1 unreadable line")


def test_stop_signal_puts_back_a_handler_set_outside_python_as_the_default(monkeypatch):
    """signal.signal returns None for a handler C code set: restoring that raised a TypeError at the end."""
    import signal

    from world import StopSignal
    calls = []
    monkeypatch.setattr(signal, "signal", lambda sig, handler: calls.append((sig, handler)))  # (returns None)
    with StopSignal():
        pass
    assert calls[2:] == [(signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.SIG_DFL)]


def test_all_finite_finds_a_nan_in_the_weights_or_an_inf_in_the_moments():
    import parallel
    from world import World
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert parallel.all_finite(model, World(), optimizer)
    optimizer.state[model.bias]["exp_avg_sq"][0] = float("inf")  # the weights stay finite (a huge gradient)
    assert parallel.all_finite(model, World()) and not parallel.all_finite(model, World(), optimizer)
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    assert not parallel.all_finite(model, World())


def test_resume_auto_starts_fresh_then_resumes_with_this_runs_adamw_settings_and_dropout(char_data, tmp_path):
    result = train_here(char_data, tmp_path, max_iters=2, resume="auto")  # nothing to resume yet
    assert result["step"] == 2
    # AdamW's settings changed on resume apply (the saved param_groups once overrode them silently);
    # dropout is no part of the model's shape: it may change too (docs/resume.md)
    train_here(char_data, tmp_path, max_iters=3, resume="auto", weight_decay=0.5, beta1=0.8, beta2=0.9, dropout=0.1)
    saved = ckpt(tmp_path)
    assert saved["step"] == 3 and [g["weight_decay"] for g in saved["optimizer"]["param_groups"]] == [0.5, 0.0]
    assert saved["model_args"]["dropout"] == 0.1
    assert all(tuple(g["betas"]) == (0.8, 0.9) for g in saved["optimizer"]["param_groups"])


@pytest.mark.parametrize("dtype, device", [("bfloat16", "cpu"), ("float16", "cpu"), pytest.param(
    "bfloat16", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_mixed_precision_runs_lower_the_loss(char_data, tmp_path, dtype, device):
    train_here(char_data, tmp_path, dtype=dtype, device=device, max_iters=40, eval_interval=40, log_interval=5)
    losses = [r["loss"] for r in metrics(tmp_path) if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    saved = ckpt(tmp_path)
    assert all(w.dtype == torch.float32 for w in saved["model"].values())  # master weights stay fp32
    assert bool(saved["scaler"]) == (dtype == "float16")  # the scaler is on only for float16
    # clipped and logged unscaled (float16's scaled gradients: a norm about 2**16 times it)
    assert all(r["grad_norm"] < 100 for r in metrics(tmp_path) if "loss" in r)


def test_missing_dataset_is_prepared_by_local_rank_zero(char_data, tmp_path, monkeypatch):
    calls = []

    class FakePrepare:
        @staticmethod
        def prepare(out_dir):
            calls.append(out_dir)
            shutil.copytree(char_data, out_dir, dirs_exist_ok=True)  # (made, and locked, by Dataset.ready)

    real = loader.importlib.import_module  # (torch imports its lazy modules through it too)
    monkeypatch.setattr(loader.importlib, "import_module",
                        lambda name, *args, **kw: FakePrepare if name.startswith("data.") else real(name, *args, **kw))
    data_dir = tmp_path / "fresh_data"
    train_here(data_dir, tmp_path / "out", max_iters=1)
    assert calls == [str(data_dir)]


def test_uneven_global_batch_names_the_three_numbers(char_data, tmp_path):
    with pytest.raises(ConfigError, match=r"global_batch_size \(12\).*batch_size \(8\)"):
        train_here(char_data, tmp_path, batch_size=8, global_batch_size=12)


@pytest.mark.slow  # inductor compiles in worker processes
def test_compiled_model_saves_prefix_free_weights(char_data, tmp_path):
    train_here(char_data, tmp_path, compile=True, max_iters=4, eval_interval=4)
    saved = ckpt(tmp_path)
    assert "transformer.wte.weight" in saved["model"]
    assert not any("_orig_mod" in k or k.startswith("module.") for k in saved["model"])


@pytest.mark.slow  # wandb starts its service process
def test_wandb_logs_offline_when_asked(char_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in requirements.txt, but not on every machine")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train_here(char_data, tmp_path, wandb_log=True, max_iters=4, eval_interval=4)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_wandb_is_told_whether_the_run_failed(char_data, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is in requirements.txt, but not on every machine")
    import train
    logged, finished = [], []

    class FakeRun:  # what wandb.init returns: no service process, no files
        def log(self, record, step):
            logged.append(step)
            records.append(record)

        def finish(self, exit_code):
            finished.append(exit_code)
    started, records = [], []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: started.append(kwargs) or FakeRun())
    train_here(char_data, tmp_path / "ok", wandb_log=True, max_iters=2, eval_interval=2)
    assert started[0]["config"] == ckpt(tmp_path / "ok", "last.pt")["config"]  # the run's settings, for its charts
    assert records and not any("step" in record for record in records)  # (wandb's own axis, not a chart)
    monkeypatch.setattr(train, "optimizer_step", raising(RuntimeError("a step failed")))
    with pytest.raises(RuntimeError, match="a step failed"):
        train_here(char_data, tmp_path / "failed", wandb_log=True, max_iters=2, eval_interval=2)
    assert finished == [0, 1] and logged[-1] == 0 and 2 in logged  # the failed run's step-0 eval was logged


def test_a_fresh_run_in_a_used_out_dir_starts_a_new_log_and_drops_the_old_best(char_data, tmp_path):
    train_here(char_data, tmp_path, max_iters=4, eval_interval=2)
    assert (tmp_path / "best.pt").exists()
    # a fresh run never better than its unsaved step 0: the old run's best.pt was what sample.py took
    train_here(char_data, tmp_path, max_iters=4, eval_interval=2, resume="never", learning_rate=0.5)
    assert [r["step"] for r in metrics(tmp_path) if "val_loss" in r] == [0, 2, 4]
    assert not (tmp_path / "best.pt").exists() and ckpt(tmp_path, "last.pt")["config"]["learning_rate"] == 0.5
    kept = tmp_path / "kept"  # a resume (here no better than its best) keeps that best
    train_here(char_data, kept, max_iters=4, eval_interval=2)
    best = ckpt(kept, "best.pt")["step"]
    train_here(char_data, kept, max_iters=8, eval_interval=2, learning_rate=0.5, resume="auto")
    assert ckpt(kept, "best.pt")["step"] == best and ckpt(kept, "last.pt")["step"] == 8


def test_a_run_killed_before_its_first_save_keeps_the_log_of_the_checkpoint_a_resume_takes(char_data, tmp_path,
                                                                                          monkeypatch):
    """A run rewrites metrics.jsonl as it starts (a fresh one empties it, one resumed from previous.pt
    drops the rows after it), but last.pt changes only at its first save. Killed before that, the next
    resume=auto continues last.pt with last.pt's own history, kept in it, not the rewritten file."""
    import train
    train_here(char_data, tmp_path, max_iters=4, eval_interval=2)
    assert ckpt(tmp_path, "previous.pt")["step"] == 2
    history = metrics(tmp_path)

    def killed(run, best, log):
        raise KeyboardInterrupt
    for start in (dict(resume="never", seed=7), dict(resume=str(tmp_path / "previous.pt"))):
        with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
            patch.setattr(train.Run, "save", killed)
            train_here(char_data, tmp_path, max_iters=4, eval_interval=2, **start)
        assert metrics(tmp_path) != history  # rewritten at the start
    train_here(char_data, tmp_path, max_iters=6, eval_interval=2, resume="auto")
    assert [r for r in metrics(tmp_path) if r["step"] <= 4] == history and metrics(tmp_path)[-1]["step"] == 6


def test_a_resume_hands_rank_0s_read_copy_back_to_the_os(char_data, tmp_path, monkeypatch):
    """After build_run has read a whole checkpoint, nothing freed is left resident: glibc keeps
    freed buffers of up to 32 MB in its heap, which malloc_trim would still give back."""
    import ctypes

    import train
    shape = dict(n_layer=2, n_head=4, n_embd=768, batch_size=2, global_batch_size=2, eval_iters=1, max_iters=1)
    train_here(char_data, tmp_path, **shape)
    size = (tmp_path / "last.pt").stat().st_size  # ~170 MB: weights and AdamW moments
    rss = lambda: int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024
    resident = []

    def measured(*args):
        run = build_run(*args)
        before = rss()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        resident.append(before - rss())  # what build_run left for malloc_trim to give back
        return run
    build_run = train.build_run
    monkeypatch.setattr(train, "build_run", measured)
    train_here(char_data, tmp_path, **{**shape, "max_iters": 2, "resume": "auto"})
    assert resident and resident[0] < size / 10, (resident, size)


CHECK_MMAP = """
import ctypes, torch, world
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
world.place("cpu", "float32", "auto")
torch.ones(16 << 20, dtype=torch.uint8).sum()  # freed at once: glibc would raise its threshold to 16 MB
mapped = libc.mallinfo2().hblkhd
x = torch.ones(8 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd - mapped)
# under 4 MB: from the heap's top, which its free leaves free. (Not a tensor: the tensor's own small
# bookkeeping, allocated after its data and held in a cache when freed, could sit above it, about half the time.)
y = libc.malloc(3 << 20)
libc.free(ctypes.c_void_p(y))
print(libc.mallinfo2().keepcost)  # the free top the heap keeps (about 130 KB without the trim threshold)
"""


@pytest.mark.slow
def test_a_cpu_process_maps_big_tensors_on_their_own():
    """A process training on the CPU fixes glibc's mmap threshold at 4 MB (world.keep_cpu_memory_lean):
    a tensor over it is mapped on its own and unmapped when freed, not kept in the fragmenting heap;
    and its trim threshold at 32 MB, so a freed smaller one is not handed back and faulted in again."""
    result = python("-c", CHECK_MMAP)
    assert result.returncode == 0, result.stderr
    mapped, kept = map(int, result.stdout.split())
    assert mapped >= 8 << 20 and kept >= 3 << 20, result.stdout


def test_the_ranks_agree_on_a_stop_about_every_2_seconds_and_every_slow_step(monkeypatch):
    """torchrun kills its workers 30 s after passing SIGTERM on: with 3.5 s steps, agreeing only
    every 10 steps lost the stop's checkpoint. The cadence follows the step time (every rank
    gets it from the same all-reduce): every 10 quick steps, every slow one. A single process
    stops as soon as it is sent a signal, with no host sync per step."""
    import collectives
    from world import World
    clock = [0.0]
    monkeypatch.setattr(collectives.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda votes, op: votes.mul_(2))  # two ranks alike
    for size, expected in ((2, [1, 11, 21, 23, 24, 25, 26, 27, 28, 29]), (1, [1, 11, 21, 25, 26, 27, 28, 29])):
        agree, due, clock[0] = collectives.Agreement(World(size=size), step=0), [], 0.0
        for step in range(1, 30):
            clock[0] += 0.01 if step < 20 else 3.5
            signum = signal.SIGTERM if step >= (12 if size == 2 else 25) else 0  # (2 ranks: only at their agreements)
            if agree.due(step, signum):
                due.append(step)
                problems = ["bad", None] if size == 1 else [None]  # (a message would travel in other collectives)
                assert agree(torch.tensor(2.5), signum, problems, step) == (2.5, signum, problems)
        # two ranks at 21: 10 steps, 8 quick and 2 slow, in 7.08 s, so every 2 steps; then every step
        assert due == expected, (size, due)
    # a SIGTERM that only the other rank received stops this one too, at the same step: its vote is in the sum
    other = torch.tensor([2.5, 0.01, 1.0, 0.0, 0.0])  # its loss, step time, SIGTERM, SIGINT, a problem
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda votes, op: votes.add_(other))
    agree = collectives.Agreement(World(size=2), step=0)
    assert agree(torch.tensor(2.5), 0, [None], 1) == (2.5, signal.SIGTERM, [None])
    assert agree(torch.tensor(2.5), signal.SIGINT, [None], 2) == (2.5, signal.SIGTERM, [None])  # SIGTERM's, when both
    alone = collectives.Agreement(World(), step=4)  # between its agreements, a single process stops on either
    assert [alone.due(4, s) for s in (0, signal.SIGTERM, signal.SIGINT)] == [False, True, True]
