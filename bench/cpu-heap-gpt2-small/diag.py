"""train.py with a record per rank before and after each save: RSS, peak RSS since the last record,
glibc's heap (mallinfo2: bytes in use, free, mapped on their own) and the bytes of live CPU tensors.
    python diag.py RECORD_PREFIX [train.py arguments]  (run by run.sh under torchrun)"""
import ctypes, gc, json, os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI2

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def live_tensor_bytes():
    seen, total = set(), 0
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor):
                t = o._local_tensor if hasattr(o, "_local_tensor") else o
                if t.device.type != "cpu" or t.is_meta: continue
                s = t.untyped_storage(); p = s.data_ptr()
                if p and p not in seen:
                    seen.add(p); total += s.nbytes()
        except Exception:
            pass
    return total

def reset_peak():
    open("/proc/self/clear_refs", "w").write("5")

import train
out = open(f"{sys.argv[1]}.{os.environ.get('RANK','0')}", "a")
G = 2**30
def emit(tag, step):
    m = libc.mallinfo2()
    rec = dict(tag=tag, step=step, rss=status("VmRSS")/G, hwm=status("VmHWM")/G, heap_used=m.uordblks/G,
               heap_free=m.fordblks/G, arena=m.arena/G, mmapped=m.hblkhd/G, tensors=live_tensor_bytes()/G)
    out.write(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}) + "\n"); out.flush()

build_run, save = train.build_run, train.Run.save
def b(cfg, world, meta):
    run = build_run(cfg, world, meta); emit("built", run.step); reset_peak(); return run
def s(self, best):
    emit("before-save", self.step); save(self, best); emit("after-save", self.step); reset_peak()
train.build_run, train.Run.save = b, s
if os.environ.get("DIAG_TRIM"):
    step = train.optimizer_step
    def trimmed(*a, **k):
        r = step(*a, **k); libc.malloc_trim(0); return r
    train.optimizer_step = trimmed
train.cli(sys.argv[2:])
