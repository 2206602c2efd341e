"""Broken files and runaway numbers: one clear message, and no good file overwritten."""

import errno
import json
import math
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
import train
from config import Config, resolve
from data.files import link_or_copy
from errors import ConfigError, RunError
from harness import flip_a_bit, raising, small_disk, tiny_args, train_here
from model import GPT


@pytest.mark.parametrize("poisoned_at, stop, says, last", [(6, False, "training loss is nan at step 7", "last.pt"),
                                                      # the step's eval sees it before its checkpoint is written
                                                      (8, False, "validation loss is nan at step 8", "last.pt"),
                                                      # a stop's checkpoint, off the eval steps: the save checks
                                                      (6, True, "weights or moments are NaN or inf at step 6", "last.pt"),
                                                      # step 4's background save had completed (it said "no
                                                      # checkpoint of this run was written yet")
                                                      (6, False, "training loss is nan at step 7", "last.dcp"),
                                                      (6, True, "weights or moments are NaN or inf at step 6", "last.dcp"),
                                                      (8, False, "validation loss is nan at step 8", "last.dcp")])
def test_a_diverging_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint(char_data, tmp_path, monkeypatch,
                                                                                 poisoned_at, stop, says, last):
    # a hook outside train.py's loop: the optimizer's step `poisoned_at` leaves a NaN in the weights,
    # as an overflow would
    configure = GPT.configure_optimizers

    def poisoned(model, *args, **kwargs):
        optimizer = configure(model, *args, **kwargs)
        step, calls = optimizer.step, []

        def poisoned_step(*a, **k):
            result = step(*a, **k)
            calls.append(1)
            if len(calls) == poisoned_at:
                with torch.no_grad():
                    model.transformer.wte.weight[0, 0] = float("nan")
                if stop:
                    os.kill(os.getpid(), signal.SIGTERM)
            return result

        optimizer.step = poisoned_step
        return optimizer

    monkeypatch.setattr(GPT, "configure_optimizers", poisoned)
    with pytest.raises(RunError, match=rf"{says}\..*learning_rate=0.003.*{re.escape(last)} holds step 4, the last "
                                       r"good one \(resume=auto continues from it\)\.$"):
        train_here(char_data, tmp_path, max_iters=20, eval_interval=4,
                   **(dict(checkpoint_format="sharded", async_checkpoint=True) if last == "last.dcp" else {}))
    ckpt = checkpoint.read(tmp_path / last, tensors=True)
    assert ckpt["step"] == 4 and all(torch.isfinite(w).all() for w in ckpt["model"].values())
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("terminal", [False, True])
def test_an_absurd_learning_rate_stops_the_run_with_exit_1_and_saves_nothing(char_data, tmp_path, capsys,
                                                                             monkeypatch, terminal):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)  # a terminal: tqdm's bar, closed before the error
    with pytest.raises(SystemExit) as exit_info:
        train.cli(tiny_args(char_data, tmp_path, learning_rate=1e30, warmup_iters=0, eval_interval=5))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert (re.search(r"(it/s|s/it)\]\n", out) is not None and out.endswith("\n")) == terminal, out  # (s/it: slow)
    assert re.fullmatch(r"error: the training loss is nan at step \d\. Likely causes: a learning rate "
                        r"too high \(learning_rate=1e\+30.*no checkpoint of this run was written yet\.\n",
                        err), err
    # only the causes this run's settings allow (float16 overflow was named for every dtype)
    assert "(learning_rate x weight_decay = 1e+29: keep it below 1)" in err and "float16" not in err
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob(".*.tmp"))


