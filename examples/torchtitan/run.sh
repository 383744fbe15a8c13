#!/usr/bin/env bash
# TorchTitan 0.2.2's Llama 3 debug model on neuron: FSDP2 over 2 ranks, torch.compile.
# Usage: examples/torchtitan/run.sh [WORK_DIR] [extra TorchTitan flags...]
# Builds the tokenizer and dataset locally (prepare_assets.py), then launches TorchTitan's own
# trainer unchanged (`python -m torchtitan.train`); every choice is a TorchTitan config value
# (llama3_debug_neuron.toml) or a command-line flag. NGPU sets the number of ranks (default 2).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${1:-$HERE/work}"
shift || true
PY="${PYTHON:-python}"
# TorchTitan 0.2.2 imports triton at start-up; `make build`/`make test` install it into its own
# directory (kept off the venv, where vLLM refuses it). TORCHTITAN_TRITON_DIR overrides.
TRITON_DIR="${TORCHTITAN_TRITON_DIR:-$HERE/../../.venv/torchtitan-triton}"
if [ -d "$TRITON_DIR/triton" ]; then
    export PYTHONPATH="$TRITON_DIR${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$WORK"
[ -f "$WORK/assets/tokenizer/tokenizer.json" ] || "$PY" "$HERE/prepare_assets.py" "$WORK/assets"
cd "$WORK"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "${NGPU:-2}" -m torchtitan.train \
    --job.config_file "$HERE/llama3_debug_neuron.toml" \
    --job.dump_folder "$WORK/outputs" \
    --model.hf_assets_path "$WORK/assets/tokenizer" \
    --training.dataset_path "$WORK/assets/c4_test" \
    "$@"
