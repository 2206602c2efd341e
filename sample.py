"""Generate text from a trained checkpoint.

    python sample.py --out_dir=out
    python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0   # greedy
    python sample.py --init_from=gpt2 --start="The meaning of life is"     # OpenAI's weights

Loads best.pt (else last.pt, also when best.pt is damaged) from out_dir with
weights_only=True and rebuilds the tokenizer from the meta.json that train.py
saved beside it. The same --seed gives the same text. --temperature=0 picks
the most likely token at every step (greedy); a negative temperature is an
error. --top_k larger than the vocabulary is clamped to it (no filtering). A
prompt with characters outside a character-level vocabulary is an error that
lists them. Every bad input ends in one line on stderr and exit status 2.

--init_from=gpt2 (gpt2-medium, gpt2-large, gpt2-xl, or a folder holding a Hugging Face GPT-2
model) samples from those weights with GPT-2's tokenizer, no training run needed. All
--num_samples samples are generated together, as one batch through the key/value cache.
"""

import argparse
import sys
from pathlib import Path

import torch

import checkpoint
import pretrained
from checkpoint import UnreadableCheckpoint
from data.dataset import load_meta
from data.tokenizers import tokenizer_from_meta
from errors import ConfigError, first_line
from launch import auto_device
from model import GPT, GPTConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", default="out", help="folder with best.pt / last.pt and meta.json")
    p.add_argument("--init_from", default="", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl or a Hugging "
                                                   "Face GPT-2 folder, instead of a checkpoint in --out_dir")
    p.add_argument("--start", default="\n", help='prompt text, or FILE:path to read it from a file')
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = no top-k filtering")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps")
    return p.parse_args(argv)


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_model(out_dir: Path, device: torch.device, prefer: str = "best.pt") -> tuple:
    """The model from best.pt, else last.pt (or the other way round); a damaged file is reported
    and the next one tried."""
    names = ("best.pt", "last.pt") if prefer == "best.pt" else ("last.pt", "best.pt")
    candidates = [out_dir / name for name in names if (out_dir / name).exists()]
    if not candidates:
        fail(f"no best.pt or last.pt in {out_dir}: train first, or pass --out_dir")
    for path in candidates:
        try:
            ckpt = checkpoint.read(path)
            model = GPT(GPTConfig(**{**ckpt["model_args"], "dropout": 0.0}))
            model.load_state_dict(ckpt["model"])
            break
        except UnreadableCheckpoint as e:
            problem = str(e)
        except Exception as e:  # plain data, but not a checkpoint of this repo's GPT
            problem = f"{path} is not a GPT checkpoint of this repo ({type(e).__name__}: {first_line(e)})"
        if path == candidates[-1]:
            fail(problem)
        print(f"warning: {problem}; trying {candidates[-1]}", file=sys.stderr)
    meta_path = out_dir / "meta.json"
    if not meta_path.is_file():
        fail(f"{meta_path} is missing: train.py writes it beside the checkpoint; copy the dataset's "
             f"meta.json there")
    try:
        meta = load_meta(out_dir)
    except ValueError as e:
        fail(str(e))
    if meta["vocab_size"] != model.config.vocab_size:
        fail(f"{meta_path} has a vocabulary of {meta['vocab_size']} tokens but {path} was trained "
             f"with {model.config.vocab_size}: they come from different runs")
    return model.eval().to(device), meta, path, ckpt["step"]


def read_prompt(start: str) -> str:
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            fail(f"prompt file {path} does not exist")
        try:
            start = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            fail(f"prompt file {path} is not UTF-8 text ({e.reason} at byte {e.start})")
    if not start:
        fail("the prompt is empty: give --start=TEXT or a non-empty FILE:path")
    return start


def main(argv=None):
    args = parse_args(argv)
    if args.max_new_tokens <= 0:
        fail(f"--max_new_tokens must be positive, got {args.max_new_tokens}")
    if args.num_samples <= 0:
        fail(f"--num_samples must be positive, got {args.num_samples}")
    if not args.temperature >= 0:  # also refuses nan
        fail(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        fail(f"--top_k must be >= 0 (0 = no top-k filtering), got {args.top_k}")
    out_dir = Path(args.out_dir)
    if not args.init_from and not out_dir.is_dir():
        fail(f"out_dir {out_dir} does not exist: train first (python train.py) or pass --out_dir")
    try:
        device = auto_device() if args.device == "auto" else torch.device(args.device)
    except RuntimeError:
        fail(f"--device={args.device} is not a device torch knows: use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("--device=cuda but CUDA is not available here: use --device=cpu")
    if args.init_from:
        try:
            model, meta, path, step = pretrained.load_gpt(args.init_from, device), {"tokenizer": "gpt2"}, args.init_from, 0
        except ConfigError as e:
            fail(str(e))
    else:
        model, meta, path, step = load_model(out_dir, device)
    try:
        encode, decode = tokenizer_from_meta(meta)
        prompt = encode(read_prompt(args.start))
    except (ValueError, RuntimeError) as e:  # characters outside a char vocabulary; no GPT-2 BPE
        fail(str(e))
    print(f"# {path} (step {step}), seed {args.seed}", file=sys.stderr)

    generator = torch.Generator(device).manual_seed(args.seed)
    idx = torch.tensor([prompt] * args.num_samples, dtype=torch.long, device=device)  # (N, T)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k or None, generator=generator)  # (N, T + new): one batch
    for row in out.tolist():
        print(decode(row))
        print("---------------")


if __name__ == "__main__":
    main()
