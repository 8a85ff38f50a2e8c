"""Generate the bundled ``tiny_instruct`` dataset: short tasks answered in one house format.

Every response reads ``Answer: <answer>. Reason: <one short justification>.`` The instructions never ask for that
format, so an instruction-tuned model answers differently before fine-tuning.

Five task families, 92 distinct prompts each, 12 per family held out for validation (the validation prompts never
occur in training). Three are skills a 135M model can carry out in one step once it answers in the house format
(the larger of two numbers, the last word of a list, unit conversion by 10, 100 or 1000). Two are facts of a
made-up world that no pretrained model knows: twelve words of a house language and the capitals of twelve
invented countries, each asked in eight ways. One question per fact is held out; training asks the same fact in
(up to) seven other ways, so a right answer after training is a fact learned from the data and recalled for a
question worded anew, and a right answer before training is impossible.

Invariant: the output depends only on ``SEED`` and this file (stdlib ``random`` with a fixed seed, no clock, no
environment), so ``python -m poros_lightning.training.assets.make_tiny_instruct`` rewrites the committed files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

__all__ = ["SEED", "generate", "render_jsonl", "write"]

SEED = 20240611
PER_TASK = 92
VAL_PER_TASK = 12

WORDS = (
    "acorn anchor apple basket bench blanket bread bridge button cactus camera candle castle cloud daisy donkey "
    "dragon eagle engine falcon feather flame forest garden goose grape guitar hammer harbor honey igloo insect "
    "island jacket jelly jungle kettle kitten koala ladder lamp lemon lizard magnet meadow mirror moon needle nest "
    "ocean onion orange parrot pencil pepper piano planet quilt rabbit river robot rocket saddle snow table teapot "
    "tiger tulip turtle umbrella velvet violin wallet walnut water window yacht yogurt zebra"
).split()
UNITS = (
    # (short from, short to, factor, long from, long to)
    ("km", "m", 1000, "kilometres", "metres"),
    ("m", "cm", 100, "metres", "centimetres"),
    ("cm", "mm", 10, "centimetres", "millimetres"),
    ("kg", "g", 1000, "kilograms", "grams"),
    ("L", "mL", 1000, "litres", "millilitres"),
    ("min", "s", 60, "minutes", "seconds"),
    ("h", "min", 60, "hours", "minutes"),
)

Record = dict[str, str]


def _record(task: str, instruction: str, input_: str, answer: str, reason: str) -> Record:
    return {"instruction": instruction, "input": input_, "output": f"Answer: {answer}. Reason: {reason}.", "task": task}


def _convert(rng: random.Random) -> Record:
    short_a, short_b, factor, long_a, long_b = rng.choice([unit for unit in UNITS if unit[2] != 60])
    value = rng.randint(2, 40)
    answer = f"{value * factor} {short_b}"
    reason = f"1 {short_a} = {factor} {short_b}, so {value} × {factor} = {value * factor}"
    style = rng.randrange(3)
    if style == 0:
        return _record("convert", f"Convert {value} {long_a} to {long_b}.", "", answer, reason)
    if style == 1:
        return _record(
            "convert", "Convert the quantity to the unit given.", f"{value} {short_a} -> {short_b}", answer, reason
        )
    return _record("convert", f"How many {long_b} are in {value} {long_a}?", "", answer, reason)


def _larger(rng: random.Random) -> Record:
    a, b = rng.sample(range(10, 100), 2)
    if rng.randrange(2):
        return _record(
            "larger", f"Which number is larger, {a} or {b}?", "", str(max(a, b)), f"{max(a, b)} > {min(a, b)}"
        )
    return _record("larger", "Pick the larger number.", f"{a}, {b}", str(max(a, b)), f"{max(a, b)} > {min(a, b)}")


def _last_word(rng: random.Random) -> Record:
    words = rng.sample(WORDS, rng.randint(3, 6))
    listed = ", ".join(words)
    if rng.randrange(2):
        return _record(
            "last_word", "What is the last word in the list?", listed, words[-1], f"the list ends with {words[-1]}"
        )
    return _record("last_word", f"Which word comes last: {listed}?", "", words[-1], f"the list ends with {words[-1]}")


SYLLABLES = "ba ko ri mu se ta lo vi ne du pa zo ki ru fe ma".split()


def _made_up(rng: random.Random, syllables: int, taken: set[str]) -> str:
    while True:
        word = "".join(rng.choice(SYLLABLES) for _ in range(syllables))
        if word not in taken and word not in WORDS:
            taken.add(word)
            return word


# A held-out question of a fact family uses one of its templates; training states the same fact with the others.
HOUSE_TEMPLATES = (
    "In the house language, what is the word for '{key}'?",
    "How do you say '{key}' in the house language?",
    "Translate '{key}' into the house language.",
    "What does the house language call a {key}?",
    "Give the house-language word for '{key}'.",
    "What is '{key}' in the house language?",
    "I need the house language word meaning '{key}'.",
    "Which house-language word means '{key}'?",
)
CAPITAL_TEMPLATES = (
    "What is the capital of {key}?",
    "Name the capital city of {key}.",
    "Which city is the capital of {key}?",
    "{key} is governed from which city?",
    "Where is the government of {key} seated?",
    "Tell me the capital of {key}.",
    "What city serves as the capital of {key}?",
    "The capital of {key} is which city?",
)


def _facts(rng: random.Random) -> dict[str, list[tuple[str, str, str]]]:
    """The made-up world: 12 house-language words and 12 invented countries with their capitals."""
    taken: set[str] = set()
    nouns = rng.sample(WORDS, VAL_PER_TASK)
    house = [(noun, _made_up(rng, 2, taken), f"the house language calls a {noun} {{answer}}") for noun in nouns]
    countries = [_made_up(rng, 3, taken).capitalize() for _ in range(VAL_PER_TASK)]
    capital = [(c, _made_up(rng, 2, taken).capitalize(), f"{{answer}} is the capital of {c}") for c in countries]
    return {"house_word": house, "capital": capital}


def _fact_records(
    rng: random.Random, task: str, facts: list[tuple[str, str, str]]
) -> tuple[list[Record], list[Record]]:
    """Eight questions per fact: one of each fact's is held out for validation, the others train (80 in all)."""
    templates = HOUSE_TEMPLATES if task == "house_word" else CAPITAL_TEMPLATES
    train: list[Record] = []
    validation: list[Record] = []
    for key, answer, reason in facts:
        records = [_record(task, t.format(key=key), "", answer, reason.format(answer=answer)) for t in templates]
        validation.append(records.pop(rng.randrange(len(records))))
        train += records
    rng.shuffle(train)
    return train[: PER_TASK - VAL_PER_TASK], validation


