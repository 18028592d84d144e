"""A job's dataset: records read and validated (file:line or file:record errors), columns
renamed, tokenized and truncated into :class:`Example` s.

A dataset is a JSONL file (one record per non-blank line), a Parquet or JSON file, or a
Hugging Face ``datasets`` folder (``save_to_disk``); the last three are read with the
``datasets`` library. ``columns`` maps a record form's field to the dataset's column (e.g.
``{"prompt": "question", "completion": "answer"}``). The forms (what each objective reads)
are in :mod:`.record_forms`; only what the model should produce is trained.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_multilora.data.record_forms import EXPECTED, PROBLEMS, answer_ids
from megatron_multilora.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class Example:
    """One tokenized sequence.

    ``loss_mask[i]`` says whether predicting ``tokens[i + 1]`` from position ``i`` counts in
    the loss, so ``len(loss_mask) == len(tokens) - 1``. ``values``: the loss's other
    per-token inputs by name (one float per loss-mask entry: e.g. sampled log-probs,
    advantages, reference log-probs). ``units``: what the example adds to its adapter's loss
    normaliser (default: its loss tokens; e.g. 1 per preference pair or per sequence).
    ``targets``: the token each position is scored on where that is not the next token
    (one per loss-mask entry; a service client's ``target_tokens``).
    """

    tokens: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    values: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    units: int | None = None
    targets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) < 2:
            raise ValueError(f"an Example needs at least 2 tokens, got {len(self.tokens)}")
        if len(self.loss_mask) != len(self.tokens) - 1:
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for "
                f"{len(self.tokens)} tokens; expected {len(self.tokens) - 1}"
            )
        if self.targets is not None and len(self.targets) != len(self.loss_mask):
            raise ValueError(
                f"targets has {len(self.targets)} entries; expected {len(self.loss_mask)}"
            )
        bad = [k for k, v in self.values.items() if len(v) != len(self.loss_mask)]
        if bad:
            raise ValueError(
                f"values {bad} need one entry per loss-mask entry ({len(self.loss_mask)})"
            )

    @property
    def loss_units(self) -> int:
        return sum(self.loss_mask) if self.units is None else self.units


# What packing keeps together in one micro-batch: an example, or a group (a preference pair).
Packable = Example | tuple[Example, ...]


def examples_of(item: Packable) -> tuple[Example, ...]:
    """The examples a packable item holds, in order."""
    return item if isinstance(item, tuple) else (item,)


class DatasetError(ValueError):
    """A dataset problem; the message starts with ``"path:line: "`` (JSONL), ``"path: record
    n: "`` (other formats) or ``"path: "``."""


def rename_columns(record: dict, columns: Mapping[str, str] | None) -> dict:
    """``record`` with each ``columns`` value (a dataset column) renamed to its key (the
    form's field); columns not mapped stay as they are."""
    if not columns:
        return record
    out = {k: v for k, v in record.items() if k not in columns.values()}
    for ours, theirs in columns.items():
        if theirs in record:
            out[ours] = record[theirs]
    return out


def _where_to_look(path: Path) -> str:
    """For a missing file: the absolute path it was looked for at, the nearest names beside
    it, and for what looks like a Hub id, that only local files are read."""
    folder = path.absolute().parent
    notes = [f"looked for {path.absolute()}"]
    if folder.is_dir():
        near = difflib.get_close_matches(path.name, [p.name for p in folder.iterdir()], n=3)
        if near:
            notes.append("did you mean " + " or ".join(str(folder / n) for n in near) + "?")
    elif not path.is_absolute() and len(path.parts) == 2:
        notes.append(
            "datasets are read from local files only, not the Hugging Face Hub: download it "
            "first (e.g. datasets.load_dataset(...).to_json(...)) and give that file"
        )
    return " (" + "; ".join(notes) + ")"


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found{_where_to_look(path)}") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot open ({e.strerror})") from None
    with handle:
        # Read bytes and decode line by line, so bad UTF-8 is reported with its line too.
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{number}: not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                # Without its line break: an unclosed record is then reported at the line's
                # end, not at column 1 of a line after it.
                yield f"{path}:{number}", json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{path}:{number}: malformed JSON ({e.msg} at column "
                    f"{e.colno}); expected one JSON object per line"
                ) from None


def _library_records(path: Path) -> Iterator[tuple[str, Any]]:
    """Parquet/JSON files and ``save_to_disk`` folders, through the ``datasets`` library."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{path}: reading this format needs the datasets library "
            "(pip install datasets); or convert it to JSONL"
        ) from None
    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path))
            if isinstance(table, datasets.DatasetDict):
                raise DatasetError(
                    f"{path}: a DatasetDict with splits {list(table)}; give one "
                    f"split's folder (e.g. {path / next(iter(table))})"
                )
        else:
            kind = "parquet" if path.suffix == ".parquet" else "json"
            table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except DatasetError:
        raise
    except Exception as e:  # the library's own errors: a bad file is the user's to fix
        raise DatasetError(
            f"{path}: cannot read it with the datasets library ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    for i, record in enumerate(table):
        yield f"{path}: record {i}", record


def _numbered_records(
    path: str | Path, form: str, columns: Mapping[str, str] | None
) -> Iterator[tuple[str, dict]]:
    """Yield ``(where, record)`` for each record (columns renamed), validated for ``form``."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: file not found{_where_to_look(path)}")
    reader = (
        _jsonl_records
        if path.is_file() and path.suffix not in (".parquet", ".json")
        else _library_records
    )
    seen = False
    for where, record in reader(path):
        if not isinstance(record, dict):
            raise DatasetError(
                f"{where}: expected a JSON object, got {type(record).__name__}; {EXPECTED[form]}"
            )
        record = rename_columns(record, columns)
        problem = PROBLEMS[form](record)
        if problem is not None:
            mapped = f" (columns {dict(columns)})" if columns else ""
            raise DatasetError(f"{where}: {problem}{mapped}")
        seen = True
        yield where, record
    if not seen:
        raise DatasetError(
            f"{path}: no records (the file is empty or blank); {EXPECTED[form]}, one per record"
        )


