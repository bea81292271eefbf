#!/usr/bin/env bash
# One device call on the H200 after a change to DoRALinear's host path (the norm's tail
# kernel): the gpu-marked tests, the norm and layer sections of the GPU suite (each with
# its same-run A/B against the torch tail), the host-cost probe, and the memory peaks of
# notebook 06.  Everything lands in $OUT/results.tgz; record it here with:
#   python -c "from dora_num.studies.gpu_suite import ingest; ingest('r/suite', only=(...))"
#   python -m dora_num.studies.memory_model --ingest r/memory --git-sha <sha>
# Needs .carry/minilm (python -m dora_num.studies.carry .carry/minilm) carried along.
set -u
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
SHA=${DORA_NUM_GIT_SHA:-unknown}
R=$OUT/r
mkdir -p "$R"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
t0=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/kernels > "$R/pytest_gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$R/pytest_gpu.log"
timeout 150 python3 -m dora_num gpu-suite --out "$R/suite" --only norm layer --git-sha "$SHA" > "$R/suite.log" 2>&1
echo "suite exit $? after $(( $(date +%s) - t0 )) s" >> "$R/suite.log"
timeout 60 python3 -m dora_num.studies.bench_overhead > "$R/overhead.log" 2>&1
echo "overhead exit $? after $(( $(date +%s) - t0 )) s" >> "$R/overhead.log"
timeout 120 python3 -m dora_num.studies.memory_model --measure --out "$R/memory" --base .carry/minilm \
  > "$R/memory.log" 2>&1
echo "memory exit $? after $(( $(date +%s) - t0 )) s" >> "$R/memory.log"
tail -n 3 "$R"/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
