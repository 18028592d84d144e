"""Command-line overrides checked against the config's schema before Hydra composes them.

Every documented field can be overridden, a job entry's too: ``adapters.0.dropout=0.1``
works whether or not the jobs file sets ``dropout`` (Hydra would refuse a key the YAML lacks:
such an override is handed on as ``++``, add or replace). A key that is no field, with or
without ``+``, is refused here with the project's own message: the full key, the nearest
field names, exit status 2 (Hydra's would be "Key 'x' is not in struct", exit 1).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from pathlib import Path

from megatron_multilora.training.config import AdapterJob, ConfigError, RunConfig

CONF = Path(__file__).resolve().parents[2] / "conf"


def _groups() -> set[str]:
    """The config groups (``conf/<group>/``), chosen with ``group=name``."""
    return {p.name for p in CONF.iterdir() if p.is_dir()} if CONF.is_dir() else set()


def _section(field: dataclasses.Field) -> object:
    """The dataclass a field holds (a section), dict for a free mapping, else None."""
    factory = field.default_factory
    if factory is dict:
        return dict
    return factory if dataclasses.is_dataclass(factory) else None


def _problem(path: list[str]) -> str | None:
    """What is wrong with the key ``path`` (None: a field of the schema)."""
    schema: object = RunConfig
    for depth, part in enumerate(path):
        where = ".".join(path[: depth + 1])
        if schema is dict:
            return None  # a free mapping (e.g. a job's columns)
        if schema is None:
            return f"{'.'.join(path[:depth])} is a value, not a section: {where} cannot be set"
        if schema is list:  # the adapters list: an entry's index, then an AdapterJob's field
            if not part.isdigit():
                return f"{where}: a job is named by its index in the list, e.g. adapters.0.lr"
            schema = AdapterJob
            continue
        fields = {f.name: f for f in dataclasses.fields(schema)}
        if part not in fields:
            names = sorted(fields) + (sorted(_groups()) if depth == 0 else [])
            near = difflib.get_close_matches(part, sorted(set(names)), n=3)
            hint = (
                f"did you mean {' or '.join('.'.join([*path[:depth], n]) for n in near)}? "
                if near
                else ""
            )
            return f"{where}: no such field; {hint}the fields here: {', '.join(sorted(fields))}"
        schema = list if (depth == 0 and part == "adapters") else _section(fields[part])
    return None


def checked_overrides(arguments: Sequence[str]) -> list[str]:
    """``arguments`` with every field override checked (ConfigError lists each problem) and a
    job entry's fields handed to Hydra as add-or-replace (``++``). Flags, group choices
    (``parallel=tp2``), whole lists (``adapters=[...]``) and ``hydra.`` keys pass as they are."""
    out, problems = [], []
    groups = _groups()
    for argument in arguments:
        prefix = next((p for p in ("++", "+", "~") if argument.startswith(p)), "")
        key, eq, value = argument[len(prefix) :].partition("=")
        if argument.startswith("-") or not (eq or prefix == "~") or key.startswith("hydra"):
            out.append(argument)
            continue
        path = key.split(".")
        if len(path) == 1 and key in groups:
            out.append(argument)
            continue
        problem = _problem(path)
        if problem is not None:
            problems.append(f"{argument}: {problem}")
        elif path[0] == "adapters" and len(path) > 2 and prefix != "~":
            out.append(f"++{key}={value}")
        else:
            out.append(f"++{key}={value}" if prefix == "+" else argument)
    if problems:
        raise ConfigError("the run cannot start:\n  - " + "\n  - ".join(problems))
    return out
