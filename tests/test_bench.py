"""bench.py's report and scripts/plot_runs.py, on a tiny model (figures are checked for being
measured and consistent, never against a speed)."""

import json
import subprocess
import sys

import pytest

from harness import REPO, ranks_say, run, train_here

PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 5000, path  # a real picture, not an empty canvas
    import matplotlib.image
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 600 and height > 300


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Run from another folder with a relative config file and report folder: the workers must
    read them where the caller meant (they once ran in the repo, and failed or wrote there)."""
    here = tmp_path_factory.mktemp("bench")
    (here / "tiny.py").write_text('n_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nbatch_size = 4\n'
                                  'global_batch_size = 8\ndtype = "float32"\ndevice = "cpu"\n')
    proc = run([sys.executable, str(REPO / "bench.py"), "tiny.py", "--nproc=1,2", "--strategies=ddp,fsdp",
                "--steps=2", "--warmup=1", "--report=report", "--profile", "--peak_flops=1e10",
                "--hellaswag_interval=5"], timeout=600, cwd=here)  # (ignored: a bench run evaluates nothing)
    return here / "report", proc.stdout


@pytest.mark.slow
def test_bench_writes_json_markdown_and_png(report):
    folder, stdout = report
    data = json.loads((folder / "bench.json").read_text())
    assert {"torch", "device", "host", "command", "cpus"} <= data["info"].keys()
    from model import GPT, GPTConfig  # what was measured: tiny.py's shape, on synthetic data's GPT-2 vocabulary
    n_params = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=50257)).get_num_params()
    assert (data["info"]["vocab_size"], data["info"]["n_params"]) == (50257, n_params)
    assert data["config"]["n_layer"] == 2 and data["config"]["global_batch_size"] == 8
    assert [(r["strategy"], r["nproc"]) for r in data["runs"]] == [("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)]
    table = (folder / "bench.md").read_text()
    assert "python bench.py" in table and table.count("\n| ddp |") == 2 and table.count("\n| fsdp |") == 2
    assert f"synthetic data (vocabulary 50,257) | {n_params / 1e6:.2f}M parameters |" in table
    assert_png(folder / "bench.png")
    assert "report:" in stdout
    # a profile of each run launched (one process of fsdp is measured as ddp), not only of the last
    assert sorted(p.name for p in folder.glob("profile*")) == ["profile-ddp-1.txt", "profile-ddp-2.txt",
                                                               "profile-fsdp-2.txt"]


@pytest.mark.slow
def test_bench_figures_are_positive_and_consistent(report):
    folder, _ = report
    for r in json.loads((folder / "bench.json").read_text())["runs"]:
        raw = r["raw"]
        assert len(raw["step_times"]) == 2 and all(t > 0 for t in raw["step_times"])
        assert r["tokens_per_step"] == 8 * 32
        assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
        assert r["step_time_min_s"] <= r["step_time_s"] <= r["step_time_max_s"]
        assert r["accumulation_steps"] == 8 // (4 * r["nproc"])
        assert r["peak_memory_bytes"] > 10 * 2**20 and len(raw["peak_memory"]) == r["nproc"]
        assert 0 <= r["comm_share"] < 1
        # a CPU's MFU from its given peak, which its processes share: each is measured against its part
        flops_per_token = r["mfu"] * 1e10 / r["tokens_per_sec"]  # (nanoGPT's 6N + 12 L T C, N without wpe)
        assert flops_per_token == pytest.approx(6 * raw["n_params"] + 12 * 2 * 32 * 32, rel=1e-9)
        assert (r["nproc"] == 1) == (raw["step_times_nosync"] is None)
        if r["nproc"] == 1:
            assert r["scaling_efficiency"] == pytest.approx(1.0)
        else:
            base = next(b for b in json.loads((folder / "bench.json").read_text())["runs"]
                        if b["strategy"] == r["strategy"] and b["nproc"] == 1)
            assert r["scaling_efficiency"] == pytest.approx(r["tokens_per_sec"] / (2 * base["tokens_per_sec"]))


@pytest.mark.slow
def test_measured_state_bytes_confirm_the_memory_formula(report):
    """DDP holds 16 bytes per parameter on every rank; FSDP on 2 ranks about half (each rank its
    shard): state_bytes_per_rank, the formula behind scripts/memory_guide.py's table."""
    from model import GPT, GPTConfig
    from memory_guide import state_bytes_per_rank
    folder, _ = report
    runs = {(r["strategy"], r["nproc"]): r["state_bytes"] for r in json.loads((folder / "bench.json").read_text())["runs"]}
    n = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=50257)).get_num_params(
        non_embedding=False)
    # (AdamW also keeps a 4-byte step count per tensor: 112 bytes here, outside the formula)
    assert sum(runs["ddp", 2].values()) == pytest.approx(state_bytes_per_rank(n, 0, "ddp", 2), rel=1e-4)
    assert sum(runs["ddp", 1].values()) == sum(runs["fsdp", 1].values())  # one process: nothing to shard
    fsdp = sum(runs["fsdp", 2].values())
    assert fsdp == pytest.approx(state_bytes_per_rank(n, 0, "fsdp", 2, gathered=False), rel=0.01)
    assert runs["fsdp", 2]["optimizer"] == pytest.approx(runs["ddp", 2]["optimizer"] / 2, rel=0.01)


