#!/usr/bin/env bash
# Runs the suite (ctest -LE slow, as scripts/test.sh does) N times over the
# current build/ and prints, per test, how often it passed and its slowest
# time; exits non-zero if any run failed. With --load, a CPU hog
# (stress-ng --cpu 1, installed when missing) takes one core meanwhile.
#
#   bash scripts/soak_tests.sh 10
#   bash scripts/soak_tests.sh 3 --load
#
# Randomised tests print their seed (MNIST_DDP_TEST_SEED=...); the failed
# runs' output stays in build/soak/ to replay them.
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${1:-}"
load="${2:-}"
if ! [[ "$runs" =~ ^[1-9][0-9]*$ ]] || { [ -n "$load" ] && [ "$load" != --load ]; }; then
  echo "usage: bash scripts/soak_tests.sh N [--load]" >&2
  exit 2
fi
[ -f build/CTestTestfile.cmake ] || { echo "soak_tests.sh: no build/: run bash scripts/build.sh first" >&2; exit 2; }

hog=""
stop_hog() { if [ -n "$hog" ] && [ "$hog" -gt 1 ]; then kill "$hog" 2>/dev/null || true; wait "$hog" 2>/dev/null || true; fi; }
trap stop_hog EXIT
if [ "$load" = --load ]; then
  command -v stress-ng >/dev/null || bash scripts/install_deps.sh stress-ng
  stress-ng --cpu 1 --quiet &
  hog=$!
  echo "soak_tests.sh: stress-ng --cpu 1 running as pid $hog"
fi

out=build/soak
rm -rf "$out" && mkdir -p "$out"
failed_runs=0
for ((i = 1; i <= runs; i++)); do
  start=$(date +%s)
  if (cd build && ctest --timeout 900 --label-exclude slow -j "$(nproc)" --output-junit "soak/run$i.xml" >"soak/run$i.txt" 2>&1); then
    verdict=passed
    rm -f "$out/run$i.txt"
  else
    verdict="FAILED (output: $out/run$i.txt)"
    failed_runs=$((failed_runs + 1))
  fi
  echo "soak_tests.sh: run $i of $runs $verdict in $(( $(date +%s) - start )) s"
done

python3 - "$out" "$runs" <<'EOF'
import glob, sys, xml.etree.ElementTree as ET
out, runs = sys.argv[1], int(sys.argv[2])
tests = {}
for path in sorted(glob.glob(out + "/run*.xml")):
    for case in ET.parse(path).getroot().iter("testcase"):
        t = tests.setdefault(case.get("name"), {"passed": 0, "skipped": 0, "runs": 0, "slowest": 0.0})
        t["runs"] += 1
        skipped = case.get("status") == "notrun" or case.find("skipped") is not None
        t["skipped"] += skipped
        t["passed"] += not skipped and case.get("status") != "fail" and case.find("failure") is None
        t["slowest"] = max(t["slowest"], float(case.get("time", 0)))
width = max(len(n) for n in tests) if tests else 4
print(f"{'test':<{width}}  passed  skipped  slowest s")
for name, t in sorted(tests.items(), key=lambda kv: (kv[1]["passed"] + kv[1]["skipped"] == kv[1]["runs"], -kv[1]["slowest"])):
    print(f"{name:<{width}}  {t['passed']:>2}/{t['runs']:<3}  {t['skipped']:>7}  {t['slowest']:9.1f}")
EOF
echo "soak_tests.sh: $((runs - failed_runs)) of $runs runs passed"
[ "$failed_runs" -eq 0 ]
