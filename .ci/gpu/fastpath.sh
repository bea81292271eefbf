#!/usr/bin/env bash
# One device call for the fast path and the model level (run by the device tool in the repo root,
# $OUT given).  Arguments, in any combination (run in this order):
#   tests   the gpu-marked tests of the fast path (split products, no-sync checks, layer, model bench)
#   smoke   `dora-num gpu-suite --only model --smoke` (tiny model: checks the machinery, ~1 min)
#   full    `dora-num gpu-suite --only model` (8B layer shapes, r 16/64/384, with/without
#           checkpointing; timings, agreement, host-cost and public-compose probe; ~4-5 min)
# e.g. `bash .ci/gpu/fastpath.sh tests smoke` (< 90 s after a cold start? see the report) or
# `bash .ci/gpu/fastpath.sh full`.
# Results: $OUT/results.tgz (r/pytest_fastpath.log, r/model.log, r/suite/{device.json,model_*.csv});
# here: mkdir r && tar xzf results.tgz -C r --strip-components=1 &&
#       python3 -m dora_num record model --ingest r/suite
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
R="$OUT/r"; mkdir -p "$R"
SHA=${DORA_NUM_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
for arg in "$@"; do
  case "$arg" in
    tests) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_split_products.py \
             tests/ops/test_layer_fastpath.py tests/ops/test_finite.py tests/ops/test_layer.py \
             tests/ops/kernels/test_norm_tail.py tests/studies/speed/test_model_bench.py \
             > "$R/pytest_fastpath.log" 2>&1
           echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$R/pytest_fastpath.log" ;;
    smoke) timeout 240 python3 -m dora_num gpu-suite --only model --smoke --out "$R/suite" --git-sha "$SHA" \
             > "$R/model.log" 2>&1
           echo "model smoke exit $? after $(( $(date +%s) - t0 )) s" >> "$R/model.log" ;;
    full)  timeout 540 python3 -m dora_num gpu-suite --only model --out "$R/suite" --git-sha "$SHA" \
             > "$R/model.log" 2>&1
           echo "model exit $? after $(( $(date +%s) - t0 )) s" >> "$R/model.log" ;;
    *) echo "fastpath.sh: unknown argument $arg (tests | smoke | full)" >&2; exit 2 ;;
  esac
done
tail -n 4 "$R"/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r
