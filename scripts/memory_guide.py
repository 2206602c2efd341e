"""How much memory each strategy needs per GPU for the GPT-2 sizes: the table in docs/fsdp.md.

    python scripts/memory_guide.py [--world=1,2,4,8] [--batch_size=8]

Model state is what AdamW training keeps for every parameter, in float32 (the master weights
also when autocast computes in bf16): the weight (4 bytes), its gradient (4) and two moments
(8), 16 bytes in all. DDP keeps all of it on every GPU; FSDP keeps 1/W of it, plus, while a
block computes, that block gathered whole (its weights in the compute dtype, and its float32
gradients until they are reduce-scattered). state_bytes_per_rank is the formula, and bench.py's
measured state bytes per rank confirm it (tests/test_bench.py). HSDP (fsdp_shard_size=S) keeps what
FSDP over S ranks keeps: read the column W=S.

Activations are an estimate per sequence of 1024 tokens in bf16 (Korthikanti et al.'s 34·T·C
bytes per layer with a fused attention kernel, plus the logits in bf16 and float32 for the loss);
activation checkpointing keeps only each block's input (2·T·C bytes per layer) and one block's
activations at a time.

Checkpoints need host (CPU) memory on top, at each save: a checkpoint holds 12 bytes per
parameter (the weights and both moments). checkpoint_format="file" gathers all of it into global
rank 0's CPU memory, so that one process needs 12 bytes per parameter however many share the
training; "sharded" has each rank write its own 12/W, and async_checkpoint stages a copy of it
first (another 12/W per rank for as long as the background write runs). That is under FSDP; under
HSDP a rank holds 12/S, and under DDP, whose ranks each hold the whole, async stages all 12 on each.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.dataset import GPT2_VOCAB_SIZE  # noqa: E402
from errors import ArgumentParser, ConfigError, reported  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

SIZES = {"gpt2 (124M)": (12, 12, 768), "gpt2-medium (350M)": (24, 16, 1024),
         "gpt2-large (774M)": (36, 20, 1280), "gpt2-xl (1.5B)": (48, 25, 1600)}
T, V = 1024, 50304  # context, padded vocabulary
GB = 1e9


def state_bytes_per_rank(n_params: int, block_params: int, strategy: str, world_size: int,
                         compute_bytes: int = 2, gathered: bool = True) -> int:
    """Model state one rank holds in training: 16 bytes per parameter (the float32 weight, its
    gradient and AdamW's two moments). FSDP holds 1/world_size of that, plus (gathered=True)
    the block that is computing, whole: its weights in the compute dtype, float32 gradients.
    bench.py measures the first part (tests/test_bench.py)."""
    if strategy == "ddp" or world_size == 1:
        return 16 * n_params
    return 16 * n_params // world_size + gathered * (compute_bytes + 4) * block_params


def n_params(n_layer, n_head, n_embd) -> tuple:
    """(all parameters, one block's) of a GPT-2 shape, counted from the model itself on the meta device."""
    import torch
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=T, vocab_size=GPT2_VOCAB_SIZE,
                              pad_vocab_to=64))
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.transformer.h[0].parameters()))


def checkpoint_bytes(n_params: int, checkpoint_format: str, world_size: int, is_rank0: bool = True) -> int:
    """Host memory one rank needs for a save beyond its training state: file gathers the whole
    checkpoint (12 bytes per parameter) into rank 0; sharded copies nothing to a single rank
    (DCP writes each rank's shards from where they are); async stages this rank's shards once."""
    if checkpoint_format == "file":
        return 12 * n_params if is_rank0 else 0
    return 12 * n_params // world_size if checkpoint_format == "sharded+async" else 0


def activations(n_layer, n_embd, checkpointing: bool) -> float:
    """Bytes of activations per 1024-token sequence (an estimate)."""
    logits = T * V * (2 + 4)
    if checkpointing:
        return n_layer * 2 * T * n_embd + 34 * T * n_embd + logits
    return n_layer * 34 * T * n_embd + logits


def table(worlds: list, batch: int) -> str:
    sharded = [w for w in worlds if w > 1]  # (W=1 is DDP's column)
    head = ["model", "parameters", "DDP (any W)", *(f"FSDP W={w}" for w in sharded), "activations per sequence",
            "with checkpointing"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, (layers, heads, width) in SIZES.items():
        total, block = n_params(layers, heads, width)
        state = [state_bytes_per_rank(total, block, "fsdp" if w > 1 else "ddp", w) for w in [1, *sharded]]
        cells = [name, f"{total / 1e6:.0f}M", *(f"{b / GB:.2f} GB" for b in state),
                 *(f"{activations(layers, width, c) / GB:.2f} GB" for c in (False, True))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Host memory for a save (W={max(worlds)}), on top of training: file on rank 0 | "
                  f"sharded, any rank | sharded + async, any rank (under FSDP)", ""]
    for name, (layers, heads, width) in SIZES.items():
        total, _ = n_params(layers, heads, width)
        lines.append(f"- {name}: " + " | ".join(f"{checkpoint_bytes(total, f, max(worlds)) / GB:.2f} GB"
                                                for f in ("file", "sharded", "sharded+async")))
    return "\n".join(lines) + (f"\n\nPer GPU: model state + batch_size x activations (batch_size={batch}: "
                               f"multiply the last columns by {batch}).")


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", default="1,2,4,8", help="process counts for the FSDP columns")
    p.add_argument("--batch_size", type=int, default=8)
    args = p.parse_args(argv)
    try:
        worlds = sorted({int(w) for w in args.world.split(",")})  # (the columns in order, each once)
    except ValueError:
        raise ConfigError(f"--world={args.world}: give process counts, e.g. --world=1,2,4,8") from None
    if min(worlds) < 1 or args.batch_size < 1:
        raise ConfigError("--world counts and --batch_size must be positive")
    print(table(worlds, args.batch_size))


if __name__ == "__main__":
    with reported():
        main()
