"""Config, command-line and data mistakes: exit status 2 and one line saying what to do, the same
on every rank, before the process group forms, with no traceback and no file touched.

Each case runs train.cli as rank 0 and as rank 1 of a two-process world whose other rank never
starts: an error raised after the process group began to form would instead wait out
dist_timeout and end as a failed rendezvous (exit 1), so these tests also show where it fires.
"""

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import errors
import pretrained
import world
import train
from config import Config, resolve
from harness import REPO, child_env, free_port, mounted, python, raising, ranks_say, tiny_args, train_py, without_log


@pytest.fixture
def copies(char_data, trained_copy, tmp_path):
    """A data folder and an out folder (with last.pt) of our own, free to damage."""
    shutil.copytree(char_data, tmp_path / "data")
    return tmp_path / "data", trained_copy


def nothing_written(out_dir) -> bool:
    """No checkpoint, config or metrics: at most the run.lock rank 0 took before the checks."""
    return not out_dir.exists() or [p.name for p in out_dir.iterdir()] == ["run.lock"]


def snapshot(*folders) -> dict:
    """Every file's hash; run.lock is left out: it names the last run that held out_dir, not data."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "run.lock"}


def run_cli(args, monkeypatch, capsys, rank=0, world_size=1, port=None):
    if world_size > 1:
        for name, value in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world_size,
                                LOCAL_WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=port).items():
            monkeypatch.setenv(name, str(value))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.cli(args)
    return exit_info.value.code, capsys.readouterr().err


# ----------------------------------------------------------------------------- damage to data

def rewrite_meta(data, **changes):
    meta = json.loads((data / "meta.json").read_text())
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del meta[key]
    (data / "meta.json").write_text(json.dumps(meta))


def put_token(data, split, position, value):
    tokens = np.memmap(data / f"{split}.bin", dtype=np.uint16, mode="r+")
    tokens[position] = value
    tokens.flush()


def append_bytes(data, split, extra: bytes):
    with open(data / f"{split}.bin", "ab") as f:
        f.write(extra)


def other_vocabulary(data):
    from data.shakespeare_char.prepare import prepare
    text = data.parent / "abc.txt"
    text.write_text("abc cab bac\n" * 2000)
    prepare(out_dir=str(data), input_path=str(text))


def case_insensitive_disk(data, monkeypatch):
    """No dataset, and a disk where data/Shakespeare_char/prepare.py exists (macOS's, Windows'): import refuses it."""
    shutil.rmtree(data)
    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p, **kw: exists(Path(str(p).replace("Shakes", "shakes")), **kw))


def nanogpt_files_in_repo_data(data, monkeypatch):
    """data as data/shakespeare_char of a repo of its own, holding train.bin and val.bin only."""
    import loader
    (data / "meta.json").unlink()
    (data.parent / "repo" / "data").mkdir(parents=True)
    (data.parent / "repo" / "data" / "shakespeare_char").symlink_to(data)
    monkeypatch.setattr(loader, "REPO", data.parent / "repo")


def config_file_that_raises(data):
    path = data.parent / "raises.py"
    path.write_text("def heads():\n    return 1 / 0\nn_layer = 2\nn_head = heads()\n")  # (the line that raised)
    return [str(path)]


def config_file_with_a_syntax_error(data):
    path = data.parent / "syntax.py"
    path.write_text("n_layer = = 2\n")
    return [str(path)]


def config_file_with_a_nul_byte(data):
    path = data.parent / "nul.py"
    path.write_text("n_layer = 2\0\n")
    return [str(path)]


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


def two_gpus(data, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def cuda_without_bfloat16(data, monkeypatch):
    two_gpus(data, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)


def test_a_gpu_that_would_emulate_bfloat16_gets_float16(monkeypatch):
    """torch's is_bf16_supported() is True on any CUDA GPU (a V100's or T4's bfloat16 is emulated: slow), so auto
    picked it there and --dtype=bfloat16 was never refused; it also made a tensor, a launcher's parent's GPU context."""
    from types import SimpleNamespace
    for name, value in (("is_available", lambda: True), ("current_device", lambda: 0),
                        ("_check_bf16_tensor_supported", lambda device: True)):
        monkeypatch.setattr(torch.cuda, name, value)
    cuda = torch.device("cuda", 0)
    for major, dtype in ((7, torch.float16), (8, torch.bfloat16)):  # a V100, an A100
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, major=major: SimpleNamespace(
            major=major, minor=0))
        assert world.pick_dtype("auto", cuda) == dtype
        if major == 7:
            with pytest.raises(errors.ConfigError, match="this GPU cannot run bfloat16: use --dtype=float16"):
                world.pick_dtype("bfloat16", cuda)


def dtype_autocast_cannot_run(data, monkeypatch):
    # CPU autocast does not do float64: it warns and turns itself off, as autocast does on
    # a device without bfloat16 (older Macs)
    monkeypatch.setitem(world.DTYPES, "bfloat16", torch.float64)


# (id, extra args or a function of the data folder returning them, a damage(data, monkeypatch)
#  to the data folder or to the environment, the expected message)
CASES = [
    ("unknown name", ["--n_layers=3"], None, r"unknown config name 'n_layers': did you mean 'n_layer'\?"),
    ("wrong type", ["--batch_size=4.0"], None, r"config 'batch_size' must be int, got 4\.0 \(float\)"),
    ("unparseable value", ["--learning_rate=3e-3e"], None,
     r"config 'learning_rate' must be float, got '3e-3e' \(str\)"),
    ("unparseable bool", ["--compile=yes"], None, r"config 'compile' must be bool, got 'yes'"),
    ("override without a value", ["--n_layer"], None, r"write overrides as --n_layer=VALUE"),
    ("a bare --", ["--"], None, r"'--': write overrides as --name=VALUE"),
    ("neither file nor override", ["n_layer=3"], None, r"neither a config file \(\.py\) nor"),
    ("legacy --local_rank without a number", ["--local_rank"], None,
     r"--local_rank needs a number, e\.g\. --local_rank=0, got ''"),
    ("missing config file", ["no/such/config.py"], None,
     r"cannot read config file no/such/config\.py: No such file or directory \(\S+/configs holds the shipped ones: "
     r"eval_gpt2\.py, .*, shakespeare_char\.py\)"),  # (nanoGPT's are config/train_*.py)
    ("config file that raises", config_file_that_raises, None,
     r"raises\.py, line 2: ZeroDivisionError: division by zero"),
    ("config file syntax error", config_file_with_a_syntax_error, None, r"syntax\.py, line 1: syntax error"),
    ("config file with a NUL byte", config_file_with_a_nul_byte, None,
     r"nul\.py: syntax error: source code string cannot contain null bytes"),  # no "line None"
    ("config file raising a message of two lines", lambda d: [str(write_bytes(d.parent / "two.py",
                                                                            b'raise ValueError("\\none\\ntwo")'))],
     None, r"two\.py, line 1: ValueError: one\n"),
    ("a name too long for a file system", ["--out_dir=" + "x" * 256], None,
     r"out_dir is not a path a file system takes \(a NUL byte, a name over 255 bytes or a path over 4032 with the "
     r"names written in it\)"),
    ("a NUL byte in a path", ['--resume="last\\x00.pt"'], None, r"resume is not a path a file system takes"),
    ("a lone surrogate in a path", lambda d: [str(write_bytes(d.parent / "surrogate.py", b'out_dir = "\\ud800"'))],
     None, r"out_dir is not a path a file system takes"),
    ("n_embd and n_head", ["--n_embd=33"], None, r"n_embd \(33\) must be divisible by n_head \(2\)"),
    ("zero layers", ["--n_layer=0"], None, r"n_layer must be positive, got 0"),
    ("negative batch", ["--batch_size=-4"], None, r"batch_size must be positive, got -4"),
    ("zero learning rate", ["--learning_rate=0"], None, r"learning_rate must be a positive number, got 0"),
    ("negative learning rate", ["--learning_rate=-1e-3"], None,
     r"learning_rate must be a positive number, got -0\.001"),
    ("infinite number", ["--learning_rate=1e999"], None, r"'learning_rate' must be a finite number, got inf"),
    ("negative infinity", ["--learning_rate=-inf"], None, r"'learning_rate' must be a finite number, got -inf"),
    ("signed NaN", ["--min_lr=+nan"], None, r"'min_lr' must be a finite number, got nan"),
    ("negative seed", ["--seed=-1"], None, r"seed must be >= 0, got -1"),
    ("integer past 64 bits", ["--seed=99999999999999999999999"], None,
     r"config 'seed' must be an integer from -2\*\*63 to 2\*\*63 - 1, got 99999999999999999999999$"),
    ("integer just past 64 bits", ["--seed=9223372036854775808"], None,  # (it said: "got an integer of 64 bits")
     r"config 'seed' must be an integer from -2\*\*63 to 2\*\*63 - 1, got 9223372036854775808$"),
    ("timeout past 1e6 s", ["--dist_timeout=1e10"], None, r"dist_timeout must be positive seconds, 1 to 1e6"),
    ("config file not UTF-8", lambda d: [str(write_bytes(d.parent / "latin1.py", b"n_layer = 1\n# caf\xe9\n"))],
     None, r"config file .*latin1\.py is not UTF-8 text \(invalid continuation byte at byte 17\)"),
    ("config file of a huge integer", lambda d: [str(write_bytes(d.parent / "big.py", b"seed = 10**10000\n"))],
     None, r"config 'seed' must be an integer from -2\*\*63 to 2\*\*63 - 1, got an integer of 33220 bits"),
    ("a huge integer for a float", lambda d: [str(write_bytes(d.parent / "big.py", b"learning_rate = 10**5000\n"))],
     None, r"'learning_rate' must be a finite number, got an integer of 16610 bits$"),  # (repr raised: a traceback)
    ("a huge integer in a list", lambda d: [str(write_bytes(d.parent / "big.py", b"learning_rate = [10**5000]\n"))],
     None, r"'learning_rate' must be float, got a list \(list\)$"),  # (the fallback raised AttributeError)
    ("a huge micro-batch", ["--batch_size=10000000000", "--global_batch_size=10000000001"], None,  # (it spun for hours)
     r"try --global_batch_size=20000000000 \(a resume must keep 10000000001: launch it on 1 process with "
     r"--batch_size=357641, or another"),  # (where batch_size would not split it either: it said 1 process alone)
    ("global batch vs micro-batch", ["--global_batch_size=10", "--batch_size=3"], None,
     r"global_batch_size \(10\) must be divisible by batch_size \(3\) x world size \(2\) = 6: "
     r"try --global_batch_size=12"),
    ("global batch vs world size", ["--global_batch_size=12"], None,
     r"global_batch_size \(12\) must be divisible by batch_size \(4\) x world size \(2\) = 8: "
     r"try --global_batch_size=16, or --batch_size=3, which keeps the global batch \(a resume must\)$"),
    ("block_size longer than val", ["--block_size=7000"], None,
     r"block_size \(7000\) is too long for the val split of .* \(6,002 tokens; it needs 7,001\)"),
    ("block_size too long for train", [],  # a window may start at any offset: two blocks at least
     lambda d, m: (os.truncate(d / "train.bin", 2 * 31), rewrite_meta(d, train_tokens=31)),
     r"block_size \(16\) is too long for the train split of .* \(31 tokens; it needs 32\)"),
    ("block_size 1 too long for val", ["--block_size=1"],  # (it also said "or a model of a smaller block_size")
     lambda d, m: (os.truncate(d / "val.bin", 2 * 1), rewrite_meta(d, val_tokens=1)),
     r"block_size \(1\) is too long for the val split of .* \(1 tokens; it needs 2\): use more data$"),
    ("an empty val split", [],  # (not "cannot mmap an empty file", naming no file)
     lambda d, m: (os.truncate(d / "val.bin", 0), rewrite_meta(d, val_tokens=0)),
     r"block_size \(16\) is too long for the val split of .* \(0 tokens; it needs 17\)"),
    ("resume required and forbidden", ["--init_from=resume", "--resume=never"], None,
     r"init_from='resume' needs a checkpoint but resume='never' forbids one"),
    ("unknown dtype", ["--dtype=float8"], None, r"dtype must be one of .*got 'float8'"),
    ("dtype the GPU cannot run", ["--device=cuda", "--dtype=bfloat16"], cuda_without_bfloat16,
     r"this GPU cannot run bfloat16: use --dtype=float16"),
    ("dtype autocast cannot run", ["--dtype=bfloat16"], dtype_autocast_cannot_run,
     r"dtype=bfloat16 cannot run on cpu here"),
    ("no CUDA", ["--device=cuda"], lambda d, m: m.setattr(torch.cuda, "is_available", lambda: False),
     r"device=cuda but CUDA is not available here: use --device=cpu"),
    ("unknown device", ["--device=tpu"], None, r"device 'tpu' is not one this trainer runs on"),
    ("GPU index past this host's", ["--device=cuda:2"], two_gpus,  # (cuda:0 and cuda:1 exist)
     r"device cuda:2 does not exist here: this host has 2 GPUs; run at most 2 processes on it"),
    ("unknown backend", ["--backend=tcp"], None, r"backend must be one of .*got 'tcp'"),
    ("backend missing from this build", ["--backend=mpi"], None,
     r"backend 'mpi' is not available in this torch build: use gloo"),
    ("nccl on CPU", ["--backend=nccl"], lambda d, m: m.setattr(world.dist, "is_backend_available", lambda b: True),
     r"backend nccl needs CUDA devices: use --backend=gloo on CPU"),  # (a CPU build of torch has no nccl at all)
    ("no MPS", ["--device=mps"], lambda d, m: m.setattr(torch.backends.mps, "is_available", lambda: False),
     r"device=mps but MPS is not available here: use --device=cpu"),
    # data
    ("no data and no prepare script", ["--dataset=nosuch"], lambda d, m: shutil.rmtree(d),
     r"no dataset in .*data \(meta\.json missing\), and dataset='nosuch' names no data/NAME/prepare\.py"),
    ("dataset given as a path", ["--dataset=shakespeare_char/"], lambda d, m: shutil.rmtree(d),
     r"dataset='shakespeare_char/' names no data/NAME/prepare\.py to prepare it"),
    ("dataset in another letter case", ["--dataset=Shakespeare_char"], case_insensitive_disk,  # (a traceback)
     r"dataset='Shakespeare_char' names no data/NAME/prepare\.py to prepare it"),
    ("nanoGPT's data folder", [], lambda d, m: (d / "meta.json").unlink(),
     r"data holds train\.bin and val\.bin but no meta\.json: train\.py will not prepare over them"),
    ("nanoGPT's files in data/DATASET", ["--data_dir="], nanogpt_files_in_repo_data,  # (a prepare overwrote them)
     r"shakespeare_char holds train\.bin and val\.bin but no meta\.json: train\.py will not prepare over them"),
    ("nanoGPT's character-level folder", [], lambda d, m: (d / "meta.json").rename(d / "meta.pkl"),
     r"nanoGPT's character-level ones \(meta\.pkl\) train once their text is prepared again \(python data/shakesp"),
    ("data_dir a folder of other files", lambda d: [f"--data_dir={d.parent / 'home'}"],  # (data/shakespeare was one)
     lambda d, m: [(d.parent / "home" / name).write_text("x") for name in ("prepare.py", "notes.md", "input.txt",
                   ".draft.1.tmp") if (d.parent / "home").mkdir(exist_ok=True) or True],  # (the last was deleted)
     r"no dataset in .*home \(meta\.json missing\), and it holds other files \(notes\.md, prepare\.py\): train\.py "
     r"prepares shakespeare_char only into a new or empty folder: check --data_dir"),
    ("prepare_input that did not make the dataset", lambda d: [f"--prepare_input={d.parent / 'other.txt'}"],
     lambda d, m: (d.parent / "other.txt").write_text("another text\n" * 99),  # (it went unused)
     r"data holds a dataset made from .*input_text\.txt, not from prepare_input .*other\.txt: leave --prepare_in"),
    ("prepare_input missing", ["--prepare_input=no/such/corpus.txt"], lambda d, m: shutil.rmtree(d),
     r"prepare_input no/such/corpus\.txt does not exist: the dataset in .*data is missing"),
    ("prepare_input a pipe a launcher's worker lacks", ["--prepare_input=/dev/fd/1023"], lambda d, m: shutil.rmtree(d),
     r"prepare_input /dev/fd/1023 does not exist \(a shell's <\(\.\.\.\) pipe reaches the program it started, not a "),
    ("unfinished streaming preparation", [], lambda d, m: (d / "meta.json").rename(d / ".progress.json"),
     r"data holds an unfinished preparation \(\.progress\.json and no meta\.json\): run the dataset's prepare\.py"),
    ("meta.json not JSON", [], lambda d, m: (d / "meta.json").write_text("{\"vocab_size\": "),
     r"meta\.json is not valid JSON .*: prepare the dataset again"),
    ("meta.json a folder", [], lambda d, m: (d / "meta.json").unlink() or (d / "meta.json").mkdir(),  # (was: "no
     r"meta\.json is not a file: move it out of the way, then prepare the dataset again"),      # meta.json")
    ("meta.json of another format", [], lambda d, m: rewrite_meta(d, format=2),
     r"meta\.json has format 2; this train\.py reads format 1: prepare the dataset again"),
    ("meta.json without a format", [], lambda d, m: rewrite_meta(d, format=None),
     r"meta\.json has no format; this train\.py reads format 1: prepare the dataset again"),
    ("meta.json without vocab_size", [], lambda d, m: rewrite_meta(d, vocab_size=None),
     r"meta\.json: vocab_size is None, which is missing or invalid"),
    ("meta.json chars not text", [], lambda d, m: rewrite_meta(d, chars=123),
     r"meta\.json: chars is 123, not the vocabulary's characters"),
    ("meta.json chars twice", [], lambda d, m: rewrite_meta(d, chars="a" + json.loads((d / "meta.json").read_text())[
        "chars"][1:]), r"meta\.json: chars is 'a.*', not the vocabulary's characters, each once"),  # which one would 'a' be?
    ("meta.json chars disagree", [], lambda d, m: rewrite_meta(d, chars="abc"),
     r"meta\.json: a char vocabulary of 3 characters, but vocab_size"),
    ("meta.json gpt2 of another size", [], lambda d, m: rewrite_meta(d, tokenizer="gpt2"),
     r"meta\.json: tokenizer gpt2, but vocab_size \d+ \(GPT-2's BPE has 50257 tokens\)"),
    ("bin not whole tokens", [], lambda d, m: append_bytes(d, "train", b"\0"),
     r"train\.bin is 108027 bytes, not a whole number of uint16 tokens"),
    ("bin token count", [], lambda d, m: append_bytes(d, "val", b"\0\0"),
     r"val\.bin holds 6,003 tokens, but meta\.json says 6,002"),
    ("bin missing", [], lambda d, m: (d / "val.bin").unlink(),
     r"val\.bin is missing, though meta\.json is there"),
    ("bin a folder", [], lambda d, m: (d / "val.bin").unlink() or (d / "val.bin").mkdir(),
     r"val\.bin is no file, though meta\.json is there"),
    ("token id beyond the vocabulary", [], lambda d, m: put_token(d, "train", 30_000, 65_535),
     r"train\.bin: token id 65535 at position 30,000 is >= vocab_size"),
    # the sampled windows reach a split's very last token, and an id of vocab_size is one too many
    ("token id of vocab_size at a split's end", [],
     lambda d, m: put_token(d, "val", -1, json.loads((d / "meta.json").read_text())["vocab_size"]),
     r"val\.bin: token id (\d+) at position 6,001 is >= vocab_size \1: the files come from different"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_rank_exits_2_with_the_same_message_before_the_group_and_touches_nothing(
        case, copies, monkeypatch, capsys):
    name, extra, damage, message = case
    data, out = copies
    if damage is not None:
        damage(data, monkeypatch)
    if callable(extra):
        extra = extra(data)
    before = snapshot(data.parent)
    args = tiny_args(data, out, resume="auto", dist_timeout=3) + extra
    port = free_port()
    results = []
    for rank in (0, 1):
        started = time.monotonic()
        code, err = run_cli(args, monkeypatch, capsys, rank=rank, world_size=2, port=port)
        results.append((code, err))
        assert code == 2, f"rank {rank}: exit {code}\n{err}"
        assert time.monotonic() - started < 3, "it waited for a peer: the check came too late"
    (_, err0), (_, err1) = results
    assert err0 == err1
    assert err0.startswith("error: ") and err0.count("\n") == 1 and "Traceback" not in err0
    assert re.search(message, err0), err0
    assert snapshot(data.parent) == before


def test_a_dataset_with_another_vocabulary_than_the_checkpoint_is_refused(copies, char_data, tmp_path,
                                                                         monkeypatch, capsys):
    data, out = copies
    other = tmp_path / "other"
    other_vocabulary(other)
    before = snapshot(tmp_path)
    code, err = run_cli(tiny_args(other, out, resume="auto"), monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert f"{out / 'last.pt'} was trained on a vocabulary of" in err
    assert "but the dataset now has 5" in err and f"data_dir={str(char_data)!r}" in err
    assert "--resume=never" in err
    assert snapshot(tmp_path) == before
    # the same number of characters, other ones: it once resumed, and sample.py decoded with them
    chars = json.loads((data / "meta.json").read_text())["chars"]
    rewrite_meta(data, chars=chars[::-1])
    before = snapshot(tmp_path)
    code, err = run_cli(tiny_args(data, out, resume="auto"), monkeypatch, capsys)
    assert code == 2 and err == (f"error: {out / 'last.pt'} was trained on another vocabulary than the dataset's "
                                 f"(same size, other tokens): resume with the data it was trained on "
                                 f"(data_dir={str(char_data)!r}) or start afresh with --resume=never\n")
    assert snapshot(tmp_path) == before
    # out_dir's meta.json rewritten by a later run into it that saved nothing: the checkpoint's own vocabulary
    # decides (the meta.json was compared once: the other characters resumed, and the right ones were refused)
    shutil.copy(data / "meta.json", out / "meta.json")
    rewrite_meta(data, chars=chars)
    saved = checkpoint.read(out / "last.pt")
    assert checkpoint.load(out / "last.pt", saved["model_args"], resolve(tiny_args(data, out)),
                           json.loads((data / "meta.json").read_text()))["step"] == saved["step"]
    assert pretrained.load_model(out, torch.device("cpu"))[1]["chars"] == chars  # sample.py's, eval.py's
    shutil.copy(other / "meta.json", out / "meta.json")  # ... even one of another size ("from different runs")
    assert pretrained.load_model(out, torch.device("cpu"))[1]["chars"] == chars
    # a checkpoint from before checkpoints kept their vocabulary: the meta.json beside it decides, as it did
    torch.save({k: v for k, v in saved.items() if k != "vocab"}, out / "last.pt")
    shutil.copy(data / "meta.json", out / "meta.json")
    rewrite_meta(data, chars=chars[::-1])
    code, err = run_cli(tiny_args(data, out, resume="auto"), monkeypatch, capsys)
    assert code == 2 and "last.pt was trained on another vocabulary than the dataset's" in err, err
    shutil.copy(other / "meta.json", out / "meta.json")  # ... and there one of another size: sample.py refuses it
    with pytest.raises(errors.ConfigError) as sampled:
        pretrained.load_model(out, torch.device("cpu"), "last")
    assert str(sampled.value) == (f"{out / 'meta.json'} has a vocabulary of 5 tokens but {out / 'last.pt'} was "
                                  f"trained with {saved['model_args']['vocab_size']}: they come from different runs")


def launch_two_ranks(args, timeout=60, sizes=(2, 2)):
    port = free_port()
    procs = [subprocess.Popen(train_py(args), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env(RANK=r, WORLD_SIZE=sizes[r], LOCAL_RANK=r, MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port))
             for r in range(2)]
    try:
        return [(p.returncode, out, err) for p in procs for out, err in [p.communicate(timeout=timeout)]]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow
def test_a_rank_started_with_another_world_size_says_so(char_data, tmp_path):
    # (it waited out dist_timeout for a third rank, and said only to check MASTER_ADDR, MASTER_PORT and WORLD_SIZE)
    (code0, _, err0), (code1, _, err1) = launch_two_ranks(tiny_args(char_data, tmp_path / "out", dist_timeout=5,
                                                                    global_batch_size=24), sizes=(2, 3))
    assert (code1, err1) == (2, "error: WORLD_SIZE is 3 here but 2 on rank 0: start every rank with the same\n")
    assert code0 == 1 and "could not form the process group of 2 ranks" in err0, err0


def test_a_master_port_in_use_is_named(char_data, tmp_path, monkeypatch, capsys):
    # (it was "could not form the process group ... within dist_timeout", exit 1: relaunch, which fails again)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = run_cli(tiny_args(char_data, tmp_path / "out"), monkeypatch, capsys, world_size=2, port=port)
    assert code == 2 and err.startswith(f"error: MASTER_PORT {port} is in use on "), err
    assert err.endswith("(another program, or another job's rank 0, listens there): give every rank another\n")


def test_a_rank_given_twice_is_named_at_once(monkeypatch):
    # (the second rank 1 waited out twice dist_timeout, then blamed "another program listening on MASTER_PORT")
    import torch.distributed as dist
    import collectives
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # rank 0's, which a rank 1 joined
    attempt = dist.PrefixStore("attempt-0", store)
    attempt.set("world_size", "2")
    attempt.add("rank-1", 1)
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    with pytest.raises(errors.ConfigError, match=rf"^another process joined 127.0.0.1:{store.port} as rank 1 first: "
                                                 r"RANK was given twice, or another job uses this MASTER_PORT; "):
        collectives._join(world.World(rank=1, size=2), dist_timeout=5)


@pytest.mark.parametrize("answered", [False, True])
def test_a_join_that_never_ends_says_how_far_it_got(monkeypatch, answered):
    # (past the store, a peer that stopped while gloo connected was blamed on "another program on MASTER_PORT")
    import threading
    import collectives
    said = []
    monkeypatch.setattr(collectives, "say", said.append)
    monkeypatch.setattr(os, "_exit", said.append)
    reached = threading.Event()
    if answered:
        reached.set()
    collectives._watch(world.World(rank=0, size=2), "10.0.0.1:29500", -0.95, reached, threading.Event())  # 0.1 s
    assert said[1] == 1 and said[0].startswith("error: rank 0 on ")
    # (how long it waited: 2 x dist_timeout + 2 s, where GroupNotFormed's own words say "within dist_timeout")
    assert ("the store at 10.0.0.1:29500 answered, but not every rank joined the group in 0.1s" if answered else
            "nothing answered at 10.0.0.1:29500 in 0.1s: is another program listening on MASTER_PORT?") in said[0]


@pytest.mark.slow
@pytest.mark.parametrize("program", ["train.py", "eval.py"])
def test_ctrl_c_ends_a_rank_waiting_for_its_peers_at_once(char_data, tmp_path, program):
    # the store's C++ wait held the main thread, so Python's handler ran only after dist_timeout (10 minutes)
    port = free_port()
    env = child_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    command = train_py(tiny_args(char_data, tmp_path / "out", dist_timeout=600)) if program == "train.py" else \
        [sys.executable, "eval.py", f"--out_dir={tmp_path}", "--dist_timeout=600"]  # (it fails later: no checkpoint)
    proc = subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    def listening():  # rank 0 is waiting for rank 1
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    try:
        deadline = time.monotonic() + 60
        while not listening():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.endswith("error: interrupted (Ctrl-C)\n"), err  # (after a 2 s grace)


@pytest.mark.slow
def test_two_launched_ranks_both_exit_2_and_debug_shows_the_traceback(char_data, tmp_path):
    args = tiny_args(char_data, tmp_path / "out", dist_timeout=300) + ["--n_embd=33"]
    started = time.monotonic()
    quiet = launch_two_ranks(args)
    assert time.monotonic() - started < 120  # nobody waited for a peer (300 s), on a machine however busy
    for code, stdout, stderr in quiet:
        assert code == 2, stderr
        assert stderr == "error: n_embd (33) must be divisible by n_head (2)\n"
    for code, stdout, stderr in launch_two_ranks(args + ["--debug"]):
        assert code == 2
        assert "Traceback (most recent call last)" in stderr and "config.py" in stderr
        assert stderr.endswith("error: n_embd (33) must be divisible by n_head (2)\n")
    assert nothing_written(tmp_path / "out")


LATIN1 = "caf\u00e9 au lait\n".encode("latin-1") * 99  # a text that exists, but no preparation can read


@pytest.mark.slow
@pytest.mark.parametrize("problem, message", [
    ("--n_embd=33", "n_embd (33) must be divisible by n_head (2)"),  # found by the launcher
    ("--block_size=7000", "block_size (7000) is too long for the val split"),  # found by the ranks
    ("--resume=/nonexistent/\udcff.pt", "nothing to resume from: /nonexistent/\\udcff.pt does not exist"),  # not UTF-8
    (lambda tmp: [f"--data_dir={tmp / 'fresh'}", f"--prepare_input={write_bytes(tmp / 'l1.txt', LATIN1)}"],
     "preparing shakespeare_char in "),  # rank 0's line only: not rank 1's "failed on another rank: see its message"
])
def test_train_spawn_exits_2_and_debug_shows_the_traceback(char_data, tmp_path, problem, message):
    problem = problem(tmp_path) if callable(problem) else [problem]
    args = ["train_spawn.py", "--nproc=2", *tiny_args(char_data, tmp_path / "out"), *problem]
    quiet = python(*args, timeout=120)
    # one line, though every rank raised it (they once each printed it, and the launcher its terminations)
    assert quiet.returncode == 2 and quiet.stderr.startswith(f"error: {message}"), quiet.stderr
    assert quiet.stderr.count("\n") == 1 and "Traceback" not in quiet.stderr, quiet.stderr
    loud = python(args[0], "--debug", *args[1:], timeout=120)  # (first: not read as a setting before the problem)
    assert loud.returncode == 2 and "Traceback (most recent call last)" in loud.stderr, loud.stderr
    assert loud.stderr.strip().splitlines()[-1] == quiet.stderr.strip()  # the same error, not one about --debug
    assert nothing_written(tmp_path / "out")


@pytest.mark.parametrize("launcher, args, message", [
    ("train_spawn.py", ["--nproc=4", "--global_batch_size=6"],
     "global_batch_size (6) must be divisible by batch_size (4) x world size (4) = 16: try --global_batch_size=16 "
     "(a resume must keep 6: launch it on 3 processes with --batch_size=2, or another number that divides 6)"),
    ("bench.py", ["--nproc=4", "--strategies=fsdp", "--strategy=fsdp", "--fsdp_shard_size=3", "--global_batch_size=48"],
     "fsdp_shard_size (3) must divide the world size (4): e.g. the processes per host, 4"),
])
def test_a_launchers_own_check_is_for_the_world_it_will_start(char_data, tmp_path, script, launcher, args, message):
    """(once its parent checked the batch and fsdp_shard_size for a world of one process)"""
    proc = script(launcher, *tiny_args(char_data, tmp_path / "out"), *args)
    assert proc.returncode == 2 and proc.stderr == f"error: {message}\n", proc.stderr


def test_train_spawns_own_argument_is_one_line(char_data, tmp_path, script):
    for nproc, message in (("0", "--nproc must be a positive integer, got 0"),
                           ("two", "argument --nproc: invalid int value: 'two' (see train_spawn.py --help)")):
        proc = script("train_spawn.py", f"--nproc={nproc}", *tiny_args(char_data, tmp_path / "out"))
        assert proc.returncode == 2 and proc.stderr == f"error: {message}\n", proc.stderr


@pytest.mark.parametrize("code, received, said", [
    (-9, None, "error: rank 1 was killed by SIGKILL: relaunch with resume=auto to continue from the last checkpoint\n"),
    (128 + signal.SIGTERM, signal.SIGTERM, ""),  # stopped with a checkpoint: no error line
    (-signal.SIGINT, signal.SIGINT, ""),  # the launcher's Ctrl-C reached a rank done training: was "killed", 1
    (-signal.SIGTERM, None, ""),  # a SIGTERM that reached a rank outside training, from anyone: 143, as a shell says
])
def test_train_spawn_exits_as_its_rank_did(char_data, tmp_path, script, monkeypatch, code, received, said):
    # sys.exit(-9) would end the launcher with status 247
    import torch.multiprocessing as mp
    handlers = {}

    class Killed:
        processes = []

        def join(self):
            if received:
                handlers[received](received, None)
            raise mp.ProcessExitedException("", error_index=1, error_pid=4242, exit_code=code,
                                            signal_name=signal.Signals(-code).name if code < 0 else None)
    monkeypatch.setattr(mp, "spawn", lambda *args, **kwargs: Killed())
    monkeypatch.setattr(signal, "signal", handlers.__setitem__)  # pytest keeps its own handlers
    proc = script("train_spawn.py", "--nproc=2", *tiny_args(char_data, tmp_path / "out"))
    expected = 128 - code if -code in (signal.SIGTERM, signal.SIGINT) else max(code, 1)  # (SIGINT's death: 130)
    assert proc.returncode == expected and proc.stderr == said, (proc.returncode, proc.stderr)


def test_a_signal_while_train_spawn_starts_its_ranks_is_passed_on(tmp_path, monkeypatch):
    """A Ctrl-C that came while mp.spawn was still starting the ranks was lost: the launcher ignored it
    until its forwarding handler was in place, and the ranks, still importing torch, ignored it too."""
    import torch.multiprocessing as mp
    import train_spawn
    kill, sent = os.kill, []

    class Started:
        processes = [type("Rank", (), {"pid": 4242, "is_alive": lambda self: True})()]

        def join(self):
            return True

    def spawn(worker, args, **kwargs):
        kill(os.getpid(), signal.SIGINT)  # (the terminal's Ctrl-C reaches the launcher as it starts rank 1)
        Started.interrupted = args[3]
        return Started()
    monkeypatch.setattr(mp, "spawn", spawn)
    monkeypatch.setattr(os, "kill", lambda pid, signum: sent.append((pid, signum)))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        train_spawn.run(2, [], tmp_path)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, list(previous))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert sent == [(4242, signal.SIGINT)] and Started.interrupted.is_set()


@pytest.mark.parametrize("lines, exit_code, expected", [
    # a Ctrl-C that reached one rank: its line alone, not its peer's lost collective beside it
    ({0: "LOST", 1: "error: interrupted (Ctrl-C)"}, 130, ["error: interrupted (Ctrl-C)"]),
    # a rank killed by SIGKILL: the launcher's line names it; the survivor's lost collective goes
    ({0: "LOST"}, -9, ["error: rank 1 was killed by SIGKILL"]),
    ({0: "LOST", 1: "LOST"}, 1, ["LOST"]),  # a broken network: nothing else to say
    # mp.spawn ends the other ranks with SIGTERM once one failed: that is not what the user sent
    ({0: "error: interrupted (SIGTERM)"}, -9, ["error: rank 1 was killed by SIGKILL"]),
    ({0: "error: interrupted (SIGTERM)", 1: "error: MASTER_PORT 29517 is in use"}, 2, ["error: MASTER_PORT 29517"]),
    ({1: "error: interrupted (SIGTERM)"}, 143, ["error: interrupted (SIGTERM)"]),  # (the one a user sent it)
    ({}, 134, ["error: rank 1 exited with status 134"]),  # an abort (NCCL's watchdog, a C++ assert) said nothing
    ({0: "error: x on another rank: see its message", 1: "error: the real cause"}, 2, ["error: the real cause"]),
])
def test_train_spawn_prints_the_cause_not_the_peers_that_lost_it(tmp_path, monkeypatch, capsys, lines, exit_code,
                                                                  expected):
    import torch.multiprocessing as mp
    import train_spawn
    from errors import CollectiveFailed
    lost = str(CollectiveFailed(0, "step 5", 600, RuntimeError("Connection closed by peer")))
    for rank, line in lines.items():
        (tmp_path / str(rank)).write_text(lost if line == "LOST" else line)

    class Failed:
        processes = []

        def join(self):
            raise mp.ProcessExitedException("", 1, 4242, exit_code, "SIGKILL" if exit_code == -9 else None)
    monkeypatch.setattr(mp, "spawn", lambda worker, args, **kwargs: Failed())
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as stop:
            train_spawn.run(2, [], tmp_path)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    printed = capsys.readouterr().err.splitlines()
    assert stop.value.code == max(exit_code, 1) and len(printed) == len(expected)
    assert all(line.startswith(lost if start == "LOST" else start) for line, start in zip(printed, expected))


def _train_rank_recording_config_errors(rank, world_size, args, damage_on_rank1=True, rank1_args=(), rank1_env=None):
    """ranks_say: train.main on each rank (rank1_args added on rank 1, and rank1_env to its environment)."""
    import loader
    import train
    from config import resolve
    if rank == 1:
        os.environ.update(rank1_env or {})
    if rank == 1 and damage_on_rank1:  # this host's copy of the data turns out damaged once prepared
        def damaged(data_dir, meta, **kwargs):
            raise ValueError(f"{data_dir}/train.bin is damaged on rank 1's host")
        loader.check_token_files = damaged
    train.main(resolve([*args, *(rank1_args if rank == 1 else ())]))
    return "trained"


@pytest.mark.slow
def test_data_found_bad_after_preparing_on_one_host_stops_every_rank(char_data, tmp_path):
    # The data is missing, so it passes the check before the process group forms; local rank 0
    # prepares it, and then one rank's check fails: both must stop, neither may wait for the other.
    fresh = tmp_path / "fresh"
    args = tiny_args(fresh, tmp_path / "out", prepare_input=char_data.parent / "input_text.txt",
                     dist_timeout=300)
    started = time.monotonic()
    ranks_say(_train_rank_recording_config_errors, 2, tmp_path, args)
    assert time.monotonic() - started < 120  # (a wait for the other rank: 300 s)
    assert (fresh / "meta.json").exists()
    assert (tmp_path / "rank1.txt").read_text() == f"{fresh}/train.bin is damaged on rank 1's host"
    assert (tmp_path / "rank0.txt").read_text() == "the dataset check failed on another rank: see its message"
    assert nothing_written(tmp_path / "out")


@pytest.mark.slow
@pytest.mark.parametrize("rollback", [False, True])
def test_a_relaunch_whose_rank_0_is_on_a_host_without_the_newest_checkpoint_stops(char_data, tmp_path, rollback):
    """Each host its own out_dir (the file format allows it), and a c10d rendezvous that made another host's
    process rank 0 this time: the run started again from step 0, beside the other host's newer last.pt. After a
    rollback (--resume=PATH of an older one), rank 0's previous.pt is of a later step than the last.pt it resumes:
    that step was compared, and host B's steps were lost."""
    import socket
    from harness import train_here
    b, a = tmp_path / "host_b", tmp_path / "host_a"
    train_here(char_data, b, max_iters=2, eval_interval=1)  # last.pt of step 2, previous.pt of step 1
    args = tiny_args(char_data, a, resume="auto", max_iters=4, eval_interval=2, dist_timeout=60)
    a.mkdir()  # rank 0's: a last.pt that is no checkpoint of ours is no step (was a KeyError)
    if rollback:
        shutil.copy(b / "last.pt", a / "previous.pt")
        shutil.copy(b / "previous.pt", a / "last.pt")
    else:
        torch.save({"a": 1}, a / "last.pt")
    said = ranks_say(_train_rank_recording_config_errors, 2, tmp_path, args, False,
                     [f"--out_dir={b}"], {"LOCAL_RANK": "0"})  # (rank 1: host B's first process)
    assert said == [f"{b / 'last.pt'} on {socket.gethostname()} (rank 1) is of step 2, but rank 0's out_dir holds "
                    f"{'step 1' if rollback else 'none'}: relaunch with that host's processes as ranks 0.. (torchrun's "
                    f"static rendezvous, --node_rank=0 there), or copy its out_dir to rank 0's host"] * 2, said


