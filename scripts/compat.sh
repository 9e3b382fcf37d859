#!/usr/bin/env bash
# `make compat`: the GPU image's versions (Python 3.12, torch 2.11, transformers 5.17, triton 3.6) in a second venv.
# 1. The image alone plus the carried wheels (.device-wheels/, installed with --no-index): the device check runs.
# 2. The project's other dependencies on top: the tests marked `compat` (models, cache, methods, device check).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COMPAT_VENV:-.venv-compat}
PY312=""
for candidate in ${PY312_BIN:-} python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$candidate; break; fi
done
[ -n "$PY312" ] || { echo "make compat needs Python 3.12 (the GPU image's): set PY312_BIN=/path/to/python3.12"; exit 1; }
test -x "$VENV/bin/python" || "$PY312" -m venv "$VENV"
PIP="$VENV/bin/python -m pip -q"
$PIP install --upgrade pip
$PIP install -r requirements/device-image.txt
test -f .device-wheels/manifest.json || .venv/bin/python -m kvresearch.device_wheels
$PIP install --no-index --no-deps .device-wheels/*.whl
echo "[compat] the device check at the tiny shape, with the image's packages and the carried wheels only"
TRITON_INTERPRET=1 "$VENV/bin/python" -m kvresearch.device_check --out outputs/compat/device_check --plan tiny --contexts 160 224
echo "[compat] the project's other dependencies, then the compat tests"
DEPS=$("$VENV/bin/python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"torch", "transformers", "kvpress", "triton"}  # the image's own, and kvpress (its transformers bound is <5.3)
deps = project["dependencies"] + project["optional-dependencies"]["dev"]
print(" ".join(f"'{d}'" for d in deps if re.split(r"[<>=!~; \[]", d)[0].lower() not in skip))
PY
)
eval "$PIP install $DEPS"
$PIP install --no-deps -e .
$PIP install --no-deps -r requirements/nodeps.txt
"$VENV/bin/python" -c "import torch, transformers; print('[compat] torch', torch.__version__, 'transformers', transformers.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m compat
