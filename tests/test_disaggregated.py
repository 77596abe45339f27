"""Disaggregated prefill/decode (issue 44): the recipe's `disaggregated:` block, the three units
planned from one target export (prefill/target, decode/target, decode/draft), and the KV
hand-off contract the manifest carries, which every read of the bundle checks."""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qpcbuild.bundle import verify_bundle
from qpcbuild.bundle.manifest import MANIFEST, seal
from qpcbuild.cli import app
from qpcbuild.errors import RecipeError
from qpcbuild.plan import make_plan
from qpcbuild.recipe import recipe_from_text

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
runner = CliRunner()

DEMO_DISAGG = {
    "disaggregated": {"prefill": {"device_group": [0], "num_cores": 16},
                      "decode": {"target": {"device_group": [1], "num_cores": 10},
                                 "draft": {"device_group": [1], "num_cores": 6}}}}


def demo_recipe(**changes) -> dict:
    """recipes/demo.yaml (the tiny demo pair) with `changes` merged at the top level; the
    aggregated placement is dropped when a disaggregated block is given."""
    data = yaml.safe_load((RECIPES / "demo.yaml").read_text())
    if "disaggregated" in changes:
        data["hardware"] = {"card": data["hardware"]["card"]}
    data.update(copy.deepcopy(changes))
    return data


def load(data: dict):
    return recipe_from_text(yaml.safe_dump(data), "test.yaml", base_dir=RECIPES)


def problems_of(data: dict) -> dict[str, str]:
    with pytest.raises(RecipeError) as exc:
        load(data)
    return {p.path: p.message for p in exc.value.problems}


# ---------------------------------------------------------------- the recipe
def test_overlapping_node_groups_are_refused_unless_the_nodes_are_distinct_hosts():
    same = {"prefill": {"device_group": [0, 1]},
            "decode": {"target": {"device_group": [1]}, "draft": {"device_group": [1]}}}
    found = problems_of(demo_recipe(disaggregated=same))
    assert "[1]" in found["disaggregated.prefill.device_group"]
    assert "distinct_hosts" in found["disaggregated.prefill.device_group"]
    assert load(demo_recipe(disaggregated={**same, "distinct_hosts": True})).disaggregated


def test_a_disaggregated_recipe_places_roles_under_its_nodes_only():
    data = demo_recipe(**DEMO_DISAGG)
    data["hardware"]["target"] = {"device_group": [0], "num_cores": 8}
    assert "disaggregated.decode.target" in problems_of(data)["hardware.target"]


def test_node_slots_need_continuous_batching_and_cores_are_checked_per_node():
    data = demo_recipe(**DEMO_DISAGG)
    data["disaggregated"]["decode"]["max_num_seqs"] = 4
    data["disaggregated"]["decode"]["draft"]["num_cores"] = 7  # 10 + 7 > 16 on QID 1
    found = problems_of(data)
    assert "full_batch_size" in found["disaggregated.decode.max_num_seqs"]
    assert "exceed" in found["disaggregated.decode.draft.num_cores"]
    data["disaggregated"]["prefill"]["colour"] = 1
    assert "unknown key 'colour'" in problems_of(data)["disaggregated.prefill.colour"]


def test_a_recipe_without_the_block_dumps_as_before():
    r = load(demo_recipe())
    assert r.disaggregated is None and "disaggregated" not in r.to_yaml_dict()


