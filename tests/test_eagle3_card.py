"""An EAGLE-3 head on the Cloud AI card: its card graph (retained-state KV in the target's
dialect) equals a transformers forward of the head on ONNX Runtime; an eagle3 recipe for the card
plans, emits and (with a stand-in compiler) compiles the head's own QPC beside the target's,
which `finish` and `doctor` know; `run` on the card refuses the head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_eagle3 import HIDDEN, LAYERS, VOCAB, demo_head, recipe, torch_head

from qpcbuild.models.eagle3_head import read_eagle3_head
from qpcbuild.testing import write_random_eagle3_head


@pytest.mark.parametrize("continuous_batching", [False, True], ids=["plain", "cb"])
def test_card_head_graph_equals_a_transformers_forward_through_its_retained_cache(
        continuous_batching, tmp_path):
    """The head's card form (retained-state KV written at position_ids, mask from positions)
    on ONNX Runtime: a catch-up window, two draft steps on wrong tokens, the catch-up that
    overwrites them, a single step and a window padded with position -1 give the logits and
    hidden of one transformers forward over the true sequence."""
    import onnx
    import onnxruntime as ort

    from qpcbuild.export.dialect import onnxruntime_indices
    from qpcbuild.export.eagle3_card import export_card_head

    folder = write_random_eagle3_head(tmp_path / "h", LAYERS, HIDDEN, VOCAB, seed=4, heads=4,
                                      kv_heads=2)
    head = read_eagle3_head(folder, LAYERS, HIDDEN, VOCAB)
    rng = np.random.default_rng(2)
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    ids = rng.integers(0, VOCAB, 12)
    hidden = rng.standard_normal((12, HIDDEN)).astype(np.float32)
    path = export_card_head(head, embed, 64, continuous_batching, tmp_path / "g")
    opts = ort.SessionOptions()
    indices = {n: ort.OrtValue.ortvalue_from_numpy(v) for n, v in
               onnxruntime_indices(onnx.load(str(path), load_external_data=False)).items()}
    for name, value in indices.items():  # the card's INT32_MAX as ONNX Runtime takes it
        opts.add_initializer(name, value)
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    i, slots, slot = head.info, 2 if continuous_batching else 1, 1 if continuous_batching else 0
    kv = {f"past_{kind}.0": np.zeros((slots, i.num_kv_heads, 32, i.head_dim), np.float32)
          for kind in ("key", "value")}
    got: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def call(positions, tokens=None, feats=None):
        real = [p for p in positions if p >= 0]
        tokens = ids[real] if tokens is None else tokens
        feats = hidden[real] if feats is None else feats
        pad = len(positions) - len(real)
        feeds = {"input_ids": np.concatenate([tokens, np.zeros(pad, np.int64)])[None],
                 "hidden": np.concatenate([feats, np.zeros((pad, HIDDEN), np.float32)])[None],
                 "position_ids": np.array([positions], np.int64), **kv}
        if continuous_batching:
            feeds["batch_index"] = np.array([[slot]], np.int64)
        out = dict(zip(names, sess.run(None, feeds)))
        for name in kv:
            kv[name] = out[f"{name}_RetainedState"]
        for n, p in enumerate(real):
            got[p] = out["logits"][0, n], out["hidden_out"][0, n]

    call([0, 1, 2, 3, 4])
    call([5], rng.integers(0, VOCAB, 1), rng.standard_normal((1, HIDDEN)).astype(np.float32))
    call([6], rng.integers(0, VOCAB, 1), rng.standard_normal((1, HIDDEN)).astype(np.float32))
    call([5, 6, 7])  # the verified tokens overwrite the rejected drafts' entries
    call([8])
    call([9, 10, 11, -1])
    assert sorted(got) == list(range(12))
    ref_logits, ref_out = torch_head(folder, embed, ids, hidden)
    np.testing.assert_allclose(np.stack([got[p][0] for p in range(12)]), ref_logits,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.stack([got[p][1] for p in range(12)]), ref_out,
                               rtol=1e-4, atol=1e-4)
    assert sess.get_outputs()[0].shape[-1] == i.draft_vocab_size  # logits over the draft vocab


def card_recipe(tmp_path: Path) -> Path:
    """The eagle3 recipe built for the card too, with no compiler on this machine."""
    path = recipe(tmp_path, demo_head(tmp_path / "h"), "portable")
    path.write_text(path.read_text().replace("[onnxruntime]", "[onnxruntime, qaic]"))
    return path


def stand_in_compiler(folder: Path) -> Path:
    """A stand-in for qaic-compile: writes a programqpc.bin naming the graph it was given into
    the binary folder it was given, after checking that its inputs exist."""
    import sys

    folder.mkdir(parents=True)
    path = folder / "qaic-compile"
    path.write_text(f"#!{sys.executable}\nimport os, sys\n"
                    "opts = dict(a.split('=', 1) for a in sys.argv[1:] if '=' in a)\n"
                    "for flag in ('-m', '-network-specialization-config', "
                    "'-custom-IO-list-file'):\n"
                    "    assert os.path.isfile(opts[flag]), opts[flag]\n"
                    "os.makedirs(opts['-aic-binary-dir'], exist_ok=True)\n"
                    "with open(os.path.join(opts['-aic-binary-dir'], 'programqpc.bin'), 'w') as f:\n"
                    "    f.write('stand-in for ' + opts['-m'])\n")
    path.chmod(0o755)
    return path


def test_an_eagle3_recipe_for_the_card_plans_the_heads_own_compile(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from qpcbuild.cli import app

    monkeypatch.delenv("QAIC_COMPILER", raising=False)
    result = CliRunner().invoke(app, ["plan", str(card_recipe(tmp_path)), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    target = plan["roles"]["target"]
    head = target["eagle3_head"]
    # the head takes the draft's share of the shared QID, as a draft model would
    assert (target["num_cores"], head["num_cores"]) == (8, 8)
    assert plan["cores_per_qid"] == [{"qid": 0, "target": 8, "eagle3_head": 8, "free": 0}]
    # the prompt's window, the catch-up windows up to K + 1 and the one-token draft steps
    assert [(s["name"], s["symbols"]["seq_len"]) for s in head["specializations"]] == \
        [("Prefill", "8"), ("Decode_0", "1"), ("Decode_1", "4")]
    command = target["backends"]["qaic"]["eagle3_head"]["compiler_command"]
    assert "-m=target/eagle3/onnx/model.onnx" in command and "-aic-num-cores=8" in command
    assert "-aic-binary-dir=target/eagle3/qpc" in command
    assert plan["memory_per_qid_gib"][0]["eagle3_head_weights"] > 0
    shown = CliRunner().invoke(app, ["plan", str(card_recipe(tmp_path))])
    assert shown.exit_code == 0 and "qaic compile of the EAGLE-3 head" in shown.output
    crowded = CliRunner().invoke(app, ["plan", str(card_recipe(tmp_path)), "--set",
                                       "hardware.target.num_cores=16"])
    text = " ".join(crowded.output.split())
    assert crowded.exit_code == 2 and "target 16 + EAGLE-3 head 1 cores exceed" in text, text


def test_an_emit_only_eagle3_bundle_compiles_the_head_beside_the_target(tmp_path, monkeypatch):
    """--emit-only writes the head's card graph, specializations, custom I/O and compile.sh
    next to the target's; the target's compile.sh (a stand-in compiler here) compiles both,
    `finish` records both QPCs, doctor checks the head's graph; `run` on the card refuses."""
    import json
    import os
    import subprocess

    import yaml
    from typer.testing import CliRunner

    from qpcbuild.backends.qaic.finish import finish_bundle
    from qpcbuild.errors import BundleError
    from qpcbuild.bundle.verify import verify_bundle
    from qpcbuild.cli import app

    monkeypatch.delenv("QAIC_COMPILER", raising=False)
    out = tmp_path / "b"
    result = CliRunner().invoke(app, ["compile", str(card_recipe(tmp_path)), "-o", str(out),
                                      "--cache-dir", str(tmp_path / "c"), "--emit-only"])
    assert result.exit_code == 0, result.output
    unit = out / "target" / "eagle3"
    specs = json.loads((unit / "qaic" / "specializations.json").read_text())["specializations"]
    assert [s["symbols"] for s in specs] == [
        {"batch_size": "1", "seq_len": w, "ctx_len": "64"} for w in ("8", "1", "4")]
    assert [e["IOName"] for e in yaml.safe_load((unit / "qaic" / "custom_io.yaml").read_text())] \
        == ["past_key.0", "past_key.0_RetainedState", "past_value.0",
            "past_value.0_RetainedState"]
    assert "bash target/eagle3/qaic/compile.sh" in \
        (out / "target" / "qaic" / "compile.sh").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["roles"]["target"]["backends"]["qaic"]
    assert entry["eagle3_head"]["status"] == "emitted" and entry["eagle3_head"]["qpc"] is None
    assert "-aic-num-cores=8" in entry["compiler_args"]  # the target gave the head its half

    doctor = CliRunner().invoke(app, ["doctor", str(out), "--json"])
    report = json.loads(doctor.output)["roles"]
    assert report["target/eagle3"]["graph"].endswith("target/eagle3/onnx/model.onnx")
    assert {"CtxScatter", "CtxGather", "CustomRMSNorm"} <= set(report["target/eagle3"]["functions"])
    assert not any("manifest lists" in f for f in report["target/eagle3"]["findings"])

    ran = CliRunner().invoke(app, ["run", str(out), "--backend", "qaic", "--prompt", "hi"])
    assert ran.exit_code == 2, ran.output
    assert "eagle3 runs its head on onnxruntime only" in " ".join(ran.output.split())

    (out / "target" / "qpc").mkdir()  # the target's QPC alone is not a finished bundle
    (out / "target" / "qpc" / "programqpc.bin").write_text("a target QPC")
    with pytest.raises(BundleError, match="the target's EAGLE-3 head QPC is missing"):
        finish_bundle(out, ["target"])

    compiler = stand_in_compiler(tmp_path / "sdk")
    env = {"PATH": "/usr/bin:/bin", "QAIC_COMPILER": str(compiler)}  # no qpcbuild on PATH
    proc = subprocess.run([str(out / "target" / "qaic" / "compile.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (unit / "qpc" / "programqpc.bin").is_file()
    finished = finish_bundle(out, ["target"])
    head = finished.roles["target"].backends["qaic"].eagle3_head
    assert head.status == "compiled" and head.qpc_files == ["target/eagle3/qpc/programqpc.bin"]
    assert head.log == "target/eagle3/logs/qaic-compile.log"
    assert verify_bundle(out) == [] and os.access(out / "manifest.json", os.R_OK)


def test_with_a_compiler_the_head_is_compiled_cached_and_reused(tmp_path, monkeypatch):
    """Where the SDK is (a stand-in here), compile runs qaic-compile for the target and then
    for its head; a second build takes both QPCs from the cache."""
    import json

    from typer.testing import CliRunner

    from qpcbuild.bundle.verify import verify_bundle
    from qpcbuild.cli import app

    compiler = stand_in_compiler(tmp_path / "sdk")
    monkeypatch.setenv("QAIC_COMPILER", str(compiler))
    path = card_recipe(tmp_path)
    for out in (tmp_path / "b1", tmp_path / "b2"):
        result = CliRunner().invoke(app, ["compile", str(path), "-o", str(out),
                                          "--cache-dir", str(tmp_path / "c")])
        assert result.exit_code == 0, result.output
        head = json.loads((out / "manifest.json").read_text())["roles"]["target"]["backends"][
            "qaic"]["eagle3_head"]
        assert head["status"] == "compiled" and head["log"] == \
            "target/eagle3/logs/qaic-compile.log"
        assert (out / "target" / "eagle3" / "qpc" / "programqpc.bin").read_text() == \
            "stand-in for target/eagle3/onnx/model.onnx"
        assert verify_bundle(out) == []
    assert "qaic target" in result.output and "reused" in result.output.split("qaic target")[1]
