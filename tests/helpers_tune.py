"""A small, hand-made tune decision for the tests of what reads one (recipe writing, the
refusal of a contradicted K), without measuring anything."""

from __future__ import annotations

from qpcbuild.tune import Decision, Evidence, KPrediction, ModelCheck, TuneRun, recommended_ks


def made_decision(k: int, method: str = "draft_model",
                  model_check: tuple[ModelCheck, ...] = ()) -> Decision:
    """K chosen from a three-row table (K=3 fastest by 1 token/s a K), with `model_check` as
    the run's check against real runs."""
    table = tuple(KPrediction(k=kk, expected_tokens_per_step=2.0, expected_accepted_len=2.0,
                              alpha=(0.9,) * kk, draft_ms=0.2, verify_ms=0.7, host_ms=0.1,
                              cost_ms=1.0, tokens_per_s=100.0 + kk, predicted_speedup=1.5,
                              vs_best=0.0) for kk in (1, 2, 3))
    evidence = Evidence(
        calibration={"prompts": 2, "acceptance_per_position": [0.9, 0.8, 0.7],
                     "proposal_fraction": 1.0},
        costs={"verify_ms": {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, "draft_step_ms": 0.2},
        model_check=model_check, formula="")
    run = TuneRun(recipe="recipe.yaml", name="demo", overrides=(),
                  created="2026-01-01T00:00:00+00:00", prompt_set="code", machine={},
                  recipe_k=4, acceptance_measured_on=None)
    return Decision(method=method, k_max=3, chosen_k=k,
                    recommended_ks=tuple(recommended_ks(method, k)), table=table,
                    evidence=evidence, cost_source="onnxruntime-cpu", run=run)
