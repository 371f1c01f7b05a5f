# HyperQwen serving image: the pinned, patched vLLM 0.26.0 on CUDA 13, installed by the same
# install.sh that bare-metal users and CI run. Build: docker compose build (see docs/container.md).
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3.12-dev and a C/C++ compiler are runtime needs, not build leftovers: Triton compiles
# its CUDA launcher against Python.h when vLLM first runs, and TorchInductor may call g++.
# Versions are not pinned: Ubuntu supersedes point releases, which would break rebuilds, and
# 24.04 holds these packages at one minor version (Python 3.12, GCC 13).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates g++ gcc libc6-dev python3.12 python3.12-dev python3.12-venv \
    && rm -rf /var/lib/apt/lists/*

# Prepared models live on the /models volume. Every compile and download cache lives on the
# /cache volume, so restarts skip torch.compile, Triton and FlashInfer builds.
ENV HYPERQWEN_IN_CONTAINER=1 \
    MODELS_DIR=/models \
    HYPERQWEN_CACHE_DIR=/cache \
    HYPERQWEN_VENV=/opt/hyperqwen/venv \
    PYTHONUNBUFFERED=1
ENV PATH=${HYPERQWEN_VENV}/bin:${PATH} \
    VLLM_CACHE_ROOT=${HYPERQWEN_CACHE_DIR}/vllm \
    TRITON_CACHE_DIR=${HYPERQWEN_CACHE_DIR}/triton \
    TORCHINDUCTOR_CACHE_DIR=${HYPERQWEN_CACHE_DIR}/torchinductor \
    FLASHINFER_WORKSPACE_BASE=${HYPERQWEN_CACHE_DIR}/flashinfer \
    HF_HOME=${HYPERQWEN_CACHE_DIR}/huggingface \
    XDG_CACHE_HOME=${HYPERQWEN_CACHE_DIR}/xdg

# A non-root user with the usual desktop uid, so files it writes into the bind-mounted ./models
# belong to the host user. Ubuntu images ship `ubuntu` with that uid; it is replaced.
ARG APP_UID=1000
RUN if existing_user=$(getent passwd "${APP_UID}"); then userdel --remove "${existing_user%%:*}"; fi \
    && useradd --uid "${APP_UID}" --user-group --create-home --shell /bin/bash hyperqwen \
    && mkdir -p "${MODELS_DIR}" "${HYPERQWEN_CACHE_DIR}" \
    && chown hyperqwen:hyperqwen "${MODELS_DIR}" "${HYPERQWEN_CACHE_DIR}"

WORKDIR /opt/hyperqwen/app
COPY . .
RUN PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore bash install.sh "${HYPERQWEN_VENV}"

USER ${APP_UID}
VOLUME ["${MODELS_DIR}", "${HYPERQWEN_CACHE_DIR}"]
EXPOSE 18020

ENTRYPOINT ["/opt/hyperqwen/app/docker-entrypoint.sh"]
CMD ["single"]
