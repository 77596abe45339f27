"""EAGLE-3 draft heads (draft.method: eagle3): the speculators-format folder is read strictly and
refused with the reason when it does not fit the target; the head graph's outputs equal a
PyTorch forward of the head written here from transformers' own Llama building blocks, across a
call that fills its cache and a call that reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qpcbuild.errors import UsageError
from qpcbuild.models.eagle3_head import read_eagle3_head
from qpcbuild.testing import write_random_eagle3_head

LAYERS, HIDDEN, VOCAB = 4, 32, 96


# ---------------------------------------------------------------- the format, strictly
def _drop(key):
    return lambda t, c: t.pop(key)


def _embed(t, c):
    t["embed_tokens.weight"] = np.zeros((VOCAB, HIDDEN), np.float32)


def _layer_ids(t, c):
    c["eagle_aux_hidden_state_layer_ids"] = [1, 2, LAYERS]


def _d2t_range(t, c):
    t["d2t"] = t["d2t"] + VOCAB


def _d2t_dtype(t, c):
    t["d2t"] = t["d2t"].astype(np.int32)


def _d2t_twice(t, c):
    t["d2t"][1] = t["d2t"][0] - 1  # draft id 1 -> the target token of draft id 0


def _type(t, c):
    c["speculators_model_type"] = "eagle"


def _vocab(t, c):
    c["transformer_layer_config"]["vocab_size"] = VOCAB + 1


def _fc_width(t, c):
    t["fc.weight"] = t["fc.weight"][:, :2 * HIDDEN]


@pytest.mark.parametrize("tamper,message", [
    (_drop("layers.0.hidden_norm.weight"), "missing layers.0.hidden_norm.weight"),
    (_embed, "unexpected embed_tokens.weight"),
    (_layer_ids, "eagle_aux_hidden_state_layer_ids must list target layers in 0..3"),
    (_d2t_range, "outside 0..95"),
    (_d2t_dtype, "'d2t' must be int64"),
    (_d2t_twice, "two draft ids to the same target token"),
    (_type, "speculators_model_type is 'eagle'"),
    (_vocab, "vocab_size is 97"),
    (_fc_width, r"'fc.weight' has shape \[32, 64\]"),
], ids=["missing", "embedding", "layer-ids", "d2t-range", "d2t-dtype", "d2t-twice", "type",
        "vocab", "fc-width"])
def test_head_folders_are_read_strictly(tamper, message, tmp_path):
    folder = write_random_eagle3_head(tmp_path / "h", LAYERS, HIDDEN, VOCAB, tamper=tamper)
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        read_eagle3_head(folder, LAYERS, HIDDEN, VOCAB)


def test_a_head_of_another_hidden_size_is_refused(tmp_path):
    folder = write_random_eagle3_head(tmp_path / "h", LAYERS, HIDDEN, VOCAB)
    with pytest.raises(UsageError, match="target_hidden_size is 32, the target's hidden size is 64"):
        read_eagle3_head(folder, LAYERS, 64, VOCAB)


def test_a_good_folder_maps_draft_ids_to_target_ids(tmp_path):
    head = read_eagle3_head(write_random_eagle3_head(tmp_path / "h", LAYERS, HIDDEN, VOCAB),
                            LAYERS, HIDDEN, VOCAB)
    assert head.info.aux_layer_ids == (2, 2, 1)
    assert head.draft_to_target.tolist() == list(range(0, VOCAB, 2))  # every other token
    assert head.weights["lm_head.weight"].shape == (VOCAB // 2, HIDDEN)


# ---------------------------------------------------------------- the head graph
def torch_head(folder: Path, embed, ids, hidden):
    """(logits, hidden_out) of the head over one sequence from position 0, by transformers'
    LlamaRMSNorm / LlamaRotaryEmbedding / apply_rotary_pos_emb / LlamaMLP and the weights read
    with safetensors' own loader."""
    import json

    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)

    cfg = json.loads((folder / "config.json").read_text())
    lc = LlamaConfig(**{k: v for k, v in cfg["transformer_layer_config"].items()
                        if k != "model_type"})
    w = load_file(str(folder / "model.safetensors"))

    def norm(name):
        n = LlamaRMSNorm(lc.hidden_size, eps=lc.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n

    mlp = LlamaMLP(lc)
    for part in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, part).weight.data.copy_(w[f"layers.0.mlp.{part}.weight"])
    with torch.no_grad():
        x = torch.tensor(embed)[torch.tensor(ids)][None]
        h = torch.tensor(hidden)[None]
        z = torch.cat([norm("layers.0.input_layernorm.weight")(x),
                       norm("layers.0.hidden_norm.weight")(h)], -1)
        d, n = lc.head_dim, len(ids)
        q, k, v = (F.linear(z, w[f"layers.0.self_attn.{p}_proj.weight"]).view(1, n, -1, d)
                   .transpose(1, 2) for p in "qkv")
        cos, sin = LlamaRotaryEmbedding(lc)(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        attn = F.linear(attn.transpose(1, 2).reshape(1, n, -1), w["layers.0.self_attn.o_proj.weight"])
        y = h + attn
        out = y + mlp(norm("layers.0.post_attention_layernorm.weight")(y))
        logits = F.linear(norm("norm.weight")(out), w["lm_head.weight"])
    return logits[0].numpy(), out[0].numpy()


def test_head_graph_equals_a_transformers_forward_across_its_cache(tmp_path):
    import onnxruntime as ort

    from qpcbuild.export.eagle3 import export_head

    folder = write_random_eagle3_head(tmp_path / "h", LAYERS, HIDDEN, VOCAB, seed=3)
    head = read_eagle3_head(folder, LAYERS, HIDDEN, VOCAB)
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    ids = rng.integers(0, VOCAB, 9)
    hidden = rng.standard_normal((9, HIDDEN)).astype(np.float32)
    sess = ort.InferenceSession(str(export_head(head, embed, 64, tmp_path / "g")))
    i = head.info
    cache = np.zeros((1, i.num_kv_heads, 0, i.head_dim), np.float32), \
        np.zeros((1, i.num_kv_heads, 0, i.head_dim), np.float32)
    logits, outs = [], []
    for start, end in ((0, 5), (5, 6), (6, 9)):  # fill, one step, three more
        lg, out, key, value, d2t = sess.run(None, {
            "input_ids": ids[None, start:end], "hidden": hidden[None, start:end],
            "position_ids": np.arange(start, end)[None], "past_key": cache[0],
            "past_value": cache[1]})
        cache = np.concatenate([cache[0], key], 2), np.concatenate([cache[1], value], 2)
        logits.append(lg[0])
        outs.append(out[0])
    assert d2t.tolist() == head.draft_to_target.tolist()
    ref_logits, ref_out = torch_head(folder, embed, ids, hidden)
    np.testing.assert_allclose(np.concatenate(outs), ref_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(logits), ref_logits, rtol=1e-4, atol=1e-4)


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


# ---------------------------------------------------------------- the recipe and the loop
DEMO = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"


def recipe(folder: Path, head: Path, graph: str = "fused", extra: str = "") -> Path:
    path = folder / "eagle3.yaml"
    path.write_text(f"""schema: 1
name: eagle3-test
target: {{model: {DEMO}}}
draft: {{method: eagle3, model: {head}}}
speculation: {{num_speculative_tokens: 3}}
shapes: {{batch_size: 1, prefill_seq_len: 8, ctx_len: 64}}
backends: [onnxruntime]
onnxruntime: {{graph: {graph}}}
{extra}""")
    return path


def demo_head(folder: Path, **kw) -> Path:
    import json

    cfg = json.loads((DEMO / "config.json").read_text())
    return write_random_eagle3_head(folder, cfg["num_hidden_layers"], cfg["hidden_size"],
                                    cfg["vocab_size"], heads=4, kv_heads=2, **kw)


def test_a_recipe_with_a_head_of_another_model_exits_2_naming_it(tmp_path):
    from typer.testing import CliRunner

    from qpcbuild.cli import app

    head = write_random_eagle3_head(tmp_path / "h", 6, 128, 512)
    result = CliRunner().invoke(app, ["plan", str(recipe(tmp_path, head))])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "draft.model" in text and "the target's hidden size is 256" in text, text


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


@pytest.mark.parametrize("graph,shapes", [
    ("fused", ""), ("portable", ""), ("fused", "shapes.batch_size=2"),
    ("fused", "shapes.full_batch_size=3")], ids=["fused", "portable", "batch2", "cb"])
def test_eagle3_greedy_output_equals_generate(graph, shapes, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    import qpcbuild
    from qpcbuild.cli import app
    from qpcbuild.runtime.rows import new_row
    from qpcbuild.runtime.sampling import SamplingParams

    path = recipe(tmp_path, demo_head(tmp_path / "h"), graph)
    result = CliRunner().invoke(app, ["compile", str(path), "-o", str(tmp_path / "b"),
                                      "--cache-dir", str(tmp_path / "cache")]
                                + (["--set", shapes] if shapes else []))
    assert result.exit_code == 0, result.output
    gen = qpcbuild.load(tmp_path / "b")
    assert gen.decoder.eagle3 is not None
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    prompts = ([3, 17, 42, 9, 100], [7] * 11 + [200, 5], [1, 2, 3])
    rows = [new_row(p, 24, gen.decoder.ctx_len, SamplingParams(), i)
            for i, p in enumerate(prompts)]
    per_call = len(rows) if gen.decoder.cb else gen.target.batch_size
    for start in range(0, len(rows), per_call):
        gen.decoder.run_rows(rows[start:start + per_call])
    for prompt, row in zip(prompts, rows):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert row.tokens == ref[0].tolist()
        assert row.stats.num_drafts > 0


def test_proposals_are_the_heads_forward_over_the_targets_own_features(tmp_path):
    """EAGLE's shift, checked against transformers: at each step the head reads, for every
    verified position p, the target's hidden states entering its aux layers at p (through fc)
    with the token at p + 1; its first proposal is the argmax at the last verified position
    and the next one continues from its own output."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    import qpcbuild
    from qpcbuild.cli import app
    from qpcbuild.runtime.rows import new_row
    from qpcbuild.runtime.sampling import SamplingParams

    folder = demo_head(tmp_path / "h", seed=5)
    result = CliRunner().invoke(app, ["compile", str(recipe(tmp_path, folder, "portable")), "-o",
                                      str(tmp_path / "b"), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    served = CliRunner().invoke(app, ["serve-config", str(tmp_path / "b")])
    text = " ".join(served.output.split())
    assert served.exit_code == 2 and "does not serve draft heads" in text, text
    assert '"method": "eagle3"' in text and str(folder) in text, text
    gen = qpcbuild.load(tmp_path / "b")
    drafter = gen.decoder.eagle3
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def spy(rows, room):
        proposals, q = propose(rows, room)
        seen.append((list(rows[0].tokens), proposals[0]))
        return proposals, q

    drafter.propose = spy
    row = new_row([5, 9, 33, 7, 81, 2, 40], 20, gen.decoder.ctx_len, SamplingParams(), 0)
    gen.decoder.run_rows([row])
    assert len(seen) >= 3
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    cfg = json.loads((folder / "config.json").read_text())
    fc = load_file(str(folder / "model.safetensors"))["fc.weight"]
    d2t = load_file(str(folder / "model.safetensors"))["d2t"]
    embed = model.model.embed_tokens.weight.detach().numpy()
    for tokens, proposals in seen:
        with torch.no_grad():
            states = model(input_ids=torch.tensor([tokens[:-1]]),
                           output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in cfg["eagle_aux_hidden_state_layer_ids"]], -1)
        ids, hidden = list(tokens[1:]), (aux @ fc.T).numpy()
        for proposal in proposals:
            logits, out = torch_head(folder, embed, ids, hidden)
            draft = int(logits[-1].argmax())
            assert draft + int(d2t[draft]) == proposal
            ids.append(proposal)
            hidden = np.concatenate([hidden, out[-1:]])


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
