"""checkpoint_format = "sharded": torch.distributed.checkpoint folders (last.dcp), in one process.

Exactness across formats, the converter, the readers, and every way a .dcp folder can be bad.
The same on several processes, resharded across world sizes and strategies: tests/test_fsdp.py;
a rank that does not see the folder: tests/test_fsdp.py; a full disk under async saves:
tests/test_reliability.py."""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from errors import UnreadableCheckpoint
from sharded import TMP, Background, _MetadataUnpickler
from harness import ckpt, no_temporaries, small_disk, tiny_args, train_here

SAME = dict(max_iters=12, eval_interval=4, lr_decay_iters=12)  # one schedule for every leg


@pytest.fixture(scope="module")
def straight(char_data, tmp_path_factory):
    """An uninterrupted file-format run: last.pt at 12, previous.pt at 8."""
    out = tmp_path_factory.mktemp("straight")
    train_here(char_data, out, **SAME)
    return out


@pytest.fixture(scope="module")
def sharded(char_data, tmp_path_factory):
    """A sharded run: last.dcp at 12, previous.dcp at 8, best.dcp. Copy it before damaging it."""
    out = tmp_path_factory.mktemp("sharded")
    train_here(char_data, out, checkpoint_format="sharded", **SAME)
    return out


def untimed(log: str) -> list:
    return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_sec", "mfu")}
            for line in log.splitlines()]


