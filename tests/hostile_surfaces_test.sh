#!/usr/bin/env bash
# Hostile and inconsistent input on the surfaces added after the first
# fuzzing round (issue 23), one case per failure class that reproduced
# before its fix; the MPI classes (options on one rank, equal digests with
# other decisions, a dump's staging when a rank dies) are in mpi_test.sh
# (section agreement), the report's in viz_test.sh.
#   3. a FIFO where a file is read (a calibration file; a profile file)
#   4. documented in-range sizes: refused or planned in seconds and memory
#   5. every plan `plan` writes, `run` executes (the one storage rule)
#   8. --dump's staging removed when a signal ends the run
#   9. check: every rank of the data-parallel grid exactly once
#  10. SIGTERM to `memplan profile`: forwarded, waited for, cleaned up
# and the minor ones: check's one-line reason when only the process total
# fails; profile keeps its program's exit status.
# Usage: hostile_surfaces_test.sh MEMPLAN [inputs|signals] (default: both).
set -u
memplan="$1"
section="${2:-all}"
want() { [ "$section" = all ] || [ "$section" = "$1" ]; }
root="${MEMPLAN_SOURCE_ROOT:?}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }
model() {  # FILE OUT python-statements-on-m
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
exec(sys.argv[3])
json.dump(m, open(sys.argv[2], "w"))
PY
}
# Runs a command with a wall-clock limit; its exit status, its stderr in
# $tmp/err, its time in $took (s).
timed() {  # limit command...
  local limit=$1 start
  shift
  start=$(date +%s.%N)
  timeout -s KILL "$limit" "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  took=$(python3 -c "print(round($(date +%s.%N) - $start, 1))")
}

if want inputs; then
# 3. A FIFO nobody writes, named as the calibration file: refused after
#    MEMPLAN_INPUT_TIMEOUT_S, naming the model's JSON path; not a hang.
mkdir -p "$tmp/cal"
mkfifo "$tmp/cal/hw.fifo"
model "$root/examples/models/tiny-gpt.json" "$tmp/cal/model.json" 'm["hardware"] = {"calibration": "hw.fifo"}'
MEMPLAN_INPUT_TIMEOUT_S=1 timed 20 "$memplan" plan "$tmp/cal/model.json" -o "$tmp/never.json"
[ "$rc" -eq 2 ] && grep -q "model.json: /hardware/calibration: .*hw.fifo: cannot read: no data for 1 s" "$tmp/err" \
  && [ "$(wc -l <"$tmp/err")" -eq 1 ] && [ ! -e "$tmp/never.json" ] && ok || bad "calibration FIFO: exit $rc in $took s: $(cat "$tmp/err")"
# A FIFO that is written is read (a shell's process substitution).
"$memplan" plan <(cat "$root/examples/models/tiny-gpt.json") -q -o "$tmp/fifo.plan.json" 2>"$tmp/err" && ok \
  || bad "a model through a pipe: $(cat "$tmp/err")"

