"""Training configuration: the defaults (Config), plain-Python config files of `name = value`
lines, run in a namespace of their own, then --name=value overrides, each checked against its
field's type; an unknown name suggests the nearest known one (docs/config.md)."""

import ast
import dataclasses
import difflib
import os
import traceback
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from errors import ConfigError, first_line


@dataclass
class Config:
    # I/O
    out_dir: str = "out"                    # checkpoints, config.json, metrics.jsonl
    dataset: str = "shakespeare_char"       # a folder under data/ with a prepare.py
    data_dir: str = ""                      # where train.bin/val.bin/meta.json live; "" = data/<dataset>
    prepare_input: str = ""                 # a local text file for prepare.py instead of a download
    init_from: str = "scratch"              # weights when nothing is resumed: "scratch", "resume" (a checkpoint
                                            # must exist), gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a folder
    resume: str = "auto"                    # continue a checkpoint: "auto" (the newest in out_dir, either format),
                                            # "never", or a path (a .pt file or a .dcp folder)
    checkpoint_format: str = "file"         # "file": one .pt written by rank 0; "sharded": a .dcp folder (DCP)
                                            # every rank writes its shards into (storage every rank sees)
    async_checkpoint: bool = False          # sharded: write the checkpoint in the background while training goes on
    eval_interval: int = 250                # optimizer steps between evals (and checkpoints)
    eval_iters: int = 20                    # eval windows per split = eval_iters x global_batch_size
    log_interval: int = 10                  # optimizer steps between train-loss logs
    always_save_checkpoint: bool = True     # write last at every eval, not only when val improves
    hellaswag_interval: int = 0             # optimizer steps between HellaSwag evals (and at the end); 0 = off
    hellaswag_path: str = ""                # a local hellaswag_val.jsonl; "" = the cached (or downloaded) copy
    seed: int = 1337                        # one seed; data order, init and each rank's dropout derive from it
    # model (vocab_size comes from the dataset's meta.json)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = True
    pad_vocab_to: int = 1                   # round the vocabulary rows up to a multiple (64 on GPUs)
    batch_size: int = 16                    # one process's micro-batch
    global_batch_size: int = 32             # sequences in one optimizer step, over all processes
    # optimizer and schedule
    learning_rate: float = 1e-3
    max_iters: int = 1500                   # optimizer steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0                  # max global grad norm; 0 turns clipping off
    decay_lr: bool = True                   # linear warmup then cosine decay to min_lr
    warmup_iters: int = 100
    lr_decay_iters: Optional[int] = None    # None = max_iters
    min_lr: Optional[float] = None          # None = learning_rate / 10
    # system
    device: str = "auto"                    # "auto", "cpu", "cuda", "cuda:N", "mps"
    backend: str = "auto"                   # "auto" (nccl on CUDA, else gloo), "gloo", "nccl", "mpi"
    dtype: str = "auto"                     # "auto", "float32", "bfloat16", "float16"
    compile: bool = False                   # torch.compile the model
    strategy: str = "ddp"                   # "ddp" (a whole copy per rank) or "fsdp" (FSDP2, sharded)
    fsdp_reshard: bool = True               # fsdp: free gathered weights after forward (ZeRO-3), or keep them
    fsdp_shard_size: int = 0                # fsdp: shard over groups of this many ranks, replicate across
                                            # them (HSDP: a group per host); 0 = shard over all ranks
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    dist_timeout: float = 600.0             # seconds a collective may wait for a peer
    peak_flops: float = 0.0                 # device peak FLOP/s for MFU; 0 = model.py's table
    # logging
    wandb_log: bool = False
    wandb_project: str = "gpt-train"
    wandb_run_name: str = ""                # "" = derived from out_dir

    @property
    def tokens_per_step(self) -> int:  # in one optimizer step, over all processes
        return self.global_batch_size * self.block_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def defaults(cls) -> str:
        """Every name and its default, as --name=value lines (train.py --help)."""
        return "Config names and their defaults (docs/config.md explains each):\n" + "\n".join(
            f"  --{k}={v if isinstance(v, str) else repr(v)}" for k, v in cls().to_dict().items())

    def model_args(self, vocab_size: int) -> dict:
        """GPTConfig's fields for a model of this shape on a vocabulary of vocab_size tokens."""
        return dict(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, bias=self.bias, dropout=self.dropout,
                    block_size=self.block_size, vocab_size=vocab_size, pad_vocab_to=self.pad_vocab_to)


REPO = Path(__file__).resolve().parent  # configs/, data/
FIELD_TYPES = typing.get_type_hints(Config)
PER_HOST = ("out_dir", "data_dir", "prepare_input", "hellaswag_path", "device")  # may differ between ranks
LAUNCHERS = ("nproc", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "standalone", "rdzv_id",
             "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "max_restarts", "monitor_interval", "start_method",
             "log_dir", "redirects", "tee", "rank", "world_size", "local_world_size")  # (torchrun's options, ranks)
