# The component image: every pipeline step runs on it (rtp compile --image <this image>).
# It cannot be built on the development machines (no container engine); build and push it
# as described in docs/eks.md.
#
# BASE_IMAGE must carry CUDA-enabled torch 2.13.0 on Python >= 3.11. pip treats the
# installed 2.13.0+cuXXX build as satisfying setup.cfg's torch==2.13.0, so it is kept.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/rtp
# Metadata first, so a code-only change does not reinstall the dependencies.
COPY setup.cfg pyproject.toml README.md ./
RUN mkdir -p pipelines rtp_cli components trainer benchmarks \
 && touch pipelines/__init__.py rtp_cli/__init__.py components/__init__.py trainer/__init__.py benchmarks/__init__.py \
 && python -m pip install . \
 && python -m pip uninstall -y rtp
COPY pipelines pipelines
COPY rtp_cli rtp_cli
COPY components components
COPY trainer trainer
COPY benchmarks benchmarks
RUN python -m pip install --no-deps . \
 && python -c "import torch, kfp, kfp.kubernetes, nvidia_resiliency_ext, mlflow, boto3, trainer.loop, components, rtp_cli.main" \
 && useradd --create-home --uid 1000 rtp

USER 1000
WORKDIR /home/rtp
ENTRYPOINT []
CMD ["rtp", "--help"]
