#!/usr/bin/env bash
# One pass of everything that needs the GPU, for a session on a CUDA machine (about 8-10 minutes on
# an H200): the whole test suite, compute-sanitizer over the kernel tests, the static grid against
# FlashInfer (with graph mode), the policy's calibration and held-out evaluation, the fixed-cost
# probe and a configuration sweep. Results go to results/<gpu>/ (override with OUT_DIR); logs
# beside them. Run from the repository root, steps in the order given:
#   PYTHONPATH=src scripts/gpu-check.sh [tests|sanitize|grid|calibrate|evaluate|probe|dispatch|sweep ...]
# (default: tests sanitize grid calibrate evaluate). Each step has its own time limit, so one slow
# step cannot take the others' results with it.
set -uo pipefail
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())")
out=${OUT_DIR:-results/$gpu}
mkdir -p "$out"
steps=${*:-tests sanitize grid calibrate evaluate}
backends=pkv-grouped,pkv-split,pkv-balanced,pkv-auto,fi-cuda-core,fi-tensor-core,fi-xqa
kernel_tests='g4-d128-p16-mixed and fp16 or merge_of_many'
status=0
for step in $steps; do
  echo "== $step"
  case $step in
    tests)     timeout 300 python3 -m pytest -q tests -p no:cacheprovider > "$out/pytest-h200.txt" 2>&1
               sed -i 's#[^ ]*/site-packages/#<site-packages>/#g' "$out/pytest-h200.txt"
               tail -1 "$out/pytest-h200.txt" ;;
    sanitize)  mkdir -p "$out/sanitizer"
               for tool in memcheck racecheck; do
                 timeout 120 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -x \
                   -p no:cacheprovider tests/test_decode.py -k "$kernel_tests" \
                   > "$out/sanitizer/sanitizer-$tool.txt" 2>&1
                 grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$out/sanitizer/sanitizer-$tool.txt" | tail -2
               done ;;
    grid)      timeout 200 python3 -m persistentkv.cli bench --grid --backends $backends --out "$out" \
                 > "$out/grid-log.txt" 2>&1; tail -1 "$out/grid-log.txt" ;;
    calibrate) timeout 300 python3 -m persistentkv.cli calibrate --samples 6 --out "$out/policy.json" \
                 > "$out/calibrate-log.txt" 2>&1; tail -1 "$out/calibrate-log.txt" ;;
    evaluate)  policy=()
               [ -f "$out/policy.json" ] && policy=(--policy "$out/policy.json")
               timeout 300 python3 -m persistentkv.cli evaluate "${policy[@]}" --samples 8 --eager-reps 7 --out "$out" \
                 > "$out/evaluate-log.txt" 2>&1; tail -8 "$out/evaluate-log.txt" ;;
    probe)     timeout 120 python3 scripts/probe_fixed_cost.py > "$out/probe-fixed-cost.json" 2>&1
               tail -30 "$out/probe-fixed-cost.json" ;;
    dispatch)  timeout 60 python3 scripts/probe_dispatch.py > "$out/probe-dispatch.json" 2>&1
               cat "$out/probe-dispatch.json" ;;
    sweep)     timeout 300 python3 -m persistentkv.cli sweep --out "$out/sweep.json" > "$out/sweep-log.txt" 2>&1
               tail -12 "$out/sweep-log.txt" ;;
    *)         echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
