#!/usr/bin/env bash
# One device call: the host cost of DoRALinear and the model-level suite, alone on the GPU
# (run in the repo root, $OUT given, DORA_NUM_GIT_SHA the commit measured).
#   1. .ci/gpu/layer_host_wait.py          -> $OUT/layer_host.log   (interleaved A/B of the host cost per step)
#   2. the model-level suite, MODEL_ROUNDS -> $OUT/model/model_*.csv, device.json
# Here: dora-num record model --ingest <OUT>/model --git-sha <sha> (-> data/gpu/model_*.csv), and the log
#       through dora_num.repro.recording.ingest({"layer_host.log": <OUT>/layer_host.log}, .ci/gpu/diagnostics,
#       machine=recording.read_machine(<OUT>/model), producer=..., git_sha=<sha>) (a sidecar beside it; a
#       diagnostic of the device scripts, not a data set: .ci/gpu/diagnostics/README.md).
set -u
: "${OUT:?set OUT}"
SHA=${DORA_NUM_GIT_SHA:?set DORA_NUM_GIT_SHA to the commit being measured}
export PYTHONUNBUFFERED=1 PYTHONPATH=. HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
{ echo "# H200, git $SHA: python3 .ci/gpu/layer_host_wait.py"; timeout 90 python3 .ci/gpu/layer_host_wait.py; \
  echo "layer_host_wait exit $? after $(( $(date +%s) - t0 )) s"; } > "$OUT/layer_host.log" 2>&1
timeout $(( 570 - ($(date +%s) - t0) )) python3 -m dora_num record model --out "$OUT/model" \
  --rounds "${MODEL_ROUNDS:-2}" --git-sha "$SHA" > "$OUT/model.log" 2>&1
echo "model exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/model.log"
tail -n 4 "$OUT/layer_host.log" "$OUT/model.log"
