"""Evaluate a checkpoint or GPT-2's weights: HellaSwag accuracy, and the loss on a dataset.

    python eval.py --out_dir=out-gpt-small               # best.pt (else last.pt) of a GPT-2 BPE run
    python eval.py --out_dir=out-gpt-small --checkpoint=last   # its newest instead
    python eval.py --init_from=gpt2                      # OpenAI's GPT-2 124M (or a Hugging Face folder)
    python eval.py --init_from=gpt2 --limit=500          # a quick look: the first 500 examples
    python eval.py --out_dir=out-gpt-small --hellaswag=hellaswag_val.jsonl --dataset=fineweb
    torchrun --standalone --nproc_per_node=4 eval.py --init_from=gpt2-xl   # each rank a quarter

HellaSwag's validation file comes from --hellaswag=PATH, else from the cache
(~/.cache/gpt-train/hellaswag_val.jsonl), downloaded there on first use. Every rank loads the
model itself, so under several hosts each needs its copy. The last line on stdout is
`hellaswag: acc A acc_norm B over N examples` (fractions, 4 decimals), for scripts to read
(--no_hellaswag, the loss on --dataset alone, for a model of any tokenizer: its line is the last);
docs/eval.md says what the numbers mean and what GPT-2 scores. Every bad input ends in one
line on stderr and exit status 2.
"""

import hashlib
import math

import torch

import pretrained
from collectives import agree_or_raise, collective_failures_explained, differs_from_rank0, process_group
from config import Config, validate
from errors import ArgumentParser, ConfigError, RunError, reported, signals_unwind
from data.dataset import text_sha256
from evals import hellaswag
from loader import dataset_dir, eval_starts, read_dataset, token_splits
from evals.loss import val_loss
from world import autocast, available_memory, place


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    pretrained.add_source_args(p)
    p.add_argument("--hellaswag", default="", help="a local hellaswag_val.jsonl (default: the cached copy)")
    p.add_argument("--no_hellaswag", action="store_true", help="only the loss on --dataset (any tokenizer)")
    p.add_argument("--limit", type=int, default=0, help="evaluate the first N examples only (0 = all)")
    p.add_argument("--dataset", default="", help="also the loss on this dataset's val split")
    p.add_argument("--data_dir", default="", help="that dataset's folder (default data/<dataset>), or any one")
    p.add_argument("--val_windows", type=int, default=200, help="val windows of block_size tokens for the loss")
    p.add_argument("--batch_size", type=int, default=16, help="sequences per forward (4 per HellaSwag example)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--dist_timeout", type=float, default=600.0, help="seconds a rank waits for its peers")
    return p.parse_args(argv)


def check(args):
    for name in ("limit", "val_windows", "batch_size"):
        if getattr(args, name) < (0 if name == "limit" else 1):
            raise ConfigError(f"--{name} must be {'>= 0' if name == 'limit' else 'positive'}, got {getattr(args, name)}")
    if not 1 <= args.dist_timeout <= 1e6:  # (nan too; under 1 ms, torch's store waits 0 ms)
        raise ConfigError(f"--dist_timeout must be positive seconds, 1 to 1e6, got {args.dist_timeout}")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {args.dtype!r}")
    if args.no_hellaswag and not (args.dataset or args.data_dir):
        raise ConfigError("--no_hellaswag leaves nothing to evaluate: give --dataset or --data_dir for the loss")
    if args.no_hellaswag and (args.hellaswag or args.limit):
        raise ConfigError("--hellaswag and --limit choose HellaSwag's examples: not with --no_hellaswag")
    pretrained.check_source(args)


def val_split(args, model, vocab: dict) -> tuple:
    """(tokens, window starts, its text's sha256) of --dataset's val split, checked against the model's vocabulary."""
    cfg = validate(Config(dataset=args.dataset, data_dir=args.data_dir, block_size=model.config.block_size))
    meta = read_dataset(cfg, ("val",))  # (train.bin is no concern of an evaluation)
    if any(meta.get(k) != vocab.get(k) for k in ("vocab_size", "tokenizer", "chars")):  # (or other characters)
        models = f"{vocab.get('tokenizer')} of {vocab['vocab_size']} tokens" + ", other characters" * (
            meta.get("chars") != vocab.get("chars") and meta["vocab_size"] == vocab["vocab_size"])
        raise ConfigError(f"{dataset_dir(cfg)} has another vocabulary ({meta.get('tokenizer')} of {meta['vocab_size']} "
                          f"tokens) than the model ({models}): give a dataset of the model's tokenizer")
    tokens = token_splits(cfg, meta, ("val",))["val"]
    return tokens, eval_starts(tokens, cfg.block_size, args.val_windows), text_sha256(meta)


