"""A real nginx on loopback running ``docs/deploy.md``'s configuration (``.ci/run`` installs nginx)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.serving import await_health

DEPLOY = Path(__file__).parent.parent / "docs" / "deploy.md"
DOC_WORKERS = ("127.0.0.1:8001", "127.0.0.1:8002")


def documented_config() -> str:
    """The ``nginx`` block of ``docs/deploy.md``: the configuration users are told to run."""
    blocks = re.findall(r"```nginx\n(.*?)```", DEPLOY.read_text(), re.S)
    assert len(blocks) == 1, "docs/deploy.md must hold one nginx configuration"
    return blocks[0]


def executable() -> str:
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
    if found is None:
        pytest.skip("nginx is not installed and this test needs it: apt-get install -y nginx (.ci/run does)")
    return found


@contextlib.contextmanager
def nginx(folder: Path, port: int, workers: list[str]) -> Iterator[str]:
    """nginx on ``127.0.0.1:port`` in front of ``workers`` (``host:port``), configured as documented;
    yields its base URL and stops it on exit."""
    site = documented_config().replace("listen 8080;", f"listen 127.0.0.1:{port};")
    for documented, worker in zip(DOC_WORKERS, workers, strict=True):
        site = site.replace(f"server {documented};", f"server {worker};")
    temp = "\n".join(f"    {kind}_temp_path {folder}/{kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                            "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""  # else root's workers run as nobody, who cannot write here
    conf = folder / "nginx.conf"
    conf.write_text(f"{user}worker_processes 1;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log warn;\n"
                    f"events {{ worker_connections 256; }}\nhttp {{\n    access_log off;\n{temp}\n{site}}}\n")
    proc = subprocess.Popen([executable(), "-p", str(folder), "-c", str(conf), "-e", str(folder / "error.log"),
                             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await_health(proc, port, "nginx", 30, lambda: (folder / "error.log").read_text()[-2000:])
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


