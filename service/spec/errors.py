"""How a spec's text is read and how its validation errors read: YAML numbers as YAML 1.2 has them,
and pydantic's errors as one message per field (``service.spec.spec.parse_spec`` joins them; the
REST API answers one 422 entry per field, :mod:`service.spec.check`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import ValidationError


def yaml_loader():
    """PyYAML's safe loader, reading ``1e-3`` as a number as YAML 1.2 (and JSON) do, not as a string."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"), list("-+0123456789"))
    return Loader


def read_spec_file(path: str | Path):
    """A YAML or JSON spec file as read, not validated. Raises ValueError naming the file."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read spec {str(path)!r}: {e.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=yaml_loader())
    except (ValueError, yaml.YAMLError) as e:
        first = " ".join(str(e).split())
        raise ValueError(f"spec {str(path)!r} is not valid YAML/JSON: {first}") from None
    return data


def _is_union_branch(part) -> bool:
    """A ``loc`` part pydantic adds for a branch of a union (``int``, ``literal['auto']``, ``ParallelSpec``)."""
    return isinstance(part, str) and (part in ("int", "bool", "str", "float", "none", "constrained-int")
                                      or part.startswith(("literal[", "function-")) or part[:1].isupper())


def field_errors(e: ValidationError) -> list[tuple[str, str, dict]]:
    """``(field path, message, error)`` per field: a union's branches (``2`` or ``auto``) merged into one
    message, and the branch a nested section did not take (``parallel: auto``) dropped."""
    merged: dict[str, list[tuple[str, dict]]] = {}
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"] if not _is_union_branch(x))
        msg = err["msg"].removeprefix("Value error, ")
        merged.setdefault(loc, []).append((msg, err))
    out = []
    for loc, items in merged.items():
        if loc and any(other.startswith(loc + ".") for other in merged):
            continue  # e.g. parallel: {...} was not the string auto; its fields' errors say what is wrong
        msgs = [m for m, _ in items]
        auto = "Input should be 'auto'" in msgs
        msgs = list(dict.fromkeys(m for m in msgs if m != "Input should be 'auto'")) or msgs[:1]
        msg = " or ".join(msgs) + (" (or 'auto')" if auto and len(items) > 1 else "")
        out.append((loc, msg, items[0][1]))
    return out


def format_validation_error(e: ValidationError) -> str:
    parts = []
    for loc, msg, err in field_errors(e):
        if err["type"].endswith(("_type", "finite_number", "_parsing", "than", "than_equal")) and "input" in err:
            msg += f", got {err['input']!r}"  # tp: "2", tp: true or max_restarts: -1 shows as what it is
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid job spec: " + "; ".join(parts)