def test_the_comm_share_is_the_mean_step_without_communication_against_the_mean_step():
    import bench
    raw = dict(config=dict(global_batch_size=8, batch_size=4), step_times=[2.0, 2.0], step_times_nosync=[1.0, 2.0],
               accumulation_steps=1, tokens_per_step=128, peak_memory=[1], memory_kind="peak RSS", state_bytes={},
               mfu=None)
    assert bench.summarise("ddp", 2, raw)["comm_share"] == 0.25  # 1.5 s of 2 s without: a quarter communicates


def test_fsdps_communication_on_a_cpu_is_counted_as_such():
    """Its all-gathers, reduce-scatters and waits were "other" in the profile's summary (45% of a step)."""
    import bench
    kind = lambda key: next((k for k, words in bench.KERNEL_KINDS if any(w in key.lower() for w in words)), "other")
    assert {kind(k) for k in ("FSDP::all_gather", "FSDP::post_backward_reduce", "_c10d_functional::wait_tensor",
                              "c10d::allreduce_", "gloo:all_reduce", "ncclDevKernel_AllGather_RING_LL")} == {
        "communication"}
    assert {kind(k) for k in ("FSDP::all_gather_copy_in", "FSDP::all_gather_copy_out", "aten::copy_")} == {
        "memcpy/fill"}
    assert kind("void at::native::reduce_kernel<512, 1>(...)") == "other"  # (a sum's kernel: no communication)


def test_a_profile_that_cannot_be_written_keeps_the_runs_figures(tmp_path, monkeypatch, capsys):
    """It ended the worker before its figures were written (exit 2, torchrun's traceback, no table)."""
    import torch

    import bench
    monkeypatch.setattr(bench, "timed_steps", lambda run, steps, device: torch.ones(64, 64) @ torch.ones(64, 64))
    (tmp_path / "a_file").write_text("")
    bench.profile_steps(None, torch.device("cpu"), tmp_path / "a_file" / "report", "ddp-1", write=True)
    out, err = capsys.readouterr()
    assert "device time by kind" in out and "matmul" in out
    assert err == f"warning: could not write {tmp_path}/a_file/report/profile-ddp-1.txt (it is a file, or lies under " \
                  f"one): it is above\n"
    bench.profile_steps(None, torch.device("cpu"), tmp_path / "made" / "here", "ddp-1", write=True)  # (worker mode)
    assert "device time by kind" in (tmp_path / "made" / "here" / "profile-ddp-1.txt").read_text()


