#!/usr/bin/env bash
# Fetch, on a machine with PyPI access, the wheels the GPU machine lacks (CPython 3.12,
# x86-64 Linux) into the git-ignored benchmarks/wheels/ (RTP_WHEELS), so that they travel
# with the working tree to the GPU machine, where benchmarks/gpu_setup.sh installs the
# missing ones with --no-deps --no-index. Torch is never fetched: the GPU machine has it.
#
# Fetched: nvidia-resiliency-ext 0.4.1 and its dependencies but torch, each pinned. Its
# metadata also names `pynvml`, a distribution whose `pynvml` module nvidia-ml-py provides:
# not fetched. After the download every Requires-Dist of the NVRx wheel is checked against
# what was fetched. Then the wheels' total and the whole travelling tree (tracked and
# untracked-not-ignored files plus the wheels) are printed: over 64 MiB the script fails.
#
#   scripts/fetch-gpu-wheels.sh           download (the folder is emptied first), then measure
#   scripts/fetch-gpu-wheels.sh --check   only measure what is there
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${RTP_WHEELS:-benchmarks/wheels}
PYTHON=${PYTHON:-python3}
LIMIT_BYTES=$((64 * 1024 * 1024))
PINS=(
  nvidia-resiliency-ext==0.4.1
  defusedxml==0.7.1
  nvidia-ml-py==13.615.71
  packaging==26.4
  psutil==7.2.2
  pyyaml==6.0.3
)
PROVIDED_ELSEWHERE="torch pynvml"  # on the GPU machine already / the module comes with nvidia-ml-py

case "${1:-}" in
  --check) ;;
  "")
    rm -rf "$DEST" && mkdir -p "$DEST"
    platforms=()
    # pip matches manylinux tags exactly: every glibc level up to the GPU machine's (2.39).
    for n in 17 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$DEST" "${PINS[@]}"
    ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

"$PYTHON" - "$DEST" "$LIMIT_BYTES" "$PROVIDED_ELSEWHERE" <<'PY'
import re, subprocess, sys, zipfile
from pathlib import Path

dest, limit, elsewhere = Path(sys.argv[1]), int(sys.argv[2]), set(sys.argv[3].split())
wheels = sorted(dest.glob("*.whl"))
def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
fetched = {canonical(w.name.split("-")[0]) for w in wheels}
nvrx = [w for w in wheels if canonical(w.name.split("-")[0]) == "nvidia-resiliency-ext"]
if not nvrx:
    sys.exit(f"fetch-gpu-wheels: no nvidia-resiliency-ext wheel in {dest} (run without --check)")
with zipfile.ZipFile(nvrx[0]) as archive:
    metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    requires = [line.split(":", 1)[1].strip() for line in archive.read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
needed = {canonical(re.split(r"[\s(<>=!~;\[]", r, maxsplit=1)[0]) for r in requires}
lacking = sorted(needed - fetched - elsewhere)
if lacking:
    sys.exit(f"fetch-gpu-wheels: {nvrx[0].name} needs {', '.join(lacking)}, not fetched: add it to PINS")
for wheel in wheels:
    print(f"fetch-gpu-wheels: {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
wheels_bytes = sum(w.stat().st_size for w in wheels)
listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True).stdout
tree_bytes = sum(Path(p).stat().st_size for p in listed.decode().split("\0") if p and Path(p).is_file())
total = wheels_bytes + tree_bytes
print(f"fetch-gpu-wheels: wheels {wheels_bytes / 2**20:.2f} MiB + working tree {tree_bytes / 2**20:.2f} MiB "
      f"= {total / 2**20:.2f} MiB of the 64 MiB that travel with a run (carry: [\"{dest}\"])")
if total > limit:
    sys.exit(f"fetch-gpu-wheels: {total / 2**20:.2f} MiB is over 64 MiB: remove wheels the GPU machine has, or untracked files")
PY