ELSEWHERE = {  # names the launchers or nanoGPT take, and what does their job here
    **dict.fromkeys(LAUNCHERS, "it is a launcher's option: for N processes run python train_spawn.py --nproc=N ... "
                    "or torchrun --nproc_per_node=N train.py ..."),
    "gradient_accumulation_steps": "give global_batch_size = batch_size x nanoGPT's gradient_accumulation_steps "
                                   "instead (sequences per optimizer step, over all processes)",
    "eval_only": "python eval.py --out_dir=OUT_DIR --dataset=NAME evaluates a run's checkpoint (GPT-2 BPE), and "
                 "max_iters=0 evaluates init_from's weights (as configs/eval_gpt2.py does)",
    "vocab_size": "the dataset's meta.json sets it (pad_vocab_to rounds it up)",
}
CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "backend": ("auto", "gloo", "nccl", "mpi"),
    "strategy": ("ddp", "fsdp"),
    "checkpoint_format": ("file", "sharded"),
}


def _show(value) -> str:  # at most 80 characters
    try:
        text = repr(value)
    except ValueError:  # an integer of over 4,300 digits, or a list or dict holding one
        text = f"an integer of {value.bit_length()} bits" if isinstance(value, int) else f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:75] + "[...]"


def _allowed(name: str) -> tuple:
    """The types field `name` takes (Optional[int]: int, NoneType); an unknown name suggests the nearest."""
    if name not in FIELD_TYPES:
        close = difflib.get_close_matches(name, list(FIELD_TYPES), n=1, cutoff=0.6)  # (0.5: nproc, wandb_project)
        hint = ELSEWHERE.get(name.replace("-", "_")) or ELSEWHERE["gradient_accumulation_steps"] * ("accum" in name) \
            or (f"did you mean '{close[0]}'?" if close else "see docs/config.md")  # (grad_accum: not grad_clip)
        raise ConfigError(f"unknown config name {_show(name)}: {hint}")
    return typing.get_args(FIELD_TYPES[name]) or (FIELD_TYPES[name],)


def check_type(name: str, value):
    """Return `value` as the type of field `name`, or raise ConfigError."""
    options = _allowed(name)
    for allowed in options:
        if isinstance(value, bool) != (allowed is bool):  # bool is an int subclass: only bool fields take it
            continue
        if allowed is float and isinstance(value, (int, float)):
            if not (-1e308 < value < 1e308):  # inf, nan, or an int too big for a float
                raise ConfigError(f"config '{name}' must be a finite number, got {_show(value)}")
            return float(value)
        if allowed is int and isinstance(value, int) and not -2**63 <= value < 2**63:
            raise ConfigError(f"config '{name}' must be an integer from -2**63 to 2**63 - 1, got {_show(value)}")
        if isinstance(value, allowed):  # (an Optional field's NoneType takes None)
            return value
    one_of = " or ".join("None" if t is type(None) else t.__name__ for t in options)
    raise ConfigError(f"config '{name}' must be {one_of}, got {_show(value)} ({type(value).__name__})")


def parse_value(name: str, text: str):
    """Turn the text of a --name=value override into a typed value."""
    allowed = _allowed(name)
    if bool in allowed and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        value = text  # bare words are strings: --dataset=shakespeare_char
        if float in allowed and text.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
            value = float(text)  # refused below as not finite, not as a string
    if str in allowed and not isinstance(value, str):
        value = text  # a string field takes the raw text: --out_dir=2024
    return check_type(name, value)


def load_file(path: str) -> dict:
    """Run a config file in a private namespace and return its public names."""
    try:
        source = Path(path).read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is no syntax error
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        shipped = REPO / "configs"  # (nanoGPT's are in config/, and named otherwise)
        names = ", ".join(sorted(p.name for p in shipped.glob("*.py")))
        hint = f" ({shipped} holds the shipped ones: {names})" if isinstance(e, FileNotFoundError) else ""
        raise ConfigError(f"cannot read config file {path}: {e.strerror}{hint}") from None
    namespace: dict = {"__file__": os.path.abspath(path)}  # (as under python: os.path.dirname(__file__))
    try:
        exec(compile(source, path, "exec"), namespace)
    except SyntaxError as e:
        raise ConfigError(f"{path}{f', line {e.lineno}' if e.lineno else ''}: syntax error: {e.msg}") from None
    except (Exception, SystemExit) as e:  # a config file may not end the program
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        where = f"{path}, line {lines[-1]}" if lines else path
        own = " (a config file sees only the names it sets: not the defaults, nor another file's)"
        raise ConfigError(f"{where}: {type(e).__name__}: {first_line(e)}{own * isinstance(e, NameError)}") from None
    return {k: v for k, v in namespace.items()  # (import os, from math import exp: no config value is callable)
            if not k.startswith("_") and not (isinstance(v, types.ModuleType) or callable(v))}