def test_a_hosts_newer_checkpoint_is_named_by_the_file_that_holds_its_step(tmp_path):
    """Its last.dcp newer than its last.pt but unreadable: the step is last.pt's, and so is the name (was last.dcp)."""
    import socket
    import checkpoint
    from world import World
    torch.save({"step": 7}, tmp_path / "last.pt")
    (tmp_path / "last.dcp").mkdir()
    os.utime(tmp_path / "last.pt", (1, 1))
    said = checkpoint.newer_than_rank0(Config(out_dir=str(tmp_path)), World(rank=2, local_rank=0, size=4), 3)
    assert said.startswith(f"{tmp_path / 'last.pt'} on {socket.gethostname()} (rank 2) is of step 7, but rank 0's "
                           f"out_dir holds step 3: "), said


def test_the_step_of_a_checkpoint_this_user_may_not_read_is_not_guessed(tmp_path, monkeypatch):
    """Rank 0's unreadable last.pt once counted as none: another host's older one was called newer, and the hint
    (copy its out_dir over) would have replaced it. Rank 0 raises (on_rank0 tells every rank); a save rotates it."""
    def denied(path, tensors=True):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(checkpoint, "read", denied)
    with pytest.raises(PermissionError):
        checkpoint.resume_step([tmp_path / "last.pt"])
    assert checkpoint.resume_step([tmp_path / "last.pt"], denied=0) == 0  # lineage: kept as previous.pt
    assert checkpoint.lineage(tmp_path, tmp_path / "last.pt", None, None, "never") == (True, True)


