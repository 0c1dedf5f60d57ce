#!/usr/bin/env bash
# memplan viz (docs/viz.md): bad input, and REPORT.html in a real browser (headless Chromium, installed by scripts/setup) for a tiny
# model (plan only; plan + MEASURED.json + TRACE.json) and for the K3-like
# plan: no console error, no request (the page's policy forbids them and the
# page counts them), every view rendered with ink in its charts, within a
# time limit. (Every bundled example's report: tests/plan_digests_test.sh.)
# The browser section skips (77) without Chromium.
# Usage: viz_test.sh MEMPLAN [reports|browser|browser_large] (default: all).
set -u
memplan="$1"
section="${2:-all}"
want() { [ "$section" = all ] || [ "$section" = "$1" ]; }
root="${MEMPLAN_SOURCE_ROOT:?}"
chromium=$(command -v chromium || command -v chromium-browser || true)
if { want browser || want browser_large; } && [ -z "$chromium" ]; then echo "viz: chromium not found (apt install chromium)"; exit 77; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

# Opens reports in one headless Chromium (tests/browse.py: a Chromium start
# costs 1.7 s and two cores' worth of CPU): for each NAME=URL, the DOM once
# the page says it is done ($tmp/NAME.dom), what the page and the browser
# logged, one CONSOLE line each ($tmp/NAME.log), and a screenshot of the
# viewport for --shot NAME ($tmp/NAME.png).
browse() {  # [--shot NAME] NAME=URL ...
  timeout 180 python3 "$root/tests/browse.py" "$chromium" "$tmp" "$@" 2>"$tmp/browse.err"
}

# Every view rendered, charts drawn, tables filled; nothing requested,
# nothing logged.
rendered() {  # name [views that must have drawn charts ...]
  local name=$1
  shift
  python3 - "$tmp/$name.dom" "$tmp/$name.log" "$@" <<'PY'
import re, sys
dom, log = open(sys.argv[1]).read(), open(sys.argv[2], errors="replace").read()
charts = sys.argv[3:]
body = re.search(r"<body([^>]*)>", dom).group(1)
attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body))
assert attrs.get("done") == "1", ("the page did not finish", attrs)
assert attrs["requests"] == "0" and attrs["blocked"] == "0", ("requests", attrs)
assert attrs["errors"] == "0", ("errors", attrs.get("error-text"))
consoles = [l for l in log.splitlines() if "CONSOLE" in l]
assert not consoles, consoles[:3]
views = {m.group(1): dict(re.findall(r'data-([a-z-]+)="([^"]*)"', m.group(2)))
         for m in re.finditer(r'<section id="([a-z]+)" class="view"([^>]*)>', dom)}
assert sorted(views) == ["memory", "ranks", "schedule", "tensors", "tradeoff"], sorted(views)
checked = 0
for name, v in views.items():
    assert v.get("rendered") == "ok", (name, v)
    checked += 1
for name in charts:
    assert int(views[name]["charts"]) > 0 and int(views[name]["ink"]) > 0, (name, views[name])
    checked += 1
assert int(views["tensors"]["rows"]) > 0 and int(views["ranks"]["rows"]) > 0
# Nothing outside the file: no script, style, image or link to a URL.
assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', dom), "a reference to a URL"
print(f"{checked} views checked")
PY
}

# A plan (with --sweep and remote offloads), its MEASURED.json and TRACE.json
# (every section but the large report reads them).
if want browser || want reports; then
python3 - "$root/examples/models/tiny-llama.json" "$tmp/remote.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["policies"] = [{"match": "*.mlp.*", "policy": "offload_remote"}, {"match": "*.attn.q", "policy": ["fp8", "offload_host"]}]
json.dump(m, open(sys.argv[2], "w"))
PY
"$memplan" plan "$tmp/remote.json" -o "$tmp/r.plan.json" -q --sweep &&
  "$memplan" run "$tmp/r.plan.json" --allocator eager -q -o "$tmp/r.m.json" --trace "$tmp/r.trace.json" &&
  "$memplan" viz "$tmp/r.plan.json" "$tmp/r.m.json" "$tmp/r.trace.json" -o "$tmp/r.html" >"$tmp/out" \
  && grep -q "measured, trace" "$tmp/out" && ok || bad "viz with measurement and trace: $(cat "$tmp/out")"
