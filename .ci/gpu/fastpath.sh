#!/usr/bin/env bash
# One device call for the fast path and the model level (run by the device tool in the repo root,
# $OUT given): the gpu tests of the split products, the no-sync checks and the model bench, then
# `dora-num gpu-suite --only model` (timings, agreement, host-cost and public-compose probe).
# Usage: bash .ci/gpu/fastpath.sh [--smoke]       (smoke < 90 s, full < 6 min on the H200)
# Results: $OUT/results.tgz (r/pytest_fastpath.log, r/model.log, r/suite/{device.json,model_*.csv});
# here: mkdir r && tar xzf results.tgz && python -m dora_num gpu-suite --ingest r/suite
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
R="$OUT/r"; mkdir -p "$R"
SHA=${DORA_NUM_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/ops/test_split_products.py \
  tests/ops/test_layer_fastpath.py tests/ops/test_finite.py tests/ops/test_layer.py tests/ops/test_norm.py \
  tests/studies/speed/test_model_bench.py > "$R/pytest_fastpath.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$R/pytest_fastpath.log"
timeout 420 python3 -m dora_num gpu-suite --only model --out "$R/suite" --git-sha "$SHA" "$@" > "$R/model.log" 2>&1
echo "model exit $? after $(( $(date +%s) - t0 )) s" >> "$R/model.log"
tail -n 4 "$R"/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r