def test_a_prepare_at_start_up_that_fails_is_one_line_naming_the_dataset(tmp_path, monkeypatch, capsys):
    """One process (the test below: two ranks, the other told to see this one's message)."""
    latin1, fresh = write_bytes(tmp_path / "latin1.txt", LATIN1), tmp_path / "fresh"
    code, err = run_cli(tiny_args(fresh, tmp_path / "out", prepare_input=latin1), monkeypatch, capsys)
    assert (code, err) == (2, f"error: preparing shakespeare_char in {fresh} failed: input file {latin1} is not UTF-8 "
                              f"text (byte 0xe9 at offset 3): convert it to UTF-8\n")
    assert not fresh.exists() and nothing_written(tmp_path / "out")  # (a folder made to prepare into goes too)
    import data.shakespeare_char.prepare as prepare  # a text too large for the memory (ulimit -v): a traceback

    def too_large(**kwargs):
        raise MemoryError()
    monkeypatch.setattr(prepare, "prepare", too_large)
    fresh.mkdir()  # made by the user for it, empty: it stays
    code, err = run_cli(tiny_args(fresh, tmp_path / "out"), monkeypatch, capsys)
    assert (code, err) == (2, f"error: preparing shakespeare_char in {fresh} failed: out of memory (MemoryError)\n")
    assert fresh.is_dir()


