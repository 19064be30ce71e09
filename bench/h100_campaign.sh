#!/usr/bin/env bash
# The GPU measurements behind docs/benchmarks.md, one section per measurement; each writes its raw
# files under $OUT (bench/results/<session>/ once kept). On the GPU machine:
#
#   . bench/gpu_env.sh && bash bench/h100_campaign.sh SECTION
#
# The machine goes back 30 s after a call returns, and a section longer than one command's 10
# minutes runs in the background, in a session of its own (setsid): issue `start` and the first
# `wait` in one call, and each next `wait` as soon as the last one returns:
#   bash bench/h100_campaign.sh start i38-held-bert i38-held-llama && bash bench/h100_campaign.sh wait 540
#   bash bench/h100_campaign.sh wait 560       # waits up to 560 s; copies what is done to $OUT
#
# What docs/benchmarks.md shows, by its sections, and the campaign sections that measured it:
#   i38-held-bert, i38-held-llama, i38-held-resnet (or i38-held-MODEL-capped / -uncapped)
#                "Under a hard cap at the budget": each model planned, compiled and trained 50 steps
#                under inductor-cudagraphs with a cap at the budget, and the same budget uncapped
#                (two H200s, 2026-11-29; session30_gpus/held/)   ~3-5 min a row, ~16 min on two GPUs
#   i38-ooc      "The out-of-core profile": BERT-base b32 profiled in memory and out of core, node by
#                node; then BERT-base b64 under a 24 GiB limit and uncapped (H100, 2026-11-26;
#                session12_h100/)                                                            ~4 min
#   i18d-resnet, i18d-bert
#                "Issue 18's rows under inductor-cudagraphs": bench/compare.py, eager, checkpointing,
#                the unplanned steps, recompute only and swap+recompute at half of eager's peak and
#                at checkpointing's (allocated peaks: issue 41's re-measurement replaces them; H100,
#                2026-11-26; session11_h100/)                                          ~11 min each
#   cl-cudagraphs, cl-compile05-trace
#                "Against torch.compile", ResNet-152-cl b128 (H100, 2026-11-25; session8_h100/) ~20 min each
#   inductor-bert, inductor-calibrated
#                "Against torch.compile", BERT-base b64 (H100, 2026-11-23 and 24; issue17_h100/,
#                issue17_h100_cl/)                                                    9 and ~17 min
#   backends     "Without recompute: the compiled backends" (under "Earlier results"), ResNet-152 b32
#                (H100, 2026-11-23; issue17_h100/)                                      ~10-12 min
#   plan-stability, plan-attribution, plan-attribution-steadier
#                "Why one budget gives several plans" (H100, 2026-11-25; session6_h100/) ~17, 4, 5 min
#   fit-resnet, fit-alloc
#                --fit before it profiled each batch at its size (H100, 2026-11-23; issue16_h100/;
#                superseded, out of docs/benchmarks.md since session 17)                ~7, 2 min
#   opt          "Other measurements", the optimizer passes on GPT-2 small and BERT-base (issue16_h100/) ~14 min
#   i38-opt-bert, i38-opt-llama, i38-opt-resnet
#                "Under a hard cap": each model through mutwo-opt --memory-limit CAP --budget CAP
#                under inductor-cudagraphs (H200, 2026-11-29; session30_gpus/opt/)    ~3-5 min each
#   headline-gpt2, headline-bert, headline-resnet
#                "Against eager, per-layer checkpointing and torch.compile": bench/compare.py at held
#                memory and bench/plain_loop.py beside it (issue 41; BERT: H100, 2026-11-28,
#                session23_h100/; GPT-2: H200, 2026-11-28, session24_gpus/)        ~10, ~15, ~40 min
#   headline-resnet-refs, headline-resnet-mutwo, compile-sampled-resnet
#                the same for ResNet-152-cl over two machine holds (H100, 2026-11-28; session22_h100/),
#                and one of its compiles sampled                                  ~10, ~15, ~6 min
#   i40-restart-pyc, i40-restart-models, resnet-ckpt-probe, resnet-eager-probe
#                "Setup at a restart" (BERT-base b64 restarts; H100, 2026-11-28; session23_h100/;
#                the Llama's restarts: H200, 2026-11-28, session25_h200/) and
#                the plain loop's checkpointed ResNet-152 against the harness's (H200, 2026-11-28;
#                session24_gpus/)                                                        ~8, ~6 min
#   dp-two-gpus, dp-record-stream-reuse
#                "Data parallel and FSDP2 on two GPUs, at held memory" (2 x H200, 2026-11-28;
#                session24_gpus/; ResNet-152-cl and the record-stream probe: session26_gpus/)
#                                                          ~25 min; ResNet alone ~14, BERT ~8
# Session 25 (one H200): start tests-all i40-restart-models resnet-eager-probe; the hold's time ran
#   out in ResNet's first start, which ran out of memory in all three calibration rounds.
# Session 26 (two H200s): dp-record-stream-reuse with DP_RUNS="bert resnet" (ResNet's compile
#   failed in Inductor's loop reordering), then DP_RUNS=resnet dp-two-gpus with it off.
# Session 27 (two H200s, session27_gpus/): PARALLEL="pool-excess;i40-restart-models" parallel with
#   RESTART_MODELS=resnet; then dp-two-gpus (DP_RUNS=bert) and the FSDP2 run, each with
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every variant.
# Session 29 (one H200, session29_h200/): start held-excess; then HELD_VARIANTS=capped start
#   i38-held-bert i38-held-llama tests-all i38-held-resnet (ResNet cut off by the hold's time).
# Session 30 (two H200s, then one; session30_gpus/): PARALLEL="i38-held-bert-capped i38-held-llama-capped
#   i38-held-resnet-uncapped;i38-held-resnet-capped i38-held-bert-uncapped i38-held-llama-uncapped" start
#   parallel, then the cuda tests on GPU 1; then start i38-opt-bert i38-opt-llama i38-opt-resnet.
# Session 31 (one H200, session31_h200/): RESTART_MODELS="llama resnet" RESTART_RUNS="first pyc1
#   sampled1" i40-restart-models at 671d719, then RESTART_MODELS="resnet llama" RESTART_RUNS="first pyc1
#   asbefore1 pyc2" RESTART_STEPS=5 i40-restart-models at 4d1ac11.
# Session 32 (one H200, session32_h200/): start i40-restart-all at 342a635; RESTART_MODELS=bert
#   RESTART_RUNS="first keyasbefore1" RESTART_ARGS=--aot-key-lines i40-restart-models at 0feb896;
#   RESTART_TESTS=0 RESTART_ORDER="resnet bert llama" RESTART_RUNS="pyc1 keyasbefore1" i40-restart-all
#   at e0b9e2d (the keyasbefore runs were the A/B of a key handover since removed); then
#   tests/test_cuda.py alone at 4954d55 (tests_alone.txt).
# Session 33 (one H200, session33_h200/): RESTART_TESTS=0 RESTART_RUNS=pyc1 start tests-all
#   i40-restart-all at 1fe3ec6 (every cuda test passed alone); RESTART_MODELS=bert RESTART_RUNS="first
#   pyc1 recordfirst1 pyc2 recordfirst2" RESTART_STEPS=5 i40-restart-models at cb3144c; then
#   bench/first_call_held_probe.py by hand.
# Session 34 (one H200, session34_h200/): RESTART_MODELS=bert RESTART_RUNS="first budget15" RESTART_STEPS=3
#   start tests-training i40-restart-models at 0bc7268; RESTART_RUNS="budget15 budget14" at 3d8f4ed (with
#   tests-training); RESTART_RUNS="budget15 budget14 budget13" at 20ea108.
# Owed after session 34: on an H100 when one is lent, i38-held-* and i38-opt-*, and RESTART_TESTS=0
#   i40-restart-all, its first starts alone too; resnet-eager-probe; i40-restart-pyc's bytecode half;
#   the headline rows again, every variant with expandable segments; dp-two-gpus with all three rows
#   in one run; on any GPU, RESTART_RUNS="budget15 budget13" (calibration keeping a sliced head).
# The CUDA tests: tests-all and i38-tests (every cuda-marked test, ~4 min); i18d-tests, i18c-tests,
#   tests-swap, tests (subsets of files).
# Kept because docs/swap.md, docs/backends.md or bench/*.py quote what they measured (the rows are
# in `git show 7cb6d29:docs/benchmarks.md`): i18-resnet, i18-bert, i18-tests, i18c-resnet, i18c-bert,
#   swap-resnet, swap-bert, inductor, inductor-resnet, inductor-cl, inductor-cl-mutwo,
#   inductor-cl-half, swap-inductor-cl-half, swap-inductor-cl-half-swap, swap-trace, fused-ab,
#   swap-inductor-bert, swap-inductor-bert-swap, bert-cal3, cl-half-same-run, cl-half-isolate,
#   cl-half-swap-contention, swap-options-bert; inductor-calibrated-checkpoint (docs/backends.md
#   names it as the next run of its random-replay rows).
set -u
section=${1:?"name a section: parallel, i40-restart-all, held-excess, pool-excess, dp-record-stream-reuse, i40-restart-pyc, i40-restart-models, resnet-ckpt-probe, resnet-eager-probe, dp-two-gpus, headline-resnet-refs, headline-resnet-mutwo, compile-sampled-resnet, headline-gpt2, headline-bert, headline-resnet, i38-held-bert, i38-held-llama, i38-held-resnet, i38-held-MODEL-capped, i38-held-MODEL-uncapped, i38-opt-bert, i38-opt-llama, i38-opt-resnet, i38-fix-tests, i40-stock, i40-restart, i40-restart-sampled, i40-aot-cache, i39-chunk-tests, i39-chunk-memory, i39-memory-trace, i39-cost-bert, i39-output-code, i39-output-code-bert, i39-floor-bert, i39-cost-gpt2, i38-ooc, i38-tests, i18d-resnet, i18d-bert, i18d-tests, i18c-tests, i18c-resnet, i18c-bert, i18-tests, i18-resnet, i18-bert, cl-cudagraphs, cl-compile05-trace, tests-swap, tests-all, cl-half-swap-contention, swap-options-bert, cl-half-isolate, plan-attribution, plan-attribution-steadier, plan-stability, bert-cal3, cl-half-same-run, tests, swap-trace, swap-inductor-cl-half, swap-inductor-cl-half-swap, fused-ab, inductor-cl-mutwo, swap-inductor-bert, swap-inductor-bert-swap, inductor-cl-half, inductor-calibrated-checkpoint, opt, fit-resnet, fit-alloc, swap-resnet, swap-bert, backends, inductor, inductor-resnet, inductor-bert, inductor-cl, inductor-calibrated"}
: "${OUT:?set OUT to the folder the results go to}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8