def test_bench_bad_arguments_are_one_line(script, tmp_path):
    (tmp_path / "a_file").write_text("")  # (it wrote the report into the current folder; a file: "File exists")
    for args, needle in ((["--nproc=0"], "at least 1"), (["--strategies=zero3"], "choose from ddp, fsdp"),
                         (["--report="], "--report= is no folder: give one for bench.json"),
                         ([f"--report={tmp_path / 'a_file'}"], "a_file is no folder"),
                         ([f"--report={tmp_path / 'a_file' / 'sub'}"], "sub is no folder"),  # ([Errno 20] Not a ...)
                         (["--nproc=3"], "x world size (3) = 48: try --global_batch_size=48"),
                         (["--nproc=1,1"], "--nproc=1,1 repeats a value"),
                         (["--steps=5,10"], "--steps=5,10: give a number"), (["--warmup=1,2"], "--warmup=1,2: give"),
                         (["--steps", "20"], "'--steps': write --steps=VALUE"),  # (once: unknown config name)
                         (["--profile=True"], "'--profile=True': --profile takes no value"),
                         (["--init_from=resume"], "bench.py times a run from scratch or from GPT-2's weights"),
                         (["--strategies="], "--strategies=: [''] not allowed (choose from ddp, fsdp)"),  # (unset $VAR)
                         (["--n_layer=96", "--n_head=96", "--n_embd=12288"],  # GPT-3's shape, before any worker
                          "error: this model needs at least 2,798.3 GB per process (174,580M parameters")):
        proc = script("bench.py", *args)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_plot_runs_overlays_two_runs(tmp_path, char_data, script):
    """A short real run, and a second run's metrics.jsonl and config.json written as train.py
    writes them (the plot reads nothing else)."""
    train_here(char_data, tmp_path / "a", max_iters=6, eval_interval=3)
    for name, world, rate in (("b", 2, 0.012),):
        out = tmp_path / name
        out.mkdir()
        rows = [{"step": s, "loss": 4 * (1 - rate) ** s, "lr": 1e-3} for s in range(1, 101)]
        rows += [{"step": s, "train_eval_loss": 4 * (1 - rate) ** s, "val_loss": 4.1 * (1 - rate) ** s,
                  "tokens_seen": s * 2048} for s in range(0, 101, 25)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "config.json").write_text(json.dumps({"run": {"world_size": world, "tokens_per_step": 2048}}))
    out = tmp_path / "plots" / "runs.png"
    proc = script("scripts/plot_runs.py", tmp_path / "a", tmp_path / "b", f"--out={out}")
    assert proc.returncode == 0 and "2 runs" in proc.stdout, proc.stderr
    assert_png(out)


def test_plot_runs_tells_same_named_folders_apart_and_skips_unreadable_lines(tmp_path, script, monkeypatch):
    good = '{"step": 1, "loss": 3.0, "tokens_seen": 128}\n'
    edited = '{"step": 3, "loss": "high", "tokens_seen": "many", "val_loss": [2.0]}\n'  # left out, not plotted
    for exp, bad in (("exp1", edited + '[1, 2]\n{"step": null, "loss": 1.0}\n{"step": 1e999}\n' + "[" * 100_000 + "\n"),
                     ("exp2", '{"step": 2, "loss": 2.9, "tok')):
        (tmp_path / exp / "out").mkdir(parents=True)
        (tmp_path / exp / "out" / "metrics.jsonl").write_text(good + bad)
    (tmp_path / "exp2" / "out" / "config.json").write_text('{"run": 5}')  # not train.py's
    (tmp_path / "exp1" / "out" / "config.json").write_text('{"run": {"tokens_per_step": {"a": 1}, "world_size": 0}}')
    import matplotlib.figure
    figures, savefig = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *args, **kwargs: figures.append(fig) or savefig(fig, *args, **kwargs))
    proc = script("scripts/plot_runs.py", tmp_path / "exp1" / "out", tmp_path / "exp2" / "out",
                  f"--out={tmp_path / 'runs.png'}")
    # one train point each (a run shorter than log_interval): a line of one point is drawn only with a marker
    trains = [line for ax in figures[0].axes for line in ax.get_lines() if line.get_label().endswith(" train")]
    assert trains and all(len(line.get_xdata()) == 1 and line.get_marker() not in (None, "None", "") for line in trains)
    assert proc.returncode == 0 and proc.stdout.splitlines() == [
        f"warning: skipped 4 unreadable lines of {tmp_path}/exp1/out/metrics.jsonl (a write cut short)",
        f"warning: skipped 1 unreadable line of {tmp_path}/exp2/out/metrics.jsonl (a write cut short)",
        f"2 runs -> {tmp_path / 'runs.png'}"], proc.stdout + proc.stderr
    # values no axis can be laid out to (an edit): a matplotlib traceback once; left out like the others
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "metrics.jsonl").write_text(good + '{"step": 1, "loss": 1e308, "tokens_seen": 1e308}\n'
                                                     '{"step": 1e300, "loss": 2.0}\n')
    proc = script("scripts/plot_runs.py", tmp_path / "huge", f"--out={tmp_path / 'huge.png'}")
    assert proc.returncode == 0 and proc.stdout == f"1 run -> {tmp_path / 'huge.png'}\n", proc.stdout + proc.stderr
    (tmp_path / "first").mkdir()  # a run that has evaluated its start only: its one val point is drawn
    (tmp_path / "first" / "metrics.jsonl").write_text('{"step": 0, "train_eval_loss": 4.2, "val_loss": 4.2, '
                                                      '"tokens_seen": 0}\n')
    proc = script("scripts/plot_runs.py", tmp_path / "first", f"--out={tmp_path / 'first.png'}")
    assert proc.returncode == 0 and proc.stdout == f"1 run -> {tmp_path / 'first.png'}\n", proc.stdout + proc.stderr
    # a label of non-UTF-8 bytes (a folder's name, as Python keeps it): a matplotlib traceback once
    proc = script("scripts/plot_runs.py", tmp_path / "huge", "--labels=run\udcff", f"--out={tmp_path / 'huge.png'}")
    assert proc.returncode == 0, proc.stderr
    proc = script("scripts/plot_runs.py", tmp_path / "huge", "--labels=$\\foo^$", f"--out={tmp_path / 'huge.png'}")
    assert proc.returncode == 0, proc.stderr  # (matplotlib's TeX parser once raised on it)
    (tmp_path / "taken.png").mkdir()  # the picture cannot be written: one line, the reason, and no temporary left
    proc = script("scripts/plot_runs.py", tmp_path / "huge", f"--out={tmp_path / 'taken.png'}")
    assert proc.returncode == 2 and proc.stderr == f"error: cannot write {tmp_path / 'taken.png'}: Is a directory\n"
    proc = script("scripts/plot_runs.py", tmp_path / "huge", f"--out={tmp_path / 'huge.png' / 'x.png'}")  # under a file
    assert proc.returncode == 2 and proc.stderr == (f"error: cannot write {tmp_path / 'huge.png' / 'x.png'}: it is a "
                                                    f"file, or lies under one\n"), proc.stderr  # (was "File exists")
    assert not list(tmp_path.glob(".*.tmp"))
    monkeypatch.chdir(tmp_path / "huge")  # "." is the folder's own name (it was labelled "", so not a second time)
    proc = script("scripts/plot_runs.py", ".", tmp_path / "huge", f"--out={tmp_path / 'huge.png'}")
    assert proc.returncode == 2 and proc.stderr == "error: a folder is given twice: give each run once\n", proc.stderr


