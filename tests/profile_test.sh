#!/usr/bin/env bash
# memplan profile on a program with known allocations (tests/profile_target.cu):
# the profile recovers every device allocation and the 9 MiB peak exactly.
# Needs a GPU: exits 77 (skip) without one.
set -u
memplan="$1" target="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$target" >/dev/null 2>&1
[ $? -eq 77 ] && { echo "no CUDA device: skipping"; exit 77; }
pass=0 fail=0
"$memplan" profile -o "$tmp/p.json" -- "$target" >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ $rc -eq 0 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: profile exit $rc: $(cat "$tmp/err")"; fi
python3 - "$tmp/p.json" <<'PY' && pass=$((pass + 1)) || fail=$((fail + 1))
import json, sys
p = json.load(open(sys.argv[1]))
MiB = 1 << 20
assert p["source"] == "cupti-injection", p["source"]
d = p["ranks"][0]
assert d["allocated_peak"] == 9 * MiB, f"allocated_peak {d['allocated_peak']} != 9 MiB"
assert d["peak"] >= 9 * MiB, d["peak"]
assert d["events"].get("allocations", 0) >= 3 and d["events"].get("releases", 0) >= 3, d["events"]
assert d["timeline"][-1][1] == 0, "not everything freed"
PY
echo "profile: $pass passed, $fail failed"
[ $fail -eq 0 ]
