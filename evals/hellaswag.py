"""HellaSwag, scored completion-style as llm.c scores it: which of four endings does the model
find likeliest after the context?

The validation set (10,042 examples) is rowanz/hellaswag's data/hellaswag_val.jsonl: one JSON
object a line with `ctx` (the context), `endings` (four strings) and `label` (the right one's
index). Each example becomes four rows, the context's GPT-2 tokens followed by those of
" " + ending, and the model's loss is summed over the ending's tokens only. `acc` counts the
examples whose lowest summed loss is the label's; `acc_norm` those whose lowest mean loss per
ending token is (a long ending is not penalised for its length). This is llm.c's
dev/data/hellaswag.py; the Eleuther harness words the context differently and normalises by
characters, so its figures differ (docs/eval.md lists both for GPT-2).

Under several processes the examples are cut into fixed batches, dealt round-robin to the
ranks; each rank scores its batches and the counts are summed over ranks. A batch is the same
batch whatever the world size, so W processes give the numbers one process gives, in about
1/W of the time.
"""

import hashlib
import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from collectives import agree_or_raise, differs_from_rank0
from data.files import atomic_write_bytes, cache_dir, parse_json, why_unreadable
from errors import ConfigError, HellaSwagMissing, first_line

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
# rowanz/hellaswag publishes no sha256 of the file. What its repository does record is the
# file's git blob id (`git ls-tree` at its head, a29ff8e): sha1 over "blob SIZE\0" + the bytes,
# the hash git itself verifies. A download is checked against that.
GIT_BLOB_SHA1 = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"
ENDINGS = 4


def cache_path() -> Path:
    return cache_dir() / "hellaswag_val.jsonl"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def locate(path: str = "") -> Path:
    """The validation file: `path` when given, else the cached copy, else downloaded into the cache."""
    if path:
        if why := why_unreadable(path):
            raise ConfigError(f"HellaSwag file {path} {why}: give the path of a hellaswag_val.jsonl")
        return Path(path)
    cache = cache_path()
    if cache.is_file():
        return cache
    try:
        with urllib.request.urlopen(URL, timeout=30) as response:
            data = response.read()
        if git_blob_sha1(data) != GIT_BLOB_SHA1:
            raise ValueError(f"its git blob id {git_blob_sha1(data)} is not {GIT_BLOB_SHA1}")
    except Exception as e:  # noqa: BLE001 - offline, blocked, cut short, changed upstream
        raise HellaSwagMissing(cache, URL, e) from None
    try:
        atomic_write_bytes(cache, data)
    except OSError as e:  # a read-only or full cache folder
        raise HellaSwagMissing(cache, URL, e, downloaded=True) from None
    return cache


# -----------------------------------------------------------------------------
# the file: every line checked before any example is scored

def parse_line(line: str, where: str) -> tuple:
    """(ctx, endings, label) of one line of the official format, or a ConfigError naming it."""
    try:
        example = parse_json(line)
    except ValueError:
        raise ConfigError(f"{where} is not JSON: {line[:60]!r} (each line is one JSON object, as in the official "
                          f"hellaswag_val.jsonl)") from None
    if not isinstance(example, dict):
        raise ConfigError(f"{where} is not a JSON object with ctx, endings and label")
    missing = [key for key in ("ctx", "endings", "label") if key not in example]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}: each line needs ctx, endings and label, as "
                          f"in the official hellaswag_val.jsonl")
    ctx, endings, label = example["ctx"], example["endings"], example["label"]
    label = int(label) if label in ("0", "1", "2", "3") else label  # (Hugging Face's copy writes it as a string)
    if not isinstance(ctx, str) or not ctx.strip():
        raise ConfigError(f"{where}: ctx must be a non-empty string")
    if not isinstance(endings, list) or len(endings) != ENDINGS or not all(isinstance(e, str) for e in endings):
        got = (type(endings).__name__ if not isinstance(endings, list) else f"{len(endings)} items"
               if len(endings) != ENDINGS else next(f"{e!r} ({type(e).__name__})" for e in endings
                                                    if not isinstance(e, str)))
        raise ConfigError(f"{where}: endings must be a list of {ENDINGS} strings, got {got}")
    if type(label) is not int or not 0 <= label < ENDINGS:
        raise ConfigError(f"{where}: label must be 0, 1, 2 or 3, got {label!r}")
    return ctx, endings, label


