"""A bad day: a full disk, a folder this user may not enter, a kill at any byte, a dtype change, an impossible size, Ctrl-C. Each is
survived, or ends in one `error:` line (the same on every rank) and the documented exit status;
never a traceback."""

import ctypes
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import checkpoint

import sample
import train
from config import resolve
from errors import ConfigError, LogNotWritten
from harness import REPO, child_env, no_temporaries, run_world, small_disk, tiny_args, without_log
from model import GPT, GPTConfig


def train_cli(capsys, data, out, **overrides) -> tuple:
    """train.py's entry point in this process: (exit status, stdout, stderr)."""
    try:
        train.cli(tiny_args(data, out, **{"resume": "auto", **overrides}))
        code = 0
    except SystemExit as e:
        code = e.code
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def one_error(err: str) -> str:
    """The one distinct `error:` line of a run (every rank prints it), with no traceback."""
    assert "Traceback" not in err, err
    lines = {line for line in err.splitlines() if line.startswith("error:")}
    assert len(lines) == 1, err
    return lines.pop()


def fill(disk: Path, leave: int = 0) -> Path:
    """Take every free byte of `disk` but `leave`; the file, to delete to free them again."""
    filler = disk / "filler"
    try:
        with open(filler, "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError:
        pass
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


@pytest.mark.slow
def test_a_log_or_checkpoint_cut_at_any_byte_never_blocks_a_resume(char_data, tmp_path, capsys):
    """metrics.jsonl cut anywhere: the checkpoint's copy of the log restores it (an older checkpoint,
    which holds none: the torn last line is dropped with one warning) and the run goes on; last.pt
    cut anywhere: previous.pt takes its place, saying so."""
    trained = tmp_path / "trained"
    assert train_cli(capsys, char_data, trained, max_iters=10, eval_interval=5)[0] == 0
    logged = (trained / "metrics.jsonl").read_text()
    older = shutil.copytree(trained, tmp_path / "older")
    without_log(older)
    rng = random.Random(0)
    for source, name in ((trained, "metrics.jsonl"), (older, "metrics.jsonl"), (trained, "last.pt")):
        size = (source / name).stat().st_size
        for offset in rng.sample(range(1, size - 1), 2):
            out = tmp_path / f"{source.name}-{name}-{offset}"
            shutil.copytree(source, out)
            with open(out / name, "r+b") as f:
                f.truncate(offset)
            code, printed, err = train_cli(capsys, char_data, out, max_iters=12, eval_interval=5)
            assert code == 0, err
            if name == "last.pt":
                assert "trying" in err and "previous.pt" in err and "resuming from" in printed
            elif source is trained:
                assert "unreadable" not in printed and (out / name).read_text().startswith(logged)
            elif not (out / name).read_bytes()[:offset].endswith(b"\n"):
                assert "warning: dropped 1 unreadable line" in printed
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert records[-1]["step"] == 12
    # lines that parse but hold no step (an edited file) are dropped the same way
    out = shutil.copytree(older, tmp_path / "edited")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": null}\n{"step": "x"}\n[]\n{"step": 1e999}\n')  # (the last: inf, no integer)
    code, printed, err = train_cli(capsys, char_data, out, max_iters=12, eval_interval=5)
    assert code == 0 and "warning: dropped 4 unreadable lines" in printed, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if r["step"] <= 10] == [json.loads(line) for line in logged.splitlines()]  # step 10's too
    # an older previous.pt (step 5), the log beside it running on to 10: the rows past 5 are the new run's, once each
    out = shutil.copytree(older, tmp_path / "rolled back")
    without_log(out, "previous.pt")
    code, _, err = train_cli(capsys, char_data, out, max_iters=12, eval_interval=5, resume=str(out / "previous.pt"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert code == 0 and [r["step"] for r in rows if "loss" in r] == list(range(1, 13)), err


@pytest.mark.parametrize("lost, steps_run, error, fix", [  # the save at 4 stops it; the next step's agreement does
    ('"step": 4, "train_eval_loss"', 4, (28, "No space left on device"), "free disk space"),
    ('"step": 2, "loss"', 3, (1, "Operation not permitted"), "make it writable")])  # chattr +i
def test_a_log_line_that_could_not_be_written_stops_the_run_before_a_checkpoint_passes_it(
        char_data, tmp_path, monkeypatch, lost, steps_run, error, fix):
    """A row of step 2 or 4 is lost (a disk full for a moment): a checkpoint of step 4 would make a resume
    start past it, and the log would lack it for good. The run stops instead, with no checkpoint past it."""
    import logger
    real_open, step, calls = open, train.optimizer_step, []
    monkeypatch.setattr(train, "optimizer_step", lambda run: calls.append(1) or step(run))

    class FullForTheRow:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            if text.startswith("{" + lost):
                raise OSError(*error)
            return self.f.write(text)
    monkeypatch.setattr(logger, "open", lambda path, mode="r": FullForTheRow(real_open(path, mode)), raising=False)
    with pytest.raises(LogNotWritten, match=rf"could not write .*metrics\.jsonl \({error[1]}\): {fix}, then "
                                            r"relaunch \(a line cut short is dropped\); no checkpoint of this run"):
        train.main(resolve(tiny_args(char_data, tmp_path / "out", max_iters=8, eval_interval=4, log_interval=1)))
    assert not (tmp_path / "out" / "last.pt").exists() and len(calls) == steps_run


@pytest.mark.parametrize("signal_at_step", [None, 2])  # lost before a log row; before a stop's save
def test_a_run_whose_out_dir_was_replaced_under_it_writes_nothing_more_there(char_data, tmp_path, monkeypatch,
                                                                              signal_at_step):
    """out_dir deleted (or moved) while the run trains, and another run now in a new one: the first run used to
    go on appending its rows to the other's metrics.jsonl and overwriting its last.pt. It stops instead, and
    its clean-up leaves the other run's folder alone."""
    out, step, other = tmp_path / "out", train.optimizer_step, '{"host": "elsewhere", "pid": 1, "started": "now"}'

    def replaced_at_step_2(run):
        if run.step == 2:
            shutil.rmtree(out)
            out.mkdir()
            (out / "run.lock").write_text(other)
            if signal_at_step:
                os.kill(os.getpid(), signal.SIGTERM)
        return step(run)
    monkeypatch.setattr(train, "optimizer_step", replaced_at_step_2)
    interval = 100 if signal_at_step else 1
    with pytest.raises(LogNotWritten, match=rf"rank 0 stopped writing: {re.escape(str(out / 'run.lock'))} is no "
                                            rf"longer this run's lock \({re.escape(str(out))} was deleted, moved"):
        train.main(resolve(tiny_args(char_data, out, max_iters=8, eval_interval=4, log_interval=interval)))
    assert [p.name for p in out.iterdir()] == ["run.lock"] and (out / "run.lock").read_text() == other


@pytest.mark.slow
def test_a_full_disk_ends_the_run_with_no_space_left_and_earlier_checkpoints_usable(char_data, tmp_path, capsys):
    with small_disk(tmp_path / "tiny", "64k") as disk:  # too small for the first checkpoint
        code, _, err = train_cli(capsys, char_data, disk / "out", max_iters=5, eval_interval=5)
        message = one_error(err)
        assert code == 1 and "No space left on device" in message, err
        assert "no checkpoint of this run was written yet" in message
        # a prepare script's dataset, too big for it: a full disk, named (numpy's tofile said only "N requested and M
        # written", and a file-size limit the same way: the arrays are written with file.write, which says which)
        from data.dataset import write_dataset
        with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device for the dataset in .*tiny/data: free"):
            write_dataset(disk / "data", [0] * 100_000, [0] * 10, {"vocab_size": 65, "tokenizer": "gpt2", "source": "x"})
        assert not any((disk / "data").iterdir())  # no temporary left
    with small_disk(tmp_path / "disk", "2m") as disk:
        out = disk / "out"
        assert train_cli(capsys, char_data, out, max_iters=5, eval_interval=5)[0] == 0
        filler = fill(disk)  # the log, config.json or the next checkpoint: whichever comes first
        code, _, err = train_cli(capsys, char_data, out, max_iters=10, eval_interval=5)
        message = one_error(err)
        assert code == 1 and "No space left on device" in message and "last.pt holds step 5" in message, err
        assert torch.load(out / "last.pt", weights_only=True)["step"] == 5
        filler.unlink()
        assert train_cli(capsys, char_data, out, max_iters=10, eval_interval=5)[0] == 0
        assert torch.load(out / "last.pt", weights_only=True)["step"] == 10
    with small_disk(tmp_path / "async", "2m") as disk:  # a background save fails
        out, sharded = disk / "out", dict(checkpoint_format="sharded", async_checkpoint=True)
        assert train_cli(capsys, char_data, out, max_iters=5, eval_interval=5, **sharded)[0] == 0
        fill(disk, leave=64 * 1024)  # room for run.json and the log, not for the shards
        code, _, err = train_cli(capsys, char_data, out, max_iters=10, eval_interval=5, **sharded)
        message = one_error(err)
        assert code == 1 and "No space left on device" in message and "last.dcp holds step 5" in message, err
        assert checkpoint.read(out / "last.dcp")["step"] == 5 and no_temporaries(out)  # (the part written: gone)
        code, _, err = train_cli(capsys, char_data, out, max_iters=10, eval_interval=5, checkpoint_format="sharded")
        assert code == 1 and "last.dcp holds step 5" in one_error(err) and no_temporaries(out), err  # (not async)


@pytest.mark.slow
def test_the_dtype_may_change_across_a_resume(char_data, tmp_path, capsys):
    """float32 -> float16 -> bfloat16 -> float16 -> float32: each resume continues; entering
    float16 starts a fresh loss scale and says so once."""
    step = 0
    for before, dtype in ((None, "float32"), ("float32", "float16"), ("float16", "bfloat16"),
                          ("bfloat16", "float16"), ("float16", "float32")):
        step += 3
        code, printed, err = train_cli(capsys, char_data, tmp_path, max_iters=step, eval_interval=3, dtype=dtype)
        assert code == 0, err
        assert ("loss scale starts afresh" in printed) == (dtype == "float16" and before not in (None, "float16"))
        assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == step


@pytest.mark.slow
def test_the_dtype_may_change_across_a_resume_under_fsdp(char_data, tmp_path):
    for step, dtype in ((3, "float32"), (6, "float16")):  # the case that crashed: a float16 scaler from nothing
        results = run_world(2, tiny_args(char_data, tmp_path / "out", max_iters=step, eval_interval=3,
                                         dtype=dtype, strategy="fsdp", resume="auto"), tmp_path / f"r{step}")
        assert [r["step"] for r in results] == [step, step]


def test_an_impossible_model_is_refused_before_anything_is_allocated(char_data, tmp_path, capsys):
    start = time.monotonic()
    code, _, err = train_cli(capsys, char_data, tmp_path / "out", n_layer=10**6, n_embd=10**6, n_head=1)
    assert code == 2 and "needs at least" in one_error(err) and "GB" in err
    assert time.monotonic() - start < 30 and not (tmp_path / "out").exists()  # and no out_dir left behind
    # a global batch of 10**10 sequences once took all memory for the loader's order of windows
    code, _, err = train_cli(capsys, char_data, tmp_path / "out", batch_size=1, global_batch_size=10**12)
    assert code == 2 and re.search(r"global_batch_size=1,000,000,000,000 needs at least 16,000\.0 GB per process for "
                                   r"the loader's window order, but this host has [\d,.]+ GB", one_error(err)), err
    assert time.monotonic() - start < 30 and not (tmp_path / "out").exists()


def test_the_memory_bound_counts_one_micro_batchs_logits_and_only_this_ranks_shard(monkeypatch):
    """16 bytes a parameter (weights, gradients, AdamW's moments), divided among FSDP's shards, plus the
    float32 logits and each block's float32 input (kept for backward) of one micro-batch: a model that needs a
    byte more than the memory left is refused. (A batch_size of 10**7 of a 23-character vocabulary passed, and the
    kernel killed the run without a word.)"""
    from types import SimpleNamespace
    import parallel
    from world import World
    model, cfg = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64), SimpleNamespace(
        batch_size=8, block_size=64, global_batch_size=8)
    state, logits = 16 * model.n_params, 4 * 8 * 64 * (model.padded_vocab_size + 2 * 64)
    fsdp = lambda shard_size: World(size=4, strategy="fsdp", shard_size=shard_size)  # noqa: E731
    # (on the CPU a host's processes share its memory: "more processes" on one host could never pass)
    ddp, hsdp, more = "more hosts with --strategy=fsdp", "--fsdp_shard_size=0, which shards over", "more hosts"
    gpu = World(device=torch.device("cuda", 0))
    for free, world, refused in [(state + logits - 1, World(), ddp), (state + logits, World(), None),
                                 (state // 4 + logits, fsdp(4), None), (state // 4 + logits - 1, fsdp(4), more),
                                 (state // 4 + logits, fsdp(2), hsdp),  # (HSDP: more processes were advised)
                                 (state // 4 + logits, World(size=4, shard_size=4), ddp),  # DDP: whole
                                 (state + logits - 1, gpu, "more processes with --strategy=fsdp"),
                                 (state + logits - 1, World(size=2, local_size=2),  # each holds the whole model
                                  "fewer processes on this host, or more hosts with --strategy=fsdp")]:
        monkeypatch.setattr(parallel, "available_memory", lambda device, local_size, free=free: free)
        problem = parallel.memory_problem(model, cfg, world)
        assert (problem is not None) == bool(refused), (free, world)
        assert not refused or "GB of logits and activations for batch_size=8" in problem and problem.endswith(
            f"choose a smaller model or batch_size, or {refused}" + " every rank" * (refused == hsdp)), problem
    for checkpointing in (False, True):  # a lower bound: one micro-batch's forward and backward take more than that
        gpt, x = GPT(model), torch.zeros(8, 64, dtype=torch.long)
        parallel.set_activation_checkpointing(gpt, checkpointing)
        with PeakBytes([*gpt.parameters(), x]) as measured:
            gpt(x, x)[1].backward()
        assert measured.peak >= logits + 4 * model.n_params, (checkpointing, measured.peak)  # (+ the gradients)
    cfg.batch_size = 100 * cfg.batch_size  # the logits alone past the memory: sharding the model cannot help
    monkeypatch.setattr(parallel, "available_memory", lambda device, local_size: 100 * logits)
    assert parallel.memory_problem(model, cfg, fsdp(4)).endswith("available: choose a smaller batch_size")
    cfg.batch_size, cfg.block_size = 1, 800 * 64  # one sequence already: a shorter one; the state too: a smaller model
    monkeypatch.setattr(parallel, "available_memory", lambda device, local_size: min(100 * logits, state - 1))
    assert parallel.memory_problem(model, cfg, World()).endswith("available: choose a smaller block_size and model")


def test_the_memory_bound_is_the_cgroups_limit_where_it_is_below_the_hosts(tmp_path, monkeypatch):
    """SLURM's --mem and docker --memory set a cgroup's limit, which MemAvailable (the host's) does not show:
    an impossible size passed the check and the kernel killed the run without a word."""
    import world
    proc, root = tmp_path / "cgroup", tmp_path / "sys"
    for folder, name, limit in [("job", "memory.max", "3000"), ("job/step", "memory.max", "max"),  # v2: a parent's
                                ("memory/x", "memory.limit_in_bytes", "9223372036854771712")]:  # v1: none
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / name).write_text(limit + "\n")
    proc.write_text("4:memory:/x\n0::/job/step\n")
    assert world.cgroup_memory_limit(str(proc), str(root)) == 3000
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text("2000\n")
    assert world.cgroup_memory_limit(str(proc), str(root)) == 2000
    proc.write_text("4:memory:/elsewhere\n0::/\n")  # a container's cgroup, mounted as the root: none here
    assert world.cgroup_memory_limit(str(proc), str(root)) == 2**62
    assert world.cgroup_memory_limit(str(tmp_path / "none"), str(root)) == 2**62  # (MemAvailable then, not 2**62)
    monkeypatch.setattr(world, "cgroup_memory_limit", lambda: 4 * 2**20)
    assert world.available_memory(torch.device("cpu"), local_size=2) == 2 * 2**20


class PeakBytes(TorchDispatchMode):
    """The most bytes the tensors made inside it held at once (a storage counted once, however many views;
    views of `existing` tensors not at all)."""

    def __init__(self, existing):
        super().__init__()
        self.views, self.size, self.now, self.peak = {}, {}, 0, 0
        self.existing = {t.untyped_storage().data_ptr() for t in existing}

    def _dropped(self, key):
        self.views[key] -= 1
        if not self.views[key]:
            self.now -= self.size.pop(key)
            del self.views[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            key = t.untyped_storage().data_ptr()
            if key in self.existing:
                continue
            if key not in self.views:
                self.views[key], self.size[key] = 0, t.untyped_storage().nbytes()
                self.now += self.size[key]
                self.peak = max(self.peak, self.now)
            self.views[key] += 1
            weakref.finalize(t, self._dropped, key)
        return out


@pytest.mark.parametrize("shape, prompt, new", [
    (dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=68), 1, 100),  # the cache restarts
    (dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65), 16, 5),  # a whole block of prompt
    (dict(n_layer=3, n_head=6, n_embd=96, block_size=32, vocab_size=50257), 1, 3),  # GPT-2's vocabulary
])
def test_a_huge_sample_request_runs_in_batches_that_fit_its_plan(monkeypatch, shape, prompt, new):
    config, cpu = GPTConfig(**shape), torch.device("cpu")
    per_sample = sample.sample_bytes(prompt, new, config)
    assert sample.sample_bytes(prompt, 10**11, config) > 8 * 10**11  # (the ids: past the block, no other term grows)
    torch.manual_seed(0)
    model, idx = GPT(config).eval(), torch.zeros(20, prompt, dtype=torch.long)
    with PeakBytes([*model.state_dict().values(), idx]) as measured:  # generate's peak, per sample of a batch
        model.generate(idx, new, generator=torch.Generator().manual_seed(0))
    # the plan covers it, and not by much (it once left out the activations: 1.7x over plan here, 3.4x with a long prompt)
    assert measured.peak / 20 <= per_sample <= 2 * measured.peak / 20
    assert list(sample.batches(5, prompt, new, config, cpu)) == [5]  # small: one generate call
    # planned one batch at a time (a list of them all once took memory without bound)
    tracemalloc.start()
    first = list(itertools.islice(sample.batches(10**11, prompt, new, config, cpu), 2))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert first[0] == first[1] > 1 and peak < 10**6
    monkeypatch.setattr(sample, "CHUNK_BYTES", 2 * per_sample)
    assert list(sample.batches(5, prompt, new, config, cpu)) == [2, 2, 1]
    monkeypatch.setattr(sample, "available_memory", lambda device: per_sample - 1)
    with pytest.raises(ConfigError, match="one sample needs .* available: ask for fewer --max_new_tokens"):
        next(sample.batches(1, prompt, new, config, cpu))


def test_a_non_finite_number_is_named_as_such():
    for text in ("nan", "inf", "-Infinity"):
        with pytest.raises(ConfigError, match="learning_rate' must be a finite number"):
            resolve([f"--learning_rate={text}"])


def test_a_failed_collective_says_what_to_relaunch_without_naming_a_file_that_may_not_exist():
    from collectives import collective_failures_explained
    from errors import CollectiveFailed
    from world import World
    with pytest.raises(CollectiveFailed) as failed, collective_failures_explained(World(size=2), 1e6, lambda: "step 7"):
        raise RuntimeError("Connection closed by peer")
    assert str(failed.value).endswith("(dist_timeout=1000000s): relaunch every rank (training with resume=auto "
                                      "continues from the newest checkpoint written, last.pt on rank 0's host "
                                      "or the shared last.dcp).")
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"), collective_failures_explained(
            World(), 10, lambda: "step 7"):  # one process has no peer to have lost: the error as it is
        raise RuntimeError("Connection closed by peer")


def test_the_prepare_hint_names_the_real_script(tmp_path):
    from data.dataset import load_meta
    for name, hint in (("shakespeare_char", "python data/shakespeare_char/prepare.py --out_dir"),
                       ("elsewhere", "the dataset's prepare.py --out_dir")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text("{")
        with pytest.raises(ValueError, match=hint):
            load_meta(tmp_path / name)


# --- every entry point, the same classes of bad input ---------------------------------------

@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    with small_disk(tmp_path_factory.mktemp("full"), "64k") as disk:
        fill(disk)
        yield disk


@pytest.fixture(scope="module")
def a_run(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    subprocess.run([sys.executable, "train.py", *tiny_args(char_data, out, max_iters=2, eval_interval=2)],
                   cwd=REPO, env=child_env(), check=True, capture_output=True)
    return out


HUGE = ["--n_layer=1000000", "--n_embd=1000000", "--n_head=1"]
BAD_INPUT = {  # entry point -> {class of bad input: (arguments, exit status)}; {run}, {data}, {full}
    "train.py": {"device": (["--device=tpu"], 2), "size": (HUGE, 2),
                 "path": (["--resume=/nonexistent/last.pt"], 2), "disk": (["--out_dir={full}/out"], 2)},
    # (train_spawn's ranks run train.py's own checks: its size and disk cases are train.py's under torchrun)
    "train_spawn.py": {"device": (["--nproc=2", "--device=tpu"], 2),
                       "path": (["--nproc=2", "--resume=/nonexistent/last.pt"], 2)},
    "sample.py": {"device": (["--out_dir={run}", "--device=tpu"], 2),
                  "size": (["--out_dir={run}", "--max_new_tokens=10000000000000"], 2),
                  "path": (["--out_dir=/nonexistent"], 2)},
    "eval.py": {"device": (["--out_dir={run}", "--device=tpu"], 2), "path": (["--out_dir=/nonexistent"], 2)},
    "bench.py": {"device": (["--nproc=1", "--device=tpu"], 2), "size": (["--nproc=1", *HUGE], 2),
                 "path": (["--nproc=1", "--report=/proc/no/such"], 2)},
    "data/shakespeare_char/prepare.py": {"path": (["--input=/nonexistent.txt", "--out_dir={full}/x"], 2),
                                         "disk": (["--input={data}/../input_text.txt", "--out_dir={full}/x"], 2)},
    "scripts/export_hf.py": {"path": (["--out_dir=/nonexistent", "--to=x"], 2),
                             "disk": (["--out_dir={run}", "--to={full}/hf"], 2)},
    "scripts/plot_runs.py": {"path": (["/nonexistent"], 2), "disk": (["{run}", "--out={full}/runs.png"], 2)},
    "scripts/memory_guide.py": {"size": (["--world=0"], 2)},
    # (its other size errors, word for word: test_bench's test_a_tools_argument_that_cannot_be_is_one_line)
    "scripts/bench_loader.py": {"size": (["--sizes=lots"], 2),
                                "batch": (["--batch_size=100000000000"], 2)},  # more than memory holds
}
CASES = [(entry, kind) for entry, kinds in BAD_INPUT.items() for kind in kinds]


@pytest.mark.slow
@pytest.mark.parametrize("entry,kind", CASES, ids=[f"{e}-{k}" for e, k in CASES])
def test_every_entry_point_meets_bad_input_with_one_line(entry, kind, char_data, a_run, full_disk, tmp_path):
    args, status = BAD_INPUT[entry][kind]
    args = [a.format(run=a_run, data=char_data, full=full_disk) for a in args]
    if entry.startswith(("train", "bench")):  # a tiny run, then the bad input, which wins
        args = tiny_args(char_data, tmp_path / "out") + args
    proc = subprocess.run([sys.executable, entry, *args], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == status, proc.stderr
    one_error(proc.stderr)


def obeying_file_modes():
    """A child's preexec_fn: root (as here and in CI) ignores file modes; without these two capabilities
    (setpriv --bounding-set=-dac_override,-dac_read_search) it is refused as any other user is."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0):  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.slow
@pytest.mark.parametrize("entry, args", [("train.py", ["--out_dir={locked}/out"]), ("train.py", ["--data_dir={locked}/data"]),
                                         ("train.py", ["--resume={locked}/last.pt"]),  # (was "does not exist")
                                         ("sample.py", ["--out_dir={locked}/run"]),
                                         ("scripts/export_hf.py", ["--out_dir={locked}/run", "--to={locked}/../hf"]),
                                         ("scripts/plot_runs.py", ["{tmp}", "--out={locked}/runs.png"])])
def test_a_folder_this_user_may_not_enter_is_one_line(entry, args, char_data, tmp_path):
    """Another user's folder on a shared cluster: each ended in a traceback (PermissionError)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')  # (a run for plot_runs.py)
    args = (tiny_args(char_data, tmp_path / "out") if entry == "train.py" else []) + [
        a.format(locked=locked, tmp=tmp_path) for a in args]
    locked.chmod(0)
    try:
        proc = subprocess.run([sys.executable, entry, *args], cwd=REPO, env=child_env(), capture_output=True, text=True,
                              timeout=300, preexec_fn=obeying_file_modes)
    finally:
        locked.chmod(0o755)
    assert proc.returncode == 2 and re.fullmatch(
        f"error: permission denied: {re.escape(str(locked))}/\\S+: this user may not use it \\(check the mode and "
        f"owner of it and its folders\\), or choose another path\n", proc.stderr), proc.stderr
    assert entry != "scripts/plot_runs.py" or f"{locked}/runs.png:" in proc.stderr  # (not its temporary's name)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, locked", [("file", "last.pt"), ("sharded", "last.dcp/run.json"),
                                         ("sharded", "last.dcp/__0_0.distcp")])  # (a part: read in the ranks' load)
def test_a_last_checkpoint_this_user_may_not_read_stops_every_rank_and_is_kept(char_data, tmp_path, fmt, locked):
    """It was read as damaged: the run fell back to previous and its next save replaced the good last. Started
    afresh (resume=never), the first save replaced it too, where a readable last becomes previous."""
    from harness import train_here
    out = tmp_path / "out"
    train_here(char_data, out, max_iters=4, eval_interval=2, checkpoint_format=fmt)
    kept = [locked, locked.replace("last", "previous")]
    before = {name: (out / name).read_bytes() for name in kept}
    (out / locked).chmod(0)
    try:
        args = tiny_args(char_data, out, max_iters=8, eval_interval=2, resume="auto", checkpoint_format=fmt)
        proc = subprocess.run([sys.executable, "train_spawn.py", "--nproc=2", *args], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=300, preexec_fn=obeying_file_modes)
        sampled = subprocess.run([sys.executable, "sample.py", f"--out_dir={out}", "--checkpoint=last"], cwd=REPO,
                                 env=child_env(), capture_output=True, text=True, timeout=300,
                                 preexec_fn=obeying_file_modes)  # (was "damaged", and sampled previous)
        failed = {name: (out / name).read_bytes() for name in kept}  # (root reads them all)
        afresh = subprocess.run([sys.executable, "train.py", *tiny_args(char_data, out, max_iters=2, eval_interval=2,
                                                                         checkpoint_format=fmt)],
                                cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
                                preexec_fn=obeying_file_modes) if "distcp" not in locked else None  # (resume=never)
    finally:
        for path in out.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert (proc.returncode, proc.stderr) == (2, f"error: permission denied: {out / locked}: this user may not use "
                                                 f"it (check the mode and owner of it and its folders), or choose "
                                                 f"another path\n"), proc.stderr
    assert sampled.returncode == 2 and sampled.stderr == proc.stderr, sampled.stderr
    assert failed == before
    if afresh:  # started afresh: the locked last is now previous, as a readable one would be (a part: not read)
        assert afresh.returncode == 0, afresh.stderr
        assert (out / kept[1]).read_bytes() == before[locked]


def _rank0_denied(rank, world):
    from collectives import on_rank0

    def read():
        raise PermissionError(13, "Permission denied", "/x/last.pt")
    try:
        on_rank0(read, world)
    except PermissionError as e:
        return f"{e.strerror}: {e.filename}"


@pytest.mark.slow
def test_rank_0s_permission_error_is_every_ranks(tmp_path):
    """(rank 0 ended alone, with the permission line; the others waited for its answer, and lost it)"""
    from harness import ranks_say
    assert ranks_say(_rank0_denied, 2, tmp_path, in_group=True) == ["Permission denied: /x/last.pt"] * 2


@pytest.mark.parametrize("tool, args", [("eval.py", ["--limit=x"]), ("data/shakespeare_char/prepare.py", ["--bogus"]),
                                        ("scripts/memory_guide.py", ["--batch_size=x"])])
def test_a_tools_malformed_option_is_one_line_not_its_usage(script, tool, args):
    proc = script(tool, *args)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.endswith(f"(see {Path(tool).name} --help)\n")


@pytest.mark.parametrize("world", ["1", "1,2,4"])
def test_the_memory_guide_table_has_a_cell_under_every_heading(script, world):
    rows = [line for line in script("scripts/memory_guide.py", f"--world={world}").stdout.splitlines()
            if line.startswith("|")]
    assert len(rows) == 6 and len({row.count("|") for row in rows}) == 1, rows  # (once a column short for W=1)


def test_bench_loader_says_why_a_measurement_failed(script, monkeypatch):
    """Its measuring child's last line (here a window order too large for memory), not a traceback."""
    failed = subprocess.CompletedProcess([], 1, "", "Traceback (most recent call last):\n  ...\n"
                                                     "MemoryError: Unable to allocate 149. GiB\n")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: failed)
    proc = script("scripts/bench_loader.py", "--sizes=4e6", "--block_size=16")
    assert proc.returncode == 1 and proc.stderr == ("error: measuring 4,000,000 bytes in 1 shard(s) failed: "
                                                    "MemoryError: Unable to allocate 149. GiB\n"), proc.stderr