def same_state(a: dict, b: dict, path=""):
    """Two checkpoints alike in every tensor (bit for bit, dtype included) and value, the config
    names that differ between the legs of a run aside."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), path
        for k in a:
            if k == "log":  # metrics.jsonl's rows so far: the same, but for how fast each run went
                assert untimed(a[k]) == untimed(b[k]), path
            elif k not in ("out_dir", "checkpoint_format", "async_checkpoint", "resume", "max_iters"):
                same_state(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def test_formats_alternate_through_resumes_and_end_bit_identical(char_data, tmp_path, straight, sharded, script):
    """file 0->4, sharded + async 4->8, file 8->12 (resume=auto reading the newest, last.dcp),
    each bit for bit on the uninterrupted run; a sharded run holds the file run's very state;
    the converter writes the file the file format would have written."""
    out = tmp_path / "mixed"
    train_here(char_data, out, **{**SAME, "max_iters": 4})
    train_here(char_data, out, resume="auto", checkpoint_format="sharded", async_checkpoint=True,
               **{**SAME, "max_iters": 8})
    assert ckpt(out, "last.dcp")["step"] == 8 and ckpt(out, "last.pt")["step"] == 4
    ran = script("train.py", *tiny_args(char_data, out, resume="auto", **SAME))
    assert ran.returncode == 0 and f"resuming from {out / 'last.dcp'} at step 8" in ran.stdout, ran.stderr
    same_state(ckpt(out), ckpt(straight))
    same_state(ckpt(sharded, "last.dcp"), ckpt(straight))
    assert ckpt(sharded, "previous.dcp")["step"] == 8 and ckpt(sharded, "best.dcp")["step"] == 12
    assert sorted(p.name for p in (sharded / "last.dcp").iterdir()) == [".metadata", "__0_0.distcp", "run.json"]
    assert no_temporaries(sharded) and no_temporaries(out)
    ran = script("scripts/convert_checkpoint.py", out / "last.dcp", tmp_path / "eight.pt")
    assert ran.returncode == 0 and "(step 8, written by 1 process)" in ran.stdout, ran.stderr
    same_state(torch.load(tmp_path / "eight.pt", weights_only=True), ckpt(straight, "previous.pt"))


def test_metadata_pickled_under_python_3_13_reads(sharded, monkeypatch):
    """DCP's checkpoint_id is a PosixPath, whose class Python 3.13 pickles as pathlib._local.PosixPath:
    every sharded checkpoint written there was refused as damaged."""
    import io
    import pathlib
    import sys
    import types
    with open(sharded / "last.dcp" / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if "pathlib._local" not in sys.modules:  # before 3.13: name the class as 3.13 does
        monkeypatch.setitem(sys.modules, "pathlib._local", types.ModuleType("pathlib._local"))
        monkeypatch.setattr(sys.modules["pathlib._local"], "PosixPath", pathlib.PosixPath, raising=False)
        monkeypatch.setattr(pathlib.PosixPath, "__module__", "pathlib._local")
    data = pickle.dumps(metadata)
    assert b"pathlib._local" in data and isinstance(metadata.storage_meta.checkpoint_id, pathlib.PosixPath)
    assert _MetadataUnpickler(io.BytesIO(data)).load().storage_meta.checkpoint_id == metadata.storage_meta.checkpoint_id


@pytest.mark.parametrize("edit", ["a part outside", "a chunk dropped", "a chunk past the end"])
def test_metadata_naming_a_part_outside_its_folder_or_not_all_of_a_tensor_is_damaged(sharded, tmp_path, edit):
    """(A crafted .metadata that named previous.dcp's part read step 8's tensors under step 12's run.json;
    one whose chunks left part of a tensor unread loaded torch.empty's garbage there.)"""
    from sharded import parts
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    with open(out / "last.dcp" / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for info in metadata.storage_data.values():
        info.relative_path = f"../previous.dcp/{info.relative_path}" if edit == "a part outside" else \
            info.relative_path
    wte = metadata.state_dict_metadata["model.transformer.wte.weight"]
    if edit == "a chunk dropped":
        wte.chunks = wte.chunks[:-1]
    elif edit == "a chunk past the end":
        wte.chunks[0].offsets = torch.Size([1, 0])
    (out / "last.dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnreadableCheckpoint, match=r"its metadata is damaged \(ValueError: a tensor's entry is not a "
                                                   r"size, a dtype, the chunks of it and a file in the folder\)$"):
        parts(out / "last.dcp")


def test_sample_and_export_read_a_sharded_run(sharded, tmp_path, script):
    ran = script("sample.py", f"--out_dir={sharded}", "--num_samples=1", "--max_new_tokens=10", "--device=cpu")
    assert ran.returncode == 0 and len(ran.stdout.strip()) >= 10, ran.stderr
    ran = script("scripts/export_hf.py", f"--out_dir={sharded}", "--checkpoint=last", f"--to={tmp_path / 'hf'}")
    assert ran.returncode == 0 and "last.dcp (step 12)" in ran.stdout, ran.stderr
    for tool in ("sample.py", "eval.py", "scripts/export_hf.py"):  # (was "no best.pt ... in out/last.dcp")
        ran = script(tool, f"--out_dir={sharded / 'last.dcp'}", *[f"--to={tmp_path / 'hf'}"] * ("export" in tool))
        assert ran.returncode == 2 and ran.stderr == (f"error: out_dir {sharded / 'last.dcp'} is a checkpoint: pass "
                                                      f"the run's folder with --out_dir (or train first: python "
                                                      f"train.py)\n"), ran.stderr


class Exploit:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/sharded-exploit-ran"),))


def damage(kind: str, last: Path):
    if kind == "no metadata":  # a save killed before rank 0 finished it
        (last / ".metadata").unlink()
    elif kind == "no run.json":
        (last / "run.json").unlink()
    elif kind == "a rank's part missing":
        (last / "__0_0.distcp").unlink()
    elif kind == "a part cut short":
        os.truncate(last / "__0_0.distcp", 1000)
    elif kind == "a part one byte short":  # its last tensor's last byte gone
        os.truncate(last / "__0_0.distcp", (last / "__0_0.distcp").stat().st_size - 1)
    elif kind == "a part's data zeroed":  # complete by its size: only reading its tensors finds it
        (last / "__0_0.distcp").write_bytes(bytes((last / "__0_0.distcp").stat().st_size))
    elif kind == "a bit flipped in a part":  # its tensors load: only their CRC-32 tells
        data = bytearray((last / "__0_0.distcp").read_bytes())
        data[len(data) // 2] ^= 1
        (last / "__0_0.distcp").write_bytes(data)
    elif kind == "a part's zip directory damaged":  # a record's disk number: zipfile reads on, torch.load does not
        data = bytearray((last / "__0_0.distcp").read_bytes())
        data[data.find(b"PK\x01\x02") + 34] ^= 0x10
        (last / "__0_0.distcp").write_bytes(data)
    elif kind == "metadata that runs code":
        (last / ".metadata").write_bytes(pickle.dumps(Exploit()))
    elif kind == "metadata naming torch.hub.load":  # a torch global, but no metadata class
        (last / ".metadata").write_bytes(b"\x80\x04\x8c\x05torch\x94\x8c\x08hub.load\x94\x93\x94.")
    elif kind == "metadata naming torch.save":
        (last / ".metadata").write_bytes(b"\x80\x04\x8c\x05torch\x94\x8c\x04save\x94\x93\x94.")
    elif kind in ("metadata of other types", "metadata naming a part by a number"):  # DCP's classes, other values
        with open(last / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()  # (DCP's classes only, as a resume reads it)
        if kind == "metadata of other types":
            metadata.storage_data = {k: 1 for k in metadata.storage_data}
        else:  # (a path joined with a number raised a TypeError)
            for info in metadata.storage_data.values():
                info.relative_path = 7
        (last / ".metadata").write_bytes(pickle.dumps(metadata))
    elif kind == "metadata garbage":
        (last / ".metadata").write_bytes(b"not a pickle")
    elif kind == "run.json of another shape":
        (last / "run.json").write_text("{}")


@pytest.mark.parametrize("kind, message", [
    ("no metadata", ".metadata is missing; the save that wrote it did not finish"),
    ("no run.json", "run.json is missing; the save that wrote it did not finish"),
    ("a rank's part missing", "__0_0.distcp (one rank's part) is missing"),
    ("a part cut short", "__0_0.distcp is cut short"),
    ("a part one byte short", "__0_0.distcp is cut short"),
    ("a part's data zeroed", "rank 0: __0_0.distcp is damaged at byte 0: not what torch.save writes"),
    ("a bit flipped in a part", "fails its CRC-32 check"),
    ("a part's zip directory damaged", "is damaged at byte 0: not what torch.save writes (PytorchStreamReader failed "
                                       "reading zip archive: unsupported multidisk archive)"),  # once miniz's advice
    ("metadata that runs code", "it names pathlib.Path.touch"),
    ("metadata naming torch.hub.load", "it names torch.hub.load, which a sharded checkpoint of this repo never holds"),
    ("metadata naming torch.save", "it names torch.save, which a sharded checkpoint of this repo never holds"),
    ("metadata garbage", "its metadata is damaged"),
    ("metadata of other types", "its metadata is damaged (AttributeError: 'int' object has no attribute"),
    ("metadata naming a part by a number", "its metadata is damaged (ValueError: a tensor's entry is not a size, a "
                                           "dtype, the chunks of it and a file in the folder)"),
    ("run.json of another shape", "run.json does not hold a run's state"),
])
def test_a_bad_sharded_checkpoint_is_one_line_and_auto_falls_back_to_previous(
        char_data, sharded, tmp_path, script, kind, message):
    Path("/tmp/sharded-exploit-ran").unlink(missing_ok=True)  # left by an earlier failure: not this run's
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    damage(kind, out / "last.dcp")
    files = {p: p.read_bytes() for p in (out / "last.dcp").iterdir()}
    ran = script("train.py", *tiny_args(char_data, out, resume=str(out / "last.dcp"), **SAME))
    error = ran.stderr.strip().splitlines()[-1]
    assert ran.returncode == 2 and error.startswith(f"error: cannot read checkpoint {out / 'last.dcp'}: "), ran.stderr
    assert message in error and "Traceback" not in ran.stderr
    assert error.endswith(": give --resume=PATH of one that reads, or --resume=never")  # (it said what was
    # wrong, not what to do)
    assert {p: p.read_bytes() for p in (out / "last.dcp").iterdir()} == files  # nothing overwritten
    ran = script("train.py", *tiny_args(char_data, out, resume="auto", checkpoint_format="sharded",
                                        **SAME))
    assert ran.returncode == 0 and message in ran.stderr and f"resuming from {out / 'previous.dcp'} at step 8" in ran.stdout
    assert ckpt(out, "last.dcp")["step"] == 12
    assert ckpt(out, "previous.dcp")["step"] == 8  # the damaged last.dcp did not replace it
    assert not Path("/tmp/sharded-exploit-ran").exists()


@pytest.mark.parametrize("thing", ["a pipe", "a file", "a link to nothing"])
def test_a_last_dcp_that_is_no_folder_is_replaced_at_the_first_save(char_data, sharded, tmp_path, capsys, thing):
    """A pipe made the save wait for ever (rmtree opened it), deaf to SIGTERM; a file was left behind as
    .last.dcp.old.tmp (and said to lack run.json); a link to nothing failed every save ("Not a directory")."""
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    shutil.rmtree(out / "last.dcp")
    {"a pipe": os.mkfifo, "a file": lambda p: p.write_text("x"),
     "a link to nothing": lambda p: p.symlink_to("nowhere")}[thing](out / "last.dcp")
    train_here(char_data, out, resume="auto", checkpoint_format="sharded", **{**SAME, "max_iters": 16})
    assert [ckpt(out, f"{k}.dcp")["step"] for k in ("previous", "last")] == [12, 16] and no_temporaries(out)
    if thing != "a link to nothing":  # (which is no checkpoint at all)
        assert f"cannot read checkpoint {out / 'last.dcp'}: it is not a folder\n" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    ({"param_groups": []}, "param_groups are not AdamW's two groups of this model's parameters"),
    ({"param_groups": [5]}, "param_groups are not AdamW's two groups of this model's parameters"),
])
def test_a_hand_edited_run_json_is_one_line(char_data, sharded, tmp_path, script, edit, message):
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    run_json = out / "last.dcp" / "run.json"
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), **edit}))
    ran = script("train.py", *tiny_args(char_data, out, resume=str(out / "last.dcp"), **SAME))
    assert ran.returncode == 2 and message in ran.stderr.splitlines()[-1] and "Traceback" not in ran.stderr, ran.stderr
    if "param_groups" in edit:  # the tools read the tensors: one line too, and sample.py takes previous.dcp
        ran = script("scripts/convert_checkpoint.py", out / "last.dcp", tmp_path / "x.pt")
        assert ran.returncode == 2 and ran.stderr.startswith(f"error: cannot read checkpoint {out / 'last.dcp'}: "
                                                             f"its run.json or .metadata is not"), ran.stderr
        shutil.rmtree(out / "best.dcp", ignore_errors=True)
        ran = script("sample.py", f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=2")
        assert ran.returncode == 0 and f"# {out / 'previous.dcp'} (step 8)" in ran.stderr, ran.stderr


def test_the_converter_checks_a_folder_before_writing(sharded, tmp_path, script, monkeypatch):
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    for source in (out / "last.pt", out / "metrics.jsonl"):  # (no last.pt here: the file format's name)
        ran = script("scripts/convert_checkpoint.py", source, tmp_path / "x.pt")
        assert ran.returncode == 2 and ran.stderr == (f"error: {source} is not a sharded checkpoint folder (NAME.dcp) "
                                                      f"train.py wrote\n"), ran.stderr
    ran = script("scripts/convert_checkpoint.py", out / "gone.dcp", tmp_path / "x.pt")  # (was "is not a ... folder")
    assert ran.returncode == 2 and ran.stderr == f"error: {out / 'gone.dcp'} does not exist\n", ran.stderr
    ran = script("scripts/convert_checkpoint.py", out / "last.dcp", tmp_path / "x.bin")  # resume= would not take it
    assert ran.returncode == 2 and ran.stderr == (f"error: {tmp_path / 'x.bin'}: name the file NAME.pt, as train.py "
                                                  f"and resume= expect\n"), ran.stderr
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(out / "last.dcp")
    for inside in (out / "last.dcp" / "x.pt", tmp_path / "link" / "x.pt"):  # (a save took it)
        ran = script("scripts/convert_checkpoint.py", out / "last.dcp", inside)
        assert ran.returncode == 2 and ran.stderr == (f"error: {inside} is inside a sharded checkpoint, which a save "
                                                      f"replaces: write it beside it\n"), ran.stderr
    ran = script("scripts/convert_checkpoint.py", out / "last.dcp", tmp_path / "file" / "x.pt")  # was "File exists"
    assert ran.returncode == 2 and ran.stderr == (f"error: cannot write {tmp_path / 'file' / 'x.pt'}: it is a file, "
                                                  f"or lies under one\n"), ran.stderr
    assert not (tmp_path / "x.bin").exists()
    run_json = out / "last.dcp" / "run.json"
    # a format this train.py does not read was converted (the resume of the file then refused it); a billion
    # layers in model_args were built on the meta device before the weights were compared (a hang, memory growing)
    for edit, says in (({"format": 7}, "checkpoint format 7 is not 1, which this train.py reads"),
                       ({"model_args": {"n_layer": 10**9}}, "its model_args describe 12,704,000,001,312 parameters")):
        saved = json.loads(run_json.read_text())
        run_json.write_text(json.dumps({**saved, **{k: {**saved[k], **v} if isinstance(v, dict) else v
                                                    for k, v in edit.items()}}))
        ran = script("scripts/convert_checkpoint.py", out / "last.dcp", tmp_path / "x.pt")
        assert ran.returncode == 2 and says in ran.stderr and "Traceback" not in ran.stderr, ran.stderr
        run_json.write_text(json.dumps(saved))
    run_json.write_text(json.dumps({k: v for k, v in json.loads(run_json.read_text()).items() if k != "step"}))
    ran = script("scripts/convert_checkpoint.py", out / "last.dcp", tmp_path / "x.pt")
    assert ran.returncode == 2 and "lacks ['step']: it was not written by this train.py" in ran.stderr, ran.stderr
    assert not (tmp_path / "x.pt").exists()
    # values a resume refuses (a hand edit) were converted, "written by {'a': 1} processes"
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "step": [1, 1, 1], "world_size": {"a": 1}}))
    ran = script("scripts/convert_checkpoint.py", out / "last.dcp", tmp_path / "x.pt")
    assert ran.returncode == 2 and ran.stderr == (f"error: {out / 'last.dcp'}: step [1, 1, 1] or world_size {{'a': 1}} "
                                                  f"is not a whole number: nothing converted\n"), ran.stderr
    # a shard rewritten whole (its CRC-32 right) with a NaN moment
    import checkpoint
    real = checkpoint.read

    def damaged(path, tensors=True):
        state = real(path, tensors)
        next(iter(state["optimizer"]["state"].values()))["exp_avg"].view(-1)[0] = float("nan")
        return state
    monkeypatch.setattr(checkpoint, "read", damaged)
    ran = script("scripts/convert_checkpoint.py", out / "previous.dcp", tmp_path / "x.pt")
    assert ran.returncode == 2 and ran.stderr == (f"error: {out / 'previous.dcp'}: its weights or moments hold NaN or inf: "
                                                  f"nothing converted\n"), ran.stderr
    assert not (tmp_path / "x.pt").exists()


