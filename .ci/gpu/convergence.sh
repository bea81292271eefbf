#!/usr/bin/env bash
# One wave of convergence runs on the H200, one process per run (the harness is
# bound by the host: ~0.1 s of Python per step, so runs in parallel processes
# share the GPU well).  Usage (device tool, repo root, $OUT given):
#   DORA_NUM_GIT_SHA=... bash .ci/gpu/convergence.sh eager_s0 fused_s0 ...
# Each run NAME is PATH_sSEED[_rep1] or eager_sSEED_ulp (m moved by 1 ulp at init); results in $OUT/results.tgz, one folder per
# run; record them with python -m dora_num record convergence --ingest DIR... --out
# data/gpu/convergence --git-sha SHA (together with the --profile-only folder).
set -u
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2
LIMIT=${LIMIT:-560}
R=$OUT/r
mkdir -p "$R"
for name in "$@"; do
  seed=${name#*_s}; seed=${seed%%_*}
  timeout "$LIMIT" python3 -m dora_num record convergence --out "$R/$name" --base .carry/minilm \
    --seeds "$seed" --repeat-seed "$seed" --ulp-seeds "$seed" --runs "$name" --profile-steps 0 --no-progress \
    > "$R/$name.log" 2>&1 &
done
wait
tail -n 2 "$R"/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
