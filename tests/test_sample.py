"""sample.py on a checkpoint from a short run, in this process (its __main__ run by runpy)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from harness import REPO, SEPARATOR, child_env


@pytest.fixture
def sample(script):
    """sample.py's __main__ in this process: a CompletedProcess-like result."""
    return lambda *args: script("sample.py", *args)


def test_prints_the_requested_samples_and_the_same_seed_gives_the_same_text(trained, sample):
    args = [f"--out_dir={trained}", "--start=the king", "--num_samples=3", "--max_new_tokens=25"]
    first = sample(*args, "--seed=7")
    assert first.returncode == 0, first.stderr
    samples = first.stdout.split(SEPARATOR + "\n")[:-1]
    assert len(samples) == 3
    for text in samples:
        assert text.startswith("the king") and len(text) == len("the king") + 25 + 1  # + print's newline
    assert sample(*args, "--seed=7").stdout == first.stdout
    assert sample(*args, "--seed=8").stdout != first.stdout
    assert sample(*args, "--seed=7", "--init_from=resume").stdout == first.stdout  # nanoGPT's command line


def test_samples_generated_in_several_batches_are_independent_draws(trained, monkeypatch, capsys):
    """A request larger than CHUNK_BYTES runs as several generate calls: each drew from a generator
    seeded afresh, and every batch repeated the first one's text."""
    import sample as sample_py
    monkeypatch.setattr(sample_py, "CHUNK_BYTES", 1)  # one sample a batch
    sample_py.main([f"--out_dir={trained}", "--start=the king", "--num_samples=3", "--max_new_tokens=10", "--seed=7"])
    samples = capsys.readouterr().out.split(SEPARATOR + "\n")[:-1]
    assert len(samples) == 3 and len(set(samples)) == 3, samples


def test_the_checkpoints_own_vocabulary_decodes_not_a_meta_json_a_later_run_rewrote(trained_copy, tmp_path, sample):
    """out_dir/meta.json is the dataset's of the latest run into out_dir; the checkpoint keeps the
    characters it was trained on, and sample.py reads with those."""
    args = [f"--out_dir={trained_copy}", "--start=the king", "--num_samples=1", "--max_new_tokens=10", "--seed=7"]
    before = sample(*args)
    assert before.returncode == 0, before.stderr
    meta = json.loads((trained_copy / "meta.json").read_text())
    (trained_copy / "meta.json").write_text(json.dumps({**meta, "chars": meta["chars"][::-1]}))
    assert sample(*args).stdout == before.stdout
    alone = tmp_path / "alone"  # best.pt copied by itself: it needs no meta.json
    alone.mkdir()
    shutil.copy(trained_copy / "best.pt", alone)
    assert sample(*args, f"--out_dir={alone}").stdout == before.stdout


def test_prompt_from_a_file_and_greedy_decoding(trained, tmp_path, sample):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a fool ")
    args = [f"--out_dir={trained}", f"--start=FILE:{prompt}", "--num_samples=2",
            "--max_new_tokens=10", "--temperature=0"]
    a, b = sample(*args, "--seed=1"), sample(*args, "--seed=2")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout  # greedy ignores the seed
    first, second = a.stdout.split(SEPARATOR + "\n")[:2]
    assert first == second and first.startswith("a fool ")
    args[-1] = "--temperature=1e-40"  # so small that logits / temperature would overflow to inf
    assert sample(*args, "--seed=1").stdout == a.stdout  # the limit of sampling is greedy
    prompt.write_bytes(b"\xef\xbb\xbfa fool ")  # a byte-order mark (Windows' editors) is no character of it
    assert sample(*args, "--seed=1").stdout == a.stdout
    prompt.write_bytes(b"a fool\r\n")  # its own characters, as --start gives them (\r was read as \n)
    refused = sample(*args)
    assert refused.returncode == 2 and "characters not in the vocabulary: '\\r'" in refused.stderr


