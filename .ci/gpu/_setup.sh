# Sourced by the .ci/gpu/record_*.sh device scripts: environment, output folder, GPU identity.
set -u
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
SHA=${DORA_NUM_GIT_SHA:-unknown}
R=$OUT/r
mkdir -p "$R"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
t0=$(date +%s)
