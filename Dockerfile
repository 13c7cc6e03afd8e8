# The component image: every pipeline step runs on it (rtp compile --image <this image>).
# It cannot be built on the development machines (no container engine); build and push it
# as described in docs/eks.md.
#
# BASE_IMAGE must carry CUDA-enabled torch 2.13.0 on Python >= 3.11. pip treats the
# installed 2.13.0+cuXXX build as satisfying setup.cfg's torch==2.13.0, so it is kept.
# torch 2.13.0 is built for CUDA 12.6, 12.9, 13.0 and 13.2 (no 12.8), and pytorch/pytorch
# is tagged <torch>-cuda<X.Y>-cudnn9-runtime for each; 13.0 is torch's stable CUDA (the
# PyPI build) and needs an NVIDIA driver >= 580 on the nodes (docs/eks.md, step 7).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# EFA for multi-node NCCL (docs/eks.md, "EFA"): the base image has neither libfabric nor the
# aws-ofi-nccl plugin, so without this layer NCCL falls back to TCP sockets between nodes.
# AWS's EFA installer puts libfabric (with its efa provider) under /opt/amazon/efa and the
# aws-ofi-nccl plugin (libnccl-net-ofi.so, which NCCL loads as its network plugin) under
# /opt/amazon/ofi-nccl. The flags are the container install from the EC2 user guide: no
# kernel module (the node's AMI loads it), no limits file, no check for an EFA device
# (there is none at build time); -g installs the GPUDirect-capable build. The pin is the
# latest stable release named by the EC2 user guide's "Get started with EFA and NCCL" (step 5);
# newer ones are listed at https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html
ARG EFA_INSTALLER_VERSION=1.50.0
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

# No Lustre client tools (lfs): Ubuntu's archive has none (AWS and Whamcloud build them per
# kernel), so the stage step skips striping and says so (components/stage_data/lustre.py).

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/rtp
# Metadata first, so a code-only change does not reinstall the dependencies.
COPY setup.cfg pyproject.toml README.md ./
RUN mkdir -p pipelines rtp_cli rtp_support components trainer rtp_prefork benchmarks \
 && touch pipelines/__init__.py rtp_cli/__init__.py rtp_support/__init__.py components/__init__.py trainer/__init__.py rtp_prefork/__init__.py benchmarks/__init__.py \
 && python -m pip install . \
 && python -m pip uninstall -y rtp
COPY pipelines pipelines
COPY rtp_cli rtp_cli
COPY rtp_support rtp_support
COPY components components
COPY trainer trainer
COPY rtp_prefork rtp_prefork
COPY benchmarks benchmarks
# The steps, the job pods (components/train/jobs.py) and deploy/eks/fsx-init-job.yaml all
# expect uid and gid 1000: Ubuntu 24.04 bases already have a user `ubuntu` there, which is
# removed first so the ids are rtp's and useradd does not fail on a taken uid.
# `python -m` in WORKDIR imports these copies, not site-packages', and uid 1000 cannot write
# their __pycache__: compiled here, each process does not compile them again.
RUN python -m pip install --no-deps . \
 && python -m compileall -q pipelines rtp_cli rtp_support components trainer rtp_prefork benchmarks \
 && python -c "import torch, kfp, kfp.kubernetes, nvidia_resiliency_ext, mlflow, boto3, trainer.loop, components, rtp_cli.main" \
 && if getent passwd 1000 >/dev/null; then userdel "$(getent passwd 1000 | cut -d: -f1)"; fi \
 && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
 && groupadd --gid 1000 rtp \
 && useradd --create-home --uid 1000 --gid 1000 rtp

USER 1000:1000
WORKDIR /home/rtp
ENTRYPOINT []
CMD ["rtp", "--help"]
