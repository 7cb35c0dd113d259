#!/usr/bin/env bash
# Issue 21's sampling-rate study on Fashion-MNIST instances (pi = 1/3,200): K = 2, 4, 8 views per
# class at (i) a fixed batch of 64 (32 / 16 / 8 classes per batch) and (ii) a fixed 16 classes per
# batch (batches of 32 / 64 / 128), from scratch and from a pretrained backbone (`rankwise pretrain`
# on the 10 categories of the training sources; fine-tuned with the backbone at BACKBONE_LR_MULT x
# the head's learning rate, default 1: chosen on open-set validation among 0.1 / 0.3 / 1, see
# docs/results.md), seeds 0-2; SOPRC (defaults), SOPRC with tpr_count=num_v (the released
# normalisation), AP, Smooth-AP, FastAP, contrastive, and SOPRC with detach_tpr=true (the released
# gradient; added last to each cell's list). 210 runs of BUDGET steps (default 800, validation every
# 80): 2-3 min each on one core of the 2-core development machine (4-6 when shared), 8-10 CPU-hours.
# Two more losses are known but not in the default list (issue 33): roadmap (ROADMAP) and
# recall_at_k (the Recall@k surrogate, the paper's settings: a fine-tuning loss, no gradient from
# scratch, docs/losses.md), e.g. the converged cells beside SOPRC, AP and Smooth-AP:
#   LOSSES_RUN="roadmap recall_at_k" STARTS=pretrained CELLS_RUN="fb_k2 fb_k8" BUDGET=2400 \
#   EVAL_EVERY=120 SCHEDULE=step bash benchmarks/studies/sampling_rate.sh runs/study21_conv
# and recall_at_k_detach, the Recall@k surrogate with detach_positive_ranks=true (issue 38: no
# gradient through the positives' ranks among themselves; docs/results.md).
#   bash benchmarks/studies/sampling_rate.sh [OUT]        (default OUT: runs/study21)
#   python benchmarks/studies/summarize_sampling_rate.py OUT
# Resumable: a finished run (report.json) is skipped, an interrupted one resumes from its
# checkpoint. Seed 0 of every cell runs first (pretrained start first), then seeds 1 and 2.
# Subsets: SEEDS, STARTS, CELLS_RUN and LOSSES_RUN (space-separated) restrict the lists, e.g. a
# longer-budget check: BUDGET=3200 EVAL_EVERY=320 CELLS_RUN="fb_k2 fb_k8" SEEDS=0 ... OUT_LONG.
# Learning-rate schedule: SCHEDULE=none (default: constant, what the 800-step tables use) or
# SCHEDULE=step, the SOPRC paper's form (App. D: lr x 0.1 twice), here at 50 % and 75 % of BUDGET so
# that the last quarter runs at 1 % of the learning rate and validation can plateau within the budget
# (the converged re-run: BUDGET=2400 EVAL_EVERY=120 SCHEDULE=step ... runs/study21_conv).
# Parallel: each run is claimed with flock on OUT/<run>.lock, so N copies of this script share the
# list without running anything twice; on the 2-core machine start two with THREADS=1 (torch
# intra-op threads per run, recorded in each run's config.yaml; default: torch's own).
# Pretraining variance: PRETRAIN_SEED=N pretrains OUT/pretraining with seed=N (default: the config's
# seed, 0); one OUT per pretraining seed, e.g. issue 30's study:
#   PRETRAIN_SEED=1 SEEDS=0 STARTS=pretrained CELLS_RUN="fb_k2 fb_k8" LOSSES_RUN="soprc ap smooth_ap" \
#   BUDGET=2400 EVAL_EVERY=120 SCHEDULE=step bash benchmarks/studies/sampling_rate.sh runs/study30/pre1
set -euo pipefail
OUT=${1:-runs/study21}
RANKWISE=${RANKWISE:-rankwise}
BUDGET=${BUDGET:-800}
EVAL_EVERY=${EVAL_EVERY:-80}
THREADS=${THREADS:+threads=$THREADS}
PRETRAIN_SEED=${PRETRAIN_SEED:+seed=$PRETRAIN_SEED}
BACKBONE_LR_MULT=${BACKBONE_LR_MULT:-1.0}
case ${SCHEDULE:-none} in
    none) SCHEDULE_ARGS="" ;;
    step) SCHEDULE_ARGS="schedule.name=multistep schedule.milestones=[$((BUDGET / 2)),$((BUDGET * 3 / 4))]" ;;
    *) echo "SCHEDULE=$SCHEDULE: use none or step" >&2; exit 2 ;;
