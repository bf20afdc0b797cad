#!/usr/bin/env bash
# The README's first command: installs what is missing, builds dsv4, and asks the built-in
# default model (a tiny synthetic DeepSeek-V4 that the program makes itself) a question.
# Its weights are random, so the reply is noise; extra arguments go to `dsv4 run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
./scripts/build.sh release dsv4_cli
./build/dsv4 run -p "Hello! Who are you?" -n 64 "$@"
