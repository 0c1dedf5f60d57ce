#!/usr/bin/env bash
# memplan profile on a program with known allocations (tests/profile_target.cu):
# the profile recovers every device allocation and the 9 MiB peak exactly,
# lists each allocation with its size and pool, and --trace gets the memset.
# Needs a GPU: exits 77 (skip) without one.
set -u
memplan="$1" target="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$target" >/dev/null 2>&1
[ $? -eq 77 ] && { echo "no CUDA device: skipping"; exit 77; }
pass=0 fail=0
"$memplan" profile -o "$tmp/p.json" --trace "$tmp/t.json" -- "$target" >"$tmp/out" 2>"$tmp/err"
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
# Every allocation with its size: 1, 3, 5 MiB device (the two async ones on
# a stream, from a pool), 2 MiB managed; each freed.
allocs = d["cupti"]["allocations"]
sizes = sorted(a["bytes"] for a in allocs if a["op"] == "alloc" and a["kind"] in ("device", "managed"))
assert sizes == [1 * MiB, 2 * MiB, 3 * MiB, 5 * MiB], sizes
pooled = [a for a in allocs if a["op"] == "alloc" and "pool" in a]
assert sorted(a["bytes"] for a in pooled) == [3 * MiB, 5 * MiB], pooled
assert all(a["stream"] >= 0 for a in pooled), pooled
frees = [a for a in allocs if a["op"] == "free"]
assert len(frees) >= 4, frees
PY
python3 - "$tmp/t.json" <<'PY' && pass=$((pass + 1)) || fail=$((fail + 1))
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
memsets = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "gpu_memset"]
assert memsets and memsets[0]["args"]["bytes"] == 5 << 20, memsets
assert any(e.get("name") == "process_name" and e["args"]["name"] == "device 0" for e in ev)
PY
echo "profile: $pass passed, $fail failed"
[ $fail -eq 0 ]
