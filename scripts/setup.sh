#!/usr/bin/env bash
# Installs what vlmopt needs on a fresh Debian 12 machine (run as root; only
# Debian's packages and PyPI are reached), then configures the build.
# Idempotent: a second run installs nothing and only re-runs the CMake configure.
#
#   scripts/setup.sh [--no-configure]
#
# Environment: BUILD_DIR (default build), BUILD_TYPE (default Release),
#              VLMOPT_PYTHON (default python3 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_DIR=${BUILD_DIR:-build}
BUILD_TYPE=${BUILD_TYPE:-Release}
configure=1
[[ "${1:-}" == "--no-configure" ]] && configure=0

say() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages ---------------------------------------------------------
APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  python3 python3-venv python3-pip
  libcli11-dev nlohmann-json3-dev libhdf5-dev libopencv-dev libfmt-dev libspdlog-dev
  doctest-dev libssl-dev libicu-dev chromium
  opencv-doc            # the real handwritten digits image (digits.png) and sample photos
  libtcmalloc-minimal4  # scripts/train_builtin.py preloads it: ~20 % faster training, the same weights
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  say "Debian packages: all present"
fi

# --- Python (reference tools + the torch wheel that is our libtorch) ---------
PY=${VLMOPT_PYTHON:-python3}
# Debian's own python refuses system-wide pip installs (PEP 668): use a venv there.
if "$PY" -c 'import sys, sysconfig, os; p = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"); sys.exit(0 if os.path.exists(p) and sys.prefix == sys.base_prefix else 1)'; then
  if [[ ! -x "$ROOT/.venv/bin/python" ]]; then
    say "creating $ROOT/.venv (system python is externally managed)"
    "$PY" -m venv "$ROOT/.venv"
  fi
  PY=$ROOT/.venv/bin/python
fi
if ! "$PY" - "$ROOT/scripts/requirements.txt" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.requirements import Requirement
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    req = Requirement(line)
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PYEOF
then
  say "installing Python packages from scripts/requirements.txt (torch wheel is large: a few minutes)"
  "$PY" -m pip install -q --disable-pip-version-check -r scripts/requirements.txt
else
  say "Python packages: all present"
fi
echo "$PY" > "$ROOT/.python-path"   # scripts and tests use the same interpreter

# --- configure ---------------------------------------------------------------
if ((configure)); then
  say "configuring $BUILD_DIR ($BUILD_TYPE)"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DPython3_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" >/dev/null
fi
say "done"
