"""run.py: `qpcbuild bench` with llama.cpp's and vLLM's peers added through the package's public
API. The peers themselves are tested beside this file; here, that run.py makes them known to
bench (the package alone refuses them) and passes the rest of the command line on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUN = ROOT / "benchmarks" / "peers" / "run.py"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.mark.parametrize("peer", ["llama.cpp", "llama-lookup", "llama-speculative", "vllm"])
def test_run_accepts_the_peers_the_package_refuses(peer, tmp_path):
    missing = tmp_path / "no-such-bundle"
    alone = _bench("-m", "qpcbuild", "bench", str(missing), "--peers", peer)
    assert alone.returncode == 2 and "benchmarks/peers/run.py" in alone.stderr + alone.stdout
    # through run.py the peer is known: what stops the same command is the missing bundle
    ran = _bench(str(RUN), str(missing), "--peers", peer)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    out = ran.stdout + ran.stderr
    assert "no-such-bundle" in out and f"peer '{peer}'" not in out
