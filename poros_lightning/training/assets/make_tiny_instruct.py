"""Generate the bundled ``tiny_instruct`` dataset: short tasks answered in one house format.

Every response reads ``Answer: <answer>. Reason: <one short justification>.`` The instructions never ask for that
format, so an instruction-tuned model answers differently before fine-tuning and the format is what a short LoRA
run learns first: validation loss on response tokens falls quickly and generated answers visibly change shape.

Ten task families (unit conversion, addition and subtraction word problems, weekday counting, capitalisation,
letter counting, parity, comparison, sorting, next number in a sequence) contribute 46 distinct prompts each;
6 per family are held out for validation, so the validation prompts never occur in training.

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
PER_TASK = 46
VAL_PER_TASK = 6

WORDS = (
    "acorn anchor apple basket bench blanket bread bridge button cactus camera candle castle cloud daisy donkey "
    "dragon eagle engine falcon feather flame forest garden goose grape guitar hammer harbor honey igloo insect "
    "island jacket jelly jungle kettle kitten koala ladder lamp lemon lizard magnet meadow mirror moon needle nest "
    "ocean onion orange parrot pencil pepper piano planet quilt rabbit river robot rocket saddle snow table teapot "
    "tiger tulip turtle umbrella velvet violin wallet walnut water window yacht yogurt zebra"
).split()
NAMES = ("Mia", "Leo", "Ava", "Omar", "Zoe", "Ravi", "Nora", "Sam", "Lena", "Kai", "Iris", "Theo", "Maya", "Finn")
ITEMS = (
    "apples",
    "stickers",
    "marbles",
    "books",
    "pencils",
    "shells",
    "coins",
    "cards",
    "stamps",
    "cookies",
    "balloons",
    "buttons",
)
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
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


def _spell(word: str) -> str:
    return "-".join(word)


def _convert(rng: random.Random) -> Record:
    short_a, short_b, factor, long_a, long_b = rng.choice(UNITS)
    value = rng.randint(2, 9) if factor == 60 else rng.randint(2, 25)
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


def _add(rng: random.Random) -> Record:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 19), rng.randint(2, 19)
    question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
    return _record("add", question, "", f"{a + b} {item}", f"{a} + {b} = {a + b}")


def _subtract(rng: random.Random) -> Record:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(8, 30)
    b = rng.randint(2, a - 1)
    question = f"{name} had {a} {item} and gave away {b}. How many {item} does {name} have left?"
    return _record("subtract", question, "", f"{a - b} {item}", f"{a} - {b} = {a - b}")


def _weekday(rng: random.Random) -> Record:
    start, n = rng.randrange(7), rng.randint(1, 6)
    step = rng.choice((1, -1))
    days = [DAYS[(start + step * k) % 7] for k in range(1, n + 1)]
    plural = "day" if n == 1 else "days"
    direction = "after" if step == 1 else "before"
    counted = ", ".join(f"{day} ({k})" for k, day in enumerate(days, start=1))
    verb = "Counting on" if step == 1 else "Counting back"
    question = f"What day of the week is {n} {plural} {direction} {DAYS[start]}?"
    return _record("weekday", question, "", days[-1], f"{verb} from {DAYS[start]}: {counted}")


def _uppercase(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    reason = f"{_spell(word)} becomes {_spell(word.upper())}"
    if rng.randrange(2):
        return _record("uppercase", "Write the word in capital letters.", word, word.upper(), reason)
    return _record("uppercase", f"Write '{word}' in capital letters.", "", word.upper(), reason)


def _count_letters(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    reason = f"{_spell(word)} has {len(word)} letters"
    if rng.randrange(2):
        return _record("count_letters", "Count the letters in the word.", word, str(len(word)), reason)
    return _record("count_letters", f"How many letters are in the word '{word}'?", "", str(len(word)), reason)


def _parity(rng: random.Random) -> Record:
    n = rng.randint(10, 999)
    kind = "even" if n % 2 == 0 else "odd"
    return _record("parity", f"Is {n} even or odd?", "", kind, f"{n} ends in {n % 10}, and {n % 10} is {kind}")


def _larger(rng: random.Random) -> Record:
    a, b = rng.sample(range(10, 100), 2)
    return _record("larger", f"Which number is larger, {a} or {b}?", "", str(max(a, b)), f"{max(a, b)} > {min(a, b)}")


def _sort(rng: random.Random) -> Record:
    numbers = rng.sample(range(1, 100), rng.randint(3, 5))
    ordered = sorted(numbers)
    listed = ", ".join(map(str, numbers))
    answer = ", ".join(map(str, ordered))
    return _record("sort", "Sort the numbers from smallest to largest.", listed, answer, " < ".join(map(str, ordered)))


def _sequence(rng: random.Random) -> Record:
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    terms = [start + step * k for k in range(4)]
    nxt = terms[-1] + step
    reason = f"each number is {step} more than the one before, and {terms[-1]} + {step} = {nxt}"
    question = f"What number comes next: {', '.join(map(str, terms))}?"
    return _record("sequence", question, "", str(nxt), reason)


TASKS: dict[str, Callable[[random.Random], Record]] = {
    "convert": _convert,
    "add": _add,
    "subtract": _subtract,
    "weekday": _weekday,
    "uppercase": _uppercase,
    "count_letters": _count_letters,
    "parity": _parity,
    "larger": _larger,
    "sort": _sort,
    "sequence": _sequence,
}


def generate(seed: int = SEED) -> dict[str, list[Record]]:
    """Generate both splits.

    Args:
        seed: seed of the single ``random.Random`` that drives every choice.

    Returns:
        ``{"train": [...], "validation": [...]}`` with ``len(TASKS) * (PER_TASK - VAL_PER_TASK)`` and
        ``len(TASKS) * VAL_PER_TASK`` records; no prompt (instruction + input) occurs twice across both splits.
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