# ---------------------------------------------------------------- the plan
def test_the_card_recipe_plans_three_units_from_one_target_export():
    plan = make_plan(load(yaml.safe_load((RECIPES / "llama8b-1b-disagg.yaml").read_text())))
    units = {rp.unit: rp for rp in plan.roles}
    assert list(units) == ["prefill/target", "decode/target", "decode/draft"]
    prefill, decode, draft = units.values()
    # one export for both target units; the draft is its own
    assert prefill.cache_keys.export == decode.cache_keys.export != draft.cache_keys.export
    assert [s.name for s in prefill.specializations] == ["Prefill"]
    assert [s.name for s in decode.specializations] == ["Decode"]  # K=3: seq_len 4
    assert decode.specializations[0].symbols["seq_len"] == "4"
    assert [s.name for s in draft.specializations] == ["Prefill", "Decode"]  # a full draft
    assert prefill.specializations[0].symbols["full_batch_size"] == "4"  # the prefill slots
    assert decode.specializations[0].symbols["full_batch_size"] == "16"
    argv = {u: rp.backends["qaic"].compiler_argv[1:] for u, rp in units.items()}
    assert argv["prefill/target"] == [
        "-aic-hw", "-aic-hw-version=ai100", "-m=target/onnx/model.vllmKvCache.onnx",
        "-retained-state", "-convert-to-fp16", "-mxfp6-matmul", "-aic-num-cores=16",
        "-aic-enable-depth-first",
        "-mdp-load-partition-config=prefill/qaic/mdp_ts_2.json",
        "-network-specialization-config=prefill/qaic/specializations.json",
        "-custom-IO-list-file=prefill/qaic/custom_io.yaml", "-aic-binary-dir=prefill/qpc"]
    assert "-m=target/onnx/model.vllmKvCache.onnx" in argv["decode/target"]
    assert "-aic-num-cores=10" in argv["decode/target"]
    assert "-aic-num-cores=6" in argv["decode/draft"]
    assert {e["Precision"] for rp in units.values() for e in rp.backends["qaic"].custom_io} \
        == {"mxint8"}
    mdp = prefill.backends["qaic"].mdp_partition
    assert [d["numCores"] for d in mdp["partitions"][0]["devices"]] == [16, 16]


def test_plan_names_the_three_units():
    shown = runner.invoke(app, ["plan", str(RECIPES / "llama8b-1b-disagg.yaml")])
    assert shown.exit_code == 0, shown.output
    for unit in ("prefill/target", "decode/target", "decode/draft"):
        assert f"--- {unit}:" in shown.output
    assert shlex.join(["-m=target/onnx/model.vllmKvCache.onnx", "-retained-state"]) in \
        shown.output


