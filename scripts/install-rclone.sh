#!/usr/bin/env bash
# Install Debian's rclone, the fastest common tool `rtp bench staging` compares `rtp stage`
# with. A no-op when rclone is installed; uses sudo when not root. Set
# RTP_SKIP_RCLONE_INSTALL=1 to skip (the benchmark then reports rclone as skipped, with why).
set -euo pipefail
if [ "${RTP_SKIP_RCLONE_INSTALL:-0}" = "1" ]; then
    echo "install-rclone: skipped (RTP_SKIP_RCLONE_INSTALL=1)"
    exit 0
fi
if command -v rclone >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install-rclone: no apt-get here; install rclone yourself (the benchmark skips it without)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-rclone: not root and no passwordless sudo; install rclone yourself" >&2
        exit 0
    fi
fi
echo "install-rclone: installing rclone"
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y -qq --no-install-recommends rclone >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends rclone >/dev/null
fi
