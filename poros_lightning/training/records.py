"""Reading instruction records (JSONL, JSON, Parquet, a hub dataset) and checking each one's schema.

Invariant: every error names the file and the line (or row) of the record at fault, and the fix.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

from poros_lightning.errors import DataError

__all__ = ["ROLES", "SCHEMAS", "Located", "optional_import", "conversation", "read_hub", "read_records"]


ROLES = ("system", "user", "assistant")
SCHEMAS = (
    "instruction/input/output: {'instruction': str, 'input': str (optional), 'output': str}; "
    "prompt/completion: {'prompt': str, 'completion': str}; "
    "messages: {'messages': [{'role': 'system'|'user'|'assistant', 'content': str}, ...]}; "
    "text: {'text': str}"
)
_WHITESPACE = re.compile(r"\s*")


def optional_import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise DataError(
            f"reading this data needs the optional package {module.split('.')[0]!r}: {err}",
            "pip install datasets (it brings pyarrow), or convert the data to JSONL.",
        ) from err


Located = tuple[str, dict[str, Any]]  # (where: "file:line" or "file row N", record)


# ----------------------------------------------------------------------------------------------------- reading


def _read_jsonl(path: Path) -> list[Located]:
    records = []
    with path.open(encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    records.append((f"{path}:{line_no}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"{path}:{line_no}: invalid JSON ({err.msg} at column {err.colno}).",
                        "each line of a .jsonl file must be one JSON object.",
                    ) from err
    return records


def _read_json(path: Path) -> list[Located]:
    text = path.read_text(encoding="utf-8-sig")
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        return _read_jsonl(path)  # many ".json" files hold one record per line
    decoder = json.JSONDecoder()
    records: list[Located] = []
    counted, line_no = 0, 1

    def where(at: int) -> str:
        nonlocal counted, line_no  # count newlines incrementally: positions only move forward
        line_no, counted = line_no + text.count("\n", counted, at), at
        return f"{path}:{line_no}"

    def skip(at: int) -> int:
        return _WHITESPACE.match(text, at).end()  # type: ignore[union-attr]  # r"\s*" always matches

    # Walk the top-level array element by element so each record keeps the line it starts on.
    pos = skip(pos + 1)
    while not text.startswith("]", pos):
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise DataError(f"{where(err.pos)}: invalid JSON ({err.msg}).", "fix the JSON syntax there.") from err
        records.append((where(pos), record))
        pos = skip(end)
        if text.startswith(",", pos):
            pos = skip(pos + 1)
        elif not text.startswith("]", pos):
            raise DataError(f"{where(pos)}: expected ',' or ']' after a record.", "fix the JSON syntax there.")
    return records


def _present(row: dict[str, Any]) -> dict[str, Any]:
    # Columnar sources fill the columns a row lacks with nulls; a null field is an absent field.
    return {key: value for key, value in row.items() if value is not None}


def _read_parquet(path: Path) -> list[Located]:
    table = optional_import("pyarrow.parquet").read_table(str(path))
    return [(f"{path} row {i}", _present(row)) for i, row in enumerate(table.to_pylist(), start=1)]


def read_records(path: str | Path, max_records: int | None = None) -> list[Located]:
    """Read the records of a ``.jsonl``, ``.json`` (a top-level array, or one record per line) or ``.parquet`` file.

    Args:
        path: the file.
        max_records: keep only the first this many records.

    Returns:
        ``(where, record)`` pairs; ``where`` is ``"file:line"`` (``"file row N"`` for parquet) for error messages.

    Raises:
        DataError: the file is missing, has an unknown suffix, is not valid JSON, or holds no record.
    """
    path = Path(path)
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist.", "check train_path / val_path.")
    if path.suffix not in readers:
        raise DataError(f"{path}: unknown data file type {path.suffix!r}.", f"use one of {sorted(readers)}.")
    records = readers[path.suffix](path)[:max_records]
    if not records:
        raise DataError(f"{path}: the file holds no record.", f"add records ({SCHEMAS}) or point to another file.")
    return records


def read_hub(name: str, max_records: int | None) -> dict[str, list[Located]]:
    datasets = optional_import("datasets")
    try:
        splits = datasets.load_dataset(name)
    except Exception as err:  # datasets raises many types here (network, unknown name, missing config)
        raise DataError(
            f"cannot load dataset {name!r} from the hub: {err}",
            "check the name and the network, or download it and pass train_path.",
        ) from err
    if "train" not in splits:
        raise DataError(
            f"dataset {name!r} has no 'train' split (splits: {sorted(splits)}).",
            "pass train_path with a local file instead.",
        )
    out = {}
    for split in ("train", "validation"):
        if split in splits:
            rows = (
                splits[split]
                if max_records is None
                else splits[split].select(range(min(max_records, len(splits[split]))))
            )
            out[split] = [(f"{name} [{split}] row {i}", _present(row)) for i, row in enumerate(rows, start=1)]
    return out


# ------------------------------------------------------------------------------------------------ validation


def _field(record: dict[str, Any], key: str, where: str, schema: str, *, required: bool = True) -> str:
    if key not in record or (not required and record[key] is None):
        if required:
            raise DataError(
                f"{where}: {schema} record is missing field {key!r} (fields: {sorted(record)}).",
                f"accepted schemas: {SCHEMAS}",
            )
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {key!r} must be a string, got {type(value).__name__}.", f"accepted schemas: {SCHEMAS}"
        )
    if required and not value.strip():
        raise DataError(f"{where}: field {key!r} is empty.", "remove the record or fill in the field.")
    return value


def conversation(record: Any, where: str) -> tuple[str, list[dict[str, str]] | tuple[str, str]]:
    """Validate one record; return ``("chat", messages)``, ``("completion", (prompt, completion))`` or
    ``("text", (text, ""))``."""
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: a record must be a JSON object, got {type(record).__name__}.", f"accepted schemas: {SCHEMAS}"
        )
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages' must be a non-empty list.", f"accepted schemas: {SCHEMAS}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: messages[{i}] must be {{'role': one of {list(ROLES)}, 'content': str}}, got {m!r:.120}.",
                    f"accepted schemas: {SCHEMAS}",
                )
        if messages[0]["role"] == "assistant" or not any(m["role"] == "assistant" for m in messages):
            raise DataError(
                f"{where}: 'messages' must start with a system or user turn and hold an assistant turn.",
                "only assistant turns carry loss; a conversation without one teaches nothing.",
            )
        return "chat", [{"role": m["role"], "content": m["content"]} for m in messages]
    if "instruction" in record or "output" in record:
        schema = "instruction/input/output"
        instruction = _field(record, "instruction", where, schema)
        extra = _field(record, "input", where, schema, required=False)
        output = _field(record, "output", where, schema)
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return "chat", [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    if "prompt" in record or "completion" in record:
        schema = "prompt/completion"
        return "completion", (_field(record, "prompt", where, schema), _field(record, "completion", where, schema))
    if "text" in record:
        return "text", (_field(record, "text", where, "text"), "")
    raise DataError(f"{where}: record matches no schema (fields: {sorted(record)}).", f"accepted schemas: {SCHEMAS}")
