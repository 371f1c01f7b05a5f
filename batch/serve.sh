#!/usr/bin/env bash
# Thin launcher: all logic is in `hyperqwen serve batch` (knobs from the environment and .env).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${HYPERQWEN_VENV:-.venv}/bin/hyperqwen" serve batch "$@"
