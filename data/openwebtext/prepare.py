"""OpenWebText, nanoGPT's corpus and split, as GPT-2 BPE token shards in llm.c's format.

    python data/openwebtext/prepare.py                        # ~9B tokens, ~18 GB of shards
    python data/openwebtext/prepare.py --input='owt/*.parquet' --out_dir=data/owt   # local files

The split is nanoGPT's rule: with the documents numbered in corpus order, the first 0.05% of a
permutation drawn by np.random.default_rng(2357) are val (Hugging Face datasets'
train_test_split(test_size=0.0005, seed=2357) draws the same), so the same corpus gives the
same val documents as nanoGPT's, about 4,000 of 8 million. Unlike nanoGPT, each document is
prefixed by <|endoftext|> (50256) as in llm.c, and the tokens go to shards (openwebtext_val_*.bin,
openwebtext_train_*.bin) instead of one 17 GB file. Documents come from the repo's parquet files
on the hub, downloaded first (about 25 GB; each file is deleted once tokenized) because the split
needs the number of documents, or from local .parquet / .jsonl / .txt files. Stopped at any
point, the same command continues from the last complete shards.
"""

import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from data.corpora import errors_exit_2
from data.documents import count_documents, hub_files, hub_source, local_source
from data.streaming import checked_workers, finished, read_progress, recorded, shard_arguments, write_shards

PREPARE_IN_TRAIN = False  # hours of downloading: train.py asks for this script to be run first
REPO_ID = "Skylion007/openwebtext"
VAL_FRACTION, SPLIT_SEED = 0.0005, 2357  # nanoGPT's test_size and seed


def val_documents(n_documents: int) -> set:
    """The document numbers of the val split: nanoGPT's (datasets' train_test_split) rule."""
    n_val = math.ceil(VAL_FRACTION * n_documents)
    return set(np.random.default_rng(SPLIT_SEED).permutation(n_documents)[:n_val].tolist())


def prepare(out_dir=None, input_pattern=None, repo_id=REPO_ID, revision="main", shard_tokens=10**8,
            workers=None) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).resolve().parent
    local = local_source(input_pattern) if input_pattern else None
    settings = {} if local else {"repo": repo_id, "revision": revision}
    settings.update(val_fraction=VAL_FRACTION, split_seed=SPLIT_SEED)
    # a finished folder is checked before the hub is asked for its files or a document is counted
    meta = finished(out_dir, recorded(settings, "openwebtext", shard_tokens, local))
    if meta is None:
        workers = checked_workers(shard_tokens, workers)  # (before every document is counted)
        hint = "pass --revision (a branch with the parquet conversion) or --input"
        source = local or hub_source(repo_id, hub_files(repo_id, revision, "", hint), revision, out_dir / ".download")
        counts = read_progress(out_dir)["counts"]
        if len(counts) != len(source.names):  # the split needs the number of documents up front
            counts = [count_documents(source.fetch(i)) for i in range(len(source.names))]
        val = val_documents(sum(counts))
        meta = write_shards(source, out_dir, "openwebtext", shard_tokens, workers,
                            route=lambda doc: "val" if doc in val else "train",
                            split_of_shard={"val": lambda n: "val", "train": lambda n: "train"},
                            settings=settings, counts=counts)
    print(f"{meta['documents']:,} documents ({math.ceil(VAL_FRACTION * meta['documents']):,} val): train "
          f"{meta['train_tokens']:,} tokens in {len(meta['shards']['train'])} shards, val {meta['val_tokens']:,} "
          f"tokens -> {out_dir}")
    return meta


def main(argv=None) -> dict:
    args = shard_arguments(__doc__, REPO_ID).parse_args(argv)
    return prepare(args.out_dir, args.input, args.repo, args.revision, args.shard_tokens, args.workers)


if __name__ == "__main__":
    with errors_exit_2():
        main()
