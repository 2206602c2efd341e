"""Trained models to use: OpenAI's released GPT-2 in Hugging Face's format, the way back out to
that format, and a training run's checkpoint loaded for sample.py, eval.py and the export script.

init_from may name a released model (gpt2, gpt2-medium, gpt2-large, gpt2-xl: 124M to 1.5B parameters), taken from the
local Hugging Face cache or downloaded into it, or a folder holding a Hugging Face GPT-2 model (config.json and
model.safetensors, or pytorch_model.bin, read with weights_only=True). transformers is not needed: safetensors reads
the weights, huggingface_hub finds or fetches them, and gpt2_from_hf/gpt2_to_hf map the names (scripts/export_hf.py
writes a checkpoint as such a folder, which transformers' GPT2LMHeadModel.from_pretrained loads).

Under several processes train.py's rank 0 reads and the other ranks receive, as for a resume, so
other hosts need no copy (eval.py loads on every rank).
"""

import difflib
import functools
import warnings
from contextlib import suppress
from pathlib import Path

import torch
import torch.nn.functional as F

import checkpoint
from data.dataset import GPT2_META, GPT2_VOCAB_SIZE, load_meta
from data.files import read_json, same_path
from errors import ConfigError, UnreadableCheckpoint, first_line, load_failure
from model import GPT, GPTConfig

RELEASED = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# GPT-2 in Hugging Face's layout (transformers' GPT2LMHeadModel): the same names, under
# "transformer." (older files drop the prefix); Conv1D layers store their weight as (in, out),
# the transpose of nn.Linear's; attention mask buffers (".attn.bias", ".attn.masked_bias") are
# not weights; lm_head.weight is the token embedding.

HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_from_hf(hf_state, model, positions: int = None):
    """`model`'s state dict from a Hugging Face GPT-2 state dict, every name checked one to one.

    The position table (of `positions` rows, config.json's n_positions, when given) is cropped to
    model's block_size and the token rows padded to its padded vocabulary. Raises ValueError
    naming the first tensor that is missing, extra, of another shape, or not finite floats."""
    expected = model.state_dict()
    got = {}
    for name, tensor in hf_state.items():
        name = name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name
        if name in got:  # (else one of the two would be dropped unseen)
            raise ValueError(f"the GPT-2 weights hold {name} twice, with and without the 'transformer.' prefix")
        if not name.endswith((".attn.bias", ".attn.masked_bias")):  # the causal mask buffers
            got[name] = tensor.t() if name.endswith(HF_TRANSPOSED) else tensor
    # tied to wte in GPT-2: a file may hold it again (or alone: safetensors' save_model keeps that name), not another
    lm_head = got.pop("lm_head.weight", None)
    if lm_head is not None and not torch.equal(lm_head, got.setdefault("transformer.wte.weight", lm_head)):
        raise ValueError("the GPT-2 weights hold an lm_head.weight other than wte.weight (an untied output "
                         "layer): this GPT ties the two, as GPT-2 does")
    names = expected.keys() - {"lm_head.weight"}
    for problem, found in (("lack", sorted(names - got.keys())), ("hold an unknown tensor", sorted(got.keys() - names))):
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise ValueError(f"the GPT-2 weights {problem} {found[0]}{more}")
    cfg, rows = model.config, got["transformer.wpe.weight"].shape[0]
    if positions not in (None, rows):  # else the crop below would hide it
        raise ValueError(f"transformer.wpe.weight has {rows} rows in the GPT-2 weights, but config.json gives "
                         f"n_positions={positions}: the two come from different models")
    got["transformer.wpe.weight"] = got["transformer.wpe.weight"][:cfg.block_size]
    wte = got["transformer.wte.weight"]
    if wte.shape[0] == cfg.vocab_size:
        got["transformer.wte.weight"] = F.pad(wte, (0, 0, 0, cfg.padded_vocab_size - cfg.vocab_size))
    for name in (n for n in expected if n in names):  # in the model's order: the first misfit is named
        if got[name].shape != expected[name].shape:
            raise ValueError(f"{name} has shape {tuple(got[name].shape)} in the GPT-2 weights, but "
                             f"{tuple(expected[name].shape)} in a GPT of n_layer={cfg.n_layer}, "
                             f"n_head={cfg.n_head}, n_embd={cfg.n_embd}, vocab_size={cfg.vocab_size}")
        if not got[name].is_floating_point() or not torch.isfinite(got[name]).all():  # (and a run's: load_model)
            raise ValueError(f"{name} holds NaN or inf, or no floats, in the GPT-2 weights: a damaged file; fetch or "
                             f"export it again")
    state = {name: got[name].to(torch.float32).contiguous() for name in expected if name in names}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def gpt2_to_hf(model):
    """A Hugging Face GPT-2 state dict of `model` (lm_head left out: transformers ties it to
    wte). GPT-2 always has biases; a model without them gets zeros, which compute the same."""
    cfg, state = model.config, {}
    for name, tensor in model.state_dict().items():
        tensor = tensor[:cfg.vocab_size] if name == "transformer.wte.weight" else tensor
        if name != "lm_head.weight":
            state[name] = (tensor.t() if name.endswith(HF_TRANSPOSED) else tensor).detach().float().contiguous().clone()
    if not cfg.bias:
        for name, tensor in list(state.items()):
            if name.endswith(".weight") and not name.endswith(("wte.weight", "wpe.weight")):
                out = tensor.shape[-1] if name.endswith(HF_TRANSPOSED) else tensor.shape[0]
                state[name[:-len("weight")] + "bias"] = torch.zeros(out)
    return state