def test_a_divergence_names_only_the_causes_its_settings_allow():
    """float16 overflow only under float16; before any step (GPT-2 weights evaluated at step 0, a bit flipped in
    their file), the weights it started from, not the learning rate (which had not been used)."""
    from types import SimpleNamespace

    from errors import Diverged
    run = SimpleNamespace(cfg=Config(learning_rate=1e-3, weight_decay=0.1), world=SimpleNamespace(dtype=torch.float16),
                          step=3)
    said = str(Diverged("the training loss is nan at step 3", run, None))
    assert "float16 overflow (try --dtype=bfloat16), or bad data" in said and "weight decay" not in said
    run = SimpleNamespace(cfg=Config(learning_rate=10.0, weight_decay=0.1), world=SimpleNamespace(dtype=torch.float32),
                          step=3)
    assert "(learning_rate x weight_decay = 1: keep it below 1)" in str(Diverged("nan", run, None))  # (each step: 0)
    run.step, run.cfg.init_from = 0, "gpt2"
    assert str(Diverged("the validation loss is nan at step 0", run, None)).startswith(
        "the validation loss is nan at step 0. Likely causes: the weights it started from (init_from=gpt2: out of "
        "range? a damaged file?), or bad data. Nothing was saved")


def test_a_run_started_with_stdout_closed_trains(char_data, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", None)  # `python train.py >&-` (it was an AttributeError's traceback)
    assert train_here(char_data, tmp_path, max_iters=2, eval_interval=2)["step"] == 2


def test_a_torch_compile_that_fails_is_one_line(char_data, tmp_path, capsys, monkeypatch):
    """No C++ compiler, say: torch.compile fails at the first compiled forward (step 0's eval)."""
    def broken(graph, example_inputs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nits advice")
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: compile_(model, backend=broken))
    with pytest.raises(SystemExit) as exit_info:
        train.cli(tiny_args(char_data, tmp_path, compile=True))
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1, err
    assert err == ("error: torch.compile failed (RuntimeError: InvalidCxxCompiler: No working C++ compiler found): "
                   "run with --compile=False\n"), err


@pytest.mark.parametrize("damage, reason", [("truncated", "it is truncated"), ("random bytes", ""),
                                           ("a flipped bit", "its bytes are damaged (record archive/data/"),
                                           ("a NaN weight", "its weights or moments hold NaN or inf"),
                                           ("an inf moment", "its weights or moments hold")])  # (resumed, diverged)
def test_a_damaged_last_checkpoint_is_reported_and_the_previous_one_used(trained_copy, tmp_path, char_data,
                                                                         capsys, damage, reason):
    out = trained_copy
    last = out / "last.pt"
    data = last.read_bytes()
    if damage == "a flipped bit":  # in the middle of a weight's bytes: torch.load itself reads it silently
        flip_a_bit(last)
    else:
        last.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    if damage in ("a NaN weight", "an inf moment"):  # other code's: a run never saves one
        ckpt = torch.load(out / "previous.pt", weights_only=True)
        if damage == "a NaN weight":
            ckpt["model"]["transformer.ln_f.weight"][0] = float("nan")
        else:
            ckpt["optimizer"]["state"][3]["exp_avg_sq"].view(-1)[0] = float("inf")
        torch.save({**ckpt, "step": 10}, last)
    result = train_here(char_data, out, max_iters=10, eval_interval=5, resume="auto", weight_decay=0.05)
    printed = capsys.readouterr()
    printed = printed.out + printed.err  # the warning goes to stderr
    assert f"cannot read checkpoint {last}: {reason}" in printed
    assert "trying" in printed and "previous.pt" in printed
    assert "resuming from" in printed and "at step 5" in printed
    assert result["step"] == 10
    # the damaged last.pt was not kept as previous.pt over the one the run resumed from
    assert [torch.load(out / f"{k}.pt", weights_only=True)["step"] for k in ("previous", "last")] == [5, 10]
    # AdamW as this run set it, not as the checkpoint tried first held it (the NaN one's groups stayed)
    assert torch.load(out / "last.pt", weights_only=True)["optimizer"]["param_groups"][0]["weight_decay"] == 0.05


def test_adamw_resumes_as_this_run_sets_it_whatever_the_checkpoint_says(char_data, tmp_path):
    """Options a hand edit put in param_groups went on into AdamW: amsgrad a KeyError's traceback at the
    first step, maximize a loss that rose. A resume sets every option but the parameters itself."""
    train_here(char_data, tmp_path / "straight", max_iters=6, eval_interval=2)
    edited = torch.load(tmp_path / "straight" / "previous.pt", weights_only=True)  # step 4
    assert edited["step"] == 4
    for group in edited["optimizer"]["param_groups"]:
        group.update(amsgrad=True, maximize=True, eps=0.5)
    torch.save(edited, tmp_path / "edited.pt")
    train_here(char_data, tmp_path / "resumed", max_iters=6, eval_interval=2, resume=str(tmp_path / "edited.pt"))
    resumed, straight = (torch.load(tmp_path / run / "last.pt", weights_only=True) for run in ("resumed", "straight"))
    assert all(torch.equal(resumed["model"][k], w) for k, w in straight["model"].items())


def test_a_last_pt_linked_to_nothing_is_reported_not_skipped(trained_copy, char_data, capsys):
    """(its storage not mounted, say): resume=auto took previous.pt without a word"""
    out = trained_copy
    (out / "last.pt").unlink()
    (out / "last.pt").symlink_to(out / "gone" / "last.pt")
    assert train_here(char_data, out, max_iters=10, eval_interval=5, resume="auto")["step"] == 10
    assert f"cannot read checkpoint {out / 'last.pt'}: it is not a file\ntrying {out / 'previous.pt'}" in \
        capsys.readouterr().err


def test_when_no_checkpoint_reads_the_line_says_what_to_do(trained_copy, char_data):
    """(it named the damage only; and --resume=never, which it then suggested, init_from=resume refuses)"""
    out = trained_copy
    for name in ("last.pt", "previous.pt"):
        (out / name).write_bytes(b"not a checkpoint")
    for init_from, afresh in (("scratch", "--resume=never"), ("resume", "--resume=never --init_from=scratch")):
        with pytest.raises(ConfigError, match=rf"^cannot read checkpoint {out / 'previous.pt'}: it is truncated .*: "
                                              rf"give --resume=PATH of one that reads \(best\?\), or {afresh}$"):
            train_here(char_data, out, max_iters=10, resume="auto", init_from=init_from)
    (out / "best.pt").unlink()  # (a best to try was suggested where there was none)
    with pytest.raises(ConfigError, match=r"give --resume=PATH of one that reads, or --resume=never$"):
        train_here(char_data, out, max_iters=10, resume="auto")
    (out / "best.dcp").mkdir()  # the sharded format's best
    with pytest.raises(ConfigError, match=r"give --resume=PATH of one that reads \(best\?\), or --resume=never$"):
        train_here(char_data, out, max_iters=10, resume="auto")


def test_a_resume_at_or_past_max_iters_says_nothing_is_left_to_train(trained_copy, char_data, capsys):
    """It exited 0 with no word after "resuming from"."""
    before = (trained_copy / "last.pt").read_bytes()
    for max_iters in (10, 5):  # the same command again, and a smaller max_iters
        assert train_here(char_data, trained_copy, max_iters=max_iters, eval_interval=5, resume="auto")["step"] == 10
        printed = capsys.readouterr().out
        assert f"at step 10, max_iters={max_iters}: nothing is left to train (raise --max_iters to go on)" in printed
    assert "(4 per micro-batch x 1 process x 2 accumulation steps)" in printed  # (not "1 processes")
    assert (trained_copy / "last.pt").read_bytes() == before


@pytest.mark.parametrize("damage", ["bytes", "a link to itself"])
def test_a_previous_pt_resumed_by_another_spelling_of_its_path_is_kept(trained_copy, char_data, damage):
    out = trained_copy
    (out / "last.pt").unlink()
    if damage == "bytes":
        (out / "last.pt").write_bytes(b"damaged")
    else:  # Path.resolve raised on the loop at the first save, a traceback once training was done
        (out / "last.pt").symlink_to("last.pt")
    # once compared as text: out/../out/previous.pt was taken for a file outside out_dir, and the
    # damaged last.pt rotated over the checkpoint the run had resumed from
    train_here(char_data, out, max_iters=10, eval_interval=5, resume=f"{out}/../{out.name}/previous.pt")
    assert [torch.load(out / f"{k}.pt", weights_only=True)["step"] for k in ("previous", "last")] == [5, 10]


def test_resume_auto_tries_a_last_before_its_previous_whatever_their_times(tmp_path):
    """Newest first, but a copied or touched previous.pt no longer goes before last.pt (the
    save from it, not rotating, then overwrote the good last.pt)."""
    from checkpoint import newest
    for name, seconds in (("previous.pt", 300), ("last.pt", 100), ("last.dcp", 200), ("previous.dcp", 50)):
        path = tmp_path / name
        if path.suffix == ".dcp":
            path.mkdir()
            path = path / ".metadata"
        path.touch()
        os.utime(path, (seconds, seconds))
    assert [p.name for p in newest([tmp_path / n for n in ("last.pt", "previous.pt", "last.dcp", "previous.dcp",
                                                            "best.pt")])] == [
        "last.dcp", "last.pt", "previous.pt", "previous.dcp"]
    # a live run's save renames last.dcp away as a reader (sample.py, eval.py) looks: a FileNotFoundError traceback
    real_stat = os.stat

    def rotated_after(path, *args, **kwargs):
        found = real_stat(path, *args, **kwargs)
        if str(path).endswith("last.dcp/.metadata") and (tmp_path / "last.dcp").exists():
            os.rename(tmp_path / "last.dcp", tmp_path / ".last.dcp.old")
        return found
    os.utime(tmp_path / "last.dcp" / ".metadata", (400, 400))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "stat", rotated_after)
        assert [p.name for p in newest([tmp_path / n for n in ("last.dcp", "last.pt")])] == ["last.dcp", "last.pt"]
        assert [p.name for p in newest([tmp_path / n for n in ("last.dcp", "last.pt")])] == ["last.pt"]  # (gone)
    (tmp_path / "loop").mkdir()  # a link to itself: its own line when read (the stat of one pass was a traceback)
    (tmp_path / "loop" / "last.pt").symlink_to("last.pt")
    assert newest([tmp_path / "loop" / "last.pt"]) == [tmp_path / "loop" / "last.pt"]


