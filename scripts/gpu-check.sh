#!/usr/bin/env bash
# One pass of everything that needs the GPU, for a session on a CUDA machine (about 8-10 minutes on
# an H200): the whole test suite, compute-sanitizer over a small set of kernel tests, the static
# grid and the trace replay against FlashInfer, and the configuration sweep. Results go to
# results/<gpu>/ (override with OUT_DIR); logs beside them. Run from the repository root:
#   PYTHONPATH=src scripts/gpu-check.sh [tests|sanitize|grid|traces|sweep ...]   (default: all)
set -uo pipefail
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())")
out=${OUT_DIR:-results/$gpu}
mkdir -p "$out"
steps=${*:-tests sanitize grid traces sweep}
backends=pkv-grouped,pkv-split,pkv-workqueue,pkv-graph,fi-cuda-core,fi-tensor-core,fi-xqa
status=0
for step in $steps; do
  echo "== $step"
  case $step in
    tests)    timeout 300 python3 -m pytest -q tests -p no:cacheprovider > "$out/pytest.txt" 2>&1
              tail -1 "$out/pytest.txt" ;;
    sanitize) for tool in memcheck racecheck; do
                timeout 240 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -x \
                  -p no:cacheprovider tests/test_decode.py -k "g4-d128-p16-mixed and fp16" \
                  > "$out/sanitizer-$tool.txt" 2>&1
                grep -E "ERROR SUMMARY|passed|failed" "$out/sanitizer-$tool.txt" | tail -2
              done ;;
    grid)     timeout 300 python3 -m persistentkv.cli bench --grid --backends $backends --out "$out" \
                > "$out/grid-log.txt" 2>&1; tail -2 "$out/grid-log.txt" ;;
    traces)   timeout 300 python3 -m persistentkv.cli bench --samples 8 --backends $backends --out "$out" \
                > "$out/traces-log.txt" 2>&1; tail -2 "$out/traces-log.txt" ;;
    sweep)    timeout 200 python3 -m persistentkv.cli sweep --out "$out/sweep.json" > "$out/sweep-log.txt" 2>&1
              tail -12 "$out/sweep-log.txt" ;;
    *)        echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