def test_the_converter_does_not_replace_a_newer_checkpoint(sharded, tmp_path, script):
    """(convert out/last.dcp out/last.pt after a switch to the file format lost the newer last.pt)"""
    assert script("scripts/convert_checkpoint.py", sharded / "last.dcp", tmp_path / "x.pt").returncode == 0  # step 12
    before = (tmp_path / "x.pt").read_bytes()
    ran = script("scripts/convert_checkpoint.py", sharded / "previous.dcp", tmp_path / "x.pt")  # step 8
    assert ran.returncode == 2 and ran.stderr == (
        f"error: {tmp_path / 'x.pt'} holds step 12, newer than {sharded / 'previous.dcp'}'s 8: write another file "
        f"(e.g. {tmp_path / 'converted.pt'}), or delete it first\n"), ran.stderr
    assert (tmp_path / "x.pt").read_bytes() == before
    assert script("scripts/convert_checkpoint.py", sharded / "last.dcp", tmp_path / "x.pt").returncode == 0  # same step
    earlier = {**torch.load(tmp_path / "x.pt", weights_only=True), "step": 1}
    for key, value in (("model_args", {"n_layer": 7}), ("vocab", {"chars": "ab"}), ("config", {"seed": 7}),
                       ("config", {"global_batch_size": 64})):  # another run's, of an earlier step
        torch.save({**earlier, key: {**earlier[key], **value}}, tmp_path / "x.pt")
        ran = script("scripts/convert_checkpoint.py", sharded / "last.dcp", tmp_path / "x.pt")
        assert ran.returncode == 2 and ran.stderr == (
            f"error: {tmp_path / 'x.pt'} holds another run's checkpoint (another model, vocabulary, seed or "
            f"global_batch_size): write another file (e.g. {tmp_path / 'converted.pt'}), or delete it first\n"), \
            ran.stderr
    # this run's, with another dropout and without a field older files lack: replaced, as a resume would take it
    args = {k: v for k, v in earlier["model_args"].items() if k != "pad_vocab_to"}
    torch.save({**earlier, "model_args": {**args, "dropout": 0.3}}, tmp_path / "x.pt")
    assert script("scripts/convert_checkpoint.py", sharded / "last.dcp", tmp_path / "x.pt").returncode == 0
    (tmp_path / "x.pt").write_bytes(b"junk")  # no checkpoint at all: replaced too, as --help says
    assert script("scripts/convert_checkpoint.py", sharded / "last.dcp", tmp_path / "x.pt").returncode == 0
    assert torch.load(tmp_path / "x.pt", weights_only=True)["step"] == 12


