"""The llama.cpp peers of `qpcbuild bench`: llama-cpp-python ("llama.cpp") and llama.cpp's own
prompt lookup program ("llama-lookup"). The parsing and the skip paths need neither; the tests that
run llama.cpp are skipped unless llama-cpp-python is installed (CI does not install it: a source
build), the SmolLM2 float32 GGUF exists (`make smollm2-gguf`), and, for llama-lookup,
$QPCBUILD_LLAMA_CPP_BIN names a folder holding the program."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks.peers import PEERS
from benchmarks.peers.llama_cpp import (LLAMA_CPP_BIN_ENV, _CountingDraft, _cut_at_eos,
                                      llama_cpp_peer, llama_lookup_peer, parse_lookup_output)

ROOT = Path(__file__).resolve().parents[3]
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
GGUF = SMOLLM2 / "model-f32.gguf"

# Real output of llama.cpp 0.5.0-dev (commit 0c1e570, the source llama-cpp-python 0.3.36 vendors)
#   llama-lookup -m model-f32.gguf -f prompt.txt --no-escape -n 31 --spec-draft-n-max 4 -t 2 \
#       -tb 2 -c 1024 --temp 0 --top-k 1 --seed 0 -lv 5
# on SmolLM2-135M-Instruct, prompt.txt holding 'def quicksort(arr):\n    """Sort a list."""\n'
# (-f drops the file's final newline, so it read 13 tokens, without it): stdout (the
# prompt and the generated text), then the lines of stderr that matter here, verbatim (the rest
# of its 4,600 debug lines, model loading and graph building, left out).
LOOKUP_SAMPLE = r'''

def quicksort(arr):
    """Sort a list."""
    return sorted(arr)

# Example usage:
arr = [5, 2, 4, 3, 1, 2



0.00.361.024 I cmn          init: llama threadpool init, n_threads = 2
0.00.361.052 D attach_threadpool: call
0.00.556.863 D the sampled target token (472, '
   ') did not match, or we ran out of drafted tokens
0.00.596.925 D the sampled target token (1003, ' return') did not match, or we ran out of drafted tokens
0.00.638.713 D the sampled target token (13156, ' sorted') did not match, or we ran out of drafted tokens
0.00.676.615 D the sampled target token (24, '(') did not match, or we ran out of drafted tokens
0.00.719.079 D the sampled target token (2110, 'arr') did not match, or we ran out of drafted tokens
0.00.760.530 D the sampled target token (25, ')') did not match, or we ran out of drafted tokens
0.00.799.306 D the sampled target token (198, '
') did not match, or we ran out of drafted tokens
0.00.838.307 D the sampled target token (198, '
') did not match, or we ran out of drafted tokens
0.00.880.646 D the sampled target token (19, '#') did not match, or we ran out of drafted tokens
0.00.928.195 D the sampled target token (12066, ' Example') did not match, or we ran out of drafted tokens
0.00.973.236 D the sampled target token (6486, ' usage') did not match, or we ran out of drafted tokens
0.01.014.101 D the sampled target token (42, ':') did not match, or we ran out of drafted tokens
0.01.060.042 D the sampled target token (198, '
') did not match, or we ran out of drafted tokens
0.01.107.212 D the sampled target token (2110, 'arr') did not match, or we ran out of drafted tokens
0.01.151.244 D the sampled target token (446, ' =') did not match, or we ran out of drafted tokens
0.01.190.784 D the sampled target token (933, ' [') did not match, or we ran out of drafted tokens
0.01.239.879 D the sampled target token (37, '5') did not match, or we ran out of drafted tokens
0.01.285.638 D the sampled target token (28, ',') did not match, or we ran out of drafted tokens
0.01.326.972 D the sampled target token (216, ' ') did not match, or we ran out of drafted tokens
0.01.369.842 D the sampled target token (34, '2') did not match, or we ran out of drafted tokens
0.01.410.036 D the sampled target token (28, ',') did not match, or we ran out of drafted tokens
0.01.452.450 D the sampled target token (216, ' ') did not match, or we ran out of drafted tokens
0.01.495.108 D the sampled target token (36, '4') did not match, or we ran out of drafted tokens
0.01.536.095 D the sampled target token (28, ',') did not match, or we ran out of drafted tokens
0.01.625.459 D the sampled target token matches the 0th drafted token (216, ' ') - accepted
0.01.625.585 D the sampled target token (35, '3') did not match, or we ran out of drafted tokens
0.01.672.186 D the sampled target token (28, ',') did not match, or we ran out of drafted tokens
0.01.734.940 D the sampled target token matches the 0th drafted token (216, ' ') - accepted
0.01.735.090 D the sampled target token (33, '1') did not match, or we ran out of drafted tokens
0.01.781.032 D the sampled target token (28, ',') did not match, or we ran out of drafted tokens
0.01.843.434 D the sampled target token matches the 0th drafted token (216, ' ') - accepted
0.01.843.553 D the sampled target token (34, '2') did not match, or we ran out of drafted tokens
0.01.843.723 I encoded   13 tokens in    0.130 seconds, speed:  346.856 t/s
0.01.843.724 I decoded   32 tokens in    1.287 seconds, speed:   24.857 t/s
0.01.843.725 I n_draft      = 4
0.01.843.727 I n_predict    = 32
0.01.843.727 I n_drafted    = 6
0.01.843.728 I t_draft_flat = 0.02 ms
0.01.843.730 I t_draft      = 0.39 ms, 65.17 us per token, 15345.27 tokens per second
0.01.843.730 I n_accept     = 3
0.01.843.731 I accept       = 50.000%
0.01.843.753 I common_perf_print:    graphs reused =         23
'''


def test_parse_lookup_output_reads_timing_counts_and_every_sampled_token():
    r = parse_lookup_output(LOOKUP_SAMPLE)
    assert (r["n_input"], r["encode_s"]) == (13, 0.130)
    assert (r["n_decoded"], r["decode_s"]) == (32, 1.287)
    assert (r["n_draft"], r["n_predict"], r["n_drafted"], r["n_accept"]) == (4, 32, 6, 3)
    # One id per sampled token, in order, whether it was an accepted draft or not; pieces that
    # hold a newline (ids 198, 472) span two lines of the log.
    assert len(r["tokens"]) == r["n_predict"] == 32
    assert r["tokens"][:8] == [472, 1003, 13156, 24, 2110, 25, 198, 198]
    assert r["tokens"][-6:] == [28, 216, 33, 28, 216, 34]
    assert LOOKUP_SAMPLE.count("matches the") == r["n_accept"]


def test_parse_lookup_output_without_debug_lines_has_no_tokens():
    quiet = "\n".join(line for line in LOOKUP_SAMPLE.splitlines() if " D " not in line)
    r = parse_lookup_output(quiet)
    assert r["tokens"] == [] and r["n_decoded"] == 32 and r["n_accept"] == 3


def test_parse_lookup_output_rejects_output_without_timing():
    with pytest.raises(ValueError, match="encoded"):
        parse_lookup_output("error while handling argument \"--draft\": the argument has been "
                            "removed\n")


def test_cut_at_eos_keeps_the_eos_and_the_limit():
    assert _cut_at_eos([5, 6, 2, 7, 8], {2}, 10) == [5, 6, 2]
    assert _cut_at_eos([5, 6, 7, 8], {2}, 3) == [5, 6, 7]
    assert _cut_at_eos([], {2}, 3) == []


def test_counting_draft_counts_calls_and_proposed_tokens():
    import numpy as np

    d = _CountingDraft(lambda ids: np.array(ids[-2:]) if len(ids) > 3 else np.array([], int))
    d(np.array([1, 2]))
    d(np.array([1, 2, 3, 4]))
    assert (d.calls, d.proposed) == (2, 2)


def _hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_llama_lookup_skipped_without_the_program(tmp_path, monkeypatch, peer_manifest):
    folder = _hf_folder(tmp_path)
    monkeypatch.delenv(LLAMA_CPP_BIN_ENV, raising=False)
    p = llama_lookup_peer(peer_manifest(folder, threads=1), [4], 16, {2}, None, print)
    assert p.status == "skipped" and LLAMA_CPP_BIN_ENV in p.note and not p.cases
    monkeypatch.setenv(LLAMA_CPP_BIN_ENV, str(tmp_path / "nowhere"))
    p = llama_lookup_peer(peer_manifest(folder, threads=1), [4], 16, {2}, None, print)
    assert p.status == "skipped" and "no such program" in p.note


def test_llama_lookup_skipped_without_a_gguf(tmp_path, monkeypatch, peer_manifest):
    folder = _hf_folder(tmp_path)
    exe = tmp_path / "bin" / "llama-lookup"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv(LLAMA_CPP_BIN_ENV, str(exe.parent))
    p = llama_lookup_peer(peer_manifest(folder, threads=1), [4], 16, {2}, None, print)
    assert p.status == "skipped" and ".gguf" in p.note
    # A bundle (not a recipe) records no checkpoint folder: the note says so, not "no .gguf".
    unknown = peer_manifest(folder, threads=1, local=False)
    p = llama_lookup_peer(unknown, [4], 16, {2}, None, print)
    assert p.status == "skipped" and "bench the recipe" in p.note and ".gguf" not in p.note


def test_llama_cpp_skipped_when_not_installed(tmp_path, monkeypatch, peer_manifest):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    p = llama_cpp_peer(peer_manifest(_hf_folder(tmp_path), threads=1), [4], 16, {2}, None,
                       print)
    assert p.status == "skipped" and "not installed" in p.note


def test_both_llama_peers_are_registered():
    assert PEERS["llama.cpp"] is llama_cpp_peer
    assert PEERS["llama-lookup"] is llama_lookup_peer


def test_llama_lookup_runner_command_prompt_file_and_figures(tmp_path, monkeypatch,
                                                            peer_manifest):
    """The runner against a stand-in program that records its arguments and prompt file and
    prints the captured output: the command line, the text it reads, what is counted."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = _hf_folder(tmp_path)
    (folder / "model-f32.gguf").write_bytes(b"GGUF")
    tok = Tokenizer(models.WordLevel({"def": 0, "f(x):": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (tmp_path / "sample.txt").write_text(LOOKUP_SAMPLE)
    exe = tmp_path / "bin" / "llama-lookup"
    exe.parent.mkdir()
    exe.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 0.5.0-dev (build 1, commit 0c1e570)"); sys.exit(0)
prompt = open(args[args.index("-f") + 1]).read()
json.dump({{"args": args, "prompt": prompt}}, open({str(tmp_path / "seen.json")!r}, "w"))
sys.stdout.write(open({str(tmp_path / "sample.txt")!r}).read())
""")
    exe.chmod(0o755)
    monkeypatch.setenv(LLAMA_CPP_BIN_ENV, str(exe.parent))
    p = llama_lookup_peer(peer_manifest(folder, threads=3, ctx=512), [4], 30, {198}, None, print)
    assert p.status == "ok" and p.version == "0.5.0-dev (commit 0c1e570)"
    assert [m.label for m, _ in p.cases] == ["target-only (no drafts)", "llama-lookup K=4"]
    acc: dict = {}
    outs, tokens, seconds = p.cases[1][1]([[0, 1]], acc)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["prompt"] == "def f(x):\n"  # our ids decoded, plus the newline -f drops
    args = seen["args"]
    opt = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("-")}
    assert (opt["--spec-draft-n-max"], opt["-t"], opt["-tb"], opt["-c"], opt["-n"]) == \
        ("4", "3", "3", "512", "29")
    assert (opt["--temp"], opt["--top-k"]) == ("0", "1") and "--no-escape" in args
    # Cut after the first EOS (198 here), kept as our engine keeps it.
    assert outs == [[472, 1003, 13156, 24, 2110, 25, 198]]
    assert tokens == 32 and seconds == pytest.approx(0.130 + 1.287)
    assert acc == {"prompt_token_mismatch": 1,  # 13 prompt tokens in the sample, 2 here
                   "draft_tokens_proposed": 6, "draft_tokens_accepted": 3}


# ---------------------------------------------------------------- with llama.cpp itself
def _sanity() -> tuple[list[int], list[int]]:
    """The prompt and greedy continuation that get_smollm2.py recorded from transformers on
    model.safetensors (conversion.json), as token ids."""
    from tokenizers import Tokenizer

    rec = json.loads((SMOLLM2 / "conversion.json").read_text())
    tok = Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    prompt = tok.encode(rec["sanity_prompt"]).ids
    full = tok.encode(rec["sanity_greedy_24"]).ids
    assert full[:len(prompt)] == prompt
    return prompt, full[len(prompt):]


# One thread: OpenMP's spinning waits would make more than one slow on a busy test machine.
needs_gguf = pytest.mark.skipif(not GGUF.is_file(), reason="no SmolLM2 float32 GGUF "
                                "(make smollm2-gguf)")


@needs_gguf
def test_llama_cpp_peer_reproduces_transformers_greedy_tokens_on_the_same_weights(
        peer_manifest):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    prompt, want = _sanity()
    p = llama_cpp_peer(peer_manifest(SMOLLM2, threads=1), [2], len(want), {2}, None, print)
    assert p.status == "ok", p.note
    assert [m.method for m, _ in p.cases] == ["target_only", "ngram"]
    for meas, run in p.cases:
        acc: dict = {}
        outs, tokens, seconds = run([prompt], acc)
        assert outs == [want] and tokens == len(want) and seconds > 0, meas.label
        if meas.method == "ngram":
            assert acc["rounds"] >= 1
            assert 0 <= acc["draft_tokens_accepted"] <= acc["draft_tokens_proposed"]


@needs_gguf
@pytest.mark.skipif(not os.environ.get(LLAMA_CPP_BIN_ENV), reason=f"${LLAMA_CPP_BIN_ENV} not set")
def test_llama_lookup_peer_reproduces_transformers_greedy_tokens(peer_manifest):
    prompt, want = _sanity()
    p = llama_lookup_peer(peer_manifest(SMOLLM2, threads=1), [4], len(want), {2}, None, print)
    assert p.status == "ok", p.note
    for meas, run in p.cases:
        acc: dict = {}
        outs, tokens, seconds = run([prompt], acc)
        assert outs == [want] and tokens >= len(want) and seconds > 0, meas.label
        assert acc["prompt_token_mismatch"] == 0
