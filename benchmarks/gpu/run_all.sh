#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu/run_all.py says what it runs): at most 8 minutes on one
# H100/H200. From the repository root:  OUT=/some/folder bash benchmarks/gpu/run_all.sh [--cpu-smoke]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-python3}" benchmarks/gpu/run_all.py "$@"
