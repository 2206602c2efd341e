"""FineWeb-Edu (or FineWeb) as GPT-2 BPE token shards in llm.c's format.

    python data/fineweb/prepare.py                            # FineWeb-Edu sample-10BT: ~10B tokens
    python data/fineweb/prepare.py --subset=sample-100BT      # or a dump, e.g. CC-MAIN-2024-10
    python data/fineweb/prepare.py --repo=HuggingFaceFW/fineweb --subset=sample-10BT
    python data/fineweb/prepare.py --input='corpus/*.parquet' --out_dir=data/mine  # local files

Documents come from the dataset's parquet files on the Hugging Face hub, one file at a time
(downloaded, tokenized, deleted), or from local .parquet / .jsonl (a `text` field) / .txt files.
Each is encoded with GPT-2's BPE in worker processes, prefixed by <|endoftext|> (50256), and the
token stream is cut into shards of --shard_tokens (10^8: 200 MB each). As in llm.c's fineweb.py,
the first shard is val and the rest train: fineweb_val_000000.bin, fineweb_train_000001.bin, ...
meta.json, written last, lists every shard with its token count and sha256. Stopped at any
point, the same command continues from the last complete shard. sample-10BT needs about 20 GB
for the shards and 2-3 GB for one downloaded file at a time.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.corpora import errors_exit_2
from data.documents import hub_files, hub_source, local_source
from data.streaming import checked_workers, finished, recorded, shard_arguments, write_shards

PREPARE_IN_TRAIN = False  # hours of downloading: train.py asks for this script to be run first
REPO_ID = "HuggingFaceFW/fineweb-edu"


def prepare(out_dir=None, input_pattern=None, repo_id=REPO_ID, subset="sample-10BT", revision="main",
            shard_tokens=10**8, workers=None) -> dict:
    out_dir = Path(out_dir) if out_dir else Path(__file__).resolve().parent
    local = local_source(input_pattern) if input_pattern else None
    settings = {} if local else {"repo": repo_id, "subset": subset, "revision": revision}
    # a finished folder is checked before the hub is asked for its files (a rerun offline too)
    meta = finished(out_dir, recorded(settings, "fineweb", shard_tokens, local))
    if meta is None:
        workers = checked_workers(shard_tokens, workers)
        # sample-10BT lives in sample/10BT/, a dump in data/
        folder = f"sample/{subset.removeprefix('sample-')}/" if subset.startswith("sample-") else f"data/{subset}/"
        source = local or hub_source(repo_id, hub_files(repo_id, revision, folder, "check --subset"), revision,
                                     out_dir / ".download")
        meta = write_shards(source, out_dir, "fineweb", shard_tokens, workers,
                            route=lambda doc: "stream",
                            split_of_shard={"stream": lambda n: "val" if n == 0 else "train"},
                            settings=settings)
    print(f"{meta['documents']:,} documents: train {meta['train_tokens']:,} tokens in "
          f"{len(meta['shards']['train'])} shards, val {meta['val_tokens']:,} tokens -> {out_dir}")
    return meta


def main(argv=None) -> dict:
    parser = shard_arguments(__doc__, REPO_ID)
    parser.add_argument("--subset", default="sample-10BT", help="sample-10BT, sample-100BT, or a dump name")
    args = parser.parse_args(argv)
    return prepare(args.out_dir, args.input, args.repo, args.subset, args.revision, args.shard_tokens,
                   args.workers)


if __name__ == "__main__":
    with errors_exit_2():
        main()
