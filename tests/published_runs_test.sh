#!/usr/bin/env bash
# The step model against published training runs (bench/published/,
# docs/planner.md "Time model"): every run of runs.json planned at its
# published layout lands within 15 % of the published tokens/s per GPU,
# or runs.json explains its miss, and an explained miss still misses.
set -u
memplan="$1" root="${MEMPLAN_SOURCE_ROOT:?}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=$("$root/bench/published/compare" --memplan "$memplan" --check --json "$tmp/runs.json" 2>&1)
rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAIL: bench/published/compare --check exited $rc"; exit 1; }
python3 - "$tmp/runs.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["runs"]
kinds = {r["kind"] for r in rows}
gpus = {r["gpu"] for r in rows}
within = [r for r in rows if r["within_15_percent"]]
ok = len(rows) >= 8 and {"dense", "moe"} <= kinds and {"A100", "H100"} <= gpus and len(within) >= 8
print(f"published runs: {len(rows)} checked, {len(within)} within 15 %, kinds {sorted(kinds)}, GPUs {sorted(gpus)}")
sys.exit(0 if ok else 1)
PY
