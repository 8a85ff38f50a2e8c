"""Instruction and text data for causal-LM fine-tuning.

Records come from local JSONL, JSON or parquet files, or from a ``datasets`` hub name, in one of four schemas:
instruction/input/output, prompt/completion, messages (chat turns) or plain text. Invariants this module keeps:

* Labels are not shifted (the loss shifts, as in Hugging Face models) and are ``-100`` on every prompt token and
  every padding token: instruction, prompt/completion and messages records carry loss on response tokens only.
* A record is trained on exactly the prompt that :func:`format_prompt` returns, so generation after training sees
  the same tokens as training did (tokenize it with ``add_special_tokens=False``).
* Every record is validated and tokenized in ``setup``; nothing is read or checked mid-epoch. Errors name the
  file, the line (or row) and the field.
* The same ``seed`` gives the same split and the same batches: the loaders shuffle and seed their workers with
  their own ``torch.Generator`` and draw nothing from the global RNG.

Heavy optional imports (``datasets``, ``pyarrow``) happen in :func:`optional_import` only.
"""

from __future__ import annotations

import functools
import random
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from poros_lightning.errors import DataError, PorosConfigError
from poros_lightning.training.assets import tiny_instruct_path
from poros_lightning.training.records import (
    Located,
    conversation,
    read_hub,
    read_records,
)
from poros_lightning.training.resumable import ResumableDataLoader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["IGNORE_INDEX", "InstructionDataModule", "collate", "format_prompt", "read_records", "tokenize_records"]

IGNORE_INDEX = -100
Example = dict[str, list[int]]


# ------------------------------------------------------------------------------------------------ formatting