def read_examples(path: Path, limit: int = 0) -> list:
    """(ctx, endings, label) of every example in the file (the first `limit` when limit > 0);
    the whole file is checked either way, so a bad line is found before anything is scored."""
    examples = []
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig")  # (-sig: a byte-order mark is no JSON)
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{path}, line {n} is not UTF-8 text ({e.reason} at byte {e.start} "
                                      f"of the line)") from None
                if line.strip():
                    examples.append(parse_line(line, f"{path}, line {n}"))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if not examples:
        raise ConfigError(f"{path} holds no examples: give hellaswag_val.jsonl, one JSON object a line")
    return examples[:limit] if limit > 0 else examples


# -----------------------------------------------------------------------------
# rendering and scoring

@dataclass
class Example:
    rows: list        # four token lists: the context, then one ending each
    start: int        # where the endings begin: the context's length
    label: int
    truncated: bool   # cut to fit block_size: the context lost tokens from its left (or an ending from its end)


def render(ctx: str, endings: list, label: int, encode, block_size: int) -> Example:
    """Tokens as llm.c renders them: encode(ctx), then encode(" " + ending) for each ending.
    A row is block_size + 1 tokens at most (the model reads all but its last, as a training
    window). A context too long for that loses its oldest tokens, like a model reading a stream;
    one is always kept (it predicts the ending's first token), and an ending that still does
    not fit is cut at its end."""
    context = encode(ctx)
    ends = [encode(" " + e) for e in endings]
    keep = max(1, block_size + 1 - max(map(len, ends)))
    truncated = len(context) > keep or max(map(len, ends)) > block_size  # (the ending: with one context token)
    context = context[-keep:]
    ends = [e[:block_size + 1 - len(context)] for e in ends]
    return Example([context + e for e in ends], len(context), label, truncated)


def check_tokenizer(meta: dict, what: str, instead: str):
    """HellaSwag is English prose, scored in GPT-2 BPE tokens: a character-level model is refused."""
    if meta.get("tokenizer") != "gpt2":
        raise ConfigError(f"HellaSwag needs a model of GPT-2 BPE tokens, but {what} reads "
                          f"{meta.get('tokenizer')!r} tokens: {instead}, or use a model trained on shakespeare, "
                          f"fineweb or openwebtext, or GPT-2's weights (init_from=gpt2)")


def load(path: str, block_size: int, limit: int = 0) -> list:
    """The examples of the validation file (`path`, or the cached or downloaded copy), rendered."""
    if block_size < 2:  # one context token and one ending token, or no ending is scored at all
        raise ConfigError(f"HellaSwag needs a block_size of at least 2, not {block_size}")
    from data.tokenizers import gpt2_encoding
    try:
        enc = gpt2_encoding(verbose=False)
    except (OSError, ValueError, RuntimeError) as e:  # a bad $GPT2_TIKTOKEN_FILE; no copy and no network
        raise ConfigError(f"HellaSwag needs GPT-2's tokenizer: {first_line(e, 1000)}") from None
    return [render(*example, enc.encode_ordinary, block_size) for example in read_examples(locate(path), limit)]


def load_on_every_rank(path: str, meta: dict, block_size: int, world, limit: int = 0) -> list:
    """load() on every rank (each host reads its own copy); any rank's problem stops them all
    with its message, instead of leaving the others waiting in the first evaluation."""
    examples, error = None, None
    try:
        check_tokenizer(meta, "this model", "train with --hellaswag_interval=0")
        examples = load(path, block_size, limit)
    except ConfigError as e:
        error = str(e)
    agree_or_raise(error, world)
    same_on_every_rank(examples, world, "hellaswag_path")
    return examples


def same_on_every_rank(examples: list, world, setting: str):
    """Stop every rank, with one line, unless each rank's examples are rank 0's: each host reads its
    own copy, and a shorter or other one would score other examples, summed into neither's score."""
    if world.size == 1:  # (no start-up cost alone: the digest reads every token)
        return
    digest = hashlib.sha256(json.dumps([(ex.rows, ex.label) for ex in examples]).encode()).hexdigest()[:16]
    agree_or_raise(differs_from_rank0({"examples": digest}, world, what=f"HellaSwag file (each host's {setting})"),
                   world)


