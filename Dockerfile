# syntax=docker/dockerfile:1
# The project in an image, for the Prefect Docker and Kubernetes work pools (deployments/README.md).
#
#   docker build -t rlhf-dag:cpu .                  # CPU torch (the default, last stage)
#   docker build --target cuda -t rlhf-dag:cuda .   # CUDA torch + the `vllm` extra, for the GPU pools
#
# It installs as the README does: torch first and pinned (TORCH_SPEC, as in the Makefile), then the
# project in editable mode from /opt/rlhf-dag, the directory the deployments' pull step moves into
# (deployments/prefect-cluster.yaml: the flow entrypoints are relative to it). The GPU stage needs
# only the host's NVIDIA driver and container toolkit: the CUDA libraries come with torch's wheels.
# Nothing here has been built on the project's CI machines (they have no Docker).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
# g++: DeepSpeed compiles its CPU ops (shared-memory communication) the first time they are used
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    TOKENIZERS_PARALLELISM=false
WORKDIR /opt/rlhf-dag
COPY pyproject.toml README.md ./
COPY rlhf_core rlhf_core
COPY rlhf_cli rlhf_cli
COPY tasks tasks
COPY flows flows
COPY deployments deployments
COPY configs configs
COPY data data

FROM base AS cuda
# PyPI's Linux torch wheel is the CUDA build; naming the pin again in the second install keeps
# pip from moving torch to satisfy a newer vllm (vllm 0.32 pins torch==2.13.0, 0.33 torch==2.14.0).
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install ${TORCH_SPEC} && pip install -e '.[vllm]' ${TORCH_SPEC}

FROM base AS cpu
# the CPU wheel index keeps the multi-GB CUDA build out of a CPU image
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN pip install ${TORCH_SPEC} && pip install -e .
