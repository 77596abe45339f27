"""Write docs/manifest-schema.json, the JSON Schema of a bundle's manifest.json, from the typed
`Manifest` model itself (qpcbuild/bundle/manifest.py).

Generated so that it cannot drift from the code: tests/test_docs.py regenerates it and fails when
the committed file differs. Run `python scripts/manifest_schema.py` after changing the model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "manifest-schema.json"


def schema_text() -> str:
    sys.path.insert(0, str(ROOT))  # this checkout's qpcbuild, as tests/test_docs.py runs it
    from qpcbuild.bundle.manifest import MANIFEST_SCHEMA, Manifest

    schema = Manifest.model_json_schema(by_alias=True, mode="validation")
    schema["$comment"] = (f"manifest.json schema {MANIFEST_SCHEMA}, generated from "
                          "qpcbuild.bundle.manifest.Manifest by scripts/manifest_schema.py; "
                          "fields not listed are kept and sealed but not interpreted")
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the committed file differs from the model")
    args = parser.parse_args()
    text = schema_text()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python "
                  "scripts/manifest_schema.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