def test_a_damaged_last_pt_skipped_for_the_other_format_is_not_rotated_over_previous(trained_copy, char_data):
    out = trained_copy
    (out / "last.pt").write_bytes(b"damaged")
    train_here(char_data, out, max_iters=10, eval_interval=5, resume="auto", checkpoint_format="sharded")
    # now last.dcp (step 10) is the newest; the first .pt save replaces the damaged last.pt, and
    # previous.pt (step 5) stays: it once became the damaged file
    train_here(char_data, out, max_iters=15, eval_interval=5, resume="auto")
    assert [torch.load(out / f"{k}.pt", weights_only=True)["step"] for k in ("previous", "last")] == [5, 15]


@pytest.mark.parametrize("checkpoint_format", ["file", "sharded"])
def test_a_fresh_start_rotates_an_earlier_last_only_if_it_reads(trained_copy, char_data, checkpoint_format):
    """resume=never: the earlier run's last becomes previous; a damaged last.pt became previous.pt over the
    good one, and a file named last.dcp became previous.dcp (what a fallback from a damaged last.dcp takes)"""
    out, name = trained_copy, "last.pt" if checkpoint_format == "file" else "last.dcp"
    (out / name).write_bytes(b"damaged")
    previous = (out / "previous.pt").read_bytes()
    train_here(char_data, out, max_iters=5, eval_interval=5, resume="never", checkpoint_format=checkpoint_format)
    assert (out / "previous.pt").read_bytes() == previous and (out / name).is_dir() == (name == "last.dcp")
    assert not (out / "previous.dcp").exists()
    train_here(char_data, out, max_iters=5, eval_interval=5, resume="never", checkpoint_format=checkpoint_format)
    assert (out / name.replace("last", "previous")).exists()  # a readable one is rotated
    if checkpoint_format == "file":
        assert (out / "previous.pt").read_bytes() != previous
        torch.save({"w": torch.zeros(3)}, out / "last.pt")  # another program's tensors, no step: not ours, replaced
        train_here(char_data, out, max_iters=5, eval_interval=5, resume="never")
        assert [torch.load(out / f"{k}.pt", weights_only=True)["step"] for k in ("previous", "last")] == [5, 5]


