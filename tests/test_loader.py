import numpy as np
import pytest
import torch

from loader import ShardedTokenLoader, Tokens, eval_starts

BLOCK = 8


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)  # token value = its position: windows are readable
    return path


def make(path, rank=0, world=1, batch=4, global_batch=16, seed=3):
    loader = ShardedTokenLoader(Tokens.file(path, "uint16"), BLOCK, batch, global_batch, rank, world, seed)
    loader.set_epoch(0)
    return loader


def starts_of(x):
    return [int(row[0]) for row in x]


def epoch_windows(path, rank, world, batch=2, global_batch=12, epoch=0):
    loader = make(path, rank, world, batch, global_batch)
    loader.set_epoch(epoch)
    seen = []
    while not loader.epoch_done:
        x, y = loader.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
        seen += starts_of(x)
    return seen, loader


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_are_disjoint_and_cover_the_epoch(token_file, world):
    per_rank = [epoch_windows(token_file, r, world)[0] for r in range(world)]
    union = [s for seen in per_rank for s in seen]
    assert len(union) == len(set(union))  # disjoint, and no window twice
    loader = epoch_windows(token_file, 0, world)[1]
    assert sorted(union) == sorted(loader.starts.tolist())  # the whole epoch
    assert len(union) == loader.windows_per_epoch == loader.steps_per_epoch * 12
    offset = min(union) % BLOCK
    assert all(s % BLOCK == offset for s in union)  # one stride-block_size grid per epoch


def test_set_epoch_changes_the_order_deterministically(token_file):
    a = make(token_file)
    first = a.starts.copy()
    a.set_epoch(1)
    second = a.starts.copy()
    b = make(token_file)
    b.set_epoch(1)
    assert not np.array_equal(first, second)
    assert set(first % BLOCK) != set(second % BLOCK)  # a fresh offset (6, then 7), not only a fresh order
    assert np.array_equal(second, b.starts)  # same (seed, epoch), same order
    assert not np.array_equal(make(token_file, seed=4).starts, first)
    assert not (np.diff(first) > 0).all() and not (np.diff(second) > 0).all()  # shuffled, not in the file's order
    offsets = set()
    for epoch in range(64):  # every offset within a window comes, in time (the last one too)
        a.set_epoch(epoch)
        offsets.add(int(a.starts[0] % BLOCK))
    assert offsets == set(range(BLOCK))


def test_an_epochs_order_costs_8_bytes_a_window_while_it_is_drawn(tmp_path):
    """(whole-length temporaries once made it peak at 40: 5 x what docs/data.md and the memory guard count)"""
    import tracemalloc

    from data.dataset import Shard
    path = tmp_path / "train.bin"
    with open(path, "wb") as f:
        f.truncate(2 * 4_000_001)  # sparse: 4 million windows of block_size 1
    loader = ShardedTokenLoader(Tokens([Shard(path, "uint16", 0, 4_000_001)]), 1, 4, 4, 0, 1, 0)
    tracemalloc.start()
    try:
        loader.set_epoch(0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert loader.n_windows == 4_000_000 and peak < 10 * loader.n_windows


def test_next_batch_rolls_into_the_next_epoch_by_itself(token_file):
    loader = make(token_file)
    while not loader.epoch_done:
        loader.next_batch()
    assert loader.epoch == 0
    x, _ = loader.next_batch()  # what set_epoch(1) on a fresh loader gives first
    assert loader.epoch == 1 and loader.position == 4
    fresh = make(token_file)
    fresh.set_epoch(1)
    assert starts_of(x) == starts_of(fresh.next_batch()[0])


@pytest.mark.parametrize("steps", [3])
def test_optimizer_step_sees_the_same_micro_batches_for_any_world_size(token_file, steps):
    """The same windows, and grouped alike: in bfloat16 each micro-batch's gradient is rounded as a whole
    (rank-strided micro-batches moved bfloat16 weights 2e-3 between 1 and 2 processes in 8 steps)."""
    def step_sets(world, accum, batch):
        loaders = [make(token_file, r, world, batch, global_batch=16) for r in range(world)]
        sets = []
        for _ in range(steps):
            seen = []
            for _ in range(accum):
                for loader in loaders:
                    seen.append(tuple(starts_of(loader.next_batch()[0])))
            sets.append(sorted(seen))
        return sets

    reference = step_sets(world=1, accum=4, batch=4)
    assert step_sets(world=2, accum=2, batch=4) == reference
    assert step_sets(world=4, accum=1, batch=4) == reference
    assert len(set(map(tuple, reference))) == steps  # the steps differ from each other


def test_load_state_dict_continues_with_the_next_batch(token_file):
    straight = make(token_file, rank=1, world=2, batch=2, global_batch=8)
    for _ in range(5):
        straight.next_batch()
    state = straight.state_dict()
    expected = [straight.next_batch()[0] for _ in range(3)]

    resumed = ShardedTokenLoader(Tokens.file(token_file, "uint16"), BLOCK, 2, 8, 1, 2, seed=3)
    resumed.load_state_dict(state)
    assert [torch.equal(resumed.next_batch()[0], e) for e in expected] == [True] * 3


def test_dataset_smaller_than_a_step_uses_several_passes(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(100, dtype=np.uint16).tofile(path)  # 11 windows of 8 tokens at any offset
    loader = ShardedTokenLoader(Tokens.file(path, "uint16"), BLOCK, 4, 16, 0, 1, seed=0)
    loader.set_epoch(0)
    assert loader.passes == 2 and loader.steps_per_epoch == 1
    x, _ = loader.next_batch()
    assert x.shape == (4, BLOCK)


def test_eval_windows_are_fixed_and_spread(tmp_path):
    def tokens(n):
        np.zeros(n, dtype=np.uint16).tofile(tmp_path / f"{n}.bin")
        return Tokens.file(tmp_path / f"{n}.bin", "uint16")
    a = eval_starts(tokens(10_000), 16, 50)
    assert np.array_equal(a, eval_starts(tokens(10_000), 16, 50))
    assert len(a) == 50 and a[0] == 0 and a[-1] + 17 <= 10_000
    assert len(eval_starts(tokens(100), 16, 50)) == 6  # clamped to the windows that exist


def test_the_eval_loss_runs_without_dropout_and_leaves_the_model_training(token_file):
    from contextlib import nullcontext

    from evals.loss import val_loss
    from model import GPT, GPTConfig
    from world import World
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=BLOCK, vocab_size=4000, dropout=0.5))
    tokens = Tokens.file(token_file, "uint16")
    loss = lambda: val_loss(model, tokens, eval_starts(tokens, BLOCK, 8), BLOCK, 4, World(), nullcontext(), False)
    first = loss()
    assert model.training and loss() == first  # no dropout mask: the same loss each time


