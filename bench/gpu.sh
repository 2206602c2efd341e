#!/usr/bin/env bash
# A GPU session's work in a few commands of under 10 minutes each, run from the repo root on a GPU
# machine. Each phase leaves its logs and reports in $OUT/PHASE.tgz (default OUT: out-gpu) and
# prints a summary last.
#   bash bench/gpu.sh compare   # nanoGPT's bench.py, llm.c and ours on this GPU, one after the other
#   bash bench/gpu.sh verify    # GPU tests, the baby GPT end to end (ours and nanoGPT's), the fast suite
#   bash bench/gpu.sh tune      # candidate speed-ups on and off; GPT-2 xl's shape on one GPU
# The GPU machine has no network: NANOGPT is a folder with karpathy/nanoGPT's bench.py, model.py,
# configurator.py, train.py, config/ and data/shakespeare_char/ (with input.txt); LLMC a folder with
# llm.c's train_gpt2cu and a run.sh that runs it (neither is in this repo); SHAKESPEARE_INPUT tiny
# Shakespeare's input.txt. LIMIT=seconds bounds a phase; ONLY="name ..." runs just those items.
set -u
PHASE=${1:-compare}
OUT=${OUT:-out-gpu}
NANOGPT=$(realpath "${NANOGPT:-.gpu/nanogpt}")
LLMC=$(realpath "${LLMC:-.gpu/llmc}")
SHAKESPEARE_INPUT=$(realpath "${SHAKESPEARE_INPUT:-.gpu/input.txt}")
LIMIT=${LIMIT:-570}  # seconds for the whole phase: an item that would not fit in what is left is skipped
R=$(mktemp -d)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} | tee "$R/env.txt"

timed() {  # name, seconds, command...: its log in $R/name.log; its wall time and exit status in $R/times.txt
  local name=$1 limit=$2; shift 2
  [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]] && return  # ONLY="a b": just these items
  if (( SECONDS + limit > LIMIT )); then echo "=== $name: skipped, $((LIMIT - SECONDS)) s left" | tee -a "$R/times.txt"; return; fi
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "$name exit $rc after $((SECONDS - t0)) s" | tee -a "$R/times.txt"; tail -n 2 "$R/$name.log"
}
ours() {  # name, seconds, bench.py arguments...: one GPT-2 124M bench.py run on one process
  local name=$1 limit=$2; shift 2
  timed "$name" "$limit" python3 bench.py configs/gpt_small.py --nproc=1 --report="$R/$name" "$@"
}
nanogpt_bench() {  # batch size: nanoGPT's bench.py on one fixed random batch, bias off, compiled
  timed "nanogpt_b$1" 150 bash -c "cd '$NANOGPT' && python3 bench.py --real_data=False --batch_size=$1 --compile=True"
}

case $PHASE in
compare)
  # nanoGPT's bench.py: bias off, 50304 vocabulary rows, bf16, compiled, no clipping, accumulation 1,
  # 10 warm-up and 20 timed steps. Ours at its settings (bench.py's loader reads synthetic tokens).
  as_nanogpt=(--bias=False --grad_clip=0 --steps=20 --warmup=10)
  for b in 12 32; do
    nanogpt_bench $b
    ours "ours_b${b}_as_nanogpt" 150 --batch_size=$b --global_batch_size=$b "${as_nanogpt[@]}"
  done
  timed llmc_b32 150 env OUT="$R/llmc" bash "$LLMC/run.sh" 32 30  # llm.c with cuDNN attention
  # ours as configured (gpt_small: bias, clipping, 512 x 1024 tokens a step), then micro-batch 64
  ours gpt_small_b32 150 --steps=6 --warmup=2 --profile
  ours gpt_small_b64 150 --steps=6 --warmup=2 --batch_size=64
  timed llmc_nocudnn_b32 120 env OUT="$R/llmc" LLMC_VARIANT=nocudnn bash "$LLMC/run.sh" 32 30 ;;
verify)
  timed test_gpu 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
  timed test_cuda_cases 120 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_bad_input.py tests/test_train.py
  # the baby GPT: nanoGPT's README reports val ~1.47 after 5000 iterations, ~3 minutes on an A100
  timed baby_nanogpt 200 bash -c "cd '$NANOGPT' && python3 data/shakespeare_char/prepare.py && python3 train.py config/train_shakespeare_char.py"
  timed baby_ours 200 python3 train.py configs/shakespeare_char.py --compile=True --out_dir="$R/out-sc" \
    --data_dir="$R/data-sc" --prepare_input="$SHAKESPEARE_INPUT"
  timed sample 60 python3 sample.py --out_dir="$R/out-sc" --num_samples=2 --max_new_tokens=300
  rm -f "$R"/out-sc/*.pt
  # the fast suite (CPU tests), spread over the host's cores: the whole suite under pytest-xdist
  # ran 209 of 527 tests in 365 s there (its process-starting tests import CUDA torch each time)
  timed test_fast 180 python3 -m pytest -q -p no:cacheprovider -m "not slow" -n 8 --timeout=120 -rfEs ;;
tune)
  timed loss_kernels 90 python3 bench/loss_kernels.py
  timed attention_kernels 60 python3 bench/attention_kernels.py --batch=32
  B=${BEST_BATCH:-64}
  # inductor's own switches: tune each generated kernel's block sizes; autotune matmul templates too
  for tuning in COORDINATE_DESCENT_TUNING MAX_AUTOTUNE; do
    timed "${tuning,,}_b$B" 300 env "TORCHINDUCTOR_$tuning=1" python3 bench.py configs/gpt_small.py --nproc=1 \
      --report="$R/${tuning,,}_b$B" --steps=6 --warmup=2 --batch_size=$B
  done
  # GPT-2 xl's shape (1.5B) on one GPU, activations kept
  ours xl_b8 240 --global_batch_size=64 --steps=3 --warmup=2 --n_layer=48 --n_head=25 --n_embd=1600 --batch_size=8
  python3 scripts/memory_guide.py --world=1 --batch_size=8 > "$R/memory_guide.txt" 2>&1 ;;
*) echo "phase must be compare, verify or tune, got '$PHASE'"; exit 2 ;;
esac
python3 bench/gpu_summary.py "$R" | tee "$R/summary.md"
cp "$R/summary.md" "$OUT/$PHASE-summary.md"
tar czf "$OUT/$PHASE.tgz" --exclude='*.pt' --exclude='*.bin' --exclude='data-sc' -C "$R" .