@pytest.mark.slow  # mount and umount are processes
def test_the_converter_onto_a_full_disk_is_one_line(sharded, tmp_path, script):
    with small_disk(tmp_path / "disk", "64k") as disk:  # torch's zip writer said "unexpected pos 57408 vs 57360"
        ran = script("scripts/convert_checkpoint.py", sharded / "last.dcp", disk / "x.pt")
        assert ran.returncode == 2 and ran.stderr.startswith(f"error: cannot write {disk / 'x.pt'}: No space left on "
                                                             f"device: a checkpoint takes about"), ran.stderr
        assert ran.stderr.count("\n") == 1 and list(disk.iterdir()) == []


def test_a_background_save_whose_folder_is_gone_still_ends_with_its_failure(tmp_path):
    """Explaining the failure looked at the folder's free space and raised in DCP's callback:
    the save never finished, and the run waited for it for ever."""
    from concurrent.futures import Future
    future = Future()
    background = Background(future, tmp_path / "gone", None, step=5, need=100)
    future.set_exception(OSError(2, "No such file or directory"))
    assert background.finished.wait(timeout=10)
    assert background.failure(wait=True) == "FileNotFoundError: [Errno 2] No such file or directory"


def test_a_save_on_a_full_disk_measures_the_space_before_its_part_goes(tmp_path, monkeypatch):
    """The part written was deleted first, its space freed and found enough: "make out_dir writable", the line
    said (torch's zip writer reports a write cut short as "unexpected pos", with no errno)."""
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp
    import sharded
    from model import GPT, GPTConfig
    from world import World
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=16))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu", fused=False)

    def cut_short(state, storage_writer, **kwargs):
        (tmp_path / TMP / "__0_0.distcp").write_bytes(b"the part written")
        raise dcp.api.CheckpointException("save", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})
    monkeypatch.setattr(dcp, "save", cut_short)
    full = lambda folder: SimpleNamespace(free=0 if (tmp_path / TMP).exists() else 1e9)  # noqa: E731 (till it goes)
    monkeypatch.setattr(shutil, "disk_usage", full)
    with pytest.raises(OSError, match=r"^rank 0: No space left on device: a checkpoint takes about 0\.0 MB, 0\.0 MB"):
        sharded.save_run(model, optimizer, {"step": 5}, tmp_path, False, World())
    assert not (tmp_path / TMP).exists()


