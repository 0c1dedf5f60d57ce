#!/usr/bin/env bash
# Planning time against microbatches, as a user runs it (docs/planner.md,
# "Periodic window"): `memplan plan` on bundled models with
# train.microbatches replaced, with the periodic window (the default) and
# simulating every microbatch (--full-simulation, refused past 50 000
# layer-microbatches).
#
#   bench/microbatch_sweep.sh [MODEL ...]   (default: llama3-70b deepseek-v3 kimi-k3-like)
set -euo pipefail
cd "$(dirname "$0")/.."
memplan=build/tools/memplan
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(llama3-70b deepseek-v3 kimi-k3-like)
echo "| model | microbatches | window | with window | every microbatch |"
echo "|---|---|---|---|---|"
for name in "${models[@]}"; do
  for mbs in 64 128 256 512 1024; do
    python3 - "examples/models/$name.json" "$tmp/m.json" "$mbs" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["train"]["microbatches"] = int(sys.argv[3])
json.dump(m, open(sys.argv[2], "w"))
PY
    cell() {  # cell [FLAGS]: "wall s, RSS MB" or why it was refused
      if /usr/bin/time -f "%e %M" -o "$tmp/time" "$memplan" plan "$tmp/m.json" -q -o "$tmp/p.json" "$@" 2>"$tmp/err"; then
        read -r wall rss <"$tmp/time"
        echo "$wall s, $((rss / 1024)) MB"
      else
        echo "refused"
      fi
    }
    with=$(cell)
    window=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["simulation"]; print(s["simulated"] if "period_microbatches" in s else "none")' "$tmp/p.json")
    full=$(cell --full-simulation)
    echo "| $name | $mbs | $window | $with | $full |"
  done
done