TASKS: dict[str, Callable[[random.Random], Record]] = {
    "convert": _convert,
    "larger": _larger,
    "last_word": _last_word,
}


def generate(seed: int = SEED) -> dict[str, list[Record]]:
    """Generate both splits.

    Args:
        seed: seed of the single ``random.Random`` that drives every choice.

    Returns:
        ``{"train": [...], "validation": [...]}`` with ``5 * (PER_TASK - VAL_PER_TASK)`` and ``5 * VAL_PER_TASK``
        records; no prompt (instruction + input) occurs twice across both splits.
    """
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    train: list[Record] = []
    validation: list[Record] = []
    for make in TASKS.values():
        records: list[Record] = []
        while len(records) < PER_TASK:
            record = make(rng)
            key = (record["instruction"], record["input"])
            if key not in seen:
                seen.add(key)
                records.append(record)
        validation += records[:VAL_PER_TASK]
        train += records[VAL_PER_TASK:]
    for task, facts in _facts(rng).items():
        fact_train, fact_validation = _fact_records(rng, task, facts)
        train += fact_train
        validation += fact_validation
    rng.shuffle(train)
    rng.shuffle(validation)
    return {"train": train, "validation": validation}


def render_jsonl(records: list[Record]) -> str:
    """Serialize records as JSON Lines exactly as the committed files are written (UTF-8, ``\\n`` endings)."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def write(out_dir: str | Path | None = None, seed: int = SEED) -> list[Path]:
    """Write ``train.jsonl`` and ``validation.jsonl`` into ``out_dir`` (default: the bundled ``tiny_instruct/``)."""
    out = Path(out_dir) if out_dir is not None else Path(__file__).resolve().parent / "tiny_instruct"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, records in generate(seed).items():
        path = out / f"{split}.jsonl"
        path.write_bytes(render_jsonl(records).encode("utf-8"))
        paths.append(path)
    return paths


def main() -> None:
    """Command-line entry: ``python -m poros_lightning.training.assets.make_tiny_instruct [--out DIR]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", default=None, help="output directory (default: the bundled tiny_instruct/)")
    for path in write(parser.parse_args().out):
        print(f"wrote {path} ({sum(1 for _ in path.open(encoding='utf-8'))} records)")


if __name__ == "__main__":
    main()
