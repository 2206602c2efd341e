"""Documents encoded with GPT-2's BPE in worker processes (data/streaming.py's shards), each prefixed by the
end-of-text token as llm.c does: a pool with two blocks of documents in flight, whose stop signals are the main
process's (a worker a Ctrl-C or SIGTERM ended, started or working, broke the pool: tracebacks, not one line)."""

import multiprocessing as mp
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from itertools import islice
from typing import Iterator

import numpy as np

from data.dataset import GPT2_EOT
from data.tokenizers import gpt2_encoding
from errors import RunError

STOPS = (signal.SIGINT, signal.SIGTERM)  # a terminal's Ctrl-C and a scheduler's SIGTERM reach the whole group
_encoder = None  # the worker's tiktoken Encoding, or the exception loading it raised


def _start_worker():
    """Each worker's start. Ctrl-C is the main process's, which stops the pool, also when sent to the whole group
    (a terminal's); so is any stop signal sent while the worker started, blocked then (encode_all): each worker
    said a traceback, importing."""
    global _encoder
    for sig in STOPS:  # (SIG_IGN discards a pending one)
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the pool's terminate() of a broken pool; a group's SIGTERM too:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # encode_all's shutdown, waiting, keeps the pool's thread quiet)
    if parent := mp.parent_process():  # killed (SIGKILL), it leaves no orphan waiting for work for ever
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()
    try:
        _encoder = gpt2_encoding(verbose=False)
    except Exception as e:  # noqa: BLE001  an initializer that raises breaks the pool, with no message
        _encoder = e


def _encode(item):
    if isinstance(_encoder, Exception):
        raise _encoder  # to the main process, which reports it
    index, text = item
    return index, np.array([GPT2_EOT] + _encoder.encode_ordinary(text), dtype=np.uint16)


@contextmanager
def _stops_held():
    """The stop signals held for the few milliseconds inside: workers started then inherit them blocked (their
    start-up said tracebacks), and this process acts on one after (it left a worker its start-up data half written:
    a thread of another library may take the signal, so Python would raise it in the main thread in there)."""
    if threading.current_thread() is not threading.main_thread():  # (only there are handlers set: not held)
        yield
        return
    caught, mask = [], signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    handlers = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in STOPS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():  # (None: a handler not set from Python)
            signal.signal(sig, handler or signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum in caught:
            signal.raise_signal(signum)


def encode_all(docs: Iterator, workers: int, take):
    """Encode (doc, text) pairs in worker processes, each block's (doc, tokens) to take() in order. Two
    blocks in flight at most, so memory stays bounded (pool.map alone would read all ahead). A worker that
    dies (the out-of-memory killer) breaks this pool: multiprocessing.Pool lost its task, a hang."""
    pool = ProcessPoolExecutor(workers, mp.get_context("spawn"), initializer=_start_worker)
    try:
        pending = []
        for block in iter(lambda: list(islice(docs, workers * 64)), []):  # lists of workers * 64 documents
            with _stops_held():  # (workers start in here)
                pending.append(pool.map(_encode, block, chunksize=16))
            if len(pending) == 2:
                take(pending.pop(0))
        for result in pending:
            take(result)
    except BrokenProcessPool:
        raise RunError("a tokenizing process was killed (the out-of-memory killer?): run the same command "
                       "again, which goes on from the last shard written (fewer --workers use less memory)") from None
    finally:
        # on an error no chunk more starts; waiting, the pool's thread takes its cancelled tasks off its list before
        # it sees workers a group's SIGTERM ended (else Python 3.11's thread said InvalidStateError's traceback)
        pool.shutdown(wait=True, cancel_futures=True)
