"""The settings part of every artifact's cache key, pinned for shipped recipes: a bundle cache
(local or remote) is only as good as its keys, so a refactor of the plan must leave them byte-
identical. Recorded before the backends' planning moved into qpcbuild/plan_backends/ (now
backends/<name>/plan.py); a change here means every cached artifact is rebuilt, so it must be
one that changes artifacts (bump EXPORTER_VERSION or ORT_LOWERING_VERSION for that). The batched
and continuous-batching ONNX Runtime keys changed once since, on purpose: those bundles moved
from the portable graph to the fused one with a symbolic batch (windows run once per row,
single-token calls over all rows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEMO_EXPORT = {"target": "f62f385cade43499", "draft": "34d551558780c028"}
LLAMA_EXPORT = {"target": "3cefa9a80389b291", "draft": "0ab98a3d3807539e"}

PINNED = {
    "demo": ("demo.yaml", [], DEMO_EXPORT, {
        "target": ("5cfad01d1c74465d", "c7b38bac792434a2"),
        "draft": ("c4b3cb2cdac6c224", "d6f0b78f9d20c183")}),
    "demo-card-formats": ("demo.yaml", ["precision.quantization=mxfp6",
                                        "precision.kv_cache_dtype=mxint8"], DEMO_EXPORT, {
        "target": ("29c1b47a62fa2839", "dcfda35f17c8300b"),
        "draft": ("b57df498736e1b27", "5f7be77ad10c82b0")}),
    "demo-batch-2": ("demo.yaml", ["shapes.batch_size=2"], DEMO_EXPORT, {
        "target": ("4228bc482b914795", "3eaa138be0baab9c"),
        "draft": ("883d9edf826f31d2", "0e4f0f01e5b1bcb6")}),
    "demo-continuous-batching": ("demo.yaml", ["shapes.full_batch_size=4"], {
        "target": "ec9865e4172841ff", "draft": "e9a79f2069400f09"}, {
        "target": ("3a16c24d03d70e92", "acfbd8dd487cc9be"),
        "draft": ("36b775ac736c064d", "3bf01807a15c4f7b")}),
    "demo-compiler-options": ("demo.yaml", [
        "hardware.compiler_options.mos=2", "hardware.compiler_options.allow_mxint8_mdp_io=true",
        'hardware.compiler_options.extra_flags=["-foo"]', "onnxruntime.graph=portable"],
        DEMO_EXPORT, {
        "target": ("65d6dc24602e28af", "5ba43ba71c681df4"),
        "draft": ("60f623ad00302569", "76c46dd15f8cddf0")}),
    "llama8b-1b": ("llama8b-1b.yaml", [], LLAMA_EXPORT, {
        "target": ("f31e85cf09993cb5", "8776686c839d53d0"),
        "draft": ("6541fa692e08c448", "a3d17b7c2c62be2a")}),
    "llama8b-1b-flat-2-qids": ("llama8b-1b.yaml", ["hardware.specializations_format=flat",
                                                   "hardware.target.device_group=[0,1]"],
                               LLAMA_EXPORT, {
        "target": ("f31e85cf09993cb5", "1cbd8583e456053c"),
        "draft": ("6541fa692e08c448", "e6734842159c6542")}),
}


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path_factory, monkeypatch):
    """The llama recipes plan from the known-models table, not from this machine's HF cache."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf-cache")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("case", list(PINNED))
def test_cache_keys_are_the_recorded_ones(case):
    recipe, overrides, export, backends = PINNED[case]
    # the compiler's path is argv[0], outside the key; naming one keeps the plan off this PATH
    plan = make_plan(load_recipe(RECIPES / recipe, overrides), compiler="qaic-compile")
    assert {rp.role: rp.cache_keys.to_dict() for rp in plan.roles} == {
        role: {"export": export[role], "onnxruntime": ort, "qaic": qaic}
        for role, (ort, qaic) in backends.items()}
