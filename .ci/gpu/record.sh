#!/usr/bin/env bash
# One device call on the H200 (the device tool runs it in the repo root, $OUT given) that
# records the sections named on the command line, in this order:
#   tests         the gpu-marked tests                                  -> r/pytest_gpu.log
#   conv_profile  the convergence profile (30 steps, alone on the GPU)  -> r/conv_profile/
#   suite         the GPU suite; SUITE_SECTIONS picks its sections
#                 (default: all; every norm/layer row set carries its
#                 same-run A/B against the previous host path)          -> r/suite/
#   overhead      the host-overhead probe                               -> r/overhead.log
#   memory        the memory peaks of notebook 06                       -> r/memory/
#   holdout       the memory model's pre-registered holdout (< 2 min)   -> r/holdout/
#   graphs        the CUDA-graph timing of the training step            -> r/graphs/
#   guard         the cancellation guard's cost, on vs off interleaved  -> r/guard/
#                 (GUARD_SMOKE=1: its --smoke shapes, seconds)
# Presets: "kernels" = tests conv_profile suite overhead (after a change to the kernels);
#          "layer"   = tests suite overhead memory, SUITE_SECTIONS="norm layer" unless set
#                      (after a change to DoRALinear's host path; add "graphs" for the
#                      CUDA-graph timing).
# Each section runs under its own timeout (T_TESTS=200 T_CONV_PROFILE=120 T_SUITE=330
# T_OVERHEAD=60 T_MEMORY=60 T_HOLDOUT=120 T_GRAPHS=120 T_GUARD=150 seconds; the device call itself is limited to
# 600 s) and appends "<section> exit <rc> after <s> s" to its log.  Everything lands in
# $OUT/results.tgz; record it here (unpacked into r/) with:
#   python -m dora_num gpu-suite --ingest r/suite        (all sections; or ingest(..., only=...))
#   python -m dora_num record memory --ingest r/memory --git-sha <sha>   (and r/holdout)
#   python3 -m dora_num record guard-cost --ingest r/guard --git-sha <sha>
#   cp r/pytest_gpu.log r/overhead.log r/graphs/train_graphs.csv data/gpu/  (with sidecars:
#     README "Recording GPU data")
# Usage: DORA_NUM_GIT_SHA=<sha> bash .ci/gpu/record.sh kernels | layer | SECTION...
# Needs .carry/minilm (python -m dora_num record carry .carry/minilm) carried along for
# conv_profile, memory and holdout.
source "$(dirname "$0")/_setup.sh"
[ $# -gt 0 ] || { echo "usage: record.sh kernels | layer | SECTION... (see the header)" >&2; exit 2; }
sections=()
for arg in "$@"; do
  case "$arg" in
    kernels) sections+=(tests conv_profile suite overhead) ;;
    layer) sections+=(tests suite overhead memory); SUITE_SECTIONS=${SUITE_SECTIONS:-norm layer} ;;
    tests|conv_profile|suite|overhead|memory|holdout|graphs|guard) sections+=("$arg") ;;
    *) echo "record.sh: unknown section $arg" >&2; exit 2 ;;
  esac
done
SUITE_SECTIONS=${SUITE_SECTIONS:-all}
if [ "$SUITE_SECTIONS" = all ]; then only=(); else only=(--only $SUITE_SECTIONS); fi

run() {  # run NAME LOG TIMEOUT CMD...: one section, its exit status appended to its log
  local name=$1 log=$2 limit=$3
  shift 3
  timeout "$limit" "$@" > "$log" 2>&1
  echo "$name exit $? after $(( $(date +%s) - t0 )) s" >> "$log"
}
for s in tests conv_profile suite overhead memory holdout graphs guard; do  # this order, each section once
  case " ${sections[*]} " in *" $s "*) ;; *) continue ;; esac
  case "$s" in
    tests) run pytest "$R/pytest_gpu.log" "${T_TESTS:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests ;;
    conv_profile) run profile "$R/conv_profile.log" "${T_CONV_PROFILE:-120}" python3 -m dora_num record convergence \
        --out "$R/conv_profile" --base .carry/minilm --profile-only --profile-steps 30 --no-progress ;;
    suite) run suite "$R/suite.log" "${T_SUITE:-330}" python3 -m dora_num gpu-suite --out "$R/suite" "${only[@]}" \
        --git-sha "$SHA" ;;
    overhead) run overhead "$R/overhead.log" "${T_OVERHEAD:-60}" python3 -m dora_num record overhead ;;
    memory) run memory "$R/memory.log" "${T_MEMORY:-60}" python3 -m dora_num record memory \
        --out "$R/memory" --base .carry/minilm ;;
    holdout) run holdout "$R/holdout.log" "${T_HOLDOUT:-120}" python3 -m dora_num record memory --holdout \
        --out "$R/holdout" --base .carry/minilm --git-sha "$SHA" ;;
    graphs) run graphs "$R/graphs.log" "${T_GRAPHS:-120}" python3 -m dora_num record train-graphs --out "$R/graphs" ;;
    guard) run guard "$R/guard.log" "${T_GUARD:-150}" python3 -m dora_num record guard-cost --out "$R/guard" \
        --git-sha "$SHA" ${GUARD_SMOKE:+--smoke} ;;
  esac
done
tail -n 3 "$R"/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