def test_out_of_memory_anywhere_else_is_one_line(capsys):
    """numpy's MemoryError names the allocation (a prepare script's text under ulimit -v): it was a traceback."""
    from errors import reported
    with pytest.raises(SystemExit) as ended, reported():
        raise MemoryError("Unable to allocate 275. MiB for an array with shape (36000000,) and data type int64")
    assert ended.value.code == 1 and capsys.readouterr().err == (
        "error: out of memory (Unable to allocate 275. MiB for an array with shape (36000000,) and data type int64): "
        "free memory on this host, or ask for less\n")
    with pytest.raises(SystemExit) as ended, reported():  # torch's CPU allocator's (eval.py's forward, say)
        torch.empty(2**50, dtype=torch.uint8)
    assert ended.value.code == 1 and re.fullmatch(r"error: out of memory \(.*can't allocate memory: you tried to "
                                                  r"allocate 1125899906842624 bytes.*\): free memory on this host, or "
                                                  r"ask for less\n", capsys.readouterr().err)


@pytest.mark.slow
def test_a_prepare_that_fails_on_local_rank_0_stops_every_rank(tmp_path):
    # the input exists (so the check before the group passes) but is not UTF-8: preparing fails
    # on local rank 0 while rank 1 waits for it
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1") * 200)
    fresh = tmp_path / "fresh"
    args = tiny_args(fresh, tmp_path / "out", prepare_input=latin1, dist_timeout=300)
    started = time.monotonic()
    ranks_say(_train_rank_recording_config_errors, 2, tmp_path, args, False)
    assert time.monotonic() - started < 120  # (a wait for the other rank: 300 s)
    assert (tmp_path / "rank0.txt").read_text() == (
        f"preparing shakespeare_char in {fresh} failed: input file {latin1} is not UTF-8 text "
        f"(byte 0xe9 at offset 3): convert it to UTF-8")
    assert (tmp_path / "rank1.txt").read_text() == ("preparing the dataset failed on another rank: "
                                                    "see its message")
    assert not (fresh / "meta.json").exists() and nothing_written(tmp_path / "out")


