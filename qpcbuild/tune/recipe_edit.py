"""Writing tune's decision into a recipe: a round trip through ruamel.yaml, which keeps every
comment, key order and flow/block style; only `speculation.num_speculative_tokens` (and, for a
copy written to another folder, the model folders) change, and the evidence goes in as comment
lines above it (replacing an earlier `# tune:` block). ruamel normalises insignificant spacing
inside a line (`draft:  {...}` becomes `draft: {...}`)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from ..errors import Problem, RecipeError, UsageError
from .decision import ConfidenceStop, Decision
from .model import recommended_ks
from .report import TUNE_MARK, evidence_comment

K_KEY = "num_speculative_tokens"
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def _yaml():
    from ruamel.yaml import YAML

    y = YAML()  # round-trip mode
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)
    return y


def _marked(line: str) -> bool:
    return line.strip().startswith(TUNE_MARK)


def _drop_marked(node) -> None:
    """Remove the comment lines of an earlier tune run (those starting with TUNE_MARK) from
    node and its children: ruamel keeps comments in `ca`, per key ([2]: the end-of-line
    comment and the comment lines after it) and before a mapping's first key (lists of
    whole-line tokens)."""
    from ruamel.yaml.comments import CommentedBase

    if not isinstance(node, CommentedBase):
        return
    ca = node.ca
    for entry in list(ca.items.values()) + [ca.comment or []]:
        for i, slot in enumerate(entry or []):
            if isinstance(slot, list):
                slot[:] = [t for t in slot if not (t is not None and _marked(t.value))]
            elif slot is not None:
                head, *rest = slot.value.split("\n")
                keep = [x for x in rest if not _marked(x)]
                if _marked(head):  # a whole-line token of our own
                    head = keep.pop(0) if keep else ""
                slot.value = "\n".join([head, *keep]) if (head or keep) else "\n"
    for child in (node.values() if hasattr(node, "values") else node):
        _drop_marked(child)


def _set_eol_comment(m, key: str, text: str) -> None:
    """Replace the end-of-line comment after m[key], keeping the comment lines after it."""
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    entry = m.ca.items.get(key)
    old = entry[2] if entry and len(entry) > 2 and entry[2] is not None else None
    rest = old.value.split("\n", 1)[1] if old is not None and "\n" in old.value else ""
    m.yaml_add_eol_comment(text, key)
    new = m.ca.items[key][2]
    m.ca.items[key][2] = CommentToken(new.value.rstrip("\n") + "\n" + rest, new.start_mark
                                      if new.start_mark else CommentMark(0), None)


def _flow_list(items: list[int]):
    from ruamel.yaml.comments import CommentedSeq

    seq = CommentedSeq(items)
    seq.fa.set_flow_style()
    return seq


def kept_ks(old: Any, k: int) -> list[int]:
    """The recipe's other Ks that a tuned K keeps: K replaces a list's largest K, and the Ks
    below K stay (K=0 for target-only baselines, a ladder of shorter verify windows for
    ngram/suffix): the user asked for them. A single K keeps nothing."""
    old_ks = [x for x in old if isinstance(x, int)] if isinstance(old, list) else []
    largest = max(old_ks, default=None)
    return sorted({x for x in old_ks if x < k and x != largest})


def tuned_k_value(recipe_k: Any, chosen_k: int, stop: ConfidenceStop | None = None
                  ) -> int | list[int]:
    """num_speculative_tokens after tuning, by the one rule `tune --write` and `compile --tune`
    share: the chosen K with the recipe's kept Ks, or the confidence stop's Ks when it won
    (`stop`: Decision.winning_stop)."""
    k = chosen_k
    kept = kept_ks(recipe_k, k)
    if stop is not None:
        return sorted(set(stop.ks) | set(kept))
    return kept + [k] if kept else k


def set_k_in_text(text: str, method: str, k: int, comment: list[str],
                  model_paths: dict[str, str] | None = None,
                  schedule: dict[int, int] | None = None,
                  stop: ConfidenceStop | None = None) -> str:
    """The recipe text with num_speculative_tokens = K, `comment` (lines starting with
    TUNE_MARK) above it, `model_paths` as the roles' model folders and, when given, the K per
    batch size of `tune --per-batch` as num_speculative_tokens_per_batch_size."""
    from ruamel.yaml.comments import CommentedMap

    y = _yaml()
    data = y.load(text)
    if not isinstance(data, CommentedMap):
        raise UsageError("the recipe is not a YAML mapping")
    _drop_marked(data)
    for role, new in (model_paths or {}).items():
        if isinstance(data.get(role), CommentedMap) and "model" in data[role]:
            data[role]["model"] = new
    spec = data.get("speculation")
    if not isinstance(spec, CommentedMap):
        spec = CommentedMap()
        keys = list(data)
        at = keys.index("draft") + 1 if "draft" in keys else len(keys)
        data.insert(at, "speculation", spec)
    else:
        spec.fa.set_block_style()  # a comment line cannot stand inside {...}
    ks = recommended_ks(method, k)
    kept = kept_ks(spec.get(K_KEY), k)
    spec[K_KEY] = _flow_list(kept + [k]) if kept else k
    note = "tuned (see above)" + (f"; {kept} kept from the list" if kept else
                                  f"; compiled as {ks}" if len(ks) > 1 else "")
    _set_eol_comment(spec, K_KEY, note)
    if stop:  # confidence-stopped drafting won: its Ks (each a verify window) and threshold
        spec[K_KEY] = _flow_list(sorted(set(stop.ks) | set(kept)))
        spec["draft_p_min"] = stop.draft_p_min
        _set_eol_comment(spec, K_KEY, "tuned: confidence-stopped drafts verify in the "
                         "smallest of these")
    if schedule:
        from ruamel.yaml.comments import CommentedMap as Flow

        flow = Flow((int(b), int(kb)) for b, kb in sorted(schedule.items()))
        flow.fa.set_flow_style()
        spec[SCHEDULE_KEY] = flow
        _set_eol_comment(spec, SCHEDULE_KEY, "tune --per-batch: K by live rows")
    before = "\n".join(c[2:] if c.startswith("# ") else c.lstrip("#") for c in comment)
    spec.yaml_set_comment_before_after_key(K_KEY, before=before, indent=2)  # top level
    buf = io.StringIO()
    y.dump(data, buf)
    return buf.getvalue()


def _rebased_models(recipe, dest_dir: Path) -> dict[str, str]:
    """Relative local model folders, re-expressed relative to dest_dir."""
    from ..recipe import resolve_model_path

    out = {}
    roles = ["target"] + (["draft"] if recipe.draft.method == "draft_model" else [])
    for role in roles:
        ref = getattr(recipe, role).model
        if ref is None or Path(ref).expanduser().is_absolute():
            continue
        resolved = resolve_model_path(recipe, ref)
        if resolved != ref:  # a local folder
            dest = str(dest_dir.resolve())
            out[role] = resolved if os.path.commonpath([resolved, dest]) == os.sep \
                else os.path.relpath(resolved, dest)
    return out


def write_tuned_recipe(recipe_path: Path, result: Decision, dest: Path | None = None,
                       comment: list[str] | None = None) -> Path:
    """Write the recipe with the chosen K: in place (dest None) or as a new recipe file at dest
    (relative model folders re-based so that the copy points at the same models). The result is
    re-read with `load_recipe` before anything is written."""
    from ..recipe import load_recipe, recipe_from_text, resolve_model_path

    recipe_path = Path(recipe_path)
    r = load_recipe(recipe_path)
    text = recipe_path.read_text(encoding="utf-8")
    target = Path(dest) if dest else recipe_path
    rebase = _rebased_models(r, target.parent) \
        if target.parent.resolve() != recipe_path.parent.resolve() else {}
    k = result.chosen_k
    schedule = {p.batch_size: p.chosen_k for p in result.per_batch}
    stop = result.winning_stop
    new_text = set_k_in_text(text, r.draft.method, k,
                             comment if comment is not None else evidence_comment(result), rebase,
                             schedule, stop)
    try:
        check = recipe_from_text(new_text, str(target), base_dir=target.parent.resolve())
    except RecipeError as exc:
        raise UsageError(f"the tuned recipe would not load ({exc}); not written") from None
    written = check.speculation.num_speculative_tokens
    if stop is not None:
        k = max(stop.ks)
    if written != k and not (isinstance(written, list) and max(written) == k):
        raise RecipeError(str(target), [Problem("speculation.num_speculative_tokens",
                                                "rewriting the recipe did not set K")])
    for role in ("target", "draft"):
        a, b = getattr(r, role, None), getattr(check, role, None)
        if getattr(a, "model", None) and resolve_model_path(r, a.model) != \
                resolve_model_path(check, b.model):
            raise UsageError(f"the tuned recipe's {role}.model would point elsewhere; not written")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(new_text, encoding="utf-8")
    os.replace(tmp, target)
    return target