def test_top_k_larger_than_the_vocabulary_is_clamped_to_no_filtering(trained, sample):
    args = [f"--out_dir={trained}", "--start=the", "--num_samples=2", "--max_new_tokens=40", "--seed=3"]
    unfiltered = sample(*args, "--top_k=0")
    huge = sample(*args, "--top_k=100000")
    assert huge.returncode == 0, huge.stderr
    assert huge.stdout == unfiltered.stdout
    assert sample(*args, "--top_k=1").stdout != unfiltered.stdout  # top_k does act


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def older(out):
    """best.pt and last.pt as written before checkpoints kept their vocabulary: meta.json beside them has it."""
    for name in ("best.pt", "last.pt"):
        torch.save({k: v for k, v in torch.load(out / name, weights_only=True).items() if k != "vocab"}, out / name)
    return out


@pytest.mark.parametrize("args, message", [
    (["--out_dir=/nonexistent/out"], "out_dir /nonexistent/out does not exist: pass the run's folder with --out_dir"),
    ([lambda tmp: f"--out_dir={write(tmp / 'a_file', b'')}"],
     "a_file is not a folder: pass the run's folder with --out_dir"),
    (["--out_dir=" + "x" * 256], "the path xxxxxxxxxx"),  # (once a traceback: Path.is_dir raised)
    (["--start=FILE:" + "p" * 256], "is too long for the file system (a name over 255 bytes"),
    (["--max_new_tokens=0"], "--max_new_tokens must be positive, got 0"),
    (["--max_new_tokens=-5"], "--max_new_tokens must be positive, got -5"),
    (["--num_samples=0"], "--num_samples must be positive, got 0"),
    (["--start=the king{}é"], "characters not in the vocabulary: '{', '}', 'é'"),
    (["--temperature=-1"], "--temperature must be >= 0 and finite (0 = greedy), got -1.0"),
    (["--temperature=nan"], "--temperature must be >= 0"),
    (["--temperature=inf"], "--temperature must be >= 0 and finite"),
    (["--seed=99999999999999999999999"], "--seed must be a 64-bit integer"),
    ([f"--seed={2**64}"], "--seed must be a 64-bit integer"),  # (torch's own overflow, at the limits)
    ([f"--seed={-2**63 - 1}"], "--seed must be a 64-bit integer"),
    (["--top_k=-3"], "--top_k must be >= 0 (0 = no top-k filtering), got -3"),
    (["--device=tpu"], "device 'tpu' is not one this trainer runs on"),
    (["--start=FILE:/nonexistent/prompt.txt"], "prompt file /nonexistent/prompt.txt does not exist"),
    ([lambda tmp: f"--out_dir={tmp}", "--start=FILE:/no/prompt"], "prompt file /no/prompt"),  # (before the model)
    ([lambda tmp: f"--start=FILE:{tmp}"], "is a folder"),
    (["--start=FILE:"], "'FILE:' names no file: give --start=FILE:PATH (a text file)"),  # (was "prompt file .")
    (["--start=FILE:/proc/self/mem"], "cannot read prompt file /proc/self/mem: Input/output error"),  # (a traceback)
    (["--temperature=abc"], "argument --temperature: invalid float value: 'abc' (see sample.py --help)"),
    (["--start="], "the prompt is empty"),
    ([lambda tmp: f"--start=FILE:{write(tmp / 'empty.txt', b'')}"], "the prompt is empty"),
    ([lambda tmp: f"--start=FILE:{write(tmp / 'latin1.txt', b'caf' + bytes([0xE9]))}"],
     "is not UTF-8 text"),
    (["--start=caf\udce9"], "--start is not UTF-8 text"),  # b"caf\xe9" in argv, as Python decodes it
])
def test_bad_input_exits_with_a_clear_message(trained, tmp_path, sample, args, message):
    args = [a(tmp_path) if callable(a) else a for a in args]
    proc = sample(f"--out_dir={trained}", *args)
    code, err = proc.returncode, proc.stderr
    assert code == 2 and err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1


