"""A griffe extension for the API reference (mkdocs.yml): reST roles in docstrings as code.

gpushare's docstrings name other objects the Sphinx way (:class:`~gpushare.Buffer`,
:func:`dumps`). Markdown has no roles, so each becomes a code span: the last dotted part
where the name starts with ``~`` (as Sphinx shows it), the whole name otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    short, name = match.group(1), match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


class RstRoles(griffe.Extension):
    """Rewrites every docstring once, as griffe loads it."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
