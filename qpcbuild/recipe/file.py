"""Reading a recipe file without trusting it: a regular file read up to its cap whatever size
it claims, YAML through a safe loader that refuses aliases (the "billion laughs" bomb), and the
line of every key path for error messages, with duplicate keys reported instead of silently
collapsed."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml

from ..errors import Problem, RecipeError

MAX_RECIPE_BYTES = 1 << 20
KeyPath = tuple[str | int, ...]  # a key's place in the YAML: ("hardware", "target", "num_cores")


def dotted(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        parts.append(f"[{p}]" if isinstance(p, int) else ("." if parts else "") + str(p))
    return "".join(parts) or "<root>"


class _NoAliasLoader(yaml.SafeLoader):
    """A safe loader that also refuses anchors/aliases, which enable exponential blow-up."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in PyYAML's stubs
            raise yaml.MarkedYAMLError("while composing", None,
                                       "YAML aliases (*name) are not allowed in recipes",
                                       event.start_mark)
        return super().compose_node(parent, index)


def _key_lines(node: yaml.Node, path: KeyPath = (), out: dict[KeyPath, int] | None = None,
               duplicates: list[Problem] | None = None) -> dict[KeyPath, int]:
    out = {} if out is None else out
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            k = key.value if isinstance(key, yaml.ScalarNode) else str(key)
            line = key.start_mark.line + 1
            if k in seen and duplicates is not None:
                duplicates.append(Problem(dotted(path + (k,)), f"duplicate key (first on line "
                                          f"{seen[k]}); YAML would silently keep the last one",
                                          line))
            seen.setdefault(k, line)
            out[path + (k,)] = line
            _key_lines(value, path + (k,), out, duplicates)
            out[path + (k,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _key_lines(item, path + (i,), out, duplicates)
    return out


def parse_yaml(text: str, source: str,
               duplicates: list[Problem] | None = None) -> tuple[Any, dict[KeyPath, int]]:
    """Data and the line of every key path; duplicate keys are appended to `duplicates`."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_RECIPE_BYTES:
        raise RecipeError(source, [Problem("<file>", f"recipe is larger than {MAX_RECIPE_BYTES} "
                                           "bytes; a recipe is a short YAML file")])
    try:
        loader = _NoAliasLoader(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters before parsing
        raise RecipeError(source, [Problem("<file>", f"malformed YAML: {exc}")]) from None
    try:
        node = loader.get_single_node()
        if node is None:
            raise RecipeError(source, [Problem("<file>", "recipe is empty; start from "
                                               "recipes/demo.yaml")])
        data = loader.construct_document(node)
        lines = _key_lines(node, duplicates=duplicates)
    except RecursionError:  # "[[[[..." thousands deep: the composer recurses per level
        raise RecipeError(source, [Problem("<file>", "malformed YAML: nested too deeply")]) \
            from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        raise RecipeError(source, [Problem("<file>", f"malformed YAML: {exc.problem}", line)]) from None
    except yaml.YAMLError as exc:
        raise RecipeError(source, [Problem("<file>", f"malformed YAML: {exc}")]) from None
    finally:
        loader.dispose()
    return data, lines


def read_capped(path: Path, source: str) -> bytes:
    """The file's bytes, refusing anything but a regular file and stopping at the cap whatever
    size the file claims (/dev/zero reports 0; a FIFO would block forever)."""
    def fail(message: str) -> RecipeError:
        return RecipeError(source, [Problem("<file>", message)])

    try:
        st = path.stat()
    except FileNotFoundError:
        raise fail("no such file") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long
        raise fail(f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise fail("is a folder, not a recipe file")
    if not stat.S_ISREG(st.st_mode):
        raise fail("is not a regular file (a FIFO, socket or device); a recipe is a YAML file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise fail(f"cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise fail(f"recipe is larger than {MAX_RECIPE_BYTES} bytes; a recipe is a short YAML "
                   "file")
    return raw
