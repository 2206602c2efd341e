#!/bin/bash
# One pair of the CPU side by side with nanoGPT (docs/performance.md): nanoGPT's README CPU command for the
# baby Shakespeare model and ours with the same settings, one after the other, then each last checkpoint's
# loss over every non-overlapping 64-token window of val.bin.
#
#   bash bench/nanogpt_cpu.sh NANOGPT_DIR RUN_DIR nanogpt|ours [ITERS]    # the third names the one run first
#
# Both data/shakespeare_char folders must be prepared, each by its own prepare.py, from the same input.txt.
set -euo pipefail
[ $# -ge 3 ] && { [ "$3" = nanogpt ] || [ "$3" = ours ]; } ||
  { echo "error: usage: bash bench/nanogpt_cpu.sh NANOGPT_DIR RUN_DIR nanogpt|ours [ITERS] (which runs first)" >&2
    exit 2; }
nano=$(realpath -m "$1") runs=$(realpath -m "$2") first=$3 iters=${4:-2000}
ours=$(realpath "$(dirname "$0")/..") py=$(command -v python || command -v python3) ||
  { echo "error: no python or python3 on PATH" >&2; exit 2; }
[[ $iters =~ ^[1-9][0-9]*$ ]] || { echo "error: ITERS is a positive whole number, got '$iters'" >&2; exit 2; }
cmp -s "$nano/data/shakespeare_char/val.bin" "$ours/data/shakespeare_char/val.bin" ||
  { echo "error: the two data/shakespeare_char/val.bin differ (or one is missing): prepare both from one input.txt" >&2
    exit 2; }
mkdir -p "$runs"; summary=$runs/summary.txt
common="--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4
 --n_head=4 --n_embd=128 --max_iters=$iters --lr_decay_iters=$iters --dropout=0.0"
q() { printf %q "$1"; }  # a path with a space stays one argument in the commands below
declare -A cmd=(
  [nanogpt]="cd $(q "$nano") && $(q "$py") train.py config/train_shakespeare_char.py $common
 --out_dir=$(q "$runs/out-nanogpt")"
  [ours]="cd $(q "$ours") && $(q "$py") train.py $common --dtype=float32 --global_batch_size=12 --bias=False
 --eval_interval=250 --learning_rate=1e-3 --min_lr=1e-4 --warmup_iters=100 --beta2=0.99 --weight_decay=0.1
 --always_save_checkpoint=False --resume=never --out_dir=$(q "$runs/out-ours")")
{ echo "torch $("$py" -c 'import torch; print(torch.__version__, "threads", torch.get_num_threads())'), $(nproc) cores," \
    "ours at $(git -C "$ours" log -1 --format=%h), nanoGPT at $(git -C "$nano" log -1 --format=%h), $(date -Is)"
  uptime; } > "$summary"
second=$([ "$first" = ours ] && echo nanogpt || echo ours)
for impl in "$first" "$second"; do
  echo "== $impl: ${cmd[$impl]//$'\n'/}" >> "$summary"
  start=$(date +%s.%N)
  /usr/bin/time -v bash -c "${cmd[$impl]//$'\n'/}" > "$runs/$impl.log" 2> "$runs/$impl.time" ||
    { echo "error: the $impl run failed: see $runs/$impl.log and $runs/$impl.time" >&2; exit 1; }
  echo "$impl wall_s=$(echo "$(date +%s.%N) - $start" | bc) $(grep -E 'User time|System time|Maximum resident|Minor' \
    "$runs/$impl.time" | tr -s '\t\n' ' ;')" >> "$summary"
done
"$py" - "$nano" "$ours" "$runs" >> "$summary" <<'EOF'
import importlib.util, json, re, statistics, sys
import numpy as np, torch
nano, ours, runs = sys.argv[1:]
val = np.fromfile(f"{ours}/data/shakespeare_char/val.bin", dtype=np.uint16).astype(np.int64)
n = (len(val) - 1) // 64
x, y = (torch.from_numpy(val[i:i + n * 64].reshape(n, 64)) for i in (0, 1))
for impl, repo, path, step in (("nanogpt", nano, "out-nanogpt/ckpt.pt", "iter_num"),
                               ("ours", ours, "out-ours/last.pt", "step")):
    spec = importlib.util.spec_from_file_location(f"{impl}_model", f"{repo}/model.py")
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    ckpt = torch.load(f"{runs}/{path}", map_location="cpu", weights_only=True)
    model = module.GPT(module.GPTConfig(**ckpt["model_args"])).eval()
    model.load_state_dict(ckpt["model"])
    with torch.no_grad():
        total = sum(model(x[i:i + 256], y[i:i + 256])[1].item() * len(x[i:i + 256]) for i in range(0, n, 256))
    log = open(f"{runs}/{impl}.log").read()  # each step's time (the first left out): nanoGPT's, or 768 tokens/ours
    ms = ([float(t) for t in re.findall(r"time ([\d.]+)ms", log)] if impl == "nanogpt" else
          [768e3 / float(t.replace(",", "")) for t in re.findall(r"([\d,]+) tok/s", log)])
    print(json.dumps({"impl": impl, "step": ckpt[step], "full_val_loss": round(total / n, 4), "windows": n,
                      "median_step_ms": round(statistics.median(ms[1:]), 1)}))
EOF
