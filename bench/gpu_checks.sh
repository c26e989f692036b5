#!/usr/bin/env bash
# The GPU checks in one run, on a machine with one NVIDIA GPU and a CUDA build of torch (docs/gpu.md):
# builds commlens where it stands (its C extensions in place, the package linked from a temporary
# folder), then runs tests/test_gpu.py and bench/gpu.py (its configurations CONFIG..., else all), the log
# and the figures into OUT_DIR.
#
#     bash bench/gpu_checks.sh [OUT_DIR] [ROUNDS] [CONFIG...]
set -uo pipefail
out=${1:-/tmp/commlens-gpu}
rounds=${2:-3}
configs=("${@:3}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
exec > >(tee "$out/log") 2>&1
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', torch.cuda.nccl.version())"
include=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
for source in ring/_*.c hooks/_*.c; do  # the C extensions (pyproject.toml's), built in place
    cc -O3 -std=c11 -shared -fPIC -I"$include" -Iring "$source" -o "${source%.c}$suffix" || exit 1
done
site=$(mktemp -d)
mkdir "$site/commlens"
for part in ring hooks agent exporters dashboards deploy; do ln -s "$PWD/$part" "$site/commlens/$part"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "== the GPU extension (hooks/_gpu.cpp), built against this torch"
SECONDS=0
python3 -c "from commlens.hooks import cuda; assert cuda.native() is not None" || exit 1
echo "== built: $SECONDS s; tests/test_gpu.py"
SECONDS=0
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --durations 0 tests/test_gpu.py
echo "== tests: $SECONDS s; bench/gpu.py --rounds $rounds"
SECONDS=0
timeout 270 python3 bench/gpu.py --rounds "$rounds" ${configs[@]:+--configs "${configs[@]}"} | tee "$out/figures.txt"
echo "== bench: $SECONDS s"