def test_a_background_save_that_fails_stops_the_run_at_the_next_log_step(char_data, tmp_path, monkeypatch):
    """Not at the next save, eval_interval steps later: every step in between is work no checkpoint keeps."""
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp
    import train
    from errors import CheckpointNotWritten

    def failed(*args, **kwargs):
        future = Future()
        future.set_exception(OSError(28, "No space left on device"))
        return future
    monkeypatch.setattr(dcp, "async_save", failed)
    steps, step = [], train.optimizer_step
    monkeypatch.setattr(train, "optimizer_step", lambda run: steps.append(run.step) or step(run))
    with pytest.raises(CheckpointNotWritten, match=r"at step 4 \(OSError: \[Errno 28\] No space left on device\); no "):
        train_here(char_data, tmp_path / "out", checkpoint_format="sharded", async_checkpoint=True, log_interval=2,
                   **SAME)
    assert steps == [0, 1, 2, 3, 4, 5]  # saved at 4; step 6's agreement found the failure


def test_a_save_killed_at_any_moment_leaves_a_complete_checkpoint(char_data, sharded, tmp_path, script, monkeypatch):
    """Killed while writing: .last.dcp.tmp is left and last.dcp untouched; killed between the
    commit's renames: no last.dcp, but previous.dcp, which resume=auto takes. The commit's renames
    are made durable: out_dir is fsync'd once last.dcp is in place, and each part's bytes before that."""
    import os
    import sharded as module
    synced, files, fsync = [], set(), os.fsync
    monkeypatch.setattr(module, "fsync_dir", lambda folder: synced.append((Path(folder) / "last.dcp").is_dir()))
    monkeypatch.setattr(os, "fsync", lambda fd: files.add(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    shutil.copytree(out / "last.dcp", out / TMP)
    (out / TMP / ".metadata").unlink()
    (out / "last.dcp").rename(tmp_path / "moved")  # as if killed after last -> previous
    shutil.rmtree(out / "previous.dcp")
    (tmp_path / "moved").rename(out / "previous.dcp")
    ran = script("train.py", *tiny_args(char_data, out, resume="auto", checkpoint_format="sharded",
                                        **{**SAME, "max_iters": 16}))
    assert ran.returncode == 0, ran.stderr
    assert f"removed {out / TMP}" in ran.stdout
    assert f"resuming from {out / 'previous.dcp'} at step 12" in ran.stdout
    assert ckpt(out, "last.dcp")["step"] == 16 and ckpt(out, "previous.dcp")["step"] == 12
    assert synced and all(synced)  # (every save's commit)
    parts = {p.name for p in (out / "last.dcp").iterdir() if p.suffix == ".distcp"}
    assert parts and parts | {".metadata.tmp"} <= files  # (DCP's sync_files; .metadata is written, synced, renamed)


def test_a_sharded_checkpoint_holds_the_tied_embedding_once_and_resume_step_is_the_first_readables(sharded):
    import checkpoint
    import sharded as module
    keys = module.parts(sharded / "last.dcp")[1].state_dict_metadata  # (GPT-2 124M's lm_head: 150 MB a save)
    assert "model.transformer.wte.weight" in keys and "model.lm_head.weight" not in keys
    steps = [ckpt(sharded, f"{name}.dcp")["step"] for name in ("last", "previous")]
    assert steps[0] > steps[1] and [checkpoint.resume_step([sharded / f"{a}.dcp", sharded / f"{b}.dcp"]) for a, b in (
        ("last", "previous"), ("previous", "last"))] == steps  # (rank 0's: another host's must not be newer)
    assert checkpoint.resume_step([sharded / "nothing.dcp", sharded / "previous.dcp"]) == steps[1]


def test_a_sharded_checkpoint_of_another_shape_is_refused(char_data, sharded, tmp_path, script):
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    ran = script("train.py", *tiny_args(char_data, out, resume="auto", n_embd=64, **SAME))
    assert ran.returncode == 2 and "holds another model shape" in ran.stderr.splitlines()[-1], ran.stderr


def test_a_save_before_the_first_step_counts_no_adamw_step():
    """get_optimizer_state_dict steps a fresh optimizer with lr 0 to make its moments: under FSDP in float16
    (skipped steps; its AdamW not fused) a save before the first real step counted one, so that step was
    bias-corrected as the second, and the run differed from one that saved elsewhere."""
    import parallel
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    models = [GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16)) for _ in range(3)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=False) for m in models]
    tensors, _ = parallel.sharded_state(models[0], optimizers[0])  # saved before any step
    assert tensors["optimizer"] and all(float(s["step"]) == 0 for s in tensors["optimizer"].values())
    # as full_state saves a file under FSDP: its gathered copies are not the optimizer's own step tensors
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    parallel.optimizer_state(models[2], optimizers[2], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    x = torch.randint(0, 16, (2, 4))
    for model, optimizer in zip(models, optimizers):
        model(x, x)[1].backward()
        optimizer.step()
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*(m.parameters() for m in models)))