# ---------------------------------------------------------------- the bundle and its contract
@pytest.fixture(scope="module")
def demo_disagg_bundle(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("disagg")
    path = tmp / "recipe.yaml"
    data = demo_recipe(**DEMO_DISAGG)
    for role in ("target", "draft"):
        data[role]["model"] = str((RECIPES / data[role]["model"]).resolve())
    data["backends"] = ["onnxruntime", "qaic"]  # the card's inputs emitted, not compiled
    path.write_text(yaml.safe_dump(data))
    built = runner.invoke(app, ["compile", str(path), "-o", str(tmp / "bundle"),
                                "--cache-dir", str(tmp / "cache"), "--emit-only"])
    assert built.exit_code == 0, built.output
    return tmp / "bundle"


def test_the_bundle_records_the_units_and_the_hand_off_contract(demo_disagg_bundle):
    assert verify_bundle(demo_disagg_bundle) == []
    m = json.loads((demo_disagg_bundle / MANIFEST).read_text())
    dis, roles = m["disaggregated"], m["roles"]
    assert set(roles) == {"prefill", "target", "draft"}
    assert dis["units"]["prefill/target"]["role"] == "prefill"
    # one export: both target units carry its digest, which the contract records
    assert roles["prefill"]["source"]["weights_digest"] == \
        roles["target"]["source"]["weights_digest"] == dis["weights_digest"]
    contract = dis["kv_handoff"]
    layers = roles["target"]["arch"]["num_layers"]
    assert contract["buffers"][:2] == ["past_key.0", "past_value.0"]
    assert len(contract["buffers"]) == 2 * layers
    assert contract["kv_heads"] == roles["target"]["arch"]["num_kv_heads"]
    assert contract["last_prompt_token"] == "recomputed-on-decode"


# ---------------------------------------------------------------- vllm-qaic's KV names
def _graph_names(path: Path) -> tuple[list[str], list[str]]:
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    return [v.name for v in g.input], [v.name for v in g.output]


def _custom_io_names(path: Path) -> list[str]:
    return [e["IOName"] for e in yaml.safe_load(path.read_text())]


def test_the_card_units_compile_a_graph_with_vllm_qaics_kv_names(demo_disagg_bundle):
    """vllm-qaic serves a kv_transfer_config's QPCs with `past_key.{i}_vllmKvCache` inputs and
    `past_key.{i}_vllmKvCache_RetainedState` outputs (QEfficient's kv_cache_prefix): every
    card unit's graph, custom_io.yaml and recorded names say so; the exported graph, which
    the ONNX Runtime units are built from, keeps its names."""
    m = json.loads((demo_disagg_bundle / MANIFEST).read_text())
    layers = {r: m["roles"][r]["arch"]["num_layers"] for r in ("target", "draft")}
    for unit, model_role in (("prefill", "target"), ("target", "target"), ("draft", "draft")):
        entry = m["roles"][unit]["backends"]["qaic"]
        card_graph = f"{model_role}/onnx/model.vllmKvCache.onnx"
        assert entry["graph"] == card_graph and f"-m={card_graph}" in entry["compiler_args"]
        inputs, outputs = _graph_names(demo_disagg_bundle / card_graph)
        kv_in = [n for n in inputs if n.startswith("past_")]
        kv_out = [n for n in outputs if n.startswith("past_")]
        assert kv_in[:2] == ["past_key.0_vllmKvCache", "past_value.0_vllmKvCache"]
        assert len(kv_in) == 2 * layers[model_role]
        assert kv_out == [f"{n}_RetainedState" for n in kv_in]
        listed = _custom_io_names(demo_disagg_bundle / unit / "qaic" / "custom_io.yaml")
        assert sorted(listed) == sorted(kv_in + kv_out) == sorted(entry["kv_buffers"])
        assert inputs[:2] == ["input_ids", "position_ids"] and outputs[0] == "logits"
    exported_in, _ = _graph_names(demo_disagg_bundle / "target" / "onnx" / "model.onnx")
    assert "past_key.0" in exported_in and not any("vllmKvCache" in n for n in exported_in)
    ort_in, _ = _graph_names(demo_disagg_bundle / "prefill" / "ort" / "model.onnx")
    assert "past_key.0" in ort_in and not any("vllmKvCache" in n for n in ort_in)
    contract = m["disaggregated"]["kv_handoff"]
    assert contract["card_buffers"] == [f"{b}_vllmKvCache" for b in contract["buffers"]]


def test_the_renamed_card_graph_computes_what_the_exported_graph_does(demo_disagg_bundle):
    """The renaming reaches every reference (a name left behind would dangle): ONNX Runtime
    runs both graphs, on their shared weights file, to the same logits and KV."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from qpcbuild.export.dialect import onnxruntime_indices

    folder = demo_disagg_bundle / "target" / "onnx"
    runs, kept = [], []  # (the initializers' OrtValues must outlive their sessions)
    for name in ("model.onnx", "model.vllmKvCache.onnx"):
        opts = ort.SessionOptions()  # the card's invalid indices, as ORT takes them
        values = onnxruntime_indices(onnx.load(str(folder / name), load_external_data=False))
        for key, value in values.items():
            kept.append(ort.OrtValue.ortvalue_from_numpy(value))
            opts.add_initializer(key, kept[-1])
        session = ort.InferenceSession(str(folder / name), opts)
        feed = {}
        for i in session.get_inputs():
            if i.name in ("input_ids", "position_ids"):
                feed[i.name] = np.array([[5, 9, 2]] if i.name == "input_ids" else [[0, 1, 2]])
            elif i.name.startswith("past_"):
                shape = [1 if d == "batch_size" else 16 if d == "ctx_len" else d
                         for d in i.shape]
                feed[i.name] = np.zeros(shape, dtype=np.float32)
            else:  # num_logits_to_keep: its shape says how many
                feed[i.name] = np.zeros([1 for _ in i.shape], dtype=np.int64)
        runs.append(session.run(None, feed))
    plain, card = runs
    assert len(plain) == len(card) > 1
    for a, b in zip(plain, card):
        np.testing.assert_array_equal(a, b)


def test_an_aggregated_card_bundle_keeps_the_exported_kv_names():
    plan = make_plan(load(yaml.safe_load((RECIPES / "llama8b-1b.yaml").read_text())))
    for rp in plan.roles:
        part = rp.backends["qaic"]
        assert part.kv_infix is None and "-m=" + f"{rp.role}/onnx/model.onnx" in \
            part.compiler_argv
        assert part.custom_io[0]["IOName"] == "past_key.0"
        assert "kv_infix" not in rp.cache_keys.backends  # (a digest: checked by the ids)


def _resealed(bundle: Path, tmp: Path, edit) -> Path:
    out = tmp / "edited"
    shutil.copytree(bundle, out)
    m = json.loads((out / MANIFEST).read_text())
    edit(m)
    (out / MANIFEST).write_text(json.dumps(seal(m)))
    return out


def _set(*path, value):
    def edit(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return edit


CONTRACT_EDITS = {
    "prefill kv heads": (_set("roles", "prefill", "arch", "num_kv_heads", value=lambda n: n + 1),
                         "roles.prefill (prefill/target): kv_heads"),
    "decode head_dim": (_set("roles", "target", "arch", "head_dim", value=lambda n: n * 2),
                        "roles.target (decode/target): head_dim"),
    "prefill KV dtype": (_set("roles", "prefill", "precision", "kv_cache", value="mxint8"),
                         "roles.prefill (prefill/target): kv_dtype"),
    "buffer order": (_set("disaggregated", "kv_handoff", "buffers",
                          value=lambda b: [b[1], b[0], *b[2:]]), "buffers"),
    "contract ctx_len": (_set("disaggregated", "kv_handoff", "ctx_len", value=64), "ctx_len"),
    "prefill slots": (_set("disaggregated", "units", "prefill/target", "slots", value=2),
                      "disaggregated.units.prefill/target.slots"),
    "another export": (_set("roles", "prefill", "source", "weights_digest", value="0" * 64),
                       "roles.prefill.source.weights_digest"),
    "no prefill unit": (lambda m: m["roles"].pop("prefill"), "roles.prefill"),
    "prefill card names": (_set("roles", "prefill", "backends", "qaic", "kv_buffers",
                                value=lambda b: [n.replace("_vllmKvCache", "") for n in b]),
                           "roles.prefill: backends.qaic.kv_buffers: 'past_key.0'"),
    "decode card names": (_set("roles", "target", "backends", "qaic", "kv_buffers",
                               value=lambda b: [b[2], b[3], b[0], b[1], *b[4:]]),
                          "backends.qaic.kv_buffers"),
    "draft card names": (_set("roles", "draft", "backends", "qaic", "kv_infix", value="VLLM"),
                         "roles.draft: backends.qaic.kv_buffers"),
    "contract card names": (_set("disaggregated", "kv_handoff", "card_buffers",
                                 value=lambda b: [n.replace("vllmKvCache", "kv") for n in b]),
                            "card_buffers"),
}


@pytest.mark.parametrize("name", CONTRACT_EDITS)
def test_verify_refuses_a_unit_that_breaks_the_contract(demo_disagg_bundle, tmp_path, name):
    edit, says = CONTRACT_EDITS[name]
    edited = _resealed(demo_disagg_bundle, tmp_path, edit)
    problems = verify_bundle(edited)
    assert any(says in p for p in problems), problems
    result = runner.invoke(app, ["verify", str(edited)])
    assert result.exit_code in (1, 2) and says in result.output, result.output


# ---------------------------------------------------------------- serve-config --format disagg
def test_serve_config_prints_a_producer_and_a_consumer_with_names_vllm_has(demo_disagg_bundle):
    from helpers_serve_config import unknown_to_vllm

    from qpcbuild.bundle.manifest import read_manifest
    from qpcbuild.cli.serve_disagg import container_argv, disagg_argvs

    shown = runner.invoke(app, ["serve-config", str(demo_disagg_bundle), "--format", "disagg"])
    assert shown.exit_code == 0, shown.output
    m = read_manifest(demo_disagg_bundle)
    argvs = disagg_argvs(m, {})
    for node, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        argv = argvs[node]
        assert unknown_to_vllm(argv, "vllm") == []
        flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        assert json.loads(flags["--kv-transfer-config"]) == {"kv_connector": "QaicConnector",
                                                             "kv_role": kv_role}
        assert shlex.join(argv) in shown.output.replace(" \\\n  ", " ")
    prefill = {a: b for a, b in zip(argvs["prefill"], argvs["prefill"][1:])}
    decode = {a: b for a, b in zip(argvs["decode"], argvs["decode"][1:])}
    assert "--speculative-config" not in prefill  # the prefill node samples nothing
    assert json.loads(prefill["--additional-config"])["override_qaic_config"] == \
        {"device_group": [0], "num_cores": 16}
    assert json.loads(decode["--additional-config"]) == {
        "override_qaic_config": {"device_group": [1], "num_cores": 10},
        "draft_override_qaic_config": {"device_group": [1], "num_cores": 6}}
    assert json.loads(decode["--speculative-config"])["num_speculative_tokens"] == 4
    assert f"VLLM_QAIC_QPC_PATH={demo_disagg_bundle.resolve()}/prefill/qpc" in shown.output
    container = container_argv(m, demo_disagg_bundle, {})
    assert container[container.index("--prefill-device-group") + 1] == "0"
    assert "draft_override_qaic_config" in container[-1]


def test_serve_config_says_where_vllm_qaic_refuses_a_method_and_other_formats_refuse(
        demo_disagg_bundle):
    from qpcbuild.bundle.manifest import read_manifest
    from qpcbuild.cli.serve_disagg import refused_by_vllm_qaic

    m = read_manifest(demo_disagg_bundle)
    assert refused_by_vllm_qaic(m) is None  # draft_model
    suffix = m.model_copy(update={"speculation": m.speculation.model_copy(
        update={"method": "suffix"})})
    assert "refuses speculation method 'suffix'" in (refused_by_vllm_qaic(suffix) or "")
    other = runner.invoke(app, ["serve-config", str(demo_disagg_bundle), "--format", "vllm"])
    assert other.exit_code == 2 and "--format disagg" in other.output


# ---------------------------------------------------------------- the runtime: two processes
LONG = ("def fibonacci(n): a prompt that runs past the demo's prefill window of thirty-two "
        "tokens, so the prefill process takes it in two chunks before the hand-off")
# (the first repeats itself: ngram finds proposals in it)
PROMPTS = ["def f(x):\n    return x\n\ndef f(x):\n    return x\n\ndef f(x):\n", LONG,
           "class Stack:"]


def _build(tmp: Path, name: str, **changes) -> Path:
    data = demo_recipe(**changes)
    for role in ("target", "draft"):
        data[role]["model"] = str((RECIPES / data[role]["model"]).resolve())
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    built = runner.invoke(app, ["compile", str(path), "-o", str(tmp / name), "--cache-dir",
                                str(tmp / "cache")])
    assert built.exit_code == 0, built.output
    return tmp / name


def test_run_hands_the_kv_across_processes_and_decodes_as_the_aggregated_bundle(
        demo_disagg_bundle, tmp_path):
    aggregated = _build(tmp_path, "aggregated")
    runs = {}
    for name, bundle in (("disagg", demo_disagg_bundle), ("aggregated", aggregated)):
        args = ["run", str(bundle), "--max-new-tokens", "12", "--json"]
        for p in PROMPTS:
            args += ["--prompt", p]
        ran = runner.invoke(app, args)
        assert ran.exit_code == 0, ran.output
        runs[name] = json.loads(ran.stdout)
    ids = {name: [o["token_ids"] for b in r["batches"] for o in b["outputs"]]
           for name, r in runs.items()}
    assert ids["disagg"] == ids["aggregated"]
    handoff = runs["disagg"]["handoff"]
    assert "handoff" not in runs["aggregated"]
    per = handoff["per_prompt"]
    prompt_tokens = [o["prompt_tokens"] for b in runs["disagg"]["batches"]
                     for o in b["outputs"]]
    assert [p["prompt_tokens"] for p in per] == prompt_tokens
    assert max(prompt_tokens) > 32  # one prompt is prefilled in chunks
    # the prompt but its last token; 2 buffers per layer of [1, kv_heads, n, head_dim] float32
    m = json.loads((demo_disagg_bundle / MANIFEST).read_text())["roles"]["target"]["arch"]
    per_token = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4
    assert [p["bytes"] for p in per] == [(n - 1) * per_token for n in prompt_tokens]
    assert handoff["bytes"] == sum(p["bytes"] for p in per)
    assert handoff["processes"] == 2 and handoff["seconds"] >= 0
    shown = runner.invoke(app, ["run", str(demo_disagg_bundle), "--prompt", LONG,
                                "--max-new-tokens", "4"])
    assert shown.exit_code == 0 and f"KV hand-off: {per[1]['bytes']:,} bytes" in shown.output


def test_continuous_batching_refills_a_slot_and_ngram_speculates_on_the_decode_side(tmp_path):
    cb = {"shapes": {"batch_size": 1, "full_batch_size": 2, "prefill_seq_len": 32,
                     "ctx_len": 512}}
    aggregated = _build(tmp_path, "agg-cb", **cb)
    disagg = _build(tmp_path, "disagg-cb", **cb, **copy.deepcopy(DEMO_DISAGG))
    from qpcbuild.runtime.loader import load

    for method in ("draft_model", "ngram"):
        got = load(disagg, method=method).generate(PROMPTS, max_new_tokens=10)
        want = load(aggregated, method=method).generate(PROMPTS, max_new_tokens=10)
        # three prompts, two slots: the third is admitted when a slot frees up
        assert [r.tokens for r in got.rows] == [r.tokens for r in want.rows], method
        assert got.handoff is not None and len(got.handoff["per_prompt"]) == 3
        assert sum(r.stats.num_draft_tokens for r in got.rows) > 0  # it speculated
        # time to first token includes the worker's prefill and the hand-off
        for row, record in zip(got.rows, got.handoff["per_prompt"]):
            assert row.stats.ttft_s >= record["prefill_s"] + record["seconds"]
    _a_refused_admission_leaves_the_decoding_row_alone(load(disagg), got.rows[0].tokens)


def _a_refused_admission_leaves_the_decoding_row_alone(gen, want: list[int]) -> None:
    """Serving, a request admitted while the prefill worker is dead ends unserved at once
    (Row.unavailable: the server's 503), and the row already decoding in the other slot
    finishes with the tokens it would have had."""
    from qpcbuild.runtime.rows import new_row
    from qpcbuild.runtime.sampling import SamplingParams

    worker = gen.prefill_worker
    worker.serving = True
    decoding, refused = (new_row(gen.encode(p), 10, 512, SamplingParams(), i)
                         for i, p in enumerate(PROMPTS[:2]))
    offered = []

    def incoming(n: int) -> list:
        if offered:
            return []
        worker.proc.kill()  # dies while the first row decodes
        worker.proc.wait()
        offered.append(refused)
        return [refused]
    gen.decoder.run_rows([decoding], incoming=incoming)
    assert offered and refused.done and refused.tokens == []
    assert refused.finish_reason == "unavailable"
    assert "prefill worker exited" in refused.unavailable
    assert decoding.tokens == want and decoding.finish_reason == "length"
    deadline = time.time() + 60
    while worker.unavailable() is not None:  # replaced in the background
        assert time.time() < deadline
        time.sleep(0.05)
    assert worker.restarts == 1
    worker.close()


def test_a_killed_prefill_worker_is_replaced_and_the_next_request_is_served(
        demo_disagg_bundle):
    from qpcbuild.runtime.loader import load

    gen = load(demo_disagg_bundle)
    first = gen.generate([LONG], max_new_tokens=8).rows[0].tokens
    worker = gen.prefill_worker
    old = worker.proc
    old.kill()
    old.wait()
    again = gen.generate([LONG], max_new_tokens=8)
    assert again.rows[0].tokens == first
    assert worker.restarts == 1 and worker.proc.pid != old.pid and worker.proc.poll() is None
    worker.close()
    assert worker.proc.poll() is not None  # closed with its owner: no process left behind


def _until_healthy(server, seconds: float = 60.0) -> None:
    import httpx

    deadline = time.time() + seconds
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.time() < deadline, "the prefill worker did not come back"
        time.sleep(0.1)


def _unavailable(server, ask: dict) -> tuple[float, "object"]:
    """One request while no prefill worker answers: its status, headers and JSON, and how
    long it took."""
    import httpx

    t0 = time.perf_counter()
    got = httpx.post(server.url + "/v1/completions", json=ask, timeout=60)
    return time.perf_counter() - t0, got


def test_serve_answers_503_while_a_killed_or_hung_prefill_worker_is_replaced(
        demo_disagg_bundle):
    """Over real HTTP: a killed worker, then a hung one (stopped with SIGSTOP, so it never
    answers), each gives a 503 with an OpenAI-shaped JSON error and Retry-After, at once
    rather than after a hang; /health says 503 meanwhile; a new worker takes over and the
    same request is then served with the same tokens."""
    from helpers_server import LiveServer

    server = LiveServer(demo_disagg_bundle)
    try:
        worker = server.gen.prefill_worker
        assert worker.serving
        ask = {"model": server.name, "prompt": LONG, "max_tokens": 6, "temperature": 0}
        first = server.client.completions.create(**ask).choices[0].text
        worker.proc.kill()
        worker.proc.wait()
        seconds, got = _unavailable(server, ask)
        assert got.status_code == 503 and got.headers["retry-after"] == "2"
        error = got.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "prefill_unavailable"
        assert "prefill worker exited" in error["message"] and "retry" in error["message"]
        _until_healthy(server)
        assert server.client.completions.create(**ask).choices[0].text == first
        assert worker.restarts == 1

        worker.reply_timeout_s = 1.0  # as `serve --prefill-timeout 1`
        hung = worker.proc
        os.kill(hung.pid, signal.SIGSTOP)
        seconds, got = _unavailable(server, ask)
        assert got.status_code == 503 and seconds < 30  # the timeout, not a hang
        assert "no answer in 1 s" in got.json()["error"]["message"]
        assert hung.wait(10) == -signal.SIGKILL  # the hung worker is gone, not left behind
        _until_healthy(server)
        assert server.client.completions.create(**ask).choices[0].text == first
        assert worker.restarts == 2
        metrics = server.metrics()
        label = (("model_name", server.name),)
        assert metrics[("qpcbuild:prefill_worker_restarts", label)] == 2
        assert metrics[("qpcbuild:prefill_worker_up", label)] == 1
    finally:
        server.stop()
        server.gen.prefill_worker.close()


def test_serve_says_503_without_retry_when_no_prefill_worker_can_start(demo_disagg_bundle,
                                                                       tmp_path):
    import httpx

    from helpers_server import LiveServer

    server = LiveServer(demo_disagg_bundle)
    try:
        worker = server.gen.prefill_worker
        worker.bundle = tmp_path / "moved-away"  # the next worker finds no prefill unit
        worker.proc.kill()
        worker.proc.wait()
        ask = {"model": server.name, "prompt": LONG, "max_tokens": 4, "temperature": 0}
        deadline = time.time() + 60
        while worker.state != "failed":
            assert time.time() < deadline
            _unavailable(server, ask)
            time.sleep(0.1)
        _, got = _unavailable(server, ask)
        assert got.status_code == 503 and "retry-after" not in got.headers
        assert got.json()["error"]["message"].startswith("no prefill worker: ")
        assert httpx.get(server.url + "/health").status_code == 503  # for the orchestrator
    finally:
        server.stop()
        server.gen.prefill_worker.close()


def test_serve_refuses_a_prefill_timeout_that_is_not_a_positive_number(demo_disagg_bundle):
    got = runner.invoke(app, ["serve", str(demo_disagg_bundle), "--prefill-timeout", "0"])
    assert got.exit_code == 2 and "--prefill-timeout must be" in got.output


def test_serve_reports_the_kv_hand_off_beside_vllms_metrics(demo_disagg_bundle):
    """/metrics in Prometheus text: the hand-off's bytes (the contract's [1, kv_heads, n - 1,
    head_dim] float32 slices of every buffer) and seconds for each request served."""
    from helpers_server import LiveServer

    server = LiveServer(demo_disagg_bundle)
    try:
        served = [server.client.completions.create(model=server.name, prompt=p, max_tokens=4,
                                                   temperature=0) for p in PROMPTS]
        metrics = server.metrics()
    finally:
        server.stop()
        server.gen.prefill_worker.close()
    arch = json.loads((demo_disagg_bundle / MANIFEST).read_text())["roles"]["target"]["arch"]
    per_token = 2 * arch["num_layers"] * arch["num_kv_heads"] * arch["head_dim"] * 4
    want = sum((r.usage.prompt_tokens - 1) * per_token for r in served)
    label = (("model_name", server.name),)
    assert metrics[("qpcbuild:kv_handoff_bytes_total", label)] == want
    assert metrics[("qpcbuild:kv_handoff_requests_total", label)] == len(PROMPTS)
    assert metrics[("qpcbuild:kv_handoff_seconds_count", label)] == len(PROMPTS)
    assert metrics[("qpcbuild:kv_handoff_request_bytes_sum", label)] == want
    assert metrics[("qpcbuild:kv_handoff_prefill_seconds_sum", label)] > 0
    assert sum(v for (name, _), v in metrics.items()
               if name == "vllm:request_success_total") == len(PROMPTS)
    assert server.gen.decoder.log.records == []  # counted, not kept


def test_build_units_share_the_target_export(tmp_path):
    from qpcbuild.bundle.units import plan_units
    from qpcbuild.cache import Cache

    data = demo_recipe(**DEMO_DISAGG)
    plan = make_plan(load(data))
    units = {u.name: u for u in plan_units(plan, Cache(tmp_path / "cache"))}
    assert [n for n in units if n.startswith("export-")] == ["export-target", "export-draft"]
    assert units["onnxruntime-prefill"].deps == ("export-target",)
    # the same graph and settings: one cache entry serves both target units on ONNX Runtime
    assert units["onnxruntime-prefill"].key == units["onnxruntime-target"].key


def test_the_prefill_worker_answers_a_process_with_over_1024_open_files(demo_disagg_bundle):
    """A long-lived server or a test session holds many files: the worker's pipe then gets a
    descriptor above select()'s limit of 1,024, which select.select refused (ValueError)."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert held[-1] > 1024
        ran = runner.invoke(app, ["run", str(demo_disagg_bundle), "--prompt", PROMPTS[0],
                                  "--max-new-tokens", "4", "--json"])
        assert ran.exit_code == 0, ran.output
        assert json.loads(ran.stdout)["handoff"]["bytes"] > 0
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
