#!/usr/bin/env bash
# What each single-GPU speed-up is worth for GPT-2 124M (configs/gpt_small.py: block 1024, bf16,
# 480 sequences per optimizer step, which 12, 24 and 32 divide), one bench.py run per variant.
# Run from the repo root on a GPU machine; the reports end up in $OUT/sweep.tgz (default OUT:
# out-bench).
set -u
OUT=${OUT:-out-bench}
REPORTS=$(mktemp -d)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
timeout 60 python3 bench/attention_kernels.py --batch=24
variant() {  # name, seconds, bench.py arguments...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  timeout "$limit" python3 bench.py configs/gpt_small.py --global_batch_size=480 --nproc=1 --steps=${STEPS:-5} \
    --warmup=${WARMUP:-2} --report="$REPORTS/$name" "$@" > "$REPORTS/$name.log" 2>&1
  echo "exit $?"; tail -n 3 "$REPORTS/$name.log"
  [ -f "$REPORTS/$name/profile.txt" ] && sed -n '/device time by kind/,$p' "$REPORTS/$name/profile.txt"
}
variant eager_b12 100 --compile=false --batch_size=12 --pad_vocab_to=1  # gpt_small pads to 64: off here
variant compile_b12 150 --batch_size=12 --pad_vocab_to=1
variant compile_b12_pad64 150 --batch_size=12 --pad_vocab_to=64
variant compile_b24_pad64 170 --batch_size=24 --pad_vocab_to=64 --profile
variant compile_b32_pad64 150 --batch_size=32 --pad_vocab_to=64
mkdir -p "$OUT" && tar czf "$OUT/sweep.tgz" -C "$REPORTS" .
