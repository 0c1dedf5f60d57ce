#!/usr/bin/env bash
# Plans of the bundled examples stay byte-identical unless a change means to
# alter them: each plan's sha256 against tests/data/plan-digests.txt.
# After a deliberate planner change: scripts/update-plan-digests, and say
# why in the commit. Each bundled example's plan also gets its REPORT.html
# (memplan viz; the browser tests are tests/viz_test.sh): planned once here.
set -u
memplan="$1" root="${MEMPLAN_SOURCE_ROOT:?}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0 reports=0
while read -r want file; do
  [ -z "$want" ] && continue
  "$memplan" plan "$root/$file" -o "$tmp/p.json" -q >/dev/null 2>"$tmp/err" || { echo "FAIL: $file: $(cat "$tmp/err")"; fail=$((fail + 1)); continue; }
  got=$(sha256sum "$tmp/p.json" | cut -d' ' -f1)
  if [ "$got" = "$want" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $file: plan changed (sha256 $got, recorded $want)"; fi
  case "$file" in examples/*)
    # The report carries this plan: its digest and every rank's tensors table.
    digest=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["digest"])' "$tmp/p.json")
    if "$memplan" viz "$tmp/p.json" -o "$tmp/r.html" >/dev/null 2>"$tmp/err" && grep -q "$digest" "$tmp/r.html" \
        && grep -q '"tensors":\["' "$tmp/r.html" && grep -q '"memory":\[{' "$tmp/r.html"; then
      pass=$((pass + 1)); reports=$((reports + 1))
    else
      fail=$((fail + 1)); echo "FAIL: $file: memplan viz: $(cat "$tmp/err")"
    fi
    rm -f "$tmp/r.html" ;;
  esac
done < "$root/tests/data/plan-digests.txt"
echo "plan digests: $pass passed, $fail failed"
[ $pass -ge 11 ] && [ "$reports" -ge 15 ] && [ $fail -eq 0 ]
