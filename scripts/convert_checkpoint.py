"""Convert a sharded checkpoint (a .dcp folder) into the single-file format (a .pt file).

    python scripts/convert_checkpoint.py out/last.dcp out/last.pt

The folder is read in this one process through torch.distributed.checkpoint, whatever world
size wrote it, and written atomically as the file train.py writes with checkpoint_format=file:
the same keys, optimizer state by parameter position (and no RNG state: none is kept). A run resumes
from either (resume=auto takes the newest in out_dir); sample.py, eval.py and
scripts/export_hf.py read either. Bad input: one line on stderr, exit 2.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import checkpoint  # noqa: E402
from config import FIELD_TYPES, Config  # noqa: E402
from data.files import enclosing  # noqa: E402
from model import GPTConfig  # noqa: E402
from errors import ArgumentParser, ConfigError, first_line, reported, write_failure  # noqa: E402


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", type=Path, help="a sharded checkpoint folder, e.g. out/last.dcp")
    p.add_argument("dest", type=Path, help="the .pt file to write (replaced atomically if it exists, unless it "
                                           "holds a later step or another run's checkpoint: another model, "
                                           "vocabulary, seed or global_batch_size)")
    args = p.parse_args(argv)
    if args.source.suffix != ".dcp" or not args.source.is_dir():
        gone = args.source.suffix == ".dcp" and not args.source.exists() and not args.source.is_symlink()
        raise ConfigError(f"{args.source} " + ("does not exist" if gone else
                                               "is not a sharded checkpoint folder (NAME.dcp) train.py wrote"))
    if args.dest.suffix != ".pt":
        raise ConfigError(f"{args.dest}: name the file NAME.pt, as train.py and resume= expect")
    if enclosing(args.dest, ".dcp"):  # (a save replaces that folder)
        raise ConfigError(f"{args.dest} is inside a sharded checkpoint, which a save replaces: write it beside it")
    state = checkpoint.check_format(checkpoint.read(args.source), args.source)
    if missing := [k for k in checkpoint.REQUIRED if k not in state]:
        raise ConfigError(f"{args.source} lacks {missing}: it was not written by this train.py")
    try:  # what a resume checks of it, and finite numbers (a folder other code rewrote)
        cfg = Config(**{k: v for k, v in state["config"].items() if k in FIELD_TYPES})
        tensors = [*state["model"].values(), *(t for s in state["optimizer"]["state"].values() for t in s.values())]
        problem = GPTConfig(**state["model_args"]).size_problem(state["model"]) or \
            checkpoint.malformed(state, state["model_args"], cfg) or (
            None if all(torch.isfinite(t).all() for t in tensors) else "its weights or moments hold NaN or inf")
    except Exception as e:  # noqa: BLE001  model_args or a config no GPT of this repo has (a hand edit)
        problem = f"{type(e).__name__}: {first_line(e)}"
    if problem:
        raise ConfigError(f"{args.source}: {problem}: nothing converted")
    try:  # (out/last.pt after a switch from the sharded format is newer than out/last.dcp: it would be lost)
        held = checkpoint.read(args.dest, tensors=False) if args.dest.exists() else {}
    except ConfigError:  # not a checkpoint: replaced, as --help says
        held = {}
    held = held if isinstance(held, dict) else {}
    instead = f"write another file (e.g. {args.dest.with_name('converted.pt')}), or delete it first"
    if type(held.get("step")) is int and held["step"] > state["step"]:
        raise ConfigError(f"{args.dest} holds step {held['step']}, newer than {args.source}'s {state['step']}: "
                          f"{instead}")
    other_shape = isinstance(held.get("model_args"), dict) and checkpoint.shape_diff(held["model_args"],
                                                                                     state["model_args"])
    other_vocab = all(isinstance(x.get("vocab"), dict) for x in (held, state)) and held["vocab"] != state["vocab"]
    other_order = isinstance(held.get("config"), dict) and any(  # (what a resume refuses: another data order)
        held["config"].get(k) != state["config"].get(k) for k in checkpoint.DATA_ORDER)
    if other_shape or other_vocab or other_order:  # (not dropout, nor a field older files lack: the same model)
        raise ConfigError(f"{args.dest} holds another run's checkpoint (another model, vocabulary, seed or "
                          f"global_batch_size): {instead}")
    try:
        checkpoint.write(state, args.dest)
    except OSError as e:
        raise ConfigError(f"cannot write {args.dest}: {write_failure(e)}") from None
    n = state['world_size']
    print(f"{args.source} (step {state['step']}, written by {n} process{'es' * (n != 1)}) -> {args.dest}")


if __name__ == "__main__":
    with reported():
        main()
