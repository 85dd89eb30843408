"""Seeded task generators, sized to a target length in the model's own tokens.

Each sample is (prompt text, question, expected answer, scorer name). The filler between the
instruction and the question is grown until the rendered prompt reaches the target length,
and the needle sits at the requested depth (0 = start of the filler, 1 = its end) at a
sentence boundary.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from ktlong.eval.haystack import sentences

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NAMES = ["Amara", "Bastien", "Cordelia", "Dmitri", "Elowen", "Farid", "Greta", "Hiroshi", "Ingrid", "Joaquin",
         "Katya", "Lorcan", "Maelis", "Nikhil", "Oona", "Pavel"]
INGREDIENTS = ["saffron", "juniper", "cardamom", "tamarind", "sorrel", "fennel", "sumac", "lovage", "anise",
               "caraway", "nutmeg", "marjoram"]


@dataclass
class Sample:
    task: str
    length: int  # target tokens
    depth: float
    prompt: str  # the user message
    answer: str
    num_tokens: int = 0  # of the rendered prompt


def first_integer(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def score(task: str, answer: str, output: str) -> bool:
    if task == "passkey":
        return first_integer(output) == answer
    if task == "needle":
        return answer.lower() in output.lower()
    return answer in output  # kvretrieval, multikey: the exact value


def _insert(units: list[str], needle: str, depth: float) -> list[str]:
    at = round(depth * len(units))
    return units[:at] + [needle] + units[at:]


def passkey(rng: random.Random, num_units: int, depth: float):
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    body = " ".join(_insert([PASSKEY_FILLER] * num_units, needle, depth))
    prompt = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it "
              f"and memorize it. I will quiz you about it.\n\n{body}\n\nWhat is the pass key? "
              "Answer with the number only.")
    return prompt, key


def needle(rng: random.Random, num_units: int, depth: float):
    cook, thing = rng.choice(NAMES), rng.choice(INGREDIENTS)
    fact = f"The secret ingredient in {cook}'s famous soup is {thing}."
    body = " ".join(_insert(sentences(num_units, rng.randint(0, 1 << 30)), fact, depth))
    prompt = (f"Read the following text.\n\n{body}\n\nWhat is the secret ingredient in {cook}'s famous soup? "
              "Answer in one short sentence.")
    return prompt, thing


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kvretrieval(rng: random.Random, num_units: int, depth: float):
    pairs = [(_uuid(rng), _uuid(rng)) for _ in range(max(num_units, 1))]
    target = min(int(depth * len(pairs)), len(pairs) - 1)
    key, value = pairs[target]
    body = "{" + ", ".join(f'"{k}": "{v}"' for k, v in pairs) + "}"
    prompt = ("Extract the value corresponding to the specified key in the JSON object below.\n\n"
              f"{body}\n\nKey: \"{key}\"\nWhat is the value associated with this key? Answer with the value only.")
    return prompt, value


def multikey(rng: random.Random, num_units: int, depth: float):
    people = rng.sample(NAMES, 6)
    numbers = {p: str(rng.randint(1000000, 9999999)) for p in people}
    target = people[0]
    units = sentences(num_units, rng.randint(0, 1 << 30))
    # the asked-for needle at the depth, the distractors spread evenly
    others = [(i + 1) / 6 for i in range(5)]
    for person, d in sorted(zip(people[1:], others), key=lambda x: -x[1]):
        units = _insert(units, f"The special magic number for {person} is {numbers[person]}.", d)
    units = _insert(units, f"The special magic number for {target} is {numbers[target]}.", depth)
    prompt = (f"Read the following text.\n\n{' '.join(units)}\n\nWhat is the special magic number for "
              f"{target}? Answer with the number only.")
    return prompt, numbers[target]


TASKS: dict[str, Callable] = {"passkey": passkey, "needle": needle, "kvretrieval": kvretrieval,
                              "multikey": multikey}


def _bracket(count: Callable[[int], int], length: int) -> tuple[int, int]:
    """(lo, hi): lo units fit in length tokens (or lo is 1), hi units do not. A prompt grows
    about linearly in its units, so two small prompts give an estimate and the bracket is
    widened from it by doubling steps: a few counts of long prompts, each a tokenization of up
    to `length` tokens, instead of the dozen that doubling from 8 takes."""
    n8, n64 = count(8), count(64)
    if n8 > length:
        return 1, 8
    if n64 > length:
        return 8, 64
    per_unit = max((n64 - n8) / 56, 1e-6)
    guess = max(64, int(64 + (length - n64) / per_unit))
    step = max(1, guess // 500)
    if count(guess) <= length:
        lo, hi = guess, guess + step
        while count(hi) <= length:
            lo, step = hi, step * 2
            hi = lo + step
    else:
        lo, hi = guess - step, guess
        while lo > 64 and count(lo) > length:
            hi, step = lo, step * 2
            lo = max(64, hi - step)
    return lo, hi


def make_sample(task: str, length: int, depth: float, seed: int, count_tokens: Callable[[str], int]) -> Sample:
    """The longest prompt of this task that renders to at most `length` tokens."""
    gen = TASKS[task]

    def build(units):
        prompt, answer = gen(random.Random(seed), units, depth)
        return prompt, answer, count_tokens(prompt)

    lo, hi = _bracket(lambda units: build(units)[2], length)
    while hi - lo > 1:  # largest unit count that fits
        mid = (lo + hi) // 2
        if build(mid)[2] <= length:
            lo = mid
        else:
            hi = mid
    prompt, answer, n = build(lo)
    return Sample(task, length, depth, prompt, answer, n)