# Issue 17's rows for MODELS in one compare run, written to $OUT/inductor_NAME.json; a row may take
# 15 minutes (a whole-iteration compile of ResNet-152 may take 9), the run 40.
inductor_rows() {
  timeout 2400 python3 bench/compare.py --out "$OUT/inductor_$1.json" --models "$2" --timeout 900 \
    --variants eager,checkpoint,compile-0.5,mutwo@inductor-compile0.5,mutwo@inductor-checkpoint
}

BG=/tmp/mutwo-campaign

# The swap study of one model (issue 18): eager, checkpointing, mutwo-none (profiles once), then
# recompute-only and swap+recompute mutwo at half of eager's peak and at checkpointing's, each
# traced per stream. $OUT takes 8 files, 2 folders down: the JSON, the Chrome traces of the 4
# mutwo plans, and mutwo-none's profile (profile.json, nodes.csv: the time model's evidence); the
# traces of eager, checkpointing and mutwo-none stay on the machine (their summaries are in the JSON).
swap_study() {
  local model=$1 stem=$2
  timeout 580 python3 bench/compare.py --out "$OUT/$stem.json" --models "$model" --variants swap-study \
    --timeout 150 --trace; local status=$?
  local scratch="$OUT/$stem" name=${model%%:*} batch=${model##*:}
  mkdir -p "$scratch/left/behind"
  mv "$scratch"/*_eager.trace.json.gz "$scratch"/*_checkpoint.trace.json.gz "$scratch"/*_mutwo-none.trace.json.gz \
    "$scratch/left/behind/" 2>/dev/null
  cp "$scratch/$name/b$batch/profile.json" "$scratch/$name/b$batch/nodes.csv" "$scratch/" 2>/dev/null
  ls -la "$scratch"; return $status
}
case "$section" in
  start)
    shift; mkdir -p "$BG"; rm -f "$BG/done"
    script=$(realpath "$0")
    # One background job runs the named sections in turn; each writes into $BG and logs to $BG/NAME.out.
    setsid nohup bash -c 'for s in "$@"; do OUT='"$BG"' bash '"$script"' "$s" > '"$BG"'/"$s".out 2>&1; \
      echo "$s exit $?" >> '"$BG"'/sections; done; touch '"$BG"'/done' _ "$@" < /dev/null > /dev/null 2>&1 &
    echo "started in the background: $*" ;;
  wait)
    secs=${2:-560}; waited=0
    while [ ! -e "$BG/done" ] && [ "$waited" -lt "$secs" ]; do sleep 5; waited=$((waited + 5)); done
    # $OUT takes 8 files: the results, the sections' output as one file, the fits' logs and reports.
    cp "$BG"/*.json "$BG"/*.log "$OUT"/ 2>/dev/null
    for f in "$BG"/*.folded; do [ -e "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done  # MBs each
    for f in "$BG"/*.out; do echo "== $f"; cat "$f"; done > "$OUT/campaign.out" 2>/dev/null
    for d in "$BG"/fit_*/; do [ -e "$d/fit.json" ] && cp "$d/fit.json" "$OUT/$(basename "$d").json"; done
    cat "$BG/sections" 2>/dev/null; for f in "$BG"/*.out; do echo "== $f"; tail -4 "$f"; done
    [ -e "$BG/done" ] && echo "all sections done" || echo "still running after ${secs} s" ;;
  parallel)
    # Groups of sections side by side, one GPU and an equal share of the cores each (a machine of
    # several GPUs): PARALLEL="headline-gpt2;resnet-ckpt-probe tests-all" runs headline-gpt2 on GPU 0
    # and the other two in turn on GPU 1. Timings taken this way share the host's memory bandwidth
    # with the other group: say so beside them.
    IFS=';' read -r -a groups <<< "${PARALLEL:?set PARALLEL to groups of sections separated by ;}"
    cores=$(nproc); share=$((cores / ${#groups[@]})); script=$(realpath "$0")
    for i in "${!groups[@]}"; do
      ( export CUDA_VISIBLE_DEVICES=$i
        for s in ${groups[$i]}; do
          taskset -c $((i * share))-$(((i + 1) * share - 1)) bash "$script" "$s" > "$OUT/$s.out" 2>&1
          echo "$s (GPU $i) exit $?" >> "$OUT/sections"
        done ) &
    done
    wait ;;
  i18-tests)
    timeout 580 python3 -m pytest -q -m cuda -p no:logging -p no:cacheprovider tests ;;
  i18c-tests)
    timeout 400 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_swap.py tests/test_experiment.py \
      tests/test_backends.py tests/test_peak_calibration.py tests/test_swap_graphs.py ;;
  i38-ooc)
    timeout 250 python3 bench/out_of_core_profile.py compare --config examples/bert.yaml --batch-size 32 \
      --out "$OUT/ooc_compare_bert_b32.json"
    timeout 280 python3 bench/out_of_core_profile.py capped --config examples/bert.yaml --batch-size 64 \
      --memory-limit 24GiB --budget 14426MiB --out "$OUT/capped_bert_b64.json"
    timeout 200 python3 bench/out_of_core_profile.py capped --config examples/bert.yaml --batch-size 64 \
      --memory-limit 79GiB --budget 14426MiB --passes "profile{out_of_core=false},optimizer,select,rewrite" \
      --out "$OUT/uncapped_bert_b64.json" ;;
  i38-tests)
    timeout 400 python3 -m pytest -q -m cuda -p no:logging -p no:cacheprovider tests ;;
  i38-held-bert|i38-held-llama|i38-held-resnet|i38-held-*-capped|i38-held-*-uncapped)
    # Issue 38's "Done when": each model under its cap with the budget at the cap, and the same
    # budget uncapped (profiled in memory), both inductor-cudagraphs and mutwo's default pipeline
    # (the uncapped one with its profile forced in memory), calibrated by default, 50 steps.
    # A -capped or -uncapped suffix (i38-held-resnet-capped) runs that variant alone, so that
    # PARALLEL can put a model's two variants on two GPUs.
    variants=${HELD_VARIANTS:-capped uncapped}
    case $section in *-uncapped) variants=uncapped ;; *-capped) variants=capped ;; esac
    case $section in
      *bert*) config=examples/bert.yaml; batch=64; cap=16GiB; stem=bert_b64 ;;
      *llama*) config=examples/llama_0_5b.yaml; batch=8; cap=12GiB; stem=llama_0_5b_b8 ;;
      *resnet*) config=examples/resnet152_channels_last.yaml; batch=128; cap=12GiB; stem=resnet152_cl_b128 ;;
    esac
    # Each process compiles from an empty Inductor cache, so that planning times compare.
    # HELD_VARIANTS=capped measures the capped row alone.
    case " $variants " in *" capped "*)
      TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 1500 python3 bench/out_of_core_profile.py capped --config $config \
        --batch-size $batch --memory-limit $cap --budget $cap --backend inductor-cudagraphs --steps 50 \
        --out "$OUT/held_capped_$stem.json" ;; esac
    case " $variants " in *" uncapped "*)
      TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 1500 python3 bench/out_of_core_profile.py capped --config $config \
        --batch-size $batch --memory-limit 79GiB --budget $cap --backend inductor-cudagraphs --steps 50 \
        --passes "profile{out_of_core=false},optimizer,chunk,select,rewrite" --out "$OUT/held_uncapped_$stem.json" ;; esac ;;
  headline-gpt2|headline-bert|headline-resnet)
    # Issue 41's headline table: eager, per-block checkpointing, torch.compile at activation budget
    # 0.5, mutwo's captured step without recompute (cudagraphs, its profile), then mutwo
    # inductor-cudagraphs at what checkpointing held and at what torch.compile held (planned side by
    # side, calibrated to what the process holds); held = max reserved over 10 steady steps, each
    # variant a fresh process. Then the plain loop (bench/plain_loop.py) of eager and
    # checkpointing, the yardstick the harness's rows must agree with.
    case $section in
      *gpt2) model=gpt2:8; config=examples/gpt2.yaml; batch=8; stem=gpt2_b8 ;;
      *bert) model=bert:64; config=examples/bert.yaml; batch=64; stem=bert_b64 ;;
      *resnet) model=resnet152-cl:128; config=examples/resnet152_channels_last.yaml; batch=128; stem=resnet152_cl_b128 ;;
    esac
    g=inductor-cudagraphs
    timeout 2700 python3 bench/compare.py --out "$OUT/headline_$stem.json" --models "$model" --timeout 1500 \
      --parallel-planning 2 --calibrate-peak 1 \
      --variants eager,checkpoint,compile-0.5,mutwo@cudagraphs-none,mutwo@$g-checkpoint,mutwo@$g-compile0.5
    status=$?
    for variant in eager checkpoint; do
      timeout 300 python3 bench/plain_loop.py --config $config --batch-size $batch --variant $variant \
        --out "$OUT/plain_${stem}_$variant.json" > /dev/null
    done
    exit $status ;;
  headline-resnet-refs)
    # headline-resnet in two machine holds (a hold ends after 30 minutes; the whole section needs ~40):
    # first the reference rows and the plain loop beside them (~10 min), then headline-resnet-mutwo.
    timeout 1200 python3 bench/compare.py --out "$OUT/headline_resnet152_cl_b128_refs.json" \
      --models resnet152-cl:128 --timeout 600 --variants eager,checkpoint,compile-0.5
    status=$?
    for variant in eager checkpoint; do
      timeout 300 python3 bench/plain_loop.py --config examples/resnet152_channels_last.yaml --batch-size 128 \
        --variant $variant --out "$OUT/plain_resnet152_cl_b128_$variant.json" > /dev/null
    done
    exit $status ;;
  headline-resnet-mutwo)
    # The second hold: mutwo's unplanned row (its profile the planned rows reuse), then the two planned
    # rows side by side, their budgets what headline-resnet-refs' rows held (REFS: its JSON, kept in
    # the repo), each worker's planning sampled into $OUT/*.folded (bench/stack_sampler.py). ~25 min.
    g=inductor-cudagraphs
    timeout 1700 python3 bench/compare.py --out "$OUT/headline_resnet152_cl_b128_mutwo.json" --models resnet152-cl:128 \
      --timeout 1500 --reference "${REFS:?set REFS to headline-resnet-refs JSON}" --parallel-planning 2 \
      --calibrate-peak 1 --sample-stacks "$OUT" --variants mutwo@cudagraphs-none,mutwo@$g-checkpoint,mutwo@$g-compile0.5 ;;
  compile-sampled-resnet)
    # Where a whole-iteration compile of ResNet-152-cl b128 goes: mutwo.optimize without a budget
    # (one compile, no calibration) from an empty Inductor cache, its stacks sampled. ~8 min.
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 900 python3 bench/stock_optimizer_and_restart.py start \
      --config examples/resnet152_channels_last.yaml --batch-size 128 --backend inductor-cudagraphs \
      --sample-stacks "$OUT/compile_resnet152_cl_b128.folded" --out "$OUT/compile_resnet152_cl_b128.json"
    python3 bench/stack_sampler.py --top 120 "$OUT/compile_resnet152_cl_b128.folded" ;;
  i38-opt-bert|i38-opt-llama|i38-opt-resnet)
    # Issue 38 through the command line: mutwo-opt under --memory-limit at the same budget as
    # i38-held-*'s capped rows, inductor-cudagraphs, calibrated by default; summary.json has the
    # measured held bytes.
    case $section in
      *bert) config=examples/bert.yaml; batch=64; cap=16GiB; stem=bert_b64 ;;
      *llama) config=examples/llama_0_5b.yaml; batch=8; cap=12GiB; stem=llama_0_5b_b8 ;;
      *resnet) config=examples/resnet152_channels_last.yaml; batch=128; cap=12GiB; stem=resnet152_cl_b128 ;;
    esac
    start=$(date +%s)
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 1200 mutwo-opt $config --batch-size $batch \
      --memory-limit $cap --budget $cap --backend inductor-cudagraphs --cache-dir "$BG/plan-cache" -o "$BG/opt_$stem" \
      2> "$OUT/opt_$stem.log"
    status=$?; echo "mutwo-opt exit $status in $(( $(date +%s) - start )) s" | tee -a "$OUT/opt_$stem.log"
    cp "$BG/opt_$stem/summary.json" "$OUT/opt_${stem}_summary.json"; exit $status ;;
  i38-fix-tests)
    # The cuda-marked tests of the files whose CUDA tests failed in the fourteenth session's i38-tests.
    timeout 400 python3 -m pytest -q -m cuda -p no:logging -p no:cacheprovider tests/test_backends.py \
      tests/test_cuda.py tests/test_replay.py ;;
  i40-stock)
    # Issue 40 item 4: BERT-base b8 with the config's stock AdamW(lr=1e-4) and a LambdaLR under
    # inductor-cudagraphs against the eager loop of the same optimizer, 5 steps.
    timeout 500 python3 bench/stock_optimizer_and_restart.py stock --config examples/bert.yaml --batch-size 8 \
      --steps 5 --out "$OUT/stock_adamw_bert_b8.json" ;;
  i40-restart|i40-restart-sampled)
    # Issue 40 item 5: two fresh processes in a row, BERT-base b64 at budget 16GiB under a 16 GiB
    # limit, inductor-cudagraphs, one plan cache folder: the first plans (i38-opt-bert's entry is
    # for the YAML's pipeline, not the API's default one, so it does not apply) and compiles, the
    # second is a restart with both caches warm (~10 min in all on an H100). -sampled: the second's
    # optimize() sampled by bench/stack_sampler.py ($OUT/restart_bert_b64_second.folded), then
    # summarized (cProfile's call tree broke under torch's compile).
    for run in first second; do
      sample=()
      if [ $section = i40-restart-sampled ] && [ $run = second ]; then
        sample=(--sample-stacks "$OUT/restart_bert_b64_second.folded")
      fi
      timeout 900 python3 bench/stock_optimizer_and_restart.py start --config examples/bert.yaml --batch-size 64 \
        --budget 16GiB --memory-limit 16GiB --cache-dir "$BG/plan-cache" --out "$OUT/restart_bert_b64_$run.json" \
        "${sample[@]}" 2> "$OUT/restart_bert_b64_$run.log"
    done
    if [ $section = i40-restart-sampled ]; then
      python3 bench/stack_sampler.py "$OUT/restart_bert_b64_second.folded" --top 60
    fi ;;
  i40-restart-all)
    # Issue 40's restarts of all three models on one GPU in one machine hold: their first starts
    # (empty caches) side by side with tests-all, so their times are not first-start figures; then,
    # one process at a time, RESTART_RUNS (pyc1 pyc2) of each model in turn, 5 measured steps each.
    # ~15 min on an H200. $OUT: restart_pyc_STEM.json for each model, tests_all.out.
    # RESTART_TESTS=0 leaves tests-all out; RESTART_ORDER orders the restarts' models.
    script=$(realpath "$0")
    for model in resnet llama bert; do
      RESTART_MODELS=$model RESTART_RUNS=first RESTART_STEPS=2 bash "$script" i40-restart-models \
        > "$BG/first_$model.log" 2>&1 &
    done
    if [ "${RESTART_TESTS:-1}" = 1 ]; then
      bash "$script" tests-all > "$OUT/tests_all.out" 2>&1; echo "tests-all exit $?"; tail -3 "$OUT/tests_all.out"
    fi
    wait; for model in resnet llama bert; do tail -3 "$BG/first_$model.log"; done
    for model in ${RESTART_ORDER:-resnet llama bert}; do
      RESTART_MODELS=$model RESTART_RUNS=${RESTART_RUNS:-pyc1 pyc2} RESTART_STEPS=5 \
        bash "$script" i40-restart-models
    done ;;
  i40-restart-pyc|i40-restart-models)
    # Issue 40's restart: per model, fresh processes on one plan cache and one Inductor cache (empty
    # before the first), budget and cap as issue 38's rows (BERT-base b64 16GiB; the 0.5B Llama b8
    # and ResNet-152-cl b128 12GiB). The first plans and compiles, with Python's bytecode written
    # under $BG/pycache; then restarts: without bytecode ("plain"), as this machine's python3 runs
    # (PYTHONDONTWRITEBYTECODE=1, no .pyc for torch in its read-only site-packages: every process
    # compiles Inductor's source), and with it ("pyc"), as an installed torch runs (pip compiles
    # bytecode when it installs). Every start then trains 2 warm-up and 20 measured steps (time,
    # held memory, losses). i40-restart-pyc: BERT, three restarts of each kind, interleaved, ~8 min;
    # i40-restart-models: the Llama and ResNet, one of each kind, ~6 and ~12 min. RESTART_MODELS and
    # RESTART_RUNS name fewer; RESTART_SUFFIX ends the files' names (a run with another
    # PYTORCH_CUDA_ALLOC_CONF, which each start records). A run named sampled* is a "pyc" restart
    # whose optimize() is sampled by bench/stack_sampler.py ($OUT/restart_STEM_RUN.folded, summarized);
    # one named asbefore* a "pyc" restart with Python's garbage collector as it runs
    # (--collector-as-before: the A/B of mutwo.runtime.planning.collector); one named recordfirst* a
    # "pyc" restart whose step records at its first call, after a warm-up (--record-at-first-call: the
    # A/B of the training loop's unrecorded first call). RESTART_STEPS: measured
    # steps after each start's first (20); RESTART_ARGS: more options for every start (--aot-key-lines:
    # each AOTAutograd key computed, with its per-component lines, to find what differs when a restart
    # misses the key a first start stored). A run named budgetN starts at N GiB (under the same cap):
    # a plan-cache miss that reuses the profile the first start kept (issue 40).
    python3 -c "import os, torch._inductor.compile_fx as m; print('bytecode', m.__cached__, os.path.exists(m.__cached__), \
      'writable', os.access(os.path.dirname(m.__cached__), os.W_OK), 'PYTHONDONTWRITEBYTECODE', os.environ.get('PYTHONDONTWRITEBYTECODE'))"
    case $section in
      *pyc) models=${RESTART_MODELS:-bert}; runs=${RESTART_RUNS:-first plain1 pyc1 plain2 pyc2 plain3 pyc3} ;;
      *) models=${RESTART_MODELS:-llama resnet}; runs=${RESTART_RUNS:-first pyc1 plain1} ;;
    esac
    for model in $models; do
      case $model in
        bert) config=examples/bert.yaml; batch=64; cap=16GiB; stem=bert_b64 ;;
        llama) config=examples/llama_0_5b.yaml; batch=8; cap=12GiB; stem=llama_0_5b_b8 ;;
        resnet) config=examples/resnet152_channels_last.yaml; batch=128; cap=12GiB; stem=resnet152_cl_b128 ;;
      esac
      case " $runs " in  # a first start starts from nothing (a run before may have had another suffix)
        *" first "*) rm -rf "$BG/restart_$model" "$BG/plan-cache-$model" "$BG/inductor_$model" ;;
      esac
      mkdir -p "$BG/restart_$model"
      for run in $runs; do
        prefix=(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$BG/pycache); [ ${run#plain} != $run ] && prefix=(env)
        sample=(); [ ${run#sampled} != $run ] && sample=(--sample-stacks "$OUT/restart_${stem}_$run.folded")
        [ ${run#asbefore} != $run ] && sample=(--collector-as-before)
        [ ${run#recordfirst} != $run ] && sample=(--record-at-first-call)
        [ ${run#budget} != $run ] && sample=(--budget "${run#budget}GiB")
        "${prefix[@]}" TORCHINDUCTOR_CACHE_DIR=$BG/inductor_$model timeout 1200 python3 bench/stock_optimizer_and_restart.py \
          start --config $config --batch-size $batch --budget $cap --memory-limit $cap --measure-steps ${RESTART_STEPS:-20} \
          --cache-dir "$BG/plan-cache-$model" --out "$BG/restart_$model/$run.json" "${sample[@]}" ${RESTART_ARGS:-} \
          2> "$BG/restart_$model/$run.err"
        echo "$model $run exit $?"; grep -E "peak calibration|took" "$BG/restart_$model/$run.err" | tail -12
        tail -2 "$BG/restart_$model/$run.err"
        if [ ${run#sampled} != $run ]; then python3 bench/stack_sampler.py "${sample[1]}" --top 80; fi
      done
      # $OUT takes 8 files: each model's runs' JSON in one
      python3 -c "import json, sys; print(json.dumps({p: json.load(open(p)) for p in sys.argv[1:]}, indent=1))" \
        "$BG"/restart_$model/*.json > "$OUT/restart_pyc_$stem${RESTART_SUFFIX:-}.json"
    done ;;
  resnet-ckpt-probe|resnet-eager-probe)
    # Issue 41: does the harness time ResNet-152-cl b128 as the plain loop does? Both interleaved on
    # one machine, PROBE_ROUNDS rounds (3) of 30 measured steps each, ~6 min. The checkpointed step
    # is bound by the host's launches: its rounds' medians moved by +-7% (session24_gpus/, means
    # 0.5% apart); resnet-eager-probe does the same for eager (3.3% apart in session 22, one pair).
    case $section in *ckpt*) variant=checkpoint; stem=ckpt ;; *) variant=eager; stem=eager ;; esac
    mkdir -p "$OUT/probe_$stem"
    for round in $(seq ${PROBE_ROUNDS:-3}); do
      timeout 300 python3 bench/compare.py --out "$OUT/probe_$stem/harness_$round.json" --models resnet152-cl:128 \
        --timeout 280 --variants $variant --iterations 30 > /dev/null
      timeout 300 python3 bench/plain_loop.py --config examples/resnet152_channels_last.yaml --batch-size 128 \
        --variant $variant --steps 30 --out "$OUT/probe_$stem/plain_$round.json" > /dev/null
    done
    # $OUT takes 8 files: the rounds' JSON in one
    python3 -c "import json, sys; print(json.dumps({p: json.load(open(p)) for p in sys.argv[1:]}, indent=1))" \
      "$OUT"/probe_$stem/*.json > "$OUT/probe_${stem}_resnet152_cl_b128.json" ;;
  pool-excess)
    # Issues 38 and 42: a CUDA graph's pool holds 1.0-2.8 GiB over what the plan allocates (BERT-base
    # DDP, the FSDP2 Llama, ResNet-152; not record_stream's blocks: session26_gpus/), and
    # calibration pays for it in recompute. Does the pool hold less with expandable segments, or
    # with Inductor's static memory planning (one pool of buffers laid out at compile time)?
    # GPT-2 small b8 at checkpointing's held memory, calibrated once, each setting a fresh
    # process; the rounds' planned, allocated and held bytes are in each JSON. ~12 min.
    # Measured at c64eb24 (session27_gpus/): 576, 99 and 262 MiB over the allocation; since then
    # compare.py gives every variant expandable segments unless --allocator default.
    for setting in default expandable memory_planning; do
      case $setting in
        expandable) allocator=expandable ;;
        *) allocator=default ;;
      esac
      [ $setting = memory_planning ] && export TORCHINDUCTOR_MEMORY_PLANNING=1
      timeout 900 python3 bench/compare.py --out "$OUT/pool_excess_gpt2_b8_$setting.json" --models gpt2:8 \
        --timeout 800 --calibrate-peak 1 --allocator $allocator --variants checkpoint,mutwo@inductor-cudagraphs-checkpoint
      echo "$setting exit $?"
    done ;;
  held-excess)
    # Issue 38: BERT-base b64's calibration rounds held 1.3 GiB over their allocation under a 16 GiB
    # cap and 0.5 GiB uncapped (session28_gpus/); the first plan under the cap ran out of memory.
    # bench/held_excess_probe.py summarises the allocator's pools at the end of every round, capped
    # and uncapped (the uncapped profile in memory, as i38-held-bert). ~5 and ~2 min.
    timeout 600 python3 bench/held_excess_probe.py --config examples/bert.yaml --batch-size 64 --memory-limit 16GiB \
      --budget 16GiB --backend inductor-cudagraphs --steps 10 --out "$OUT/held_excess_capped_bert_b64.json"
    echo "capped exit $?"
    timeout 400 python3 bench/held_excess_probe.py --config examples/bert.yaml --batch-size 64 --memory-limit 79GiB \
      --budget 16GiB --backend inductor-cudagraphs --steps 10 --passes "profile{out_of_core=false},optimizer,chunk,select,rewrite" \
      --out "$OUT/held_excess_uncapped_bert_b64.json"
    echo "uncapped exit $?" ;;
  dp-record-stream-reuse)
    # Issue 42: mutwo's data-parallel steps under CUDA graphs held 1.4-2.8 GiB over what their
    # replays allocate, and not in the order of their plans (session24_gpus/). While a CUDA graph
    # records, a block that NCCL's stream used (record_stream) is not handed out again until the
    # recording ends (other projects measured the same: Megatron-LM#4383, nixl#2149); torch's
    # allocator can reuse such blocks during a capture when asked. dp-two-gpus' runs (DP_RUNS, BERT
    # by default) with that setting, beside the rows measured without it. ~8 min for BERT.
    PYTORCH_CUDA_ALLOC_CONF=graph_capture_record_stream_reuse:True DP_SUFFIX=_record_stream_reuse DP_TESTS="" \
      DP_RUNS=${DP_RUNS:-bert} bash "$(realpath "$0")" dp-two-gpus ;;
  dp-two-gpus)
    # Issue 42 on two GPUs (run it on nvidia-h100-x2): the cuda tests of FSDP2, DDP and compiled
    # DDP, each file under a timeout of its own (verbose, so a hang shows where; DP_TESTS names
    # fewer); then bench/data_parallel.py, mutwo under inductor-cudagraphs calibrated once over the
    # ranks: FSDP2's comparison (the 0.5B Llama: eager FSDP2 with and without per-layer
    # checkpointing, mutwo at checkpointing's held memory), BERT-base 16 per GPU and ResNet-152-cl
    # 64 per GPU at half of eager DDP's held memory. Each JSON is rewritten after every row. Every
    # variant runs with expandable segments (data_parallel.py --allocator; session27_gpus/ set them
    # by PYTORCH_CUDA_ALLOC_CONF).
    # DP_TESTS="" skips the tests; DP_RUNS names fewer of fsdp2, bert and resnet; DP_SUFFIX ends
    # the files' names.
    for t in ${DP_TESTS-tests/test_fully_sharded.py:240 tests/test_distributed.py:150 tests/test_distributed_compiled.py:240}; do
      timeout ${t##*:} python3 -m pytest -v -m cuda -p no:cacheprovider ${t%%:*} > "$OUT/two_gpu_$(basename ${t%%:*} .py).log" 2>&1
      echo "${t%%:*} exit $?"
    done
    export NCCL_NVLS_ENABLE=0
    dp="torchrun --nproc-per-node 2 bench/data_parallel.py --calibrate-peak 1"
    runs=" ${DP_RUNS:-fsdp2 bert resnet} "
    if [[ $runs == *" fsdp2 "* ]]; then
      timeout 900 $dp --sharding fsdp2 --out "$OUT/fsdp2_llama_two_gpus${DP_SUFFIX:-}.json" > "$OUT/fsdp2_llama_two_gpus${DP_SUFFIX:-}.log" 2>&1
      echo "fsdp2 exit $?"
    fi
    if [[ $runs == *" bert "* ]]; then
      timeout 900 $dp --models bert:16:0.5 --out "$OUT/ddp_bert_two_gpus${DP_SUFFIX:-}.json" > "$OUT/ddp_bert_two_gpus${DP_SUFFIX:-}.log" 2>&1
      echo "bert exit $?"
    fi
    if [[ $runs == *" resnet "* ]]; then
      timeout 1200 $dp --models resnet152-cl:64:0.5 --out "$OUT/ddp_resnet_two_gpus${DP_SUFFIX:-}.json" > "$OUT/ddp_resnet_two_gpus${DP_SUFFIX:-}.log" 2>&1
      echo "resnet exit $?"
    fi ;;
  i39-chunk-tests)
    # The chunk pass's CPU tests under the GPU machine's torch (2.11 captures what 2.14 keeps as an
    # alias as a detach), then the 32k-vocabulary Llama example sliced and checked on the GPU.
    timeout 400 python3 -m pytest -q -p no:logging -p no:cacheprovider tests/test_chunk.py
    timeout 300 mutwo-opt examples/llama_32k.yaml --device cuda --budget 0.5 --check --out "$BG/llama_32k" \
      > "$OUT/chunk_llama_32k_cuda.log" 2>&1; echo "mutwo-opt exit $?" ;;
  i39-chunk-memory)
    # The sliced 32k-vocabulary Llama at half its peak, measured under each backend (no
    # calibration): the planned peak against what the step allocated and held.
    for b in eager inductor inductor-cudagraphs; do
      timeout 300 mutwo-opt examples/llama_32k.yaml --device cuda --budget 0.5 --backend $b --calibrate-peak 0 \
        --out "$BG/llama_32k_$b" > "$OUT/chunk_llama_32k_$b.log" 2>&1; echo "$b exit $?"
      cp "$BG/llama_32k_$b/summary.json" "$OUT/chunk_llama_32k_$b.json"
    done ;;
  i39-output-code)
    # Where the sliced 32k-vocabulary Llama's Inductor step allocates more than simulated (eager
    # matched, Inductor +14%, inductor-cudagraphs +27%): the generated code of its step, read offline.
    TORCH_LOGS="output_code" timeout 300 mutwo-opt examples/llama_32k.yaml --device cuda --budget 0.5 \
      --backend inductor --calibrate-peak 0 --no-cache --print-ir-after rewrite --out "$BG/llama_32k_code" \
      > "$BG/llama_32k_code.full" 2>&1
    echo "exit $?"; gzip -c "$BG/llama_32k_code.full" > "$OUT/llama_32k_inductor_output_code.log.gz"
    cp "$BG/llama_32k_code/final.ir.txt" "$OUT/llama_32k_final_ir.txt" ;;
  i39-output-code-bert)
    # Where BERT-base b64's sliced Inductor step holds more than simulated (every calibration round
    # measured 2.4-4.1 GiB over its simulation, after 5f3f5e6 too): the generated code of the
    # step planned at per-layer checkpointing's held memory, uncalibrated, read offline.
    TORCH_LOGS="output_code" timeout 500 mutwo-opt examples/bert.yaml --device cuda --batch-size 64 \
      --budget 17206MiB --backend inductor --calibrate-peak 0 --no-cache --print-ir-after rewrite \
      -p "profile,optimizer,chunk,select,rewrite" \
      --out "$BG/bert_code" > "$BG/bert_code.full" 2>&1
    echo "exit $?"; gzip -c "$BG/bert_code.full" > "$OUT/bert_b64_inductor_output_code.log.gz"
    cp "$BG/bert_code/summary.json" "$OUT/bert_b64_inductor_summary.json"
    gzip -c "$BG/bert_code/final.ir.txt" > "$OUT/bert_b64_final_ir.txt.gz" ;;
  i40-aot-cache)
    # Whether a restart's compile hits AOTAutograd's cache (the sampled restart re-traced the whole
    # step in AOTAutograd, ~13 s, and hit only Inductor's FX graph cache): BERT-base b8, no budget
    # (or AOT_BATCH, AOT_BUDGET under a cap at the budget), two processes, the cache's log lines
    # kept (hit, miss, bypass and why) and each compile's key components.
    batch=${AOT_BATCH:-8}; budget=${AOT_BUDGET:+--budget $AOT_BUDGET --memory-limit $AOT_BUDGET}
    for run in 1 2; do
      TORCH_LOGS="+torch._functorch._aot_autograd.autograd_cache" timeout 900 python3 bench/stock_optimizer_and_restart.py \
        start --config examples/bert.yaml --batch-size $batch $budget --cache-dir "$BG/plan-cache-aot" \
        --out "$OUT/aot_cache_$run.json" > "$BG/aot_cache_$run.full" 2>&1
      grep -a -i "bypass\|cache hit\|cache miss\|saved\|unsupported\|took" "$BG/aot_cache_$run.full" \
        | grep -av "autograd_cache.py:904" | cut -c1-800 > "$OUT/aot_cache_$run.log"
      grep -a "autograd_cache.py:904\] \[" "$BG/aot_cache_$run.full" | cut -c1-400 > "$OUT/aot_cache_key_$run.log"
    done ;;
  i39-memory-trace)
    # The sliced 32k-vocabulary Llama at half its peak, eager, node by node: where what it
    # allocates leaves the simulation (eager measured 340 MiB against 261 MiB simulated).
    timeout 400 python3 bench/memory_trace.py --config examples/llama_32k.yaml --batch-size 8 --budget 0.5 \
      --out "$OUT/memory_trace_llama_32k.json" ;;
  i39-cost-bert)
    # chunk{when=cost} (the default since f8d031d) against chunk{when=budget}: BERT-base b64 at what
    # per-block checkpointing held (17,206 MiB, headline-bert), inductor-cudagraphs, calibrated
    # (mutwo.optimize's default); each pipeline planned and trained in a fresh process
    # (bench/pipeline_timing.py), its log in $OUT/cost_bert_b64_N.log. ~5 min each. COST_ONLY=1:
    # the chunk{when=cost} pipeline alone.
    default=(--passes "profile,optimizer,chunk{when=budget},select,rewrite"); [ -n "${COST_ONLY:-}" ] && default=()
    timeout 1800 python3 bench/pipeline_timing.py --config examples/bert.yaml --batch-size 64 --budget 17206MiB \
      --backend inductor-cudagraphs --warmup 2 --steps 10 "${default[@]}" \
      --passes "profile,optimizer,chunk{when=cost},select,rewrite" --out "$OUT/cost_bert_b64.json" ;;
  i39-cost-gpt2)
    # Issue 39's second model: GPT-2 small s1024 b8 at what per-layer checkpointing held (7,816 MiB,
    # headline-gpt2), inductor-cudagraphs, calibrated; chunk{when=cost} (the default) against
    # chunk{when=budget}, each in a fresh process (bench/pipeline_timing.py). ~5 min each. COST_ONLY=1:
    # the chunk{when=cost} pipeline alone.
    default=(--passes "profile,optimizer,chunk{when=budget},select,rewrite"); [ -n "${COST_ONLY:-}" ] && default=()
    timeout 1800 python3 bench/pipeline_timing.py --config examples/gpt2.yaml --batch-size 8 --budget 7816MiB \
      --backend inductor-cudagraphs --warmup 2 --steps 10 "${default[@]}" \
      --passes "profile,optimizer,chunk{when=cost},select,rewrite" --out "$OUT/cost_gpt2_b8.json" ;;
  i39-floor-bert)
    # BERT-base b64's lowest held memory (issue 39: at most 25% of eager's 32,305 MiB): the default
    # pipeline (chunk slices the head at min) at budget min, under FLOOR_BACKEND (default eager).
    timeout 900 python3 bench/pipeline_timing.py --config examples/bert.yaml --batch-size 64 --budget min \
      --backend "${FLOOR_BACKEND:-eager}" --warmup 2 --steps 10 --passes "profile,optimizer,chunk,select,rewrite" \
      --out "$OUT/floor_bert_b64_${FLOOR_BACKEND:-eager}.json" ;;
  i18d-tests)
    timeout 400 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_backends.py tests/test_experiment.py \
      tests/test_plan_choice.py tests/test_cuda_swap.py ;;
  i18c-resnet|i18c-bert|i18d-resnet|i18d-bert)
    # ResNet's compiled peaks were within 3% of plan (one re-plan at most); BERT's 11-29% under (two)
    run=${section%%-*}; case $section in *resnet) model=resnet152-cl:128; stem=${run}_resnet152_cl; rounds=1 ;;
      *) model=bert:64; stem=${run}_bert_b64; rounds=2 ;; esac
    g=inductor-cudagraphs
    # i18d also measures the unplanned step compiled (the anchor of the predictions), a fifth process
    if [ "$run" = i18d ]; then anchor=mutwo@$g-none,; parallel=5; else anchor=; parallel=4; fi
    timeout 2400 python3 bench/compare.py --out "$OUT/$stem.json" --models "$model" --timeout 1500 \
      --parallel-planning $parallel --calibrate-peak $rounds --measure-choice \
      --variants eager,checkpoint,mutwo@cudagraphs-none,${anchor}mutwo@$g-eager0.5,mutwo-swap@$g-eager0.5,mutwo@$g-checkpoint,mutwo-swap@$g-checkpoint ;;
  i18-resnet|i18-bert)
    if [ "$section" = i18-resnet ]; then model=resnet152-cl:128; stem=i18_resnet152_cl; else model=bert:64; stem=i18_bert_b64; fi
    g=inductor-cudagraphs
    timeout 1500 python3 bench/compare.py --out "$OUT/$stem.json" --models "$model" --timeout 900 --parallel-planning 4 \
      --variants eager,checkpoint,mutwo@cudagraphs-none,mutwo@$g-eager0.5,mutwo-swap@$g-eager0.5,mutwo@$g-checkpoint,mutwo-swap@$g-checkpoint ;;
  cl-cudagraphs)
    timeout 1700 python3 bench/compare.py --out "$OUT/cl_cudagraphs_resnet152.json" --models resnet152-cl:128 \
      --timeout 600 --variants eager,compile-0.5,mutwo@inductor-cudagraphs-compile0.5,mutwo@inductor-cudagraphs-eager0.5,compile@reduce-overhead-0.5 ;;
  cl-compile05-trace)
    timeout 1700 python3 bench/compare.py --out "$OUT/cl_compile05_trace_resnet152.json" --models resnet152-cl:128 \
      --timeout 600 --trace --variants eager,compile-0.5,mutwo@inductor-compile0.5,compile-1.0,mutwo@inductor-none
    status=$?; python3 bench/kernel_summary_probe.py "$OUT/cl_compile05_trace_resnet152/*.trace.json.gz" \
      "$OUT/kernels_cl_compile05_resnet152.json"; exit $status ;;
  tests-all)
    timeout 580 python3 -m pytest -q -m cuda -p no:logging -p no:cacheprovider tests ;;
  tests-training)
    # The training loop's CUDA tests (deferred recording, accumulation under CUDA graphs, held memory)
    timeout 580 python3 -m pytest -q -m cuda -p no:logging -p no:cacheprovider tests/test_training_cuda.py \
      tests/test_cuda_held_memory.py tests/test_cuda_graph_optimizer.py ;;
  tests-swap)
    timeout 580 python3 -m pytest -q -m cuda -p no:logging -p no:cacheprovider tests/test_cuda_swap.py \
      tests/test_copy_contention.py ;;
  cl-half-swap-contention)
    timeout 1200 python3 bench/compare.py --out "$OUT/cl_half_swap_contention_resnet152.json" \
      --models resnet152-cl:128 --timeout 850 --variants eager,mutwo-swap@inductor-eager0.5 ;;
  swap-options-bert)
    timeout 1150 python3 bench/swap_options.py --out "$OUT/swap_options_bert.json" --model bert:64 \
      --budget 22425894912 --options ';contention=0.05;contention=0.02' --compile 3 ;;
  tests)
    timeout 540 python3 -m pytest -q -m cuda -p no:logging -p no:cacheprovider \
      tests/test_stream_trace.py tests/test_fit.py tests/test_cuda.py tests/test_cuda_swap.py tests/test_backends.py ;;
  opt)
    timeout 1500 python3 bench/compare.py --out "$OUT/opt_gpt2_bert.json" --models gpt2:4,gpt2:8,bert:32,bert:64 \
      --timeout 150 --variants eager,checkpoint,mutwo-none,mutwo-checkpoint,mutwo+opt-none,mutwo+opt-checkpoint ;;
  fit-resnet)
    timeout 580 mutwo-opt examples/resnet152.yaml --fit 16GiB --batch-size 64 -o "$OUT/fit_resnet152" \
      2> "$OUT/fit_resnet152.log"; status=$?; tail -3 "$OUT/fit_resnet152.log"; exit $status ;;
  fit-alloc)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 mutwo-opt examples/bert.yaml --fit 16GiB \
      --batch-size 8 -o "$OUT/fit_bert_expandable" 2> "$OUT/fit_bert_expandable.log"; first=$?
    tail -3 "$OUT/fit_bert_expandable.log"
    timeout 240 mutwo-opt examples/bert.yaml --fit 16GiB --batch-size 8 -o "$OUT/fit_bert" 2> "$OUT/fit_bert.log"
    second=$?; tail -3 "$OUT/fit_bert.log"; exit $(( first || second )) ;;
  swap-resnet)
    swap_study resnet152:128 swap_resnet152_b128 ;;
  swap-bert)
    swap_study bert:64 swap_bert_b64 ;;
  backends)
    timeout 900 python3 bench/compare.py --out "$OUT/backends_resnet152_b32.json" --models resnet152:32 \
      --variants eager,mutwo-none,mutwo@cudagraphs-none,mutwo@inductor-cudagraphs-none --timeout 560 ;;
  inductor) inductor_rows resnet152_bert resnet152:128,bert:64 ;;
  inductor-calibrated)
    timeout 2000 python3 bench/compare.py --out "$OUT/inductor_calibrated_bert.json" --models bert:64 --timeout 950 \
      --calibrate-peak 2 --variants mutwo@inductor-compile0.5,mutwo@inductor-checkpoint \
      --reference bench/results/issue17_h100/inductor_bert_b64.json ;;
  inductor-resnet) inductor_rows resnet152 resnet152:128 ;;
  inductor-cl) inductor_rows resnet152_cl resnet152-cl:128 ;;
  inductor-cl-mutwo)
    timeout 900 python3 bench/compare.py --out "$OUT/inductor_cl_mutwo_resnet152.json" --models resnet152-cl:128 \
      --timeout 850 --variants mutwo@inductor-compile0.5 --reference bench/results/issue17_h100_cl/inductor_resnet152_cl.json ;;
  swap-inductor-cl-half-swap)
    timeout 900 python3 bench/compare.py --out "$OUT/swap_inductor_cl_half_swap_resnet152.json" --models resnet152-cl:128 \
      --timeout 850 --variants mutwo-swap@inductor-eager0.5 --reference bench/results/issue17_h100_cl/inductor_resnet152_cl.json ;;
  swap-trace)
    timeout 1700 python3 bench/compare.py --out "$OUT/swap_trace_cl_half_resnet152.json" --models resnet152-cl:128 \
      --timeout 850 --trace --variants mutwo@inductor-eager0.5,mutwo-swap@inductor-eager0.5 \
      --reference bench/results/issue17_h100_cl/inductor_resnet152_cl.json ;;
  fused-ab)
    timeout 1200 python3 bench/fused_pricing_ab.py --out "$OUT/fused_pricing_ab_resnet152_cl.json" --model resnet152-cl:128 \
      --budget-bytes 15766076416 --configs eager-priced,eager-priced+decomposed,fused+decomposed --timeout 500 ;;
  inductor-cl-half)
    timeout 900 python3 bench/compare.py --out "$OUT/inductor_cl_half_resnet152.json" --models resnet152-cl:128 \
      --timeout 850 --variants mutwo@inductor-eager0.5 --reference bench/results/issue17_h100_cl/inductor_resnet152_cl.json ;;
  inductor-calibrated-checkpoint)
    timeout 1200 python3 bench/compare.py --out "$OUT/inductor_calibrated_bert_checkpoint.json" --models bert:64 \
      --timeout 1150 --calibrate-peak 2 --variants mutwo@inductor-checkpoint \
      --reference bench/results/issue17_h100/inductor_bert_b64.json ;;
  swap-inductor-cl-half)
    timeout 1500 python3 bench/compare.py --out "$OUT/swap_inductor_cl_half_resnet152.json" --models resnet152-cl:128 \
      --timeout 850 --variants mutwo@inductor-eager0.5,mutwo-swap@inductor-eager0.5 \
      --reference bench/results/issue17_h100_cl/inductor_resnet152_cl.json ;;
  swap-inductor-bert)
    timeout 2000 python3 bench/compare.py --out "$OUT/swap_inductor_bert_b64.json" --models bert:64 --timeout 950 \
      --calibrate-peak 2 --variants mutwo@inductor-checkpoint,mutwo-swap@inductor-checkpoint \
      --reference bench/results/issue17_h100/inductor_bert_b64.json ;;
  swap-inductor-bert-swap)
    timeout 1200 python3 bench/compare.py --out "$OUT/swap_inductor_bert_b64_swap.json" --models bert:64 --timeout 1150 \
      --calibrate-peak 2 --variants mutwo-swap@inductor-checkpoint \
      --reference bench/results/issue17_h100/inductor_bert_b64.json ;;
  bert-cal3)
    timeout 1500 python3 bench/compare.py --out "$OUT/bert_cal3_b64.json" --models bert:64 --timeout 1150 \
      --calibrate-peak 3 --variants checkpoint,mutwo-swap@inductor-checkpoint ;;
  cl-half-same-run)
    timeout 1800 python3 bench/compare.py --out "$OUT/cl_half_same_run_resnet152.json" --models resnet152-cl:128 \
      --timeout 850 --variants eager,mutwo@inductor-eager0.5,mutwo-swap@inductor-eager0.5 ;;
  plan-attribution)
    timeout 580 python3 bench/plan_stability.py --out "$OUT/plan_attribution_resnet152_cl.json" --model resnet152-cl:128 \
      --budget 11825791744 --profiles 3 --inductor 0 --attribute --iterations 5 ;;
  plan-attribution-steadier)
    status=0
    for options in runs=7 isolate=true; do
      timeout 280 python3 bench/plan_stability.py --out "$OUT/plan_attribution_resnet152_cl_${options%%=*}.json" \
        --model resnet152-cl:128 --budget 11825791744 --profiles 3 --inductor 0 --attribute --iterations 5 \
        --profile-options "$options" > "$BG-$options.log" 2>&1 || status=$?
      grep -v Warn "$BG-$options.log" | tail -9
    done; exit $status ;;
  cl-half-isolate)
    timeout 570 python3 bench/compare.py --out "$OUT/cl_half_isolate_resnet152.json" --models resnet152-cl:128 \
      --timeout 480 --isolate-profile --variants eager,mutwo@inductor-eager0.5 ;;
  plan-stability)
    timeout 900 python3 bench/plan_stability.py --out "$OUT/plan_stability_resnet152_cl.json" --model resnet152-cl:128 \
      --budget 11825791744 --profiles 3 --inductor 2; first=$?
    timeout 600 python3 bench/plan_stability.py --out "$OUT/plan_stability_bert.json" --model bert:64 \
      --budget 19128349184 --profiles 3 --inductor 1; exit $(( first || $? )) ;;
  inductor-bert) inductor_rows bert bert:64 ;;
  *)
    echo "h100_campaign.sh: unknown section '$section'; see the list at the top of this file" >&2
    exit 2 ;;
esac
