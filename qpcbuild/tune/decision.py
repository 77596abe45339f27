"""tune's answer as one typed value: the K chosen, the table it was chosen from, the evidence
behind the table and where the call costs came from. `to_json()` is the record `tune --json`
prints and `compile --tune` stores in the manifest (key `tuning`); its keys and their order
are the ones the dict it replaces had."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

# Measured through the sessions of a bundle (each backend names its own source, such as
# "onnxruntime-cpu" or "qaic-card"), or estimated by the roofline model of the card.
CostSource = str
ROOFLINE = "roofline-model"


@dataclass(frozen=True)
class KPrediction:
    """One row of the decision table: the model's expectation at one K."""
    k: int
    expected_tokens_per_step: float
    expected_accepted_len: float
    alpha: tuple[float, ...]
    draft_ms: float
    verify_ms: float
    host_ms: float
    cost_ms: float
    tokens_per_s: float
    predicted_speedup: float
    vs_best: float | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> KPrediction:
        return cls(**{**row, "alpha": tuple(row["alpha"])})


@dataclass(frozen=True)
class BatchChoice:
    """`tune --per-batch`: the best K at one batch size (0: do not speculate there)."""
    batch_size: int
    chosen_k: int
    tokens_per_s_per_sequence: float
    tokens_per_s_batch: float
    predicted_speedup: float
    table: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class ConfidenceStop:
    """The best draft_p_min from the loop replayed at K_max, and the Ks it verifies in."""
    draft_p_min: float
    ks: tuple[int, ...]
    predicted_tokens_per_s: float
    predicted_speedup: float | None
    beats_best_fixed_k: bool
    k_max: int
    table: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class ModelCheck:
    """The model's prediction against a real run of the same bundle (decode phase, the first
    prompts): target-only, or the method at one K with its accepted tokens and drafts replayed
    and measured (equal under greedy decoding: the replay is the engine's loop)."""
    config: str  # "target-only" | "<method> K=<k>"
    predicted: float | None  # None where the costs are not this bundle's (or modelled)
    measured: float | None
    accepted_replayed: int | None = None
    accepted_measured: int | None = None
    drafts_replayed: int | None = None
    drafts_measured: int | None = None

    @property
    def error(self) -> float | None:
        """predicted / measured - 1 (None without both)."""
        if not self.measured or self.predicted is None:
            return None
        return round(self.predicted / self.measured - 1, 4)

    def to_json(self) -> dict[str, Any]:
        """The record's keys in the order tune has always written them."""
        if self.accepted_replayed is None:
            return {"config": self.config, "predicted": self.predicted,
                    "measured": self.measured, "error": self.error}
        return {"config": self.config, "measured": self.measured,
                "accepted_replayed": self.accepted_replayed,
                "accepted_measured": self.accepted_measured,
                "drafts_replayed": self.drafts_replayed, "drafts_measured": self.drafts_measured,
                "predicted": self.predicted, "error": self.error}


@dataclass(frozen=True)
class Evidence:
    """What the table rests on, as recorded: the calibration (acceptance by K), the call costs
    (their figures and statistic), the model's check against real runs, and the formula."""
    calibration: Mapping[str, Any]
    costs: Mapping[str, Any]
    model_check: tuple[ModelCheck, ...]
    formula: str


@dataclass(frozen=True)
class TuneRun:
    """Where the decision was made: the recipe, its overrides, the prompts and the machine."""
    recipe: str
    name: str
    overrides: tuple[str, ...]
    created: str
    prompt_set: str
    machine: Mapping[str, Any]
    recipe_k: int | list[int]
    acceptance_measured_on: str | None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    method: str
    k_max: int
    chosen_k: int
    recommended_ks: tuple[int, ...]
    table: tuple[KPrediction, ...]
    evidence: Evidence
    cost_source: CostSource
    per_batch: tuple[BatchChoice, ...] = ()
    confidence_stop: ConfidenceStop | None = None
    run: TuneRun | None = None
    # filled in by the CLI: the model check's contradictions, and the recipe written
    model_check_disagrees: tuple[str, ...] | None = None
    written: str | None = None
    written_value: int | list[int] | None = field(default=None)

    @property
    def chosen(self) -> KPrediction:
        return next(r for r in self.table if r.k == self.chosen_k)

    @property
    def costs_measured(self) -> bool:
        return self.cost_source != ROOFLINE

    @property
    def winning_stop(self) -> ConfidenceStop | None:
        """The confidence stop when it beat the best fixed K (then its Ks and threshold are
        what a tuned recipe gets), else None."""
        stop = self.confidence_stop
        return stop if stop is not None and stop.beats_best_fixed_k else None

    def with_run(self, run: TuneRun) -> Decision:
        return replace(self, run=run)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        run = self.run
        if run is not None:
            out.update({"tool": "qpcbuild tune", "recipe": run.recipe, "name": run.name,
                        "overrides": list(run.overrides), "created": run.created,
                        "prompt_set": run.prompt_set, "machine": dict(run.machine),
                        "recipe_k": run.recipe_k})
        out["cost_source"] = self.cost_source
        if run is not None:
            out.update({"acceptance_measured_on": run.acceptance_measured_on,
                        "notes": list(run.notes)})
        chosen = self.chosen
        out.update({"method": self.method, "k_max": self.k_max, "chosen_k": self.chosen_k,
                    "recommended_ks": list(self.recommended_ks),
                    "predicted_tokens_per_s": chosen.tokens_per_s,
                    "predicted_speedup": chosen.predicted_speedup,
                    "calibration": self.evidence.calibration, "costs": self.evidence.costs,
                    "model_check": [c.to_json() for c in self.evidence.model_check],
                    "table": [_listed(asdict(r)) for r in self.table],
                    "formula": self.evidence.formula})
        if self.per_batch:
            out["per_batch"] = [_listed(asdict(p)) for p in self.per_batch]
        if self.confidence_stop is not None:
            out["confidence_stop"] = _listed(asdict(self.confidence_stop))
        if self.model_check_disagrees is not None:
            out["model_check_disagrees"] = list(self.model_check_disagrees)
        if self.written is not None:
            out.update({"written": self.written, "written_value": self.written_value})
        return out


def _listed(d: dict[str, Any]) -> dict[str, Any]:
    """asdict keeps tuples; the JSON record (and a reader comparing it to lists) has lists."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