fi


if want browser; then
# 2. A tiny model, plan only, in the browser.
"$memplan" plan "$root/examples/models/tiny-llama.json" -o "$tmp/ll.plan.json" -q
"$memplan" viz "$tmp/ll.plan.json" -o "$tmp/ll.html" >/dev/null && ok || bad "viz tiny-llama"

# 5. Hostile strings (issue 23, class 1): a model name and trace events
# whose names open an HTML comment and a script, close the data element, or
# carry an entity. The page's data is JSON inside a <script> element; these
# strings must neither end it nor swallow the page's own scripts, and the
# name must come back as written.
python3 - "$tmp/remote.json" "$tmp/r.trace.json" "$tmp/h.json" "$tmp/h.trace.json" <<'PY'
import json, sys
hostile = '<!--<script x</script><!-- &amp; \\u003c>'
m = json.load(open(sys.argv[1]))
m["name"] = "tiny " + hostile
json.dump(m, open(sys.argv[3], "w"))
t = json.load(open(sys.argv[2]))
n = 0
for e in t["traceEvents"]:
    if e.get("ph") == "X" and n < 5:
        e["name"] = hostile + e["name"]
        e["cat"] = hostile
        n += 1
assert n == 5
json.dump(t, open(sys.argv[4], "w"))
PY
"$memplan" plan "$tmp/h.json" -o "$tmp/h.plan.json" -q &&
  "$memplan" run "$tmp/h.plan.json" -q -o "$tmp/h.m.json" &&
  "$memplan" viz "$tmp/h.plan.json" "$tmp/h.m.json" "$tmp/h.trace.json" --force -o "$tmp/h.html" >/dev/null 2>&1 \
  && ok || bad "viz with hostile strings"
# The three reports in one browser; the plan-only one opened at #memory
# (the anchor check below reads its DOM and screenshot).
browse --shot ll "ll=file://$tmp/ll.html#memory" "r=file://$tmp/r.html" "h=file://$tmp/h.html" \
  && ok || bad "chromium on the reports: $(tail -5 "$tmp/browse.err")"
rendered ll ranks memory schedule && ok || bad "plan-only report: $(tail -3 "$tmp/ll.log")"

# 3. The full report: plan + MEASURED.json + TRACE.json.
rendered r ranks memory schedule tradeoff && ok || bad "full report: $(tail -3 "$tmp/r.log")"
# The check's verdict per rank, the eager run's series and its step-by-step
# verdict, the trace's lanes, the PP balance table.
grep -q "check: pass" "$tmp/r.dom" && grep -q "eager dp0" "$tmp/r.dom" && grep -q "eager timeline dp0: pass" "$tmp/r.dom" \
  && grep -q "every rank within the plan" "$tmp/r.dom" \
  && grep -q 'class="heat"' "$tmp/r.dom" && ok || bad "full report: verdicts, measured series or PP balance missing"

# 3b. (issue 42) The full tiny report: a sweep's infeasible budgets as a
# shaded band with no y value, y from 0, the host chart's pinned-memory
# line; the host-only plan lists no memory outside the framework.
python3 - "$tmp/r.dom" "$tmp/r.plan.json" "$tmp/ll.dom" <<'PY' && ok || bad "the tiny report does not read right"
import json, re, sys
rdom, rplan, lldom = open(sys.argv[1]).read(), json.load(open(sys.argv[2])), open(sys.argv[3]).read()
rviews = {m.group(1): dict(re.findall(r'data-([a-z-]+)="([^"]*)"', m.group(2)))
          for m in re.finditer(r'<section id="([a-z]+)" class="view"([^>]*)>', rdom)}
