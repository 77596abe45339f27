"""What the serve-config tests share (test_serve_config.py, test_disaggregated.py): a `vllm
serve` argv's flags, and the check of its option names against the vLLM versions recorded in
tests/fixtures/vllm_cli_names.json (scripts/record_vllm_cli_names.py)."""

from __future__ import annotations

import json
from pathlib import Path

VLLM_NAMES = json.loads((Path(__file__).parent / "fixtures" / "vllm_cli_names.json").read_text())


def argv_flags(argv: list[str]) -> dict[str, str]:
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


def unknown_to_vllm(argv: list[str], form: str) -> list[str]:
    """The options, and --speculative-config keys, in a `vllm serve` argv that the vLLM targeted
    by serve-config's `form` does not have. --additional-config is not checked: vLLM hands it
    unread to the platform plugin (vllm-qaic's override_qaic_config and friends)."""
    target = VLLM_NAMES["targets"][form]
    names = VLLM_NAMES["versions"][target["version"]]
    options = set(names["serve_options"]) | set(target.get("extra_options", []))
    bad = [a for a in argv if a.startswith("--") and a.split("=", 1)[0] not in options]
    spec = argv_flags(argv).get("--speculative-config")
    fields = set(names["speculative_config_fields"])
    return bad + [f"speculative_config.{key}" for key in json.loads(spec or "{}")
                  if key not in fields]
