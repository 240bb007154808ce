# syntax=docker/dockerfile:1
# One image for every jetroll process: `jetroll <service> --watch` in docker-compose.yml, `jetroll run s3://...` on
# AWS Batch, `jetroll submit` and `jetroll status`.
#   CPU (default): docker build -t jetroll:latest .
#   GPU:           docker build -t jetroll:gpu --build-arg TORCH_VARIANT=gpu .
#                  (PyPI's CUDA 12 torch wheels plus the `gpu` extra; the NVIDIA container toolkit brings the driver.
#                  BASE_IMAGE may name a CUDA image instead, if it has python3 >= 3.11 with pip.)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# cpu: torch from the PyTorch CPU index (no CUDA libraries); gpu: torch from PyPI (CUDA) and the gpu extra
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY shared/ shared/
COPY services/ services/
COPY functions/ functions/
COPY bench/ bench/
RUN set -eux; \
    case "${TORCH_VARIANT}" in \
      cpu) python3 -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"; \
           python3 -m pip install ".[agents]" ;; \
      gpu) python3 -m pip install "torch==${TORCH_VERSION}" ".[gpu,agents]" ;; \
      *) echo "TORCH_VARIANT must be cpu or gpu, got ${TORCH_VARIANT}" >&2; exit 1 ;; \
    esac; \
    jetroll --help > /dev/null
COPY configs/ configs/

# An unprivileged user. The model cache and the run dirs are volumes in docker-compose.yml; they exist here so that
# a fresh named volume takes this ownership.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin jetroll \
    && mkdir -p /home/jetroll/.cache/jetroll /app/runs \
    && chown -R jetroll:jetroll /home/jetroll /app/runs
USER jetroll

ENTRYPOINT ["jetroll"]
CMD ["--help"]
