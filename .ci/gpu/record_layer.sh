#!/usr/bin/env bash
# One device call on the H200 after a change to DoRALinear's host path: the gpu-marked
# tests, the GPU suite (SECTIONS, default "norm layer"; "all" for every section: each
# norm/layer row set carries its same-run A/B against the previous host path), the
# host-cost probe, the memory peaks of notebook 06 and (TRAIN_GRAPHS=1) the CUDA-graph
# timing of the training step.  Everything lands in $OUT/results.tgz; record it here with:
#   python -m dora_num gpu-suite --ingest r/suite        (all sections; or ingest(..., only=...))
#   python -m dora_num.studies.gradient.memory_model --ingest r/memory --git-sha <sha>
#   cp r/pytest_gpu.log r/overhead.log r/graphs/train_graphs.csv data/gpu/  (with sidecars)
# Needs .carry/minilm (python -m dora_num.studies.carry .carry/minilm) carried along.
source "$(dirname "$0")/_setup.sh"
SECTIONS=${SECTIONS:-norm layer}
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests > "$R/pytest_gpu.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - t0 )) s" >> "$R/pytest_gpu.log"
if [ "$SECTIONS" = all ]; then only=(); else only=(--only $SECTIONS); fi
timeout 330 python3 -m dora_num gpu-suite --out "$R/suite" "${only[@]}" --git-sha "$SHA" > "$R/suite.log" 2>&1
echo "suite exit $? after $(( $(date +%s) - t0 )) s" >> "$R/suite.log"
timeout 60 python3 -m dora_num.studies.speed.overhead > "$R/overhead.log" 2>&1
echo "overhead exit $? after $(( $(date +%s) - t0 )) s" >> "$R/overhead.log"
timeout 60 python3 -m dora_num.studies.gradient.memory_model --measure --out "$R/memory" --base .carry/minilm \
  > "$R/memory.log" 2>&1
echo "memory exit $? after $(( $(date +%s) - t0 )) s" >> "$R/memory.log"
if [ "${TRAIN_GRAPHS:-0}" = 1 ]; then
  timeout 120 python3 -m dora_num.studies.speed.train_graphs --out "$R/graphs" > "$R/graphs.log" 2>&1
  echo "graphs exit $? after $(( $(date +%s) - t0 )) s" >> "$R/graphs.log"
fi
tail -n 3 "$R"/*.log
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
