"""The CUDA paths: mixed precision, compile, flash attention, fused AdamW, pinned batches, sampling,
and DDP between two processes on one GPU. Every test skips where CUDA is missing. (float16's
skipped overflows and a bfloat16 run on CUDA: tests/test_bad_input.py and tests/test_train.py,
parametrized over the device.)"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import loader
import train
from config import resolve
from harness import REPO, SEPARATOR, ckpt, metrics, run_world, tiny_args
from model import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_args(data, out, **overrides):
    return tiny_args(data, out, **{"device": "cuda", **overrides})


def run(data, out, **overrides):
    return train.main(resolve(cuda_args(data, out, **overrides)))


def op_names(fn) -> set:
    """Names of the ops and kernels `fn()` runs on the GPU, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


def test_bfloat16_autocast_computes_in_bfloat16():
    # (a CUDA bfloat16 run lowers the loss and keeps float32 weights: tests/test_train.py)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32)).cuda()
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.zeros(2, 16, dtype=torch.long, device="cuda"))
    assert seen == [torch.bfloat16]


def test_compiled_cuda_run_saves_prefix_free_weights_that_resume(char_data, tmp_path):
    run(char_data, tmp_path, dtype="bfloat16", compile=True, max_iters=6, eval_interval=3)
    saved = ckpt(tmp_path)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in saved["model"])
    assert run(char_data, tmp_path, dtype="bfloat16", compile=True, max_iters=8, eval_interval=3,
               resume="auto")["step"] == 8


def test_compiled_dropout_on_cuda_is_drawn_again_from_the_step_seed():
    # a resume reseeds every step (train.dropout_seed): CUDA's and inductor's generators must follow
    model = torch.compile(GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32,
                                        dropout=0.5)).cuda())
    x = torch.zeros(2, 16, dtype=torch.long, device="cuda")

    def logits(step):
        torch.manual_seed(train.dropout_seed(1337, 0, step))
        return model(x, x)[0]
    assert torch.equal(logits(3), logits(3)) and not torch.equal(logits(3), logits(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_runs_on_flash_or_efficient_kernels_not_the_math_fallback(dtype):
    model = GPT(GPTConfig(block_size=256, vocab_size=128, n_layer=2, n_head=4, n_embd=256)).cuda()
    idx = torch.randint(0, 128, (4, 256), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=dtype):
            _, loss = model(idx, idx)
        loss.backward()

    names = op_names(step)
    fast = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention"}
    assert names & fast, sorted(n for n in names if "attention" in n)
    assert "aten::_scaled_dot_product_attention_math" not in names


def test_adamw_is_fused_on_cuda():
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32)).cuda()
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda")
    assert optimizer.defaults["fused"] is True
    idx = torch.randint(0, 50, (2, 16), device="cuda")
    model(idx, idx)[1].backward()
    assert any("fused_adam" in n for n in op_names(optimizer.step))


def test_batches_are_pinned_and_copied_without_blocking(tmp_path, monkeypatch):
    path = tmp_path / "train.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)
    copies = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        copies.append((self.is_pinned(), kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    batches = loader.ShardedTokenLoader(loader.Tokens.file(path, "uint16"), 8, 4, 4, 0, 1, seed=0,
                                        device="cuda")
    batches.set_epoch(0)
    x, y = batches.next_batch()
    assert x.is_cuda and y.is_cuda and torch.equal(x[:, 1:], y[:, :-1])
    assert copies == [(True, True)]


@pytest.mark.slow
def test_sample_py_runs_on_cuda_and_repeats_with_a_seed(char_data, tmp_path):
    run(char_data, tmp_path, dtype="bfloat16", max_iters=10, eval_interval=10)
    args = [sys.executable, "sample.py", f"--out_dir={tmp_path}", "--device=cuda", "--num_samples=2",
            "--max_new_tokens=30", "--start=the king"]
    first = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    samples = first.stdout.split(SEPARATOR + "\n")[:-1]
    assert len(samples) == 2 and all(s.startswith("the king") for s in samples)
    assert subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120).stdout == first.stdout


@pytest.mark.slow
def test_two_processes_on_one_gpu_match_one_process(char_data, tmp_path):
    # NCCL refuses two ranks on one device; gloo moves CUDA tensors through the host.
    common = dict(device="cuda:0", backend="gloo", bias=False, batch_size=4, global_batch_size=16,
                  max_iters=8, lr_decay_iters=8, eval_interval=4, log_interval=1)
    run(char_data, tmp_path / "w1", **common)
    run_world(2, cuda_args(char_data, tmp_path / "w2", **common), tmp_path / "results")
    a, b = ckpt(tmp_path / "w1"), ckpt(tmp_path / "w2")
    assert json.loads((tmp_path / "w2" / "config.json").read_text())["run"]["world_size"] == 2
    for name in a["model"]:
        torch.testing.assert_close(a["model"][name], b["model"][name], rtol=0, atol=1e-5)
    la, lb = ([r["loss"] for r in metrics(tmp_path / w) if "loss" in r] for w in ("w1", "w2"))
    assert la == pytest.approx(lb, rel=1e-5)
