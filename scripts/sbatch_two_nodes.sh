#!/bin/bash
# Train on two nodes with SLURM: one torchrun per node, one train.py per GPU.
# Prepare the data once, then submit from the repo folder (on a disk every node sees) with the
# Python environment active (the job inherits it); arguments go to train.py:
#
#   python data/fineweb/prepare.py        # configs/gpt_small.py trains on FineWeb-Edu
#   sbatch scripts/sbatch_two_nodes.sh configs/gpt_small.py --out_dir=out-gpt-small
#
#SBATCH --job-name=gpt-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1        # one torchrun per node; it starts the train.py processes
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32         # for all of a node's train.py processes together
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
# SIGTERM 2 minutes before the time limit, to every process of the job's steps (not B:, which
# signals only this shell): all ranks stop at the next step boundary, rank 0 writes
# out_dir/last.pt, and the same sbatch command later continues from it (resume=auto).
#SBATCH --signal=TERM@120
set -euo pipefail

nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:?no GPUs on this node: set NPROC_PER_NODE, processes per node}}

# --cpus-per-task again for srun: Slurm 22.05 and 23.02 do not pass the job's value on to it.
# torchrun waits up to --shutdown-timeout seconds for its workers to save after SIGTERM.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$nproc" \
    --rdzv-backend=c10d --rdzv-endpoint="${nodes[0]}:29500" --rdzv-id="$SLURM_JOB_ID" \
    --shutdown-timeout=110 \
    train.py "$@"

# srun alone, without torchrun: one task per GPU (#SBATCH --ntasks-per-node=8 and
# --cpus-per-task=4 above). train.py reads SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_LOCALID,
# and takes MASTER_ADDR from the first node of the list and MASTER_PORT from the job and step ids.
#
#   srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python train.py "$@"