def test_every_byte_that_is_not_utf8_in_argv_is_refused():
    """Python keeps argv's bytes 0x80-0xff as the surrogates U+DC80-U+DCFF: both ends, not only a middle one."""
    import sample as sample_py
    from errors import ConfigError
    for byte in ("\udc80", "\udcff"):
        with pytest.raises(ConfigError, match="^--start is not UTF-8 text"):
            sample_py.read_prompt("caf" + byte)


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / "best.pt").unlink() or (out / "last.pt").unlink(), "no best.pt, last.pt or previous.pt in"),
    (lambda out: (out / "best.pt").rename(out / "ckpt.pt") and (out / "last.pt").unlink(),  # nanoGPT's
     "(nor a .dcp folder) (its ckpt.pt is nanoGPT's, which this repo does not read): train first"),
    (lambda out: [(out / f"{k}.pt").unlink(missing_ok=True) for k in ("best", "last", "previous")] and write(
        out / "model.safetensors", b"") and write(out / "config.json", b"{}"),  # an export's folder given as a run's
     "holds a Hugging Face model, not a training run: sample.py and eval.py take it as --init_from="),
    (lambda out: (older(out) / "meta.json").unlink(), "meta.json not found: copy the dataset's meta.json there"),
    (lambda out: (older(out) / "meta.json").unlink() or (out / "meta.json").mkdir(),
     "meta.json is not a file: move it out of the way, then copy the dataset's meta.json there"),
    (lambda out: (older(out) / "meta.json").write_text("[1, 2"), "meta.json is not valid JSON"),
    (lambda out: (older(out) / "meta.json").write_text("[" * 100_000),
     "meta.json is not valid JSON (maximum recursion"),
    (lambda out: (older(out) / "meta.json").write_text('{"format": 1}'),  # not "prepare" into the run's folder
     "vocab_size is None, which is missing or invalid: copy the dataset's meta.json there"),
    (lambda out: write(out / "best.pt", os.urandom(2000)) and write(out / "last.pt", b"PK\x03\x04"),
     "last.pt: it is truncated or not a torch checkpoint at all"),
    (lambda out: torch.save({"model": 1}, out / "best.pt") or (out / "last.pt").unlink(),
     "best.pt is not a GPT checkpoint of this repo (KeyError"),
    (lambda out: torch.save({k: v for k, v in torch.load(out / "last.pt", weights_only=True).items() if k != "step"}, out / "best.pt")
     or (out / "last.pt").unlink(), "best.pt is not a GPT checkpoint of this repo (KeyError: 'step')"),  # nanoGPT's
    (lambda out: torch.save({**(c := torch.load(out / "last.pt", weights_only=True)),  # 12 TB, were it built
                             "model_args": {**c["model_args"], "n_embd": 2**20}}, out / "best.pt")
     or (out / "last.pt").unlink(), "best.pt is not a GPT checkpoint of this repo (ValueError: its model_args"),
    (lambda out: torch.save({**(c := torch.load(out / "last.pt", weights_only=True)),  # a damaged .distcp's, converted
                             "model": {**c["model"], "transformer.ln_f.weight": c["model"]["transformer.ln_f.weight"]
                                       * float("nan")}}, out / "best.pt") or (out / "last.pt").unlink(),
     "best.pt is not a GPT checkpoint of this repo (ValueError: its weights hold NaN or inf, or no floats)"),
    (lambda out: torch.save({**(c := torch.load(out / "last.pt", weights_only=True)),  # 0 or 1: a hand edit, read as it
                             "model": {**c["model"], "transformer.ln_f.weight": c["model"]["transformer.ln_f.weight"]
                                       .bool()}}, out / "best.pt") or (out / "last.pt").unlink(),
     "best.pt is not a GPT checkpoint of this repo (ValueError: its weights hold NaN or inf, or no floats)"),
    (lambda out: torch.save({**(c := torch.load(out / "last.pt", weights_only=True)),  # finite, but they overflow
                             "model": {**c["model"], "transformer.h.0.mlp.c_fc.weight": c["model"][
                                 "transformer.h.0.mlp.c_fc.weight"] * 1e30}}, out / "best.pt"),  # (a flipped bit)
     "best.pt (step 10): its logits are NaN or inf: weights out of range (a damaged file?)"),  # (argmax: token 0)
    *[(lambda out, vocab=vocab: torch.save({**torch.load(out / "last.pt", weights_only=True), "vocab": vocab},
                                           out / "best.pt") or (out / "last.pt").unlink(),
       f"best.pt is not a GPT checkpoint of this repo (ValueError: its vocab {vocab!r} is not a tokenizer's name and "
       "characters)") for vocab in ({"tokenizer": "char", "chars": "ab"}, {"tokenizer": "bpe"}, {"tokenizer": "char"})],
])
def test_a_broken_out_dir_is_a_clear_error(trained_copy, tmp_path, sample, damage, message):
    out = trained_copy
    (out / "previous.pt").unlink()  # else the damaged ones fall back to it
    damage(out)
    proc = sample(f"--out_dir={out}")
    code, err = proc.returncode, proc.stderr
    assert code == 2 and err.splitlines()[-1].startswith("error: ") and message in err, err


