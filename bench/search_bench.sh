#!/usr/bin/env bash
# `memplan search` as a user runs it (docs/planner.md, "Search"): wall time,
# peak memory and the layouts enumerated, planned and fitting, on
# Llama-3.1-405B imported from its Hugging Face config (1,024 GPUs, global
# batch 2,048 x 8,192, default space, top 10), the bundled K3-like model
# (2,048 GPUs, default space, top 10 and top 3), DeepSeek-V3 and,
# exhaustively, tiny-moe; then one plan of each bundled large model.
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
"$memplan" import hf tests/data/hf/llama-3.1-405b.json --gpus 1024 --global-batch 2048 --seq 8192 -o "$tmp/llama-3.1-405b.json" >/dev/null
run "$tmp/llama-3.1-405b.json" --gpus 1024 --global-batch 2048
run examples/models/kimi-k3-like.json --gpus 2048
run examples/models/kimi-k3-like.json --gpus 2048 --top 3
run examples/models/deepseek-v3.json --gpus 2048
run examples/models/tiny-moe.json --gpus 8 --exhaustive
echo
echo "| command | wall | max RSS |"
echo "|---|---|---|"
for m in deepseek-v3 kimi-k3-like kimi-k2 llama3-70b gpt3-175b; do
  /usr/bin/time -f "%e %M" -o "$tmp/time" "$memplan" plan "examples/models/$m.json" -q -o "$tmp/p.json" >/dev/null 2>&1 || true
  read -r wall rss <"$tmp/time"
  printf '| `memplan plan examples/models/%s.json` | %.1f s | %.0f MB |\n' "$m" "$wall" "$(echo "$rss / 1024" | bc -l)"
done
