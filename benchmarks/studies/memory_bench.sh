#!/usr/bin/env bash
# Cross-batch memory for the ranking losses (issue 38, item 4): Fashion-MNIST instances from
# scratch (pi = 1/3,200, K = 4, batches of 64), each loss with and without loss.memory, seeds 0-2.
# AP: 1,600 steps, lr 1e-3 divided by 10 at steps 800 and 1,200, memory of 256 (4 batches) used
# from step 800 (half the budget, as XBM's released code warms up); SOPRC: 800 steps, decays at
# 400 / 600, memory from step 400. The best checkpoint on open-set validation is tested.
# Usage: bash benchmarks/studies/memory_bench.sh OUT   (then memory_table.py OUT)
set -euo pipefail
OUT=${1:?usage: memory_bench.sh OUT}
RANKWISE=${RANKWISE:-rankwise}
DATA="dataset.options.train_classes=3200 dataset.options.val_classes=250 dataset.options.test_classes=500"
run() {  # NAME SEED OVERRIDES...
  local name=$1 seed=$2
  shift 2
  [ -f "$OUT/${name}_s${seed}/report.json" ] && return 0
  "$RANKWISE" train -c configs/fashion_mnist_instances.yaml -o "$OUT/${name}_s${seed}" \
    sampler.batch_size=64 $DATA seed="$seed" "$@"
}
for seed in 0 1 2; do
  AP="loss.name=ap budget.iterations=1600 eval_every=160 schedule.name=multistep schedule.milestones=[800,1200]"
  SOPRC="loss.name=soprc budget.iterations=800 eval_every=80 schedule.name=multistep schedule.milestones=[400,600]"
  run ap_plain "$seed" $AP
  run ap_mem "$seed" $AP loss.memory.size=256 loss.memory.start_step=800
  run soprc_plain "$seed" $SOPRC
  run soprc_mem "$seed" $SOPRC loss.memory.size=256 loss.memory.start_step=400
done
