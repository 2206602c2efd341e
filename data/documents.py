"""Where a corpus's documents come from: local .parquet / .jsonl / .txt files (a `text` field; a
.txt file is one document), or parquet files of a Hugging Face dataset repo, each downloaded when
its turn comes. data/streaming.py tokenizes them into shards."""

import glob
import os
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path
from typing import Callable, Iterator

from data.files import parse_json
from errors import first_line


def read_documents(path: Path) -> Iterator[str]:
    """The documents of one file, in order; ValueError naming the file when it has no text."""
    if path.suffix == ".txt":
        try:
            yield path.read_bytes().decode("utf-8").removeprefix("\ufeff")  # (a byte-order mark is no text)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start:,}): convert it") from None
    elif path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = parse_json(line.decode("utf-8").removeprefix("\ufeff"))
                except ValueError as e:  # UnicodeDecodeError too
                    raise ValueError(f"{path}, line {line_number}: not a line of UTF-8 JSON ({e}): each line "
                                     f"must be a JSON object with the document in 'text'") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f"{path}, line {line_number}: no 'text' field (a string): each "
                                     f"line must be a JSON object with the document in 'text'")
                yield record["text"]
    elif path.suffix == ".parquet":
        parquet = parquet_file(path)
        with readable_parquet(path):  # (damaged inside)
            for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
                yield from (text or "" for text in batch.column(0).to_pylist())
    else:
        raise ValueError(f"{path}: not a .parquet, .jsonl or .txt file")


@contextmanager
def readable_parquet(path: Path):
    """pyarrow's errors (a file cut short, or damaged inside) as one line naming the file."""
    try:
        yield
    except UnicodeDecodeError as e:  # a string column's bytes are not checked when written (it read as damaged)
        raise ValueError(f"{path}: a document in its 'text' column is not UTF-8 ({e.reason}, byte "
                         f"0x{e.object[e.start]:02x}): give the documents as UTF-8 text") from None
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError; its text may end in a newline
        raise ValueError(f"{path} is not a readable parquet file ({first_line(e)})") from None


def parquet_file(path: Path):
    """The file's pyarrow ParquetFile, with a 'text' column of strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    with readable_parquet(path):
        parquet = pq.ParquetFile(path)
    if "text" not in parquet.schema_arrow.names:
        raise ValueError(f"{path} has no 'text' column (it has {', '.join(parquet.schema_arrow.names)})")
    if (columns := parquet.schema_arrow.names.count("text")) > 1:  # (pyarrow's field("text") raises a KeyError)
        raise ValueError(f"{path} has {columns} 'text' columns: give it one, holding the documents")
    kind = parquet.schema_arrow.field("text").type
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind  # a pandas categorical's strings
    if str(kind) not in ("string", "large_string", "string_view"):
        raise ValueError(f"{path}: its 'text' column holds {kind}, not strings: give the documents as text")
    return parquet


def count_documents(path: Path) -> int:
    if path.suffix == ".parquet":
        return parquet_file(path).metadata.num_rows
    return sum(1 for _ in read_documents(path))


@dataclass
class Source:
    """The corpus: an ordered list of files, each fetched (if need be) when its turn comes."""
    names: list                      # what each file is called in meta.json and messages
    fetch: Callable[[int], Path]     # file index -> a local path to read
    release: Callable[[int], None] = lambda i: None  # done with file i (a download may go)
    description: dict = field(default_factory=dict)
    sizes: list = None               # local files' bytes: a resume or rerun must find the same


def _link_loop(folder: str, chain: tuple = ()):
    """A link under `folder` to a folder on its own path (itself, or one holding it: ** would follow it for ever;
    two: 2^40 paths, a hang), found without following one; None if there is none. Hidden folders, as glob's **."""
    chain += (os.path.realpath(folder),)
    with suppress(OSError):  # (a folder that cannot be read: glob skips it too)
        for entry in os.scandir(folder):
            if not entry.name.startswith(".") and entry.is_dir():
                if entry.is_symlink() and os.path.realpath(entry.path) in chain:
                    return entry.path
                if found := _link_loop(entry.path, chain):
                    return found
    return None


