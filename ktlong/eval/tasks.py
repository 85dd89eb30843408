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

from ktlong.eval import stdlib_text
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


# tasks whose answer is several references, joined by ", " in Sample.answer: each must be in
# the output (RULER's string_match_all), or for qa any one of them (its string_match_part)
ALL_OF = {"multivalue", "multiquery", "vartrack", "commonwords", "freqwords"}
ANY_OF = {"qa"}


def references(task: str, answer: str) -> list[str]:
    return answer.split(", ") if task in ALL_OF | ANY_OF else [answer]


def score(task: str, answer: str, output: str) -> bool:
    if task == "passkey":
        return first_integer(output) == answer
    if task == "needle":
        return answer.lower() in output.lower()
    if task in ALL_OF:  # as RULER scores them, case aside; a sample counts when it found them all
        return all(ref.lower() in output.lower() for ref in references(task, answer))
    if task in ANY_OF:
        return any(ref.lower() in output.lower() for ref in references(task, answer))
    return answer in output  # kvretrieval, multikey: the exact value


def _insert(units: list[str], needle: str, depth: float) -> list[str]:
    at = round(depth * len(units))
    return units[:at] + [needle] + units[at:]


def _insert_all(units: list[str], placed: list[tuple[str, float]]) -> list[str]:
    """Each (needle, depth) at its depth of the units, the deepest first (so that each depth is
    taken among the units, not among needles inserted before it)."""
    for needle, depth in sorted(placed, key=lambda x: -x[1]):
        units = _insert(units, needle, depth)
    return units


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
    units = _insert_all(units, [(f"The special magic number for {p} is {numbers[p]}.", d)
                                for p, d in zip(people[1:], others)])
    units = _insert(units, f"The special magic number for {target} is {numbers[target]}.", depth)
    prompt = (f"Read the following text.\n\n{' '.join(units)}\n\nWhat is the special magic number for "
              f"{target}? Answer with the number only.")
    return prompt, numbers[target]


def _spread(units: list[str], needles: list[str], depth: float) -> list[str]:
    """The needles in order, the first at depth and the others evenly after it to the end."""
    return _insert_all(units, [(text, depth + (1 - depth) * i / len(needles)) for i, text in enumerate(needles)])


def multivalue(rng: random.Random, num_units: int, depth: float):
    """One key with four values in four places (RULER's multi-value needle); all four asked."""
    person, *others = rng.sample(NAMES, 3)
    values = [str(n) for n in rng.sample(range(1000000, 9999999), 4)]
    units = sentences(num_units, rng.randint(0, 1 << 30))
    for other, at in zip(others, (0.3, 0.8)):  # other keys' values, not asked
        units = _insert(units, f"One of the special magic numbers for {other} is {rng.randint(1000000, 9999999)}.", at)
    units = _spread(units, [f"One of the special magic numbers for {person} is {v}." for v in values], depth)
    prompt = (f"Read the following text.\n\n{' '.join(units)}\n\nWhat are all the special magic numbers for "
              f"{person}? Answer with the numbers only.")
    return prompt, ", ".join(values)


def multiquery(rng: random.Random, num_units: int, depth: float):
    """Four keys, each with its value, asked in one question (RULER's multi-query needle)."""
    people = rng.sample(NAMES, 5)
    numbers = [str(n) for n in rng.sample(range(1000000, 9999999), 5)]
    units = sentences(num_units, rng.randint(0, 1 << 30))
    units = _insert(units, f"The special magic number for {people[4]} is {numbers[4]}.", 0.5)  # not asked
    units = _spread(units, [f"The special magic number for {p} is {n}." for p, n in zip(people[:4], numbers)], depth)
    asked = ", ".join(people[:3]) + f" and {people[3]}"
    prompt = (f"Read the following text.\n\n{' '.join(units)}\n\nWhat are the special magic numbers for {asked}? "
              "Answer with the numbers only.")
    return prompt, ", ".join(numbers[:4])


