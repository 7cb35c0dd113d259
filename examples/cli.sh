#!/usr/bin/env bash
# Way in no. 3: the command line with a config. Needs `pip install 'rankwise[cli]'`.
#   bash examples/cli.sh            # 300 steps into runs/example-cli
#   STEPS=20 OUT=/tmp/x bash examples/cli.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}   # `rankwise ...` is the same program as `python -m rankwise ...`
OUT=${OUT:-runs/example-cli}
STEPS=${STEPS:-300}
EVERY=$(( STEPS / 3 > 0 ? STEPS / 3 : 1 ))

# train (KEY=VALUE overrides any config key), then evaluate the saved run's embeddings' report
"$PYTHON" -m rankwise train --config examples/cli_digits.yaml --output "$OUT" --overwrite \
    budget.iterations="$STEPS" eval_every="$EVERY"
# an interrupted run (Ctrl-C) continues bit for bit with:
#   "$PYTHON" -m rankwise train --resume "$OUT"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
report = json.load(open(f"{sys.argv[1]}/report.json"))
print(f"best validation mAP {report['best_val']['map']:.4f} at step {report['best_step']}; "
      f"test mAP {report['test']['map']:.4f}")
PY
