"""The bundle's manifest is read and written only through the typed `Manifest`
(qpcbuild/bundle/manifest_model.py, sealed and read by manifest.py): no other module indexes the
manifest's JSON by string key.

A source scan, not a proof: it looks for `manifest[...]` / `manifest.get(...)` and for any
subscript or `.get` with a key that only the bundle manifest has. Dicts that merely share a key
name with the manifest (a run's stats, the doctor's report, the recipe's YAML, the plan's and the
export's records) are named below with the reason, so a new exception is a visible decision."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qpcbuild"
MODELS = ("bundle/manifest.py", "bundle/manifest_model.py")  # reading and sealing; the model
OCI_KEYS = {"layers", "artifactType", "subject", "mediaType", "annotations", "config"}
BUNDLE_KEYS = ("roles", "compiled_ks", "specializations", "k_schedule",
               "num_speculative_tokens_per_batch_size", "qpc_files", "kv_binding",
               "core_share", "intra_op_threads", "eos_token_ids", "smoke_weights",
               "weights_digest", "prefill_seq_len", "full_batch_size", "num_speculative_tokens",
               "bundle_id", "speculation", "shapes", "tokenizer", "toolchain", "tuning")
BY_NAME = re.compile(r'\bmanifest(?:\[|\.get\()\s*"(\w+)"')  # (an OCI manifest is allowed)
BY_KEY = re.compile(r'(\w+(?:\[[\w.]+\])?)(?:\[|\.get\()"(' + "|".join(BUNDLE_KEYS) + r')"\]?'
                    r'(\s*=(?!=))?')
NOT_A_BUNDLE_MANIFEST = {
    "st": "a run's stats record (runtime/stats.py)",
    "report": "the doctor's report",
    "data": "the recipe's YAML, edited by tune",
    "exports[rp.role]": "the export stage's record, which the build copies into the manifest",
}


def offending_lines(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in MODELS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            keys = [k for k in BY_NAME.findall(line) if k not in OCI_KEYS]
            keys += [key for receiver, key, assigned in BY_KEY.findall(line)
                     if not assigned and receiver not in NOT_A_BUNDLE_MANIFEST]
            if keys:
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_no_module_but_the_model_reads_the_manifest_by_key():
    assert offending_lines(PACKAGE) == []


def test_the_scan_finds_dict_access_to_a_manifest(tmp_path):
    """The scan itself: each form of access it must catch (as the code read manifests before
    the model) is caught, and the model's own module and plain writes are not."""
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "manifest_model.py").write_text('m["roles"]["target"]\n')
    (tmp_path / "reader.py").write_text(
        'ks = gen.manifest["roles"]["target"]["compiled_ks"]\n'
        'spd = m["speculation"]\n'
        'policy = spd.get("k_schedule")\n'
        'name = manifest.get("name")\n'
        'layers = manifest.get("layers")\n'       # an OCI manifest: allowed
        'out["k_schedule"] = 3\n'                  # a write into a dict being built: allowed
        'gate = st.get("speculation")\n')          # a stats record: allowed
    assert [line.split(":")[1] for line in offending_lines(tmp_path)] == ["1", "2", "3", "4"]