def test_bench_loader_labels_a_dataset_under_a_megabyte(script, monkeypatch):
    measured = json.dumps(dict(windows=20, startup_s=0.01, anon_mb=140, file_mb=1, batches_per_s=9000))
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess([], 0, measured, ""))
    proc = script("scripts/bench_loader.py", "--sizes=4e5", "--block_size=16")
    assert proc.returncode == 0 and "| 0.40 MB | one train.bin | 20 |" in proc.stdout, proc.stdout  # (was "0 MB")


@pytest.mark.slow
def test_a_tool_piped_into_head_ends_quietly(a_run, char_data, tmp_path):
    """`sample.py | head -1`: the reader goes away mid-output; the writer ends as a pipe's writer
    does (128 + SIGPIPE), with no traceback. (Its output is more than a pipe's buffer holds.) So do
    train_spawn.py's ranks (rank 1 said a collective failed, and rank 0 'exited with status 141') and
    the launchers' --help."""
    for command in (["sample.py", f"--out_dir={a_run}", "--num_samples=2000", "--max_new_tokens=100"],
                    ["train_spawn.py", "--nproc=2", *tiny_args(char_data, tmp_path, max_iters=100_000)]):
        proc = subprocess.Popen([sys.executable, *command], cwd=REPO, env=child_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 128 + signal.SIGPIPE and "Traceback" not in err and "error" not in err, err
    for launcher in ("train.py", "train_spawn.py"):  # --help, its reader gone before a byte (once a traceback)
        read, write = os.pipe()
        os.close(read)
        proc = subprocess.run([sys.executable, launcher, "--help"], cwd=REPO, env=child_env(), stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
        os.close(write)
        assert proc.returncode == 128 + signal.SIGPIPE and proc.stderr == "", proc.stderr


@pytest.mark.slow
def test_ctrl_c_ends_a_tool_with_one_line(a_run):
    """A tool (here sample.py mid-generation) ends with one line and status 130. (train.py stops at
    the next log step with a checkpoint instead: tests/test_faults.py, test_recovery.py.)"""
    # Ctrl-C's default action even when this suite runs in the background (`cmd &` in a script
    # starts it with SIGINT ignored, and Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "sample.py", f"--out_dir={a_run}", "--max_new_tokens=100000",
                             "--num_samples=64"], cwd=REPO, env=child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stderr:  # its header: the generation starts now
            if line.startswith("# "):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT and one_error(err) == "error: interrupted (Ctrl-C)", err