def is_pretrained(init_from: str) -> bool:
    return init_from not in ("scratch", "resume")


def weight_file(folder: Path):
    """The folder's GPT-2 weight file (safetensors first), or None."""
    return next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)


def is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and weight_file(folder) is not None


def near_gpt2_name(name: str) -> str:
    """": did you mean 'gpt2'?" for a name near a known one (gpt2-small, the hub's openai-community/gpt2), or ""."""
    bare = name.lower().removeprefix("openai-community/")  # (gpt2-XL; gpt2-small, or gpt2-smal, is 'gpt2')
    close = [] if "/" in bare else difflib.get_close_matches(bare, ["scratch", "resume", *RELEASED, "gpt2-small"], n=1)
    close = [c.removesuffix("-small") for c in close]
    return close and close[0] != name and f": did you mean '{close[0]}'{' (train.py)' * (close[0] == 'scratch')}?" or ""


@functools.lru_cache(maxsize=None)  # model_args() and load_state() both ask: look (or download) once
def locate(init_from: str) -> Path:
    """The folder of a released model (from the Hugging Face cache, else downloaded) or a path."""
    if init_from not in RELEASED:
        folder = Path(init_from)
        if not is_model_folder(folder):
            hint = (" (its weights are in shards, which are not read: save it with a larger max_shard_size)"
                    if (folder / "model.safetensors.index.json").exists() else
                    " (a checkpoint of this repo's: sample.py reads a run's folder as --out_dir, train.py continues"
                    " it with --resume=PATH)" if folder.exists() and (folder.suffix in (".pt", ".dcp")
                                                                     or any(folder.glob("last.*"))) else
                    "" if folder.exists() else near_gpt2_name(init_from))
            raise ConfigError(f"init_from {init_from}: no Hugging Face GPT-2 model there (a folder with "
                              f"config.json and model.safetensors or pytorch_model.bin){hint}")
        return folder
    from huggingface_hub import snapshot_download
    wanted = dict(repo_id=RELEASED[init_from], allow_patterns=["config.json", "model.safetensors"])

    def complete(folder) -> Path:  # a cached snapshot may hold config.json alone (a tokenizer's download)
        if not is_model_folder(Path(folder)):
            raise FileNotFoundError(f"{folder} lacks config.json or model.safetensors")
        return Path(folder)
    with suppress(Exception):  # not in the cache: fetch it
        return complete(snapshot_download(**wanted, local_files_only=True))
    try:
        return complete(snapshot_download(**wanted))
    except Exception as e:  # noqa: BLE001 - offline, blocked, no such repo
        raise ConfigError(
            f"{init_from} is not in the Hugging Face cache and cannot be downloaded here "
            f"({type(e).__name__}: {first_line(e, 120)}): on a machine with a network run `hf download "
            f"{RELEASED[init_from]} config.json model.safetensors --local-dir {init_from}` (`huggingface-cli "
            f"download` before huggingface_hub 1.0) and pass --init_from=./{init_from} (a path), or copy its "
            f"cache (~/.cache/huggingface/hub)") from None


