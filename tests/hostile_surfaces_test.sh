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
# Section rules: the third round's classes (issue 41: search, export, import).
# Usage: hostile_surfaces_test.sh MEMPLAN [inputs|signals|rules] (default: all).
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
# 8. (issue 41) The signal reaches the program's children too: a shell's
#    background job ends with it (its process group).
#    (--foreground: timeout signals memplan alone, not its own process group.)
TMPDIR=$profile_tmp timeout --foreground -s TERM 1 "$memplan" profile -o "$tmp/p.json" -- \
  sh -c "sleep 30 & echo \$! > '$tmp/grandchild.pid'; wait" >"$tmp/out" 2>"$tmp/err"
rc=$?
sleep 0.3
grandchild=$(cat "$tmp/grandchild.pid" 2>/dev/null)
# Ended: gone, or a zombie nobody has reaped yet (its shell is gone too).
state=$(ps -o stat= -p "$grandchild" 2>/dev/null | tr -d ' ')
[ "$rc" -eq 124 ] && [ -n "$grandchild" ] && { [ -z "$state" ] || [ "${state#Z}" != "$state" ]; } && ok \
  || { bad "SIGTERM to profile of a shell: exit $rc, its child ${grandchild:-?} alive"; kill "$grandchild" 2>/dev/null; }
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