# 4. Documented sizes: a one-line refusal in milliseconds past the limits,
#    the static-memory refusal before any liveness work, and a plan at the
#    layers x microbatches limit, each within 20 s and 2 GiB of address
#    space (measured figures: docs/design.md, "Input limits and hostile
#    input").
sizes=0
while IFS='|' read -r what edit want_rc pattern; do
  model "$root/examples/models/tiny-gpt.json" "$tmp/size.json" "$edit"
  rc=$( (ulimit -v $((2 << 20)); timed 20 "$memplan" plan "$tmp/size.json" -q -o "$tmp/size.plan.json"; echo "$rc $took") )
  took=${rc#* }
  rc=${rc%% *}
  if [ "$rc" -eq "$want_rc" ] && { [ -z "$pattern" ] || grep -q "$pattern" "$tmp/err"; }; then sizes=$((sizes + 1)); else
    bad "$what: exit $rc (want $want_rc) in $took s: $(head -c 300 "$tmp/err")"; fi
  echo "size: $what: exit $rc in $took s"
  rm -f "$tmp/size.plan.json"
done <<'CASES'
1e6 microbatches (past the limit)|m["train"]["microbatches"] = 10**6|2|size.json: /train/microbatches: expected an integer in \[1, 200000\]
100 000 layers (past the limit)|m["arch"]["layers"] = 100000|2|size.json: /arch/layers: expected an integer in \[1, 10000\]
5000 layers x 41 microbatches|m["arch"]["layers"] = 5000; m["train"]["microbatches"] = 41|2|size.json: /train/microbatches: 41 microbatches of 5000 layers is 205000 layer-microbatches; the planner's limit is 200000
5000 layers x 11 microbatches (a periodic window of 10)|m["arch"]["layers"] = 5000; m["train"]["microbatches"] = 11|0|
10 000 layers over budget in statics|m["arch"]["layers"] = 10000; m["arch"]["hidden"] = 4096; m["arch"]["ffn_hidden"] = 16384; m["parallel"]["pp"] = 2|3|infeasible: pp rank 0's static memory alone is
50 000 microbatches of 4 layers (at the limit, a periodic window)|m["train"]["microbatches"] = 50000; m["budget"] = 2**50|0|
CASES
[ "$sizes" -eq 6 ] && ok

# 5. Tight budgets with keep annotations: whatever `plan` writes, `run`
#    executes. Every tensor but the ones later layers read in place is
#    pinned to keep, so the pipeline rebalancer, short of memory, looks at
#    those (it once stored layer0.embed.out remote, and run refused it).
planned=0 ran=0
for m in tiny-attnres; do  # (its AttnRes partials and embedding output are read in place)
  model "$root/examples/models/$m.json" "$tmp/free.json" 'm["parallel"]["pp"] = 2; m.pop("budget", None)'
  "$memplan" plan "$tmp/free.json" -o "$tmp/free.plan.json" -q
  python3 - "$tmp/free.json" "$tmp/free.plan.json" "$tmp/tight.json" <<'PY'
import json, sys
m, p = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
m["policies"] = [{"match": t["name"], "policy": "keep"} for t in p["tensors"]
                 if not t["name"].endswith(("attn_res.partial", "embed.out"))]
json.dump(m, open(sys.argv[3], "w"))
PY
  "$memplan" plan "$tmp/tight.json" -o "$tmp/pinned.plan.json" -q
  for frac in 0 0.5 0.9; do
    # Between the any-plan bound and the keep-all peak.
    budget=$(python3 -c "import json; p = json.load(open('$tmp/pinned.plan.json'))
lo, hi = max(p['any_plan_lower_bound']), max(r['peak'] for r in p['ranks'])
print(int(lo + $frac * (hi - lo)))")
    "$memplan" plan "$tmp/tight.json" --budget "$budget" -o "$tmp/tight.plan.json" -q 2>/dev/null || continue
    planned=$((planned + 1))
    "$memplan" run "$tmp/tight.plan.json" -q -o "$tmp/tight.m.json" 2>"$tmp/err" && ran=$((ran + 1)) \
      || bad "$m at budget $budget: plan wrote it, run refused: $(cat "$tmp/err")"
  done
done
echo "storage rule: $planned plans written under tight budgets, $ran executed"
[ "$planned" -ge 2 ] && [ "$ran" -eq "$planned" ] && ok || bad "storage rule: $planned planned, $ran ran"

# 9. check: the data-parallel grid, each rank once.
model "$root/examples/models/tiny-llama.json" "$tmp/dp.json" 'm["parallel"].update(pp=1, vp=1, dp=2)'
"$memplan" plan "$tmp/dp.json" -o "$tmp/dp.plan.json" -q
"$memplan" plan "$root/examples/models/tiny-llama.json" -o "$tmp/one.plan.json" -q
"$memplan" run "$tmp/one.plan.json" -q -o "$tmp/one.m.json"
grid=0
while IFS='|' read -r what plan edit pattern; do
  python3 - "$tmp/one.m.json" "$tmp/grid.m.json" "$tmp/$plan" "$edit" <<'PY'
import copy, json, sys
m = json.load(open(sys.argv[1]))
plan = json.load(open(sys.argv[3]))
m["plan_digest"] = plan["digest"]
m["ranks"] = m["ranks"][:len(plan["ranks"])]
exec(sys.argv[4])
json.dump(m, open(sys.argv[2], "w"))
PY
  "$memplan" check "$tmp/$plan" "$tmp/grid.m.json" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ "$rc" -eq 2 ] && grep -q "$pattern" "$tmp/err" && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grid=$((grid + 1)) \
    || bad "check, $what: exit $rc: $(cat "$tmp/err")"
done <<'CASES'
dp 2, a replica missing|dp.plan.json|pass|pp rank 0 has data-parallel replicas {0}, but .*dp.plan.json: /model/parallel/dp 2 makes them {0, 1}
dp 2, dp_rank 7|dp.plan.json|r = copy.deepcopy(m["ranks"][0]); r["dp_rank"] = 7; m["ranks"].append(r)|replicas {0, 7}
dp 1, dp_rank 3|one.plan.json|[r.update(dp_rank=3) for r in m["ranks"]]|replicas {3}, but .* makes them {0}
dp 1, ep_rank 5|one.plan.json|m["ranks"][1]["ep_rank"] = 5|/ranks/1/ep_rank: 5, but .*/model/parallel/ep 1 puts dp_rank 0 at 0
CASES
[ "$grid" -eq 4 ] && ok
# The whole grid passes (replicas with equal numbers).
python3 - "$tmp/one.m.json" "$tmp/grid.m.json" "$tmp/dp.plan.json" <<'PY'
import copy, json, sys
m = json.load(open(sys.argv[1]))
plan = json.load(open(sys.argv[3]))
m["plan_digest"] = plan["digest"]
r0 = copy.deepcopy(m["ranks"][0])
m["ranks"] = []
for d in range(2):
    r = copy.deepcopy(r0); r["pp_rank"] = 0; r["dp_rank"] = d; r["peak"] = plan["ranks"][0]["peak"]
    r["allocated_peak"] = plan["ranks"][0]["lower_bound"]; r.pop("allocation_timeline", None); m["ranks"].append(r)
m["allocator"] = "arena"; m["measurement"] = "feasibility"
json.dump(m, open(sys.argv[2], "w"))
PY
"$memplan" check "$tmp/dp.plan.json" "$tmp/grid.m.json" >"$tmp/out" 2>"$tmp/err" && ok \
  || bad "check, the whole dp 2 grid: $(cat "$tmp/out" "$tmp/err")"

# Minor: only the process's CUPTI total fails: the reason says so (not "0 of
# 2 ranks outside the plan's bounds").
python3 - "$tmp/one.m.json" "$tmp/proc.m.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["process"] = {"device_bytes_peak": 1, "context_bytes": 0, "profiler_bytes": 0}
json.dump(m, open(sys.argv[2], "w"))
PY
"$memplan" check "$tmp/one.plan.json" "$tmp/proc.m.json" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ "$rc" -eq 1 ] && grep -q "check failed: the process's CUPTI total is off the ranks' planned memory" "$tmp/err" \
  && ! grep -q "0 of" "$tmp/err" && ok || bad "process-only failure: exit $rc: $(cat "$tmp/err")"
