"""Generate text from a trained checkpoint.

    python sample.py --out_dir=out
    python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0   # greedy
    python sample.py --out_dir=out --checkpoint=last                         # the newest, not the best
    python sample.py --init_from=gpt2 --start="The meaning of life is"     # OpenAI's weights

Loads best (else last, else previous, also when one is damaged; .pt or .dcp) from out_dir with
weights_only=True and rebuilds the tokenizer from the vocabulary the checkpoint
keeps (an older one's: the meta.json beside it). The same --seed gives the same text. --temperature=0 picks
the most likely token at every step (greedy); a negative temperature is an
error. --top_k larger than the vocabulary is clamped to it (no filtering). A
prompt with characters outside a character-level vocabulary is an error that
lists them. Every bad input ends in one line on stderr and exit status 2.

--init_from=gpt2 (gpt2-medium, gpt2-large, gpt2-xl, or a folder holding a Hugging Face GPT-2
model) samples from those weights with GPT-2's tokenizer, no training run needed (nanoGPT's
--init_from=resume is the run in --out_dir). All
--num_samples samples are generated together, as one batch through the key/value cache.
"""

import math
import sys
from pathlib import Path

import torch

import pretrained
from data.files import why_unreadable
from data.tokenizers import tokenizer_from_meta
from errors import ArgumentParser, ConfigError, reported
from world import World, available_memory, pick_device

CHUNK_BYTES = 2**31  # fixed, not the free memory: the same seed gives the same text on any machine


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    pretrained.add_source_args(p)
    p.add_argument("--start", default="\n", help='prompt text, or FILE:path to read it from a file')
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = no top-k filtering")
    p.add_argument("--seed", type=int, default=1337, help="64 bits; on a CPU torch keeps the low 32")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    return p.parse_args(argv)


def read_prompt(start: str) -> str:
    if start.startswith("FILE:"):
        if not (path := Path(start[5:])).name:
            raise ConfigError(f"{start!r} names no file: give --start=FILE:PATH (a text file)")
        if why := why_unreadable(path):
            raise ConfigError(f"prompt file {path} {why}")
        try:
            # bytes: read_text would turn \r\n and \r into \n; a byte-order mark is no character of the prompt
            start = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ConfigError(f"prompt file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:  # (a terminal none is attached to, /proc/self/mem)
            raise ConfigError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    elif any("\udc80" <= c <= "\udcff" for c in start):  # how Python keeps argv's bad bytes
        raise ConfigError("--start is not UTF-8 text: set the terminal to UTF-8, or put the prompt in a "
                          "UTF-8 file and give --start=FILE:path")
    if not start:
        raise ConfigError("the prompt is empty: give --start=TEXT or a non-empty FILE:path")
    return start


def sample_bytes(prompt: int, new: int, config) -> int:
    """The most memory generate takes for one sample (float32): its key/value caches, the activations of
    its longest forward (the prompt, or the half block a full cache restarts from: once left out, they
    took as much again as the caches), the logits and sampling's temporaries, and the ids."""
    block, width = config.block_size, config.n_embd
    tokens = min(block, max(prompt, block // 2 if prompt + new > block else 0))
    return (8 * config.n_layer * block * width + 4 * width * (12 * tokens + 2 * block)  # (attention reads a
            + 16 * config.padded_vocab_size + 8 * (prompt + new))                      # layer's cache as a copy)


def batches(num_samples: int, prompt: int, new: int, config, device):
    """Sample counts per generate call, one at a time: all at once up to CHUNK_BYTES of sample_bytes,
    then in chunks of that size, so a huge request runs in bounded memory."""
    per_sample = sample_bytes(prompt, new, config)
    if per_sample > available_memory(device):
        raise ConfigError(f"one sample needs {per_sample / 1e9:.1f} GB, more than {device} has available: ask for "
                          f"fewer --max_new_tokens (or a shorter --start)")
    chunk = max(1, CHUNK_BYTES // per_sample)
    for i in range(0, num_samples, chunk):  # (a list of them all took memory without bound)
        yield min(chunk, num_samples - i)


def check(args):
    for name, ok, rule in (("max_new_tokens", args.max_new_tokens > 0, "positive"),
                           ("num_samples", args.num_samples > 0, "positive"),
                           ("temperature", 0 <= args.temperature < math.inf, ">= 0 and finite (0 = greedy)"),
                           ("seed", -2**63 <= args.seed < 2**64, "a 64-bit integer"),
                           ("top_k", args.top_k >= 0, ">= 0 (0 = no top-k filtering)")):
        if not ok:
            raise ConfigError(f"--{name} must be {rule}, got {getattr(args, name)}")
    pretrained.check_source(args)


def main(argv=None):
    args = parse_args(argv)
    check(args)
    device = pick_device(args.device, World())
    text = read_prompt(args.start)  # (before the model, which may be a download, or take minutes to load)
    model, meta, name = pretrained.load_for_text(args.init_from, args.out_dir, device, args.checkpoint)
    try:
        encode, decode = tokenizer_from_meta(meta)
    except (ValueError, RuntimeError) as e:  # no GPT-2 BPE file to be had
        raise ConfigError(str(e)) from None
    try:
        prompt = encode(text)
    except ValueError as e:  # characters outside a char vocabulary
        default = " (the default --start, a newline: give --start=TEXT)" if args.start == "\n" else ""
        raise ConfigError(f"{e}{default}") from None
    print(f"# {name}, seed {args.seed}", file=sys.stderr)

    generator = torch.Generator(device).manual_seed(args.seed)
    for n in batches(args.num_samples, len(prompt), args.max_new_tokens, model.config, device):
        idx = torch.tensor([prompt] * n, dtype=torch.long, device=device)  # (n, T)
        try:
            out = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k or None, generator=generator)  # (n, T + new): one batch
        except ValueError as e:  # (its arguments were checked above: the weights)
            raise ConfigError(f"{name}: {e}") from None
        for row in out:  # a row at a time: the whole batch as Python ints took 4x the memory the plan gives it
            print(decode(row.tolist()))
            print("---------------", flush=True)


if __name__ == "__main__":
    with reported():
        main()
