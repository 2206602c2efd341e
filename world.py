"""Where this process stands: its rank, device and dtype (docs/multihost.md); the process group
it joins is collectives.py's.

setup() (train.py's, train_spawn.py's and bench.py's start-up) finds what a rank can see alone and
config.resolve could not (a dtype the device cannot run, a global batch the world cannot split) before
the group forms, so each rank fails at once instead of waiting out dist_timeout; the rest is agreed.
"""

import os
import re
import signal
import threading
import warnings
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from config import CHOICES, Config
from data.files import LIBC
from errors import ConfigError, GlobalBatchIndivisible

DTYPES = {name: getattr(torch, name) for name in CHOICES["dtype"] if name != "auto"}


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    local_size: int = 1
    group: object = None  # a gloo group for small CPU messages (the default group unless NCCL)
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    backend: str = "gloo"
    accum: int = 1        # micro-steps per optimizer step on each rank
    shard_size: int = 1   # FSDP shards over groups of this many ranks (HSDP when < size)
    strategy: str = "ddp" # cfg.strategy; ddp on one process, where there is nothing to shard
    save_group: object = None  # async_checkpoint: a gloo group of its own for background writes
    timeout: object = None     # dist_timeout (a timedelta) for every group made after the first
    mesh: object = None        # FSDP's DeviceMesh, whose groups collectives.process_group lets go of at the end

    @property
    def is_master(self) -> bool:
        return self.rank == 0


# -----------------------------------------------------------------------------
# ranks

def slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM node list, as `scontrol show hostnames` orders them:
    'gpu[03-05,07],cpu1' -> 'gpu03', 'rack[2-3]-n[1-4]' -> 'rack2-n1'."""
    first = re.split(r",(?![^\[]*\])", nodelist)[0]  # a comma inside brackets does not split
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", first)  # each range starts at its first value


def slurm_tasks_per_node(counts: str) -> list[int]:
    """SLURM's compressed task counts, one per node: '4(x2),3' -> [4, 4, 3]; [] for what is not such a list."""
    if not re.fullmatch(r"\d+(\(x\d+\))?(,\d+(\(x\d+\))?)*", counts):
        return []
    return [int(n) for n, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", counts) for _ in range(int(repeat or 1))]


def find_world() -> World:
    """Read ranks from torchrun or manual variables, else from SLURM, else one process."""
    env, world = os.environ, World()
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
             "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID")
    bad = {k: env[k] for k in names if k in env and not (env[k].isascii() and env[k].isdigit())}
    if bad:
        raise ConfigError(f"rank variables must be whole numbers, got {bad}: check the launch command")
    if ("RANK" in env) != ("WORLD_SIZE" in env):  # else one process would train, silently alone
        raise ConfigError(f"{'RANK' if 'RANK' in env else 'WORLD_SIZE'} is set but "
                          f"{'WORLD_SIZE' if 'RANK' in env else 'RANK'} is not: set both (or neither)")
    if "RANK" in env:
        size = int(env["WORLD_SIZE"])
        world = World(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), size, int(env.get("LOCAL_WORLD_SIZE", size)))
    # Only inside a step that srun launched: an sbatch script itself also sees SLURM_PROCID=0
    # and SLURM_NTASKS=N, but no peer would ever join it.
    # (the step's own task count: srun --preserve-env, and salloc's shell, pass on the job's SLURM_NTASKS)
    elif "SLURM_STEP_ID" in env and int(tasks := env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))) > 1:
        # rank 0 runs on the step's first node, which need not be the job's first
        nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        env.setdefault("MASTER_ADDR", slurm_first_host(nodes))
        step = int(env["SLURM_STEP_ID"]) if env["SLURM_STEP_ID"].isdigit() else 0  # steps at once: own ports
        env.setdefault("MASTER_PORT", str(29500 + (int(env.get("SLURM_JOB_ID", "0")) + 1009 * step) % 3000))
        counts, node = env.get("SLURM_STEP_TASKS_PER_NODE", tasks), int(env.get("SLURM_NODEID", 0))
        per_node = slurm_tasks_per_node(counts)
        if "SLURM_PROCID" not in env or node >= len(per_node):
            raise ConfigError(f"srun's variables do not describe this task (SLURM_PROCID={env.get('SLURM_PROCID')}, "
                              f"SLURM_NODEID={node}, SLURM_STEP_TASKS_PER_NODE={counts!r}): launch with srun, "
                              f"or unset SLURM_STEP_ID for one process")
        world = World(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(tasks), per_node[node])
    if not (world.rank < world.size and world.local_rank < world.local_size):  # else peers never come
        raise ConfigError(f"rank {world.rank} (local rank {world.local_rank}) cannot be in a world of size "
                          f"{world.size} ({world.local_size} on this host): check the launch command")
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if world.size > 1 and not (addr and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{world.size} processes need MASTER_ADDR (rank 0's host) and MASTER_PORT (a port, 1-65535), "
                          f"got {addr!r} and {env.get('MASTER_PORT')!r}: check the launch command")
    return world


def strip_local_rank(argv: list[str]) -> list[str]:
    """Accept torch.distributed.launch's --local-rank=N / --local_rank N and export LOCAL_RANK."""
    rest, args = [], iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name not in ("--local-rank", "--local_rank"):
            rest.append(arg)
            continue
        value = value if eq else next(args, "")
        if not (value.isascii() and value.isdigit()):
            raise ConfigError(f"{name} needs a number, e.g. {name}=0, got {value!r}")
        os.environ.setdefault("LOCAL_RANK", value)
    return rest


# -----------------------------------------------------------------------------
# device, dtype, backend

def pick_device(name: str, world: World) -> torch.device:
    """auto: cuda:LOCAL_RANK where CUDA exists, else Apple's mps for a single process, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else (
            "mps" if world.size == 1 and torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # refused just below
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device {name!r} is not one this trainer runs on: use auto, cpu, "
                          f"cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but CUDA is not available here: use --device=cpu")
        index, count = world.local_rank if device.index is None else device.index, torch.cuda.device_count()
        if index >= count:  # else "invalid device ordinal" inside torch, later
            raise ConfigError(f"device cuda:{index} does not exist here: this host has {count} GPU"
                              f"{'s' * (count != 1)}; run at most {count} process{'es' * (count != 1)} on it")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but MPS is not available here: use --device=cpu")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported(including_emulation=False)  # (V100, T4: emulated)
    if name == "auto" and device.type == "cuda":
        return torch.bfloat16 if bf16 else torch.float16
    dtype = torch.float32 if name == "auto" else DTYPES[name]
    if dtype == torch.bfloat16 and not bf16:
        raise ConfigError("this GPU cannot run bfloat16: use --dtype=float16")
    # (CUDA's autocast runs both half dtypes; elsewhere try it, without touching a GPU in a parent)
    if dtype != torch.float32 and device.type != "cuda" and not autocast_runs(device, dtype):
        raise ConfigError(f"dtype={name} cannot run on {device} here (autocast does not support "
                          f"it): use --dtype=float32 or --dtype=auto")
    return dtype


def autocast_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matmul under autocast on `device` really computes in `dtype`. Where the dtype
    is unsupported, autocast warns and turns itself off rather than failing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(device.type, dtype=dtype):
                a = torch.ones(2, 2, device=device)
                return (a @ a).dtype == dtype
    except (RuntimeError, TypeError, ValueError):
        return False


def use_device(world: World):
    """Make world.device this process's own: its GPU, or its share of the host's CPU cores."""
    if world.device.type == "cpu":  # ranks on one host share its cores
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, cores // world.local_size)
        if torch.get_num_threads() != threads:  # setting even the same count made 20x the futex calls
            torch.set_num_threads(threads)
    elif world.device.type == "cuda":
        torch.cuda.set_device(world.device)
        # float32 matmuls left in a mixed-precision run may use TF32; a float32 run keeps float32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = world.dtype != torch.float32


def available_memory(device: torch.device, local_size: int = 1) -> int:
    """Bytes this process may still allocate: the GPU's free memory, or its share of the host's (at most
    of its memory cgroup's limit: SLURM's --mem, docker --memory, which MemAvailable does not see)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return min(kib * 1024, cgroup_memory_limit()) // local_size
    except (OSError, StopIteration, ValueError):  # not Linux: no estimate, nothing refused
        return 2**62


def cgroup_memory_limit(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int:
    """The tightest memory limit of this process's cgroup and those above it (v2's memory.max, v1's
    memory.limit_in_bytes), or 2**62 where none is set or can be read."""
    limits, lines = [2**62], []
    with suppress(OSError):  # (then MemAvailable alone)
        lines = [line.split(":", 2) for line in Path(proc).read_text().splitlines() if line.count(":") >= 2]
    for _, controllers, path in lines:
        if controllers and "memory" not in controllers.split(","):  # ("": cgroup v2's one hierarchy)
            continue
        base = Path(root, "memory" if controllers else "")  # (a container's own cgroup is mounted as it)
        for folder in (base / path.lstrip("/"), *(base / path.lstrip("/")).parents):
            for name in ("memory.max", "memory.limit_in_bytes"):
                with suppress(OSError):
                    limits.append(int(text) if (text := (folder / name).read_text().strip()).isdigit() else 2**62)
            if folder == base:
                break
    return min(limits)


def keep_cpu_memory_lean():
    """Free tensors over 4 MB straight to the OS: glibc's heap kept a step's temporaries (an FSDP rank
    peaked at 1.9 GiB, not 0.8: docs/fsdp.md). 2 MB pages, where the kernel allows, keep the fresh
    pages from costing speed (PyTorch reads THP_MEM_ALLOC_ENABLE at its first tensor: call this first)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if LIBC:
        LIBC.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD; a fixed one is never raised
        # M_TRIM_THRESHOLD: fixing the one above leaves it at 128 KiB, and the heap's top was handed
        # back and faulted in again every step (6x the page faults, 5% of a small model's time)
        LIBC.mallopt(-1, 32 << 20)


def place(device: str, dtype: str, backend: str, claim: bool = True, world: World = None) -> World:
    """Ranks (`world`'s, else the launcher's), device, dtype and backend, all checked before any group
    forms (eval.py's start-up). claim=False only checks: a launcher's parent (train_spawn, bench)
    takes no GPU or threads."""
    world = world or find_world()
    world.device = pick_device(device, world)
    if claim and world.device.type == "cpu":
        keep_cpu_memory_lean()  # before the first tensor (pick_dtype may make one)
    world.dtype = pick_dtype(dtype, world.device)
    world.backend = backend if backend != "auto" else ("nccl" if world.device.type == "cuda" else "gloo")
    if not dist.is_backend_available(world.backend):
        raise ConfigError(f"backend '{world.backend}' is not available in this torch build: use gloo")
    if world.backend == "nccl" and world.device.type != "cuda":
        raise ConfigError("backend nccl needs CUDA devices: use --backend=gloo on CPU")
    if claim:
        use_device(world)
    return world


def setup(cfg: Config, claim: bool = True, world: World = None) -> World:
    """place() and the accumulation steps, checked before any group forms: global_batch_size sequences
    a step, batch_size per micro-step and process."""
    world = place(cfg.device, cfg.dtype, cfg.backend, claim, world)
    if cfg.global_batch_size % (cfg.batch_size * world.size):
        raise GlobalBatchIndivisible(cfg.global_batch_size, cfg.batch_size, world.size)
    world.accum = cfg.global_batch_size // (cfg.batch_size * world.size)
    if cfg.fsdp_shard_size and world.size % cfg.fsdp_shard_size:
        raise ConfigError(f"fsdp_shard_size ({cfg.fsdp_shard_size}) must divide the world size ({world.size}): "
                          f"e.g. the processes per host, {world.local_size}")
    world.shard_size = cfg.fsdp_shard_size or world.size
    world.strategy = cfg.strategy if world.size > 1 else "ddp"
    return world


def autocast(world: World):
    return nullcontext() if world.dtype == torch.float32 else torch.autocast(world.device.type, dtype=world.dtype)


# -----------------------------------------------------------------------------
# stop signals

@dataclass
class StopSignal:
    """SIGTERM (a scheduler's preemption, torchrun passing it on) or SIGINT (Ctrl-C) asks the run
    to stop with a checkpoint at the next agreement (collectives.Agreement: all ranks agree on it,
    so they stop together). Another Ctrl-C changes nothing: to end at once, kill -9."""
    received: int = 0  # the signal's number
    previous: dict = field(default_factory=dict)  # the handlers to restore

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only there can it be set
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():  # (None: a handler not set from Python, which cannot be restored)
            signal.signal(sig, handler or signal.SIG_DFL)
