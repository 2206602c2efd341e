#!/usr/bin/env bash
# The GPU session's work in four commands, each under 10 minutes, run from the repo root on a GPU
# machine; each writes its logs and reports to $OUT/PHASE.tgz (default OUT: out-bench).
#   bash bench/h100_sweep.sh verify   # GPU tests, the fast suite, the baby GPT end to end, sample.py
#   NANOGPT=path/to/nanoGPT bash bench/h100_sweep.sh nanogpt   # nanoGPT's bench.py, then ours at its settings
#   bash bench/h100_sweep.sh sweep    # what each speed-up is worth for GPT-2 124M
#   bash bench/h100_sweep.sh xl       # GPT-2 xl's shape (1.5B) on one GPU: speed, MFU, peak memory
# No network there: verify reads tiny shakespeare from SHAKESPEARE_INPUT (default
# data/shakespeare_char/input.txt) and nanogpt a checkout of karpathy/nanoGPT; carry both.
set -u
PHASE=${1:-sweep}
OUT=${OUT:-out-bench}
REPORTS=$(mktemp -d)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"

timed() {  # name, seconds, command...: its log in $REPORTS/name.log, its wall time and exit status
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$REPORTS/$name.log" 2>&1
  echo "exit $? after $((SECONDS - t0)) s"; tail -n 3 "$REPORTS/$name.log"
}
ours() {  # name, seconds, bench.py arguments...: one GPT-2 124M run of bench.py on one process
  local name=$1 limit=$2; shift 2
  timed "$name" "$limit" python3 bench.py configs/gpt_small.py --nproc=1 --report="$REPORTS/$name" "$@"
  [ -f "$REPORTS/$name/profile-ddp-1.txt" ] && sed -n '/device time by kind/,$p' "$REPORTS/$name/profile-ddp-1.txt"
}

case $PHASE in
verify)
  timed test_gpu 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py
  timed test_fast 150 python3 -m pytest -q -p no:cacheprovider -m "not slow"
  timed test_cuda_cases 120 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_bad_input.py tests/test_train.py
  # nanoGPT's README: val ~1.47 after 5000 iterations, about 3 minutes on an A100
  timed shakespeare_char 300 python3 train.py configs/shakespeare_char.py --out_dir="$REPORTS/out-sc" \
    --data_dir="$REPORTS/data-sc" --prepare_input="${SHAKESPEARE_INPUT:-data/shakespeare_char/input.txt}"
  grep -h '"val_loss"' "$REPORTS/out-sc/metrics.jsonl" | tail -n 2
  timed sample 60 python3 sample.py --out_dir="$REPORTS/out-sc" --num_samples=2 --max_new_tokens=300
  rm -f "$REPORTS"/out-sc/*.pt ;;
nanogpt)
  # nanoGPT's bench.py: bias off, 50304 vocabulary rows, bf16, compiled, no clipping, 10 warm-up and
  # 20 timed steps on one random batch; ours the same (bench.py's loader reads synthetic tokens)
  for b in 12 32; do
    timed "nanogpt_b$b" 150 bash -c "cd '${NANOGPT:?set NANOGPT}' && python3 bench.py --real_data=False --batch_size=$b --compile=True"
    ours "ours_b${b}_as_nanogpt" 150 --batch_size=$b --global_batch_size=$b --bias=False --pad_vocab_to=64 \
      --grad_clip=0 --steps=20 --warmup=10
  done ;;
sweep)
  timeout 60 python3 bench/attention_kernels.py --batch=24
  # 480 sequences per optimizer step, which 12, 24 and 32 divide; gpt_small pads the vocabulary to 64
  set -- --global_batch_size=480 --steps=${STEPS:-5} --warmup=${WARMUP:-2}
  ours eager_b12 100 "$@" --compile=false --batch_size=12 --pad_vocab_to=1
  ours compile_b12 150 "$@" --batch_size=12 --pad_vocab_to=1
  ours compile_b12_pad64 120 "$@" --batch_size=12
  ours compile_b24_pad64 150 "$@" --batch_size=24 --profile
  ours compile_b32_pad64 120 "$@" --batch_size=32 ;;
xl)
  # GPT-2 xl's shape (1.5B) on one GPU: without and with activations recomputed in backward
  for ac in false true; do
    ours "xl_b8_ac_$ac" 240 --global_batch_size=64 --steps=3 --warmup=2 --n_layer=48 --n_head=25 --n_embd=1600 \
      --batch_size=8 --activation_checkpointing=$ac
  done
  python3 scripts/memory_guide.py --world=1 --batch_size=8 > "$REPORTS/memory_guide.txt" 2>&1
  grep -e "gpt2-xl" -e "^| model" "$REPORTS/memory_guide.txt" ;;
*) echo "phase must be verify, nanogpt, sweep or xl, got '$PHASE'"; exit 2 ;;
esac
mkdir -p "$OUT" && tar czf "$OUT/$PHASE.tgz" -C "$REPORTS" .
