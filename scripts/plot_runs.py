"""Overlay the loss curves of training runs, from their metrics.jsonl, without wandb.

    python scripts/plot_runs.py out-1proc out-2proc out-4proc --out=runs.png
    python scripts/plot_runs.py out --labels=baseline --out=loss.png

Left: train loss (each logged step, lines) and val loss (each eval, markers) against the step;
middle: the same against tokens seen, so runs with different batch sizes line up; and when a
run evaluated HellaSwag (hellaswag_interval), a third panel of its acc_norm against the step,
beside GPT-2 124M's score by the same scorer. Each run is labelled by its folder name with
its world size from config.json when present, or by --labels.
Folders of the same name (exp1/out, exp2/out) are labelled by their paths. A folder without
metrics.jsonl, or with no loss in it, is one line on stderr and exit 2; an unreadable line in
it (cut short by a kill) is skipped with a warning, as train.py does on a resume.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.files import atomic_write, read_json, why_unreadable  # noqa: E402
from errors import ArgumentParser, ConfigError, reported, write_failure  # noqa: E402
from logger import read_metrics  # noqa: E402

GPT2_124M_ACC_NORM = 0.2955  # llm.c dev/data/hellaswag.py, completion style (docs/eval.md)


def read_run(out_dir: Path) -> dict:
    """Train and val points (step, tokens seen, loss) of one run; the last line wins per step
    (a resumed run may log a step again)."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():  # (a pipe would wait for a writer)
        raise ConfigError(f"{path} {why_unreadable(path) or 'is not a file'}: give the out_dir of a training run")
    train, val, hellaswag, tokens_per_step = {}, {}, {}, None
    for row in read_metrics(path, "skipped"):
        # an edit's "high", or 1e308 (matplotlib cannot lay an axis out to it), is not plotted
        row = {k: v for k, v in row.items() if type(v) in (int, float) and abs(v) < 1e15}
        if "step" not in row:
            continue
        if row["step"] and row.get("tokens_seen"):
            tokens_per_step = row["tokens_seen"] / row["step"]
        if "loss" in row:
            train[row["step"]] = row["loss"]
        if "val_loss" in row:
            val[row["step"]] = row["val_loss"]
        if "hellaswag_acc_norm" in row:
            hellaswag[row["step"]] = row["hellaswag_acc_norm"]
    if not train and not val:
        raise ConfigError(f"{path} holds no train or val loss yet")
    world = None
    config = out_dir / "config.json"
    if config.is_file():
        try:
            run = read_json(config)["run"]
            numbers = {k: v for k, v in run.items() if type(v) is int and v > 0}  # an edit's {"a": 1} is not one
            world, tokens_per_step = numbers.get("world_size"), numbers.get("tokens_per_step") or tokens_per_step
        except (ValueError, TypeError, KeyError, AttributeError):  # not train.py's: the label goes without
            pass
    return dict(train=sorted(train.items()), val=sorted(val.items()), hellaswag=sorted(hellaswag.items()),
                tokens_per_step=tokens_per_step, world=world)


def plot(runs: dict, out: Path):
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # a label (a folder's name) with $...$ is text, not TeX
    import matplotlib.pyplot as plt
    panels = 3 if any(r["hellaswag"] for r in runs.values()) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    for i, (label, r) in enumerate(runs.items()):
        # runs that agree lie on top of each other: each gets its own dash and a thinner line
        color, dash, width = f"C{i % 10}", ("-", "--", ":", "-.")[i % 4], max(0.8, 2.6 - 0.6 * i)
        per = r["tokens_per_step"] or 0
        for ax, x in ((axes[0], lambda s: s), (axes[1], lambda s: s * per)):
            if ax is axes[1] and not per:
                continue
            if r["train"]:
                ax.plot([x(s) for s, _ in r["train"]], [v for _, v in r["train"]], dash, color=color, alpha=0.7,
                        linewidth=width, label=f"{label} train", marker="." if len(r["train"]) == 1 else None)
            if r["val"]:
                ax.plot([x(s) for s, _ in r["val"]], [v for _, v in r["val"]], "osd^"[i % 4], color=color,
                        markersize=8 - 1.5 * (i % 4), fillstyle="none", label=f"{label} val")
        if r["hellaswag"]:
            axes[2].plot([s for s, _ in r["hellaswag"]], [v for _, v in r["hellaswag"]], dash + "osd^"[i % 4],
                         color=color, linewidth=width, fillstyle="none", label=label)
    for ax, xlabel in ((axes[0], "optimizer step"), (axes[1], "tokens seen")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if panels == 3:  # llm.c's completion-style score of GPT-2 124M, the scorer evals/hellaswag.py follows
        axes[2].axhline(GPT2_124M_ACC_NORM, color="r", linestyle="--", label=f"GPT-2 124M ({GPT2_124M_ACC_NORM})")
        axes[2].axhline(0.25, color="gray", linestyle=":", label="chance (0.25)")
        axes[2].set_xlabel("optimizer step")
        axes[2].set_ylabel("HellaSwag acc_norm")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    try:  # whole or not at all: a full disk once left a cut-short picture in place of the last one
        atomic_write(out, lambda f: fig.savefig(f, dpi=120, format="png"))
    finally:
        plt.close(fig)


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dirs", nargs="+", help="training runs' out_dir folders")
    p.add_argument("--out", default="runs.png", help="the PNG to write")
    p.add_argument("--labels", default="", help="comma-separated labels, one per folder")
    args = p.parse_args(argv)
    if (out := Path(args.out)).suffix.lower() != ".png":
        raise ConfigError(f"--out={out}: give a .png file name")
    labels = args.labels.split(",") if args.labels else []
    if labels and len(labels) != len(args.out_dirs):
        raise ConfigError(f"--labels has {len(labels)} name{'s' * (len(labels) > 1)} for {len(args.out_dirs)} folders")
    if len(set(labels)) < len(labels):
        raise ConfigError(f"--labels={args.labels} repeats a name: give each run its own")
    names = [Path(os.path.realpath(folder)).name for folder in args.out_dirs]  # (".": the folder's own name)
    if len(set(names)) < len(names):  # exp1/out, exp2/out: the paths tell them apart
        names = [os.path.realpath(folder) for folder in args.out_dirs]
    if len(set(names)) < len(names):
        raise ConfigError("a folder is given twice: give each run once")
    runs = {}
    for i, folder in enumerate(args.out_dirs):
        r = read_run(Path(folder))
        label = labels[i] if labels else names[i] + (f" (W={r['world']})" if r["world"] else "")
        runs[label.encode("utf-8", "backslashreplace").decode()] = r  # (a name's non-UTF-8 bytes as \udcff)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(runs, out)
    except PermissionError:  # errors.reported's line, as every tool's
        raise
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {write_failure(e)}") from None
    print(f"{len(runs)} run{'s' if len(runs) > 1 else ''} -> {out}")


if __name__ == "__main__":
    with reported():  # (the picture that cannot be written is a ConfigError, a full stdout one line)
        main()
