# The component image: every pipeline step runs on it (rtp compile --image <this image>).
# It cannot be built on the development machines (no container engine); build and push it
# as described in docs/eks.md.
#
# BASE_IMAGE must carry CUDA-enabled torch 2.13.0 on Python >= 3.11. pip treats the
# installed 2.13.0+cuXXX build as satisfying setup.cfg's torch==2.13.0, so it is kept.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# EFA for multi-node NCCL (docs/eks.md, "EFA"): the base image has neither libfabric nor the
# aws-ofi-nccl plugin, so without this layer NCCL falls back to TCP sockets between nodes.
# AWS's EFA installer puts libfabric (with its efa provider) under /opt/amazon/efa and the
# aws-ofi-nccl plugin (libnccl-net-ofi.so, which NCCL loads as its network plugin) under
# /opt/amazon/ofi-nccl. The flags are the container install from the EC2 user guide: no
# kernel module (the node's AMI loads it), no limits file, no check for an EFA device
# (there is none at build time); -g installs the GPUDirect-capable build. Check
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html for newer versions.
ARG EFA_INSTALLER_VERSION=1.38.0
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends curl ca-certificates \
 && curl -fsSL -o /tmp/efa.tar.gz https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz \
 && tar -xzf /tmp/efa.tar.gz -C /tmp \
 && cd /tmp/aws-efa-installer \
 && ./efa_installer.sh -y -g --skip-kmod --skip-limit-conf --no-verify \
 && cd / && rm -rf /tmp/aws-efa-installer /tmp/efa.tar.gz /var/lib/apt/lists/* \
 && ls /opt/amazon/efa/lib*/libfabric.so* \
 && ls /opt/amazon/ofi-nccl/lib*/libnccl-net*.so* /opt/amazon/ofi-nccl/lib/*/libnccl-net*.so* 2>/dev/null | grep -q . \
 || { echo "the EFA installer did not install libfabric and aws-ofi-nccl where expected" >&2; exit 1; }
# NCCL finds the plugin (libnccl-net*.so) and libfabric through the loader path. The
# per-job variables (FI_PROVIDER=efa, FI_EFA_USE_DEVICE_RDMA on p4d/p5) are set by the job
# manifests (components/train/jobs.py), not here: the same image also runs CPU steps.
ENV PATH=/opt/amazon/efa/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:/opt/amazon/efa/lib64:${LD_LIBRARY_PATH}

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