SCALER = dict(scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, _growth_tracker=0)


@pytest.mark.parametrize("problem, message", [
    ("missing", "nothing to resume from"),
    ("random bytes", "cannot read checkpoint"),
    ("other shape", "holds another model shape (checkpoint, now): {'n_embd': (32, 64)}: resume with the shape it "
                    "was trained with, or start afresh with --resume=never"),
    ("other bias", "holds another model shape (checkpoint, now): {'bias': (True, False)}"),
    ("other seed", "was trained with seed=1337; resuming with 7 would change the data order"),
    ("other global batch", "was trained with global_batch_size=8; resuming with 16 would change the data order"),
    (lambda ck: ck.pop("loader"), "lacks ['loader']: it was not written by this train.py"),
    ("unknown format", "checkpoint format 99 is not 1"),
    # hand edits, each once a traceback from Run.load_state_dict: one line, on every rank
    ({"step": "10"}, "step '10' or world_size 1 is not a whole number"),
    ({"step": -1}, "step -1 or world_size 1 is not a whole number"),  # a negative learning rate once
    ({"loader": {"epoch": 0}}, "loader {'epoch': 0} is not an epoch (-1 before the first) and a position"),
    ({"loader": {"epoch": 0, "position": 3}}, "a position that is a multiple of global_batch_size"),
    ({"loader": {"epoch": 0, "position": -8}}, "a position that is a multiple of global_batch_size"),  # (a multiple)
    ({"loader": {"epoch": -5, "position": 0}}, "is not an epoch (-1 before the first)"),  # once numpy's error
    ({"loader": {"epoch": -2, "position": 0}}, "is not an epoch (-1 before the first)"),  # (the first one refused)
    ({"optimizer": {}}, "optimizer is not AdamW's state of two parameter groups"),
    # once a heap corruption (fused AdamW wrote past the end), and a resume with fresh moments
    (lambda ck: ck["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)), "optimizer is not AdamW's state"),
    (lambda ck: ck["optimizer"]["state"].clear(), "optimizer is not AdamW's state"),
    # AdamW's step: once a traceback from inside the first update
    (lambda ck: ck["optimizer"]["state"][0].update(step=torch.tensor([1.0, 2.0])), "optimizer is not AdamW's state"),
    (lambda ck: ck["optimizer"]["state"][1].update(step=torch.tensor(float("nan"))), "optimizer is not AdamW's"),
    (lambda ck: ck["optimizer"]["state"][1].update(step=torch.tensor(-1.0)), "optimizer is not AdamW's"),  # (NaN loss)
    ({"model": {}}, "model weight transformer.wte.weight is missing, not this model's, or of another shape"),
    (lambda ck: ck["model"].update({"transformer.ln_f.weight": ck["model"]["transformer.ln_f.weight"].bool()}),
     "model weight transformer.ln_f.weight is missing, not this model's, or of another shape or no floats"),
    (lambda ck: ck["model"].update(extra=torch.zeros(1)), "model weight extra is missing, not this model's"),
    ({"val_loss": torch.tensor(1.0)}, "a value beside the tensors is not plain data"),  # broken JSON for rank 1
    ({"scaler": {"scale": "x"}}, "the scaler's state {'scale': 'x'} is not one"),  # float16: once a traceback
    ({"scaler": {**SCALER, "scale": 0.0}}, "the scaler's state"),  # a float16 run would stall: no step is taken
    ({"scaler": {**SCALER, "growth_interval": -1}}, "the scaler's state"),
    ({"scaler": {**SCALER, "growth_interval": 0}}, "the scaler's state"),  # the scale would never grow again
    ({"scaler": {**SCALER, "scale": float("inf")}}, "the scaler's state"),  # every step skipped, exit 0
    ({"scaler": {**SCALER, "growth_interval": 2000.5}}, "the scaler's state"),  # a traceback in its update
    ({"scaler": {**SCALER, "backoff_factor": 0.0}}, "the scaler's state"),
    ({"scaler": {**SCALER, "growth_factor": 1.0}}, "the scaler's state"),
    ({"scaler": {**SCALER, "_growth_tracker": -1}}, "is not one (GradScaler's)"),
    ({"hellaswag_step": 2.5}, "hellaswag_step 2.5 is not a whole number"),
    ({"log": [{"step": 0}]}, "log [{'step': 0}] is not metrics.jsonl's text"),  # would be written as the log
    ("fifo", "it is not a file"),  # once a hang
])
def test_bad_checkpoints_are_clear_errors_naming_the_file(trained_copy, tmp_path, script, problem, message):
    """(a dict: a checkpoint with those values changed)"""
    out = trained_copy
    path = tmp_path / "given.pt"
    overrides = {}
    if problem == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif problem == "fifo":
        os.mkfifo(path)
    elif isinstance(problem, str) and problem.startswith("other "):
        shutil.copy(out / "last.pt", path)
        overrides = {"other shape": {"n_embd": 64}, "other bias": {"bias": False}, "other seed": {"seed": 7},
                     "other global batch": {"global_batch_size": 16}}[problem]
    elif problem != "missing":
        ckpt = torch.load(out / "last.pt", weights_only=True)
        if callable(problem):
            problem(ckpt)
        torch.save({**ckpt, **({"format": 99} if problem == "unknown format" else {} if callable(problem) else problem)},
                   path)
    proc = script("train.py", *tiny_args(data_dir_of(out), out, resume=str(path), **overrides))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and str(path) in proc.stderr and "Traceback" not in proc.stderr


def data_dir_of(out_dir):
    return json.loads((out_dir / "config.json").read_text())["config"]["data_dir"]


class Exploit:
    """Unpickling this would run a shell command."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/gpt-train-pwned",))


def test_a_checkpoint_that_would_run_code_is_refused(trained_copy, tmp_path):
    out = trained_copy
    ckpt = torch.load(out / "last.pt", weights_only=True)
    torch.save({**ckpt, "config": Exploit()}, out / "last.pt")
    if os.path.exists("/tmp/gpt-train-pwned"):
        os.remove("/tmp/gpt-train-pwned")
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        checkpoint.load(out / "last.pt", {}, resolve([]))
    assert not os.path.exists("/tmp/gpt-train-pwned")


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_and_no_temporaries(trained_copy, tmp_path,
                                                                                   monkeypatch):
    out = trained_copy
    before, previous = (out / "last.pt").read_bytes(), (out / "previous.pt").read_bytes()
    real_save = torch.save

    def save_then_fail(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save({"step": 11}, out, best=False)
    # nothing rotated: previous.pt is not last.pt's second name (a fallback once lost to a full disk)
    assert (out / "last.pt").read_bytes() == before and (out / "previous.pt").read_bytes() == previous
    assert not (out / "previous.pt").samefile(out / "last.pt")
    assert not list(out.glob(".*.tmp"))
    # the same failure inside a run: a message, and the run's last good checkpoint stays
    with pytest.raises(RunError, match=rf"could not write a checkpoint at step 12.*No space left.*; {out}/last.pt "
                                       rf"holds step 10, the last good one \(--resume={out}/last.pt continues from "
                                       r"it\): free disk space or choose another out_dir, then relaunch\.$"):
        train_here(data_dir_of(out), out, max_iters=12, eval_interval=12, resume="auto")
    assert (out / "last.pt").read_bytes() == before
    # resumed from a path resume=auto would not pick (a rollback; another folder's): the line names it (it said
    # "previous.pt holds step ...: relaunch with resume=auto", which went on from last.pt, or from scratch)
    with pytest.raises(RunError, match=rf"; {out}/previous.pt holds step \d+, the last good one \(--resume={out}/"
                                       r"previous.pt continues from it\)"):
        train_here(data_dir_of(out), out, max_iters=12, eval_interval=12, resume=out / "previous.pt")
    from errors import _kept
    assert _kept(("my runs/last.pt", 4, False)).endswith("(--resume='my runs/last.pt' continues from it)")  # pastes
    assert not list(out.glob(".*.tmp"))
    monkeypatch.setattr(torch, "save", raising(PermissionError(13, "Permission denied")))  # (chattr +i)
    with pytest.raises(RunError, match=r"at step 12 \(\[Errno 13\] Permission denied\).*: make out_dir writable or "):
        train_here(data_dir_of(out), out, max_iters=12, eval_interval=12, resume="auto")


class Killed(BaseException):
    pass


def test_a_kill_while_best_is_written_leaves_last_one_save_behind(trained_copy, monkeypatch):
    """best is written before last is committed, both formats: killed in between, the resume
    redoes the step and writes best again (after last, best_val_loss would already count it)."""
    import sharded

    def killed(src, dst):
        raise Killed(dst)
    out = trained_copy
    before, previous = (out / "last.pt").read_bytes(), (out / "previous.pt").read_bytes()
    monkeypatch.setattr(checkpoint, "link_or_copy", lambda src, dst: killed(src, dst) if dst.name == "best.pt"
                        else link_or_copy(src, dst))
    with pytest.raises(Killed):  # (or a copy to best.pt that fails: no hard links, a full disk)
        checkpoint.save({"step": 11}, out, best=True)
    assert (out / "last.pt").read_bytes() == before
    assert (out / "previous.pt").read_bytes() == previous and not list(out.glob(".*.tmp"))  # not rotated yet
    for folder, step in (("last.dcp", 10), (sharded.TMP, 11)):  # as a sharded save leaves them to commit
        (out / folder).mkdir()
        (out / folder / "run.json").write_text(json.dumps({"step": step}))
    monkeypatch.setattr(sharded, "link_or_copy", killed)
    with pytest.raises(Killed):
        sharded._commit(out, best=True, rotate=True)
    assert json.loads((out / "last.dcp" / "run.json").read_text()) == {"step": 10}
    monkeypatch.setattr(sharded, "link_or_copy", raising(OSError(28, "No space left on device")))  # (no hard links)
    with pytest.raises(OSError) as failed:  # (copytree's shutil.Error: a list of them, in the run's line)
        sharded._commit(out, best=True, rotate=True)
    assert type(failed.value) is OSError and failed.value.errno == 28
    assert json.loads((out / "last.dcp" / "run.json").read_text()) == {"step": 10}
    assert not list(out.glob(".*.tmp"))  # the parts written went at once: not at the next start (the disk stays full)
    (out / sharded.TMP).mkdir()
    (out / sharded.TMP / "run.json").write_text(json.dumps({"step": 12}))
    replace = os.replace

    def overlayfs(src, dst):  # a folder of its lower layer (a container image's): never renamed (each save failed)
        if Path(src).name == "last.dcp":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        replace(src, dst)
    monkeypatch.setattr(os, "replace", overlayfs)
    monkeypatch.setattr(sharded, "exchange", lambda a, b: False)  # (overlayfs swaps no such folder either)
    monkeypatch.setattr(sharded, "link_or_copy", link_or_copy)
    sharded._commit(out, best=False, rotate=True)
    assert [json.loads((out / f"{name}.dcp" / "run.json").read_text()) for name in ("last", "previous")] == [
        {"step": 12}, {"step": 10}] and not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("swap", [True, False], ids=["renameat2", "two renames"])
def test_a_sharded_commit_leaves_a_live_runs_readers_a_last_dcp(tmp_path, monkeypatch, swap):
    """sample.py or the converter reading a live run's last.dcp found none between a save's two renames ("train
    first"), or while the folders it replaced were deleted. Where the system swaps two folders in one step, there is
    no such moment; elsewhere two renames commit, and the deletes wait until last.dcp is back."""
    import sharded
    from data.files import exchange
    (tmp_path / "a").mkdir()
    if swap and not exchange(tmp_path / "a", tmp_path / "a"):
        pytest.skip("this system or file system has no renameat2 with RENAME_EXCHANGE")
    assert not exchange(tmp_path / "a", tmp_path / "b") and (tmp_path / "a").is_dir()  # (nothing to swap with)
    for folder, step in (("previous.dcp", 9), ("last.dcp", 10), (sharded.TMP, 11)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "run.json").write_text(json.dumps({"step": step}))
    seen, deleted, remove = [], [], sharded.remove

    def watched(call):
        def each(*args):
            seen.append((tmp_path / "last.dcp").is_dir())
            result = call(*args)
            seen.append((tmp_path / "last.dcp").is_dir())
            return result
        return each
    monkeypatch.setattr(sharded, "exchange", watched(exchange if swap else lambda a, b: False))
    monkeypatch.setattr(sharded, "_rename", watched(sharded._rename))
    monkeypatch.setattr(sharded, "remove", lambda path: (path.exists() and deleted.append(
        (json.loads((path / "run.json").read_text())["step"], (tmp_path / "last.dcp").is_dir()))) or remove(path))
    sharded._commit(tmp_path, best=True, rotate=True)
    assert [json.loads((tmp_path / f"{name}.dcp" / "run.json").read_text())["step"]
            for name in ("last", "previous", "best")] == [11, 10, 11] and not list(tmp_path.glob(".*"))
    assert seen and all(seen) == swap, seen
    assert deleted == [(9, True)], deleted  # the old previous.dcp, once last.dcp is back


@pytest.mark.slow  # mount and umount are processes
def test_a_full_disk_leaves_the_previous_checkpoint_loadable(trained, tmp_path):
    size = (trained / "last.pt").stat().st_size
    with small_disk(tmp_path / "disk", str(size * 2 + 65536)) as disk:
        shutil.copy(trained / "last.pt", disk / "last.pt")
        big = torch.load(disk / "last.pt", weights_only=True)
        big["padding"] = torch.zeros(size // 2, dtype=torch.uint8)  # the new one cannot fit
        with pytest.raises((OSError, RuntimeError)):  # torch's zip writer reports it as RuntimeError
            checkpoint.save(big, disk, best=False)
        assert torch.load(disk / "last.pt", weights_only=True)["step"] == 10
        assert not list(disk.glob(".*.tmp"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_float16_overflow_is_skipped_by_the_scaler_and_the_run_goes_on(char_data, tmp_path, monkeypatch, device):
    # A scale far too high, as at the start of any float16 run but more so: the first steps'
    # scaled gradients overflow float16; the scaler must skip them (halving its scale each
    # time) and the run must neither stop nor count them as divergence.
    scalers = []

    class HighScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "init_scale": 2.0 ** 40})
            scalers.append(self)

    monkeypatch.setattr(torch.amp, "GradScaler", HighScaler)
    result = train_here(char_data, tmp_path, max_iters=40, eval_interval=40, dtype="float16", device=device)
    skipped = 40 - math.log2(scalers[0].get_scale())  # growth would take 2000 clean steps
    log = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert result["step"] == 40 and 5 <= skipped < 40, skipped
    # the skipped steps are the ones whose unscaled gradients held inf, and only those
    assert sum(not math.isfinite(r["grad_norm"]) for r in steps) == skipped
    assert all(math.isfinite(r["loss"]) for r in steps)
    evals = [r["val_loss"] for r in log if "val_loss" in r]
    assert evals[-1] < evals[0] - 0.2
    weights = torch.load(tmp_path / "last.pt", weights_only=True)["model"].values()
    assert all(torch.isfinite(w).all() for w in weights)


def test_an_error_line_a_launcher_cannot_collect_goes_to_stderr(tmp_path, monkeypatch, capsys):
    """train_spawn.py's ranks write their line into ERRORS_TO; where that fails (a full /tmp), the line was
    lost to an OSError's traceback; it goes to stderr instead."""
    from errors import say
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ERRORS_TO", str(tmp_path / "file"))  # not a folder: every write there fails
    say("error: the real reason")
    assert capsys.readouterr().err == "error: the real reason\n"
    monkeypatch.setenv("ERRORS_TO", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    say("error: collected")
    assert capsys.readouterr().err == "" and (tmp_path / "0").read_text() == "error: collected"
    monkeypatch.setenv("RANK", "1")  # each rank its own file: the launcher prints each distinct line once
    say("error: rank 1's")
    assert capsys.readouterr().err == "" and (tmp_path / "1").read_text() == "error: rank 1's"
    assert (tmp_path / "0").read_text() == "error: collected"
    writes = []  # on a stderr that ranks share (torchrun's), line and newline in one write: never "...error: ..."
    monkeypatch.delenv("ERRORS_TO")
    monkeypatch.setattr(sys, "stderr", type("Stderr", (), {"write": writes.append, "flush": lambda self: None})())
    say("error: whole")
    assert writes == ["error: whole\n"]
