"""Tokenizers: characters (the vocabulary stored in meta.json) and GPT-2's BPE through tiktoken.

The GPT-2 vocabulary ships with the repo as data/gpt2.tiktoken (the file tiktoken calls
r50k_base, as the openai-whisper package carries it; MIT licence), checked by sha256. Without it,
it comes from a verified cache, tiktoken's own download, or the copy inside the openai-whisper
source package on the Python package index.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import tarfile
import tempfile
from pathlib import Path

from tqdm import tqdm

from data.dataset import GPT2_EOT, GPT2_VOCAB_SIZE
from data.files import atomic_write_bytes, cache_dir, check_sha256, pip_download, sha256_bytes

GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # = r50k_base
WHISPER_PACKAGE = "openai-whisper==20250625"  # its sdist ships the GPT-2 vocabulary
WHISPER_GPT2_MEMBER = "whisper/assets/gpt2.tiktoken"
REPO_COPY = Path(__file__).resolve().parent / "gpt2.tiktoken"


def gpt2_cache_path() -> Path:
    return cache_dir() / "gpt2.tiktoken"


def _ranks(data: bytes) -> dict:
    """gpt2.tiktoken's lines, "base64(token bytes) rank", as {token bytes: rank}."""
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in data.splitlines() if line)}


def _gpt2_from_bpe(data: bytes):
    """tiktoken's "gpt2" Encoding from verified gpt2.tiktoken bytes (what load_tiktoken_bpe parses)."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = _ranks(data)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB_SIZE)


def _gpt2_bpe_from_whisper() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        sdist = pip_download(["--no-binary", ":all:", WHISPER_PACKAGE], tmp)
        with tarfile.open(sdist, "r:gz") as tar:
            wanted = (m for m in tar if m.isfile() and m.name.split("/", 1)[-1] == WHISPER_GPT2_MEMBER)
            member = next(wanted, None)
            if member is None:
                raise RuntimeError(f"{sdist.name} holds no {WHISPER_GPT2_MEMBER}")
            data = tar.extractfile(member).read()
    check_sha256(data, GPT2_TIKTOKEN_SHA256, f"{WHISPER_GPT2_MEMBER} from {WHISPER_PACKAGE}")
    return data


def gpt2_encoding(bpe_file=None, verbose: bool = True):
    """The GPT-2 tokenizer as a tiktoken.Encoding equal to tiktoken.get_encoding("gpt2").

    Sources, in order: `bpe_file` or $GPT2_TIKTOKEN_FILE (a gpt2.tiktoken / r50k_base.tiktoken);
    the copy in this repo, data/gpt2.tiktoken; the verified copy in ~/.cache/gpt-train; tiktoken's
    own download; the copy inside the openai-whisper sdist on the package index. Local copies
    are checked by sha256 (a given file that fails is an error; the others are skipped).
    """
    origin = "--bpe_file" if bpe_file else "$GPT2_TIKTOKEN_FILE"
    bpe_file = bpe_file or os.environ.get("GPT2_TIKTOKEN_FILE")
    cache = gpt2_cache_path()
    local = {path: path.read_bytes() for path in (REPO_COPY, cache) if path.is_file()}
    verified = next((path for path, data in local.items() if sha256_bytes(data) == GPT2_TIKTOKEN_SHA256), None)
    if bpe_file:
        if not Path(bpe_file).is_file():  # (a pipe was "missing")
            what = "a folder" if Path(bpe_file).is_dir() else "not a file" if Path(bpe_file).exists() else "missing"
            raise ValueError(f"GPT-2 BPE file {bpe_file} (from {origin}) is {what}: point it at a gpt2.tiktoken "
                             f"file, or leave it out to use {REPO_COPY.name} in data/")
        data = Path(bpe_file).read_bytes()
        check_sha256(data, GPT2_TIKTOKEN_SHA256, f"{bpe_file} (from {origin}; should be GPT-2's gpt2.tiktoken = "
                     f"r50k_base)", f": point it at a gpt2.tiktoken file, or leave it out to use data/{REPO_COPY.name}")
        enc, how = _gpt2_from_bpe(data), f"local file {bpe_file}"
    elif verified is not None:
        enc, how = _gpt2_from_bpe(local[verified]), f"local file {verified}"
    else:
        for path in local:
            print(f"note: ignoring {path}: its sha256 is not GPT-2's", file=sys.stderr)  # (not sample.py's text)
        try:
            import tiktoken
            enc, how = tiktoken.get_encoding("gpt2"), "tiktoken"
        except Exception as e:  # noqa: BLE001 - offline, blocked, or a broken tiktoken cache
            print(f"tiktoken.get_encoding('gpt2') failed ({type(e).__name__}: {str(e)[:120]}); "
                  f"taking the vocabulary from the {WHISPER_PACKAGE} sdist", file=sys.stderr)
            data = _gpt2_bpe_from_whisper()
            try:
                atomic_write_bytes(cache, data)
                kept = f"cached in {cache}"
            except OSError as e:  # a read-only or full cache folder (a prepare's workers fetch it again, each)
                kept = f"not cached: {cache}: {e.strerror or e}"
            enc, how = _gpt2_from_bpe(data), f"{WHISPER_PACKAGE} sdist via pip download ({kept})"
    if enc.encode("hello world") != [31373, 995] or enc.n_vocab != GPT2_VOCAB_SIZE:
        raise RuntimeError(f"the GPT-2 encoding from {how} does not behave like GPT-2's")
    if verbose:
        print(f"gpt2 tokenizer: {how}", file=sys.stderr)  # a diagnostic, not sample text
    return enc


_PARAGRAPH_CUT = re.compile(r"(?<=\S\n)(?=\n\S)")  # between the newlines of "a\n\nB"


def encode_with_progress(enc, text: str, desc: str = "encoding", chunk_chars: int = 1 << 16) -> list:
    """enc.encode_ordinary(text), a chunk of paragraphs at a time, with a progress bar.

    Chunks end between the two newlines of "a\\n\\nB", where the GPT-2 pre-tokenizer
    splits anyway, so the ids are the same as encoding the whole text at once."""
    ids, start = [], 0
    with tqdm(total=len(text), desc=desc, unit="char", unit_scale=True, disable=None) as bar:
        while start < len(text):
            cut = _PARAGRAPH_CUT.search(text, start + chunk_chars)
            end = cut.start() if cut else len(text)
            ids += enc.encode_ordinary(text[start:end])
            bar.update(end - start)
            start = end
    return ids


def tokenizer_from_meta(meta: dict) -> tuple:
    """(encode, decode) for a dataset: encode(str) -> list[int], decode(list[int]) -> str. `meta` names
    char or gpt2 (load_meta and pretrained.load_model check it)."""
    if meta["tokenizer"] == "char":
        chars = meta["chars"]
        stoi = {c: i for i, c in enumerate(chars)}

        def encode(text: str) -> list:
            unknown = sorted(set(text) - stoi.keys())
            if unknown:
                raise ValueError(f"characters not in the vocabulary: {', '.join(map(repr, unknown))}")
            return [stoi[c] for c in text]

        def decode(ids) -> str:
            return "".join(chars[int(i)] for i in ids)

        return encode, decode
    enc = gpt2_encoding()
    return (lambda text: enc.encode(text, allowed_special={"<|endoftext|>"}),
            lambda ids: enc.decode([int(i) for i in ids]))


def _byte_to_char() -> dict:
    """GPT-2's printable stand-in for each byte in its vocabulary files: printable Latin-1 bytes
    stand for themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def write_gpt2_tokenizer_files(folder, model_max_length: int = 1024):
    """vocab.json, merges.txt and tokenizer_config.json: GPT-2's tokenizer as transformers reads
    it, made from data/gpt2.tiktoken. Each token of two or more bytes was made by one merge; it
    is found by running the merges ranked before the token on the token's own bytes."""
    if not REPO_COPY.is_file():
        raise ValueError(f"{REPO_COPY} is missing: restore it (git checkout data/{REPO_COPY.name})")
    data = REPO_COPY.read_bytes()
    check_sha256(data, GPT2_TIKTOKEN_SHA256, str(REPO_COPY))
    ranks = _ranks(data)
    to_char = _byte_to_char()
    text = lambda token: "".join(to_char[b] for b in token)
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:  # merge the lowest-ranked adjacent pair, as BPE does
            i = min(range(len(parts) - 1), key=lambda j: ranks.get(parts[j] + parts[j + 1], 1 << 30))
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        merges.append(f"{text(parts[0])} {text(parts[1])}")
    vocab = {**{text(token): rank for token, rank in ranks.items()}, "<|endoftext|>": GPT2_EOT}
    folder = Path(folder)
    atomic_write_bytes(folder / "vocab.json", json.dumps(vocab, ensure_ascii=False).encode())
    atomic_write_bytes(folder / "merges.txt", ("#version: 0.2\n" + "\n".join(merges) + "\n").encode())
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length, "add_prefix_space": False,
              "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    atomic_write_bytes(folder / "tokenizer_config.json", (json.dumps(config, indent=1) + "\n").encode())
