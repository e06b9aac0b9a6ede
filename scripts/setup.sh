#!/usr/bin/env bash
# Create .venv (once) and install cupyconv into it with what the demo and the tests need.
#   CUPYCONV_CUDA=12 installs cupy-cuda12x, CUPYCONV_CUDA=13 cupy-cuda13x, CUPYCONV_CUDA=none no CuPy
#   (NumPy reference backend only). Unset, it is 12 where an NVIDIA driver is present and none otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${CUPYCONV_CUDA:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]; then
    CUPYCONV_CUDA=12
  else
    # Without a driver CuPy runs no kernel, so its large wheels and the NVRTC wheel would be downloaded for nothing.
    CUPYCONV_CUDA=none
    echo "setup.sh: no NVIDIA driver here (no nvidia-smi on PATH, no /proc/driver/nvidia), so no CuPy:" \
         "cupyconv will run on its NumPy reference backend (set CUPYCONV_CUDA=12 or 13 to install CuPy anyway)"
  fi
fi
case "$CUPYCONV_CUDA" in
  12) extras="cuda12,test" ;;
  13) extras="cuda13,test" ;;
  none) extras="test" ;;
  *) echo "CUPYCONV_CUDA must be 12, 13 or none" >&2; exit 2 ;;
esac
python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install --quiet --upgrade pip
# torch 2.13.0 is the version the suite is checked with; on machines without CUDA pip finds a CPU build.
"$py" -m pip install --quiet "torch==2.13.0"
"$py" -m pip install --quiet -e ".[${extras}]"
