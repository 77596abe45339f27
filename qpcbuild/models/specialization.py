"""A compiled shape of a model's graph, as the plan decides it and the manifest records it. A
module of its own (pydantic only), so reading a manifest loads no numpy."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator


class Specialization(BaseModel):
    """One compiled shape of the graph: its name (Prefill, Decode_1, ...) and each symbolic dim's
    size as text (the compiler's specializations.json form). The plan decides them; the
    manifest records and checks them (bundle/manifest_model.py)."""
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    name: str
    symbols: dict[str, str]

    @field_validator("symbols")
    @classmethod
    def _sizes(cls, v: dict[str, str]) -> dict[str, str]:
        missing = {"batch_size", "seq_len", "ctx_len"} - set(v)
        if missing:
            raise ValueError(f"lacks {', '.join(sorted(missing))}")
        bad = [k for k, n in v.items() if not (n.isascii() and n.isdigit() and 0 < int(n) < 1 << 24)]
        if bad:
            raise ValueError(f"{bad[0]} must be a positive whole number, got {v[bad[0]]!r}")
        return v

    def size(self, symbol: str) -> int:
        return int(self.symbols[symbol])
