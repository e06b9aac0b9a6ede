#!/usr/bin/env bash
# Create .venv (once) and install cupyconv into it with what the demo and the tests need.
#   CUPYCONV_CUDA=12 (default) installs cupy-cuda12x, CUPYCONV_CUDA=13 cupy-cuda13x,
#   CUPYCONV_CUDA=none installs no CuPy (NumPy reference backend only).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
py=.venv/bin/python
"$py" -m pip install --quiet --upgrade pip
case "${CUPYCONV_CUDA:-12}" in
  12) extras="cuda12,test" ;;
  13) extras="cuda13,test" ;;
  none) extras="test" ;;
  *) echo "CUPYCONV_CUDA must be 12, 13 or none" >&2; exit 2 ;;
esac
# torch 2.13.0 is the version the suite is checked with; on machines without CUDA pip finds a CPU build.
"$py" -m pip install --quiet "torch==2.13.0"
"$py" -m pip install --quiet -e ".[${extras}]"
