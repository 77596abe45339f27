"""EAGLE-3 draft heads (draft.method: eagle3): the speculators-format folder is read strictly and
refused with the reason when it does not fit the target; the head graph's outputs equal a
PyTorch forward of the head written from transformers' own Llama building blocks
(helpers_eagle3.py), across a call that fills its cache and a call that reads it. (The head on
the card: test_eagle3_card.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_eagle3 import DEMO, HIDDEN, LAYERS, VOCAB, demo_head, recipe, torch_head

from qpcbuild.errors import UsageError
from qpcbuild.models.eagle3_head import read_eagle3_head
from qpcbuild.testing import write_random_eagle3_head


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


def test_the_fused_head_graph_equals_the_forward_with_its_cache_kept_in_place(tmp_path):
    """The ONNX Runtime form of a fused target's head (backends/onnxruntime/eagle3_graph.py):
    GroupQueryAttention reads and writes one buffer bound as both the cache input and its
    retained-state output, and the tokens come in as rows of the target's embedding (the graph
    holds none). Its outputs equal transformers' forward; slots past a call's positions hold
    garbage (what a rejected draft leaves), which the kernel must never read."""
    import onnx
    import onnxruntime as ort

    from qpcbuild.backends.onnxruntime.eagle3_graph import export_fused_head

    # (GroupQueryAttention takes head_dim 16 and up; 2 query heads share one KV head)
    folder = write_random_eagle3_head(tmp_path / "h", LAYERS, HIDDEN, VOCAB, heads=2,
                                      kv_heads=1, seed=3)
    head = read_eagle3_head(folder, LAYERS, HIDDEN, VOCAB)
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    ids = rng.integers(0, VOCAB, 9)
    hidden = rng.standard_normal((9, HIDDEN)).astype(np.float32)

    def project(g, x, name, w, out):
        return g.op("MatMul", x, g.weight(name, w), out=out)

    path = export_fused_head(head, 64, tmp_path / "g", project, "float32")
    graph = onnx.load(str(path), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert "GroupQueryAttention" in ops and "Softmax" not in ops and len(ops) < 40, ops
    assert "Gather" not in ops and not any(tuple(t.dims) == (VOCAB, HIDDEN)
                                           for t in graph.initializer)  # no embedding
    sess = ort.InferenceSession(str(path))
    i = head.info
    buffers = [rng.standard_normal((1, i.num_kv_heads, 16, i.head_dim)).astype(np.float32) * 50
               for _ in range(2)]
    b = sess.io_binding()
    for name, buffer in zip(("past_key", "past_value"), buffers):
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        b.bind_ortvalue_input(name, value)
        b.bind_ortvalue_output(f"{name}_RetainedState", value)
    logits, outs = [], []
    for start, end in ((0, 5), (5, 6), (6, 9)):  # fill, one step, three more
        b.bind_cpu_input("inputs_embeds", embed[ids[start:end]][None])  # the target's rows
        b.bind_cpu_input("hidden", hidden[None, start:end])
        b.bind_cpu_input("position_ids", np.arange(start, end)[None])
        b.bind_output("logits")  # (each call: its shape is the call's)
        b.bind_output("hidden_out")
        sess.run_with_iobinding(b)
        lg, out = (v.numpy() for v in b.get_outputs()[2:])
        logits.append(lg[0])
        outs.append(out[0])
    ref_logits, ref_out = torch_head(folder, embed, ids, hidden)
    np.testing.assert_allclose(np.concatenate(outs), ref_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(logits), ref_logits, rtol=1e-4, atol=1e-4)
    assert np.abs(buffers[0][:, :, 9:]).max() > 10  # the garbage past position 8 is still there
    d2t = sess.run(["draft_to_target"], {
        "inputs_embeds": embed[ids[:1]][None], "hidden": hidden[None, :1], "position_ids": [[0]],
        "past_key": buffers[0][:, :, :1].copy(), "past_value": buffers[1][:, :, :1].copy()})[0]
    assert d2t.tolist() == head.draft_to_target.tolist()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_head_graph_runs_every_projection_in_blocks_close_to_float(bits, tmp_path):
    """onnxruntime.draft_weights for an eagle3 recipe: the head's eight projections become
    MatMulNBits (the embedding stays a float table), and its logits stay near the float
    head's (a proposer's numerics change only what it proposes)."""
    import onnx
    import onnxruntime as ort

    from qpcbuild.backends.onnxruntime.nbits import LEGACY_NBITS
    from qpcbuild.backends.onnxruntime.nbits import matmul_nbits
    from qpcbuild.export.eagle3 import export_head

    folder = write_random_eagle3_head(tmp_path / "h", LAYERS, HIDDEN, VOCAB, seed=3)
    head = read_eagle3_head(folder, LAYERS, HIDDEN, VOCAB)
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    ids, hidden = rng.integers(0, VOCAB, 6), rng.standard_normal((6, HIDDEN)).astype(np.float32)

    def project(g, x, name, w, out):
        return matmul_nbits(g, x, name, w, bits, LEGACY_NBITS, out)

    path = export_head(head, embed, 64, tmp_path / "g", project, f"int{bits}")
    graph = onnx.load(str(path), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("MatMulNBits") == 8, ops
    assert {p.key: p.value for p in graph.metadata_props}["weights"] == f"int{bits}"
    empty = np.zeros((1, head.info.num_kv_heads, 0, head.info.head_dim), np.float32)
    logits = ort.InferenceSession(str(path)).run(["logits"], {
        "input_ids": ids[None], "hidden": hidden[None], "position_ids": np.arange(6)[None],
        "past_key": empty, "past_value": empty})[0][0]
    ref, _ = torch_head(folder, embed, ids, hidden)
    err = np.abs(logits - ref).max() / np.abs(ref).max()
    assert 0 < err < (0.05 if bits == 8 else 0.25), err


# ---------------------------------------------------------------- the recipe and the loop
def test_a_recipe_with_a_head_of_another_model_exits_2_naming_it(tmp_path):
    from typer.testing import CliRunner

    from qpcbuild.cli import app

    head = write_random_eagle3_head(tmp_path / "h", 6, 128, 512)
    result = CliRunner().invoke(app, ["plan", str(recipe(tmp_path, head))])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "draft.model" in text and "the target's hidden size is 256" in text, text


@pytest.mark.parametrize("graph,shapes", [
    ("fused", ""), ("portable", ""), ("fused", "shapes.batch_size=2"),
    ("fused", "shapes.full_batch_size=3"), ("fused", "onnxruntime.draft_weights=int8")],
    ids=["fused", "portable", "batch2", "cb", "int8-head"])
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


@pytest.mark.parametrize("graph,heads,in_place", [
    ("fused", 4, True), ("portable", 4, False),
    ("fused", 32, False)],  # head_dim 8: GroupQueryAttention's kernel refuses it, so a fused
    ids=["fused", "portable", "fused-head-dim-8"])  # target's head is built portable
def test_proposals_are_the_heads_forward_over_the_targets_own_features(graph, heads, in_place,
                                                                      tmp_path):
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

    folder = demo_head(tmp_path / "h", seed=5, heads=heads, kv_heads=heads // 2)
    result = CliRunner().invoke(app, ["compile", str(recipe(tmp_path, folder, graph)), "-o",
                                      str(tmp_path / "b"), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    served = CliRunner().invoke(app, ["serve-config", str(tmp_path / "b")])
    text = " ".join(served.output.split())
    assert served.exit_code == 2 and "does not serve draft heads" in text, text
    assert '"method": "eagle3"' in text and str(folder) in text, text
    gen = qpcbuild.load(tmp_path / "b")
    drafter = gen.decoder.eagle3
    assert drafter.in_place == in_place  # the head graph in the target's form where it fits
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def spy(rows, room, stop):
        proposals, q = propose(rows, room, stop)
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


def test_tune_counts_a_heads_acceptance_with_the_target_running(tmp_path):
    """tune replays each K over the target's known greedy outputs, but a head reads the
    target's own features, which known tokens cannot give: its statistics must be those of a
    real run at that K (before, the replay saw no proposal at all)."""
    from typer.testing import CliRunner

    import qpcbuild
    from qpcbuild.cli import app
    from qpcbuild.tune.acceptance import replayed, summed_run

    result = CliRunner().invoke(app, ["compile", str(recipe(tmp_path, demo_head(tmp_path / "h"))),
                                      "-o", str(tmp_path / "b"), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    gen = qpcbuild.load(tmp_path / "b")
    ids = [[3, 17, 42, 9, 100], [7] * 11 + [200, 5]]
    outputs = summed_run(gen.sibling(target_only=True), ids, 16, None, target_only=True)["outputs"]
    sim = replayed(gen, ids, outputs, 16, 3)
    gen.fresh_proposer()
    real = summed_run(gen, ids, 16, 3)
    assert sim["drafts"] > 0 and sim["draft_calls"] > 0
    assert (sim["drafts"], sim["accepted"], sim["per_pos"]) == \
        (real["drafts"], real["accepted"], real["per_pos"])


def test_a_confidence_stopped_head_proposes_less_and_keeps_the_targets_output(tmp_path):
    """speculation.draft_p_min with a head: a row stops drafting where the head's softmax is
    less confident than the threshold, the step verifies in the smallest compiled window that
    holds what was proposed, and the greedy output is still transformers' `generate`; tune's
    replay at that threshold counts what the run did."""
    import torch
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    import qpcbuild
    from qpcbuild.cli import app
    from qpcbuild.runtime.rows import new_row
    from qpcbuild.runtime.sampling import SamplingParams
    from qpcbuild.testing import write_shortcut_eagle3_head
    from qpcbuild.tune.acceptance import replayed

    head = write_shortcut_eagle3_head(tmp_path / "h", DEMO)
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    prompts = ([3, 17, 42, 9, 100], [7] * 11 + [200, 5], [1, 2, 3])
    with torch.no_grad():
        refs = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0].tolist()
                for p in prompts]
    stats = {}
    for p_min in (0.0, 0.2):
        out = tmp_path / f"b{p_min}"
        result = CliRunner().invoke(app, [
            "compile", str(recipe(tmp_path, head)), "-o", str(out), "--cache-dir",
            str(tmp_path / "cache"), "--set", f"speculation.draft_p_min={p_min}",
            "--set", "speculation.num_speculative_tokens=[1,2,3]"])
        assert result.exit_code == 0, result.output
        gen = qpcbuild.load(out)
        rows = [new_row(p, 24, gen.decoder.ctx_len, SamplingParams(), i)
                for i, p in enumerate(prompts)]
        windows: dict[int, int] = {}
        for row in rows:  # batch 1: a row per call
            for k, n in gen.decoder.run_rows([row]).windows.items():
                windows[k] = windows.get(k, 0) + n
        assert [row.tokens for row in rows] == refs, p_min
        stats[p_min] = (sum(r.stats.num_draft_tokens for r in rows), windows)
        # tune's replay (the real target running, the stop at p_min) counts what the run did
        sim = replayed(gen, [list(p) for p in prompts],
                       [r.tokens[len(p):] for p, r in zip(prompts, rows)], 24, 3, p_min)
        assert (sim["draft_tokens"], sim["accepted"], sim["windows"]) == \
            (stats[p_min][0], sum(r.stats.num_accepted_tokens for r in rows), windows)
    (full, full_windows), (stopped, windows) = stats[0.0], stats[0.2]
    assert 0 < stopped < full, stats
    # without the stop only a row's last steps (little room left) verify fewer than K tokens
    smaller = sum(n for k, n in windows.items() if k < 3)
    assert smaller > sum(n for k, n in full_windows.items() if k < 3) + 3, stats
