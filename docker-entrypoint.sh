#!/usr/bin/env bash
# Entrypoint of the HyperQwen image: maps the image's commands onto the hyperqwen CLI. Every
# branch ends in exec, so vLLM (or your command) replaces this shell and receives the signals.
set -euo pipefail

usage() {
    cat <<'EOF'
Commands of the HyperQwen image (docker run IMAGE COMMAND, or the compose services):
  single    serve one user fast: speculative decoding, few slots (default)
  batch     serve many concurrent requests
  prepare   download, validate and prepare the model into /models
  doctor    check versions, patches, GPU, model and access
  help      show this help
Anything else runs as a command, e.g. `bash` or `hyperqwen settings`.
Extra words after single/batch/prepare/doctor go to that hyperqwen command
(e.g. `single --print-argv`). Knobs come from the environment; see .env.example.
EOF
}

: "${MODELS_DIR:?is set by the image (Dockerfile ENV); this script runs inside it}"
: "${HYPERQWEN_CACHE_DIR:?is set by the image (Dockerfile ENV); this script runs inside it}"
uid=$(id -u)
gid=$(id -g)

# Fails early, naming the fix, instead of deep inside a download or torch.compile.
require_writable() {
    local dir=$1 what=$2 fix=$3
    [[ -w "$dir" ]] && return 0
    printf 'docker-entrypoint: %s (%s) is not writable by uid %s, the user this image runs as.\n%s\n' \
        "$dir" "$what" "$uid" "$fix" >&2
    exit 1
}

readonly MODELS_FIX="Docker creates a missing ./models as root. On the host: mkdir -p models && sudo chown $uid:$gid models
(or rebuild the image for your uid: docker compose build --build-arg APP_UID=\$(id -u))."
readonly CACHE_FIX="The cache volume belongs to another uid (an image built with another APP_UID?).
Remove it, models stay in ./models: docker compose down --volumes"

command=${1:-single}
(($#)) && shift
case "$command" in
    single | batch)
        require_writable "$HYPERQWEN_CACHE_DIR" "the compile cache volume" "$CACHE_FIX"
        exec hyperqwen serve "$command" "$@"
        ;;
    prepare)
        require_writable "$MODELS_DIR" "the models folder, ./models on the host" "$MODELS_FIX"
        require_writable "$HYPERQWEN_CACHE_DIR" "the download cache volume" "$CACHE_FIX"
        exec hyperqwen prepare "$@"
        ;;
    doctor) exec hyperqwen doctor "$@" ;;
    help | -h | --help) usage ;;
    *) exec "$command" "$@" ;;
esac