@torch.no_grad()
def score(model, examples: list, device, autocast) -> tuple:
    """For examples scored in one forward: each one's ending of lowest summed loss, and of
    lowest mean loss per token (two lists of indices into its endings; -1 where a loss is NaN or inf)."""
    rows = [row for ex in examples for row in ex.rows]
    starts = [ex.start for ex in examples for _ in ex.rows]
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)  # right-padded: causal attention
    scored = torch.zeros(len(rows), width, dtype=torch.bool)  # never lets padding reach a real token
    for i, (row, start) in enumerate(zip(rows, starts)):
        tokens[i, :len(row)] = torch.tensor(row)
        scored[i, start:len(row)] = True
    tokens, scored = tokens.to(device), scored.to(device)
    x = tokens[:, :-1]                                          # (4E, T-1)
    y = torch.where(scored[:, 1:], tokens[:, 1:], -1)           # the ending's tokens; -1 elsewhere
    with autocast:
        logits, _ = model(x, y)                                 # (4E, T-1, V): targets give every position
    ending = y >= 0
    losses = torch.zeros(y.shape, device=device)                # (4E, T-1): the endings' token losses
    losses[ending] = F.cross_entropy(logits[ending].float(), y[ending], reduction="none")
    total = losses.sum(1).view(-1, ENDINGS)                     # (E, 4)
    mean = total / ending.sum(1).view(-1, ENDINGS)
    finite = total.isfinite().all(1)  # (NaN's argmin is ending 0: a diverged model scored 1 in 4): -1, refused
    return total.argmin(1).where(finite, -1).tolist(), mean.argmin(1).where(finite, -1).tolist()


@dataclass
class Score:
    correct: int
    correct_norm: int
    examples: int
    truncated: int
    not_finite: int  # examples whose losses are NaN or inf (a diverged model, a float16 overflow): a caller stops

    @property
    def acc(self) -> float:
        return self.correct / self.examples

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.examples

    def line(self) -> str:
        return f"hellaswag: acc {self.acc:.4f} acc_norm {self.acc_norm:.4f} over {self.examples} examples"


def evaluate(model, examples: list, world, autocast, batch_size: int, same_forwards: bool = False,
             progress: bool = False) -> tuple:
    """(Score over all ranks, the same on every rank; this rank's picks {example index: (by sum,
    by mean)}). Every rank calls it; a forward scores batch_size sequences (at least one example's
    four). `same_forwards` (FSDP, which gathers weights in every forward): a rank with fewer
    batches scores spare ones, counted nowhere, to keep in step."""
    per_batch = max(1, batch_size // ENDINGS)
    batches = [range(i, min(i + per_batch, len(examples))) for i in range(0, len(examples), per_batch)]
    mine = batches[world.rank::world.size]
    forwards = len(batches[::world.size]) if same_forwards else len(mine)  # rank 0 has the most
    was_training = model.training
    model.eval()
    picks = {}
    progress = progress and sys.stderr is not None and sys.stderr.isatty()  # (a bar into a full disk ended it)
    for b in tqdm(range(forwards), desc="hellaswag", unit="batch", disable=not progress):
        batch = mine[b] if b < len(mine) else batches[0]
        by_sum, by_mean = score(model, [examples[i] for i in batch], world.device, autocast)
        if b < len(mine):
            picks.update({i: (s, m) for i, s, m in zip(batch, by_sum, by_mean)})
    model.train(was_training)
    counts = torch.tensor([sum(examples[i].label == s for i, (s, _) in picks.items()),
                           sum(examples[i].label == m for i, (_, m) in picks.items()),
                           len(picks), sum(examples[i].truncated for i in picks),
                           sum(s < 0 for s, _ in picks.values())], dtype=torch.int64)
    if world.size > 1:  # integer counts on the CPU: world.group is gloo also under NCCL
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=world.group)
    return Score(*counts.tolist()), picks
