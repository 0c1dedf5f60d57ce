#!/usr/bin/env bash
# How well a calibrated time model predicts `memplan run` on this machine
# (docs/planner.md, "Calibration"): calibrates the host backend, then for
# every runnable example (and tiny-llama under each storage policy) plans
# with the calibration, runs N times and prints the plan's
# overhead.emulated_s against the median measured compute_s; then
# tiny-llama with its layers and micro-batch size varied (what one rank
# computes grows with both), and Spearman's rank correlation between the
# predictions and the measurements over every row: does the time model rank
# configurations as the runs do (issue 24's (a), goal rho >= 0.9)?
#
#   bench/calibration_accuracy.sh [N]     # N runs per row, default 3
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-3}
memplan=build/tools/memplan
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$memplan" calibrate -o "$tmp/hw.json" -q
python3 - "$tmp/hw.json" <<'PY'
import json, sys
h = json.load(open(sys.argv[1]))["hardware"]
print(f"calibration: GEMM {h['bf16_flops']/1e9:.2f} GFLOP/s, memory {h['hbm_bw']/1e9:.1f} GB/s, per-op {h['launch_s']*1e6:.2f} us")
PY
row() {  # row NAME MODEL.json [POLICY] [PYTHON-EDIT-OF-m]
  local name=$1 src=$2 policy=${3:-} edit=${4:-}
  python3 - "$src" "$tmp/m.json" "$policy" "$edit" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["hardware"] = {"calibration": "hw.json"}
if sys.argv[3]:
    m["policies"] = [{"match": "*", "policy": sys.argv[3]}]
if sys.argv[4]:
    exec(sys.argv[4])
json.dump(m, open(sys.argv[2], "w"))
PY
  "$memplan" plan "$tmp/m.json" -o "$tmp/p.json" -q
  local times=()
  for _ in $(seq "$n"); do
    "$memplan" run "$tmp/p.json" -o "$tmp/r.json" -q
    times+=("$(python3 -c "import json; print(json.load(open('$tmp/r.json'))['compute_s'])")")
  done
  python3 - "$name" "$tmp/p.json" "${times[@]}" <<'PY'
import json, statistics, sys
name, plan, times = sys.argv[1], json.load(open(sys.argv[2])), [float(t) for t in sys.argv[3:]]
pred, med = plan["overhead"]["emulated_s"], statistics.median(times)
spread = f"{min(times)*1e3:.0f}-{max(times)*1e3:.0f}"
print(f"| {name} | {pred*1e3:.1f} | {med*1e3:.1f} ({spread}) | {100*(med-pred)/pred:+.1f} % |")
PY
  python3 -c "import json,statistics,sys; print(json.load(open('$tmp/p.json'))['overhead']['emulated_s'], statistics.median(float(t) for t in sys.argv[1:]))" "${times[@]}" >>"$tmp/pairs"
}
echo "| model | predicted (ms) | measured median (range) (ms) | measured vs predicted |"
echo "|---|---|---|---|"
for m in tiny-llama tiny-gpt tiny-moe tiny-mla tiny-attnres tiny-deepseek tiny-k3-fp32 tiny-k3; do
  row "$m" "examples/models/$m.json"
done
for policy in recompute fp8 offload_host; do
  row "tiny-llama, every tensor $policy" examples/models/tiny-llama.json "$policy"
done
for layers in 8 12; do
  row "tiny-llama, $layers layers" examples/models/tiny-llama.json "" "m['arch']['layers'] = $layers"
done
for mb in 1 4; do
  row "tiny-llama, micro-batch $mb" examples/models/tiny-llama.json "" "m['train']['micro_batch'] = $mb"
done
read -r rho rows < <(python3 bench/spearman.py "$tmp/pairs")
echo "Spearman rho over $rows rows: $rho (goal >= 0.9)"

