"""The component image's base, user and EFA layer, checked statically (no container engine runs here).

The base is a pytorch/pytorch tag that exists for the pinned torch, and the image's user
is uid/gid 1000 (what the job pods and the FSx init Job expect) even on an Ubuntu 24.04
base that already has a user there.

What a real build must contain for NCCL to use EFA between nodes: AWS's EFA installer run
in its container mode (libfabric with the efa provider and the aws-ofi-nccl plugin), a
build-time check that both landed, and the loader path NCCL finds the plugin through.
The per-job variables belong to the job manifests, not the image (the image also runs
the CPU steps); docs/eks.md says how to confirm on a cluster that NCCL chose EFA.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions() -> list[str]:
    """The Dockerfile's instructions with continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#")]
    return [
        " ".join(part.split()) for part in "\n".join(lines).replace("\\\n", " ").split("\n") if part.strip()
    ]


def test_the_efa_installer_runs_in_container_mode_from_a_pinned_version():
    run = next(i for i in _instructions() if "efa_installer.sh" in i)
    assert run.startswith("RUN ")
    assert re.search(r"ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+", DOCKERFILE)
    assert "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" in run
    flags = run.split("efa_installer.sh", 1)[1].split("&&", 1)[0].split()
    # No kernel module (the node's AMI has it), no limits file, no device check at build time.
    assert {"-y", "-g", "--skip-kmod", "--skip-limit-conf", "--no-verify"} <= set(flags)
    assert "rm -rf /tmp/aws-efa-installer" in run  # the installer does not stay in the image


def test_the_build_fails_without_libfabric_or_the_aws_ofi_nccl_plugin():
    run = next(i for i in _instructions() if "efa_installer.sh" in i)
    assert "/opt/amazon/efa/lib*/libfabric.so" in run
    assert "libnccl-net" in run and "/opt/amazon/ofi-nccl" in run
    assert "exit 1" in run


def test_nccl_finds_the_plugin_and_libfabric_on_the_loader_path():
    env = " ".join(i for i in _instructions() if i.startswith("ENV "))
    ld_path = re.search(r"LD_LIBRARY_PATH=(\S+)", env)
    assert ld_path
    entries = ld_path.group(1).split(":")
    assert any(e.startswith("/opt/amazon/ofi-nccl/lib") for e in entries)
    assert "/opt/amazon/efa/lib" in entries and entries[-1] == "${LD_LIBRARY_PATH}"
    assert "/opt/amazon/efa/bin" in env  # fi_info, to check the provider by hand (docs/eks.md)


def test_the_efa_layer_comes_before_the_project_and_per_job_variables_stay_out():
    instructions = _instructions()
    efa = next(n for n, i in enumerate(instructions) if "efa_installer.sh" in i)
    project = next(n for n, i in enumerate(instructions) if i.startswith("COPY setup.cfg"))
    assert efa < project  # a code change does not rebuild the EFA layer
    env = " ".join(i for i in instructions if i.startswith("ENV "))
    assert "FI_PROVIDER" not in env and "FI_EFA_USE_DEVICE_RDMA" not in env  # the job manifests set them
    assert instructions[-3:-1] == ["WORKDIR /home/rtp", "ENTRYPOINT []"] and "USER 1000:1000" in instructions


# CUDA versions torch 2.13.0 is built for (pytorch/pytorch v2.13.0,
# .github/scripts/generate_binary_build_matrix.py: CUDA_ARCHES); its docker release workflow
# tags pytorch/pytorch:<torch>-cuda<X.Y>-cudnn9-{runtime,devel} for each of them.
TORCH_2_13_CUDA = ("12.6", "12.9", "13.0", "13.2")


def test_the_default_base_image_is_a_published_pytorch_tag_for_the_pinned_torch():
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert base
    found = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn9-runtime", base.group(1))
    assert found, base.group(1)
    pinned = re.search(r"^\s*torch==(\S+)$", (ROOT / "setup.cfg").read_text(), re.M)
    assert pinned and found.group(1) == pinned.group(1)
    assert found.group(2) in TORCH_2_13_CUDA, f"no torch {found.group(1)} image for CUDA {found.group(2)}"


def test_the_image_user_is_uid_and_gid_1000_even_on_a_base_that_has_one():
    from components.train.jobs import RUN_AS_USER

    instructions = _instructions()
    assert f"USER {RUN_AS_USER}:{RUN_AS_USER}" in instructions  # what the job pods run as
    run = next(i for i in instructions if "useradd" in i)
    # Ubuntu 24.04 images ship user `ubuntu` as 1000: it goes before rtp takes the ids.
    assert run.index("userdel") < run.index("groupadd --gid 1000 rtp") < run.index("useradd")
    assert "getent passwd 1000" in run and "getent group 1000" in run
    assert "useradd --create-home --uid 1000 --gid 1000 rtp" in run


def test_every_package_copied_into_the_workdir_is_byte_compiled_after_the_copy():
    # `python -m trainer` in WORKDIR imports these copies, which uid 1000 cannot compile into.
    instructions = _instructions()
    copied = [i.split()[1] for i in instructions if re.fullmatch(r"COPY (\w+) \1", i)]
    assert {"trainer", "components", "rtp_cli", "rtp_prefork"} <= set(copied)
    compiling = [n for n, i in enumerate(instructions) if "python -m compileall" in i]
    assert compiling, "no RUN byte-compiles the copied packages"
    run = instructions[compiling[0]]
    last_copy = max(n for n, i in enumerate(instructions) if re.fullmatch(r"COPY (\w+) \1", i))
    assert compiling[0] > last_copy
    arguments = run.split("python -m compileall", 1)[1].split("&&", 1)[0].split()
    assert set(copied) <= set(arguments)
    assert instructions.index(run) < next(n for n, i in enumerate(instructions) if i.startswith("USER "))