def gpt2_shape(init_from: str) -> dict:
    """read_shape of a released GPT-2 or a Hugging Face folder, which must be of GPT-2's BPE: the one
    tokenizer init_from brings (an export of a character-level run is not)."""
    shape = read_shape(locate(init_from))
    if shape["vocab_size"] != GPT2_VOCAB_SIZE:
        raise ConfigError(f"{init_from} has a vocabulary of {shape['vocab_size']} tokens, not GPT-2's BPE "
                          f"({GPT2_VOCAB_SIZE}): init_from takes GPT-2 BPE models only (a run of other tokens "
                          f"is used, or goes on, from its own checkpoint: --out_dir)")
    return shape


def read_shape(folder: Path) -> dict:
    """GPTConfig fields from a GPT-2 config.json; an error for variants model.py does not build."""
    where = folder / "config.json"
    try:
        hf = read_json(where)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} cannot be read: {first_line(e)}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{where} holds a JSON {type(hf).__name__}, not GPT-2's settings (an object)")
    checks = {"model_type": ("gpt2",), "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
              "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
              "add_cross_attention": (False,), "layer_norm_epsilon": (1e-5,), "tie_word_embeddings": (True,)}
    for key, allowed in checks.items():
        if (key in hf or key == "model_type") and hf.get(key) not in allowed:  # model_type is required
            raise ConfigError(f"{where}: {key}={hf.get(key)!r}, but this GPT is GPT-2's "
                              f"architecture ({key} in {allowed})")
    names = dict(n_layer="n_layer", n_head="n_head", n_embd="n_embd", block_size="n_positions", vocab_size="vocab_size")
    bad = next((n for n in names.values() if type(hf.get(n)) is not int or hf[n] < 1), None)
    if bad:
        raise ConfigError(f"{where} holds {bad}={hf.get(bad)!r}: GPT-2's config.json gives "
                          f"{', '.join(names.values())} as whole numbers of at least 1")
    shape = {ours: hf[theirs] for ours, theirs in names.items()}
    if shape["n_embd"] % shape["n_head"] or hf.get("n_inner") not in (None, 4 * shape["n_embd"]):
        raise ConfigError(f"{where}: n_embd={shape['n_embd']} with n_head={shape['n_head']} and "
                          f"n_inner={hf.get('n_inner')}, but GPT-2 splits n_embd evenly among its heads and its MLP "
                          f"is 4 x n_embd wide (n_inner null or {4 * shape['n_embd']})")
    # Before a model of that shape is built (n_layer=10**6 would not fit in memory): no weight file
    # holds under a byte a weight. A smaller mismatch is named tensor by tensor in gpt2_from_hf.
    weights, n_embd = weight_file(folder), shape["n_embd"]
    params = shape["n_layer"] * 12 * n_embd ** 2 + (shape["vocab_size"] + shape["block_size"]) * n_embd
    if params > weights.stat().st_size:
        raise ConfigError(f"{where} describes a model of {params:,} weights, but {weights} holds "
                          f"{weights.stat().st_size:,} bytes: cut short (an interrupted copy?) or another model's")
    return shape


def model_args(cfg, meta: dict) -> dict:
    """The run's model arguments: the config's shape on the dataset's vocabulary, or GPT-2's (read here, on rank 0).
    A resume of a run started from GPT-2 takes GPT-2's dimensions from its checkpoint: the files may go."""
    if cfg.init_from != "scratch" and (resumed := resumed_shape(cfg)):
        return {**cfg.model_args(meta["vocab_size"]), **resumed}
    if not is_pretrained(cfg.init_from):
        return cfg.model_args(meta["vocab_size"])
    shape = gpt2_shape(cfg.init_from)
    if cfg.block_size > shape["block_size"]:
        raise ConfigError(f"block_size {cfg.block_size} is longer than {cfg.init_from}'s {shape['block_size']} "
                          f"positions: use --block_size={shape['block_size']} or less (the table is cropped)")
    if not cfg.bias:
        raise ConfigError(f"{cfg.init_from} has biases in every Linear and LayerNorm: --bias=false cannot load it")
    if meta["vocab_size"] != shape["vocab_size"] or meta["tokenizer"] != "gpt2":
        raise ConfigError(f"{cfg.init_from} reads GPT-2 BPE tokens ({shape['vocab_size']} of them), but the dataset "
                          f"is {meta['tokenizer']} with {meta['vocab_size']}: use a GPT-2 BPE dataset, "
                          f"e.g. --dataset=shakespeare")
    return {**cfg.model_args(meta["vocab_size"]), **shape, "block_size": cfg.block_size}  # (bias: checked True)


