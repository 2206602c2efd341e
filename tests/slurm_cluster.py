"""A throwaway one-host SLURM cluster (munged, slurmctld, slurmd) in a temporary folder.

Needs root and Debian's packages (`apt-get install slurm-wlm munge`). Everything the
daemons write (key, sockets, state, spool, logs) lives in one folder under the temp dir;
ports are free ones picked at start, so a cluster the machine already runs is not touched.
The daemons run in the foreground as children of this process and die with it. Leftovers of
a run that was killed outright are swept at the next start: processes that carry the dead
run's folder in their environment are killed, then the folder is removed.

By hand, to see what srun gives a task:

    python tests/slurm_cluster.py srun -n 2 sh -c 'env | grep ^SLURM_ | sort'
"""

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train_spawn import free_port

PACKAGES = "slurm-wlm munge"
TOOLS = ["munged", "munge", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue",
         "scontrol", "scancel"]
PREFIX = "gpt-train-slurm-"
MARK = "GPT_TRAIN_SLURM_DIR"  # in the environment of the daemons and of every srun we start


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None when it can."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux to run slurmd and munged"
    absent = [t for t in TOOLS if not shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if absent:
        return f"{' '.join(absent)} not found: apt-get install {PACKAGES}"
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f"this host's name {socket.gethostname()!r} does not resolve (add it to /etc/hosts)"
    return None


def _die_with_parent():
    os.setsid()  # Ctrl-C in the terminal reaches pytest, which tears down in order
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _marked_pids(folder: Path) -> list[int]:
    """Processes whose environment names `folder` as their cluster (tasks, steps, daemons)."""
    needle = f"{MARK}={folder}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def _kill(pids: list[int], sig=signal.SIGKILL):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def sweep_leftovers():
    """Kill what a crashed earlier run left behind and remove its folder."""
    for folder in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            owner = int((folder / "owner").read_text())
        except (OSError, ValueError):
            owner = None
            if time.time() - folder.stat().st_mtime < 60:
                continue  # perhaps a session that is starting right now
        if owner is not None and Path(f"/proc/{owner}").exists():
            continue  # a cluster whose owner still lives: it stops its own
        _kill(_marked_pids(folder))
        shutil.rmtree(folder, ignore_errors=True)


class SlurmCluster:
    def __init__(self, cpus: int = None):
        self.host = socket.gethostname().split(".")[0]
        self.cpus = max(2, cpus or len(os.sched_getaffinity(0)))
        self.dir = None
        self.daemons = {}  # name -> Popen

    # -- what callers use

    def env(self, base: dict = None) -> dict:
        """`base` (default: this process's environment) pointed at this cluster."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.dir / "slurm.conf"), **{MARK: str(self.dir)})
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    def run(self, *cmd: str, check=True, timeout=30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env(), capture_output=True, text=True,
                              check=check, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.dir / "log").glob("*")))

    # -- start and stop

    def start(self, timeout: float = 30):
        sweep_leftovers()
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.dir / "owner").write_text(str(os.getpid()))
        self.dir.chmod(0o755)  # munged wants every folder above its socket searchable
        for sub, mode in (("munge", 0o755), ("key", 0o700), ("state", 0o700), ("spool", 0o755),
                          ("log", 0o755)):
            (self.dir / sub).mkdir(mode=mode)
        key = self.dir / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)  # munged refuses a key that others may read
        sock = self.dir / "munge" / "munge.socket"
        self._daemon("munged", "munged", "--foreground", "--force", f"--socket={sock}",
                     f"--key-file={key}", f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
                     f"--seed-file={self.dir / 'munge' / 'munged.seed'}")
        deadline = time.monotonic() + timeout
        self._wait(lambda: self.run("munge", "-n", f"--socket={sock}", check=False).returncode == 0,
                   deadline, "munged to answer")
        (self.dir / "slurm.conf").write_text(self._conf(sock))
        conf = str(self.dir / "slurm.conf")
        self._daemon("slurmctld", "slurmctld", "-D", "-f", conf)
        self._wait(lambda: "UP" in self.run("scontrol", "ping", check=False).stdout,
                   deadline, "slurmctld to answer scontrol ping")
        self._daemon("slurmd", "slurmd", "-D", "-f", conf, "-N", self.host)
        self._wait(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
                   == "idle", deadline, f"node {self.host} to be idle")
        return self

    def stop(self):
        if self.dir is None:
            return
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            try:  # cancel jobs while slurmd can still end their steps
                self.run("scancel", "--user=root", check=False, timeout=10)
                deadline = time.monotonic() + 10
                while (self.run("squeue", "-h", check=False, timeout=10).stdout.strip()
                       and time.monotonic() < deadline):
                    time.sleep(0.1)
            except subprocess.TimeoutExpired:
                pass  # a hung slurmctld: the kills below still clean up
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.pop(name, None)
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        _kill(_marked_pids(self.dir))  # a step or task that outlived its daemons
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    # -- helpers

    def _daemon(self, name: str, *cmd: str):
        log = open(self.dir / "log" / f"{name}.log", "ab")
        self.daemons[name] = subprocess.Popen(cmd, env=self.env(), stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              preexec_fn=_die_with_parent)
        log.close()

    def _wait(self, ready, deadline: float, what: str):
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else "timed out"
                raise RuntimeError(f"SLURM test cluster: waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.05)

    def _conf(self, munge_socket: Path) -> str:
        d = self.dir
        return f"""\
ClusterName=gpttest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
# trust the CPU count below even where slurmd detects fewer (2 tasks need 2 CPUs)
SlurmdParameters=config_overrides
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE OverSubscribe=FORCE State=UP
"""


if __name__ == "__main__":
    if reason := missing():
        sys.exit(f"cannot start a SLURM cluster: {reason}")
    with SlurmCluster() as cluster:
        print(f"SLURM_CONF={cluster.dir / 'slurm.conf'}", file=sys.stderr)
        cmd = sys.argv[1:] or ["sinfo"]
        sys.exit(subprocess.run(cmd, env=cluster.env()).returncode)
