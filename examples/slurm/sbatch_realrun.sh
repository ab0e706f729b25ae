#!/bin/bash
# Multi-node realrun under SLURM: one torchrun per node, NCCL on GPUs, rendezvous from SLURM variables.
#   sbatch --nodes 4 examples/slurm/sbatch_realrun.sh examples/my_gpu_run.toml
# The run config must say [realrun] backend = "nccl", device = "cuda", and
# cluster.pp x cluster.dp = nodes x GPUs per node (global rank r -> dp_rank r // pp, stage r % pp:
# with pp <= GPUs per node, pipeline P2P stays inside a node and only the DP all-reduce crosses nodes).
#SBATCH --job-name=sparsebalance-realrun
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch examples/slurm/sbatch_realrun.sh RUN.toml}
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export NCCL_ASYNC_ERROR_HANDLING=1   # a dead rank aborts the collectives instead of hanging them

# validate once, before any GPU process starts (bad config -> one line, exit 2)
python -c "import sys; from sparsebalance.commands.train import validate_for_launch; validate_for_launch(sys.argv[1], [])" "$CONFIG"

srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    -m sparsebalance.realrun --config "$CONFIG"