def _variable(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def vartrack(rng: random.Random, num_units: int, depth: float):
    """A value passed along a chain of five variables (RULER's variable tracking, one chain of
    four hops), the assignments spread from depth on, beside a second chain of another value."""
    names = []
    while len(names) < 10:
        name = _variable(rng)
        if name not in names:
            names.append(name)
    value, other = rng.sample(range(10000, 99999), 2)
    units = sentences(num_units, rng.randint(0, 1 << 30))

    def chain(variables, number):
        return [f"VAR {variables[0]} = {number}."] + [f"VAR {b} = VAR {a}." for a, b in zip(variables, variables[1:])]
    units = _spread(units, chain(names[5:], other), 0.2)
    units = _spread(units, chain(names[:5], value), depth)
    prompt = (f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
              f"{' '.join(units)}\n\nFind all variables that are assigned the value {value} in the text above. "
              "Answer with the variable names only.")
    return prompt, ", ".join(names[:5])


SYLLABLES = ["ka", "lo", "mer", "tis", "van", "ru", "pel", "dor", "shi", "bam", "ne", "qua", "zor", "fi", "gul",
             "tep", "wis", "yan", "cro", "hib"]


def _words(rng: random.Random, count: int) -> list[str]:
    """count distinct made-up words of three syllables."""
    found: dict[str, None] = {}
    while len(found) < count:
        found["".join(rng.choice(SYLLABLES) for _ in range(3))] = None
    return list(found)


def commonwords(rng: random.Random, num_units: int, depth: float):
    """A numbered list of words where ten appear 30 times each and the others 3 times (RULER's
    common words extraction); the ten asked. depth plays no part."""
    words = _words(rng, 10 + num_units)
    common, rare = words[:10], words[10:]
    items = common * 30 + rare * 3
    rng.shuffle(items)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    prompt = (f"Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
              f"ones that appear most often.\n\n{listing}\n\nWhat are the 10 most common words in the above list? "
              "Answer with the words only.")
    return prompt, ", ".join(common)


def freqwords(rng: random.Random, num_units: int, depth: float):
    """A text of coded words drawn by a Zipf law (RULER's frequent words extraction, alpha 2): the
    three most frequent asked, the third strictly ahead of the fourth. depth plays no part."""
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(60)]
    weights = [1 / (rank + 1) ** 2 for rank in range(len(vocabulary))]
    drawn = rng.choices(vocabulary, weights, k=max(num_units, 12))
    counts = {w: drawn.count(w) for w in set(drawn)}
    top = sorted(counts, key=lambda w: (-counts[w], vocabulary.index(w)))
    while len(top) > 3 and counts[top[2]] <= counts[top[3]]:  # no tie at the cut
        drawn.insert(rng.randrange(len(drawn) + 1), top[2])
        counts[top[2]] += 1
    prompt = (f"Read the following coded text and track the frequency of each coded word. Find the three most "
              f"frequently appeared coded words.\n\n{' '.join(drawn)}\n\nWhat are the three most frequently "
              "appeared coded words in the above coded text? Answer with the words only.")
    return prompt, ", ".join(top[:3])


def qa(rng: random.Random, num_units: int, depth: float):
    """Question answering over real text (RULER's QA, on text that ships with Python): the
    documentation of num_units functions, classes and methods of the standard library; the
    question quotes one's first sentence and asks whose it is, the passage at depth."""
    passages, askable = stdlib_text.passages(), stdlib_text.askable()
    gold = passages[rng.choice(askable)]
    order = list(range(len(passages)))
    rng.shuffle(order)
    others = [passages[i] for i in order if passages[i] is not gold][:num_units]
    units = _insert([f"{p.module}.{p.name}: {p.text}" for p in others], f"{gold.module}.{gold.name}: {gold.text}", depth)
    body = "\n".join(units)
    prompt = (f"Answer the question based on the given documents.\n\n{body}\n\nWhich function, class or method "
              f"above is documented as follows: \"{gold.first_sentence}\"? Answer with its name only.")
    return prompt, gold.name.split(".")[-1]


TASKS: dict[str, Callable] = {"passkey": passkey, "needle": needle, "kvretrieval": kvretrieval,
                              "multikey": multikey, "multivalue": multivalue, "multiquery": multiquery,
                              "vartrack": vartrack, "commonwords": commonwords, "freqwords": freqwords, "qa": qa}


def _bracket(count: Callable[[int], int], length: int) -> tuple[int, int]:
    """(lo, hi): lo units fit in length tokens (or lo is 1), hi units do not. A prompt grows
    about linearly in its units, so two small prompts give an estimate, one long prompt corrects
    it (units whose sizes vary, as the QA task's passages do, make the first estimate miss), and
    the bracket is widened from there by doubling steps: a few counts of long prompts, each a
    tokenization of up to `length` tokens, instead of the dozen that doubling from 8 takes."""
    n8, n64 = count(8), count(64)
    if n8 > length:
        return 1, 8
    if n64 > length:
        return 8, 64
    per_unit = max((n64 - n8) / 56, 1e-6)
    first = max(65, int(64 + (length - n64) / per_unit))
    n_first = count(first)
    per_unit = max((n_first - n64) / (first - 64), 1e-6)
    guess = max(64, int(64 + (length - n64) / per_unit))
    step = max(1, guess // 500)
    fits = (n_first if guess == first else count(guess)) <= length
    if fits:
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