@pytest.mark.slow
def test_an_out_dir_rank_0_cannot_write_stops_every_rank_before_training(char_data, tmp_path):
    taken = tmp_path / "a_file"
    taken.write_text("not a folder")
    ranks_say(_train_rank_recording_config_errors, 2, tmp_path, tiny_args(char_data, taken, dist_timeout=60), False)
    assert (tmp_path / "rank0.txt").read_text().startswith(f"out_dir {taken} cannot be written (")
    assert (tmp_path / "rank1.txt").read_text() == (tmp_path / "rank0.txt").read_text()  # rank 0's own words
    assert taken.read_text() == "not a folder"


@pytest.mark.slow
def test_ranks_started_with_different_configs_all_stop_before_training(char_data, tmp_path):
    # each would train on alone (another learning rate), or fail in a collective that does not match
    rank1 = [f"--data_dir={char_data}/.", "--learning_rate=0.03", "--n_layer=3", "--seed=7"]  # paths may differ
    ranks_say(_train_rank_recording_config_errors, 2, tmp_path, tiny_args(char_data, tmp_path / "out", dist_timeout=60),
              False, rank1)
    line = ("rank 1 was started with seed=7 (rank 0: 1337), n_layer=3 (rank 0: 2), learning_rate=0.03 (rank 0: 0.003): "
            "give every rank the same config")  # (another seed: another order of the data)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [line, line]
    assert nothing_written(tmp_path / "out")
    # the same config, but another host's copy of the dataset holds other characters (the same count), made
    # from another text (the same sizes: once unnoticed, as a shuffle of the same lines would be)
    other = shutil.copytree(char_data, tmp_path / "other")
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "chars": meta["chars"][::-1],
                                                 "source": {**meta["source"], "sha256": "0" * 64}}))
    ranks_say(_train_rank_recording_config_errors, 2, tmp_path, tiny_args(char_data, tmp_path / "out", dist_timeout=60),
              False, [f"--data_dir={other}"])
    line = (tmp_path / "rank1.txt").read_text()
    assert line.startswith("rank 1 was started with chars=") and ", text_sha256='" in line and line.endswith(
        "give every rank the same dataset (each host's data_dir)") and (tmp_path / "rank0.txt").read_text() == line


