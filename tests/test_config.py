import os
import re

import pytest

from config import Config, ConfigError, parse_value, resolve


def test_file_then_overrides_resolve_in_order(tmp_path):
    cfg_file = tmp_path / "exp.py"
    cfg_file.write_text("import math, os\nfrom math import sqrt\n# a comment\nn_layer = 6\nlearning_rate = 1e-3\n"
                        "max_iters = 200\nlr_decay_iters = max_iters * 2\ndataset = 'shakespeare'\n"
                        "n_embd = int(sqrt(1024))\n_tokens = 4 * 32\nfrom random import randint\n"
                        "data_dir = os.path.join(os.path.dirname(__file__), 'd')\n")
    # (sqrt was an unknown config name, and randint, a bound method, still was; __file__ was not defined)
    cfg = resolve([str(cfg_file), "--n_layer=3", "--learning_rate=2", "--compile=true",
                   "--out_dir=out-7", "--min_lr=None"])
    assert cfg.n_layer == 3                        # the override wins over the file
    assert cfg.learning_rate == 2.0 and isinstance(cfg.learning_rate, float)  # int stands for float
    assert cfg.lr_decay_iters == 400               # the file is real Python
    assert cfg.dataset == "shakespeare" and cfg.n_embd == 32 and cfg.data_dir == str(tmp_path / "d")  # the file's
    assert cfg.compile is True and cfg.out_dir == "out-7" and cfg.min_lr is None
    assert cfg.n_head == Config().n_head           # untouched names keep their defaults
    cfg_file.write_bytes(b"\xef\xbb\xbfn_layer = 2\n")  # a byte-order mark, as some Windows editors save it
    assert resolve([str(cfg_file)]).n_layer == 2
    assert Config(pad_vocab_to=64).model_args(65)["pad_vocab_to"] == 64  # (the model is built from these)


def test_unknown_name_suggests_the_closest_valid_name(tmp_path):
    with pytest.raises(ConfigError, match="unknown config name 'n_layers'.*'n_layer'"):
        resolve(["--n_layers=4"])
    for name in ("grad_accum", "accum_steps"):  # (grad_accum: "did you mean 'grad_clip'?")
        with pytest.raises(ConfigError, match=f"unknown config name '{name}': give global_batch_size = batch_size x"):
            resolve([f"--{name}=4"])
    cfg_file = tmp_path / "typo.py"
    cfg_file.write_text("learnig_rate = 0.1\n")
    with pytest.raises(ConfigError, match=f"^{cfg_file}: unknown config name 'learnig_rate'.*'learning_rate'\\? "
                                          f"\\(or start a helper name of the file's own with _\\)$"):
        resolve([str(cfg_file)])
    cfg_file.write_text("gradient_accumulation_steps = 8\n")  # as a helper name, it would be dropped: no such hint
    with pytest.raises(ConfigError, match="give global_batch_size = batch_size x nanoGPT's gradient_accumulation_steps "
                                          "instead \\(sequences per optimizer step, over all processes\\)$"):
        resolve([str(cfg_file)])
    for name in ("world_size", "rank", "monitor_interval"):  # they suggested block_size, ..., log_interval
        with pytest.raises(ConfigError, match=f"unknown config name '{name}': it is a launcher's option"):
            resolve([f"--{name}=2"])
    cfg_file.write_text("log_dir = 'runs/x'\n")  # a launcher's name, but a helper's too
    with pytest.raises(ConfigError, match="it is a launcher's option: .* \\(or start a helper name of the file's own "
                                          "with _\\)$"):
        resolve([str(cfg_file)])
    cfg_file.write_text("lr_decay_iters = max_iters\n")  # nanoGPT's configurator ran files among the defaults
    with pytest.raises(ConfigError, match="line 1: NameError: name 'max_iters' is not defined \\(a config file sees "
                                          "only the names it sets: not the defaults, nor another file's\\)$"):
        resolve([str(cfg_file)])
    cfg_file.write_text('batch_size = "4"\n')  # of two files given, the one at fault is named
    (tmp_path / "good.py").write_text("batch_size = 4\n")
    with pytest.raises(ConfigError, match=f"^{cfg_file}: config 'batch_size' must be int, got '4' \\(str\\)$"):
        resolve([str(tmp_path / "good.py"), str(cfg_file)])
    with pytest.raises(ConfigError, match="^unknown config name 'nprocs': see docs/config.md$"):  # not wandb_project
        resolve(["--nprocs=2"])
    # a launcher's option given to train.py (with or without a value): the launchers that take it
    for arg in ("--nproc=2", "--nproc-per-node=4", "--standalone", "--rdzv-endpoint=HOST_A:29500"):
        with pytest.raises(ConfigError, match=f"^unknown config name '{arg[2:].partition('=')[0]}': it is a "
                                              f"launcher's option: .* train_spawn.py --nproc=N .* torchrun "):
            resolve([arg, "--n_layer=2"])
    with pytest.raises(ConfigError, match="^unknown config name 'n_layers': did you mean 'n_layer'"):
        resolve(["--n_layers"])  # (not "write overrides as --n_layers=VALUE")
    # nanoGPT's names that are not ours say what does their job (not a near name: eval_interval, block_size)
    for arg, hint in (("--gradient_accumulation_steps=5", "global_batch_size = batch_size x nanoGPT's gradient_acc"),
                      ("--eval_only=True", "python eval.py --out_dir=OUT_DIR"), ("--vocab_size=100", "meta.json")):
        with pytest.raises(ConfigError, match=f"^unknown config name '{arg[2:].partition('=')[0]}': .*{hint}"):
            resolve([arg])