if want rules; then
# The third fuzzing round (issue 41), one case per class that reproduced.
# 1. search writes ZeRO-3 layouts with -o (the schema took zero 0-2).
timed 60 "$memplan" search "$root/examples/models/tiny-gpt.json" --gpus 8 --space zero=3 -q -o "$tmp/s3.json"
[ "$rc" -eq 0 ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert any(l['layout']['zero']==3 for l in d['layouts'])" "$tmp/s3.json" \
  && ok || bad "search --space zero=3 -o: exit $rc: $(cat "$tmp/err")"
# 3. export refuses an edited plan, as run does.
"$memplan" plan "$root/examples/models/tiny-llama.json" -q -o "$tmp/x.plan.json" 2>/dev/null
python3 - "$tmp/x.plan.json" "$tmp/x.edited.json" "$tmp/x.peak.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
e = json.loads(json.dumps(p))
e["tensors"][0]["effective"] = ["recompute"] if e["tensors"][0]["effective"] != ["recompute"] else ["keep"]
json.dump(e, open(sys.argv[2], "w"))
k = json.loads(json.dumps(p))
k["ranks"][0]["peak"] += 4096
json.dump(k, open(sys.argv[3], "w"))
PY
for edited in x.edited x.peak; do
  timed 60 "$memplan" export megatron "$tmp/$edited.json" -q -o "$tmp/$edited.args"
  [ "$rc" -eq 2 ] && grep -q "export re-plans the embedded model" "$tmp/err" && [ ! -e "$tmp/$edited.args" ] \
    && ok || bad "export of $edited: exit $rc: $(cat "$tmp/err")"
done
timed 60 "$memplan" export megatron "$tmp/x.plan.json" -q -o "$tmp/x.args"
[ "$rc" -eq 0 ] && ok || bad "export of the plan itself: exit $rc: $(cat "$tmp/err")"
# A model file given to export: say what to do.
timed 20 "$memplan" export megatron "$root/examples/models/tiny-llama.json" -q
[ "$rc" -eq 2 ] && grep -q "this is a model file, not a plan; run .memplan plan" "$tmp/err" && ok \
  || bad "export of a model file: exit $rc: $(cat "$tmp/err")"
# 4. export's round-trip line runs for a host-preset model.
timed 60 "$memplan" export megatron "$tmp/x.plan.json" -o "$tmp/x.args"
line=$(grep -o "memplan import megatron ARGS --gpus [0-9]* --hardware [a-z0-9]* --as-written" "$tmp/out")
hw=$(echo "$line" | sed 's/.*--hardware \([a-z0-9]*\).*/\1/')
gpus=$(echo "$line" | sed 's/.*--gpus \([0-9]*\).*/\1/')
[ "$hw" = host ] && timed 60 "$memplan" import megatron "$tmp/x.args" --gpus "$gpus" --hardware "$hw" --as-written -o "$tmp/x.rt.json" \
  && [ "$rc" -eq 0 ] && ok || bad "export's round trip ($line): exit $rc: $(cat "$tmp/err")"
# 5. No layout exists: say which rule, exit 2, not the budget.
check_none() {  # pattern args...
  local pattern=$1
  shift
  timed 60 "$memplan" search "$@" -q
  [ "$rc" -eq 2 ] && grep -q "$pattern" "$tmp/err" && ! grep -q "fits the budget" "$tmp/err" && ok \
    || bad "search $*: exit $rc: $(cat "$tmp/err")"
}
check_none "global batch 64 is not a multiple of micro_batch x dp" "$root/examples/models/tiny-gpt.json" --gpus 1048576 --global-batch 64
check_none "is not a multiple of any tp x pp x cp" "$root/examples/models/tiny-k3-fp32.json" --gpus 5 --space tp=2,4 pp=2
check_none "lighter_ends={2}" "$root/examples/models/tiny-gpt.json" --gpus 4 --space lighter_ends=2
check_none "none of 2 layouts is a valid model; 2 of them: /parallel/tp: arch.heads (4) is not divisible by tp (3)" "$root/examples/models/tiny-gpt.json" --gpus 3 --space tp=3 pp=1 cp=1
# 6. plan says what run would refuse (one rule, planner/runtime_limits.h).
model "$root/examples/models/tiny-moe.json" "$tmp/moe-tp.json" 'm["parallel"].update({"tp": 2, "sp": False})'
timed 60 "$memplan" plan "$tmp/moe-tp.json" -q -o "$tmp/moe-tp.plan.json"
[ "$rc" -eq 0 ] && grep -q "warning: memplan run does not execute this layout yet: /parallel/sp: MoE under tp > 1" "$tmp/err" \
  && ok || bad "plan of MoE at tp 2 without sp: exit $rc: $(cat "$tmp/err")"
# 8. Minor: a bare --budget below a MiB warns; --global-batch in hex is refused;
#    import hf names the config's key; a multi-step dump is replaced.
timed 60 "$memplan" plan "$root/examples/models/tiny-gpt.json" --budget 80 -q
grep -q "warning: --budget 80 is 80 bytes" "$tmp/err" && ok || bad "--budget 80: $(cat "$tmp/err")"
timed 20 "$memplan" search "$root/examples/models/tiny-gpt.json" --gpus 8 --global-batch 0x10 -q
[ "$rc" -eq 2 ] && grep -q "expected a decimal integer, got 0x10" "$tmp/err" && ok || bad "--global-batch 0x10: exit $rc: $(cat "$tmp/err")"
python3 - "$tmp/cfg.json" <<'PY'
import json, sys
json.dump({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
           "num_key_value_heads": 3, "intermediate_size": 512, "vocab_size": 1000,
           "max_position_embeddings": 256}, open(sys.argv[1], "w"))
PY
timed 20 "$memplan" import hf "$tmp/cfg.json" --gpus 1 --global-batch 1 --seq 128 -o "$tmp/cfg.model.json"
[ "$rc" -eq 2 ] && grep -q "cfg.json: /num_key_value_heads (the imported model's /arch/kv_heads)" "$tmp/err" && ok \
  || bad "import hf kv_heads: exit $rc: $(cat "$tmp/err")"
"$memplan" plan "$root/examples/models/tiny-gpt.json" -q -o "$tmp/d.plan.json" 2>/dev/null
"$memplan" run "$tmp/d.plan.json" -q --steps 2 --dump "$tmp/dumpdir" -o "$tmp/d1.json" 2>"$tmp/err" \
  && "$memplan" run "$tmp/d.plan.json" -q --steps 2 --dump "$tmp/dumpdir" -o "$tmp/d2.json" 2>"$tmp/err" && ok \
  || bad "a multi-step dump replaced: $(cat "$tmp/err")"
fi

echo "hostile_surfaces_$section: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