def test_plot_runs_reads_an_older_config_and_a_png_named_in_capitals(tmp_path, capsys):
    """A config.json from before tokens_per_step was written: the tokens seen come from metrics.jsonl; a world size
    that no run has is no label; --out=X.PNG is a PNG."""
    import plot_runs
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 4.0, "tokens_seen": 0}\n'
                                            '{"step": 4, "loss": 3.0, "val_loss": 3.5, "tokens_seen": 512}\n')
    (tmp_path / "config.json").write_text('{"run": {"world_size": -2}}')
    run = plot_runs.read_run(tmp_path)
    assert run["tokens_per_step"] == 128 and run["world"] is None and run["val"] == [(0, 4.0), (4, 3.5)]
    plot_runs.main([str(tmp_path), f"--out={tmp_path / 'X.PNG'}"])
    assert capsys.readouterr().out == f"1 run -> {tmp_path / 'X.PNG'}\n"
    assert_png(tmp_path / "X.PNG")


def test_plot_runs_bad_input_is_one_line(tmp_path, script):
    (tmp_path / "empty").mkdir()
    (tmp_path / "nolosses").mkdir()
    (tmp_path / "nolosses" / "metrics.jsonl").write_text("")
    (tmp_path / "odd" / "metrics.jsonl").mkdir(parents=True)  # once "does not exist"
    for run in ("a", "b"):  # two runs named "out", links to themselves: Path.resolve raised, a traceback once
        (tmp_path / run).mkdir()
        (tmp_path / run / "out").symlink_to("out")
    for args, needle in (([str(tmp_path / "empty")], "metrics.jsonl does not exist"),
                         ([str(tmp_path / "nolosses")], "holds no train or val loss"),
                         ([str(tmp_path / "nolosses"), "--labels=a,b"], "2 names for 1 folders"),
                         ([str(tmp_path / "empty")] * 2, "a folder is given twice"),
                         ([str(tmp_path / "empty"), str(tmp_path / "nolosses"), "--labels=a,a"], "repeats a name"),
                         ([str(tmp_path / "a" / "out"), str(tmp_path / "b" / "out")], "metrics.jsonl does not exist"),
                         ([str(tmp_path / "odd")], "metrics.jsonl is a folder")):
        proc = script("scripts/plot_runs.py", *args)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_synthetic_data_stays_bounded_however_many_steps_are_asked_for(monkeypatch, tmp_path):
    """--steps=10**12 once made a worker allocate 233 TiB of token ids: past 2**27 tokens the
    loader's epochs roll over instead."""
    import bench

    class Made(Exception):
        pass

    def made(cfg, world, folder, n_train):
        raise Made(n_train)
    monkeypatch.setattr(bench, "synthetic_data", made)
    tiny = ["--n_layer=1", "--n_head=1", "--n_embd=16", "--block_size=8", "--batch_size=2", "--global_batch_size=2",
            "--device=cpu", "--dtype=float32"]
    for steps, tokens in ((3, (1 + 2 * 3 + 2) * 16 + 8), (10**12, 2**27 + 8)):
        with pytest.raises(Made) as n_train:
            bench.worker(tiny, steps, 1, tmp_path / "result.json", tmp_path, None)
        assert n_train.value.args[0] == tokens


