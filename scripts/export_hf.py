"""Write a training run's checkpoint as a Hugging Face GPT-2 folder.

    python scripts/export_hf.py --out_dir=out-shakespeare --to=gpt2-shakespeare
    python scripts/export_hf.py --out_dir=out --checkpoint=last --to=hf-out

The folder holds config.json and model.safetensors and, when the run's dataset is GPT-2 BPE,
GPT-2's tokenizer files (vocab.json, merges.txt, tokenizer_config.json), so that

    from transformers import GPT2LMHeadModel, AutoTokenizer
    model = GPT2LMHeadModel.from_pretrained("gpt2-shakespeare")

loads it and computes the logits this repo computes. A character-level model is written too
(its vocabulary is meta.json's, which transformers has no tokenizer for). A model trained with
bias=False gets zero biases, which compute the same. Bad input: one line on stderr, exit 2.
"""

import json
import os
import sys
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from safetensors.torch import save  # noqa: E402

import checkpoint  # noqa: E402
import pretrained  # noqa: E402
from data.dataset import GPT2_EOT, has_shards  # noqa: E402
from data.files import atomic_write_bytes, enclosing, fsync_dir, preparing, read_json, same_path  # noqa: E402
from data.tokenizers import write_gpt2_tokenizer_files  # noqa: E402
from errors import ArgumentParser, ConfigError, first_line, reported, write_failure  # noqa: E402
from model import GPT  # noqa: E402

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def export(model: GPT, folder, gpt2_tokenizer: bool):
    """Write `model` as a Hugging Face GPT-2 folder: config.json, model.safetensors and, for a
    model of GPT-2's BPE, the tokenizer files (their names are returned). They are made in a temporary folder
    inside it, then moved in: a failure (a full disk, a damaged vocabulary file) leaves what was there as it was."""
    folder = Path(folder)
    parts = (p.name for p in (*folder.glob("model-*-of-*.safetensors"), *folder.glob("pytorch_model-*-of-*.bin")))
    stale = ("pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json", "tokenizer.json",
             "generation_config.json", "added_tokens.json", "special_tokens_map.json", *parts,  # (a download in parts)
             ) + TOKENIZER_FILES * (not gpt2_tokenizer)  # (the two: ids past the vocabulary)
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES, *stale):  # (else some were replaced first)
        if (folder / name).is_dir() and not (folder / name).is_symlink():
            raise ConfigError(f"{folder / name} is a folder, where the export writes or removes a file: move it away")
    cfg, eot = model.config, GPT2_EOT if gpt2_tokenizer else None  # (a character model has no end-of-text id)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
              "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
              "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new",
              "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
              "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
              "tie_word_embeddings": True, "bos_token_id": eot, "eos_token_id": eot}
    with made_for(folder):  # (its lock held throughout: another export's files are not removed by this one)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".export.", suffix=".tmp") as tmp:
            weights = save(pretrained.gpt2_to_hf(model), metadata={"format": "pt"})
            atomic_write_bytes(Path(tmp, "model.safetensors"), weights)
            atomic_write_bytes(Path(tmp, "config.json"), (json.dumps(config, indent=1) + "\n").encode())
            if gpt2_tokenizer:
                write_gpt2_tokenizer_files(tmp, cfg.block_size)
            made = sorted(p.name for p in Path(tmp).iterdir())
            for name in made:
                os.replace(Path(tmp, name), folder / name)
        for name in stale:  # an earlier export's or download's files would describe another model (or tokenizer)
            (folder / name).unlink(missing_ok=True)
        fsync_dir(folder)
    return made


@contextmanager
def made_for(folder: Path):
    """Make folder (and its parents) for the export, and remove those it made, while empty, if the export
    fails (one made meanwhile by another export into it is not empty, and stays). One export writes into
    it at a time (an flock on it), and removes the temporary folders a killed one left (a model's size each)."""
    first = next((p for p in reversed((folder, *folder.parents)) if not p.exists()), None)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with preparing(folder, "the export", "export"):  # (data.files: the lock and the stale temporaries)
            yield
    except BaseException:
        for made in [p for p in (folder, *folder.parents) if first is not None and p.is_relative_to(first)]:
            with suppress(OSError):  # (not empty: it stays, and so do the folders above it)
                made.rmdir()
        raise


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out_dir", default="out", help="the training run's folder (its checkpoints)")
    p.add_argument("--checkpoint", choices=("best", "last"), default="best",
                   help="best (the default; last when there is none) or last, .pt or .dcp (the newer)")
    p.add_argument("--to", required=True, help="the folder to write (created; files in it are replaced)")
    args = p.parse_args(argv)
    out_dir, to = Path(args.out_dir), Path(args.to)
    if not args.to:  # (an unset shell variable): it would write into the current folder
        raise ConfigError("--to is empty: give the folder to write")
    pretrained.run_folder(out_dir)
    mine = same_path(to, out_dir)
    try:  # the Hugging Face folder the run started from: its weights would be replaced
        written = read_json(out_dir / "config.json")  # (as logger.py writes it)
        start, ran_in = written["config"]["init_from"], written["run"].get("cwd", "")  # (a relative path: from there)
        began = start not in pretrained.RELEASED and pretrained.is_pretrained(start) and \
            same_path(to, os.path.join(ran_in, start))
    except (OSError, ValueError, LookupError, TypeError, AttributeError):  # (no config.json: an older run, a copy)
        began = False
    run = any((to / name).exists() for name in checkpoint.WRITTEN if name != "config.json") or any(to.glob("*.dcp"))
    named = to.suffix == ".pt" or enclosing(to, ".dcp") is not None  # (through a link too; a run's next save
    if mine or began or run or named:  # replaces it) a run's (its config.json), its init_from, or a checkpoint
        what = ("a checkpoint's name, or inside one" if named else "the run's own folder" if mine else
                "the folder the run started from (init_from)" if began else
                "a dataset folder" if (to / "train.bin").exists() or has_shards(to) else "another run's own folder")
        raise ConfigError(f"--to={to} is {what}: give another folder, of its own (files there are replaced)")
    model, meta, path, step = pretrained.load_model(out_dir, "cpu", prefer=args.checkpoint)
    try:
        made = export(model, to, gpt2_tokenizer=meta["tokenizer"] == "gpt2")
    except OSError as e:
        raise ConfigError(f"cannot write {to}: {write_failure(e)}") from None
    except ValueError as e:  # data/gpt2.tiktoken missing or damaged
        raise ConfigError(f"cannot write GPT-2's tokenizer files: {first_line(e)}") from None
    print(f"{path} (step {step}) -> {to}/ ({', '.join(made)})")  # (not a user's own files beside them)


if __name__ == "__main__":
    with reported():
        main()