@pytest.mark.parametrize("arg, expected", [
    ("--n_layer=4.5", "'n_layer' must be int"),
    ("--n_layer=true", "'n_layer' must be int"),
    ("--n_layer=True", "'n_layer' must be int"),  # Python's True, an int subclass: refused all the same
    ("--learning_rate=False", "'learning_rate' must be float"),
    ("--compile=2", "'compile' must be bool"),
    ("--learning_rate=fast", "'learning_rate' must be float"),
    ("--lr_decay_iters=1.5", "'lr_decay_iters' must be int or None"),
])
def test_wrong_type_names_the_key_and_expected_type(arg, expected):
    with pytest.raises(ConfigError, match=expected):
        resolve([arg])


def test_wrong_type_in_a_file_names_the_key(tmp_path):
    cfg_file = tmp_path / "bad.py"
    cfg_file.write_text("batch_size = '12'\n")
    with pytest.raises(ConfigError, match="'batch_size' must be int"):
        resolve([str(cfg_file)])


LONG = "a" * 300  # a file name past 255 bytes


@pytest.mark.parametrize("args, expected", [  # one bad value for each of config.validate's checks
    *[(f"--{n}=0", f"{n} must be positive") for n in ("n_layer", "n_head", "n_embd", "block_size", "batch_size",
                                                       "global_batch_size", "eval_interval", "eval_iters",
                                                       "log_interval", "pad_vocab_to")],
    *[(f"--{n}=-1", f"{n} must be >= 0") for n in ("max_iters", "warmup_iters", "weight_decay", "grad_clip",
                                                    "hellaswag_interval", "seed", "peak_flops")],
    ("--n_embd=130", "divisible by n_head"),
    ("--dropout=1.0", "dropout must be in"),
    ("--learning_rate=0", "learning_rate must be a positive number"),
    ("--min_lr=1", "min_lr must be in"),
    ("--min_lr=-0.1", "min_lr must be in"),
    ("--lr_decay_iters=0", "lr_decay_iters must be None or at least warmup_iters (100) and 1, got 0"),
    ("--lr_decay_iters=50", "at least warmup_iters (100)"),  # else warmup, then min_lr at once: no cosine
    ("--warmup_iters=0 --lr_decay_iters=0", "at least warmup_iters (0) and 1, got 0"),  # (0 would read as max_iters)
    ("--beta2=1.0", "beta1 and beta2 must be in"),
    ("--beta1=1.0", "beta1 and beta2 must be in"),
    ("--beta1=-0.1", "beta1 and beta2 must be in"),
    ("--dist_timeout=0", "dist_timeout must be positive seconds"),
    ("--dist_timeout=0.0004", "dist_timeout must be positive seconds, 1 to 1e6"),  # (a store that waits 0 ms)
    ("--dist_timeout=1000001", "dist_timeout must be positive seconds, 1 to 1e6"),
    ("--pad_vocab_to=65537", "pad_vocab_to rounds the vocabulary up to a multiple of it (64 on GPUs): at most"),
    ("--fsdp_shard_size=-1", "fsdp_shard_size must be >= 0"),
    ("--fsdp_shard_size=2", "it needs --strategy=fsdp"),
    ("--fsdp_reshard=false", "fsdp_reshard=False keeps FSDP's gathered weights from forward to backward: it needs"),
    *[(f"--{n}=zero3", f"{n} must be one of") for n in ("dtype", "backend", "strategy", "checkpoint_format")],
    ("--resume=somewhere", "resume must be 'auto', 'never' or a path"),
    ("--async_checkpoint=true", "it needs --checkpoint_format=sharded"),
    ("--init_from=resume --resume=never", "resume='never' forbids one"),
    ("--out_dir=", "out_dir must not be empty"),
    *[(f"--{n}={v}", f"{n} is not a path a file system takes") for n, v in (
        ("out_dir", LONG), ("dataset", LONG), ("data_dir", LONG), ("prepare_input", LONG), ("init_from", f"x/{LONG}"),
        ("resume", f"{LONG}.pt"), ("hellaswag_path", LONG), ("data_dir", "a\0b"))],
    # a run writes names of up to 64 bytes inside them: a path that takes no more failed after training, exit 1
    *[(f"--{n}={'/'.join(['x' * 200] * 21)[:4040]}", f"{n} is not a path a file system takes (a NUL byte, a name over "
       f"255 bytes or a path over 4032 with the names written in it)") for n in ("out_dir", "data_dir")],
])
def test_values_are_range_checked(args, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        resolve(args.split(" "))


def test_the_limits_themselves_are_allowed():
    for args in ("--min_lr=0", "--min_lr=6e-4 --learning_rate=6e-4", "--dist_timeout=1", "--dist_timeout=1e6",
                 "--pad_vocab_to=65536", "--warmup_iters=0 --lr_decay_iters=1", "--lr_decay_iters=100"):
        resolve(args.split(" "))


def test_a_home_the_shell_left_unexpanded_is_expanded(monkeypatch, tmp_path):
    """bash expands ~ only at a word's start: --out_dir=~/x came as it is, and each tool made a folder named ~ in
    the current folder (a resume there started afresh; --data_dir=~/d prepared Shakespeare into ./~/d)."""
    from errors import ArgumentParser
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = resolve(["--out_dir=~/runs/a", "--data_dir=~", "--dataset=shakespeare_char"])
    assert (cfg.out_dir, cfg.data_dir) == (f"{tmp_path}/runs/a", str(tmp_path))
    p = ArgumentParser()
    p.add_argument("--out_dir")
    p.add_argument("--start")
    args = p.parse_args(["--out_dir=~/runs/a", "--start=~/a prompt, not a path"])  # (--start='~': it sampled /root)
    assert (args.out_dir, args.start) == (f"{tmp_path}/runs/a", "~/a prompt, not a path")
    assert p.parse_args(["--out_d=~/b"]).out_dir == f"{tmp_path}/b"  # (abbreviated, as argparse allows)


def test_override_syntax_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="--n_layer=VALUE"):
        resolve(["--n_layer", "4"])
    with pytest.raises(ConfigError, match="neither a config file"):
        resolve(["n_layer=4"])
    with pytest.raises(ConfigError, match="cannot read config file"):
        resolve(["missing.py"])
    (tmp_path / "folder.py").mkdir()  # the shipped configs are listed for a missing file only
    with pytest.raises(ConfigError, match=f"^cannot read config file {tmp_path}/folder.py: Is a directory$"):
        resolve([str(tmp_path / "folder.py")])


