#!/usr/bin/env bash
# One device call on the H200 (the device tool runs it in the repo root, $OUT given):
# the gpu-marked tests, the convergence profile (one process alone on the GPU), the
# GPU suite and the host-overhead probe.  Everything lands in $OUT/results.tgz; record
# it here with:
#   python -m dora_num gpu-suite --ingest r/suite
#   cp r/pytest_gpu.log data/gpu/  (with a sidecar: see README "Recording GPU results")
# Needs .carry/minilm (python -m dora_num.studies.carry .carry/minilm) carried along.
source "$(dirname "$0")/_setup.sh"
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests > "$R/pytest_gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$R/pytest_gpu.log"
timeout 120 python3 -m dora_num.studies.convergence.run --out "$R/conv_profile" --base .carry/minilm \
  --profile-only --profile-steps 30 --no-progress > "$R/conv_profile.log" 2>&1
echo "profile exit $? after $(( $(date +%s) - t0 )) s" >> "$R/conv_profile.log"
timeout 260 python3 -m dora_num gpu-suite --out "$R/suite" --git-sha "$SHA" > "$R/suite.log" 2>&1
echo "suite exit $? after $(( $(date +%s) - t0 )) s" >> "$R/suite.log"
timeout 30 python3 -m dora_num.studies.speed.overhead > "$R/overhead.log" 2>&1
tail -n 3 "$R"/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
