#!/usr/bin/env bash
# The quick benchmarks of two source trees, interleaved A B A B, with their ratios side by side.
#   bash benchmarks/golden/bench_compare.sh SRC_A SRC_B OUT_DIR
# Each of bench_losses.py --quick, bench_retrieval.py --sizes quick and bench_hashing.py --sizes
# quick runs for A, then B, then A, then B (the same machine state for both trees), from that
# tree's benchmarks/ with PYTHONPATH=<tree>/src; stdout goes to OUT_DIR/<bench>.<A|B><1|2>.log,
# the wall time of every run to OUT_DIR/durations.txt. The benchmarks' own ratios (time against
# their baselines, measured in one process) are printed per table row, A1 B1 A2 B2 side by side.
# PYTHON (default: python) must have rankwise's test extras (PML, torchmetrics, faiss optional).
# MAX_PASS_S (default 300): when the first pass (A1) takes longer, stop there and print its times
# (the comparison is then too slow for this machine's state; MAX_PASS_S=0 never stops).
set -uo pipefail
if [ $# -ne 3 ]; then echo "usage: $0 SRC_A SRC_B OUT_DIR" >&2; exit 2; fi
SRC_A=$(cd "$1" && pwd)
SRC_B=$(cd "$2" && pwd)
mkdir -p "$3" && OUT=$(cd "$3" && pwd)
PYTHON=${PYTHON:-python}
MAX_PASS_S=${MAX_PASS_S:-300}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
: > "$OUT/durations.txt"

# bench NAME TREE TAG ARGS...: one run of benchmarks/NAME.py of TREE, stdout to NAME.TAG.log
bench() {
    local name=$1 tree=$2 tag=$3 start
    shift 3
    start=$(date +%s.%N)
    (cd "$tree/benchmarks" && PYTHONPATH="$tree/src" "$PYTHON" "$name.py" "$@") \
        > "$OUT/$name.$tag.log" 2>&1 || echo "$name $tag failed (see $OUT/$name.$tag.log)" >&2
    printf '%-18s %-3s %7.1f s\n' "$name" "$tag" "$(echo "$(date +%s.%N) - $start" | bc)" \
        | tee -a "$OUT/durations.txt"
}

for round in 1 2; do
    for side in A B; do
        tree=$SRC_A && [ "$side" = B ] && tree=$SRC_B
        tag=$side$round
        pass_start=$(date +%s)
        bench bench_losses "$tree" "$tag" --quick --threads 1
        bench bench_retrieval "$tree" "$tag" --sizes quick --out "$OUT/bench_retrieval.$tag.md"
        bench bench_hashing "$tree" "$tag" --sizes quick --output "$OUT/bench_hashing.$tag.md"
        pass_s=$(($(date +%s) - pass_start))
        if [ "$tag" = A1 ] && [ "$MAX_PASS_S" -gt 0 ] && [ "$pass_s" -gt "$MAX_PASS_S" ]; then
            echo "the quick benchmarks took $pass_s s > MAX_PASS_S=$MAX_PASS_S: stopped after A1"
            break 2
        fi
    done
done

# every markdown table row of each log that has a ratio column: its heading and label, the ratios
"$PYTHON" - "$OUT" <<'PY'
import re, sys
from pathlib import Path

out = Path(sys.argv[1])
RATIO_COLUMN = re.compile(r"ratio|/ ours|speed-?up", re.I)


def ratio_rows(text):
    rows, header, heading = {}, None, ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("# ")[:28]
        if line.startswith("target:"):  # bench_losses' checks: "target: X ...: time ratio R (...)"
            rows[line.split(": time ratio")[0]] = line.split("time ratio")[1].split()[0]
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            for i, column in enumerate(header):
                if RATIO_COLUMN.search(column) and i < len(cells):
                    rows[f"{heading} | {cells[0][:40]} | {column}"] = cells[i]
    return rows


for name in ("bench_losses", "bench_retrieval", "bench_hashing"):
    logs = {t: out / f"{name}.{t}.log" for t in ("A1", "B1", "A2", "B2")}
    runs = {t: ratio_rows(p.read_text(errors="replace")) for t, p in logs.items() if p.exists()}
    print(f"\n== {name}: ratios " + " ".join(runs))
    for key in dict.fromkeys(k for rows in runs.values() for k in rows):
        print(f"{key[:100]:100s} " + " ".join(f"{rows.get(key, '-'):>8s}" for rows in runs.values()))
PY
