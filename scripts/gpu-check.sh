#!/usr/bin/env bash
# One pass of everything that needs the GPU, for a run on a CUDA machine (about 8-10 minutes on
# an H200): the whole test suite, compute-sanitizer over the kernel tests, the static grid against
# FlashInfer (with graph mode), the policy's calibration and held-out evaluation, the fixed-cost
# probe and a configuration sweep. Results go to results/<gpu>/ (override with OUT_DIR); logs
# beside them. Run from the repository root, steps in the order given:
#   PYTHONPATH=src scripts/gpu-check.sh [tests|sanitize|grid|shapes|calibrate|evaluate|probe|
#                                        dispatch|sweep|presets|judge|pages|pdl|d256|d512|
#                                        qtiles|smallcells|longsplit|fp8vt|firstgraph|qsplits|
#                                        tp8tiles|stepparts|benchorder|graphdump|graphshare|
#                                        heldgraphs|qgrids|longtiles|tp8long|gemma2window|
#                                        q16floor|tp8small|mblocks|mixwaves|d256chunks|tp8b128|
#                                        wholerows|abtree|padrows|widepad|d256regs|d512q|
#                                        capregs|policycost|mblockcross|smallstep|smallsweep|
#                                        d512cross|largerows|valueblocks|valuerows|firstpages|
#                                        stalls|pagefetch|gluonfp8|e2e ...]
# (default: tests sanitize grid calibrate evaluate; RUNS=1 runs the steps that repeat only once).
# Each step has its own time limit, so one slow step cannot take the others' results with it.
# tests: the suite in seven parallel pytest processes (a file each or a few; about 5 minutes on
# an H200, most of it Triton's compiles). shapes: the grid at each preset of $PRESETS against
# FlashInfer's three decode entries (default all nine, the one- and two-KV-head ones first;
# results/<gpu>/shapes/ is the matrix's format; $SHAPE_BACKENDS replaces the backends). presets: a
# policy per preset of $PRESETS (default the shapes without a shipped one), fitted and judged on
# the held-out seeds, about 150 s each; judge: the held-out evaluation alone at each of $PRESETS
# with the policy pkv-auto takes there (about 75 s each); pages: the page-size spot check (1 and
# 64); pdl: the layer chain with PDL off and on (three steps), and the attention steps alone with
# and without it; d256: gemma2-9b's tiles and splits on the mixed batches where FlashInfer's
# CUDA-core path is ahead (v19: 0.96-0.99x on B8 traces); d512: head dim 512's splits of at
# least 32 tokens (v33) against 128 (before), and 32-token tiles at 8 warps (v21's small-step
# winner); qtiles:
# launch shapes for rows of 4, 8 and 16 queries (8 warps, one program an SM; 32-token tiles; 2
# stages; splits down to 32 tokens); smallcells: three programs an SM on one KV head's small steps
# (llama3-70b-tp8, gpt-oss-tp8); longsplit: v17's balanced chunks for long splits against the rule
# before (:balfrom0), twice, at $PRESETS (default the fitted presets with few KV heads); fp8vt: an
# fp8 cache in HND against HND_VT (V's blocks transposed), both scale granularities, alternated
# twice, with the fp16 step of the same cells; firstgraph: the variant-cost probe with two graphs
# of a torch copy captured first, each timed (v21: two graphs of another cell of ours captured
# first take away the slowness of a process's first graphs); stepparts: the small steps FlashInfer's
# XQA wins, timed as plan + runs, runs alone, plan alone and one empty launch (v21); tp8tiles:
# gpt-oss-tp8's 64-token tiles at 4 and 5 stages, and 128-token tiles at 2 (v21: its large steps
# at 0.94-0.95x FlashInfer's tensor-core wrapper); qsplits: rows of 4, 8 and 16 queries with
# splits of at least 256 or 512 tokens, or one task an SM (v21: the small steps' misses);
# benchorder: llama3-70b-tp8's small cells with our graphs alone and replayed after XQA's (v22: the
# probe's step 1-7% under the matrix's); graphdump: the variant-cost probe's graphs as DOT files
# (v22: our first two graphs of a process run slow); graphshare: the same probe with every graph
# of a cell through one DecodeWrapper (v25: the slow first graphs have the fast one's nodes);
# heldgraphs: the probe with each graph's wrapper and outputs held through the replays, its
# outputs checked after them (v26: the slow first graphs replayed over freed buffers, by the
# code); qgrids: q_len 4 and 8 over the whole grid against FlashInfer's prefill and XQA paths;
# longtiles: head dim 64's presets with 128-token tiles for tasks of at least 1K, 2K or 4K
# tokens against the default tile (v27: kept at gpt-oss, not at gpt-oss-tp8); tp8long: why
# gpt-oss-tp8's small cells ran 2-6% slower with the long tiles compiled in (v27), the long
# tiles under a register cap of 200 and at two stages beside the default, twice;
# gemma2window: gemma2-9b's windowed large steps, 64-token tiles at two stages and the fixed
# schedules beside the rule (v22: 0.90-0.98x); q16floor: gpt-oss at 16 queries a row (128 tile
# rows) with smaller split floors than the rule's 512 tokens there, and with 8 warps (no spill
# there), twice (v28: B1 at 0.55x FlashInfer's prefill, 16 tasks on B1 L1K); tp8small:
# gpt-oss-tp8's small cells under 1.00x with larger splits, whole rows and chunks, twice (v27: B8
# L4K 0.94x, 256 tasks of 128 tokens); tp8b128: B128 L1K at one KV head (128 rows, 4 under the
# SMs, so the rule splits them) in whole rows, at four stages and in chunks beside the default,
# at llama3-70b-tp8 and gpt-oss-tp8, twice (v45, H100: whole rows 6% faster at 8/1/128, 2-3%
# slower at 8/1/64); wholerows: whole rows at four stages and three, and the rule's whole rows
# from 95% of the SMs (:wholefill0.95), against the default where rows x KV heads are 128, at
# seven presets, rows of 1K and 2K tokens (v46); mblocks: 16 queries a row at llama3-70b and
# qwen2.5-7b, the default's M-blocks of 64 rows against blocks of 32 and two stages, twice
# (v31: 0.64-0.87x FlashInfer's prefill on B1 there); padrows: 32-row tiles (8 queries at group
# 4, 4 at group 8) padded to 64 rows (the default), which Triton compiles to the warp-group MMA,
# against mma.sync
# (:padrows16, no padding), twice; widepad: gemma2-9b at 16 queries a row (32-row tiles at head
# dim 256) with v33's rule (no padding past head dim 128) against tiles padded to 64, twice;
# d256regs: gemma2-9b's grid with the default's cap of 224 registers against none (the
# compiler's own choice, 168, spills 24 B at group 2, head dim 256), twice;
# d512q: head dim 512 at 4, 8 and 16 queries a row in the default's M-blocks of 16 rows against
# blocks of 32, twice; capregs: the one-query grids of llama3-8b, llama3-70b-tp8 and gpt-oss-tp8
# with a cap of 224 registers against the compiler's 158-168, twice; policycost: the plan, and
# the plan + runs, of small steps planned by a fitted policy on the device beside the same steps
# by the rule (v35: a fit whose bins were all the rule's ran 0.1-0.2 us a layer slower);
# mblockcross: M-blocks of 16 and of 32 rows beside the default over seven cells from B1 L1K to
# B32 L8K, at llama3-8b (8 and 16 queries), gemma2-9b (16) and head dim 512 (4, 8 and 16),
# twice (about 10-15 minutes; RUNS=1 halves it): where the better block turns over, by bytes;
# smallstep: v36's half-size M-blocks on small steps (pkv-auto) against the whole tile
# (:smallstep0), over the 8-query grid at 32/8/128 with FlashInfer's paths, and six cells at
# gemma2-9b (16 queries), gpt-oss (8), qwen2.5-7b (8) and llama3-70b (4), once; smallsweep:
# that rule's threshold off, at its default and doubled, over the cells of 34-268 MB near it
# (llama3-8b at 8 queries, gemma2-9b at 16, qwen2.5-7b at 8);
# d512cross: head dim 512 at 4, 8 and 16 queries, its blocks of 16 against blocks of 32 over
# 13 cells of 4 MB to 1 GB of K/V (mblockcross's and the sizes between), once (about 5 minutes);
# largerows: v37's blocks of 32 on head dim 512's large steps against blocks of 16 over the
# same cells (FlashInfer's prefill path beside them at 8 queries), once;
# valueblocks: head dim 512's large 8- and 16-query steps in 64-row programs two to a task's
# output columns (v38's default) against v37's blocks of 32, with FlashInfer's prefill path, once;
# mixwaves: the mixed cells of gemma2-9b and llama3-8b with finer work items (waves 3 and 4:
# more, shorter tasks claimed longest first) and balanced chunks beside the default, once (v42,
# H100: finer items lost 1-18%, chunks tied or won at gemma2-9b);
# d256chunks: gemma2-9b's grid with v42's chunks from 2560-token splits (the default) against
# the rule before (chunks from 16K), twice; abtree: this tree against another's src folder
# ($BASE_SRC) over $CELLS with $BENCH_ARGS, alternated twice (v47: the per-token fp8 fix);
# valuerows: v49's value blocks on 16-row tiles (2 and 4 programs a task's output columns) on
# the small, latency-bound cells at one and four queries (llama3-8b) and one (gpt-oss-tp8,
# qwen2.5-7b), against the default and FlashInfer's XQA, twice (about 4 minutes a run; rejected
# in v51: 1.0-2.7x slower);
# firstpages: v50's KernelConfig.first_pages (each task's first pages beside its record) on the
# same cells at one query (llama3-8b, gpt-oss-tp8, qwen2.5-7b, llama3-70b-tp8) and four
# (llama3-8b), against the default and XQA, twice;
# stalls: what the token loop's warps wait on (v23-v24 measured 5.7 cycles a warp between
# issues and 0.4 eligible warps a scheduler in the fp8 step, not why): Nsight Compute on one B32
# L8K launch at 32/8/128, fp16 HND and fp8 HND_VT (per tensor), each stall reason's cycles per
# issued instruction (raw page), and the fp8 kernel's SASS lines with their stall samples
# (source page), and the same page for B1 L1K at four queries a row (where the merge of 16
# rows costs about 1 us more than the one-query step's, v26-v27, not known where); about 3
# minutes;
# pagefetch: v53's KernelConfig.page_prefetch_tiles (each tile asks the L2 for the page indices
# of the tile 2 or 4 ahead), v55's page_prefetch_task (each task for all its own at its start)
# and keep_page_table (the index loads marked evict_last) against the default on llama3-8b's
# large and small cells, fp16 HND and fp8 HND_VT per tensor and per token
# (PAGEFETCH_CACHES="fp16 tensor token", a subset to run fewer), the columns' order reversed
# in the second run; then Nsight Compute's stall reasons
# of the fp8 B32 L8K launch with 2 tiles ahead, the task prefetch and the kept table (the
# `stalls` raw page, one file each); about 14 minutes for two runs;
# gluonfp8: v55's Gluon probe of the e4m3 token loop (scripts/probe_gluon_fp8.py): its check
# against the float64 reference (tests/test_gluon_probe.py), then its variants against our fp8
# grouped and auto steps and our fp16 step at B32 L8K, B8 L32K and B128 L8K, twice; about 4
# minutes;
# e2e: transformers end to end, each run "model requests mean-prompt [flags]" of $E2E_RUNS (default gpt-oss-20b at 32 requests of about 1K-token
# prompts and llama3-8b at 128 of about 256, both with the profile; the 4K-prompt runs are
# measured, BENCHMARKS.md v18: one at 128 requests takes about 310 s).
set -uo pipefail
# the model in the device's name: "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100
gpu=$(python3 - <<'PY'
import re, torch
name = torch.cuda.get_device_name()
model = re.search(r"\b[A-Z]+\d{2,4}\b", name)
print((model.group(0) if model else name.split()[-1]).lower())
PY
)
out=${OUT_DIR:-results/$gpu}
mkdir -p "$out"
steps=${*:-tests sanitize grid calibrate evaluate}
backends=pkv-grouped,pkv-split,pkv-balanced,pkv-auto,fi-cuda-core,fi-tensor-core,fi-xqa
kernel_tests='g4-d128-p16-mixed and fp16 or merge_of_many'
status=0
repeats=${RUNS:-1 2}   # the runs of the steps that run twice, for the noise (RUNS="2": the second alone)
wait_for_gpu() {   # a step timed beside another process's kernels (one left running by a
  local others      # killed caller, say) is wrong: wait up to 2 minutes for the GPU, then warn
  for _ in $(seq 120); do
    others=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
    [ -z "$others" ] && return 0
    sleep 1
  done
  echo "WARNING: other processes still use the GPU (pids: $(echo $others)): this step's" \
       "timings are suspect"
}
for step in $steps; do
  echo "== $step"
  wait_for_gpu
  case $step in
    tests)     # the slowest files alone, the rest spread over the other processes
               groups=("tests/test_decode.py" "tests/test_variants.py" "tests/test_fp8.py"
                       "tests/test_compile.py" "tests/test_transformers.py"
                       "tests/test_multi_token.py tests/test_graph_mode.py tests/test_op.py"
                       "$(ls tests/test_*.py | grep -v -E 'test_(decode|variants|fp8|compile|transformers|multi_token|graph_mode|op)\.py' | tr '\n' ' ')")
               i=0
               for g in "${groups[@]}"; do
                 i=$((i + 1))
                 timeout 560 python3 -m pytest -q -p no:cacheprovider $g > "$out/pytest-part$i.txt" 2>&1 &
               done
               wait
               cat "$out"/pytest-part*.txt > "$out/pytest-$gpu.txt"; rm -f "$out"/pytest-part*.txt
               sed -i 's#[^ ]*/site-packages/#<site-packages>/#g' "$out/pytest-$gpu.txt"
               grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest-$gpu.txt" | tail -12 ;;
    sanitize)  mkdir -p "$out/sanitizer"
               for tool in memcheck racecheck; do
                 timeout 120 compute-sanitizer --tool $tool --print-limit 20 python3 -m pytest -q -x \
                   -p no:cacheprovider tests/test_decode.py -k "$kernel_tests" \
                   > "$out/sanitizer/sanitizer-$tool.txt" 2>&1
                 grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$out/sanitizer/sanitizer-$tool.txt" | tail -2
               done ;;
    grid)      timeout 200 python3 -m persistentkv.cli bench --grid --backends $backends --out "$out" \
                 > "$out/grid-log.txt" 2>&1; tail -1 "$out/grid-log.txt" ;;
    shapes)    mkdir -p "$out/shapes"   # the shape matrix: the grid at each preset of $PRESETS
               for p in ${PRESETS:-llama3-70b-tp8 gpt-oss-tp8 llama3-70b-tp4 qwen2.5-7b llama3-8b \
                                   gpt-oss llama3-70b qwen3-14b gemma2-9b}; do
                 timeout 240 python3 -m persistentkv.cli bench --grid --preset $p \
                   --backends ${SHAPE_BACKENDS:-pkv-auto,fi-cuda-core,fi-tensor-core,fi-xqa} \
                   --out "$out/shapes" \
                   --tag $p > "$out/shapes/$p-log.txt" 2>&1 || status=1
                 tail -1 "$out/shapes/$p-log.txt"
               done ;;
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
    judge)     mkdir -p "$out/presets"
               for p in ${PRESETS:-llama3-70b qwen3-14b gpt-oss gpt-oss-tp8 gemma2-9b}; do
                 timeout 200 python3 -m persistentkv.cli evaluate --preset "$p" --samples 8 \
                   --out "$out/presets" --tag "judge-$p" > "$out/presets/judge-$p-log.txt" 2>&1
                 grep "x FI best" "$out/presets/judge-$p-log.txt"
               done ;;
    pdl)       for shape in "--tag pdl" "--batch 1 --context 1024 --tag pdl-b1" \
                            "--batch 64 --context 8192 --tag pdl-b64"; do
                 timeout 200 python3 -m persistentkv.cli layer-chain $shape --out "$out" \
                   > "$out/layer-chain-log.txt" 2>&1; tail -3 "$out/layer-chain-log.txt"
               done
               for i in $repeats; do   # twice, for the noise
                 timeout 200 python3 -m persistentkv.cli bench --grid --cells "B1 L1K,B8 L1K,B8 L8K" \
                   --backends pkv-auto,pkv-auto:pdl1 --out "$out" --tag pdl-alone-$i \
                   > "$out/pdl-alone-log.txt" 2>&1; tail -1 "$out/pdl-alone-log.txt"
               done ;;
    d256)      mkdir -p "$out/d256"
               for i in $repeats; do   # twice, for the noise
                 timeout 250 python3 -m persistentkv.cli bench --grid --preset gemma2-9b \
                   --cells "B8 bimodal,B8 uniform,B8 zipf,B4 bimodal,B8 L8K,B1 L32K" \
                   --backends pkv-auto,pkv-auto:blockn64:stages2,pkv-auto:blockn16:stages4,pkv-auto:pps3:waves3,fi-cuda-core,fi-tensor-core \
                   --out "$out/d256" --tag "d256-$i" > "$out/d256/d256-$i-log.txt" 2>&1
                 tail -1 "$out/d256/d256-$i-log.txt"
               done ;;
    d512)      timeout 300 python3 -m persistentkv.cli bench --grid --num-qo-heads 16 --num-kv-heads 2 \
                 --head-dim 512 --backends pkv-auto,pkv-auto:minsplit128,pkv-auto:blockn32:warps8:stages3,fi-tensor-core \
                 --out "$out" --tag d512-tiles > "$out/d512-log.txt" 2>&1; tail -1 "$out/d512-log.txt" ;;
    qtiles)    mkdir -p "$out/qtiles"   # several queries a row: the tile's launch shape
               for q in 4 8 16; do
                 timeout 200 python3 -m persistentkv.cli bench --grid --q-len $q \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B8 L1K,B8 L8K,B32 L32K,B4 zipf" \
                   --backends pkv-auto,pkv-auto:warps8:pps1,pkv-auto:blockn32,pkv-auto:stages2,pkv-auto:minsplit32,fi-prefill \
                   --out "$out/qtiles" --tag "qtiles-q$q" > "$out/qtiles/qtiles-q$q-log.txt" 2>&1
                 tail -1 "$out/qtiles/qtiles-q$q-log.txt"
               done ;;
    smallcells) mkdir -p "$out/smallcells"   # one KV head's small steps: programs per SM
               for p in llama3-70b-tp8 gpt-oss-tp8; do
                 timeout 200 python3 -m persistentkv.cli bench --grid --preset "$p" \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B8 L1K,B4 zipf,B128 L1K,B8 L32K" \
                   --backends pkv-auto,pkv-auto:pps3,pkv-auto:stages2,fi-xqa,fi-tensor-core \
                   --out "$out/smallcells" --tag "smallcells-$p" \
                   > "$out/smallcells/smallcells-$p-log.txt" 2>&1
                 tail -1 "$out/smallcells/smallcells-$p-log.txt"
               done ;;
    longsplit) mkdir -p "$out/longsplit"
               for p in ${PRESETS:-qwen2.5-7b llama3-70b-tp4 llama3-70b-tp8}; do
                 for i in $repeats; do   # twice, for the noise
                   timeout 200 python3 -m persistentkv.cli bench --grid --preset "$p" \
                     --cells "B4 L128K,B8 L128K,B32 L32K,B32 L128K,B128 L32K" \
                     --backends pkv-auto,pkv-auto:balfrom0,fi-tensor-core --out "$out/longsplit" \
                     --tag "longsplit-$p-$i" > "$out/longsplit/longsplit-$p-$i-log.txt" 2>&1
                   tail -1 "$out/longsplit/longsplit-$p-$i-log.txt"
                 done
               done ;;
    fp8vt)     mkdir -p "$out/fp8vt"
               cells="B1 L32K,B1 L128K,B4 L32K,B8 L1K,B8 L8K,B8 L32K,B8 L128K,B32 L8K,B16 mix"
               timeout 200 python3 -m persistentkv.cli bench --grid --cells "$cells" \
                 --backends pkv-auto --out "$out/fp8vt" --tag fp16 > "$out/fp8vt/fp16-log.txt" 2>&1
               for i in $repeats; do
                 for g in tensor token; do
                   for layout in HND HND_VT; do
                     timeout 200 python3 -m persistentkv.cli bench --grid --kv-fp8 $g --layout $layout \
                       --cells "$cells" --backends pkv-auto --out "$out/fp8vt" --tag "$g-$layout-$i" \
                       > "$out/fp8vt/$g-$layout-$i-log.txt" 2>&1; tail -1 "$out/fp8vt/$g-$layout-$i-log.txt"
                   done
                 done
               done
               for g in tensor token; do
                 python3 scripts/benchmark_tables.py --ab-a "$out"/fp8vt/$g-HND-{1,2}.json \
                   --ab-b "$out"/fp8vt/$g-HND_VT-{1,2}.json
               done ;;
    firstgraph) mkdir -p "$out/firstgraph"   # a process's first graphs: a torch copy's first
               timeout 150 python3 scripts/probe_variant_cost.py --throwaway-torch --last-again \
                 --json "$out/firstgraph/firstgraph-torch.json" \
                 > "$out/firstgraph/firstgraph-torch-log.txt" 2>&1
               cut -c1-300 "$out/firstgraph/firstgraph-torch-log.txt" | tail -6 ;;
    qsplits)   mkdir -p "$out/qsplits"   # several queries a row: longer splits, fewer partials
               for q in 4 8 16; do
                 timeout 200 python3 -m persistentkv.cli bench --grid --q-len $q \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B8 L1K,B4 zipf,B8 L8K" \
                   --backends pkv-auto,pkv-auto:minsplit256,pkv-auto:minsplit512,pkv-auto:waves1,fi-prefill \
                   --out "$out/qsplits" --tag "qsplits-q$q" > "$out/qsplits/qsplits-q$q-log.txt" 2>&1
                 tail -1 "$out/qsplits/qsplits-q$q-log.txt"
               done ;;
    tp8tiles)  mkdir -p "$out/tp8tiles"   # gpt-oss-tp8 (8/1/64): deeper pipelines at 64 tokens
               for i in $repeats; do   # twice, for the noise
                 timeout 200 python3 -m persistentkv.cli bench --grid --preset gpt-oss-tp8 \
                   --cells "B32 L128K,B128 L32K,B8 L32K,B128 L1K,B8 L4K,B1 L8K,B4 zipf" \
                   --backends pkv-auto,pkv-auto:stages4,pkv-auto:stages5,pkv-auto:blockn128:stages2,fi-tensor-core,fi-xqa \
                   --out "$out/tp8tiles" --tag "tp8tiles-$i" > "$out/tp8tiles/tp8tiles-$i-log.txt" 2>&1
                 tail -1 "$out/tp8tiles/tp8tiles-$i-log.txt"
               done ;;
    stepparts) mkdir -p "$out/stepparts"   # small steps: planner, launches, kernel, apart
               for pc in "llama3-70b-tp8:B128 L1K,B32 L1K,B8 L4K" "gpt-oss-tp8:B128 L1K,B8 L4K" \
                         "qwen2.5-7b:B32 L1K,B8 L1K,B4 zipf" "gpt-oss:B4 zipf,B1 L8K"; do
                 p=${pc%%:*}
                 timeout 150 python3 scripts/probe_step_parts.py --preset "$p" --cells "${pc#*:}" \
                   --json "$out/stepparts/stepparts-$p.json" > "$out/stepparts/stepparts-$p-log.txt" 2>&1
                 cut -c1-300 "$out/stepparts/stepparts-$p-log.txt" | tail -3
               done ;;
    policycost) mkdir -p "$out/policycost"   # a plan by the policy beside the rule's, apart
               # fits whose bins are all (qwen2.5-7b) or all but one (llama3-8b) the rule's (v35)
               for pc in "qwen2.5-7b:B1 L1K,B4 L1K,B4 zipf,B8 L1K,B32 L1K" \
                         "llama3-8b:B4 L1K,B4 zipf,B8 bimodal"; do
                 p=${pc%%:*}
                 timeout 150 python3 scripts/probe_step_parts.py --preset "$p" --cells "${pc#*:}" \
                   --policy "results/h100/v35/presets/policy-$p.json" \
                   --json "$out/policycost/policycost-$p.json" > "$out/policycost/policycost-$p-log.txt" 2>&1
                 cut -c1-400 "$out/policycost/policycost-$p-log.txt" | tail -5
               done ;;
    mblockcross) mkdir -p "$out/mblockcross"   # M-blocks of 16 against 32 (and the default)
               # by step size, at three shapes and the query counts where the block matters: where
               # the crossover in K/V bytes lies at each, before a rule that picks the block per step
               for sq in "llama3-8b:8" "llama3-8b:16" "gemma2-9b:16" "d512:4" "d512:8" "d512:16"; do
                 s=${sq%%:*}; q=${sq#*:}
                 if [ "$s" = d512 ]; then shape="--num-qo-heads 16 --num-kv-heads 2 --head-dim 512"
                 else shape="--preset $s"; fi
                 for i in $repeats; do
                   timeout 300 python3 -m persistentkv.cli bench --grid $shape --q-len $q \
                     --cells "B1 L1K,B1 L8K,B4 L1K,B8 L1K,B8 L8K,B32 L1K,B32 L8K" \
                     --backends pkv-auto,pkv-auto:tilerows16,pkv-auto:tilerows32 \
                     --out "$out/mblockcross" --tag "$s-q$q-$i" > "$out/mblockcross/$s-q$q-$i-log.txt" 2>&1
                   tail -1 "$out/mblockcross/$s-q$q-$i-log.txt"
                 done
               done ;;
    d512cross) mkdir -p "$out/d512cross"   # head dim 512 (16/2) at 4, 8 and 16 queries: its
               # blocks of 16 (the default) against blocks of 32 over 13 cells of 4 MB-1 GB, the
               # 34-134 MB gap of mblockcross's cells filled (mixes, B1 L32K, B4 L8K, B8 L4K)
               for q in 4 8 16; do
                 timeout 190 python3 -m persistentkv.cli bench --grid --num-qo-heads 16 \
                   --num-kv-heads 2 --head-dim 512 --q-len $q \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B8 L1K,B4 zipf,B8 zipf,B1 L32K,B4 L8K,B8 L4K,B32 L1K,B4 bimodal,B8 L8K,B32 L8K" \
                   --backends pkv-auto,pkv-auto:tilerows32 \
                   --out "$out/d512cross" --tag "d512-q$q" > "$out/d512cross/d512-q$q-log.txt" 2>&1
                 tail -1 "$out/d512cross/d512-q$q-log.txt"
               done ;;
    largerows) mkdir -p "$out/largerows"   # v37: head dim 512's large steps in blocks of 32
               # (pkv-auto) against blocks of 16 (:largerows0, before), d512cross's cells, with
               # FlashInfer's prefill path at 8 queries
               for q in 4 8 16; do
                 b=pkv-auto,pkv-auto:largerows0; [ $q = 8 ] && b=$b,fi-prefill
                 timeout 200 python3 -m persistentkv.cli bench --grid --num-qo-heads 16 \
                   --num-kv-heads 2 --head-dim 512 --q-len $q \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B8 L1K,B4 zipf,B8 zipf,B1 L32K,B4 L8K,B8 L4K,B32 L1K,B4 bimodal,B8 L8K,B32 L8K" \
                   --backends $b --out "$out/largerows" --tag "d512-q$q" \
                   > "$out/largerows/d512-q$q-log.txt" 2>&1
                 tail -1 "$out/largerows/d512-q$q-log.txt"
               done ;;
    valueblocks) mkdir -p "$out/valueblocks"   # v38: head dim 512's large 8- and 16-query
               # steps in 64-row programs two to a task's output columns at two stages (the
               # default) against v37's M-blocks of 32 (:largerows32:valueblocks1), with
               # FlashInfer's prefill path
               for q in 8 16; do
                 timeout 280 python3 -m persistentkv.cli bench --grid --num-qo-heads 16 \
                   --num-kv-heads 2 --head-dim 512 --q-len $q \
                   --cells "B1 L32K,B4 L8K,B8 L4K,B8 L8K,B32 L1K,B32 L8K,B4 bimodal,B8 zipf" \
                   --backends pkv-auto,pkv-auto:largerows32:valueblocks1,fi-prefill \
                   --out "$out/valueblocks" --tag "d512-q$q" \
                   > "$out/valueblocks/d512-q$q-log.txt" 2>&1
                 tail -1 "$out/valueblocks/d512-q$q-log.txt"
               done ;;
    smallstep) mkdir -p "$out/smallstep"   # v36: small steps' tiles in half-size M-blocks
               # (pkv-auto) against the whole tile (:smallstep0): the 8-query grid at 32/8/128
               # with FlashInfer's paths (issue 16), then the cells of 4-67 MB and 134-268 MB
               # at four more shapes where the rule cuts the tile
               timeout 280 python3 -m persistentkv.cli bench --grid --q-len 8 \
                 --backends pkv-auto,pkv-auto:smallstep0,fi-prefill,fi-xqa \
                 --out "$out/smallstep" --tag llama3-8b-q8 > "$out/smallstep/llama3-8b-q8-log.txt" 2>&1
               tail -1 "$out/smallstep/llama3-8b-q8-log.txt"
               for sq in "gemma2-9b:16" "gpt-oss:8" "qwen2.5-7b:8" "llama3-70b:4"; do
                 s=${sq%%:*}; q=${sq#*:}
                 timeout 150 python3 -m persistentkv.cli bench --grid --preset $s --q-len $q \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B8 L1K,B8 L8K,B32 L1K" \
                   --backends pkv-auto,pkv-auto:smallstep0 --out "$out/smallstep" \
                   --tag "$s-q$q" > "$out/smallstep/$s-q$q-log.txt" 2>&1
                 tail -1 "$out/smallstep/$s-q$q-log.txt"
               done ;;
    smallsweep) mkdir -p "$out/smallsweep"   # v36's threshold on this GPU: none, 768 KiB an SM
               # (the default, fitted on an H100) and twice that, over the cells near it
               for sq in "llama3-8b:8" "gemma2-9b:16" "qwen2.5-7b:8"; do
                 s=${sq%%:*}; q=${sq#*:}
                 timeout 180 python3 -m persistentkv.cli bench --grid --preset $s --q-len $q \
                   --cells "B1 L8K,B8 L1K,B1 L32K,B4 L8K,B8 L4K,B8 zipf,B32 L1K" \
                   --backends pkv-auto:smallstep0,pkv-auto,pkv-auto:smallstep1572864 \
                   --out "$out/smallsweep" --tag "$s-q$q" > "$out/smallsweep/$s-q$q-log.txt" 2>&1
                 tail -1 "$out/smallsweep/$s-q$q-log.txt"
               done ;;
    valuerows) mkdir -p "$out/valuerows"   # v49: value blocks on 16-row tiles, small steps
               vb=pkv-auto:valueblocks2:valuerows16,pkv-auto:valueblocks4:valuerows16
               vb=$vb,pkv-auto:valueblocks4:valuerows16:pps4   # 4 blocks fit 4 programs an SM
               for i in $repeats; do
                 for sq in "llama3-8b:1" "llama3-8b:4" "gpt-oss-tp8:1" "qwen2.5-7b:1"; do
                   s=${sq%%:*}; q=${sq#*:}; tag=$s-q$q-$i
                   timeout 200 python3 -m persistentkv.cli bench --grid --preset $s --q-len $q \
                     --cells "B1 L1K,B4 L1K,B8 L1K,B4 zipf,B1 L8K,B8 L4K,B32 L1K,B128 L1K,B8 L32K" \
                     --backends pkv-auto,$vb,fi-xqa --out "$out/valuerows" --tag $tag \
                     > "$out/valuerows/$tag-log.txt" 2>&1
                   tail -1 "$out/valuerows/$tag-log.txt"
                 done
               done ;;
    firstpages) mkdir -p "$out/firstpages"   # v50: each task's first pages beside its record
               for i in $repeats; do
                 for sq in "gpt-oss-tp8:1" "llama3-8b:1" "qwen2.5-7b:1" "llama3-8b:4" \
                           "llama3-70b-tp8:1"; do
                   s=${sq%%:*}; q=${sq#*:}; tag=$s-q$q-$i
                   timeout 200 python3 -m persistentkv.cli bench --grid --preset $s --q-len $q \
                     --cells "B1 L1K,B4 L1K,B8 L1K,B4 zipf,B1 L8K,B8 L4K,B32 L1K,B128 L1K,B8 L32K" \
                     --backends pkv-auto,pkv-auto:firstpages1,fi-xqa --out "$out/firstpages" \
                     --tag $tag > "$out/firstpages/$tag-log.txt" 2>&1
                   tail -1 "$out/firstpages/$tag-log.txt"
                 done
               done ;;
    benchorder) mkdir -p "$out/benchorder"   # our graphs alone, and replayed after XQA's
               for i in $repeats; do
                 for b in pkv-auto pkv-auto,fi-xqa; do
                   timeout 120 python3 -m persistentkv.cli bench --grid --preset llama3-70b-tp8 \
                     --cells "B128 L1K,B32 L1K,B8 L4K" --backends $b --out "$out/benchorder" \
                     --tag "benchorder-${b//,/-}-$i" > "$out/benchorder/log-${b//,/-}-$i.txt" 2>&1
                   tail -1 "$out/benchorder/log-${b//,/-}-$i.txt"
                 done
               done ;;
    graphdump) mkdir -p "$out/graphdump"   # the slow first graphs of a process, node by node
               timeout 150 python3 scripts/probe_variant_cost.py --last-again \
                 --dump-graphs "$out/graphdump" --json "$out/graphdump/graphdump.json" \
                 > "$out/graphdump/graphdump-log.txt" 2>&1
               cut -c1-300 "$out/graphdump/graphdump-log.txt" | tail -4 ;;
    graphshare) mkdir -p "$out/graphshare"   # the first graphs again, all through one wrapper
               timeout 150 python3 scripts/probe_variant_cost.py --last-again --one-wrapper \
                 --json "$out/graphshare/graphshare.json" > "$out/graphshare/log.txt" 2>&1
               cut -c1-300 "$out/graphshare/log.txt" | tail -4 ;;
    heldgraphs) mkdir -p "$out/heldgraphs"   # the first graphs, each graph's buffers held
               timeout 150 python3 scripts/probe_variant_cost.py --last-again \
                 --json "$out/heldgraphs/heldgraphs.json" > "$out/heldgraphs/log.txt" 2>&1
               cut -c1-300 "$out/heldgraphs/log.txt" | tail -4 ;;
    qgrids)    mkdir -p "$out/qgrids"   # several queries a row against FlashInfer's paths
               for q in 4 8; do
                 timeout 250 python3 -m persistentkv.cli bench --grid --q-len $q \
                   --backends pkv-auto,fi-prefill,fi-xqa --out "$out/qgrids" --tag qlen-$q \
                   > "$out/qgrids/qlen-$q-log.txt" 2>&1 || status=1
               done ;;
    longtiles) mkdir -p "$out/longtiles"   # a tile by a task's length, head dim 64
               timeout 280 python3 -m persistentkv.cli bench --grid --preset gpt-oss-tp8 \
                 --backends pkv-auto,pkv-auto:longblockn128:longfrom1024,pkv-auto:longblockn128,pkv-auto:longblockn128:longfrom4096,fi-tensor-core,fi-xqa \
                 --out "$out/longtiles" --tag gpt-oss-tp8 > "$out/longtiles/gpt-oss-tp8-log.txt" 2>&1 || status=1
               timeout 280 python3 -m persistentkv.cli bench --grid --preset gpt-oss \
                 --backends pkv-auto,pkv-auto:blockn128:longblockn0,pkv-auto:longfrom2048,fi-tensor-core,fi-xqa \
                 --out "$out/longtiles" --tag gpt-oss > "$out/longtiles/gpt-oss-log.txt" 2>&1 || status=1 ;;
    tp8long)   mkdir -p "$out/tp8long"   # gpt-oss-tp8: what the long tiles cost its small cells
               long=pkv-auto:longblockn128:longfrom1024
               for i in $repeats; do   # twice, for the noise
                 timeout 200 python3 -m persistentkv.cli bench --grid --preset gpt-oss-tp8 \
                   --cells "B1 L1K,B4 L1K,B8 L1K,B8 L8K,B4 zipf,B32 L8K,B32 L128K,B128 L32K" \
                   --backends pkv-auto,$long,$long:maxreg200,pkv-auto:stages2,$long:stages2,fi-tensor-core \
                   --out "$out/tp8long" --tag "tp8long-$i" > "$out/tp8long/tp8long-$i-log.txt" 2>&1
                 tail -1 "$out/tp8long/tp8long-$i-log.txt"
               done ;;
    gemma2window) mkdir -p "$out/gemma2window"   # gemma2-9b's windowed large steps
               timeout 250 python3 -m persistentkv.cli bench --grid --preset gemma2-9b \
                 --window-left 4096 --soft-cap 50 --cells "B128 L8K,B128 L32K,B32 L32K,B8 L4K" \
                 --backends "pkv-auto,pkv-auto:blockn64:stages2,pkv-balanced,pkv-split,pkv-grouped,$(
                             )fi-cuda-core,fi-tensor-core" \
                 --out "$out/gemma2window" --tag gemma2window > "$out/gemma2window/log.txt" 2>&1
               tail -1 "$out/gemma2window/log.txt" ;;
    mixwaves)  mkdir -p "$out/mixwaves"   # mixed batches: finer work items, balanced chunks
               for p in gemma2-9b llama3-8b; do
                 timeout 250 python3 -m persistentkv.cli bench --grid --preset $p \
                   --cells "B4 uniform,B8 uniform,B8 bimodal,B16 mix,B8 L32K" \
                   --backends "pkv-auto,pkv-auto:waves3,pkv-auto:waves4,pkv-balanced,$(
                               )fi-cuda-core,fi-tensor-core" \
                   --out "$out/mixwaves" --tag "$p" > "$out/mixwaves/$p-log.txt" 2>&1
                 tail -1 "$out/mixwaves/$p-log.txt"
               done ;;
    d256chunks) mkdir -p "$out/d256chunks"   # v42: head dim 256's chunks from 2560-token splits
               for i in $repeats; do    # (the default) against the rule before (16K), twice
                 timeout 250 python3 -m persistentkv.cli bench --grid --preset gemma2-9b \
                   --backends pkv-auto,pkv-auto:balfrom16384,fi-cuda-core,fi-tensor-core \
                   --out "$out/d256chunks" --tag "gemma2-9b-$i" > "$out/d256chunks/gemma2-9b-$i-log.txt" 2>&1
                 tail -1 "$out/d256chunks/gemma2-9b-$i-log.txt"
               done ;;
    q16floor)  mkdir -p "$out/q16floor"   # gpt-oss, 16 queries a row: the split floor
               for i in $repeats; do   # twice, for the noise
                 timeout 300 python3 -m persistentkv.cli bench --grid --preset gpt-oss --q-len 16 \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B4 zipf,B32 L1K" \
                   --backends pkv-auto,pkv-auto:minsplit64,pkv-auto:minsplit32,pkv-auto:warps8,pkv-auto:warps8:minsplit32,pkv-auto:longblockn0,fi-prefill \
                   --out "$out/q16floor" --tag "q16floor-$i" > "$out/q16floor/q16floor-$i-log.txt" 2>&1
                 tail -1 "$out/q16floor/q16floor-$i-log.txt"
               done ;;
    mblocks)   mkdir -p "$out/mblocks"   # 16 queries a row at head dim 128: M-blocks' size, stages
               for i in $repeats; do   # twice, for the noise
                 for preset in llama3-70b qwen2.5-7b; do
                   timeout 150 python3 -m persistentkv.cli bench --grid --preset $preset --q-len 16 \
                     --cells "B1 L1K,B1 L8K,B4 L1K,B32 L1K" \
                     --backends pkv-auto,pkv-auto:tilerows32,pkv-auto:stages2,fi-prefill \
                     --out "$out/mblocks" --tag "$preset-q16-$i" > "$out/mblocks/$preset-q16-$i-log.txt" 2>&1
                   tail -1 "$out/mblocks/$preset-q16-$i-log.txt"
                 done
               done ;;
    padrows)   mkdir -p "$out/padrows"   # 32-row tiles padded to 64 (the warp-group MMA)
               for i in $repeats; do   # twice, for the noise
                 for run in "llama3-8b 8" "llama3-70b 4" "gpt-oss 4"; do
                   set -- $run
                   timeout 150 python3 -m persistentkv.cli bench --grid --preset $1 --q-len $2 \
                     --cells "B1 L1K,B1 L8K,B4 L1K,B8 L8K,B32 L1K,B32 L8K" \
                     --backends pkv-auto:padrows16,pkv-auto,fi-prefill \
                     --out "$out/padrows" --tag "$1-q$2-$i" > "$out/padrows/$1-q$2-$i-log.txt" 2>&1
                   tail -1 "$out/padrows/$1-q$2-$i-log.txt"
                 done
               done ;;
    widepad)   mkdir -p "$out/widepad"   # v33: no padded tiles past head dim 128, against them
               for i in $repeats; do   # twice, for the noise
                 timeout 200 python3 -m persistentkv.cli bench --grid --preset gemma2-9b --q-len 16 \
                   --cells "B1 L1K,B1 L8K,B4 L1K,B8 L8K,B32 L1K,B32 L8K" \
                   --backends pkv-auto,pkv-auto:padrows64,fi-prefill \
                   --out "$out/widepad" --tag "gemma2-9b-q16-$i" > "$out/widepad/gemma2-9b-q16-$i-log.txt" 2>&1
                 tail -1 "$out/widepad/gemma2-9b-q16-$i-log.txt"
               done ;;
    d256regs)  mkdir -p "$out/d256regs"   # v34: gemma2-9b's decode tile capped at 224 registers (the
               for i in $repeats; do   # default) against the compiler's 168 and its spill; twice
                 timeout 250 python3 -m persistentkv.cli bench --grid --preset gemma2-9b \
                   --backends pkv-auto,pkv-auto:maxreg0,fi-cuda-core,fi-tensor-core \
                   --out "$out/d256regs" --tag "gemma2-9b-$i" > "$out/d256regs/gemma2-9b-$i-log.txt" 2>&1
                 tail -1 "$out/d256regs/gemma2-9b-$i-log.txt"
               done ;;
    d512q)     mkdir -p "$out/d512q"   # v34: head dim 512 at 4, 8 and 16 queries a row: M-blocks of 16
               for q in 4 8 16; do     # (the default) against blocks of 32; FlashInfer's prefill
                 for i in $repeats; do # path builds its head-dim-512 module on first use (minutes)
                   timeout 400 python3 -m persistentkv.cli bench --grid --num-qo-heads 16 --num-kv-heads 2 \
                     --head-dim 512 --q-len $q --cells "B1 L1K,B1 L8K,B4 L1K,B8 L8K,B32 L1K,B32 L8K" \
                     --backends pkv-auto,pkv-auto:tilerows32,fi-prefill \
                     --out "$out/d512q" --tag "d512-q$q-$i" > "$out/d512q/d512-q$q-$i-log.txt" 2>&1
                   tail -1 "$out/d512q/d512-q$q-$i-log.txt"
                 done
               done ;;
    capregs)   mkdir -p "$out/capregs"   # v34: one-query tiles at head dims 64 and 128 under a cap
               for p in llama3-8b llama3-70b-tp8 gpt-oss-tp8; do   # of 224 registers (no spill to
                 for i in $repeats; do                             # remove: 168 -> 224 registers)
                   timeout 250 python3 -m persistentkv.cli bench --grid --preset $p \
                     --backends pkv-auto,pkv-auto:maxreg224,fi-cuda-core,fi-tensor-core \
                     --out "$out/capregs" --tag "$p-$i" > "$out/capregs/$p-$i-log.txt" 2>&1
                   tail -1 "$out/capregs/$p-$i-log.txt"
                 done
               done ;;
    tp8small)  mkdir -p "$out/tp8small"   # gpt-oss-tp8's small cells under 1.00x: their splits
               for i in $repeats; do   # twice, for the noise
                 timeout 250 python3 -m persistentkv.cli bench --grid --preset gpt-oss-tp8 \
                   --cells "B8 L4K,B8 L8K,B4 zipf,B128 L1K" \
                   --backends pkv-auto,pkv-split@16,pkv-split@32,pkv-grouped,pkv-balanced,fi-cuda-core,fi-tensor-core,fi-xqa \
                   --out "$out/tp8small" --tag "tp8small-$i" > "$out/tp8small/tp8small-$i-log.txt" 2>&1
                 tail -1 "$out/tp8small/tp8small-$i-log.txt"
               done ;;
    tp8b128)   mkdir -p "$out/tp8b128"   # v45: whole rows against the rule's half-rows
               for i in $repeats; do
                 for p in llama3-70b-tp8 gpt-oss-tp8; do
                   timeout 150 python3 -m persistentkv.cli bench --grid --preset $p \
                     --cells "B128 L1K,B128 L8K,B32 L8K" \
                     --backends pkv-auto,pkv-grouped,pkv-grouped:stages4,pkv-balanced,fi-xqa \
                     --out "$out/tp8b128" --tag "$p-$i" > "$out/tp8b128/$p-$i-log.txt" 2>&1
                   tail -1 "$out/tp8b128/$p-$i-log.txt"
                 done
               done ;;
    wholerows) mkdir -p "$out/wholerows"   # v46: whole rows where rows x KV heads are 128 (4
               # under the SMs, so the rule splits them) at every KV-head count, rows of 1K and 2K
               # (v47, H200: the rule's whole rows from 95% of the SMs, :wholefill0.95, since
               # removed, lost 11-46% to the default everywhere)
               for pc in "llama3-70b-tp8:B128 L1K,B128 L2K" "qwen2.5-7b:B32 L1K,B32 L2K" \
                         "llama3-8b:B16 L1K,B16 L2K" "gpt-oss-tp8:B128 L1K,B128 L2K" \
                         "llama3-70b-tp4:B64 L1K,B64 L2K" "gemma2-9b:B16 L1K,B16 L2K" \
                         "gpt-oss:B16 L1K,B16 L2K"; do
                 p=${pc%%:*}
                 for i in $repeats; do
                   timeout 150 python3 -m persistentkv.cli bench --grid --preset "$p" \
                     --cells "${pc#*:}" \
                     --backends pkv-auto,pkv-grouped,pkv-grouped:stages4,fi-tensor-core,fi-xqa \
                     --out "$out/wholerows" --tag "$p-$i" > "$out/wholerows/$p-$i-log.txt" 2>&1
                   tail -1 "$out/wholerows/$p-$i-log.txt"
                 done
               done ;;
    abtree)    mkdir -p "$out/abtree"   # this tree (B) against another one's src folder (A:
               # $BASE_SRC, e.g. `git archive <commit> src | tar x -C <dir>`, then <dir>/src),
               # pkv-auto over $CELLS with $BENCH_ARGS (e.g. "--kv-fp8 token"), alternated twice
               base=${BASE_SRC:?abtree compares with BASE_SRC, the src folder of another tree}
               for i in 1 2; do
                 for side in a b; do
                   src=$PWD/src; [ $side = a ] && src=$base
                   PYTHONPATH="$src:${PYTHONPATH:-}" timeout 200 python3 -m persistentkv.cli bench \
                     --grid ${BENCH_ARGS:-} --cells "${CELLS:-B1 L32K,B8 L8K,B8 L32K,B32 L8K}" \
                     --backends pkv-auto --out "$out/abtree" --tag "$side-$i" \
                     > "$out/abtree/$side-$i-log.txt" 2>&1; tail -1 "$out/abtree/$side-$i-log.txt"
                 done
               done
               python3 scripts/benchmark_tables.py --ab-a "$out"/abtree/a-{1,2}.json \
                 --ab-b "$out"/abtree/b-{1,2}.json ;;
    stalls)    mkdir -p "$out/stalls"   # v52: the warps' stall reasons, fp16 against fp8
               for c in "fp16:" "fp8vt:--kv-fp8 tensor --layout HND_VT"; do
                 tag=${c%%:*}; flags=${c#*:}
                 timeout 150 ncu --clock-control none --kernel-name regex:paged_decode \
                   --launch-skip 2 --launch-count 1 --section WarpStateStats \
                   --section SchedulerStats --csv --page raw python3 -m persistentkv.cli bench \
                   --grid --cells "B32 L8K" $flags --backends pkv-auto --layers 2 \
                   > "$out/stalls/raw-$tag.csv" 2>&1
                 grep -c issue_stalled "$out/stalls/raw-$tag.csv"
               done
               timeout 200 ncu --clock-control none --kernel-name regex:paged_decode \
                 --launch-skip 2 --launch-count 1 --section SourceCounters \
                 --section WarpStateStats --csv --page source --print-source sass \
                 python3 -m persistentkv.cli bench --grid --cells "B32 L8K" --kv-fp8 tensor \
                 --layout HND_VT --backends pkv-auto --layers 2 \
                 > "$out/stalls/source-fp8vt.csv" 2>&1
               timeout 200 ncu --clock-control none --kernel-name regex:paged_decode \
                 --launch-skip 2 --launch-count 1 --section SourceCounters \
                 --section WarpStateStats --csv --page source --print-source sass \
                 python3 -m persistentkv.cli bench --grid --cells "B1 L1K" --q-len 4 \
                 --backends pkv-auto --layers 2 > "$out/stalls/source-q4-b1.csv" 2>&1
               python3 scripts/stall_table.py "$out"/stalls/raw-{fp16,fp8vt}.csv
               python3 scripts/stall_table.py --source --top 12 "$out"/stalls/source-*.csv ;;
    pagefetch) mkdir -p "$out/pagefetch"   # v53: page indices prefetched into the L2
               cells="B1 L1K,B8 L1K,B1 L32K,B4 L32K,B8 L8K,B8 L32K,B32 L8K,B16 mix"
               for i in $repeats; do
                 cols=pkv-auto,pkv-auto:pagefetch2,pkv-auto:pagefetch4,pkv-auto:taskfetch1
                 cols=$cols,pkv-auto:keeptable1
                 [ "$i" = 2 ] && cols=$(tr , '\n' <<< "$cols" | tac | paste -sd,)
                 for kv in "fp16:" "tensor:--kv-fp8 tensor --layout HND_VT" \
                           "token:--kv-fp8 token --layout HND_VT"; do
                   tag=${kv%%:*}-$i
                   [[ " ${PAGEFETCH_CACHES:-fp16 tensor token} " == *" ${kv%%:*} "* ]] || continue
                   timeout 240 python3 -m persistentkv.cli bench --grid --cells "$cells" ${kv#*:} \
                     --backends $cols --out "$out/pagefetch" --tag $tag \
                     > "$out/pagefetch/$tag-log.txt" 2>&1
                   tail -1 "$out/pagefetch/$tag-log.txt"
                 done
               done
               for fetch in pagefetch2 taskfetch1 keeptable1; do
                 timeout 150 ncu --clock-control none --kernel-name regex:paged_decode \
                   --launch-skip 2 --launch-count 1 --section WarpStateStats \
                   --section SchedulerStats --csv --page raw python3 -m persistentkv.cli bench \
                   --grid --cells "B32 L8K" --kv-fp8 tensor --layout HND_VT \
                   --backends pkv-auto:$fetch --layers 2 \
                   > "$out/pagefetch/raw-fp8vt-$fetch.csv" 2>&1
               done
               python3 scripts/stall_table.py "$out"/pagefetch/raw-fp8vt-*.csv ;;
    gluonfp8)  mkdir -p "$out/gluonfp8"   # v55: the e4m3 loop with hand-picked operand layouts
               timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_probe.py \
                 > "$out/gluonfp8/pytest.txt" 2>&1
               tail -1 "$out/gluonfp8/pytest.txt"
               for i in $repeats; do
                 for cell in "32 8192" "8 32768" "128 8192"; do
                   set -- $cell
                   timeout 150 python3 scripts/probe_gluon_fp8.py --rows $1 --tokens $2 \
                     > "$out/gluonfp8/B$1-L$2-$i.txt" 2>&1
                   cat "$out/gluonfp8/B$1-L$2-$i.txt"
                 done
               done ;;
    e2e)       mkdir -p "$out/e2e"
               runs=${E2E_RUNS:-"gpt-oss-20b 32 1024 --profile;llama3-8b 128 256 --profile"}
               IFS=';' read -ra runs <<< "$runs"
               for run in "${runs[@]}"; do
                 set -- $run
                 model=$1 requests=$2 prompt=$3; shift 3
                 tag="e2e-$model-${requests//,/-}x$prompt"
                 timeout 600 python3 -m persistentkv.cli e2e --model $model --requests $requests \
                   --mean-prompt $prompt --new-tokens 32 "$@" --out "$out/e2e" --tag "$tag" \
                   > "$out/e2e/$tag-log.txt" 2>&1; tail -3 "$out/e2e/$tag-log.txt"
               done ;;
    *)         echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