fi

if want signals; then
# 8. SIGTERM during a run with --dump: no staging left beside the target.
model "$root/examples/models/tiny-llama.json" "$tmp/long.json" 'm["train"]["microbatches"] = 64; m.pop("budget", None)'
"$memplan" plan "$tmp/long.json" -o "$tmp/long.plan.json" -q
mkdir -p "$tmp/dumps"
"$memplan" run "$tmp/long.plan.json" -q --dump "$tmp/dumps/d" -o "$tmp/dumps/m.json" &
job=$!
for k in $(seq 100); do ls -A "$tmp/dumps" | grep -q '^\.memplan\..*\.tmp$' && break; sleep 0.05; done
staged=$(ls -A "$tmp/dumps" | grep -c '^\.memplan\.')
kill -TERM "$job"
wait "$job"
rc=$?
[ "$staged" -ge 1 ] && [ "$rc" -eq 143 ] && [ -z "$(ls -A "$tmp/dumps")" ] && ok \
  || bad "SIGTERM during --dump: staged $staged, exit $rc, left: $(ls -A "$tmp/dumps")"

# 10. SIGTERM to `memplan profile` (as `timeout` sends it): the program is
#     ended, memplan's temporary directory removed, memplan ends by SIGTERM.
profile_tmp=$tmp/ptmp
mkdir -p "$profile_tmp"
TMPDIR=$profile_tmp timeout -s TERM 1 "$memplan" profile -o "$tmp/p.json" -- \
  sh -c "echo \$\$ > '$tmp/child.pid'; exec sleep 30" >"$tmp/out" 2>"$tmp/err"
rc=$?
sleep 0.2
child=$(cat "$tmp/child.pid" 2>/dev/null)
[ "$rc" -eq 124 ] && [ -n "$child" ] && ! kill -0 "$child" 2>/dev/null && [ -z "$(ls -A "$profile_tmp")" ] \
  && [ ! -e "$tmp/p.json" ] && ok || bad "SIGTERM to profile: exit $rc, child ${child:-?} alive: $(kill -0 "$child" 2>&1 && echo yes), left: $(ls -A "$profile_tmp")"
# 3. A program that replaces its profile file by a FIFO: refused, not a hang.
TMPDIR=$profile_tmp timed 20 "$memplan" profile -o "$tmp/p.json" -- sh -c 'mkfifo "$MEMPLAN_PROFILE_OUT"'
[ "$rc" -eq 5 ] && grep -q "replaced its profile or trace file by something other than a regular file" "$tmp/err" \
  && [ -z "$(ls -A "$profile_tmp")" ] && ok || bad "profile FIFO: exit $rc in $took s: $(cat "$tmp/err")"
# Minor: the program's own exit status survives --trace (it leaves a
# profile, no trace, and exits 3).
"$memplan" run "$tmp/long.plan.json" -q -o "$tmp/any.m.json" 2>/dev/null || true
TMPDIR=$profile_tmp timed 20 "$memplan" profile -o "$tmp/p.json" --trace "$tmp/t.json" -- \
  sh -c "cp '$tmp/any.m.json' \"\$MEMPLAN_PROFILE_OUT\"; exit 3"
[ "$rc" -eq 3 ] && ok || bad "profile --trace of a failing program: exit $rc: $(cat "$tmp/err")"
fi

echo "hostile_surfaces_$section: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