def _bos_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The BOS token text if the tokenizer adds one by itself (text is later tokenized without special tokens)."""
    ids = tokenizer("x")["input_ids"]
    adds = tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id
    return tokenizer.bos_token if adds else ""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], prompt: bool, bos: str) -> str:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    # Fixed template for tokenizers without a chat template (base models).
    text = bos
    for m in messages:
        end = (tokenizer.eos_token or "") if m["role"] == "assistant" else ""
        text += f"### {m['role'].capitalize()}:\n{m['content']}{end}\n\n"
    return text + ("### Assistant:\n" if prompt else "")


def _segments(record: Any, tokenizer: PreTrainedTokenizerBase, where: str, bos: str) -> list[tuple[str, bool]]:
    """Split a record into ``(text, carries_loss)`` pieces whose concatenation is the training text."""
    kind, content = conversation(record, where)
    eos = tokenizer.eos_token or ""
    if kind == "completion":
        return [(bos + content[0], False), (content[1] + eos, True)]
    if kind == "text":
        return [(bos + content[0] + eos, True)]
    # Render the conversation turn by turn: the prompt before each assistant turn, then the turn itself.
    segments: list[tuple[str, bool]] = []
    done = ""
    for k, message in enumerate(content):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, content[:k], True, bos)
        full = _render(tokenizer, content[: k + 1], False, bos)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError(
                f"{where}: the tokenizer's chat template does not render this conversation turn by "
                "turn (an earlier rendering is not a prefix of a later one).",
                "use a tokenizer whose chat template only appends turns, or instruction records.",
            )
        turn = full[len(prompt) :]
        # The loss ends with the end-of-sequence token; what a template writes after it (a newline) is not a target.
        cut = turn.rfind(eos) + len(eos) if eos and eos in turn else len(turn)
        segments += [(prompt[len(done) :], False), (turn[:cut], True), (turn[cut:], False)]
        done = full
    return segments


def format_prompt(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> str:
    """Return the prompt text exactly as training formats it, ending where the (last) response starts.

    Tokenize the result with ``add_special_tokens=False``: special tokens the format needs are already in it.

    Raises:
        DataError: the record is malformed, or it is a plain-text record (which has no prompt).
    """
    segments = _segments(record, tokenizer, "record", _bos_text(tokenizer))
    last = max(i for i, (_, loss) in enumerate(segments) if loss)
    if last == 0:
        raise DataError(
            "a plain-text record has no prompt.", "pass an instruction, prompt/completion or messages record."
        )
    return "".join(text for text, _ in segments[:last])


# ---------------------------------------------------------------------------------------------- tokenization


def tokenize_records(
    records: list[dict[str, Any]] | list[Located],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    *,
    source: str = "records",
) -> list[Example]:
    """Tokenize records into ``{"input_ids", "labels"}`` lists, truncated to ``seq_len`` tokens.

    Args:
        records: plain records, or ``(where, record)`` pairs from :func:`read_records` (better error messages).
        tokenizer: the tokenizer.
        seq_len: maximum tokens per example; longer examples are cut at the end.
        source: names the data in error messages.

    Returns:
        One example per record that keeps at least one trainable response token; labels are ``IGNORE_INDEX`` on
        prompt tokens. Records truncated to no response token are dropped with a warning.

    Raises:
        DataError: a record is malformed, or truncation leaves no record with a response token.
    """
    located = [r if isinstance(r, tuple) else (f"{source} record {i}", r) for i, r in enumerate(records, start=1)]
    if not located:
        raise DataError(f"{source}: no record to tokenize.", "check the data file or max_records.")
    bos = _bos_text(tokenizer)
    pieces = [_segments(record, tokenizer, where, bos) for where, record in located]
    flat = [text for segments in pieces for text, _ in segments]
    encoded = iter(tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    examples, dropped, shortest_prompt = [], 0, None
    for segments in pieces:
        ids: list[int] = []
        labels: list[int] = []
        for _, loss in segments:
            seg = next(encoded)
            ids += seg
            labels += seg if loss else [IGNORE_INDEX] * len(seg)
        ids, labels = ids[:seq_len], labels[:seq_len]
        # labels[0] is never a target after the shift, so it does not count as a response token.
        if all(label == IGNORE_INDEX for label in labels[1:]):
            dropped += 1
            prompt = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
            shortest_prompt = prompt if shortest_prompt is None else min(shortest_prompt, prompt)
            continue
        examples.append({"input_ids": ids, "labels": labels})
    if not examples:
        raise DataError(
            f"{source}: seq_len={seq_len} is too small: every record is cut before its response "
            f"(the shortest prompt is at least {shortest_prompt} tokens).",
            "raise seq_len (data.seq_len), or shorten the prompts.",
        )
    if dropped:
        warnings.warn(
            f"{source}: {dropped} of {len(located)} records have no response token within seq_len={seq_len}"
            " and were dropped; raise seq_len to keep them.",
            stacklevel=2,
        )
    return examples


def pack(examples: list[Example], seq_len: int) -> list[Example]:
    """Concatenate examples (in order) and cut the stream into rows of ``seq_len`` tokens.

    Labels travel with their tokens, so prompt tokens stay masked; the end-of-sequence token each example ends with
    marks the boundaries (attention is not isolated between packed examples). The last row may be shorter; rows
    without a trainable token are dropped.
    """
    ids = [t for e in examples for t in e["input_ids"]]
    labels = [t for e in examples for t in e["labels"]]
    rows = []
    for start in range(0, len(ids), seq_len):
        row_labels = labels[start : start + seq_len]
        if any(label != IGNORE_INDEX for label in row_labels[1:]):
            rows.append({"input_ids": ids[start : start + seq_len], "labels": row_labels})
    return rows


def collate(examples: list[Example], pad_id: int, pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad examples to the longest one (rounded up to ``pad_to_multiple_of``) into LongTensors ``[B, T]``.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``; padding has ``attention_mask == 0`` and ``labels == -100``.
    """
    length = max(len(e["input_ids"]) for e in examples)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[row, :n] = torch.tensor(e["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.tensor(e["labels"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError(
            "the tokenizer has neither a pad token nor an end-of-sequence token.",
            "use a tokenizer that defines eos_token (or set tokenizer.pad_token).",
        )
    return int(pad)


def _split(records: list[Located], val_fraction: float, seed: int, source: str) -> tuple[list[Located], list[Located]]:
    n_val = max(1, round(len(records) * val_fraction)) if val_fraction > 0 else 0
    if n_val >= len(records):
        raise DataError(
            f"{source}: {len(records)} record(s) cannot be split with val_fraction={val_fraction}.",
            "add records, set val_fraction: 0, or pass val_path.",
        )
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    val = set(order[:n_val])
    return [r for i, r in enumerate(records) if i not in val], [r for i, r in enumerate(records) if i in val]


class InstructionDataModule(L.LightningDataModule):
    """Tokenized instruction (or plain text) data with response-only loss, a validation split and fixed order.

    With no ``train_path`` and no ``dataset_name`` the bundled ``tiny_instruct`` dataset is used (its own
    validation split included). Batches are ``{"input_ids", "attention_mask", "labels"}`` LongTensors ``[B, T]``.

    Args:
        train_path: training records (``.jsonl``, ``.json`` or ``.parquet``); default: the bundled train split.
        val_path: validation records; default: the bundled validation split with the bundled train split, the
            dataset's ``validation`` split with ``dataset_name``, else ``val_fraction`` of the training records.
        dataset_name: a ``datasets`` hub name used instead of ``train_path`` (needs the network or its cache).
        tokenizer: tokenizer name or path for :func:`poros_lightning.training.tokenizers.load_tokenizer`.
        seq_len: maximum tokens per example (examples are cut at the end; with ``packing``, the row length).
        batch_size: examples per batch.
        val_fraction: share of the training records held out for validation when no validation data is given;
            ``0`` disables validation in that case.
        packing: concatenate examples into full ``seq_len`` rows (fewer padding tokens, no attention isolation).
        seed: seeds the validation split and the training shuffle.
        num_workers: DataLoader worker processes.
        pad_to_multiple_of: round each batch's length up to a multiple of this (fixed shapes for compiled runs).
        max_records: read at most this many records from each source (quick experiments).

    Attributes:
        train_examples: tokenized training examples (``{"input_ids", "labels"}`` lists); ``None`` before ``setup``.
        val_examples: tokenized validation examples (empty: no validation).
    """

    def __init__(
        self,
        train_path: str | None = None,
        val_path: str | None = None,
        dataset_name: str | None = None,
        tokenizer: str = "smollm2",
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        packing: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        pad_to_multiple_of: int | None = None,
        max_records: int | None = None,
    ) -> None:
        super().__init__()
        checks = {
            "seq_len": (seq_len, seq_len >= 2, "an integer >= 2"),
            "batch_size": (batch_size, batch_size >= 1, "an integer >= 1"),
            "val_fraction": (val_fraction, 0 <= val_fraction < 1, "a fraction in [0, 1)"),
            "num_workers": (num_workers, num_workers >= 0, "an integer >= 0"),
            "pad_to_multiple_of": (pad_to_multiple_of, pad_to_multiple_of is None or pad_to_multiple_of >= 1, ">= 1"),
            "max_records": (max_records, max_records is None or max_records >= 1, "an integer >= 1, or null"),
        }
        for key, (value, ok, expected) in checks.items():
            if not ok:
                raise PorosConfigError(f"data.{key}={value!r} is invalid.", f"set data.{key} to {expected}.")
        if train_path is not None and dataset_name is not None:
            raise PorosConfigError("data.train_path and data.dataset_name are both set.", "set only one of them.")
        for key, value in (("train_path", train_path), ("val_path", val_path)):
            if value is not None and not Path(value).is_file():
                raise DataError(f"data.{key}={value!r} does not exist.", "check the path (relative to the cwd).")
        self.save_hyperparameters()
        self.train_path, self.val_path, self.dataset_name = train_path, val_path, dataset_name
        self.tokenizer_name, self.seq_len, self.batch_size = tokenizer, seq_len, batch_size
        self.val_fraction, self.packing, self.seed = val_fraction, packing, seed
        self.num_workers, self.pad_to_multiple_of, self.max_records = num_workers, pad_to_multiple_of, max_records
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._pad_id = 0
        self.train_examples: list[Example] | None = None
        self.val_examples: list[Example] = []

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, loaded on first use."""
        if self._tokenizer is None:
            from poros_lightning.training.tokenizers import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def _sources(self) -> tuple[tuple[str, list[Located]], tuple[str, list[Located]] | None]:
        """Return ``(name, records)`` for training and validation (``None``: split validation off training)."""
        if self.dataset_name is not None:
            splits = read_hub(self.dataset_name, self.max_records)
            train = (self.dataset_name, splits["train"])
            val = (f"{self.dataset_name} [validation]", splits["validation"]) if "validation" in splits else None
        else:
            bundled = self.train_path is None
            path = str(tiny_instruct_path("train")) if bundled else self.train_path
            train = (path, read_records(path, self.max_records))
            val_file = tiny_instruct_path("validation")
            val = (str(val_file), read_records(val_file, self.max_records)) if bundled and not self.val_path else None
        if self.val_path is not None:
            val = (self.val_path, read_records(self.val_path, self.max_records))
        return train, val

    @override
    def setup(self, stage: str) -> None:
        if self.train_examples is not None:
            return
        self._pad_id = _pad_id(self.tokenizer)
        (train_name, train), val = self._sources()
        if val is None:
            train, val_records = _split(train, self.val_fraction, self.seed, train_name)
            val = (f"{train_name} (val_fraction={self.val_fraction})", val_records)
        train_examples = tokenize_records(train, self.tokenizer, self.seq_len, source=train_name)
        val_examples = tokenize_records(val[1], self.tokenizer, self.seq_len, source=val[0]) if val[1] else []
        if self.packing:
            train_examples, val_examples = pack(train_examples, self.seq_len), pack(val_examples, self.seq_len)
        self.train_examples, self.val_examples = train_examples, val_examples

    def _loader(self, examples: list[Example] | None, shuffle: bool) -> DataLoader:
        if examples is None:
            raise PorosConfigError("the data module is not set up.", "call setup('fit') before asking for a loader.")
        collate_fn = functools.partial(collate, pad_id=self._pad_id, pad_to_multiple_of=self.pad_to_multiple_of)
        kwargs = {
            "batch_size": self.batch_size,
            "collate_fn": collate_fn,
            "num_workers": self.num_workers,
            "persistent_workers": self.num_workers > 0,
        }
        if shuffle:  # the order is a function of (seed, epoch), so a run can resume mid-epoch exactly
            return ResumableDataLoader(examples, seed=self.seed, **kwargs)
        # Every DataLoader iterator draws its workers' base seed from `generator`, else from the global torch RNG;
        # with persistent workers only the first validation would draw, which a resumed run cannot repeat.
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(examples, generator=generator, **kwargs)  # type: ignore[arg-type]  # a list is map-style

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_examples, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader | list:
        return self._loader(self.val_examples, shuffle=False) if self.val_examples else []
