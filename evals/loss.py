"""The loss over a fixed set of windows of a split, shared out across ranks (train.py's eval, eval.py)."""

import numpy as np
import torch
import torch.distributed as dist

from collectives import first_error
from errors import ConfigError
from loader import Tokens, windows_to_batch
from world import World


@torch.no_grad()
def val_loss(model, tokens: Tokens, starts: np.ndarray, block_size: int, batch_size: int, world: World, autocast,
             same_forwards: bool) -> float:
    """Mean loss over fixed windows split across ranks; sums are all-reduced, so every rank agrees.
    same_forwards (FSDP): every rank runs as many forwards as rank 0."""
    model.eval()
    # (sum of token losses, token count, ranks that read a token id past the vocabulary)
    totals = torch.zeros(3, dtype=torch.float32 if world.device.type == "mps" else torch.float64,
                         device=world.device)
    mine = starts[world.rank::world.size]
    # FSDP gathers weights in every forward, so every rank runs as many as rank 0 (spares count 0)
    n = len(starts[::world.size]) if same_forwards else len(mine)
    for i in range(0, n, batch_size):
        batch = mine[i:i + batch_size]
        x, y = windows_to_batch(tokens, batch if len(batch) else starts[:1], block_size, world.device)
        with autocast:
            _, loss = model(x, y)
        totals[0] += loss.to(totals.dtype) * y.numel() * (len(batch) > 0)
        totals[1] += y.numel() * (len(batch) > 0)
    totals[2] = tokens.bad is not None
    if world.size > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    if totals[2] > 0:  # no loss of a damaged split is reported: every rank stops with one message
        raise ConfigError(first_error(tokens.bad, world))
    model.train()
    return (totals[0] / totals[1]).item()