def test_a_workers_result_goes_into_a_folder_it_makes(tmp_path):
    """(bench.py --worker --result=FILE, for other launchers: a folder not made yet was a raw errno line,
    exit 2, after the whole measurement)"""
    import bench
    tiny = ["--n_layer=1", "--n_head=1", "--n_embd=16", "--block_size=8", "--batch_size=2", "--global_batch_size=2",
            "--device=cpu", "--dtype=float32"]
    bench.worker(tiny, 2, 0, tmp_path / "new" / "result.json", tmp_path, None)
    assert json.loads((tmp_path / "new" / "result.json").read_text())["config"]["n_embd"] == 16


def _bench_rank(rank, world_size, args, result):
    import bench
    bench.worker(args, 3 if rank == 0 else 6, 1, result, result.parent, None)  # (rank 1 started with --steps=6)
    return "measured"


@pytest.mark.slow
def test_bench_workers_started_with_different_settings_all_stop(tmp_path):
    """(bench.py --worker under another launcher: rank 1 with another --steps aborted rank 0 in gloo's C++,
    exit 134; with another n_embd, both measured rank 0's model)"""
    tiny = ["--n_layer=1", "--n_head=1", "--n_embd=16", "--block_size=8", "--batch_size=2", "--global_batch_size=4",
            "--device=cpu", "--dtype=float32", "--dist_timeout=60"]
    lines = ranks_say(_bench_rank, 2, tmp_path, tiny, tmp_path / "result.json")
    assert lines == ["rank 1 was started with steps=6 (rank 0: 3): give every rank the same config"] * 2, lines
    assert not (tmp_path / "result.json").exists()


def test_a_worker_that_fails_while_running_is_a_failed_run(monkeypatch, tmp_path):
    """The checks passed in the parent, then a torchrun failed: exit 1 (a run failed), not 2 (bad input)."""
    import subprocess

    import bench
    from errors import RunError
    commands = []

    class Failed:  # a torchrun that ended with status 1
        def wait(self):
            return 1
    monkeypatch.setattr(bench.subprocess, "Popen", lambda cmd, env: commands.append(cmd) or Failed())
    monkeypatch.setattr(sys, "argv", ["bench.py", "--debug"])
    with pytest.raises(RunError, match="the ddp run on 1 process failed \\(exit 1\\)"):
        bench.measure(["ddp"], [1], ["--device=cpu"], 1, 0, tmp_path, False)
    assert commands[0][-1] == "--debug"  # the workers show their tracebacks too
    assert commands[0][-5:-2] == ["--strategy=ddp", "--fsdp_reshard=True", "--fsdp_shard_size=0"]  # (FSDP's: fsdp's)