@pytest.mark.parametrize("bad", [65, 999])  # the first id past a vocabulary of 65, and one far past it
def test_an_id_past_the_vocabulary_is_named_and_read_as_zero(tmp_path, bad):
    path = tmp_path / "train.bin"
    ids = np.arange(100, dtype=np.uint16) % 65
    ids[42] = bad
    ids.tofile(path)
    tokens = Tokens.file(path, "uint16")
    tokens.vocab_size = 65
    assert tokens.windows(np.array([0, 40]), 8)[1].tolist() == [40, 41, 0, 43, 44, 45, 46, 47]
    assert tokens.bad.startswith(f"{path} holds token id {bad} at token position 42,")
    ids[80] = bad + 1  # another, read later: the first one found stays the one named
    ids.tofile(path)
    tokens.windows(np.array([76]), 8)
    assert tokens.bad.startswith(f"{path} holds token id {bad} at token position 42,")


def test_more_shards_than_a_shells_open_file_limit_are_read(tmp_path, monkeypatch):
    # each shard's memory map keeps a descriptor: FineWeb's 100B tokens (1,000 shards) passed ulimit -n 1024
    import os
    import resource
    from config import Config
    from data.dataset import write_shard
    from errors import ConfigError
    from loader import token_splits
    names = {"train": [f"c_train_{i:06d}.bin" for i in range(1, 301)], "val": ["c_val_000000.bin"]}
    for i, name in enumerate(names["train"] + names["val"]):
        write_shard(tmp_path / name, np.full(20, i % 50, dtype=np.uint16))
    meta = dict(vocab_size=50, dtype="uint16", shards={s: [{"file": n, "tokens": 20} for n in ns]
                                                       for s, ns in names.items()})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/dev/fd")) + 100, hard))
    try:
        splits = token_splits(Config(data_dir=str(tmp_path)), meta)
        firsts = splits["train"].windows(np.arange(0, 6000, 20), 4)[:, 0]  # one window in each shard
        assert firsts.tolist() == [i % 50 for i in range(300)]
        del splits
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 1024))  # (a shell's `ulimit -n 1024`)
        monkeypatch.setattr(resource, "setrlimit", lambda what, limits: set_to.append(limits))
        set_to = []
        token_splits(Config(data_dir=str(tmp_path)), dict(meta, shards={"train": meta["shards"]["train"] * 3}),
                     ("train",))  # 900 fit in it: not refused for the room it would have liked
        assert set_to == [(1024, 1024)]
        with pytest.raises(ConfigError, match=r"^1,200 token shards need about 1,2\d\d open files, and ulimit -Hn "
                                              r"allows 1,024: raise it, or prepare fewer, larger shards"):
            token_splits(Config(data_dir=str(tmp_path)), dict(meta, shards={"train": meta["shards"]["train"] * 4}),
                         ("train",))
        from data.files import allow_open_files  # torch's, gloo's and the checkpoints' own files need room too
        assert allow_open_files(1024 - len(os.listdir("/dev/fd")) - 16) and \
            allow_open_files(1024 - len(os.listdir("/dev/fd")) - 48) is None
        import loader  # train.py's ranks agree on it (hosts may differ): rank 1 once said a peer had died
        from world import World
        monkeypatch.setattr(loader, "agree_or_raise", lambda problem, world: agreed.append((problem, world.rank)))
        agreed = []
        token_splits(Config(data_dir=str(tmp_path)), meta, world=World(rank=1, size=2))
        assert agreed == [(None, 1)]
    finally:
        monkeypatch.undo()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