def main(argv=None):
    args = parse_args(argv)
    check(args)
    world = place(args.device, args.dtype, "auto")  # checked before the group, like train.py
    with process_group(world, args.dist_timeout), \
            collective_failures_explained(world, args.dist_timeout, lambda: "during the evaluation"):
        error = None
        try:  # a rank whose copy of something is missing stops every rank, with its message
            model, meta, name = pretrained.load_for_text(args.init_from, args.out_dir, world.device, args.checkpoint)
            # a lower bound, one forward's float32 logits (HellaSwag's: an example's 4 endings at least)
            need = 4 * max(args.batch_size, 4) * model.config.block_size * model.config.padded_vocab_size
            if need > (free := available_memory(world.device, world.local_size)):  # (else a traceback, or killed)
                raise ConfigError(f"--batch_size={args.batch_size} needs at least {need / 1e9:,.1f} GB for one "
                                  f"forward's logits, but {world.device} has {free / 1e9:,.1f} GB available: give a "
                                  f"smaller --batch_size")
            val = val_split(args, model, meta) if args.dataset or args.data_dir else None
            examples = score = None
            if not args.no_hellaswag:
                hellaswag.check_tokenizer(meta, name, "evaluate --no_hellaswag with --dataset (the loss alone)")
                examples = hellaswag.load(args.hellaswag, model.config.block_size, args.limit)
        except ConfigError as e:
            error = str(e)
        # a rank started with another --limit (say) would score other examples: every rank stops
        per_host = ("out_dir", "init_from", "hellaswag", "data_dir", "device", "dist_timeout")
        agree_or_raise(differs_from_rank0(vars(args), world, per_host) or error, world)
        # ... and so would a rank whose own copy (of a per-host path) is another model or val split: their
        # scores would be summed into one (a digest of the model's shape and each weight's first and last value)
        ends = torch.cat([p.detach().reshape(-1)[[0, -1]].float() for p in model.parameters()]).cpu().numpy()
        digest = hashlib.sha256(repr(vars(model.config)).encode() + ends.tobytes()).hexdigest()[:16]
        loaded = {"model": digest, "val": val and [int(val[0].lengths.sum()), val[2]]}
        agree_or_raise(differs_from_rank0(loaded, world, what="model and val split (each host's --out_dir or "
                                          "--init_from, and --data_dir)"), world)
        # a loss that is NaN or inf is no score (its weights are finite: pretrained.load_gpt checked)
        half = str(world.dtype).removeprefix("torch.") if world.dtype != torch.float32 else None
        overflows = f": the model overflows {half} (try --dtype=float32)" if half else ""
        if val is not None:
            loss = val_loss(model, *val[:2], model.config.block_size, args.batch_size, world, autocast(world), False)
            if not math.isfinite(loss):  # (all-reduced: every rank stops)
                raise RunError(f"the val loss on {args.data_dir or args.dataset} is {loss}{overflows}")
        if examples is not None:
            hellaswag.same_on_every_rank(examples, world, "--hellaswag")
            score, _ = hellaswag.evaluate(model, examples, world, autocast(world), args.batch_size,
                                          progress=world.is_master)
            if score.not_finite:
                raise RunError(f"HellaSwag's losses are NaN or inf in {score.not_finite} of {score.examples} "
                               f"examples{overflows}")
    if world.is_master:
        print(f"# {name}, {world.size} process{'es' if world.size > 1 else ''}")
        if val is not None:
            print(f"{args.data_dir or args.dataset} val loss {loss:.4f} over {len(val[1])} windows of "
                  f"{model.config.block_size} tokens")
        if score is not None:
            if score.truncated:
                print(f"note: {score.truncated} example{'s' * (score.truncated != 1)} did not fit block_size "
                      f"({model.config.block_size}): contexts lost tokens from the left (an ending still too "
                      f"long, from its end)")
            print(score.line())
    return score


if __name__ == "__main__":
    with reported(), signals_unwind():
        main()
