#!/bin/sh
# Entry command of the pagedllm images: `pagedllm serve` listening on all interfaces of the container.
# Arguments are appended, so `docker run IMAGE /models/my-model --max-model-len 4096` works and a later
# `--port` / `--host` given by the user wins. `exec` replaces the shell, so SIGTERM from `docker stop` /
# Kubernetes reaches pagedllm itself and starts its graceful drain.
set -eu
exec pagedllm serve --host "${PAGEDLLM_HOST:-0.0.0.0}" --port "${PAGEDLLM_PORT:-8000}" "$@"
