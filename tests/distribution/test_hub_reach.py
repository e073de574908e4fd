"""`laya-aot fetch hf://...` without network: one line saying so, then the local cache only; not a minute of
retries logged twice (issue 22, item 8)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from laya_aot.cli import hub_reach

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connection is refused at once
    return port


def test_fetch_without_network_says_so_once_and_uses_the_cache_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    env.update(HF_ENDPOINT="http://127.0.0.1:%d" % _closed_port(), HF_HOME=str(tmp_path / "hf-home"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "laya_aot.cli", "fetch", "hf://acme/bundles"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2, p.stderr                                   # the network, then the cache miss
    assert "cannot be reached" in lines[0] and "using the local cache only" in lines[0]
    assert "HF_HUB_OFFLINE is set and the cache does not hold it" in lines[1]
    assert "Retrying" not in p.stderr and "Traceback" not in p.stderr


def test_no_check_behind_a_proxy_or_when_offline_is_asked(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:%d" % _closed_port())
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    assert "does not answer" in hub_reach.unreachable(timeout=1)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub_reach.unreachable(timeout=1) is None                    # only the proxy knows the way
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_reach.unreachable(timeout=1) is None
