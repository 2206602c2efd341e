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

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pretrained  # noqa: E402
from errors import ArgumentParser, ConfigError, first_line, reported  # noqa: E402


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
    mine = os.path.realpath(to) == os.path.realpath(out_dir)  # (Path.resolve raises on a link loop)
    if mine or (to / "run.lock").exists() or to.suffix == ".dcp":  # a run's (its config.json) or a checkpoint
        what = "a sharded checkpoint" if to.suffix == ".dcp" else f"{'the' if mine else 'another'} run's own folder"
        raise ConfigError(f"--to={to} is {what}: give another folder, of its own (files there are replaced)")
    model, meta, path, step = pretrained.load_model(out_dir, "cpu", prefer=args.checkpoint)
    try:
        pretrained.export(model, to, gpt2_tokenizer=meta["tokenizer"] == "gpt2")
    except OSError as e:
        raise ConfigError(f"cannot write {to}: {e.strerror or e}") from None
    except ValueError as e:  # data/gpt2.tiktoken missing or damaged
        raise ConfigError(f"cannot write GPT-2's tokenizer files: {first_line(e)}") from None
    files = ", ".join(sorted(f.name for f in to.iterdir() if not f.name.startswith(".")))
    print(f"{path} (step {step}) -> {to}/ ({files})")


if __name__ == "__main__":
    with reported():
        main()