bad = sum(not p["fits"] for p in rplan["sweep"])
assert int(rviews["tradeoff"]["infeasible"]) == bad and float(rviews["tradeoff"]["y-min"]) == 0, rviews["tradeoff"]
assert bad == 0 or f"{bad} of {len(rplan['sweep'])} budgets do not fit (shaded)" in rdom, bad
assert 'class="note host-limit"' in rdom and "pinned host memory per GPU" in rdom
assert 'class="note runtime-items"' not in lldom
print(f"tiny report reads right: {bad} infeasible sweep points shaded")
PY
# Opened at #memory: that view first under the header, the page at its
# top, and the screenshot not blank (headless Chromium shows nothing of a
# scrolled page, so the browser's jump to the anchor came out blank).
read -r _ _ ink < <(python3 "$root/tests/png_ink.py" "$tmp/ll.png")
[ "${ink:-0}" -gt 1000 ] && ok || bad "the report opened at #memory is blank ($ink pixels of ink)"
python3 - "$tmp/ll.dom" <<'PY' && ok || bad "#memory is not the first view, or the page scrolled"
import re, sys
dom = open(sys.argv[1]).read()
body = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', re.search(r"<body([^>]*)>", dom).group(1)))
first = re.search(r'<section id="([a-z]+)" class="view"', dom).group(1)
assert first == "memory" and body["scroll-y"] == "0" and 0 < int(body["anchor-top"]) < 600, (first, body)
PY
echo "report opened at #memory: $ink sampled pixels of ink"

rendered h ranks memory schedule && ok || bad "hostile strings blank the report: $(tail -3 "$tmp/h.log")"
python3 - "$tmp/h.dom" <<'PY' && ok || bad "the hostile model name is not shown as written"
import html, sys
dom = open(sys.argv[1]).read()
want = html.escape("tiny <!--<script x</script><!-- &amp; \\u003c>", quote=False)
assert want in dom, "name not found"
PY

fi

if want browser_large; then
# 4. The K3-like plan (16 ranks, down-sampled timelines) within the limit.
"$memplan" plan "$root/examples/models/kimi-k3-like.json" -o "$tmp/k3.plan.json" -q
"$memplan" viz "$tmp/k3.plan.json" -o "$tmp/k3.html" >/dev/null && ok || bad "viz kimi-k3-like"
start=$(date +%s)
browse "k3=file://$tmp/k3.html" && ok || bad "chromium on the K3-like report: $(tail -5 "$tmp/browse.err")"
rendered k3 ranks memory schedule && ok || bad "K3-like report: $(tail -3 "$tmp/k3.log")"
grep -q "down-sampled to 4000 points" "$tmp/k3.dom" && ok || bad "the K3-like report does not say it down-samples"
# A GPU preset's plan: the memory outside the framework under the bars and
# listed (docs/accounting.md section 9b); the host-only tiny plan has none.
grep -q "outside the framework, per GPU (the bars' grey base; fits: peak + these &lt;= budget): cuda_context 512.00 MiB" "$tmp/k3.dom" \
  && ok || bad "the runtime items are not in the K3-like report"
echo "K3-like report: $(( $(date +%s) - start )) s in the browser, $(stat -c %s "$tmp/k3.html") bytes"

