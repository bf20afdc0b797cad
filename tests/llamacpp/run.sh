#!/usr/bin/env bash
# The llama.cpp interoperability tests (test_llamacpp_interop.py): builds llama.cpp once
# (build.sh; cached under DSV4_CACHE_DIR, default ~/.cache/dsv4), then runs the checks with
# the dsv4 binary given as $1 (default build/dsv4).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cli="$(realpath "${1:-$here/../../build/dsv4}")"
build="$("$here/build.sh" | tail -1)"
DSV4_CLI="$cli" LLAMACPP_BUILD="$build" "${PYTHON:-python3}" "$here/test_llamacpp_interop.py"