def test_an_out_dir_in_use_or_that_cannot_be_written_is_one_line(char_data, tmp_path, script):
    # in this process: the lock is an flock, which a second open file of the same process cannot take
    busy = tmp_path / "busy"
    with checkpoint.locked_out_dir(busy, world.World()):
        proc = script("train.py", *tiny_args(char_data, busy, max_iters=2))
    line, = proc.stderr.splitlines()
    assert proc.returncode == 2 and f"out_dir {busy} is in use by the run started" in line, proc.stderr
    assert f"pid {os.getpid()} " in line and "another --out_dir" in line
    taken = tmp_path / "a_file"
    taken.write_text("not a folder")
    proc = script("train.py", *tiny_args(char_data, taken))
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: out_dir {taken} cannot be written (it is a file, "
                                                           f"or lies under one): choose another --out_dir\n"), proc.stderr
    (tmp_path / "scratch").symlink_to(tmp_path / "not_mounted" / "scratch")
    proc = script("train.py", *tiny_args(char_data, tmp_path / "scratch"))
    assert proc.stderr == (f"error: out_dir {tmp_path / 'scratch'} cannot be written (a link to nothing: is its "
                           f"storage mounted?): choose another --out_dir or mount it\n"), proc.stderr
    assert proc.stderr.count("\n") == 1 and taken.read_text() == "not a folder"


