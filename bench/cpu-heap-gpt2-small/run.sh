# usage: bash run.sh OUT_FOLDER N_LAYER N_HEAD N_EMBD [train.py arguments]   e.g. bash run.sh /tmp/h 12 12 768
# Under FSDP on 4 processes: U trains 4 steps (saves at 2 and 4), A trains 2, B resumes A to 4.
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
D=$1; L=$2; H=$3; E=$4; shift 4; mkdir -p $D; rm -f $D/[UAB].[0-3] $D/[UAB].log
COMMON="--n_layer=$L --n_head=$H --n_embd=$E --block_size=64 --batch_size=1 --global_batch_size=4 --lr_decay_iters=4 --warmup_iters=0 --eval_interval=2 --eval_iters=1 --log_interval=1 --dtype=float32 --device=cpu --strategy=fsdp --compile=False --dropout=0.0 --checkpoint_format=sharded --data_dir=$REPO/data/shakespeare_char"
cd "$REPO"
export OMP_NUM_THREADS=1
python -m torch.distributed.run --standalone --nproc_per_node=4 "$HERE/diag.py" $D/U $COMMON --max_iters=4 --out_dir=$D/u "$@" > $D/U.log 2>&1
python -m torch.distributed.run --standalone --nproc_per_node=4 "$HERE/diag.py" $D/A $COMMON --max_iters=2 --out_dir=$D/b "$@" > $D/A.log 2>&1
python -m torch.distributed.run --standalone --nproc_per_node=4 "$HERE/diag.py" $D/B $COMMON --max_iters=4 --out_dir=$D/b "$@" > $D/B.log 2>&1
rm -rf $D/u $D/b  # the checkpoints
for x in U A B; do echo "== $x rank 1"; cat $D/$x.1; done
