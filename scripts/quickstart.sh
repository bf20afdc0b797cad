#!/usr/bin/env bash
# The README's first command: installs what is missing, builds dsv4, and runs it on the
# built-in default model (a tiny synthetic DeepSeek-V4 that the program makes itself).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
./scripts/build.sh release dsv4_cli
./build/dsv4 info "$@"
