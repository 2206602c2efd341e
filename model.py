"""
GPT-2 style language model in one file.

Parameter names match OpenAI's GPT-2 (transformer.wte, transformer.h.0.attn.c_attn, ...) so
its weights map one to one (GPT-2's Conv1D weights are the transpose of our nn.Linear ones).
Attention goes through F.scaled_dot_product_attention; generation uses a key/value cache.
"""

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2
    # Round the rows of the token embedding (= output layer) up to a multiple of this, so the
    # largest matmul gets tensor-core friendly shapes on GPUs (50257 -> 50304 with 64). The
    # padding rows start at zero and their logits are cut off, so they never get a gradient
    # and nothing the model computes changes.
    pad_vocab_to: int = 1

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.pad_vocab_to) * self.pad_vocab_to

    @property
    def n_params(self) -> int:
        """Parameters of this shape, padding rows included, counted without building the model."""
        C, bias = self.n_embd, int(self.bias)
        block = 12 * C * C + 2 * C + 11 * C * bias  # 4 matrices (C x 3C, C x C, C x 4C, 4C x C), 2 LayerNorms
        return self.n_layer * block + (self.padded_vocab_size + self.block_size) * C + C * (1 + bias)

    def size_problem(self, weights: dict):
        """What is wrong if a checkpoint's `weights` are not as many as this shape (its model_args) has, or
        None: checked before a model is built (an edited shape could ask for terabytes, or a billion layers)."""
        held = sum(v.numel() for k, v in weights.items() if k != "lm_head.weight")  # (wte's, tied)
        return None if self.n_params == held else \
            f"its model_args describe {self.n_params:,} parameters, its weights hold {held:,}"


class KVCache:
    """Keys and values of one attention layer for block_size positions, allocated on first use
    with the first keys' dtype and device (so it follows autocast without being told)."""

    def __init__(self, max_len):
        self.max_len = max_len
        self.k = self.v = None

    def update(self, k, v, pos):
        """Store k, v (B, nh, T, hs) at positions pos..pos+T-1; return keys and values 0..pos+T-1."""
        B, nh, T, hs = k.shape
        assert pos + T <= self.max_len, f"cache overflow: {pos} + {T} > {self.max_len}"
        if self.k is None:
            self.k = k.new_empty(B, nh, self.max_len, hs)
            self.v = v.new_empty(B, nh, self.max_len, hs)
        self.k[:, :, pos:pos + T] = k
        self.v[:, :, pos:pos + T] = v
        return self.k[:, :, :pos + T], self.v[:, :, :pos + T]


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v together
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x, cache=None, pos=0):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # 3 x (B, nh, T, hs)
                   for t in self.c_attn(x).split(C, dim=2))  # 3 x (B, T, C)
        if cache is not None:
            # Generation feeds either a whole prompt at pos 0 or one new token after the cache.
            assert pos == 0 or T == 1, "cached attention takes a prefill at 0 or one token at a time"
            k, v = cache.update(k, v, pos)  # (B, nh, pos+T, hs)
        # Training and prefill: queries and keys line up, so the causal mask applies. A single
        # query after the cache is the last position and may see every cached key: no mask.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=pos == 0,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate='tanh')  # GPT-2 was trained with the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    checkpoint_activations = False  # recompute this block in backward (train.py's activation_checkpointing)

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, pos=0):
        if self.checkpoint_activations and self.training and torch.is_grad_enabled():
            # keep only the block's input; its activations are recomputed during backward
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x, cache, pos)

    def _forward(self, x, cache=None, pos=0):
        x = x + self.attn(self.ln_1(x), cache, pos)  # pre-LayerNorm residual blocks
        return x + self.mlp(self.ln_2(x))


