#!/usr/bin/env bash
# `memplan search` as a user runs it (docs/planner.md, "Search"): wall time,
# peak memory and the layouts enumerated, planned and fitting, on the
# bundled K3-like model (2,048 GPUs, default space, top 10 and top 3), on
# DeepSeek-V3 and, exhaustively, on tiny-moe.
#
#   bench/search_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
memplan=build/tools/memplan
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| command | layouts | planned | fit | wall | max RSS |"
echo "|---|---|---|---|---|---|"
run() {  # run ARGS...
  /usr/bin/time -f "%e %M" -o "$tmp/time" "$memplan" search "$@" -q -o "$tmp/s.json" || true
  python3 - "$tmp/s.json" "$tmp/time" "$*" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
wall, rss = open(sys.argv[2]).read().split()
c = s["counts"]
print(f"| `memplan search {sys.argv[3]}` | {c['layouts']:,} | {c['planned']} | {c['fit']} | {float(wall):.1f} s | {int(rss)/1024:.0f} MB |")
PY
}
run examples/models/kimi-k3-like.json --gpus 2048
run examples/models/kimi-k3-like.json --gpus 2048 --top 3
run examples/models/deepseek-v3.json --gpus 2048
run examples/models/tiny-moe.json --gpus 8 --exhaustive
