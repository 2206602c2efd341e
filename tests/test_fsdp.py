"""strategy = "fsdp": the guarantees DDP gives, under FSDP2 (fully_shard) on CPU with gloo.

Weights equal DDP's on the same global batch (the README's 1e-5), checkpoints are the one
single-file format (so either strategy resumes the other's, on another world size), the
gradients are reduce-scattered once per optimizer step whatever the accumulation. (A SIGTERM
stops and resumes as under DDP: tests/test_recovery.py.)"""

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import train
from config import resolve
from collectives import lost_peer
from harness import (assert_close_runs, ckpt, max_diff, metrics, no_temporaries, ranks_say, run_ranks, run_world,
                     small_disk, tiny_args, train_here)

TOL = 1e-5  # the README's tolerance between launches
STEPS = 6


def args_for(data, out, **kw):
    # global batch 16: accumulation 2 at W=2 (batch 4) and W=4 (batch 2); 65 vocabulary rows padded
    # to 66, so the tied, padded embedding is sharded, saved and resharded too
    base = dict(batch_size=4, global_batch_size=16, max_iters=STEPS, eval_interval=3, lr_decay_iters=STEPS,
                resume="never", pad_vocab_to=2)
    return tiny_args(data, out, **{**base, **kw})


@pytest.fixture(scope="module")
def ddp_reference(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    run_world(2, args_for(char_data, out, strategy="ddp"), out / "results")
    return {**ckpt(out), "out_dir": out}


def record_where_the_model_is_built(rank):
    """A run_world patch: each rank writes the device its GPT's parameters were created on."""
    import model
    original = model.GPT.__init__

    def init(self, config):
        original(self, config)
        Path(f"{os.environ['BUILT_LOG']}.{rank}").write_text(str(next(self.parameters()).device))
    model.GPT.__init__ = init


def record_group_timeouts(rank):
    """A run_world patch: each process group made prints the timeout it was given (torch's default
    for the groups made after the first is 30 minutes, not dist_timeout)."""
    import inspect

    import torch.distributed.distributed_c10d as c10d
    original = c10d._new_process_group_helper

    def helper(*args, **kwargs):
        given = inspect.signature(original).bind(*args, **kwargs).arguments
        print(f"group {given['group_desc']} timeout {given['timeout']}", flush=True)
        return original(*args, **kwargs)
    c10d._new_process_group_helper = helper


@pytest.fixture(scope="module")
def fsdp_whole(char_data, tmp_path_factory):
    """An uninterrupted fsdp run on 2 processes: its out_dir (and built.RANK: where each rank's
    model was first built)."""
    out = tmp_path_factory.mktemp("fsdp")
    os.environ["BUILT_LOG"] = str(out / "built")
    try:
        run_world(2, args_for(char_data, out, strategy="fsdp"), out / "results", patch=record_where_the_model_is_built)
    finally:
        del os.environ["BUILT_LOG"]
    return out


def assert_like_ddp(checkpoint, ddp_reference, nproc):
    assert checkpoint["step"] == STEPS and checkpoint["world_size"] == nproc
    assert max_diff(checkpoint, ddp_reference) < TOL
    # the optimizer state is the full one, in torch.optim's own layout, as DDP writes it
    ref = ddp_reference["optimizer"]
    assert [g["params"] for g in checkpoint["optimizer"]["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    for i, state in ref["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert checkpoint["optimizer"]["state"][i][key].shape == state[key].shape
            assert (checkpoint["optimizer"]["state"][i][key] - state[key]).abs().max() < TOL


@pytest.mark.slow
def test_fsdp_on_2_processes_ends_with_ddps_weights_and_moments(fsdp_whole, ddp_reference):
    assert_like_ddp(ckpt(fsdp_whole), ddp_reference, 2)
    assert_close_runs(fsdp_whole, ddp_reference["out_dir"])  # and logs DDP's losses and gradient norms
    # only rank 0 ever held the whole model: rank 1 built it on the meta device, then its shard
    assert [(fsdp_whole / f"built.{r}").read_text() for r in (0, 1)] == ["cpu", "meta"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc, extra", [(4, {"batch_size": 2}),
                                          (4, {"batch_size": 2, "fsdp_shard_size": 2, "checkpoint_format": "sharded"}),
                                          (2, {"fsdp_reshard": False, "activation_checkpointing": True, "compile": True})])
def test_fsdp_weights_equal_ddp_on_the_same_global_batch(char_data, tmp_path, ddp_reference, nproc, extra):
    run_world(nproc, args_for(char_data, tmp_path, strategy="fsdp", **extra), tmp_path / "results")
    name = "last.dcp" if extra.get("checkpoint_format") == "sharded" else "last.pt"  # HSDP's shards and replicas
    assert_like_ddp(ckpt(tmp_path, name), ddp_reference, nproc)


@pytest.mark.slow
def test_fsdp_resume_is_exact_and_crosses_strategies_world_sizes_and_formats(char_data, tmp_path, ddp_reference,
                                                                             fsdp_whole, capsys):
    sharded, logs = dict(strategy="fsdp", checkpoint_format="sharded", resume="auto"), tmp_path / "results"
    # sharded fsdp -> fsdp, same world: bit for bit against an uninterrupted (file-format) fsdp run
    run_world(2, args_for(char_data, tmp_path / "ff", **sharded, max_iters=STEPS // 2), logs)
    assert no_temporaries(tmp_path / "ff")  # (nor the probe that found out_dir shared)
    for r in (0, 1):  # FSDP's warning for the padded logits' slice
        assert "returned a view tensor" not in (logs / f"rank{r}.log").read_text()
    run_world(2, args_for(char_data, tmp_path / "ff", **sharded), logs)
    assert max_diff(ckpt(tmp_path / "ff", "last.dcp"), ckpt(fsdp_whole)) == 0
    # resharded on every load, the next global batch each time: ddp on one process (file) ->
    # fsdp W=4 (sharded, async) -> fsdp W=2 (sharded) -> ddp on one process (file)
    chain = tmp_path / "chain"
    train.main(resolve(args_for(char_data, chain, max_iters=2)))
    run_world(4, args_for(char_data, chain, **sharded, async_checkpoint=True, batch_size=2, max_iters=3,
                          dist_timeout=77, fsdp_shard_size=2), logs, patch=record_group_timeouts)
    assert f"resuming from {chain / 'last.pt'} at step 2" in (logs / "rank0.log").read_text()
    # the default group, HSDP's mesh (2 x 2: each rank's shard and replicate groups) and the background
    # save's group all time out after dist_timeout
    made = [line for line in (logs / "rank0.log").read_text().splitlines() if line.startswith("group ")]
    assert {"default_pg", "mesh_replicate", "mesh_shard", "None"} == {line.split()[1] for line in made}, made
    assert all(line.endswith(" timeout 0:01:17") for line in made), made
    run_world(2, args_for(char_data, chain, **sharded, max_iters=4), logs)
    capsys.readouterr()
    train.main(resolve(args_for(char_data, chain, resume="auto")))
    assert f"resuming from {chain / 'last.dcp'} at step 4" in capsys.readouterr().out
    result = ckpt(chain)
    assert result["step"] == STEPS and max_diff(result, ddp_reference) < TOL


@pytest.mark.slow
def test_a_float16_fsdp_checkpoint_resumes_under_ddp(char_data, tmp_path):
    # FSDP's float16 AdamW is unfused (see build_run), and its saved param_groups say so: the
    # fused DDP run that resumes it must keep its kernel, or its scaler's step hits the unfused one
    run_world(2, args_for(char_data, tmp_path, strategy="fsdp", dtype="float16", max_iters=2), tmp_path / "results")
    for r in (0, 1):  # (torch's warning for its sharded scaler's found_inf, on every rank)
        assert "Warning" not in (tmp_path / "results" / f"rank{r}.log").read_text()
    assert train.main(resolve(args_for(char_data, tmp_path, dtype="float16", resume="auto")))["step"] == STEPS
    assert all(g["fused"] for g in ckpt(tmp_path)["optimizer"]["param_groups"])


@pytest.mark.slow
def test_sample_reads_an_fsdp_checkpoint(fsdp_whole, script):
    proc = script("sample.py", f"--out_dir={fsdp_whole}", "--num_samples=1", "--max_new_tokens=20", "--device=cpu")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert len(out.strip()) > 20


def _count_reduce_scatters(rank):
    """Count FSDP2's gradient reduce-scatters into $COUNT_FILE.rank (it calls them through
    torch.distributed's module attributes)."""
    import torch.distributed as dist
    path = Path(os.environ["COUNT_FILE"] + f".{rank}")
    path.write_text("0")
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, **kwargs):
            path.write_text(str(int(path.read_text()) + 1))
            return _original(*args, **kwargs)
        setattr(dist, name, counted)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [8, 2])  # W=2, global 16: accumulation 1 or 4
def test_one_reduce_scatter_per_shard_group_per_optimizer_step(char_data, tmp_path, monkeypatch, batch_size):
    monkeypatch.setenv("COUNT_FILE", str(tmp_path / "rs"))
    args = args_for(char_data, tmp_path / "out", strategy="fsdp", batch_size=batch_size, max_iters=3,
                    eval_interval=100)
    run_world(2, args, tmp_path / "results", patch=_count_reduce_scatters)
    groups = 2 + 1  # n_layer blocks and the root
    assert [int((tmp_path / f"rs.{r}").read_text()) for r in range(2)] == [3 * groups] * 2


def test_activation_checkpointing_changes_no_number(char_data, tmp_path):
    """Recomputation replays dropout with the same random numbers: the same weights."""
    for name, flag in (("plain", False), ("ckpt", True)):
        train.main(resolve(args_for(char_data, tmp_path / name, dropout=0.1, max_iters=3,
                                    activation_checkpointing=flag)))
    assert max_diff(ckpt(tmp_path / "plain"), ckpt(tmp_path / "ckpt")) == 0


def test_activation_checkpointing_recomputes_each_block(monkeypatch):
    import model as model_module
    import parallel
    model = model_module.GPT(model_module.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50))
    calls = []
    block_forward = model_module.Block._forward
    monkeypatch.setattr(model_module.Block, "_forward", lambda self, *a, **k: (calls.append(1),
                                                                                block_forward(self, *a, **k))[1])
    x = torch.randint(0, 50, (2, 16))
    for enabled, forwards in ((False, 2), (True, 4)):  # once per block, twice with recompute
        calls.clear()
        parallel.set_activation_checkpointing(model, enabled)
        model(x, x)[1].backward()
        assert len(calls) == forwards


def _rank_1_on_a_host_without_the_shared_disk(rank, world_size, args, out_dir):
    """run_ranks: rank 1 gets a mount namespace of its own with an empty tmpfs where rank 0's
    out_dir lives (another host with a local disk at the same path); each rank's error goes to
    out_dir/../error.RANK."""
    import ctypes
    import subprocess
    from config import resolve
    from errors import ConfigError
    out_dir = Path(out_dir)
    if rank == 1:
        assert ctypes.CDLL(None, use_errno=True).unshare(0x00020000) == 0  # CLONE_NEWNS
        subprocess.run(["mount", "--make-rprivate", "/"], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(out_dir.parent)], check=True)
    try:
        train.main(resolve(args))
    except ConfigError as e:
        (out_dir.parent.parent / f"error.{rank}").write_text(str(e))