def cross_entropy(logits, targets, vocab_size: int):
    """Mean loss of logits (..., padded V) against targets (-1: not counted). Padding ids past vocab_size
    score -inf: probability 0 and a gradient of exactly 0 (a slice's backward would write the padded
    gradient in a pass of its own). Compiled, the mask fuses into the loss kernels: no masked copy is written."""
    if logits.size(-1) > vocab_size:
        logits = logits.masked_fill(torch.arange(logits.size(-1), device=logits.device) >= vocab_size, float('-inf'))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.padded_vocab_size > config.vocab_size:  # padded after construction, so the
            # random numbers drawn are the same as without padding
            padding = config.padded_vocab_size - config.vocab_size
            self.lm_head.weight = nn.Parameter(F.pad(self.lm_head.weight.detach(), (0, 0, 0, padding)))
            self.lm_head.out_features = self.transformer.wte.num_embeddings = config.padded_vocab_size
        # Weight tying: the output projection is the token embedding (one tensor, counted once).
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # Each block adds two projections to the residual stream; scale them down so its
        # variance does not grow with depth (GPT-2 paper).
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # of the token rows only the real ones are drawn; padding rows stay zero
            rows = self.config.vocab_size if module.weight is self.lm_head.weight else None
            nn.init.normal_(module.weight[:rows], mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding=True):
        """Parameters, the tied embedding counted once and its padding rows not at all; non_embedding
        leaves out the position embeddings (token embeddings are also the output layer's weights)."""
        cfg = self.config
        return cfg.n_params - (cfg.padded_vocab_size - cfg.vocab_size + cfg.block_size * non_embedding) * cfg.n_embd

    def forward(self, idx, targets=None, caches=None, pos=0):
        """Logits and loss of idx (B, T), whose tokens sit at positions pos..pos+T-1: over every
        position with targets; else the next token's logits only (B, 1, V), for generation,
        through per-layer key/value caches when given."""
        B, T = idx.size()
        assert pos + T <= self.config.block_size, \
            f"Cannot forward a sequence of length {T}: block_size is only {self.config.block_size}"
        positions = torch.arange(pos, pos + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, caches[i] if caches else None, pos)
        V = self.config.vocab_size
        if targets is None:  # the next token only: skip the output layer for the other positions
            return self.lm_head(self.transformer.ln_f(x[:, [-1], :]))[..., :V], None  # (B, 1, V)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, padded V)
        loss = cross_entropy(logits, targets, V)
        # (not a view where nothing is padded: FSDP warns of a view its backward hook could miss)
        return (logits[..., :V] if self.config.padded_vocab_size > V else logits), loss  # (B, T, V)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, fused=True):
        """AdamW with weight decay on matrices and embeddings only, not on biases or LayerNorms."""
        params = [p for p in self.parameters() if p.requires_grad]
        optim_groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
                        {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        # The fused kernel does the whole update in one launch (on CPU too, about 5x faster here).
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas,
                                 fused=(fused and device_type in ('cuda', 'cpu', 'mps')) or None)

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=None):
        """Model FLOPs utilisation of fwdbwd_per_iter block_size-long sequences (forward and
        backward) in dt seconds. peak_flops=None looks up the CUDA device in PEAK_FLOPS; None
        when the peak is unknown (e.g. on CPU)."""
        if peak_flops is None and torch.cuda.is_available():
            peak_flops = peak_flops_for(torch.cuda.get_device_name())
        if peak_flops is None:
            return None
        # PaLM appendix B: 6 flops per parameter per token (2 forward, 4 backward) for the matmuls,
        # plus 12*L*H*Q*T (H*Q = n_embd) for attention scores and their weighted sums over T positions.
        cfg = self.config
        flops_per_token = 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        return flops_per_token * cfg.block_size * fwdbwd_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens; returns (B, T + max_new_tokens).
        Call model.eval() first. temperature 0 is greedy; top_k keeps the k most likely tokens;
        generator (a torch.Generator on idx's device) makes sampling reproducible.

        The prompt is run once (prefill) and each new token then costs one position against
        per-layer key/value caches. Positions are learned, so a full cache cannot slide by one:
        at block_size it is rebuilt from the last block_size // 2 tokens, so every token sees
        at least that much context, for at most one extra position of work per token on average.
        """
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if not temperature >= 0:  # (nor NaN)
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        assert idx.size(1) >= 1, "generate needs a prompt of at least one token"
        block_size = self.config.block_size
        caches = [KVCache(block_size) for _ in self.transformer.h]
        context, pos = idx[:, -block_size:], 0  # the prompt, then one new token at a time
        for _ in range(max_new_tokens):  # (the last token sampled is never run)
            logits = self(context, caches=caches, pos=pos)[0]  # (B, 1, V)
            pos += context.size(1)  # positions filled in the caches
            if not torch.isfinite(logits[:, -1]).all():  # (argmax would pick token 0; multinomial fail)
                raise ValueError("its logits are NaN or inf: weights out of range (a damaged file?)")
            idx_next = _sample(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
            context = idx_next
            if pos == block_size:  # cache full: restart it from the most recent half block (see docstring)
                context, pos = idx[:, -max(1, block_size // 2):], 0
        return idx


def _sample(logits, temperature, top_k, generator):
    """Next token (B, 1) from last-position logits (B, V)."""
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or below float32's smallest normal: greedy
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    # the top k of the logits as given: a huge temperature makes every scaled one 0, and a tie kept them all
    cut = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]] if top_k is not None else None  # (B, 1)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # <= 0: a tiny temperature cannot overflow
    logits = scaled if cut is None else scaled.masked_fill(logits < cut, -float('inf'))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


# Dense (no sparsity) bf16 tensor-core peak FLOP/s. The first name found as whole words in the device's
# name wins, so specific variants come before the generic name (and an RTX A1000 is no A100).
PEAK_FLOPS = [
    ('H100 PCIe', 756e12),  # the PCIe card runs at lower clocks and power than SXM
    ('H100 NVL', 835e12),
    ('H100', 989e12),  # SXM
    ('H200 NVL', 835e12),
    ('H200', 989e12),
    ('GH200', 989e12),  # Grace Hopper's
    ('A100', 312e12),
]


def peak_flops_for(device_name):
    """Peak bf16 FLOP/s for a device name such as 'NVIDIA H100 80GB HBM3', or None if unknown."""
    return next((flops for name, flops in PEAK_FLOPS if re.search(rf"\b{name}\b", device_name, re.IGNORECASE)), None)