# 4b. A report that reads right (issue 42), on the K3-like plan (GPU preset,
# 725 saved tensors): the header's facts; every category's colour apart
# (CIE76 delta E) and visible on the white chart; one peak per memory chart,
# the table's, with the lower bound named; the budget line net of the memory
# outside the framework; y axes from 0; the tensor table collapsed with a
# control.
python3 - "$tmp/k3.dom" "$tmp/k3.plan.json" <<'PY' && ok || bad "the K3-like report does not read right"
import html, json, re, sys
dom, plan = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))
checked = 0
def fmt(b):  # MP.fmtBytes
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b} B"
facts = dict(re.findall(r'data-fact="([^"]+)"><dt>[^<]*</dt><dd>([^<]*)</dd>', dom))
for key, want in [("step", " ms (modelled)"), ("tokens/s per GPU", "MFU"), ("global batch", "tokens"), ("layout", "ZeRO-"),
                  ("hardware", "GiB per GPU"), ("dtypes", "bf16"), ("storage", "keep")]:
    assert want in html.unescape(facts.get(key, "")), (key, facts)
    checked += 1
views = {m.group(1): dict(re.findall(r'data-([a-z-]+)="([^"]*)"', m.group(2)))
         for m in re.finditer(r'<section id="([a-z]+)" class="view"([^>]*)>', dom)}
assert int(views["ranks"]["colors"]) >= 6 and float(views["ranks"]["min-delta-e"]) >= 20, views["ranks"]
assert float(views["ranks"]["min-contrast"]) >= 1.8, views["ranks"]
for name in ("ranks", "memory"):
    assert float(views[name]["y-min"]) == 0, (name, views[name])
checked += 4
for r in plan["ranks"]:
    head = f"pp rank {r['pp_rank']}: peak {fmt(r['peak'])} (placed arena, as in the table); lower bound {fmt(r['lower_bound'])}"
    assert head in dom, head
    checked += 1
runtime = plan["ranks"][0]["static"]["runtime"]
assert runtime > 0 and f"budget less {fmt(runtime)} outside the framework" in dom, runtime
assert int(views["tensors"]["rows"]) == 25 and f"show all {len(plan['tensors'])} rows" in dom, views["tensors"]
body = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', re.search(r"<body([^>]*)>", dom).group(1)))
assert int(body["page-height"]) < 10000, body["page-height"]  # 21,700 px before the table was collapsed
checked += 1
print(f"K3-like report reads right: {checked} checks, {len(plan['ranks'])} memory headings")
PY
fi

if want reports; then
# 1. Bad input: one line, the exit code, nothing written.
python3 - "$tmp/r.m.json" "$tmp/other.m.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["plan_digest"] = "sha256:" + "0" * 64
json.dump(m, open(sys.argv[2], "w"))
PY
"$memplan" viz "$tmp/r.plan.json" "$tmp/other.m.json" -o "$tmp/mismatch.html" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ "$rc" -eq 4 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && [ ! -e "$tmp/mismatch.html" ] && ok \
  || bad "digest mismatch: exit $rc: $(cat "$tmp/err")"
"$memplan" viz "$tmp/r.plan.json" "$tmp/other.m.json" -o "$tmp/forced.html" --force >/dev/null 2>"$tmp/err"
rc=$?
# The banner's text is in the page's data (the browser tests draw banners).
[ "$rc" -eq 0 ] && grep -q "warning: .*--force" "$tmp/err" && grep -q "drawn anyway: --force" "$tmp/forced.html" \
  && ok || bad "--force: exit $rc, no warning: $(cat "$tmp/err")"
echo '{"schema": "memplan.measured/1", "ranks": [' >"$tmp/broken.json"
cp "$tmp/r.html" "$tmp/keep.html"
"$memplan" viz "$tmp/r.plan.json" "$tmp/broken.json" -o "$tmp/keep.html" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ "$rc" -eq 2 ] && grep -q "broken.json" "$tmp/err" && cmp -s "$tmp/r.html" "$tmp/keep.html" && ok \
  || bad "malformed MEASURED.json: exit $rc: $(cat "$tmp/err"); or the old report was touched"
python3 -c "import json, sys; t = json.load(open(sys.argv[1])); t['traceEvents'] = {}; json.dump(t, open(sys.argv[2], 'w'))" \
  "$tmp/r.trace.json" "$tmp/bad-trace.json"