@pytest.mark.parametrize("name, thing", [("last.pt", "a folder"), ("previous.pt", "a folder"), ("best.pt", "a folder"),
                                         ("config.json", "a folder"), ("metrics.jsonl", "a pipe"), ("run.lock", "a link")])
def test_a_file_of_the_run_held_by_something_else_is_refused_before_training(trained_copy, char_data, tmp_path, script,
                                                                             name, thing):
    """Each save once failed with exit 1 and "free disk space" (a folder), on every relaunch; metrics.jsonl
    too (a pipe there once hung the start); a link run.lock had its target overwritten, outside out_dir."""
    out, notes = trained_copy, tmp_path / "notes.txt"
    notes.write_text("a user's file")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != name}
    (out / name).unlink(missing_ok=True)
    {"a folder": Path.mkdir, "a pipe": os.mkfifo, "a link": lambda p: p.symlink_to(notes)}[thing](out / name)
    proc = script("train.py", *tiny_args(char_data, out, max_iters=15, eval_interval=5))
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {out / name} is {'a link' if thing == 'a link' else 'not a file'}, but the run writes a file of "
        f"its own there: move it away or choose another --out_dir\n"), proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != name} == before
    assert notes.read_text() == "a user's file"


def test_an_out_dir_in_a_sharded_checkpoint_or_a_dataset_or_model_folder_is_refused(char_data, tmp_path, script):
    """Inside last.dcp, the run's files went when a save of the other run rotated and replaced that folder;
    in a dataset's folder, the run wrote its meta.json over the dataset's (also one it prepared there itself,
    then refused to resume); in a Hugging Face model's (an in-place fine-tune), its config.json over the model's."""
    (tmp_path / "run" / "last.dcp").mkdir(parents=True)
    data, model, older = shutil.copytree(char_data, tmp_path / "data"), tmp_path / "gpt2-mine", tmp_path / "gpt2-bin"
    for folder, weights in ((model, "model.safetensors"), (older, "pytorch_model.bin")):  # (transformers' older)
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "gpt2"}')
        (folder / weights).write_bytes(b"weights")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "edufineweb_train_000001.bin").write_bytes(b"tokens")
    before = {p: p.read_bytes() for folder in (data, model, older, shards) for p in folder.iterdir()}
    for out, why in ((tmp_path / "run" / "last.dcp" / "sub", f"inside the checkpoint {tmp_path / 'run' / 'last.dcp'}, "
                                                             f"which a save replaces"),
                     (tmp_path / "run" / "last.dcp", f"inside the checkpoint {tmp_path / 'run' / 'last.dcp'}, "
                                                     f"which a save replaces"),  # (itself: it was taken)
                     (data, "a dataset folder, whose meta.json the run writes"),
                     (shards, "a dataset folder, whose meta.json the run writes"),  # (llm.c's token shards)
                     (model, "a Hugging Face model's folder, whose config.json the run writes"),
                     (older, "a Hugging Face model's folder, whose config.json the run writes")):
        proc = script("train.py", *tiny_args(char_data, out))
        assert proc.returncode == 2 and proc.stderr == f"error: {out} is {why}: choose another --out_dir\n", proc.stderr
    new = tmp_path / "new"
    proc = script("train.py", *tiny_args(new, new), f"--prepare_input={char_data.parent / 'input_text.txt'}")
    assert proc.returncode == 2 and proc.stderr == (f"error: {new} is a dataset folder, whose meta.json the run "
                                                    f"writes: choose another --out_dir\n"), proc.stderr
    assert resolve([f"--data_dir={new}", f"--out_dir={new}"])  # (eval.py and bench.py write no out_dir: theirs)
    assert not (tmp_path / "run" / "last.dcp" / "sub").exists() and not new.exists()
    assert {p: p.read_bytes() for folder in (data, model, older, shards) for p in folder.iterdir()} == before


@pytest.mark.slow  # mount and umount are processes
def test_one_folder_reached_by_two_paths_is_one_folder(tmp_path):
    """A bind mount (or another letter case, where the disk ignores it: macOS's) gives a folder a second path that
    realpath tells apart: out_dir as data_dir was let through (the run's files went into the dataset), and a resume
    from --resume=ALIAS/last.pt counted as one from elsewhere (fresh: its first save deleted out_dir's best.pt)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "last.pt").write_bytes(b"the checkpoint resumed")
    with mounted(tmp_path / "alias", "--bind", str(tmp_path / "real")) as alias:
        with pytest.raises(errors.ConfigError, match=f"{alias} is a dataset folder, whose meta.json the run writes"):
            with checkpoint.locked_out_dir(alias, world.World(), data_dir=tmp_path / "real"):
                pass
        resumed = str(alias / "last.pt")
        assert checkpoint.lineage(tmp_path / "real", tmp_path / "real" / "last.pt", resumed, (resumed, 5, False),
                                  resumed) == (True, False)  # (rotated, as from out_dir/last.pt; not fresh)
    assert os.listdir(tmp_path / "real") == ["last.pt"]


def test_a_new_out_dir_deleted_under_a_failing_run_leaves_its_own_error(tmp_path, monkeypatch):
    """The clean-up of a folder the run made listed it: a FileNotFoundError traceback after the run's error."""
    with pytest.raises(RuntimeError, match="the run's own failure"):
        with checkpoint.locked_out_dir(tmp_path / "out", world.World()):
            shutil.rmtree(tmp_path / "out")
            raise RuntimeError("the run's own failure")
    rmdir = Path.rmdir

    def fuse_rmdir(folder):  # FUSE, NFS: an unlinked file still open stays in its folder (.fuse_hidden*, .nfs*)
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if os.path.exists(
            f"/proc/self/fd/{fd}")]
        if any(fd.startswith(f"{folder}/") for fd in fds):
            raise OSError(39, "Directory not empty", str(folder))
        rmdir(folder)
    monkeypatch.setattr(Path, "rmdir", fuse_rmdir)
    with pytest.raises(RuntimeError, match="the run's own failure"):  # (was that OSError, after a traceback)
        with checkpoint.locked_out_dir(tmp_path / "out", world.World()):
            raise RuntimeError("the run's own failure")
    assert not (tmp_path / "out").exists()
    made = tmp_path / "made"  # one the user made, empty: it stays (only a folder the run made for nothing goes)
    made.mkdir()
    (made / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "x" * 500}))  # longer
    with pytest.raises(RuntimeError, match="the run's own failure"):
        with checkpoint.locked_out_dir(made, world.World()):
            assert json.loads((made / "run.lock").read_text())["pid"] == os.getpid()  # (not a longer note's tail)
            raise RuntimeError("the run's own failure")
    assert made.is_dir()
    with pytest.raises(RuntimeError, match="the run's own failure"):  # a run that wrote files: they stay, and the lock
        with checkpoint.locked_out_dir(tmp_path / "wrote", world.World()):  # (by which prepare.py refuses the folder)
            (tmp_path / "wrote" / "config.json").write_text("{}")
            raise RuntimeError("the run's own failure")
    assert sorted(os.listdir(tmp_path / "wrote")) == ["config.json", "run.lock"]


