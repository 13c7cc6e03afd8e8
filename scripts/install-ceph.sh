#!/usr/bin/env bash
# Install the Debian packages of a single-node Ceph RGW (the real S3 server the staging
# integration tests start on loopback). A no-op when they are already installed; uses sudo
# when not root. Set RTP_SKIP_CEPH_INSTALL=1 to skip (those tests then skip with a reason).
set -euo pipefail
if [ "${RTP_SKIP_CEPH_INSTALL:-0}" = "1" ]; then
    echo "install-ceph: skipped (RTP_SKIP_CEPH_INSTALL=1)"
    exit 0
fi
PACKAGES="radosgw ceph-mon ceph-osd ceph-common"
if command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null \
    && command -v radosgw-admin >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install-ceph: no apt-get here; install $PACKAGES yourself (the Ceph tests skip without them)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-ceph: not root and no passwordless sudo; install $PACKAGES yourself" >&2
        echo "install-ceph: (the Ceph tests skip without them)" >&2
        exit 0
    fi
fi
echo "install-ceph: installing $PACKAGES (about 235 MB)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
