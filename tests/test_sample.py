"""sample.py on a checkpoint from a short run."""

import subprocess
import sys

import pytest

import train
from config import resolve
from harness import REPO, tiny_args

SEPARATOR = "---------------"


@pytest.fixture(scope="module")
def trained(char_data, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sample_out")
    train.main(resolve(tiny_args(char_data, out_dir, max_iters=10, eval_interval=10)))
    return out_dir


def sample(*args):
    return subprocess.run([sys.executable, "sample.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_prints_the_requested_samples_and_the_same_seed_gives_the_same_text(trained):
    args = [f"--out_dir={trained}", "--start=the king", "--num_samples=3", "--max_new_tokens=25"]
    first = sample(*args, "--seed=7")
    assert first.returncode == 0, first.stderr
    samples = first.stdout.split(SEPARATOR + "\n")[:-1]
    assert len(samples) == 3
    for text in samples:
        assert text.startswith("the king") and len(text) == len("the king") + 25 + 1  # + print's newline
    assert sample(*args, "--seed=7").stdout == first.stdout
    assert sample(*args, "--seed=8").stdout != first.stdout


def test_prompt_from_a_file_and_greedy_decoding(trained, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a fool ")
    args = [f"--out_dir={trained}", f"--start=FILE:{prompt}", "--num_samples=2",
            "--max_new_tokens=10", "--temperature=0"]
    a, b = sample(*args, "--seed=1"), sample(*args, "--seed=2")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout  # greedy ignores the seed
    first, second = a.stdout.split(SEPARATOR + "\n")[:2]
    assert first == second and first.startswith("a fool ")


@pytest.mark.parametrize("args, message", [
    (["--out_dir=/nonexistent/out"], "does not exist"),
    (["--max_new_tokens=0"], "must be positive"),
    (["--start=the king{}"], "not in the vocabulary"),
    (["--temperature=-1"], "temperature must be >= 0"),
])
def test_bad_input_exits_with_a_clear_message(trained, args, message):
    proc = sample(f"--out_dir={trained}", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
