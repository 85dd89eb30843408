"""Natural-prose haystack generated offline: seeded sentences about an invented country.

Nothing is downloaded; the same seed gives the same text. Sentences are varied enough that
a model cannot predict the next one, and none of them states a number-keyed fact that a
needle could be confused with.
"""

from __future__ import annotations

import random

PLACES = ["Varenholt", "the Ossian coast", "Lake Mirrow", "the old quarter of Brenn", "the Tallis hills",
          "Callowmere", "the river Ysk", "the northern plateau", "Dunmarsh", "the market town of Aldwick",
          "the Harrow valley", "the salt flats of Emberline", "Westreach", "the island of Corra"]
PEOPLE = ["farmers", "fishermen", "weavers", "schoolteachers", "travelling musicians", "clockmakers",
          "beekeepers", "ferry pilots", "stonemasons", "librarians", "shepherds", "glassblowers"]
THINGS = ["autumn fairs", "wooden bridges", "stone lighthouses", "orchards of pale apples", "slow canals",
          "bell towers", "lantern festivals", "copper roofs", "narrow staircases", "winter markets",
          "painted boats", "tidal mills", "reading rooms", "herb gardens"]
ADJECTIVES = ["quiet", "stubborn", "generous", "weathered", "patient", "cheerful", "careful", "restless",
              "thoughtful", "proud", "modest", "curious"]
VERBS = ["remember", "repair", "celebrate", "argue about", "write songs about", "trade stories about",
         "keep records of", "paint", "walk past", "gather near"]
TIMES = ["in the early morning", "after the first frost", "during the long summer evenings",
         "when the ferries stop running", "on market days", "before the spring rains",
         "once the harvest is in", "late in the year"]
TEMPLATES = [
    "In {place}, the {adj} {people} {verb} the {things} {time}.",
    "Visitors to {place} often notice the {things}, which the {people} still {verb} {time}.",
    "Nobody in {place} can say exactly when the {things} were built, but the {people} {verb} them {time}.",
    "{Time}, the {people} of {place} {verb} the {things} with a {adj} kind of attention.",
    "The {things} of {place} are less famous than those of {place2}, yet the {people} {verb} them all the same.",
    "Old letters from {place} describe {adj} {people} who would {verb} the {things} {time}.",
    "A {adj} traveller once wrote that {place} is best understood by watching the {people} {time}.",
    "When the weather turns, the {people} of {place} {verb} the {things} and then go home to {place2}.",
    "Children in {place} learn early to {verb} the {things}, a habit the {adj} {people} encourage.",
    "It is said that the {things} near {place} were a gift from the {people} of {place2}.",
]


def sentence(rng: random.Random) -> str:
    place, place2 = rng.sample(PLACES, 2)
    time = rng.choice(TIMES)
    text = rng.choice(TEMPLATES).format(
        place=place, place2=place2, adj=rng.choice(ADJECTIVES), people=rng.choice(PEOPLE),
        verb=rng.choice(VERBS), things=rng.choice(THINGS), time=time, Time=time[0].upper() + time[1:])
    return text[0].upper() + text[1:]


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(count)]