def test_a_read_while_a_run_replaces_the_folder_reads_one_whole_checkpoint(sharded, tmp_path, monkeypatch):
    """(convert_checkpoint.py or sample.py reading a live run's last.dcp as a save committed: run.json of one
    step and the tensors of the next, which a resume then took; or a false "missing" part)"""
    import sharded as sharded_py
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    whole = {k: sharded_py.read(out / k, tensors=True) for k in ("last.dcp", "previous.dcp")}
    load, commits = sharded_py.load, []

    def committed_meanwhile(path, state, world=None):  # a save's rotation, between run.json and the tensors
        if not commits:
            commits.append(os.replace(out / "last.dcp", out / "old.dcp") or os.replace(out / "previous.dcp", path))
        return load(path, state, world)
    monkeypatch.setattr(sharded_py, "load", committed_meanwhile)
    read = sharded_py.read(out / "last.dcp", tensors=True)
    assert commits and read["step"] == whole["previous.dcp"]["step"] == 8
    assert all(torch.equal(read["model"][k], w) for k, w in whole["previous.dcp"]["model"].items())
    # a read that failed as the folder was replaced ("a part is missing") reads the new one, not "unreadable"
    monkeypatch.undo()
    shutil.rmtree(out)
    out = Path(shutil.copytree(sharded, tmp_path / "out"))
    _read, failed = sharded_py._read, []

    def failed_meanwhile(path, tensors):
        if not failed:
            failed.append(os.replace(out / "last.dcp", out / "old.dcp") or os.replace(out / "previous.dcp", path))
            raise sharded_py.UnreadableCheckpoint(f"cannot read checkpoint {path}: a part is missing")
        return _read(path, tensors)
    monkeypatch.setattr(sharded_py, "_read", failed_meanwhile)
    assert failed == [] and sharded_py.read(out / "last.dcp", tensors=True)["step"] == 8 and failed


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_signal_while_a_sharded_checkpoint_is_read_is_not_a_damaged_checkpoint(sharded, monkeypatch, stop):
    """DCP packs every exception into its CheckpointException, Ctrl-C's and a SIGTERM's SystemExit too: the
    checkpoint was called unreadable, and the resume (or sample.py) went on with the one before it."""
    import sharded as sharded_py
    from torch.distributed.checkpoint import FileSystemReader

    def interrupted(self, *args, **kwargs):  # the signal's handler, run as the tensors are read
        raise stop()
    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    with pytest.raises(stop):
        sharded_py.read(sharded / "last.dcp", tensors=True)
