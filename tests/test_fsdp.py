"""strategy = "fsdp": the guarantees DDP gives, under FSDP2 (fully_shard) on CPU with gloo.

Weights equal DDP's on the same global batch (the README's 1e-5), checkpoints are the one
single-file format (so either strategy resumes the other's, on another world size), the
gradients are reduce-scattered once per optimizer step whatever the accumulation, and a
SIGTERM stops and resumes as under DDP."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
from harness import REPO, child_env, run, run_world, tiny_args

pytestmark = pytest.mark.slow
TOL = 1e-5  # the README's tolerance between launches
STEPS = 6


def args_for(data, out, **kw):
    # global batch 16: accumulation 2 at W=2 (batch 4) and W=4 (batch 2)
    base = dict(batch_size=4, global_batch_size=16, max_iters=STEPS, eval_interval=3, lr_decay_iters=STEPS,
                resume="never")
    return tiny_args(data, out, **{**base, **kw})


def torchrun(nproc, args):
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "train.py", *args], child_env())


def weights(out_dir, name="last.pt"):
    return checkpoint.read(Path(out_dir) / name)


def max_diff(a, b) -> float:
    assert a["model"].keys() == b["model"].keys()
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


@pytest.fixture(scope="module")
def ddp_reference(char_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    torchrun(2, args_for(char_data, out, strategy="ddp"))
    return weights(out)


@pytest.fixture(scope="module")
def fsdp_whole(char_data, tmp_path_factory):
    """An uninterrupted fsdp run on 2 processes: its out_dir."""
    out = tmp_path_factory.mktemp("fsdp")
    torchrun(2, args_for(char_data, out, strategy="fsdp"))
    return out


def assert_like_ddp(ckpt, ddp_reference, nproc):
    assert ckpt["step"] == STEPS and ckpt["world_size"] == nproc
    assert max_diff(ckpt, ddp_reference) < TOL
    # the optimizer state is the full one, in torch.optim's own layout, as DDP writes it
    ref = ddp_reference["optimizer"]
    assert [g["params"] for g in ckpt["optimizer"]["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    for i, state in ref["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert ckpt["optimizer"]["state"][i][key].shape == state[key].shape
            assert (ckpt["optimizer"]["state"][i][key] - state[key]).abs().max() < TOL


def test_fsdp_on_2_processes_ends_with_ddps_weights_and_moments(fsdp_whole, ddp_reference):
    assert_like_ddp(weights(fsdp_whole), ddp_reference, 2)


@pytest.mark.parametrize("nproc, extra", [(4, {"batch_size": 2}),
                                          (2, {"fsdp_reshard": False, "activation_checkpointing": True, "compile": True})])
def test_fsdp_weights_equal_ddp_on_the_same_global_batch(char_data, tmp_path, ddp_reference, nproc, extra):
    torchrun(nproc, args_for(char_data, tmp_path, strategy="fsdp", **extra))
    assert_like_ddp(weights(tmp_path), ddp_reference, nproc)


def test_fsdp_resume_is_exact_and_crosses_strategies_and_world_sizes(char_data, tmp_path, ddp_reference,
                                                                     fsdp_whole):
    half = dict(max_iters=STEPS // 2)
    # fsdp -> fsdp, same world: bit for bit against an uninterrupted fsdp run
    torchrun(2, args_for(char_data, tmp_path / "ff", strategy="fsdp", **half))
    torchrun(2, args_for(char_data, tmp_path / "ff", strategy="fsdp", resume="auto"))
    assert max_diff(weights(tmp_path / "ff"), weights(fsdp_whole)) == 0
    # fsdp (W=2) -> ddp (one process), and ddp (one process) -> fsdp (W=2): the next global batch
    torchrun(2, args_for(char_data, tmp_path / "fd", strategy="fsdp", **half))
    run([sys.executable, "train.py", *args_for(char_data, tmp_path / "fd", resume="auto")], child_env())
    run([sys.executable, "train.py", *args_for(char_data, tmp_path / "df", **half)], child_env())
    out = torchrun(2, args_for(char_data, tmp_path / "df", strategy="fsdp", resume="auto")).stdout
    assert f"resuming from {tmp_path / 'df' / 'last.pt'} at step 3" in out
    for name in ("fd", "df"):
        ckpt = weights(tmp_path / name)
        assert ckpt["step"] == STEPS and max_diff(ckpt, ddp_reference) < TOL, name


def test_sample_reads_an_fsdp_checkpoint(fsdp_whole):
    out = run([sys.executable, "sample.py", f"--out_dir={fsdp_whole}", "--num_samples=1", "--max_new_tokens=20",
               "--device=cpu"], child_env()).stdout
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


@pytest.mark.parametrize("batch_size", [8, 2])  # W=2, global 16: accumulation 1 or 4
def test_one_reduce_scatter_per_shard_group_per_optimizer_step(char_data, tmp_path, monkeypatch, batch_size):
    monkeypatch.setenv("COUNT_FILE", str(tmp_path / "rs"))
    args = args_for(char_data, tmp_path / "out", strategy="fsdp", batch_size=batch_size, max_iters=3,
                    eval_interval=100)
    run_world(2, args, tmp_path / "results", patch=_count_reduce_scatters)
    groups = 2 + 1  # n_layer blocks and the root
    assert [int((tmp_path / f"rs.{r}").read_text()) for r in range(2)] == [3 * groups] * 2


def test_sigterm_stops_an_fsdp_run_that_resumes_to_the_same_weights(char_data, tmp_path):
    steps = 30
    base = dict(strategy="fsdp", max_iters=steps, eval_interval=15, lr_decay_iters=steps)
    torchrun(2, args_for(char_data, tmp_path / "whole", **base))
    args = args_for(char_data, tmp_path / "cut", **{**base, "resume": "auto"})
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py", *args], cwd=REPO, env=child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in proc.stdout:  # the loop has started: step lines are printed after each step
        if line.startswith("step 3:"):
            break
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=120) != 0
    assert "stopped by SIGTERM at step" in out, out
    assert 3 <= weights(tmp_path / "cut")["step"] < steps
    torchrun(2, args)
    ckpt = weights(tmp_path / "cut")
    assert ckpt["step"] == steps and max_diff(ckpt, weights(tmp_path / "whole")) == 0


def test_activation_checkpointing_changes_no_number(char_data, tmp_path):
    """Recomputation replays dropout with the same random numbers: the same weights."""
    for name, flag in (("plain", False), ("ckpt", True)):
        run([sys.executable, "train.py", *args_for(char_data, tmp_path / name, dropout=0.1, max_iters=3,
                                                   activation_checkpointing=flag)], child_env())
    assert max_diff(weights(tmp_path / "plain"), weights(tmp_path / "ckpt")) == 0


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
