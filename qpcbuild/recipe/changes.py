"""A stage's changes to a recipe (measuring at batch 1 on ONNX Runtime, another K list, the K
tune chose) as one typed value, applied by `recipe.with_changes`: pydantic's
`model_copy(update=)` on each section it names, then the whole recipe validated again,
cross-field rules included.

The user's `--set section.key=value` strings are parsed where they come in (the CLI, through
`load_recipe`); inside the program a change is this value, never a dotted string."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from pydantic import BaseModel

from .schema import Recipe

# The recipe's sections a stage may change, field by field.
SECTIONS = ("speculation", "shapes", "precision", "onnxruntime")


@dataclass(frozen=True)
class RecipeChanges:
    """Per section, the fields to set (values as the recipe holds them: 1, None, [0, 3]); and
    the backends list, replaced whole. Empty: the recipe as it is."""
    backends: tuple[str, ...] | None = None
    speculation: Mapping[str, Any] = field(default_factory=dict)
    shapes: Mapping[str, Any] = field(default_factory=dict)
    precision: Mapping[str, Any] = field(default_factory=dict)
    onnxruntime: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a misspelt field is a programming error, said before any recipe is touched
        for section in SECTIONS:
            model = Recipe.model_fields[section].annotation
            assert isinstance(model, type) and issubclass(model, BaseModel)
            unknown = sorted(set(getattr(self, section)) - set(model.model_fields))
            if unknown:
                raise ValueError(f"recipe section {section} has no field {', '.join(unknown)}")

    def __bool__(self) -> bool:
        return self.backends is not None or any(getattr(self, s) for s in SECTIONS)

    def then(self, later: RecipeChanges) -> RecipeChanges:
        """These changes followed by `later` (its values win)."""
        return RecipeChanges(
            backends=later.backends if later.backends is not None else self.backends,
            **{s: {**getattr(self, s), **getattr(later, s)} for s in SECTIONS})

    def sections(self) -> list[tuple[str, Mapping[str, Any]]]:
        """(section, its fields to set) for each section these changes touch."""
        return [(s, getattr(self, s)) for s in SECTIONS if getattr(self, s)]

    def assignments(self) -> list[tuple[str, Any]]:
        """(dotted key, value) pairs, for saying what was changed the way a user sets it."""
        out: list[tuple[str, Any]] = []
        if self.backends is not None:
            out.append(("backends", list(self.backends)))
        for section, values in self.sections():
            out += [(f"{section}.{key}", v) for key, v in values.items()]
        return out
