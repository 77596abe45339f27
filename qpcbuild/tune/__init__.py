"""`qpcbuild tune`: pick K from measured evidence instead of a guess.

Parts: model.py (the decision model, pure functions), acceptance.py (greedy outputs and the
engine's loop replayed at every K), costs.py (call costs, measured on a backend or modelled,
each with its source), decision.py (the typed answer: table, evidence, cost source),
calibrate.py (the whole run), recipe_edit.py (writing K into a recipe
with ruamel.yaml), report.py (the evidence comment, tables, JSON).
"""

from .acceptance import replayed, summed_run
from .calibrate import DEFAULT_K_MAX, calibrate, tune
from .decision import (BatchChoice, ConfidenceStop, Decision, Evidence, KPrediction,
                       ModelCheck, TuneRun)
from .costs import (ROOFLINE_ASSUMPTIONS, cost_backend, lower_quartile, measure_costs,
                    roofline_call_s, roofline_costs, roofline_figures)
from .model import (all_accepted, best_k_per_batch, choose_k, conditional_acceptance,
                    expected_tokens, host_model, predict, recommended_ks)
from .recipe_edit import set_k_in_text, write_tuned_recipe
from .report import TUNE_MARK, cost_line, evidence_comment, show_tune, write_json

__all__ = ["BatchChoice", "ConfidenceStop", "DEFAULT_K_MAX", "Decision", "Evidence",
           "KPrediction", "ModelCheck", "TuneRun", "ROOFLINE_ASSUMPTIONS", "TUNE_MARK", "all_accepted",
           "best_k_per_batch", "calibrate", "choose_k", "conditional_acceptance", "cost_backend",
           "cost_line", "evidence_comment", "expected_tokens", "host_model", "lower_quartile",
           "measure_costs", "predict", "recommended_ks", "replayed", "roofline_call_s",
           "roofline_costs", "roofline_figures", "set_k_in_text", "show_tune", "summed_run",
           "tune", "write_json", "write_tuned_recipe"]
