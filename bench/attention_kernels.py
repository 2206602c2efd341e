"""Time causal attention (forward + backward) on each SDPA kernel for GPT-2 small's shapes.

    python bench/attention_kernels.py [--batch=24]

Shows which kernel PyTorch picks by itself and what the others would cost; a GPU is needed.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, repeat=20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head_dim", type=int, default=64)
    a = p.parse_args()
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    # causal attention: half of the 4*B*H*T*T*D forward flops, backward 2.5x the forward
    flops = 4 * a.batch * a.heads * a.seq ** 2 * a.head_dim / 2 * 3.5
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | shape {shape} bf16, causal")
    for name, backends in [("default choice", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                           ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("math", [SDPBackend.MATH])]:
        try:
            if backends is None:
                ms = time_ms(step)
            else:
                with sdpa_kernel(backends):
                    ms = time_ms(step)
            print(f"{name:>15}: {ms:7.3f} ms fwd+bwd, {flops / ms / 1e9:6.1f} TFLOP/s")
        except RuntimeError as e:
            print(f"{name:>15}: not available ({str(e).splitlines()[0][:80]})")


if __name__ == "__main__":
    main()
