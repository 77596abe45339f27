"""shapes.prefill_tail_seq_lens: a prompt's last prefill chunk goes through the narrowest
compiled window that holds it. The oracle is the same pair built without tail windows (whose
greedy output test_oracles.py checks against transformers): the first token's logits and every
generated token must be the same, while the calls really are narrower."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import qpcbuild
from qpcbuild.bundle import build_bundle
from qpcbuild.cache import Cache
from qpcbuild.cli import app
from qpcbuild.plan import make_plan
from qpcbuild.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
TAILS = "shapes.prefill_tail_seq_lens=[8,16]"  # the demo recipe prefills 32 at a time


def build(tmp_factory, name: str, *overrides: str) -> Path:
    out = tmp_factory.mktemp(name) / "bundle"
    r = load_recipe(ROOT / "recipes/demo.yaml", list(overrides))
    build_bundle(make_plan(r), cache=Cache(tmp_factory.getbasetemp() / "cache"), out=out)
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Path]:
    """The demo pair with and without tail windows, at batch 1 and at batch 3."""
    batch3 = ("shapes.batch_size=3", "shapes.ctx_len=160")
    return {"plain": build(tmp_path_factory, "plain"),
            "tails": build(tmp_path_factory, "tails", TAILS),
            "plain3": build(tmp_path_factory, "plain3", *batch3),
            "tails3": build(tmp_path_factory, "tails3", TAILS, *batch3)}


@pytest.fixture(scope="module")
def token_ids(pairs) -> list[list[int]]:
    """Prompts of 5..70 tokens: below, between and above the windows 8, 16 and 32."""
    gen = qpcbuild.load(pairs["plain"], verify="none")
    text = " ".join(json.loads(line)["text"] for line in
                    (DEMO / "eval_prompts.jsonl").read_text().splitlines()[:6])
    ids = gen.encode(text)
    return [ids[:n] for n in (5, 8, 12, 16, 20, 33, 40, 47, 70)]


def widths_seen(gen) -> list[tuple[str, int]]:
    """Wrap both sessions' run to record (role, window width) for every call."""
    seen: list[tuple[str, int]] = []
    for role, session in (("target", gen.target), ("draft", gen.draft)):
        if session is None:
            continue
        run = session.run

        def recording(ids, pos, *rest, _run=run, _role=role):
            seen.append((_role, ids.shape[1]))
            return _run(ids, pos, *rest)
        session.run = recording
    return seen


def test_the_tail_windows_are_compiled_for_both_roles_and_sealed(pairs):
    tails = qpcbuild.load(pairs["tails"], verify="full").manifest
    plain = qpcbuild.load(pairs["plain"], verify="none").manifest
    assert tails.shapes.prefill_tail_seq_lens == [8, 16]
    for role in (tails.target, tails.draft):
        prefills = {s.name: s.size("seq_len") for s in role.specializations
                    if s.name.startswith("Prefill")}
        assert prefills == {"Prefill": 32, "Prefill_8": 8, "Prefill_16": 16}
    # a recipe without tail windows writes no key: the bundles built before keep their ids
    raw = json.loads((pairs["plain"] / "manifest.json").read_text())
    assert "prefill_tail_seq_lens" not in raw["shapes"]
    assert plain.bundle_id != tails.bundle_id


def test_first_token_logits_equal_the_full_window_prefill(pairs, token_ids):
    plain = qpcbuild.load(pairs["plain"], verify="none")
    tails = qpcbuild.load(pairs["tails"], verify="none")
    for ids in token_ids:
        rows = [plain.decoder, tails.decoder]
        logits = [np.array(d._prefill(d.target, [_row(ids)], _times(), "target")) for d in rows]
        np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4,
                                   err_msg=f"{len(ids)} tokens")


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_generated_tokens_equal_and_the_windows_are_narrower(pairs, token_ids, method):
    plain = qpcbuild.load(pairs["plain"], verify="none")
    tails = qpcbuild.load(pairs["tails"], method=method, verify="none")
    seen = widths_seen(tails)
    for ids in token_ids:
        seen.clear()
        out = tails.generate([ids], max_new_tokens=24)
        base = plain.generate([ids], max_new_tokens=24, target_only=True)
        assert out.rows[0].tokens == base.rows[0].tokens, len(ids)
        target_prefill = [w for role, w in seen if role == "target" and w in (8, 16, 32)]
        full, last = divmod(len(ids), 32)
        want = [32] * full + ([next(w for w in (8, 16, 32) if w >= last)] if last else [])
        assert target_prefill[:len(want)] == want, (len(ids), seen)
        if method == "draft_model":
            assert ("draft", want[-1]) in seen  # the draft's prefill is narrower too


def test_rows_of_uneven_length_in_one_batch_stay_exact(pairs, token_ids):
    """Batch 3: a row that ended in an earlier call repeats its last full-width chunk; the
    narrow window serves only calls in which no row has ended."""
    plain = qpcbuild.load(pairs["plain3"], verify="none")
    tails = qpcbuild.load(pairs["tails3"], method="draft_model", verify="none")
    for batch in ([token_ids[0], token_ids[2], token_ids[4]],      # 5, 12, 20: one call
                  [token_ids[1], token_ids[6], token_ids[8]],      # 8, 40, 70: three calls
                  [token_ids[5], token_ids[6], token_ids[7]]):     # 33, 40, 47: two calls
        out = tails.generate(batch, max_new_tokens=20)
        for i, ids in enumerate(batch):
            single = plain.generate([ids], max_new_tokens=20, target_only=True)
            assert out.rows[i].tokens == single.rows[0].tokens, (i, len(ids))


runner = CliRunner()


@pytest.mark.parametrize("value,problem", [("[32]", "outside 1..31"), ("[0]", "outside 1..31"),
                                           ("[8,8]", "duplicate"), ("[abc]", ""),
                                           ("[5]", "already a verify window (K+1 for K=4)")])
def test_a_bad_tail_window_is_refused_with_its_place(value, problem, tmp_path):
    res = runner.invoke(app, ["plan", str(ROOT / "recipes/demo.yaml"), "--set",
                              f"shapes.prefill_tail_seq_lens={value}"])
    assert res.exit_code == 2, res.output
    assert "shapes.prefill_tail_seq_lens" in res.output and problem in res.output


def _row(ids: list[int]):
    from qpcbuild.runtime.rows import new_row
    from qpcbuild.runtime.sampling import SamplingParams
    return new_row(ids, 8, 512, SamplingParams(), 0)


def _times():
    from qpcbuild.runtime.rows import LoopTimes
    return LoopTimes()