def local_source(pattern: str) -> Source:
    """Files matching a glob pattern (or one path), in sorted order; ** matches folders at any depth."""
    magic = any(c in pattern for c in "*?[") and not Path(pattern).is_file()  # ("notes [v1].txt" is a name)
    root = os.path.join(*takewhile(lambda part: not any(c in part for c in "*?["), Path(pattern).parts), "")
    if "**" in pattern and (loop := _link_loop(root or ".")):  # (a link above root is followed once, as named)
        raise ValueError(f"--input {pattern}: {loop} is a link to a folder that holds it, which ** would follow for "
                         f"ever: remove the link, or give a pattern without **")
    files = sorted(map(Path, glob.glob(pattern, recursive=True))) if magic else [Path(pattern)]
    unique = {}  # a file ** reaches twice (through a link to a folder) is one: its documents were in val and train
    for f in files:
        if f.is_file():
            unique.setdefault(os.path.realpath(f), f)
        elif magic and not f.is_dir():  # (dropped, its documents would be missing without a word)
            raise ValueError(f"--input {pattern} matches {f}, which is not a readable regular file (a link to "
                             f"nothing, a pipe or a device): move it away, or give a pattern that leaves it out")
    if not (files := list(unique.values())):
        folder = f"is a folder: give its files ({pattern.rstrip('/')}/*.jsonl, say)" if Path(pattern).is_dir() else \
            "is not a regular file (a pipe or a device): give a file" if Path(pattern).exists() else ""
        raise FileNotFoundError(f"--input {pattern} {folder or 'matches no file'}")
    for f in files:  # before any is read: a later one refused once left shards whose progress refused the fixed list
        if f.suffix not in (".parquet", ".jsonl", ".txt"):
            raise ValueError(f"{f}: not a .parquet, .jsonl or .txt file")
    return Source([os.path.abspath(f) for f in files], lambda i: files[i], sizes=[f.stat().st_size for f in files],
                  description={"name": "local files", "input": os.path.abspath(pattern), "files": len(files)})


@contextmanager
def on_the_hub(what: str):
    """A failure to reach the hub (offline, blocked, no such repo: httpx's errors are no OSError) as one line."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        raise OSError(f"could not {what} on the Hugging Face hub ({type(e).__name__}: {str(e).splitlines()[0][:200]}"
                      f"): check the network and --repo/--revision, or give local files with --input") from None


def hub_files(repo_id: str, revision: str, folder: str, hint: str) -> list:
    """The .parquet files under `folder` of a Hugging Face dataset repo, sorted."""
    from huggingface_hub import HfApi
    with on_the_hub(f"list the files of {repo_id}"):
        names = HfApi().list_repo_files(repo_id, repo_type="dataset", revision=revision)
    files = sorted(f for f in names if f.startswith(folder) and f.endswith(".parquet"))
    if not files:
        raise ValueError(f"{repo_id} has no parquet files in {folder or 'it'} at revision {revision}: {hint}")
    return files


def hub_source(repo_id: str, files: list, revision: str, download_dir: Path) -> Source:
    """Parquet files of a Hugging Face dataset repo, downloaded one at a time and deleted after."""
    from huggingface_hub import hf_hub_download

    def fetch(i):
        with on_the_hub(f"download {files[i]} of {repo_id}"):
            return Path(hf_hub_download(repo_id, files[i], repo_type="dataset", revision=revision,
                                        local_dir=download_dir))

    return Source(files, fetch, lambda i: (download_dir / files[i]).unlink(missing_ok=True),  # each once read
                  {"name": "huggingface hub", "repo": repo_id, "revision": revision, "files": len(files)})