def read_records(
    path: str | Path, form: str = "completion", columns: Mapping[str, str] | None = None
) -> list[dict]:
    """Read and validate a dataset's records for ``form`` (see :mod:`.record_forms`), in
    order, columns renamed. Needs no tokenizer, so a run's data can be checked before any
    model is built. Raises DatasetError naming the file and record of the first bad one."""
    return [record for _, record in _numbered_records(path, form, columns)]


def _truncate(
    ids: list[int], trained: list[bool], max_seq_len: int
) -> tuple[list[int], list[bool]]:
    """Cut a bos-led sequence to ``max_seq_len`` tokens, keeping its trained part if possible.

    The prompt is everything between bos and the first trained token. It loses tokens from
    its left (bos stays, as the model always sees it first); if the trained part alone does
    not fit after bos, the prompt goes entirely and the rest is cut on the right.
    """
    excess = len(ids) - max_seq_len
    if excess <= 0:
        return ids, trained
    prompt_len = trained.index(True, 1) - 1  # tokens between bos and the first trained one
    cut = min(excess, prompt_len)
    ids, trained = ids[:1] + ids[1 + cut :], trained[:1] + trained[1 + cut :]
    return ids[:max_seq_len], trained[:max_seq_len]


def _example(
    ids: list[int], trained: list[bool], max_seq_len: int, units: int | None = None
) -> Example:
    # trained[0] is bos's flag, which never becomes a label.
    if not any(trained[1:]):
        raise ValueError("the record has no tokens to train on")
    ids, trained = _truncate(ids, trained, max_seq_len)
    return Example(tokens=tuple(ids), loss_mask=tuple(trained[1:]), units=units)


def _check_len(max_seq_len: int) -> None:
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2 (one input and one label), got {max_seq_len}")


def tokenize_record(record: dict, tokenizer: Tokenizer, max_seq_len: int) -> Example:
    """Tokenize one completion-form record into an Example of at most ``max_seq_len`` tokens.

    prompt/completion: ``[bos] + prompt + completion + [eos]``, loss on predicting the
    completion and eos. chat: ``tokenizer.encode_chat``, loss on the assistant tokens and
    eos. Too-long sequences lose the start of the prompt first; the loss mask always keeps
    at least one True. Raises ValueError for an invalid record or ``max_seq_len < 2``.
    """
    _check_len(max_seq_len)
    problem = PROBLEMS["completion"](record)
    if problem is not None:
        raise ValueError(problem)
    if "messages" in record:
        ids, trained = tokenizer.encode_chat(record["messages"])
    else:
        ids, trained = answer_ids(record["prompt"], record["completion"], tokenizer)
    return _example(ids, trained, max_seq_len)


def tokenize_pair(record: dict, tokenizer: Tokenizer, max_seq_len: int) -> tuple[Example, Example]:
    """A preference record as (chosen, rejected) examples, each the prompt and its answer;
    the pair counts one loss unit (on the chosen one)."""
    _check_len(max_seq_len)
    problem = PROBLEMS["preference"](record)
    if problem is not None:
        raise ValueError(problem)
    chosen = _example(*answer_ids(record["prompt"], record["chosen"], tokenizer), max_seq_len, 1)
    rejected = _example(
        *answer_ids(record["prompt"], record["rejected"], tokenizer), max_seq_len, 0
    )
    return chosen, rejected


def _load(
    path: str | Path,
    form: str,
    tokenize: Callable[[dict, Tokenizer, int], Any],
    tokenizer: Tokenizer,
    max_seq_len: int,
    columns: Mapping[str, str] | None,
) -> list:
    """Every record of ``path`` in ``form``, tokenized; errors name the file and record."""
    _check_len(max_seq_len)
    out = []
    for where, record in _numbered_records(path, form, columns):
        try:
            out.append(tokenize(record, tokenizer, max_seq_len))
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from e
    return out


def load_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    max_seq_len: int,
    columns: Mapping[str, str] | None = None,
) -> list[Example]:
    """Read, validate and tokenize a completion-form dataset; errors name file and record."""
    return _load(path, "completion", tokenize_record, tokenizer, max_seq_len, columns)


def load_pairs(
    path: str | Path,
    tokenizer: Tokenizer,
    max_seq_len: int,
    columns: Mapping[str, str] | None = None,
) -> list[tuple[Example, Example]]:
    """Read, validate and tokenize a preference dataset into (chosen, rejected) pairs."""
    return _load(path, "preference", tokenize_pair, tokenizer, max_seq_len, columns)
