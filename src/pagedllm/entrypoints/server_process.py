"""Helpers for programs that run `pagedllm serve` as a child process (the serving benchmarks, the end-to-end
tests): a free local port, and waiting until the server answers /health."""
from __future__ import annotations

import socket
import subprocess
import time
from typing import Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300, log_path: Optional[str] = None) -> None:
    """Poll url + "/health" until it answers 200. Raises RuntimeError when the process exits first (with the
    tail of its log, if given) or when timeout_s passes (the process is then killed)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = ""
            if log_path is not None:
                with open(log_path, errors="replace") as f:
                    tail = ":\n" + f.read()[-4000:]
            raise RuntimeError(f"the server exited with code {proc.returncode}{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer {url}/health within {timeout_s:.0f} s")


def nginx_gateway_config(deploy_nginx_dir: str, workdir: str, listen_port: int, upstream_ports: list[int]) -> str:
    """Lay out the repository's nginx gateway config (deploy/nginx) in `workdir` for a loopback run: the same
    files, with the listen address set to 127.0.0.1:listen_port and the replica list to the given local ports.
    Returns the path of the main nginx.conf."""
    import os
    import re
    import shutil

    conf_d = os.path.join(workdir, "conf.d")
    os.makedirs(conf_d, exist_ok=True)
    shutil.copy(os.path.join(deploy_nginx_dir, "nginx.conf"), workdir)
    with open(os.path.join(deploy_nginx_dir, "conf.d", "pagedllm.conf")) as f:
        gateway = f.read()
    gateway, count = re.subn(r"^(\s*)listen 80;", rf"\1listen 127.0.0.1:{listen_port};", gateway, flags=re.M)
    if count != 1:
        raise ValueError("deploy/nginx/conf.d/pagedllm.conf must have exactly one 'listen 80;'")
    with open(os.path.join(conf_d, "pagedllm.conf"), "w") as f:
        f.write(gateway)
    with open(os.path.join(deploy_nginx_dir, "conf.d", "upstreams.inc")) as f:
        template = [line for line in f if line.strip().startswith("server ")]
    if len(template) != 1:
        raise ValueError("deploy/nginx/conf.d/upstreams.inc must have exactly one 'server' line")
    with open(os.path.join(conf_d, "upstreams.inc"), "w") as f:
        for port in upstream_ports:  # the same server parameters (max_fails, fail_timeout), local addresses
            f.write(re.sub(r"server \S+", f"server 127.0.0.1:{port}", template[0], count=1))
    return os.path.join(workdir, "nginx.conf")


def start_nginx(conf_path: str, log_path: str) -> subprocess.Popen:
    """Run nginx in the foreground on `conf_path` (its directory is the prefix: pid file, temp dirs)."""
    import os
    import shutil

    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx is None:
        raise FileNotFoundError("nginx is not installed (Debian: apt-get install nginx)")
    prefix = os.path.dirname(os.path.abspath(conf_path))
    directives = f"daemon off; pid {prefix}/nginx.pid;"
    if os.geteuid() == 0:  # workers would run as `nobody`, who cannot enter a private temp dir
        directives += " user root;"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([nginx, "-e", "stderr", "-p", prefix + "/", "-c", conf_path, "-g", directives],
                                stdout=log, stderr=subprocess.STDOUT)
    return proc