def test_string_fields_take_the_raw_text():
    assert parse_value("out_dir", "2024") == "2024"
    assert parse_value("wandb_run_name", "None") == "None"
    assert parse_value("bias", "False") is False


def test_shipped_configs_resolve():
    from conftest import REPO
    for path in sorted((REPO / "configs").glob("*.py")):
        resolve([str(path)])
        assert path.read_text().startswith("# "), f"{path.name} needs its one-line command comment"


def test_every_config_name_is_documented_in_the_readme():
    from conftest import REPO
    readme = (REPO / "README.md").read_text()
    missing = [name for name in Config.__dataclass_fields__ if f"`{name}`" not in readme]
    assert not missing, f"README.md's config table lacks {missing}"


def test_readme_is_short_and_every_link_in_the_docs_resolves():
    import re
    from conftest import REPO
    assert len((REPO / "README.md").read_text().splitlines()) <= 250, "README.md grew past 250 lines"

    def anchors(path):  # GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}

    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{doc.name}: {target}")
    assert not broken, f"links to nothing: {broken}"


def test_the_legacy_local_rank_argument_is_taken_out_and_exported(monkeypatch):
    """torch.distributed.launch passes --local-rank=N (--local_rank N before torch 2.0) rather than setting
    LOCAL_RANK; torchrun's own LOCAL_RANK wins (test_launchers: the launcher itself)."""
    from world import strip_local_rank
    monkeypatch.setenv("LOCAL_RANK", "0")  # (so that its absence, or value, is what comes back after)
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_local_rank(["cfg.py", "--local-rank=1", "--max_iters=3"]) == ["cfg.py", "--max_iters=3"]
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.delenv("LOCAL_RANK")
    assert (strip_local_rank(["--local_rank", "2"]), os.environ["LOCAL_RANK"]) == ([], "2")
    assert (strip_local_rank(["--local_rank=3"]), os.environ["LOCAL_RANK"]) == ([], "2")