def test_a_new_out_dir_goes_after_a_signal_before_the_lock_is_taken_and_a_winners_lock_stays(tmp_path, monkeypatch):
    """Ctrl-C while start-up cleaned the new folder left it holding run.lock; of two runs started into one new
    folder at once, the one refused deleted the other's run.lock (a third could then take the folder too)."""
    def interrupted(out_dir):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "remove_stale_temporaries", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with checkpoint.locked_out_dir(tmp_path / "out", world.World()):
            pass
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    held, real_open = [], os.open

    def other_run_first(path, *args):  # the other run opens and locks run.lock between our check and our open
        if str(path).endswith("run.lock") and not held:
            held.append(real_open(path, os.O_RDWR | os.O_CREAT, 0o644))
            fcntl.flock(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        return real_open(path, *args)
    monkeypatch.setattr(checkpoint.os, "open", other_run_first)
    with pytest.raises(errors.ConfigError, match="is in use by another run"):
        with checkpoint.locked_out_dir(tmp_path / "new", world.World()):
            pass
    assert (tmp_path / "new" / "run.lock").exists()
    os.close(held[0])


def test_wandb_that_cannot_start_is_one_line(char_data, tmp_path, script, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is in requirements.txt, but not on every machine")

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log to W&B.")
    monkeypatch.setattr(wandb, "init", no_key)
    old_log = tmp_path / "out" / "metrics.jsonl"  # an earlier run's: a refused run changes nothing
    old_log.parent.mkdir()
    old_log.write_text('{"step": 1, "loss": 3.0}\n')
    proc = script("train.py", *tiny_args(char_data, tmp_path / "out", wandb_log=True, max_iters=2))
    assert proc.returncode == 2 and proc.stderr == (
        "error: wandb could not start (UsageError: No API key configured. Use `wandb login` to log to W&B.): "
        "run `wandb login`, or set WANDB_MODE=offline, or use --wandb_log=false\n"), proc.stderr
    assert old_log.read_text() == '{"step": 1, "loss": 3.0}\n'
    monkeypatch.setattr(wandb, "init", raising(wandb.errors.UsageError("Invalid project name 'monkey/b': cannot "
                                                                      "contain characters '/,\\,#,?,%,:', found '/'")))
    proc = script("train.py", *tiny_args(char_data, tmp_path / "out", wandb_log=True, wandb_project="monkey/b"))
    assert proc.returncode == 2 and proc.stderr.endswith("): check --wandb_project and --wandb_run_name, or use "
                                                         "--wandb_log=false\n"), proc.stderr  # (not `wandb login`)
    monkeypatch.setenv("WANDB_MODE", "offline")  # its folder cannot be made: the path, not "set WANDB_MODE=offline"
    monkeypatch.setattr(wandb, "init", raising(NotADirectoryError(20, "Not a directory", "out/wandb/offline-run")))
    proc = script("train.py", *tiny_args(char_data, tmp_path / "out", wandb_log=True))
    assert proc.returncode == 2 and proc.stderr.endswith("): check out/wandb/offline-run, or use --wandb_log=false\n")
    monkeypatch.setattr(wandb, "init", no_key)
    proc = script("train.py", *tiny_args(char_data, tmp_path / "out", wandb_log=True))
    assert proc.returncode == 2 and proc.stderr.endswith("): run `wandb login`, or use --wandb_log=false\n")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: `wandb login` would not help
    proc = script("train.py", *tiny_args(char_data, tmp_path / "out", wandb_log=True, max_iters=2))
    assert proc.returncode == 2 and proc.stderr.endswith("): run pip install wandb, or use --wandb_log=false\n")


def test_a_log_history_that_cannot_be_read_is_one_line(char_data, tmp_path, script, monkeypatch):
    import logger
    out = tmp_path / "out"
    assert script("train.py", *tiny_args(char_data, out, max_iters=2, eval_interval=2)).returncode == 0
    without_log(out)  # an older checkpoint: its history is the log beside it

    def unreadable(path, verb):  # (another user's file: root reads any)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(logger, "read_metrics", unreadable)
    proc = script("train.py", *tiny_args(char_data, out, max_iters=4, eval_interval=2, resume="auto"))
    assert proc.returncode == 2 and proc.stderr == (f"error: cannot read {out}/metrics.jsonl, the log this run "
                                                    f"continues (Permission denied)\n"), proc.stderr


def test_help_lists_every_config_name_with_its_default(capsys):
    import train_spawn
    train.cli(["--help"])
    printed = capsys.readouterr().out
    assert printed.startswith(train.__doc__)
    for name, value in Config().to_dict().items():
        assert f"--{name}={value if isinstance(value, str) else repr(value)}\n" in printed
    train_spawn.main(["--help"])  # its own usage first (it once took --help for a bad override)
    assert capsys.readouterr().out == f"{train_spawn.__doc__}\n{printed}"
    import bench
    bench.main(["--help"])  # so did bench.py
    assert capsys.readouterr().out == f"{bench.__doc__}\n{Config.defaults()}\n"


@pytest.mark.parametrize("addr, port", [("127.0.0.1", "abc"), ("127.0.0.1", "65536"), ("127.0.0.1", None),
                                        (None, "29500"), ("127.0.0.1", "0")])  # (0: the store would bind any port)
def test_a_master_address_or_port_that_cannot_be_is_a_clear_error(char_data, tmp_path, monkeypatch, capsys, addr,
                                                                   port):
    """Found before the group forms (exit 2), not as a group that could not form (exit 1)."""
    for name, value in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR=addr, MASTER_PORT=port).items():
        monkeypatch.setenv(name, value) if value is not None else monkeypatch.delenv(name, raising=False)
    code, err = run_cli(tiny_args(char_data, tmp_path / "out", dist_timeout=2), monkeypatch, capsys)  # (not 600 s)
    assert code == 2 and err == (f"error: 2 processes need MASTER_ADDR (rank 0's host) and MASTER_PORT (a port, "
                                 f"1-65535), got {addr!r} and {port!r}: check the launch command\n"), err


@pytest.mark.parametrize("rank, size, message", [
    ("$SLURM_PROCID", "2", "rank variables must be whole numbers, got {'RANK': '$SLURM_PROCID'}"),  # unexpanded
    ("0", "\u00b9", "rank variables must be whole numbers, got {'WORLD_SIZE': '\u00b9'}"),  # isdigit, not int
    ("0", "0", "rank 0 (local rank 0) cannot be in a world of size 0 (0 on this host)"),
    ("2", "2", "rank 2 (local rank 0) cannot be in a world of size 2 (2 on this host)"),  # would wait
    ("1", "1", "rank 1 (local rank 0) cannot be in a world of size 1 (1 on this host)"),  # not "1 processes"
    ("1 2", "4", "rank 1 (local rank 2) cannot be in a world of size 4 (2 on this host)"),  # LOCAL_RANK 2 of 2
])
def test_rank_variables_that_cannot_be_are_a_clear_error(char_data, tmp_path, monkeypatch, capsys, rank, size,
                                                         message):
    rank, *local = rank.split(" ")
    if local:
        monkeypatch.setenv("LOCAL_RANK", local[0])
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", size)
    code, err = run_cli(tiny_args(char_data, tmp_path / "out"), monkeypatch, capsys)
    assert code == 2 and err == f"error: {message}: check the launch command\n", err


@pytest.mark.parametrize("error, code, line", [
    (errors.ConfigError("bad value"), 2, "error: bad value\n"),
    (errors.RunError("it failed"), 1, "error: it failed\n"),
    (KeyboardInterrupt(), 130, "error: interrupted (Ctrl-C)\n"),
    (BrokenPipeError(), 128 + signal.SIGPIPE, ""),  # `| head`: ends as a pipe's writer does, quietly
    (OSError(errno.ENOSPC, "No space left on device"), 1,  # stdout's disk (no file name)
     "error: the output could not be written (No space left on device): free disk space where stdout goes\n"),
    (PermissionError(errno.EACCES, "Permission denied", "/x"), 2, "error: permission denied: /x: this user may "
     "not use it (check the mode and owner of it and its folders), or choose another path\n"),
    (FileNotFoundError(errno.ENOENT, "No such file", "/x"), None, ""),  # a bug: its traceback
    (PermissionError(errno.EACCES, "Permission denied"), None, ""),  # no path to name: a bug too
], ids=["config", "run", "ctrl-c", "closed pipe", "stdout's disk full", "a path denied", "a path missing", "denied"])
def test_every_entry_points_error_is_one_line_and_its_exit_status(monkeypatch, capsys, error, code, line):
    """errors.reported, which every entry point runs inside (the slow tests see each status from a process)."""
    gone = []
    monkeypatch.setattr(errors, "_stdout_gone", lambda: gone.append(1))  # (it points fd 1 at /dev/null)
    with pytest.raises(SystemExit if code is not None else type(error)) as raised, errors.reported():
        raise error
    assert (getattr(raised.value, "code", None), capsys.readouterr().err) == (code, line)
    assert len(gone) == (isinstance(error, BrokenPipeError) or getattr(error, "errno", 0) == errno.ENOSPC)  # stdout's