esac
CONFIG=configs/fashion_mnist_instances.yaml
DATA="dataset.options.train_classes=3200 dataset.options.val_classes=250 dataset.options.test_classes=500"
mkdir -p "$OUT"
# one copy pretrains, the others wait for it
exec {PRE}> "$OUT/pretraining.lock"
flock "$PRE"
if [ ! -f "$OUT/pretraining/pretrained.pt" ] && [ -f "$OUT/pretraining/checkpoints/last.pt" ]; then
    # an interrupted pretraining (Ctrl-C, SIGTERM) continues from its checkpoint, bit for bit
    $RANKWISE pretrain --resume "$OUT/pretraining"
elif [ ! -f "$OUT/pretraining/pretrained.pt" ]; then
    $RANKWISE pretrain -c $CONFIG -o "$OUT/pretraining" --steps 400 --batch-size 128 $DATA $PRETRAIN_SEED
fi
exec {PRE}>&-
# cell -> "views_per_class batch_size"; fc_k4 (16 classes x 4) is fb_k4
declare -A CELLS=([fb_k4]="4 64" [fb_k2]="2 64" [fb_k8]="8 64" [fc_k2]="2 32" [fc_k8]="8 128")
# loss label -> overrides
declare -A LOSSES=([soprc]="loss.name=soprc" [soprc_numv]="loss.name=soprc loss.params.tpr_count=num_v"
    [ap]="loss.name=ap" [smooth_ap]="loss.name=smooth_ap" [fastap]="loss.name=fastap"
    [contrastive]="loss.name=contrastive"
    [soprc_detach]="loss.name=soprc loss.params.detach_tpr=true"
    [roadmap]="loss.name=roadmap" [recall_at_k]="loss.name=recall_at_k"
    [recall_at_k_detach]="loss.name=recall_at_k loss.params.detach_positive_ranks=true")
for seed in ${SEEDS:-0 1 2}; do
    for start in ${STARTS:-pretrained scratch}; do
        START=""
        [ $start = pretrained ] && START="model.pretrained=$OUT/pretraining optimizer.backbone_lr_mult=$BACKBONE_LR_MULT"
        for cell in ${CELLS_RUN:-fb_k4 fb_k2 fb_k8 fc_k2 fc_k8}; do
            read -r K B <<< "${CELLS[$cell]}"
            for loss in ${LOSSES_RUN:-soprc soprc_numv ap smooth_ap fastap contrastive soprc_detach}; do
                RUN="$OUT/$start/$cell/$loss/seed$seed"
                grep -qs '"status": "completed"' "$RUN/report.json" && continue
                mkdir -p "$(dirname "$RUN")"
                # another copy of this script holds the run: leave it to that copy
                exec {LOCK}> "$RUN.lock"
                flock -n "$LOCK" || { exec {LOCK}>&-; continue; }
                grep -qs '"status": "completed"' "$RUN/report.json" && { exec {LOCK}>&-; continue; }
                if [ -f "$RUN/checkpoints/last.pt" ]; then
                    $RANKWISE train --resume "$RUN" >> "$RUN.log" 2>&1 \
                        || { echo "failed: $RUN (log: $RUN.log)" >&2; exit 1; }
                else
                    # shellcheck disable=SC2086
                    $RANKWISE train -c $CONFIG -o "$RUN" budget.iterations=$BUDGET \
                        eval_every=$EVAL_EVERY $SCHEDULE_ARGS $DATA $START seed=$seed ${LOSSES[$loss]} $THREADS \
                        dataset.options.views_per_class=$K sampler.m=$K sampler.batch_size=$B \
                        > "$RUN.log" 2>&1 || { echo "failed: $RUN (log: $RUN.log)" >&2; exit 1; }
                fi
                echo "done: $RUN"
                exec {LOCK}>&-
            done
        done
    done
done
