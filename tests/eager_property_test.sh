#!/usr/bin/env bash
# Property test (docs/runtime.md, "Eager execution"): random valid
# configurations of the tiny models — pp, vp, dp, ep, tp (with or without
# sequence parallelism), cp, ZeRO, pipeline ZeRO-2,
# gradient offload, AdamW or Muon with either gather, storage mixes and
# budgets — planned, run under mpirun in eager mode (one process per rank)
# and checked step by step against the plan. Seeded (MEMPLAN_PROPERTY_SEED,
# default fixed), bounded in time (MEMPLAN_PROPERTY_SECONDS, default 20) and
# in count (MEMPLAN_PROPERTY_CASES, default 6); a failure prints its seed,
# its configuration and how to rerun it. Skips (77) without mpirun or MPI.
# Usage: eager_property_test.sh MEMPLAN
set -u
memplan="$1"
root="${MEMPLAN_SOURCE_ROOT:?}"
command -v mpirun >/dev/null || { echo "eager property: mpirun not found"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! ldd "$memplan" 2>/dev/null | grep -q "libmpi"; then
  echo "eager property: memplan was built without MPI"; exit 77
fi

python3 - "$memplan" "$root" "$tmp" <<'PY'
import json, os, random, subprocess, sys, time

memplan, root, tmp = sys.argv[1:4]
seed0 = int(os.environ.get("MEMPLAN_PROPERTY_SEED", "20261208"))
budget_s = float(os.environ.get("MEMPLAN_PROPERTY_SECONDS", "20"))
cases = int(os.environ.get("MEMPLAN_PROPERTY_CASES", "6"))
only = os.environ.get("MEMPLAN_PROPERTY_ONLY")  # rerun one case: its seed

MODELS = ["tiny-gpt", "tiny-llama", "tiny-deepseek", "tiny-moe", "tiny-k3-fp32"]
MIXES = ["keep", "recompute", "fp8", "offload_host", ["fp8", "offload_host"], "offload_remote",
         ["fp8", "offload_remote"]]
MODULES = ["*.attn.*", "*.mlp.*", "*.moe.*", "*_norm.*", "*.kda.*", "*"]


def config(seed):
    rng = random.Random(seed)
    name = rng.choice(MODELS)
    m = json.load(open(f"{root}/examples/models/{name}.json"))
    par, train = m["parallel"], m["train"]
    moe = "moe" in m["arch"]
    par["pp"] = rng.choice([1, 2, 2])
    par["vp"] = rng.choice([1, 2]) if par["pp"] > 1 else 1
    par["dp"] = rng.choice([1, 2, 2])
    par["ep"] = 2 if moe and par["dp"] == 2 and rng.random() < 0.6 else 1
    par["zero"] = rng.choice([0, 1, 2]) if par["dp"] > 1 else 0
    par["pipeline_zero2"] = par["dp"] > 1 and par["pp"] > 1 and rng.random() < 0.4
    if par["pipeline_zero2"]:
        par["zero"] = max(par["zero"], 1)
    par["grad_offload"] = "host" if par["pipeline_zero2"] and rng.random() < 0.5 else "none"
    train["optimizer"] = rng.choice(["adam", "muon"])
    if train["optimizer"] == "muon":
        par["muon_gather"] = rng.choice(["allgather", "p2p"])
    else:
        par.pop("muon_gather", None)
    if par["zero"] == 2 and not par["pipeline_zero2"]:
        par["zero"] = 1  # a ZeRO-2 reduce bucket wants 40 M parameters; tiny layers only test its refusal
    # Tensor and context parallelism (at most 8 processes: dp drops to 1).
    par["tp"] = 2 if rng.random() < 0.3 else 1
    par["sp"] = par["tp"] > 1 and (moe or rng.random() < 0.5)
    flash = m["arch"]["attention"] == "flash" and not m["arch"].get("dropout")
    par["cp"] = 2 if flash and rng.random() < 0.25 else 1
    if par["pp"] * par["dp"] * par["tp"] * par["cp"] > 8:
        par.update(dp=1, ep=1, zero=0, pipeline_zero2=False, grad_offload="none")
    if moe and par["tp"] * par["cp"] > 1 and par["ep"] == 1 and rng.random() < 0.5:
        par["ep"] = 2
    train["microbatches"] = rng.choice([2, 4])
    m["policies"] = [{"match": rng.choice(MODULES), "policy": rng.choice(MIXES)} for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.3:
        m.pop("policies")
        m["budget_fraction"] = round(rng.uniform(0.5, 0.95), 2)  # applied below, between the plan's bounds
    return name, m


def run(cmd, timeout=60):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


passed = failed = refused = 0
start = time.time()
seeds = [int(only)] if only else [seed0 * 1000 + k for k in range(1000)]
for seed in seeds:
    # The time bound applies after three cases: a loaded machine still tests some.
    if passed + failed >= cases or (time.time() - start > budget_s and passed + failed >= 3):
        break
    name, m = config(seed)
    frac = m.pop("budget_fraction", None)
    model = f"{tmp}/model.json"
    plan = f"{tmp}/plan.json"
    json.dump(m, open(model, "w"))
    r = run([memplan, "plan", model, "-o", plan, "-q"])
    if r.returncode == 0 and frac is not None:
        p = json.load(open(plan))
        lo = max(p["any_plan_lower_bound"])
        hi = max(x["peak"] for x in p["ranks"])
        m["budget"] = f"{int(lo + (hi - lo) * frac)}B"
        json.dump(m, open(model, "w"))
        r = run([memplan, "plan", model, "-o", plan, "-q"])
    if r.returncode == 2:  # a layout the planner refuses (divisibility, an infeasible budget)
        refused += 1
        continue
    par = m["parallel"]
    what = (f"seed {seed}: {name} pp {par['pp']} vp {par['vp']} dp {par['dp']} ep {par['ep']} tp {par['tp']}"
            f"{' sp' if par['sp'] else ''} cp {par['cp']} zero {par['zero']}"
            f"{' pipeline-zero2' if par.get('pipeline_zero2') else ''} grads {par.get('grad_offload')}"
            f" {m['train']['optimizer']} {par.get('muon_gather', '')} mb {m['train']['microbatches']}"
            f" policies {json.dumps(m.get('policies', []))}{' budget ' + m['budget'] if 'budget' in m else ''}")
    if r.returncode != 0:
        failed += 1
        print(f"FAIL {what}\n  plan exit {r.returncode}: {r.stderr.strip()[:400]}")
        continue
    n = par["pp"] * par["dp"] * par["tp"] * par["cp"]
    measured = f"{tmp}/measured.json"
    try:
        r = run(["mpirun", "--oversubscribe", "-np", str(n), memplan, "run", plan, "--allocator", "eager", "-q",
                 "-o", measured], timeout=90)
    except subprocess.TimeoutExpired:
        failed += 1
        print(f"FAIL {what}\n  mpirun -np {n} timed out")
        continue
    if r.returncode == 2 and ("cannot" in r.stderr or "not executed" in r.stderr) and "execute" in r.stderr:
        refused += 1  # what the runtime refuses, with its reason (docs/runtime.md, Limits)
        continue
    if r.returncode != 0:
        failed += 1
        err = [l for l in r.stderr.splitlines() if "memplan" in l][:2]
        print(f"FAIL {what}\n  mpirun -np {n} exit {r.returncode}: {' | '.join(err)[:500]}")
        continue
    r = run([memplan, "check", plan, measured])
    if r.returncode != 0:
        failed += 1
        lines = [l for l in r.stdout.splitlines() if "FAIL" in l or "over-predicted:" in l][:3]
        print(f"FAIL {what}\n  check exit {r.returncode}: " + " | ".join(lines)[:800] + r.stderr.strip()[:300])
        continue
    passed += 1
    print(f"ok   {what}")

print(f"eager property: {passed} configurations planned, run under mpirun and checked step by step, "
      f"{failed} failed, {refused} refused as invalid ({time.time() - start:.1f} s, seed {seed0})")
if failed:
    print("rerun one: MEMPLAN_PROPERTY_ONLY=<seed> tests/eager_property_test.sh build/tools/memplan")
print(f"eager property: {passed} passed, {failed} failed")  # scripts/count-tests reads this line
sys.exit(1 if failed or passed < 3 else 0)
PY
