#!/bin/bash
# A sweep on a Ray cluster built over a SLURM allocation: a Ray head on the first node, one Ray
# worker per other node, then `sparsebalance sweep --backend ray --address HEAD:PORT` from the head.
#   sbatch --nodes 4 examples/slurm/sbatch_sweep_ray.sh examples/sweep_anchor_p.toml results/sweep_ray
# Every node needs the same virtual environment with sparsebalance[cluster] (a shared file system
# does it). The sweep itself only needs CPUs: results are stored by the driver on the head node, so a
# killed job resumes when the same command is submitted again with the same --out.
#SBATCH --job-name=sparsebalance-sweep
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

GRID=${1:?usage: sbatch examples/slurm/sbatch_sweep_ray.sh GRID.toml [OUT]}
OUT=${2:-results/sweep_ray}
PORT=${RAY_PORT:-6379}
CPUS=${SLURM_CPUS_PER_TASK:-32}
export OMP_NUM_THREADS=1

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')

srun --nodes=1 --ntasks=1 -w "$HEAD" \
    ray start --head --node-ip-address="$HEAD_IP" --port="$PORT" --num-cpus="$CPUS" --block &
sleep 15
for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" \
        ray start --address="$HEAD_IP:$PORT" --num-cpus="$CPUS" --block &
done
sleep 15

sparsebalance sweep --grid "$GRID" --out "$OUT" --backend ray --address "$HEAD_IP:$PORT" --progress
status=$?
ray stop --force || true   # this job's Ray only: the allocation's nodes are ours
exit $status
