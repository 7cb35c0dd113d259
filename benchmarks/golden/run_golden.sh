#!/usr/bin/env bash
# Golden outputs of one source tree: the snapshot, the demo, the examples and quick CLI runs.
#   bash benchmarks/golden/run_golden.sh SRC_DIR OUT_DIR      (SRC_DIR holds src/, examples/, configs/)
# Compare two OUT_DIRs with compare_golden.py --ignore-file benchmarks/golden/nondeterministic.txt.
# Runs at nice 19 on one thread (OMP / MKL / numba): 11-18 min on the shared 2-core machine at load
# averages of 6-10; each step's wall time goes to OUT_DIR/durations.txt.
# PYTHON (default: python) must have rankwise's test extras; PYTHONPATH is set to SRC_DIR/src.
set -uo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 SRC_DIR OUT_DIR" >&2; exit 2; fi
SRC=$(cd "$1" && pwd)
mkdir -p "$2" && OUT=$(cd "$2" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
export PYTHONPATH="$SRC/src" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1 PYTHONHASHSEED=0
export MPLBACKEND=Agg NO_COLOR=1 COLUMNS=120
RW=(nice -n 19 "$PYTHON")
cd "$SRC" || exit 2
"$PYTHON" -c "import rankwise, sys; sys.exit(not rankwise.__file__.startswith('$SRC/src'))" \
    || { echo "rankwise is not imported from $SRC/src" >&2; exit 2; }
: > "$OUT/durations.txt"
echo "$SRC" > "$OUT/source.txt"
FAILED=0

# step NAME CMD...: run CMD, stdout+stderr to OUT/logs/NAME.log, record its wall time and status
step() {
    local name=$1 start rc
    shift
    mkdir -p "$OUT/logs"
    start=$(date +%s.%N)
    "$@" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    printf '%-40s %8.1f s  rc=%d\n' "$name" "$(echo "$(date +%s.%N) - $start" | bc)" "$rc" \
        | tee -a "$OUT/durations.txt"
    [ "$rc" -eq 0 ] || FAILED=1
}

step snapshot "${RW[@]}" "$HERE/snapshot.py" "$OUT/snapshot.pt"
step demo "${RW[@]}" -m rankwise bench --dataset digits-instances --quick \
    --losses contrastive,ap,soprc,auc --output "$OUT/demo" --overwrite sampler.batch_size=64
for example in own_loop trainer_own_model lightning_module; do
    step "example_$example" "${RW[@]}" "examples/$example.py" --steps 60
done
step example_cli env PYTHON="$PYTHON" OUT="$OUT/example-cli" STEPS=60 nice -n 19 bash examples/cli.sh
step hash "${RW[@]}" -m rankwise hash train --dataset digits --bits 12,24 \
    --methods untrained,talr,dpsh --quick --output "$OUT/hash" --overwrite
step hash_evaluate "${RW[@]}" -m rankwise hash evaluate "$OUT/hash"
step roc_fit "${RW[@]}" -m rankwise roc fit --dataset digits --alpha 0.05 --n-train 300 \
    --n-test 300 --max-iter 100 --output "$OUT/roc" --overwrite
step tune "${RW[@]}" -m rankwise tune --dataset digits --quick --losses ap \
    --grid optimizer.lr=0.001,0.003 --output "$OUT/tune" --overwrite budget.iterations=60 eval_every=30
step train "${RW[@]}" -m rankwise train --config configs/digits.yaml --output "$OUT/train" \
    --overwrite budget.iterations=60 eval_every=30
# every registered experiment whose --quick runs in under about a minute on the busy 2-core
# machine (left out: fast-rates took 103 s, hash-euclidean-ndcg 125 s, mmc-subsampling 82 s)
for experiment in estimator-bias interpolation-error auc-slope pointwise-roc-sphere; do
    step "experiment_$experiment" "${RW[@]}" -m rankwise experiment "$experiment" --quick --seed 0 \
        --output "$OUT/experiments/$experiment" --overwrite
done
# checkpoints, images and arrays are not compared; only JSON, tables and logs are kept
find "$OUT" \( -name '*.pt' ! -name snapshot.pt -o -name '*.png' -o -name '*.npz' -o -name '*.npy' \
    -o -name '*.ckpt' \) -delete
echo "done: $OUT (failed steps: $FAILED)"
exit "$FAILED"