def resumed_shape(cfg):
    """n_layer, n_head and n_embd of the checkpoint a resume takes first if its run started from GPT-2 (from
    cfg.init_from, or any with init_from=resume); else None (checkpoint.resume reports what is wrong with it)."""
    for path in checkpoint.find(cfg):
        try:
            saved = checkpoint.read(path, tensors=False)
            start = saved["config"]["init_from"]  # (a folder: by its path, however it is spelled)
            same = isinstance(start, str) and is_pretrained(start) and (cfg.init_from in (start, "resume") or (
                cfg.init_from not in RELEASED and same_path(start, cfg.init_from)))
            return {k: saved["model_args"][k] for k in ("n_layer", "n_head", "n_embd")} if same else None
        except (ConfigError, LookupError, TypeError):  # unreadable or not one of ours: the next one
            continue
    return None


def load_state(init_from: str, model: GPT) -> dict:
    """`model`'s state dict from GPT-2's weights, every tensor name and shape checked."""
    path = weight_file(folder := locate(init_from))
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(path)
        else:
            with warnings.catch_warnings():  # (torch warns of an old pickle protocol before refusing it)
                warnings.simplefilter("ignore")
                state = torch.load(path, map_location="cpu", weights_only=True)
        return gpt2_from_hf(state, model, read_shape(folder)["block_size"])
    except ValueError as e:
        raise ConfigError(f"{path}: {first_line(e, 400)}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file, or one that would run code
        raise ConfigError(f"cannot read {path} ({load_failure(e)})") from None


def load_gpt(init_from: str, device="cpu", shape: dict = None) -> GPT:
    """A released or local GPT-2 as our GPT, in eval mode (for sampling); `shape`: its read_shape."""
    shape = shape or read_shape(locate(init_from))
    model = GPT(GPTConfig(**shape, bias=True, dropout=0.0))
    model.load_state_dict(load_state(init_from, model))
    return model.eval().to(device)


def add_source_args(parser):
    """sample.py's and eval.py's --out_dir and --init_from: where the model comes from (check_source)."""
    parser.add_argument("--out_dir", help="a run's folder (default: out): its best (else last) checkpoint")
    parser.add_argument("--checkpoint", choices=("best", "last"), help="which of out_dir's (default: best)")
    parser.add_argument("--init_from", default="", help="gpt2, gpt2-medium, -large, -xl or a Hugging Face folder")


def check_source(args):
    """--out_dir or --init_from (resume: nanoGPT's name for --out_dir's run), not both, checked before loading."""
    args.init_from = "" if args.init_from == "resume" else args.init_from
    if args.init_from and (args.out_dir is not None or args.checkpoint):
        raise ConfigError(f"--init_from={args.init_from} and --{'checkpoint' if args.checkpoint else 'out_dir'}="
                          f"{args.checkpoint or args.out_dir} both name the model: give one")
    if not args.init_from:
        args.out_dir = run_folder("out" if args.out_dir is None else args.out_dir)


def run_folder(out_dir) -> Path:
    """sample.py's, eval.py's and scripts/export_hf.py's --out_dir, checked before anything is loaded."""
    path = Path(out_dir)
    if not path.is_dir() or path.suffix == ".dcp" and not (path / "config.json").exists():  # (.dcp: a checkpoint)
        what = "is a checkpoint" if path.suffix in (".dcp", ".pt") else "is not a folder"
        raise ConfigError(f"out_dir {out_dir} {what if path.exists() else 'does not exist'}: "
                          f"pass the run's folder with --out_dir (or train first: python train.py)")
    return path


def load_model(out_dir: Path, device, prefer: str = "best") -> tuple:
    """(model in eval mode, its vocabulary as meta.json's, path, step) of a training run, for sample.py,
    eval.py and scripts/export_hf.py: best, else last (or the other way round), else previous, of either format."""
    kinds = (("best", "last") if prefer == "best" else ("last", "best")) + ("previous",)
    paths = [p for kind in kinds for p in checkpoint.newest([out_dir / f"{kind}.pt", out_dir / f"{kind}.dcp"])]
    if not paths and is_model_folder(out_dir):
        raise ConfigError(f"{out_dir} holds a Hugging Face model, not a training run: sample.py and eval.py take it "
                          f"as --init_from={out_dir}")
    if prefer == "last" and not any(p.stem == "last" for p in paths):
        raise ConfigError(f"no last.pt or last.dcp in {out_dir}: use --checkpoint=best, or train first")
    if not paths:
        nanogpt = " (its ckpt.pt is nanoGPT's, which this repo does not read)" * (out_dir / "ckpt.pt").exists()
        raise ConfigError(f"no best.pt, last.pt or previous.pt in {out_dir} (nor a .dcp folder){nanogpt}: train "
                          f"first, or pass --out_dir")

    def build(path):
        ckpt = checkpoint.read(path)
        try:
            config = GPTConfig(**ckpt["model_args"])  # (its dropout: eval mode applies none; an export records it)
            if problem := config.size_problem(ckpt["model"]):
                raise ValueError(problem)
            if not all(w.is_floating_point() and torch.isfinite(w).all() for w in ckpt["model"].values()):
                raise ValueError("its weights hold NaN or inf, or no floats")  # (rewritten by other code)
            model = GPT(config)
            model.load_state_dict(ckpt["model"])
            vocab = ckpt.get("vocab", {})  # (older files hold none)
            if not (isinstance(vocab, dict) and all(isinstance(v, str) for v in vocab.values())
                    and vocab.get("tokenizer", "gpt2") in ("char", "gpt2")
                    and (vocab.get("tokenizer") != "char" or len(vocab.get("chars", "")) == config.vocab_size)):
                raise ValueError(f"its vocab {vocab!r} is not a tokenizer's name and characters")
            return model, ckpt["step"], path, vocab
        except Exception as e:  # plain data, but not a checkpoint of this repo's GPT (nanoGPT's has no step)
            raise UnreadableCheckpoint(f"{path} is not a GPT checkpoint of this repo "
                                       f"({type(e).__name__}: {first_line(e)})") from None

    model, step, path, vocab = checkpoint.read_first(paths, build)
    if "tokenizer" in vocab:  # the checkpoint's own: any later run into out_dir rewrites meta.json
        return model.eval().to(device), {**vocab, "vocab_size": model.config.vocab_size}, path, step
    try:  # older files keep their vocabulary only in the meta.json beside them
        meta = load_meta(out_dir, fix="copy the dataset's meta.json there (train.py copied it from the dataset)")
    except (OSError, ValueError) as e:  # (missing: FileNotFoundError)
        raise ConfigError(str(e)) from None
    if meta["vocab_size"] != model.config.vocab_size:
        raise ConfigError(f"{out_dir / 'meta.json'} has a vocabulary of {meta['vocab_size']} tokens but {path} was "
                          f"trained with {model.config.vocab_size}: they come from different runs")
    return model.eval().to(device), meta, path, step


def load_for_text(init_from: str, out_dir, device, prefer: str = None) -> tuple:
    """(model in eval mode, its tokenizer's meta, a name for it) for sample.py and eval.py: a training
    run's checkpoint in out_dir, or (init_from) GPT-2's weights. A Hugging Face folder brings no
    tokenizer here but GPT-2's BPE, so its vocabulary must be GPT-2's."""
    if not init_from:
        model, meta, path, step = load_model(Path(out_dir), device, prefer or "best")
        return model, meta, f"{path} (step {step})"
    shape = gpt2_shape(init_from)  # refused before its weights are read
    return load_gpt(init_from, device, shape), dict(GPT2_META), init_from
