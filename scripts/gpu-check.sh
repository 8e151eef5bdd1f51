#!/usr/bin/env bash
# One pass of everything that needs the GPU, for a session on a CUDA machine (about 8-10 minutes on
# an H200): the whole test suite, compute-sanitizer over the kernel tests, the static grid against
# FlashInfer (with graph mode), the policy's calibration and held-out evaluation, the fixed-cost
# probe and a configuration sweep. Results go to results/<gpu>/ (override with OUT_DIR); logs
# beside them. Run from the repository root, steps in the order given:
#   PYTHONPATH=src scripts/gpu-check.sh [tests|sanitize|grid|calibrate|evaluate|probe|dispatch|sweep|
#                                        presets|pages|e2e ...]
# (default: tests sanitize grid calibrate evaluate). Each step has its own time limit, so one slow
# step cannot take the others' results with it. presets: a policy per preset of $PRESETS (default
# the shapes without a shipped one), fitted and judged on the held-out seeds, about 150 s each;
# pages: the page-size spot check (1 and 64); e2e: transformers end to end (llama3-8b and
# qwen2.5-7b shapes, 32 and 128 requests of about 4K-token prompts, with the profile).
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
    presets)   mkdir -p "$out/presets"
               for p in ${PRESETS:-llama3-70b qwen3-14b gpt-oss gpt-oss-tp8 gemma2-9b}; do
                 timeout 200 python3 -m persistentkv.cli calibrate --preset "$p" --samples 4 \
                   --out "$out/presets/policy-$p.json" > "$out/presets/calibrate-$p-log.txt" 2>&1
                 tail -1 "$out/presets/calibrate-$p-log.txt"
                 timeout 200 python3 -m persistentkv.cli evaluate --preset "$p" \
                   --policy "$out/presets/policy-$p.json" --samples 8 --out "$out/presets" \
                   --tag "evaluate-$p" > "$out/presets/evaluate-$p-log.txt" 2>&1
                 grep "x FI best" "$out/presets/evaluate-$p-log.txt"
               done ;;
    pages)     for ps in 1 64; do
                 timeout 200 python3 -m persistentkv.cli bench --grid --page-size $ps \
                   --cells "B1 L8K,B1 L32K,B8 L8K,B32 L1K,B16 mix" --backends pkv-auto,fi-tensor-core,fi-xqa \
                   --out "$out" --tag "page$ps" > "$out/page$ps-log.txt" 2>&1; tail -1 "$out/page$ps-log.txt"
               done ;;
    e2e)       mkdir -p "$out/e2e"
               for model in llama3-8b qwen2.5-7b; do
                 timeout 600 python3 -m persistentkv.cli e2e --model $model --requests 32,128 \
                   --mean-prompt 4096 --new-tokens 32 --profile --out "$out/e2e" --tag "e2e-$model" \
                   > "$out/e2e/e2e-$model-log.txt" 2>&1; tail -3 "$out/e2e/e2e-$model-log.txt"
               done ;;
    *)         echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