def validate(cfg: Config) -> Config:
    """Range checks that do not depend on the world size or the device (world.setup checks
    global_batch_size against batch_size x world size once it knows the world)."""
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "global_batch_size",
                 "eval_interval", "eval_iters", "log_interval", "pad_vocab_to"):
        need(getattr(cfg, name) > 0, f"{name} must be positive, got {getattr(cfg, name)}")
    for name in ("max_iters", "warmup_iters", "weight_decay", "grad_clip", "hellaswag_interval", "seed", "peak_flops"):
        need(getattr(cfg, name) >= 0, f"{name} must be >= 0, got {getattr(cfg, name)}")
    need(cfg.n_embd % cfg.n_head == 0,
         f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    need(0 <= cfg.dropout < 1, f"dropout must be in [0, 1), got {cfg.dropout}")
    need(cfg.learning_rate > 0, f"learning_rate must be a positive number, got {cfg.learning_rate}")
    need(cfg.min_lr is None or 0 <= cfg.min_lr <= cfg.learning_rate,
         f"min_lr must be in [0, learning_rate={cfg.learning_rate}], got {cfg.min_lr}")
    need(cfg.lr_decay_iters is None or cfg.lr_decay_iters >= max(1, cfg.warmup_iters),  # (None: max_iters)
         f"lr_decay_iters must be None or at least warmup_iters ({cfg.warmup_iters}) and 1, got {cfg.lr_decay_iters}")
    need(0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1,
         f"beta1 and beta2 must be in [0, 1), got {cfg.beta1} and {cfg.beta2}")
    need(1 <= cfg.dist_timeout <= 1e6, f"dist_timeout must be positive seconds, 1 to 1e6 (11 days), "
                                       f"got {cfg.dist_timeout}")  # (under 1 ms, torch's store waits 0 ms)
    need(cfg.pad_vocab_to <= 2**16, f"pad_vocab_to rounds the vocabulary up to a multiple of it (64 on GPUs): "
                                    f"at most 65,536, got {cfg.pad_vocab_to}")
    need(cfg.fsdp_shard_size >= 0, f"fsdp_shard_size must be >= 0 (0 = all ranks), got {cfg.fsdp_shard_size}")
    need(cfg.fsdp_shard_size == 0 or cfg.strategy == "fsdp",
         f"fsdp_shard_size={cfg.fsdp_shard_size} shards the model: it needs --strategy=fsdp")
    need(cfg.fsdp_reshard or cfg.strategy == "fsdp", "fsdp_reshard=False keeps FSDP's gathered weights from forward "
         "to backward: it needs --strategy=fsdp")
    for name, choices in CHOICES.items():
        need(getattr(cfg, name) in choices, f"{name} must be one of {choices}, got {getattr(cfg, name)!r}")
    need(cfg.resume in ("auto", "never") or Path(cfg.resume).suffix in (".pt", ".dcp"),
         f"resume must be 'auto', 'never' or a path to a .pt file or .dcp folder, got {cfg.resume!r}")
    need(not cfg.async_checkpoint or cfg.checkpoint_format == "sharded",
         "async_checkpoint writes in the background through torch.distributed.checkpoint: it needs "
         "--checkpoint_format=sharded")
    need(not (cfg.init_from == "resume" and cfg.resume == "never"),
         "init_from='resume' needs a checkpoint but resume='never' forbids one: use --resume=auto "
         "(out_dir/last.pt) or --resume=PATH.pt, or --init_from=scratch")
    need(bool(cfg.out_dir), "out_dir must not be empty")
    for name in ("out_dir", "dataset", "data_dir", "prepare_input", "init_from", "resume", "hellaswag_path"):
        setattr(cfg, name, os.path.expanduser(getattr(cfg, name)))  # (--out_dir=~/x: a shell leaves that ~)
        try:
            path = os.fsencode(getattr(cfg, name))  # (the bytes the file system is given)
        except UnicodeEncodeError:  # a lone surrogate (a config file's "\ud800"): no bytes at all
            path = b"\0"
        room = 4096 - 64 * (name in ("out_dir", "data_dir"))  # (the names written inside: up to 64 bytes)
        need(b"\0" not in path and len(path) < room and all(len(part) <= 255 for part in path.split(b"/")),
             f"{name} is not a path a file system takes (a NUL byte, a name over 255 bytes or a path over {room}"
             f"{' with the names written in it' * (room < 4096)}): {_show(getattr(cfg, name))}")
    return cfg


def resolve(args: list[str]) -> Config:
    """Apply config files and --name=value overrides, in the order given, to the defaults."""
    values: dict = {}
    for arg in args:
        if arg.startswith("--"):
            name, eq, text = arg[2:].partition("=")
            if not eq and (name in FIELD_TYPES or not name):  # (an unknown name is said to be one, below)
                raise ConfigError(f"'{arg}': write overrides as --{name or 'name'}=VALUE")
            values[name] = parse_value(name, text)
        elif arg.endswith(".py"):
            for name, value in load_file(arg).items():
                try:
                    values[name] = check_type(name, value)
                except ConfigError as e:  # (of several files given, say which)
                    # (not for nanoGPT's names whose job is done elsewhere: as helpers they would be dropped silently)
                    own = " (or start a helper name of the file's own with _)" * (
                        name not in FIELD_TYPES and (name in LAUNCHERS or name not in ELSEWHERE))
                    raise ConfigError(f"{arg}: {e}{own}") from None
        else:
            raise ConfigError(f"'{arg}' is neither a config file (.py) nor a --name=value override")
    return validate(Config(**values))
