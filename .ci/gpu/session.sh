#!/usr/bin/env bash
# The device calls of one GPU recording session, each under the device tool's 10-minute limit
# (run in the repo root, $OUT given, `.carry/minilm` carried: `dora-num record carry .carry/minilm`).
#
#   smoke  every GPU entry point at small sizes, in parallel (exhaustive checks, trained-adapter
#          runs, model-level suite, GPU suite), and all gpu-marked tests (4 workers); then, alone on
#          the GPU, the cancellation guard's cost (a timing).                 -> $OUT/session_smoke.tgz
#   train  the trained-adapter runs of notebook 01 (13 processes, one deadline; the launcher
#          packs its own output: at most 8 files)                             -> $OUT/part-K.tar, plan.json, ...
#   bench  the model-level suite (timings: alone on the GPU), then the exhaustive checks with the
#          time left                                                         -> $OUT/session_bench.tgz
#   final  at the commit to be resolved: all gpu-marked tests beside the exhaustive checks (a
#          correctness record: its timings are not claims), then alone on the GPU the guard's cost
#          and the model-level suite with the time left                      -> $OUT/session_final.tgz
#   compiled the compile-native operator's device probe (.ci/gpu/compile_probe.py) and the gpu tests of the
#          operator and the PEFT paths (the compiled model rows: the matrix call)
#                                                                            -> $OUT/session_compiled.tgz
#   operator the compile probe ($PROBE_SECTIONS), the gpu tests of $PYTEST_FILES (failures printed as they come),
#          then the products recorder's $PRODUCTS_ONLY parts (default: tf32 bf16_base)
#                                                                            -> $OUT/session_operator.tgz
#   verify the gpu-marked tests of $VERIFY_TESTS (default: all), then the guard's cost
#                                                                            -> $OUT/session_verify.tgz
#   timing the kernel tile sweep, then the compiled profile (.ci/gpu/compiled_profile.py), alone on the GPU
#                                                                            -> $OUT/session_timing.tgz
#   wave   seed $CONV_SEEDS's same-batch wave (3 replicates), the deep-stack study and the memory holdout
#          beside all gpu-marked tests (a correctness record: its timings are not claims)
#                                                                            -> $OUT/session_wave.tgz
#   bundle the wave, then the tile sweep alone with the time left             -> $OUT/session_bundle.tgz
#   cards  on the card lent: all gpu-marked tests, beside them the accumulation probe at the operator's
#          shapes (this card's own record), the memory holdout and the collapse seeds' smoke plan (a
#          correctness record: no timing claims)                              -> $OUT/session_cards.tgz
#   seed   the collapse seeds' grid for seed $SEED (11 runs, one process each, deadline $SEED_WALL_S,
#          default 500 s), $SIDE beside it (probe or pytest, below), then AFTER=dorafactors alone  -> $OUT/seeds/part-K.tar, ..., session_seedK.tgz
#   probe  the card's accumulation probe at the operator's shapes, beside it the memory holdout and the gpu tests
#          of $PYTEST_FILES (default: the kit's and the flag's; correctness records: no timing claims), then alone
#          the norm's time by rank and the tail both ways of OpConfig.tail_bg (.ci/gpu/norm_rank_profile.py, a
#          diagnostic); with PROBE_HOST=1 then the compiled step's host time and profile (compile_probe.py host)
#                                                                            -> $OUT/session_probe.tgz
#   speed  the suite's timed sections $SUITE_ONLY (default: compose norm layer), alone on the GPU: a second
#          session's record of the speed targets                             -> $OUT/session_speed.tgz
#   matrix part $PART (1 or 2) of the model matrix: plain LoRA, PEFT's DoRA and this operator, eager / compile /
#          reduce-overhead, training with and without checkpointing and inference, alone on the GPU; with
#          $AFTER_PYTEST_S, every gpu-marked test after it
#                                                                            -> $OUT/session_matrix$PART.tgz
#   samebatch a convergence wave at one commit: per seed of $CONV_SEEDS (no default: one seed a call) eager,
#          fused and $ULP_REPLICATES (default 2) eager runs with m moved by 1 ulp (the same-batch floor), plus
#          the bitwise repeat of eager seed 0, one process each. Measured: all three seeds at once (13
#          processes) beside the gpu-marked tests did not finish 2000 steps in 570 s on an H100 (the
#          harness is host-bound, ~0.1 s of Python a step alone); one seed (4-5 processes) a call.
#                                                                            -> $OUT/session_samebatch.tgz
#
# Usage: DORA_NUM_GIT_SHA=<sha> bash .ci/gpu/session.sh smoke|train|bench|final|verify
# Each job runs under its own timeout and appends "<job> exit <rc> after <s> s" to its log.
# Here, after a call: tar xzf session_<phase>.tgz -C <dir>, then the ingest commands of the
# README's "Recording GPU data" section.
set -u
: "${OUT:?set OUT}"
SHA=${DORA_NUM_GIT_SHA:?set DORA_NUM_GIT_SHA to the commit being measured}
export PYTHONUNBUFFERED=1 PYTHONPATH=. HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -f .carry/minilm/config.json ] && export DORA_NUM_MINILM=.carry/minilm  # the tests' MiniLM (no package here)
W=/tmp/dora-num-session
rm -rf "$W"; mkdir -p "$W/logs"
nvidia-smi > "$W/logs/nvidia-smi.txt" 2>&1
t0=$(date +%s)
job() {  # job NAME TIMEOUT CMD...
  local name=$1 limit=$2
  shift 2
  if [ "$limit" -le 10 ]; then  # timeout 0 would mean no limit at all, and pack would never run
    echo "$name skipped: ${limit} s left of the call" > "$W/logs/$name.log"
    return
  fi
  timeout "$limit" "$@" > "$W/logs/$name.log" 2>&1
  echo "$name exit $? after $(( $(date +%s) - t0 )) s" >> "$W/logs/$name.log"
}
pack() {  # pack NAME: everything under $W as one file in $OUT
  tail -n 3 "$W"/logs/*.log
  tar czf "$OUT/session_$1.tgz" -C "$W" .
  ls -la "$OUT"
}
wave_jobs() {  # wave_jobs CONV_S PYTEST_S: seed $CONV_SEEDS's (if set) same-batch wave (5 processes, 3 replicates), the
  # deep-stack division study and the memory holdout beside it, then all gpu-marked tests; waits for all
  local s=${CONV_SEEDS:-none} name names=""  # CONV_SEEDS unset: no convergence runs
  [ "$s" != none ] && names="eager_s$s fused_s$s eager_s${s}_ulp eager_s${s}_rep1_ulp eager_s${s}_rep2_ulp"
  for name in $names; do
    job "conv_$name" "$1" env OMP_NUM_THREADS=1 python3 -m dora_num record convergence \
      --out "$W/conv/$name" --base .carry/minilm --seeds "$s" --ulp-seeds "$s" --no-repeat \
      --ulp-replicates 3 --runs "$name" --profile-steps 0 --no-progress &
  done
  job deepstack 240 python3 -m dora_num record deep-stack --out "$W/deepstack" --git-sha "$SHA" &
  job holdout 180 python3 -m dora_num record memory --holdout --out "$W/holdout" --base .carry/minilm --git-sha "$SHA"
  job pytest "$2" python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 tests
  wait
}
case "${1:-}" in
  smoke)
    job exhaustive_smoke 240 python3 -m dora_num record exhaustive --out "$W/exhaustive_smoke" --smoke --git-sha "$SHA" &
    job adapters_smoke 220 python3 -m dora_num record adapters-gpu --smoke --out "$W/adapters_smoke" \
      --base .carry/minilm --wall-s 180 --git-sha "$SHA" &
    job model_smoke 240 python3 -m dora_num record model --out "$W/model_smoke" --smoke --git-sha "$SHA" &
    job suite_smoke 240 python3 -m dora_num gpu-suite --smoke --only fma compose norm layer --out "$W/suite_smoke" \
      --git-sha "$SHA" &
    job pytest 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 tests &
    wait
    job guard 150 python3 -m dora_num record guard-cost --out "$W/guard" --git-sha "$SHA"
    pack smoke
    ;;
  train)
    job adapters 590 python3 -m dora_num record adapters-gpu --out "$OUT" --base .carry/minilm --wall-s 560 \
      --git-sha "$SHA"
    cp "$W/logs/adapters.log" "$OUT/adapters_job.log"
    tail -n 20 "$W/logs/adapters.log"
    ls -la "$OUT"
    ;;
  bench)
    job model 330 python3 -m dora_num record model --out "$W/model" --rounds "${MODEL_ROUNDS:-3}" \
      --git-sha "$SHA"
    left=$(( 570 - ($(date +%s) - t0) ))
    budget=$(( left - 80 ))
    [ "$budget" -ge 60 ] || budget=60
    job exhaustive "$left" python3 -m dora_num record exhaustive --out "$W/exhaustive" --budget-s "$budget" \
      --git-sha "$SHA"
    pack bench
    ;;
  final)
    job pytest 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 tests &
    job exhaustive 300 python3 -m dora_num record exhaustive --out "$W/exhaustive" --budget-s "${EXHAUSTIVE_S:-200}" \
      --git-sha "$SHA" &
    wait
    job guard 150 python3 -m dora_num record guard-cost --out "$W/guard" --git-sha "$SHA"
    left=$(( 575 - ($(date +%s) - t0) ))
    job model "$left" python3 -m dora_num record model --out "$W/model" --rounds "${MODEL_ROUNDS:-2}" \
      --git-sha "$SHA"
    pack final
    ;;
  compiled)  # the compile-native operator: its device probe and the ops/PEFT gpu tests
    job probe 200 python3 .ci/gpu/compile_probe.py "$W" kernels layer peft
    job pytest 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 tests/ops tests/test_peft.py \
      tests/test_peft_modes.py tests/test_wrap.py tests/test_compiled_peft.py
    pack compiled
    ;;
  operator)  # first look at a commit: the compile probe's $PROBE_SECTIONS (default all; bench alone on the GPU),
    # the gpu tests of $PYTEST_FILES (default: the operator's and the PEFT paths'; failures printed as they
    # come), then the products recorder's $PRODUCTS_ONLY parts, one job each (default: tf32 bf16_base)
    job probe 230 python3 .ci/gpu/compile_probe.py "$W" ${PROBE_SECTIONS:-kernels layer peft host bench}
    PYTHONPATH=.:.ci/gpu job pytest "${PYTEST_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -p instafail \
      -rs -n 6 ${PYTEST_FILES:-tests/ops tests/test_peft.py tests/test_peft_modes.py tests/test_wrap.py \
      tests/test_compiled_peft.py tests/test_check.py}
    for part in ${PRODUCTS_ONLY:-tf32 bf16_base}; do
      left=$(( 570 - ($(date +%s) - t0) ))
      job "products_$part" "$left" python3 -m dora_num record products --out "$W/products" --only "$part" \
        --git-sha "$SHA"
    done
    pack operator
    ;;
  verify)  # after fixes: the gpu-marked tests of the named files (VERIFY_TESTS), then the guard's cost alone
    job pytest 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 ${VERIFY_TESTS:-tests}
    job guard 420 python3 -m dora_num record guard-cost --out "$W/guard" --git-sha "$SHA"
    pack verify
    ;;
  samebatch)
    reps=${ULP_REPLICATES:-2}
    for s in ${CONV_SEEDS:?name one seed a call, e.g. CONV_SEEDS=0}; do
      names="eager_s$s fused_s$s eager_s${s}_ulp"
      for k in $(seq 1 $((reps - 1))); do names="$names eager_s${s}_rep${k}_ulp"; done
      [ "$s" = 0 ] && names="$names eager_s0_rep1"
      for name in $names; do
        job "conv_$name" "${CONV_S:-570}" env OMP_NUM_THREADS=1 python3 -m dora_num record convergence \
          --out "$W/conv/$name" --base .carry/minilm --seeds "$s" --repeat-seed "$s" --ulp-seeds "$s" \
          --ulp-replicates "$reps" --runs "$name" --profile-steps 0 --no-progress &
      done
    done
    wait
    pack samebatch
    ;;
  timing)  # alone on the GPU: the kernel tile sweep (compose, row_sumsq, norm tail), then where a compiled step's
    # GPU time goes (.ci/gpu/compiled_profile.py: eager, compile, reduce-overhead, kernel by kernel)
    job tiles 200 python3 -m dora_num record tiles --out "$W/tiles" --git-sha "$SHA"
    left=$(( 575 - ($(date +%s) - t0) ))
    job profile "$left" python3 .ci/gpu/compiled_profile.py "$W/profile" --layers "${PROFILE_LAYERS:-1}" \
      --ranks ${PROFILE_RANKS:-384}
    pack timing
    ;;
  wave)  # correctness and convergence together (no timing claims): wave_jobs (above)
    wave_jobs "${CONV_S:-540}" "${PYTEST_S:-360}"
    pack wave
    ;;
  bundle)  # one call: the wave (no timing claims), then the tile sweep alone on the GPU (a timing) with the time left
    wave_jobs "${CONV_S:-400}" "${PYTEST_S:-330}"
    left=$(( 585 - ($(date +%s) - t0) ))
    job tiles "$left" python3 -m dora_num record tiles --out "$W/tiles" --git-sha "$SHA"
    pack bundle
    ;;
  cards)  # correctness beside correctness: nothing here is timed
    job products 300 python3 -m dora_num record products --only accumulation --out "$W/products" --git-sha "$SHA" &
    job holdout "${HOLDOUT_S:-180}" python3 -m dora_num record memory --holdout --out "$W/holdout" --base .carry/minilm \
      --git-sha "$SHA" &
    job seeds_smoke 200 python3 -m dora_num record adapters-gpu --plan seeds --seeds 1 --smoke \
      --out "$W/seeds_smoke" --base .carry/minilm --wall-s 150 --git-sha "$SHA" &
    job pytest "${PYTEST_S:-400}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 tests
    wait
    pack cards
    ;;
  seed)  # one seed of the collapse grid a call (11 processes: two seeds do not fit one call's 10 minutes), with
    # $SIDE beside it, any of (space-separated; default none): probe (the card's accumulation probe and the memory
    # holdout), holdout (the memory holdout alone), pytest (all gpu tests on 3 workers): correctness records whose
    # timings are not claims; the seeds' runs end by plateau or deadline
    for side in ${SIDE:-none}; do
      case "$side" in
        probe) job products 300 python3 -m dora_num record products --only accumulation --out "$W/products" \
          --git-sha "$SHA" & ;;&
        probe|holdout) job holdout 180 python3 -m dora_num record memory --holdout --out "$W/holdout" \
          --base .carry/minilm --git-sha "$SHA" & ;;
        pytest) job pytest "${PYTEST_S:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 3 tests & ;;
        none) ;;
        *) echo "SIDE: unknown side job '$side' (probe, holdout, pytest, none)" >&2; exit 2 ;;
      esac
    done
    job seeds "$(( ${SEED_WALL_S:-500} + 40 ))" python3 -m dora_num record adapters-gpu --plan seeds \
      --seeds "${SEED:?name the seed, e.g. SEED=1}" --out "$OUT/seeds" --base .carry/minilm \
      --wall-s "${SEED_WALL_S:-500}" --git-sha "$SHA"
    wait
    tail -n 25 "$W/logs/seeds.log"
    if [ "${AFTER:-}" = dorafactors ]; then  # then alone on the GPU (a timing), with the time left
      left=$(( 585 - ($(date +%s) - t0) ))
      job dorafactors "$left" python3 -m dora_num record dorafactors --out "$W/dorafactors" \
        --dorafactors .carry/dorafactors --git-sha "$SHA"
      tail -n 15 "$W/logs/dorafactors.log"
    fi
    pack "seed$SEED"
    ;;
  probe)  # the card's accumulation probe (about 370 s alone on an H100), the holdout and the tests beside it, then the diagnostic
    job products "${PRODUCTS_S:-540}" python3 -m dora_num record products --only accumulation --out "$W/products" --git-sha "$SHA" &
    job holdout "${HOLDOUT_S:-180}" python3 -m dora_num record memory --holdout --out "$W/holdout" --base .carry/minilm \
      --git-sha "$SHA" &
    job pytest "${PYTEST_S:-540}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 ${PYTEST_FILES:-\
      tests/test_check_accumulation.py tests/ops/test_products_gpu.py tests/test_check.py tests/ops/test_finite.py} &
    wait
    left=$(( ${CALL_S:-585} - ($(date +%s) - t0) ))
    job norm_rank "$left" python3 .ci/gpu/norm_rank_profile.py "$W/norm_rank"
    if [ -n "${PROBE_HOST:-}" ]; then  # then, alone too, the compiled step's host time and its profile
      left=$(( ${CALL_S:-585} - ($(date +%s) - t0) ))
      mkdir -p "$W/compile"
      job compile_host "$left" python3 .ci/gpu/compile_probe.py "$W/compile" host
    fi
    pack probe
    ;;
  matrix)  # alone on the GPU (timings): part $PART of the model matrix (dora-num record model --matrix $PART)
    job matrix "${MATRIX_S:-585}" python3 -m dora_num record model --matrix "${PART:?set PART to 1 or 2}" \
      --out "$W/matrix" --git-sha "$SHA"
    if [ -n "${AFTER_PYTEST_S:-}" ]; then  # then, with the GPU free again, every gpu-marked test
      job pytest "$AFTER_PYTEST_S" python3 -m pytest -m gpu -q -p no:cacheprovider -rs -n 4 tests
    fi
    pack "matrix$PART"
    ;;
  speed)  # alone on the GPU (timings): the suite's sections that the speed targets read
    job suite "${SUITE_S:-570}" python3 -m dora_num gpu-suite --repeat --only ${SUITE_ONLY:-compose norm layer} \
      --out "$W/suite" --git-sha "$SHA"
    pack speed
    ;;
  *) echo "usage: DORA_NUM_GIT_SHA=<sha> bash .ci/gpu/session.sh smoke|train|bench|final|compiled|operator|verify|samebatch|timing|wave|bundle|cards|seed|probe|speed|matrix" >&2; exit 2 ;;
esac
