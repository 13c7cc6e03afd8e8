"""A real S3 server on loopback: single-node Ceph RGW for integration tests and benchmarks.

One monitor, one bluestore OSD on a sparse file and one radosgw, all in a temporary
folder, on free 127.0.0.1 ports, with cephx off (`auth ... = none`) and pools of size 1.
The monitor speaks only the v1 messenger: with msgr2 and auth none, radosgw 16.2 never
gets past AUTH_CONNECTING. Needs the Debian packages radosgw, ceph-mon, ceph-osd and
ceph-common (`scripts/install-ceph.sh`); `CephRGW.missing()` says which are absent.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from types import TracebackType
from typing import cast

from rtp_support.embedded_s3 import free_port

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
ACCESS_KEY = "rtp-test-access"
SECRET_KEY = "rtp-test-secret"


class OSDExited(RuntimeError):
    """The OSD daemon exited during start-up."""


class CephRGW:
    def __init__(self, folder: Path | None = None, start_timeout_s: float = 120.0) -> None:
        self._tmp = None if folder else tempfile.TemporaryDirectory(prefix="rtp-ceph-")
        self.folder = Path(folder or self._tmp.name)  # type: ignore[union-attr]
        self.start_timeout_s = start_timeout_s
        self.processes: list[subprocess.Popen[bytes]] = []
        self.endpoint_url = ""

    @staticmethod
    def missing() -> list[str]:
        return [b for b in BINARIES if shutil.which(b) is None]

    def _run(self, *args: str, timeout_s: float = 60) -> str:
        result = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result.stdout

    def _daemon(self, name: str, *args: str) -> None:
        log = (self.folder / "log" / f"{name}.out").open("wb")
        self.processes.append(
            subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        )

    def start(self, attempts: int = 3) -> CephRGW:
        """Start the three daemons; a start whose OSD exits at boot is retried from scratch.

        On a busy machine the OSD now and then exits right after boot ("mon_cmd_maybe_osd_create
        fail: 'wrong fsid'"; cause not found, a fixed --osd-uuid does not avoid it); a fresh
        cluster in a fresh folder then starts normally.
        """
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except OSDExited:
                if attempt == attempts:
                    raise
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder.mkdir(parents=True, exist_ok=True)
        raise AssertionError("unreachable")

    def _start_once(self) -> CephRGW:
        d = self.folder
        for sub in ("mon", "osd", "run", "log", "rgw"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        fsid, mon_port, rgw_port = str(uuid.uuid4()), free_port(), free_port()
        conf = d / "ceph.conf"
        conf.write_text(
            f"""[global]
fsid = {fsid}
mon host = 127.0.0.1:{mon_port}
ms bind msgr2 = false
public addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
osd objectstore = bluestore
bluestore block create = true
bluestore block size = 17179869184
osd data = {d}/osd
mon data = {d}/mon
run dir = {d}/run
log file = {d}/log/$name.log
admin socket = {d}/run/$name.asok
keyring = {d}/keyring
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {d}/rgw
"""
        )
        (d / "keyring").touch()
        c = str(conf)
        self._run(
            "monmaptool",
            "--create",
            "--addv",
            "a",
            f"[v1:127.0.0.1:{mon_port}]",
            "--fsid",
            fsid,
            str(d / "monmap"),
        )
        self._run("ceph-mon", "-c", c, "--mkfs", "-i", "a", "--monmap", str(d / "monmap"))
        self._daemon("mon", "ceph-mon", "-c", c, "-i", "a", "-f")
        self._run("ceph", "-c", c, "--connect-timeout", "30", "osd", "create")
        self._run("ceph-osd", "-c", c, "-i", "0", "--mkfs", timeout_s=120)
        self._daemon("osd", "ceph-osd", "-c", c, "-i", "0", "-f")
        self._daemon("rgw", "radosgw", "-c", c, "-n", "client.rgw", "-f")
        self.endpoint_url = f"http://127.0.0.1:{rgw_port}"
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            for process in self.processes:
                if process.poll() is not None:
                    self._stop_daemons()
                    kind = OSDExited if cast(list[str], process.args)[0] == "ceph-osd" else RuntimeError
                    raise kind(f"a Ceph daemon exited ({process.args!r}); logs in {d / 'log'}")
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"radosgw did not answer within {self.start_timeout_s} s; logs in {d / 'log'}"
                    ) from None
                time.sleep(0.5)
        self._run(
            "radosgw-admin",
            "-c",
            c,
            "user",
            "create",
            "--uid=rtp",
            "--display-name=rtp",
            f"--access-key={ACCESS_KEY}",
            f"--secret={SECRET_KEY}",
        )
        return self

    def credentials(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self) -> None:
        self._stop_daemons()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _stop_daemons(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    def __enter__(self) -> CephRGW:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
