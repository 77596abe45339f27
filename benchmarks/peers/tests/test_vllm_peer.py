"""The "vllm" bench peer: skip paths, and its worker protocol against a stand-in for the vLLM
environment's python (vLLM itself is a 3 GB environment outside the project; the worker's
vLLM calls are exercised where one exists, by `qpcbuild bench --peers vllm`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.peers import PEERS
from benchmarks.peers.vllm_peer import VLLM_PYTHON_ENV, vllm_peer
from benchmarks.peers.vllm_worker import REPLY


def _checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """Folders that pass for a target's and a draft's checkpoint (a config.json each)."""
    for role in ("target", "draft"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text("{}")
    return tmp_path / "target", tmp_path / "draft"


def test_registered_and_skipped_without_the_environment(tmp_path, monkeypatch, peer_manifest):
    assert PEERS["vllm"] is vllm_peer
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    p = vllm_peer(peer_manifest(*_checkpoints(tmp_path)), [4], 16, {2}, None, print)
    assert p.status == "skipped" and VLLM_PYTHON_ENV in p.note and not p.cases
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    other = tmp_path / "other"
    other.mkdir()
    p = vllm_peer(peer_manifest(*_checkpoints(other)), [4], 16, {2}, None, print)
    assert p.status == "skipped" and "no such program" in p.note


def test_worker_protocol_one_engine_at_a_time(tmp_path, monkeypatch, peer_manifest):
    starts = tmp_path / "starts.txt"
    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import json, sys
if sys.argv[2:] == ["--version"]:
    print("INFO noise"); print({REPLY!r} + json.dumps({{"vllm": "0.32.0"}})); sys.exit(0)
cfg = json.load(open(sys.argv[2]))
open({str(starts)!r}, "a").write(json.dumps(cfg) + "\\n")
print("INFO loading"); print({REPLY!r} + json.dumps({{"ready": True}}), flush=True)
spec = cfg["speculative_config"]
for line in sys.stdin:
    req = json.loads(line)
    outs = [p[::-1][:req["max_new"]] for p in req["prompts"]]
    print({REPLY!r} + json.dumps({{"outputs": outs, "tokens": sum(map(len, outs)),
          "seconds": 0.5, "drafts": 2, "draft_tokens": 8 if spec else 0,
          "accepted": 6 if spec else 0}}), flush=True)
""")
    fake.chmod(0o755)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(fake))
    manifest = peer_manifest(*_checkpoints(tmp_path))
    p = vllm_peer(manifest, [3], 2, {2}, None, print)
    assert p.status == "ok" and p.version == "0.32.0"
    assert [m.label for m, _ in p.cases] == ["target-only", "draft_model K=3"]
    base, spec = p.cases[0][1], p.cases[1][1]
    assert base([[1, 2, 3]], None) == ([[3, 2]], 2, 0.5)
    acc: dict = {}
    assert spec([[4, 5]], acc) == ([[5, 4]], 2, 0.5)
    assert acc == {"draft_tokens_proposed": 8, "draft_tokens_accepted": 6}
    spec([[4, 5]], acc)  # the same engine again: no restart
    base([[1]], None)    # another configuration: a restart
    configs = [json.loads(x) for x in starts.read_text().splitlines()]
    assert [c["speculative_config"] for c in configs] == [
        None, {"method": "draft_model", "model": manifest.draft.source.path,
               "num_speculative_tokens": 3}, None]
    assert all(c["max_model_len"] == 256 for c in configs)