def test_a_damaged_best_checkpoint_falls_back_to_last_then_previous(trained_copy, tmp_path, sample):
    out = trained_copy
    write(out / "best.pt", os.urandom(5000))
    proc = sample(f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=5")
    assert proc.returncode == 0, proc.stderr
    assert f"warning: cannot read checkpoint {out / 'best.pt'}" in proc.stderr
    assert f"# {out / 'last.pt'} (step 10)" in proc.stderr
    (out / "last.pt").unlink()  # a kill between rotating and committing a sharded save leaves only previous
    proc = sample(f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=5")
    assert proc.returncode == 0 and f"# {out / 'previous.pt'} (step 5)" in proc.stderr, proc.stderr


def test_checkpoint_last_samples_the_newest_run_when_best_is_older(trained_copy, sample):
    out, args = trained_copy, ["--num_samples=1", "--max_new_tokens=5"]
    shutil.copy(out / "previous.pt", out / "best.pt")  # the val loss stopped improving at step 5
    assert f"# {out / 'best.pt'} (step 5)" in sample(f"--out_dir={out}", *args).stderr
    proc = sample(f"--out_dir={out}", "--checkpoint=last", *args)
    assert proc.returncode == 0 and f"# {out / 'last.pt'} (step 10)" in proc.stderr, proc.stderr
    (out / "last.pt").unlink()  # not best in its place: the one asked for is missing
    proc = sample(f"--out_dir={out}", "--checkpoint=last", *args)
    assert proc.returncode == 2 and proc.stderr == f"error: no last.pt or last.dcp in {out}: use --checkpoint=best, " \
                                                   f"or train first\n", proc.stderr
    proc = sample("--init_from=gpt2", "--checkpoint=last")
    assert proc.returncode == 2 and "--init_from=gpt2 and --checkpoint=last both name the model" in proc.stderr
    run = out.rename(out.with_name("run.dcp"))  # a run's folder of that name (its config.json): not a checkpoint
    assert sample(f"--out_dir={run}", *args).returncode == 0


def test_sample_with_a_prompt_and_output_far_past_block_size_finishes(trained, tmp_path, sample):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the king speaks softly. " * 10)  # 240 characters, block_size 16
    proc = sample(f"--out_dir={trained}", f"--start=FILE:{prompt}", "--num_samples=2", "--max_new_tokens=2000",
                  "--device=cpu")
    assert proc.returncode == 0, proc.stderr
    samples = [s for s in proc.stdout.split(SEPARATOR) if s.strip()]
    assert len(samples) == 2 and all(len(s.strip("\n")) == 240 + 2000 for s in samples)


def test_a_prompt_from_a_pipe_and_a_default_prompt_the_vocabulary_lacks(trained, tmp_path, sample, monkeypatch):
    """FILE: takes a pipe (FILE:/dev/stdin once said "does not exist"); a vocabulary without a
    newline is told that the default --start is one (it read as a character the user never gave)."""
    import threading

    import data.tokenizers
    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)
    threading.Thread(target=fifo.write_text, args=("the king",), daemon=True).start()
    proc = sample(f"--out_dir={trained}", f"--start=FILE:{fifo}", "--num_samples=1", "--max_new_tokens=5")
    assert proc.returncode == 0 and proc.stdout.startswith("the king"), proc.stderr
    real = data.tokenizers.tokenizer_from_meta

    def without_newline(meta):
        encode, decode = real(meta)

        def encode_without(text):
            if "\n" in text:
                raise ValueError("characters not in the vocabulary: '\\n'")
            return encode(text)
        return encode_without, decode
    monkeypatch.setattr(data.tokenizers, "tokenizer_from_meta", without_newline)
    proc = sample(f"--out_dir={trained}")
    assert proc.returncode == 2 and proc.stderr.endswith(
        "(the default --start, a newline: give --start=TEXT)\n"), proc.stderr

    def no_bpe_file(meta):  # the hint was added to any tokenizer error, this one too
        raise ValueError("GPT-2 BPE file /tmp (from $GPT2_TIKTOKEN_FILE) is a folder")
    monkeypatch.setattr(data.tokenizers, "tokenizer_from_meta", no_bpe_file)
    proc = sample(f"--out_dir={trained}")
    assert proc.returncode == 2 and proc.stderr == "error: GPT-2 BPE file /tmp (from $GPT2_TIKTOKEN_FILE) is a folder\n"


def test_text_the_terminal_cannot_encode_is_escaped_not_a_traceback(trained, sample, script, char_data, tmp_path,
                                                                     monkeypatch):
    """PYTHONIOENCODING=ascii (or a C locale) and a sample with a character outside it: sample.py
    printed a UnicodeEncodeError's traceback after generating; now the character is written \\x.. escaped.
    So does every tool (eval.py printed its traceback after the whole evaluation: a --data_dir's name)."""
    import io

    import data.tokenizers
    real = data.tokenizers.tokenizer_from_meta
    monkeypatch.setattr(data.tokenizers, "tokenizer_from_meta",
                        lambda meta: (real(meta)[0], lambda ids: "caf\u00e9 " + real(meta)[1](ids)))
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr("sys.stdout", ascii_out)
    proc = sample(f"--out_dir={trained}", "--start=the", "--num_samples=1", "--max_new_tokens=5")
    ascii_out.flush()
    assert proc.returncode == 0, proc.stderr
    assert ascii_out.buffer.getvalue().startswith(b"caf\\xe9 the")
    named = tmp_path / "caf\u00e9"
    named.symlink_to(char_data)
    proc = script("eval.py", f"--out_dir={trained}", f"--data_dir={named}", "--no_hellaswag", "--val_windows=2")
    ascii_out.flush()
    assert proc.returncode == 0 and b"caf\\xe9 val loss " in ascii_out.buffer.getvalue(), proc.stderr


@pytest.mark.slow  # a process of its own: its stdout is the full device
@pytest.mark.parametrize("tool", ["sample.py", "scripts/plot_runs.py"])
def test_output_onto_a_full_disk_is_one_line(trained, tmp_path, tool):
    """`python sample.py > samples.txt` on a full disk was a traceback; plot_runs.py said "[Errno 28] No space
    left on device", exit 2, its picture written."""
    args = {"sample.py": [f"--out_dir={trained}", "--max_new_tokens=5"],
            "scripts/plot_runs.py": [trained, f"--out={tmp_path / 'runs.png'}"]}[tool]
    with open("/dev/full", "w") as full:
        ran = subprocess.run([sys.executable, tool, *map(str, args)], cwd=REPO, env=child_env(), stdout=full,
                             stderr=subprocess.PIPE, text=True, timeout=300)
    lines = ran.stderr.splitlines()
    assert ran.returncode == 1 and lines[-1] == ("error: the output could not be written (No space left on device): "
                                                 "free disk space where stdout goes"), ran.stderr
    assert not any("Traceback" in line or "Exception ignored" in line for line in lines), ran.stderr
