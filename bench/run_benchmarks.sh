#!/usr/bin/env bash
# Thin launcher: all logic is in `hyperqwen bench run MODE` (see bench/README.md).
# Usage: bench/run_benchmarks.sh single|batch [options]   (--help lists the options)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${HYPERQWEN_VENV:-.venv}/bin/hyperqwen" bench run "$@"