def test_a_report_that_cannot_be_written_keeps_the_last_and_the_figures_are_printed(monkeypatch, tmp_path, capsys):
    """A full disk left an empty bench.json in place of the last report, and said only "[Errno 28] ...", exit 2;
    later, when it filled at bench.png, the new bench.json and bench.md beside the last run's bench.png."""
    import errno

    import bench
    from errors import RunError
    from harness import raising
    raw = dict(device="cpu", data="synthetic", vocab_size=50257, n_params=10, dtype="float32", compile=False,
               memory_kind="peak RSS", config=dict(global_batch_size=8, batch_size=4, block_size=16), step_times=[1.0],
               step_times_nosync=None, accumulation_steps=1, tokens_per_step=128, peak_memory=[1], state_bytes={},
               mfu=None)
    rows = [bench.summarise("ddp", 1, raw)]
    bench.add_scaling(rows)
    last = {name: f"the last report's {name}" for name in ("bench.json", "bench.md", "bench.png")}
    for name, text in last.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(bench, "plot", raising(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(RunError, match=rf"could not write {tmp_path} \(No space left on device\): "
                                       r"free disk space or give another --report \(the table above holds its"):
        bench.write_report(rows, tmp_path, 1, 0, [])
    files = lambda: {p.name: p.read_text() if p.is_file() else "a folder" for p in tmp_path.iterdir()}  # noqa: E731
    assert files() == last  # (no temporaries either)
    monkeypatch.undo()  # a folder where the last file goes: its rename failed after the others were replaced
    (tmp_path / "bench.png").unlink()
    (tmp_path / "bench.png").mkdir()
    with pytest.raises(RunError, match=rf"could not write {tmp_path / 'bench.png'} \(Is a directory\): give another"):
        bench.write_report(rows, tmp_path, 1, 0, [])  # (named, and not "free disk space")
    assert files() == {**last, "bench.png": "a folder"}
    # a report of ddp and fsdp runs records the settings given (the ddp run's leave out FSDP's: fsdp_reshard=True)
    fsdp = bench.summarise("fsdp", 2, {**raw, "config": {**raw["config"], "fsdp_reshard": False}})
    monkeypatch.setattr(bench, "plot", lambda rows, f, info: f.write(b"png"))
    (tmp_path / "both").mkdir()
    bench.add_scaling(rows := [rows[0], {**rows[0], "strategy": "fsdp", "measured_as": "ddp"}, fsdp])
    bench.write_report(rows, tmp_path / "both", 1, 0, [])
    assert json.loads((tmp_path / "both" / "bench.json").read_text())["config"]["fsdp_reshard"] is False
    assert "| ddp | 1 | 8 (1) | 128 |" in capsys.readouterr().out


@pytest.mark.slow  # processes of its own
def test_a_signal_to_a_tool_goes_on_to_the_torchrun_it_waits_for_which_ends_in_one_line(tmp_path, capsys):
    """kill -INT or SIGTERM to bench.py ended it alone: torchrun and its workers ran on. Passed on, it
    printed torchrun's SignalException traceback (30-80 lines)."""
    import os
    import signal

    from errors import TORCHRUN, wait_passing_signals
    worker = (f"import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: open({str(tmp_path / 'got')!r}, "
              f"'w') and sys.exit(7))\nprint('ready', flush=True)\ntime.sleep(300)")
    child = subprocess.Popen([*TORCHRUN, "--standalone", "--nproc_per_node=1", "--no-python", sys.executable, "-c",
                              worker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert child.stdout.readline() == "ready\n"  # the worker's handler is set (and torchrun's)
    waiting = child.wait  # the SIGTERM comes once this process waits, its handler set
    child.wait = lambda: os.kill(os.getpid(), signal.SIGTERM) or waiting()
    with pytest.raises(SystemExit) as ended:
        wait_passing_signals(child)
    assert (ended.value.code, child.returncode) == (128 + signal.SIGTERM, 128 + signal.SIGTERM)  # passed on, ended here
    assert (tmp_path / "got").exists()  # ... and on to the worker
    assert "Traceback" not in child.stderr.read()
    assert capsys.readouterr().err == "error: interrupted (SIGTERM)\n"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # as it was
    # a worker that fails, after its own line (a nearly full TMPDIR): torchrun's ChildFailedError traceback once
    failed = subprocess.run([*TORCHRUN, "--standalone", "--nproc_per_node=1", "--no-python", sys.executable, "-c",
                             "import sys; sys.exit('error: the worker says why')"], capture_output=True, text=True)
    assert failed.returncode == 1 and "error: the worker says why\n" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr


def test_bench_measures_the_configs_strategy_unless_told_otherwise(monkeypatch, tmp_path):
    import bench
    measured = []  # (--strategy=fsdp was measured as ddp: --strategies' default overrode it)
    monkeypatch.setattr(bench, "measure", lambda strategies, *args: measured.append(strategies))
    monkeypatch.setattr(bench, "write_report", lambda *args: None)
    for extra in ([], ["--strategies=ddp,fsdp"]):
        bench.main(["--device=cpu", "--strategy=fsdp", "--nproc=2", f"--report={tmp_path}", *extra])
    # FSDP's own settings: "fsdp_shard_size=1 shards the model: it needs --strategy=fsdp", the bare config's (and the
    # ddp run's, which leaves them to the fsdp runs); a report folder under ~ (it made one named ~ here)
    monkeypatch.setenv("HOME", str(tmp_path))
    for strategies in ("fsdp", "ddp,fsdp"):
        bench.main(["--device=cpu", f"--strategies={strategies}", "--fsdp_shard_size=1", "--fsdp_reshard=False",
                    "--nproc=2", "--report=~/home_report"])
    assert measured == [["fsdp"], ["ddp", "fsdp"], ["fsdp"], ["ddp", "fsdp"]] and (tmp_path / "home_report").is_dir()


def test_gpu_summary_tabulates_nanogpt_llmc_and_our_runs(tmp_path, capsys):
    # bench/gpu.sh's summary: tokens/s from nanoGPT's "time per iteration" line (batch x 1024 /
    # time), llm.c's run.sh JSON line, and our bench.json; a run that failed is only in the logs
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "bench" / "gpu_summary.py")
    gpu_summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_summary)
    (tmp_path / "env.txt").write_text("NVIDIA H100 80GB HBM3\n")
    (tmp_path / "times.txt").write_text("nanogpt_b12 exit 0 after 33 s\nours exit 1 after 9 s\n")
    (tmp_path / "nanogpt_b12.log").write_text("19/20 loss: 6.1937\ntime per iteration: 28.1905ms, MFU: 119.42%\n")
    (tmp_path / "llmc_b32.log").write_text('LLMC JSON {"tokens_per_s": 459102.0, "mean_step_ms": 1141.986, '
                                           '"mean_mfu_pct": 37.33}\n')
    (tmp_path / "gpt_small_b32").mkdir()
    (tmp_path / "gpt_small_b32" / "bench.json").write_text(json.dumps({"runs": [dict(
        tokens_per_sec=460562.4, step_time_s=1.1384, mfu=0.398, peak_memory_bytes=24.75 * 2**30)]}))
    (tmp_path / "ours.log").write_text("error: the ddp run on 1 process failed (exit 1)\n")
    gpu_summary.main(tmp_path)
    out = capsys.readouterr().out
    assert "| nanogpt_b12 | 435,892 | 28.2 ms | - | - |" in out
    assert "| gpt_small_b32 | 460,562 | 1138.4 ms | 39.8% | 24.8 GiB |" in out
    assert "| llmc_b32 | 459,102 | 1142.0 ms | 37.3% (llm.c's) | - |" in out
    assert out.count("| ours") == 0 and "ours exit 1 after 9 s" in out and "### ours\n```\nerror: the ddp" in out


def test_memory_guide_columns_come_in_order_each_once(script):
    out = script("scripts/memory_guide.py", "--world=8,2,2").stdout  # (were 8, 2, 2: unsorted, and W=2 twice)
    assert "| DDP (any W) | FSDP W=2 | FSDP W=8 | activations" in out.splitlines()[0]


def test_a_step_takes_its_slowest_rank_and_the_report_derives_from_the_steps(monkeypatch):
    import bench
    monkeypatch.setattr(bench, "by_rank", lambda times, world: [[1.0, 5.0], [3.0, 2.0]])  # 2 ranks x 2 steps
    assert bench.slowest_rank(None, None) == [3.0, 5.0]  # a step is done when every rank is

    def figures(steps, nosync):
        return dict(step_times=steps, step_times_nosync=nosync, config=dict(global_batch_size=8, batch_size=4),
                    accumulation_steps=1, tokens_per_step=100, peak_memory=[1, 2], memory_kind="peak RSS",
                    state_bytes={}, mfu=None)
    one, two = bench.summarise("ddp", 1, figures([1.0, 1.0], [])), bench.summarise("ddp", 2, figures([2.0, 2.0],
                                                                                                   [1.5, 1.5]))
    assert (one["tokens_per_sec"], two["comm_share"], two["peak_memory_bytes"]) == (100, 0.25, 2)  # the sync's share
    bench.add_scaling([one, two])
    assert (one["scaling_efficiency"], two["scaling_efficiency"]) == (1.0, 0.25)  # 50 tokens/s of 2 x 100


def test_the_memory_tables_in_the_docs_are_what_memory_guide_prints(script):
    out = script("scripts/memory_guide.py").stdout.splitlines()
    rows = [line for line in out if line.startswith("| gpt2")]
    assert len(rows) == 4 and all(row in (REPO / "docs" / "fsdp.md").read_text() for row in rows), rows
    for line in (line for line in out if line.startswith("- gpt2")):  # W=8: file | sharded | sharded + async
        file, sharded, staged = (float(cell.split()[0]) for cell in line.split(": ")[1].split(" | "))
        assert sharded == 0 and staged == pytest.approx(file / 8, abs=0.006), line  # (12 bytes/parameter, or 12/W)


def test_bench_loader_makes_shards_their_headers_describe(tmp_path):
    from data.dataset import read_shard_header
    from bench_loader import make
    files = make(tmp_path, 2 * 20 * 64, 2)
    assert [read_shard_header(path) for path, _, _ in files] == [("uint16", 1280)] * 2
    assert [(offset, count) for _, offset, count in files] == [(1024, 1280)] * 2


def test_bench_loader_names_the_signal_that_killed_a_measurement(monkeypatch):
    """A measuring process killed (SIGKILL: out of memory; SIGBUS: a full TMPDIR) said "failed: no message"."""
    import bench_loader
    from errors import RunError
    monkeypatch.setattr(bench_loader.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, -7, "", ""))
    monkeypatch.setattr(sys, "argv", ["bench_loader.py", "--sizes=2e5", "--block_size=64"])
    with pytest.raises(RunError, match=r"shard\(s\) failed: killed by SIGBUS \(out of memory\? a full TMPDIR\?\)$"):
        bench_loader.main()


@pytest.mark.slow  # a bash process
@pytest.mark.parametrize("args, message", [
    ([], "usage: bash bench/nanogpt_cpu.sh NANOGPT_DIR RUN_DIR nanogpt|ours [ITERS] (which runs first)"),
    (["nano", "runs", "both"], "usage: bash bench/nanogpt_cpu.sh NANOGPT_DIR RUN_DIR nanogpt|ours [ITERS] (which runs "
                               "first)"),
    (["nano", "runs", "ours"], "the two data/shakespeare_char/val.bin differ (or one is missing): prepare both from "
                               "one input.txt"),
])
def test_the_nanogpt_side_by_side_refuses_what_it_cannot_compare(tmp_path, args, message):
    """Before it runs or creates anything (docs/performance.md; nanoGPT itself cannot be had here)."""
    ran = subprocess.run(["bash", str(REPO / "bench/nanogpt_cpu.sh"), *args], cwd=tmp_path, capture_output=True,
                         text=True)
    assert (ran.returncode, ran.stderr, list(tmp_path.iterdir())) == (2, f"error: {message}\n", [])


@pytest.mark.parametrize("tool, args, message", [
    ("bench_loader", ["--sizes=lots"], "--sizes=lots: give sizes in bytes, e.g. --sizes=4e6,4e8"),
    ("bench_loader", ["--sizes=4e6,inf"], "--sizes=4e6,inf: give sizes in bytes, e.g. --sizes=4e6,4e8"),
    ("bench_loader", ["--sizes=1e13"], "--sizes: 10,000,000,000,000 bytes is more than this benchmark makes (at most "
                                       "1e12)"),
    ("bench_loader", ["--sizes=1279,4e6", "--block_size=16"], "--sizes: 1,279 bytes is too small for block_size=16 "
                                                              "(20 shards of a window each): give at least 1,280"),
    ("bench_loader", ["--block_size=0"], "--block_size and --batch_size must be positive"),
    ("bench_loader", ["--batch_size=1000000000", "--block_size=999"], "--batch_size=1,000,000,000 x --block_size=999 "
                                                                      "on --sizes up to 4,000,000,000 bytes needs "
                                                                      "24,016.0 GB, more than this host has available"),
    # the epoch's window order too: 1e12 bytes of block 8 made its files, then failed in numpy (exit 1)
    ("bench_loader", ["--sizes=1e12", "--block_size=8"], "--batch_size=12 x --block_size=8 on --sizes up to "
                                                         "1,000,000,000,000 bytes needs 1,000.0 GB, more than this "
                                                         "host has available"),
    ("memory_guide", ["--world=1,two"], "--world=1,two: give process counts, e.g. --world=1,2,4,8"),
    ("memory_guide", ["--world=0,1"], "--world counts and --batch_size must be positive"),
    ("plot_runs", ["missing", "--out=runs.jpg"], "--out=runs.jpg: give a .png file name"),
    ("plot_runs", ["a", "b", "--labels=x"], "--labels has 1 name for 2 folders"),
    ("plot_runs", ["a", "b", "--labels=x,x"], "--labels=x,x repeats a name: give each run its own"),
    ("plot_runs", ["a", "a/"], "a folder is given twice: give each run once"),
])
def test_a_tools_argument_that_cannot_be_is_one_line(script, tool, args, message):
    """Before any work (test_reliability: each tool's bad input from a process, for its form alone)."""
    ran = script(f"scripts/{tool}.py", *args)
    assert (ran.returncode, ran.stderr) == (2, f"error: {message}\n")