def test_setup_splits_the_global_batch_over_the_world_it_is_given():
    """world.setup's accumulation, FSDP shard groups and strategy for a world of 4 (test_bad_config: its refusals
    from a launcher; test_distributed: what the steps then compute)."""
    from world import World, setup

    def placed(size, *args):
        cfg = resolve(["--device=cpu", "--batch_size=4", "--global_batch_size=32", *args])
        return setup(cfg, claim=False, world=World(rank=size - 1, local_rank=size - 1, size=size, local_size=size))
    four = placed(4, "--strategy=fsdp", "--fsdp_shard_size=2")
    assert (four.accum, four.shard_size, four.strategy, four.rank) == (2, 2, "fsdp", 3)
    assert (placed(4, "--strategy=fsdp").shard_size, placed(2).accum) == (4, 4)
    assert (placed(1, "--strategy=fsdp").strategy, placed(1).accum) == ("ddp", 8)  # one process: nothing to shard
    with pytest.raises(ConfigError, match=r"fsdp_shard_size \(3\) must divide the world size \(4\): e\.g\. the "
                                          r"processes per host, 4"):
        placed(4, "--strategy=fsdp", "--fsdp_shard_size=3")
    with pytest.raises(ConfigError, match=r"by batch_size \(4\) x world size \(3\) = 12: try --global_batch_size=36 "
                                          r"\(a resume must keep 32: launch it on 2 processes, or another number that "
                                          r"divides 32\)$"):
        placed(3)  # (no smaller batch_size keeps 32 over 3 processes: the advice was a global batch no resume takes)
