"""The `llama-speculative` bench peer (llama.cpp's own draft-model speculative decoding): skip
paths, and the runner against a stand-in program printing llama-speculative's output format
(its match lines say "of sequence N", which the token parser must read too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.peers import PEERS
from benchmarks.peers.llama_cpp import LLAMA_CPP_BIN_ENV, llama_speculative_peer, parse_lookup_output

# The lines that matter, in the format of examples/speculative/speculative.cpp (llama.cpp
# 0.5.0-dev, the source llama-cpp-python 0.3.36 vendors), run with -lv 5.
SPECULATIVE_SAMPLE = r'''
0.00.500.100 D the sampled target token matches the 0th drafted token of sequence 0 (750, ' def') - accepted
0.00.500.200 D the sampled target token matches the 1th drafted token of sequence 0 (1477, ' add') - accepted
0.00.500.300 D the sampled target token (2877, '(a') did not match, or we ran out of drafted tokens
0.00.600.100 D the sampled target token matches the 0th drafted token of sequence 0 (11, ',') - accepted
0.00.600.200 D the sampled target token (293, ' b') did not match, or we ran out of drafted tokens
0.00.700.100 D the sampled target token (151645, '') did not match, or we ran out of drafted tokens
0.00.800.000 I encoded    9 tokens in    0.250 seconds, speed:   36.000 t/s
0.00.800.001 I decoded    6 tokens in    0.400 seconds, speed:   15.000 t/s
0.00.800.002 I
0.00.800.003 I n_draft   = 4
0.00.800.004 I n_predict = 6
0.00.800.005 I n_drafted = 12
0.00.800.006 I n_accept  = 3
0.00.800.007 I accept    = 25.000%
'''


def _folder(tmp_path: Path, name: str, gguf: str | None) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if gguf:
        (folder / gguf).write_bytes(b"GGUF")
    return folder


def test_parser_reads_speculative_match_lines():
    res = parse_lookup_output(SPECULATIVE_SAMPLE)
    assert res["tokens"] == [750, 1477, 2877, 11, 293, 151645]
    assert (res["n_input"], res["n_decoded"], res["n_drafted"], res["n_accept"]) == (9, 6, 12, 3)


def test_skipped_without_program_draft_or_gguf(tmp_path, monkeypatch, peer_manifest):
    target = _folder(tmp_path, "t", "model-f32.gguf")
    monkeypatch.delenv(LLAMA_CPP_BIN_ENV, raising=False)
    p = llama_speculative_peer(peer_manifest(target, threads=2, ctx=512), [4], 16, {2}, None,
                               print)
    assert p.status == "skipped" and LLAMA_CPP_BIN_ENV in p.note
    exe = tmp_path / "bin" / "llama-speculative"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv(LLAMA_CPP_BIN_ENV, str(exe.parent))
    p = llama_speculative_peer(peer_manifest(target, threads=2, ctx=512), [4], 16, {2}, None,
                               print)
    assert p.status == "skipped" and "no draft model" in p.note
    draft = _folder(tmp_path, "d", None)
    p = llama_speculative_peer(peer_manifest(target, draft, threads=2, ctx=512), [4], 16, {2},
                               None, print)
    assert p.status == "skipped" and "draft's checkpoint folder" in p.note


def test_registered():
    assert PEERS["llama-speculative"] is llama_speculative_peer


def test_runner_command_and_figures(tmp_path, monkeypatch, peer_manifest):
    from tokenizers import Tokenizer, models, pre_tokenizers

    target = _folder(tmp_path, "t", "model-f32.gguf")
    draft = _folder(tmp_path, "d", "model-q8_0.gguf")
    tok = Tokenizer(models.WordLevel({"def": 0, "add": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(target / "tokenizer.json"))
    (tmp_path / "sample.txt").write_text(SPECULATIVE_SAMPLE)
    exe = tmp_path / "bin" / "llama-speculative"
    exe.parent.mkdir()
    exe.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 0.5.0-dev (build 1, commit 0c1e570)"); sys.exit(0)
json.dump(args, open({str(tmp_path / "seen.json")!r}, "w"))
sys.stderr.write(open({str(tmp_path / "sample.txt")!r}).read())
""")
    exe.chmod(0o755)
    monkeypatch.setenv(LLAMA_CPP_BIN_ENV, str(exe.parent))
    p = llama_speculative_peer(peer_manifest(target, draft, threads=3, ctx=512), [2, 4], 5,
                               {151645}, None, print)
    assert p.status == "ok" and [m.label for m, _ in p.cases] == \
        ["llama-speculative K=2", "llama-speculative K=4"]
    acc: dict = {}
    outs, tokens, seconds = p.cases[1][1]([[0, 1]], acc)
    args = json.loads((tmp_path / "seen.json").read_text())
    opt = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("-")}
    assert (opt["-m"], opt["-md"]) == (str(target / "model-f32.gguf"),
                                       str(draft / "model-q8_0.gguf"))
    assert (opt["--spec-draft-n-max"], opt["--spec-draft-p-min"], opt["-t"], opt["-td"],
            opt["-c"], opt["-n"]) == ("4", "0", "3", "3", "512", "4")
    assert outs == [[750, 1477, 2877, 11, 293]]  # cut at max-new-tokens 5
    assert tokens == 6 and seconds == pytest.approx(0.25 + 0.4)
    assert acc == {"prompt_token_mismatch": 1, "draft_tokens_proposed": 12,
                   "draft_tokens_accepted": 3}


def test_a_quantized_target_peer_reads_its_own_gguf(tmp_path, monkeypatch, peer_manifest):
    """llama-speculative-q4_k_m runs the target's model-q4_k_m.gguf (get_peers.py writes it
    beside the float32 one); the plain peer keeps the float32 file; a missing file is named."""
    target = _folder(tmp_path, "t", "model-f32.gguf")
    draft = _folder(tmp_path, "d", "model-q4_0.gguf")
    exe = tmp_path / "bin" / "llama-speculative"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv(LLAMA_CPP_BIN_ENV, str(exe.parent))
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(
        str(target / "tokenizer.json"))
    manifest = peer_manifest(target, draft, threads=2, ctx=512)
    p = PEERS["llama-speculative-q4_k_m"](manifest, [2], 8, {2}, None, print)
    assert p.status == "skipped" and "model-q4_k_m.gguf" in p.note and "get_peers" in p.note
    (target / "model-q4_k_m.gguf").write_bytes(b"GGUF")
    p = PEERS["llama-speculative-q4_k_m"](manifest, [2], 8, {2}, None, print)
    assert p.status == "ok" and p.name == "llama-speculative-q4_k_m"
    assert p.info["target_gguf"] == str(target / "model-q4_k_m.gguf")
    assert [m.system for m, _ in p.cases] == ["llama-speculative-q4_k_m"]
    plain = llama_speculative_peer(manifest, [2], 8, {2}, None, print)
    assert plain.info["target_gguf"] == str(target / "model-f32.gguf")