"$memplan" viz "$tmp/r.plan.json" "$tmp/r.m.json" "$tmp/bad-trace.json" -o "$tmp/never.html" >/dev/null 2>"$tmp/err"
rc=$?
[ "$rc" -eq 2 ] && grep -q "bad-trace.json: /traceEvents: expected an array" "$tmp/err" && [ ! -e "$tmp/never.html" ] && ok \
  || bad "malformed TRACE.json: exit $rc: $(cat "$tmp/err")"
# Trace events with fields of the wrong type (issue 23, class 2): exit 2 at
# the field, not an internal error; a bare-array trace (the Trace Event
# format's other form) is read.
checked=0
for field in 'pid="0"' 'tid="a"' 'tid=1.5' 'name=7' 'cat=[1]' 'args=3'; do
  python3 - "$tmp/r.trace.json" "$tmp/typed.json" "$field" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
key, value = sys.argv[3].split("=", 1)
events = t["traceEvents"]
ph = "M" if key == "args" else "X"
i = next(i for i, e in enumerate(events) if e.get("ph") == ph and (ph == "X" or e.get("name") == "thread_name"))
events[i][key] = json.loads(value)
print(i, file=open(sys.argv[2] + ".index", "w"))
json.dump(t, open(sys.argv[2], "w"))
PY
  i=$(cat "$tmp/typed.json.index")
  "$memplan" viz "$tmp/r.plan.json" "$tmp/r.m.json" "$tmp/typed.json" -o "$tmp/never.html" >/dev/null 2>"$tmp/err"
  rc=$?
  [ "$rc" -eq 2 ] && grep -q "typed.json: /traceEvents/$i/${field%%=*}: expected" "$tmp/err" && [ "$(wc -l <"$tmp/err")" -eq 1 ] \
    && [ ! -e "$tmp/never.html" ] && checked=$((checked + 1)) || bad "trace field $field: exit $rc: $(cat "$tmp/err")"
done
[ "$checked" -eq 6 ] && ok
python3 -c "import json, sys; json.dump(json.load(open(sys.argv[1]))['traceEvents'], open(sys.argv[2], 'w'))" \
  "$tmp/r.trace.json" "$tmp/bare.json"
"$memplan" viz "$tmp/r.plan.json" "$tmp/r.m.json" "$tmp/bare.json" -o "$tmp/bare.html" >"$tmp/out" 2>"$tmp/err" \
  && grep -q "measured, trace" "$tmp/out" && ok || bad "a bare-array trace: $(cat "$tmp/err")"
python3 -c "import json, sys; p = json.load(open(sys.argv[1])); p['ranks'] = 'x'; json.dump(p, open(sys.argv[2], 'w'))" \
  "$tmp/r.plan.json" "$tmp/bad-plan.json"
"$memplan" viz "$tmp/bad-plan.json" -o "$tmp/never.html" >/dev/null 2>"$tmp/err"
rc=$?
[ "$rc" -eq 2 ] && grep -q "/ranks" "$tmp/err" && [ ! -e "$tmp/never.html" ] && ok || bad "malformed plan: exit $rc: $(cat "$tmp/err")"
# A plan of more microbatches than can be drawn one by one (a periodic
# window, docs/planner.md): the report draws the window and says so.
python3 - "$root/examples/models/tiny-gpt.json" "$tmp/many.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["train"]["microbatches"] = 20000
json.dump(m, open(sys.argv[2], "w"))
PY
"$memplan" plan "$tmp/many.json" -q -o "$tmp/many.plan.json" 2>/dev/null \
  && "$memplan" viz "$tmp/many.plan.json" -o "$tmp/many.html" >/dev/null 2>"$tmp/err" \
  && grep -q "periodic window of [0-9]* microbatches standing for the plan's 20000" "$tmp/err" && [ -s "$tmp/many.html" ] \
  && ok || bad "a plan with a periodic window of 20000 microbatches: $(cat "$tmp/err")"

fi

echo "viz_$section: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
