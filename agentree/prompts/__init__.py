"""Prompt templates shipped as package data, rendered strictly.

Templates are plain text files under this folder (e.g. `frozenlake/system.txt`). A placeholder
is `{name}` with `name` an identifier; every placeholder must be given and every given variable
must be used, so a typo fails loudly. Other braces (e.g. a literal `{"score": 0.5}`) are text.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class PromptError(KeyError):
    """A template is missing, or its variables do not match the ones given."""

    def __str__(self) -> str:
        return str(self.args[0])


@cache
def load(name: str) -> str:
    """The raw text of template `name` (a path relative to this folder)."""
    try:
        return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise PromptError(f"no prompt template {name!r} in agentree.prompts") from None


def placeholders(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))


def render_text(template: str, name: str = "<template>", **variables: object) -> str:
    """Fill `{var}` placeholders; missing or unused variables raise `PromptError`."""
    needed = placeholders(template)
    missing = needed - variables.keys()
    unused = variables.keys() - needed
    if missing or unused:
        raise PromptError(
            f"prompt {name}: missing variables {sorted(missing)}, unused variables {sorted(unused)}"
        )
    return _PLACEHOLDER.sub(lambda m: str(variables[m.group(1)]), template)


def render(name: str, **variables: object) -> str:
    """Render the template file `name` strictly."""
    return render_text(load(name), name, **variables)
