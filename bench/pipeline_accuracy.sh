#!/usr/bin/env bash
# The pipeline part of the time model against real pipelines (issue 24's
# (b); docs/planner.md, "Calibration"): calibrates the host backend, then
# plans a small Llama (8 layers, hidden 128, 128 tokens per micro-batch)
# with pp 1 and 2, vp 1 and 2, 2 to 8 microbatches, runs each plan under
# `mpirun -np pp` (one process per pipeline rank, in parallel on this
# machine's cores) N times, and prints the plan's step (overhead.step_s:
# the pipeline simulation, bubbles included) against the median measured
# step (MEASURED.json step_s: the slowest rank's wall time of the
# schedule), the predicted and measured bubble share of pp 2 against pp 1
# at the same microbatches, and Spearman's rho over every row.
#
#   bench/pipeline_accuracy.sh [N]     # N runs per row, default 3
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
memplan=build/tools/memplan
command -v mpirun >/dev/null || { echo "pipeline_accuracy: mpirun not found"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$memplan" calibrate -o "$tmp/hw.json" -q
row() {  # row PP VP MICROBATCHES
  local pp=$1 vp=$2 mbs=$3
  python3 - "$tmp/m.json" "$pp" "$vp" "$mbs" <<'PY'
import json, sys
m = json.load(open("examples/models/tiny-llama.json"))
out, pp, vp, mbs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m["arch"].update(layers=8, hidden=128, ffn_hidden=256)
m["train"].update(seq_len=128, micro_batch=1, microbatches=mbs)
m["parallel"].update(pp=pp, vp=vp, dp=1)
m["hardware"] = {"calibration": "hw.json"}
json.dump(m, open(out, "w"))
PY
  "$memplan" plan "$tmp/m.json" -o "$tmp/p.json" -q
  local times=()
  for _ in $(seq "$n"); do
    mpirun --oversubscribe -np "$pp" "$memplan" run "$tmp/p.json" -o "$tmp/r.json" -q
    times+=("$(python3 -c "import json; print(json.load(open('$tmp/r.json'))['step_s'])")")
  done
  python3 - "$pp" "$vp" "$mbs" "$tmp/p.json" "${times[@]}" <<'PY' | tee -a "$tmp/rows"
import json, statistics, sys
pp, vp, mbs, plan = sys.argv[1], sys.argv[2], sys.argv[3], json.load(open(sys.argv[4]))
times = [float(t) for t in sys.argv[5:]]
pred, med = plan["overhead"]["step_s"], statistics.median(times)
print(f"| {pp} | {vp} | {mbs} | {pred*1e3:.1f} | {med*1e3:.1f} ({min(times)*1e3:.0f}-{max(times)*1e3:.0f}) | {100*(med-pred)/pred:+.1f} % |")
PY
}
echo "| pp | vp | microbatches | predicted step (ms) | measured median (range) (ms) | measured vs predicted |"
echo "|---|---|---|---|---|---|"
for mbs in 2 4 8; do
  row 1 1 "$mbs"
  row 2 1 "$mbs"
  row 2 2 "$mbs"
done
python3 - "$tmp/rows" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    c = [x.strip() for x in line.strip().strip("|").split("|")]
    rows.append((int(c[0]), int(c[1]), int(c[2]), float(c[3]), float(c[4].split()[0])))
sys.path.insert(0, "bench")
from spearman import spearman
n = len(rows)
rho = spearman([r[3] for r in rows], [r[4] for r in rows])
print(f"\nSpearman's rho (predicted step against measured median) over {n} rows: {rho:.3f}")
# Speed-up of pp 2 over pp 1 at the same microbatches: a perfect pipeline
# halves the step; 1F1B's bubble leaves m / (m + p - 1) of that.
one = {r[2]: r for r in rows if r[0] == 1}
print("\n| microbatches | vp | pp 2 / pp 1 predicted | measured | closed form: (m+1)/(2m), interleaved (1+1/(vm))/2 |")
print("|---|---|---|---|---|")
for r in rows:
    if r[0] != 2:
        continue
    base = one[r[2]]
    closed = (r[2] + 1) / (2 * r[2]) if r[1] == 1 else (1 + 1 / (r[1] * r[2])) / 2
    print(f"| {r[2]} | {r[1]} | {r[3]/base[3]:.3f} | {r[4]/base[4]:.3f} | {closed:.3f} |")
PY
