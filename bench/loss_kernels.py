"""Time GPT-2's output layer and loss (forward + backward): model.py's way against a chunked
linear + cross-entropy that never holds a whole batch of logits.

    python bench/loss_kernels.py [--tokens=32768] [--chunks=4096,8192]

model.py computes the (B*T, 50304) logits, masks the padding ids and takes the cross-entropy;
under torch.compile the mask, log-softmax and loss fuse. The chunked version computes the loss
and both gradients chunk by chunk in the forward pass (each chunk's logits freed at once), so the
backward only scales stored gradients. Both are compiled. Prints time, peak memory and the
relative error of loss and gradients against a float64 reference; a GPU is needed.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from attention_kernels import time_ms  # (bench/ is this script's folder)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import cross_entropy  # noqa: E402


def model_loss(x, w, targets, vocab):
    """model.py's output layer and loss, under autocast as train.py runs them."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return cross_entropy(F.linear(x, w), targets, vocab)


@torch.compile
def chunk_grads(x, w, targets, vocab: int, n: int):
    """One chunk's summed loss and the gradient of the mean loss over n tokens w.r.t. its logits."""
    logits = F.linear(x, w).float()
    logits = logits.masked_fill(torch.arange(logits.size(-1), device=x.device) >= vocab, float('-inf'))
    lse = logits.logsumexp(-1, keepdim=True)
    loss = (lse.squeeze(1) - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    grad = (logits - lse).exp()
    grad = grad.scatter_add(1, targets[:, None], -torch.ones_like(grad[:, :1])) / n
    return loss, grad.to(x.dtype)


class ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, targets, vocab, chunk):
        wb, n = w.to(x.dtype), x.size(0)
        grad_x, grad_w, loss = torch.empty_like(x), torch.zeros_like(w), x.new_zeros((), dtype=torch.float32)
        for s in range(0, n, chunk):
            part_loss, g = chunk_grads(x[s:s + chunk], wb, targets[s:s + chunk], vocab, n)
            loss += part_loss
            grad_x[s:s + chunk] = g @ wb
            grad_w += g.t() @ x[s:s + chunk]  # bf16 product, summed in float32 as autocast would
        ctx.save_for_backward(grad_x, grad_w)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_out, grad_w * grad_out, None, None, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)  # micro-batch 32 x block 1024
    p.add_argument("--n_embd", type=int, default=768)
    p.add_argument("--chunks", default="4096,8192")
    a = p.parse_args()
    vocab, padded = 50257, 50304
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.n_embd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(padded, a.n_embd, device="cuda")).requires_grad_()
    with torch.no_grad():
        w[vocab:] = 0
    targets = torch.randint(0, vocab, (a.tokens,), device="cuda")

    # float64 reference on a slice of the tokens (the whole batch's float64 logits would not fit)
    ref_n = 2048
    xr, wr = x[:ref_n].detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(F.linear(xr, wr)[:, :vocab], targets[:ref_n])
    ref.backward()
    rel = lambda got, want: ((got.double() - want).norm() / want.norm()).item()

    variants = [("model.py, compiled", torch.compile(model_loss))]
    variants += [(f"chunked {c}", lambda x, w, t, v, c=c: ChunkedLinearCE.apply(x, w, t, v, c))
                 for c in map(int, a.chunks.split(","))]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {a.tokens} tokens x {a.n_embd} "
          f"-> {padded} logits, bf16")
    for name, fn in variants:
        x.grad = w.grad = None
        loss = fn(x[:ref_n], w, targets[:ref_n], vocab)
        loss.backward()
        errors = f"loss {rel(loss, ref):.1e}, dx {rel(x.grad[:ref_n], xr.grad):.1e}, dw {rel(w.grad, wr.grad):.1e}"

        def step():
            x.grad = w.grad = None
            fn(x, w, targets, vocab).backward()

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = time_ms(step, repeat=10)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"{name:>20}: {ms:7.2f} ms fwd+bwd, {peak:5.2f} GiB above inputs | rel. error {errors}")


if __name__ == "__main__":
    main()