@pytest.mark.slow
def test_sharded_checkpoints_need_storage_every_rank_sees(char_data, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a mount namespace needs root")
    out = tmp_path / "disk" / "out"
    out.parent.mkdir()
    run_ranks(_rank_1_on_a_host_without_the_shared_disk, 2,
              args_for(char_data, out, strategy="fsdp", checkpoint_format="sharded"), str(out))
    errors = [(tmp_path / f"error.{r}").read_text() for r in (0, 1)]
    assert errors[0] == errors[1] and errors[0].startswith("rank 1 on ") and "does not see rank 0's" in errors[0]
    assert "needs storage every rank sees" in errors[0] and "--checkpoint_format=file" in errors[0]
    assert not (out / "last.dcp").exists()


def _rank_1_with_the_shared_disk_elsewhere(rank, world_size, args, disk, elsewhere):
    """run_ranks: rank 1 sees rank 0's disk at another path (a mount namespace of its own: the disk bound at
    `elsewhere`, an empty tmpfs where rank 0 has it), its out_dir there, as PER_HOST allows; errors to error.RANK."""
    import ctypes
    import subprocess
    from config import resolve
    from errors import ConfigError
    if rank == 1:
        assert ctypes.CDLL(None, use_errno=True).unshare(0x00020000) == 0  # CLONE_NEWNS
        subprocess.run(["mount", "--make-rprivate", "/"], check=True)
        subprocess.run(["mount", "--bind", disk, elsewhere], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", disk], check=True)
    try:
        train.main(resolve([*args, f"--out_dir={Path(elsewhere if rank else disk) / 'out'}"]))
    except ConfigError as e:
        (Path(disk).parent / f"error.{rank}").write_text(str(e))


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_where_each_host_mounts_the_storage(char_data, tmp_path):
    """(rank 0's path was every rank's: "rank 1 ... does not see rank 0's .../last.dcp", though it wrote it)"""
    if os.geteuid() != 0:
        pytest.skip("a mount namespace needs root")
    disk, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    elsewhere.mkdir()
    train_here(char_data, disk / "out", checkpoint_format="sharded", max_iters=4, eval_interval=4)
    args = tiny_args(char_data, disk / "out", checkpoint_format="sharded", max_iters=8, eval_interval=4, resume="auto")
    run_ranks(_rank_1_with_the_shared_disk_elsewhere, 2, args, str(disk), str(elsewhere))
    assert not list(tmp_path.glob("error.*")), [p.read_text() for p in tmp_path.glob("error.*")]
    assert ckpt(disk / "out", "last.dcp")["step"] == 8 and ckpt(disk / "out", "previous.dcp")["step"] == 4
    assert [r["step"] for r in metrics(disk / "out") if "val_loss" in r] == [0, 4, 8]  # resumed at 4


def _check_own_folder(rank, world, folders):
    """ranks_say: sharded.check_shared on this rank's own folder, folders[rank] (another host's disk
    at the same path)."""
    import sharded
    sharded.check_shared(Path(folders[rank]), world, "to resume from it")
    return "seen"


@pytest.mark.slow
def test_a_checkpoint_folder_of_the_same_name_but_other_content_is_not_rank_0s(tmp_path):
    """Each host an old copy of last.dcp at the path (run.json there on both, other bytes): checked by
    content, not by name, every rank stops; finding a run.json there is not seeing rank 0's."""
    folders = [tmp_path / f"host{r}" / "last.dcp" for r in (0, 1)]
    for r, folder in enumerate(folders):
        folder.mkdir(parents=True)
        (folder / "run.json").write_text(json.dumps({"step": 4 * (r + 1), "param_groups": []}))
    errors = ranks_say(_check_own_folder, 2, tmp_path, [str(f) for f in folders], in_group=True)
    assert errors[0] == errors[1] and errors[0].startswith("rank 1 on "), errors
    assert f"does not see rank 0's {folders[0]} (to resume from it; it looked at {folders[1]})" in errors[0]
    # (it said to use --checkpoint_format=file, which cannot read a .dcp either)
    assert errors[0].endswith(f"python scripts/convert_checkpoint.py {folders[0]} {folders[0].parent}/converted.pt, "
                              f"then pass --resume= that file"), errors[0]
    # a copy of rank 0's (run.json the same) that lacks a part, or holds one cut short: rank 1 failed to read it,
    shutil.copy(folders[0] / "run.json", folders[1] / "run.json")  # and the resume fell back to previous.dcp (rank
    for folder in folders:  # 0's good last.dcp called unreadable)
        (folder / "__0_0.distcp").write_bytes(b"part")
    (folders[0] / "__1_0.distcp").write_bytes(b"part")
    for damage in (lambda: None, lambda: (folders[1] / "__1_0.distcp").write_bytes(b"pa")):
        damage()
        said = ranks_say(_check_own_folder, 2, tmp_path, [str(f) for f in folders], in_group=True)
        assert said[0] == said[1] and f"does not see rank 0's {folders[0]} (to resume from it" in said[0], said


def _load_as_rank_1_leaves(rank, world, path, out):
    """ranks_say: rank 1 leaves the group at once (as kill -9 would); rank 0 loads a sharded checkpoint."""
    import sharded
    if rank == 1:
        (Path(out) / "rank1.txt").write_text("gone")
        os._exit(0)
    metadata = sharded.parts(Path(path))[1]
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
    try:
        sharded.load(Path(path), state, world)
    except RuntimeError as e:  # (an UnreadableCheckpoint is a ConfigError: ranks_say records it)
        return f"lost: {e}"
    return "loaded"


@pytest.mark.slow
def test_a_peer_lost_while_loading_a_sharded_checkpoint_is_no_unreadable_checkpoint(char_data, tmp_path):
    """(It was "cannot read checkpoint ...: Connection reset by peer", exit 2, and resume=auto moved on to
    previous.dcp: a good checkpoint blamed, the advice to give it up.) Now a lost peer: CollectiveFailed, exit 1."""
    train_here(char_data, tmp_path / "run", checkpoint_format="sharded", max_iters=2, eval_interval=2)
    said = ranks_say(_load_as_rank_1_leaves, 2, tmp_path, str(tmp_path / "run" / "last.dcp"), str(tmp_path),
                     in_group=True)
    assert said[0].startswith("lost: ") and lost_peer(RuntimeError(said[0])), said


@pytest.mark.slow
def test_a_probe_file_rank_0_cannot_write_stops_every_rank_with_its_reason(tmp_path):
    """A full disk (a real one): rank 0 alone raised, "the output could not be written ... where stdout goes",
    while rank 1 waited for it; the probe stayed behind, empty."""
    with small_disk(tmp_path / "disk", "64k") as disk:
        with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
            f.write(bytes(1 << 20))
        errors = ranks_say(_check_own_folder, 2, tmp_path, [str(disk)] * 2, in_group=True)
        assert errors[0] == errors[1], errors
        assert re.fullmatch(rf"rank 0 could not write {disk}/\.shared\.\d+\.tmp \(No space left on device\): "
                            rf"free disk space", errors[0]), errors[0]
        assert [p.name for p in disk.iterdir()] == ["filler"]


@pytest.mark.slow
def test_a_sharded_save_of_two_ranks_onto_a_disk_too_small_says_so(char_data, tmp_path):
    """A disk too small for the checkpoint, not for a rank's shard: it said "make out_dir writable" (the
    space the save needed was taken to be one rank's shard, and more than that was free)."""
    import subprocess
    from harness import REPO, args_for, child_env, run, torchrun
    args = dict(strategy="fsdp", checkpoint_format="sharded", max_iters=2, eval_interval=2)
    run(torchrun(args_for(char_data, tmp_path / "whole", **args)))
    size = sum(f.stat().st_size for f in (tmp_path / "whole" / "last.dcp").iterdir())
    with small_disk(tmp_path / "disk", f"{size // 2 // 1024}k") as disk:  # (each rank writes about half)
        proc = subprocess.run(torchrun(args_for(char_data, disk / "out", **args)), cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "No space left on device" in proc.stderr, proc.stderr
        assert "free disk space or choose another out_dir, then relaunch" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_split_the_ranks_cannot_share_evenly_has_the_single_process_loss(tmp_path):
    """169 train windows on 2 ranks: rank 1 runs a spare forward (FSDP gathers weights in each), counted nowhere."""
    from harness import make_char_dataset, metrics
    data = make_char_dataset(tmp_path, n_chars=3000)  # 2,705 train tokens: 169 windows of 16
    kw = dict(max_iters=0, eval_iters=11)  # 176 windows asked for, 169 there
    run_world(2, args_for(data, tmp_path / "fsdp", strategy="fsdp", **kw), tmp_path / "results")
    train.main(resolve(args_for(data, tmp_path / "one", **kw)))
    (fsdp,), (one,) = metrics(tmp_path / "fsdp"), metrics(tmp_path / "one")
    assert fsdp["train_eval_loss"] == pytest.approx(one["train_eval_loss"], rel=1e-6)
    assert fsdp["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)
