"""Generate text from a trained checkpoint.

    python sample.py --out_dir=out
    python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0   # greedy

Loads best.pt (else last.pt) from out_dir with weights_only=True and rebuilds
the tokenizer from the meta.json that train.py saved beside it. The same
--seed gives the same text. --temperature=0 picks the most likely token at
every step; --top_k larger than the vocabulary is clamped to it.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from data.common import tokenizer_from_meta
from model import GPT, GPTConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", default="out", help="folder with best.pt / last.pt and meta.json")
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


def load_model(out_dir: Path, device: torch.device) -> tuple:
    for name in ("best.pt", "last.pt"):
        path = out_dir / name
        if path.exists():
            break
    else:
        fail(f"no best.pt or last.pt in {out_dir}: train first, or pass --out_dir")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**{**ckpt["model_args"], "dropout": 0.0}))
    model.load_state_dict(ckpt["model"])
    model.eval().to(device)
    meta = json.loads((out_dir / "meta.json").read_text())
    return model, meta, path, ckpt["step"]


def read_prompt(start: str) -> str:
    if start.startswith("FILE:"):
        path = Path(start[5:])
        if not path.is_file():
            fail(f"prompt file {path} does not exist")
        start = path.read_text(encoding="utf-8")
    if not start:
        fail("the prompt is empty: give --start=TEXT or a non-empty FILE:path")
    return start


def main(argv=None):
    args = parse_args(argv)
    if args.max_new_tokens <= 0:
        fail(f"--max_new_tokens must be positive, got {args.max_new_tokens}")
    if args.temperature < 0:
        fail(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    out_dir = Path(args.out_dir)
    if not out_dir.is_dir():
        fail(f"out_dir {out_dir} does not exist: train first (python train.py) or pass --out_dir")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    model, meta, path, step = load_model(out_dir, device)
    encode, decode = tokenizer_from_meta(meta)
    try:
        prompt = encode(read_prompt(args.start))
    except ValueError as e:
        fail(str(e))
    print(f"# {path} (step {step}), seed {args.seed}", file=sys.stderr)

    generator = torch.Generator(device).manual_seed(args.seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    for _ in range(args.num_samples):
        out = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k or None, generator=generator)
        print(decode(out[0].tolist()))
        print("---------------")


if __name__ == "__main__":
    main()
