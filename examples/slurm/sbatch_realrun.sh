#!/bin/bash
# Multi-node realrun under SLURM: one torchrun per node, NCCL on GPUs, rendezvous from SLURM variables.
#   sbatch examples/slurm/sbatch_realrun.sh                       (default: the ready example below, 1 node)
#   sbatch --nodes 4 examples/slurm/sbatch_realrun.sh RUN.toml    (a config with pp x dp = 32)
# The run config must say [realrun] backend = "nccl", device = "cuda", and
# cluster.pp x cluster.dp = nodes x GPUs per node (global rank r -> dp_rank r // pp, stage r % pp:
# with pp <= GPUs per node, pipeline P2P stays inside a node and only the DP all-reduce crosses nodes).
#SBATCH --job-name=sparsebalance-realrun
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

CONFIG=${1:-examples/gpu_qwen25-0.5b_pp2dp4.toml}   # Qwen2.5-0.5B, PP 2 x DP 4 on 8 GPUs
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a dead rank aborts the collectives instead of hanging them

# validate once, before any GPU process starts (bad config -> one line, exit 2)
python -c "import sys; from sparsebalance.commands.train import validate_for_launch; validate_for_launch(sys.argv[1], [])" "$CONFIG"
python -c "import sys; from sparsebalance.runconfig import load_run_config; c = load_run_config(sys.argv[1]).cluster; n = int(sys.argv[2]) * int(sys.argv[3]); sys.exit(0 if c.pp * c.dp == n else f'cluster.pp x cluster.dp = {c.pp * c.dp}, but the job has {n} GPUs (nodes x GPUs per node)')" "$CONFIG" "$SLURM_NNODES" "$GPUS_PER_NODE"

srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    -m sparsebalance.realrun --config "$CONFIG"
