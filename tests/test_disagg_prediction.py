"""The card's prediction for a disaggregated recipe (qpcbuild/tune/disagg_prediction.py and
benchmarks/disagg_card_prediction.py): hand-off bytes per prompt length at the KV precision,
their time over a link the caller states (printed as an assumption), and the decode node's wait
per admitted prompt, aggregated against disaggregated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qpcbuild.errors import UsageError
from qpcbuild.recipe import load_recipe, recipe_from_text
from qpcbuild.tune.costs import roofline_figures
from qpcbuild.tune.disagg_prediction import admission_costs

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CARD = RECIPES / "llama8b-1b-disagg.yaml"
# Llama 3.1 8B's published config: 32 layers, 8 KV heads of 128; MXINT8 stores 32 values and
# one 8-bit scale in 33 bytes
LLAMA8B_KV_BYTES_PER_POSITION = 2 * 32 * 8 * 128 * 33 / 32


def test_the_hand_off_is_the_prompts_kv_at_the_card_precision_over_the_stated_link():
    r = load_recipe(CARD)
    fast, slow = (admission_costs(r, [128, 2000], gbps, roofline_figures(r))
                  for gbps in (100.0, 25.0))
    assert [c.handoff_bytes for c in fast] == [round(LLAMA8B_KV_BYTES_PER_POSITION * (n - 1))
                                               for n in (128, 2000)]
    assert fast[0].handoff_bytes == 8_583_168
    # 8,583,168 bytes = 68.67 Mbit: 0.687 ms at 100 Gbit/s, four times that at 25
    assert fast[0].link_s == pytest.approx(0.6866534e-3, rel=1e-6)
    assert slow[0].link_s == pytest.approx(4 * fast[0].link_s)


def test_disaggregated_the_decode_node_waits_for_the_drafts_prefill_only():
    r = load_recipe(CARD)
    costs = admission_costs(r, [128, 512, 2000], 100.0, roofline_figures(r))
    for c in costs:
        assert c.decode_wait_disaggregated_s == c.draft_prefill_s > 0
        assert c.decode_wait_aggregated_s > c.decode_wait_disaggregated_s
    waits = [c.decode_wait_aggregated_s for c in costs]
    assert waits == sorted(waits) and waits[-1] > 10 * waits[0]  # grows with the prompt


def test_with_ngram_no_prefill_ever_holds_the_decode_node():
    data = yaml.safe_load(CARD.read_text())
    data["draft"] = {"method": "ngram"}
    r = recipe_from_text(yaml.safe_dump(data), str(CARD))
    costs = admission_costs(r, [512], 100.0, roofline_figures(r))
    assert costs[0].draft_prefill_s == costs[0].decode_wait_disaggregated_s == 0.0
    assert costs[0].decode_wait_aggregated_s > 0


def test_refuses_an_aggregated_recipe_a_missing_link_speed_and_a_prompt_past_ctx_len():
    r = load_recipe(CARD)
    with pytest.raises(UsageError, match="--link-gbps"):
        admission_costs(r, [128], 0.0, roofline_figures(r))
    with pytest.raises(UsageError, match="ctx_len"):
        admission_costs(r, [2048], 1.0, roofline_figures(r))
    aggregated = load_recipe(RECIPES / "llama8b-1b.yaml")
    with pytest.raises(UsageError, match="not a disaggregated recipe"):
        admission_costs(aggregated, [128], 1.0, roofline_figures(aggregated))


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "disagg_card_prediction.py"),
                           *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_script_prints_the_link_speed_as_an_assumption():
    shown = _script(str(CARD), "--link-gbps", "25", "--lengths", "128")
    assert shown.returncode == 0, shown.stderr
    assert "ASSUMED link speed: 25 Gbit/s (given, not measured)" in shown.stdout
    assert "| 128 | 8.6 | 2.75 |" in shown.stdout  # MB, and ms at 25 Gbit/s
    refused = _script(str(RECIPES / "llama8b-1b.yaml"), "--link-gbps", "25")
    assert refused.returncode == 2 and "not a disaggregated recipe" in refused.stderr
    assert _script(str(CARD)).returncode == 2  # --link-gbps is required: no default speed
