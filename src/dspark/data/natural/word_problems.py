"""Math prompts: a compositional word-problem generator (13 scenario frames)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from dspark.data.natural.common import NaturalItem, _rng, source_key
from dspark.data.prompts import Prompt

# --------------------------------------------------------------------------------------------
# math: a compositional word-problem generator
# --------------------------------------------------------------------------------------------

_PEOPLE = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kemi", "Liam",
           "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf",
           "Zoe", "Aisha", "Mateo", "Lena", "Kofi", "Ines", "my sister", "my neighbour", "our teacher"]
_GOODS = [("notebook", "notebooks", 2, 9), ("pen", "pens", 1, 4), ("sandwich", "sandwiches", 4, 9),
          ("coffee", "coffees", 3, 6), ("T-shirt", "T-shirts", 8, 25), ("movie ticket", "movie tickets", 9, 15),
          ("bag of rice", "bags of rice", 3, 12), ("potted plant", "potted plants", 5, 20),
          ("paperback", "paperbacks", 7, 16), ("bus pass", "bus passes", 10, 40), ("mango", "mangoes", 1, 3),
          ("phone case", "phone cases", 6, 18), ("pizza", "pizzas", 9, 17), ("bike light", "bike lights", 8, 22)]
_SUFFIX = ["", "", "", "", " Show your working.", " Explain your reasoning step by step.",
           " Just give me the final answer.", " Can you walk me through it?", " Please explain briefly.",
           " I'd like to understand how to solve this kind of problem."]


def _person(r: random.Random) -> tuple[str, str]:
    """A name, and how the rest of the sentence refers to it."""
    n = r.choice(_PEOPLE)
    return (n[0].upper() + n[1:], n if not n.startswith(("my ", "our ")) else "they")


def _f_shopping(r: random.Random) -> tuple[str, list[str]]:
    name, they = _person(r)
    (s1, p1, lo1, hi1), (s2, p2, lo2, hi2) = r.sample(_GOODS, 2)
    q1, q2, c1, c2 = r.randint(2, 6), r.randint(2, 5), r.randint(lo1, hi1), r.randint(lo2, hi2)
    if r.random() < 0.6:
        total = q1 * c1 + q2 * c2
        bill = next(b for b in (20, 50, 100, 200, 500) if b > total)
        return f"change|{name}|{q1}x{c1}|{q2}x{c2}|{bill}", [
            f"How much change does {name} get from a ${bill} bill after buying {q1} {p1} at ${c1} each and "
            f"{q2} {p2} at ${c2} each?",
            f"{name} buys {q1} {p1} for ${c1} each and {q2} {p2} for ${c2} each, and pays with a ${bill} bill. "
            f"How much change should {they} get?",
            f"I bought {q1} {p1} (${c1} each) and {q2} {p2} (${c2} each) and handed over ${bill}. "
            f"How much change should I get back?",
            f"Work out the change from ${bill} for {q1} {p1} at ${c1} apiece plus {q2} {p2} at ${c2} apiece."]
    budget = r.randint(3, 12) * c1 + r.randint(0, c1 - 1)
    return f"budget|{name}|{c1}|{budget}|{s1}", [
        f"How many {p1} can {name} buy with ${budget} if each costs ${c1}, and how much money is left over?",
        f"{p1.capitalize()} cost ${c1} each. {name} has ${budget}. How many can {they} buy, and what's left?",
        f"I've got ${budget} to spend and {p1} are ${c1} each. How many can I get, and how much will I have left?",
        f"Find how many {p1} at ${c1} each fit into a ${budget} budget, and the money remaining."]


def _f_travel(r: random.Random) -> tuple[str, list[str]]:
    vehicle, lo, hi, step = r.choice([("car", 40, 110, 5), ("train", 60, 160, 10), ("cyclist", 12, 24, 1),
                                      ("bus", 30, 70, 5), ("hiker", 3, 6, 1), ("ferry", 15, 40, 5)])
    v, t = r.randrange(lo, hi + 1, step), r.randint(2, 6)
    d = v * t
    kind = r.randrange(3)
    if kind == 0:
        return f"speed|{vehicle}|{d}|{t}", [
            f"What is the average speed of a {vehicle} that covers {d} km in {t} hours?",
            f"A {vehicle} travels {d} km in {t} hours. What is its average speed in km/h?",
            f"I went {d} km by {vehicle if vehicle not in ('cyclist', 'hiker') else 'bike'} and it took me {t} "
            f"hours. How fast was I going on average?",
            f"Find the average speed, in kilometres per hour, of a {vehicle} that goes {d} km in {t} hours."]
    if kind == 1:
        h = r.randint(6, 14)
        return f"arrive|{vehicle}|{d}|{v}|{h}", [
            f"When does a {vehicle} arrive if it leaves at {h}:00, travels {d} km, and averages {v} km/h?",
            f"A {vehicle} sets off at {h}:00 and has {d} km to go at an average of {v} km/h. When will it arrive?",
            f"We're leaving at {h}:00 and the trip is {d} km. If we average {v} km/h, what time do we get there?",
            f"Calculate the arrival time of a {vehicle} that leaves at {h}:00 for a {d} km trip at {v} km/h."]
    v2, t2 = r.randrange(lo, hi + 1, step), r.randint(1, 4)
    return f"legs|{vehicle}|{d}|{v}|{v2 * t2}|{v2}", [
        f"How long does a trip take if a {vehicle} goes {d} km at {v} km/h and then {v2 * t2} km at {v2} km/h? "
        f"What is the average speed overall?",
        f"A {vehicle} covers {d} km at {v} km/h, then another {v2 * t2} km at {v2} km/h. Find the total time "
        f"and the average speed for the whole journey.",
        f"My journey is {d} km at about {v} km/h and then {v2 * t2} km at {v2} km/h. How long will it take "
        f"in total, and what's my average speed?"]


def _f_recipe(r: random.Random) -> tuple[str, list[str]]:
    if r.random() < 0.6:
        s = r.choice([2, 4, 6])
        s2 = s * r.choice([2, 3]) if r.random() < 0.6 else s // 2 * r.choice([3, 5])
        dish, a, ua, b, ub = r.choice([("pancakes", 50, "g of flour", 1, "eggs"),
                                       ("soup", 100, "g of lentils", 250, "ml of stock"),
                                       ("cookies", 40, "g of butter", 30, "g of sugar"),
                                       ("lemonade", 1, "lemons", 150, "ml of water"),
                                       ("a curry", 75, "g of rice", 50, "ml of coconut milk")])
        fa, fb = a * s, b * s
        return f"recipe|{dish}|{s}|{s2}|{fa}|{fb}", [
            f"How much do I need for {s2} people if a recipe for {dish} serving {s} uses {fa} {ua} and {fb} {ub}?",
            f"A recipe for {dish} serves {s} and needs {fa} {ua} and {fb} {ub}. How much of each is needed for "
            f"{s2} servings?",
            f"My {dish} recipe makes enough for {s} and calls for {fa} {ua} plus {fb} {ub}. I'm cooking for "
            f"{s2}. How much of each should I use?",
            f"Scale this recipe from {s} to {s2} servings: {fa} {ua} and {fb} {ub} ({dish})."]
    a, b = r.sample(range(1, 8), 2)
    total = (a + b) * r.randint(2, 12)
    what, x, y = r.choice([("paint", "blue", "white"), ("a drink", "juice", "water"),
                           ("concrete", "sand", "cement"), ("a fertiliser mix", "compost", "soil")])
    return f"ratio|{what}|{a}|{b}|{total}", [
        f"How many litres of {x} and of {y} go into {total} litres of {what} mixed in the ratio {a}:{b}?",
        f"{what.capitalize()} is mixed {x} to {y} in the ratio {a}:{b}. For {total} litres, how much of each "
        f"do you need?",
        f"I want to make {total} litres of {what} with {x} and {y} in a {a}:{b} ratio. How much of each?",
        f"Split {total} litres of {what} into {x} and {y} in the ratio {a}:{b}."]


def _f_percent(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(4)
    if kind == 0:
        price, pct = 20 * r.randint(2, 30), r.choice([10, 15, 20, 25, 30, 40, 50])
        item = r.choice(["coat", "laptop bag", "bike", "pair of boots", "desk lamp", "backpack"])
        return f"discount|{item}|{price}|{pct}", [
            f"What do I pay for a ${price} {item} with {pct}% off?",
            f"A {item} normally costs ${price}. It's {pct}% off this week. What is the sale price?",
            f"The {item} I want is ${price}, but there's a {pct}% discount. How much will I actually pay, "
            f"and how much do I save?",
            f"Calculate the price of a ${price} {item} after a {pct}% discount."]
    if kind == 1:
        salary, pct = 100 * r.randint(20, 60), r.choice([2, 3, 4, 5, 6, 8, 10])
        name, they = _person(r)
        return f"raise|{name}|{salary}|{pct}", [
            f"What is {name}'s new monthly pay after a {pct}% raise on ${salary}?",
            f"{name} earns ${salary} a month and gets a {pct}% raise. How much does {they} earn now?",
            f"I make ${salary} a month and my boss offered a {pct}% raise. What will my new salary be?",
            f"Increase ${salary} by {pct}% and give the new amount."]
    if kind == 2:
        n, pct = 20 * r.randint(1, 15), 5 * r.randint(1, 19)
        group, act = r.choice([("students", "walk to school"), ("employees", "work remotely"),
                               ("people surveyed", "prefer tea to coffee"), ("members", "came to the meeting")])
        return f"share|{group}|{n}|{pct}", [
            f"How many {group} {act} if {pct}% of {n} do?",
            f"Out of {n} {group}, {pct}% {act}. How many is that, and how many don't?",
            f"We asked {n} {group} and {pct}% said they {act}. How many people is that?",
            f"Find {pct}% of {n} {group} (those who {act})."]
    price, pct = 20 * r.randint(2, 30), r.choice([10, 20, 25, 50])
    sale = price * (100 - pct) // 100
    return f"reverse|{price}|{pct}", [
        f"What was the original price of something that costs ${sale} after a {pct}% discount?",
        f"After a {pct}% discount, a jacket costs ${sale}. What did it cost before the sale?",
        f"I paid ${sale} for a lamp that was {pct}% off. What was the full price?",
        f"Work out the pre-discount price if ${sale} is the price after {pct}% off."]


def _f_ages(r: random.Random) -> tuple[str, list[str]]:
    (a, _), (b, _) = _person(r), _person(r)
    while b == a:
        b = _person(r)[0]
    young, k = r.randint(3, 15), r.randint(2, 4)
    old = k * young
    if r.random() < 0.5:
        return f"times|{a}|{b}|{old}|{young}", [
            f"How old are {a} and {b} if {a} is {k} times as old as {b} and together they are {old + young}?",
            f"{a} is {k} times as old as {b}. Their ages add up to {old + young}. How old is each of them?",
            f"My age is {k} times my nephew's, and together we're {old + young}. How old are we?",
            f"Find the two ages: one is {k} times the other and they sum to {old + young}."]
    old = 2 * young + r.randint(3, 20)
    return f"twice|{old}|{young}", [
        f"In how many years will a parent aged {old} be exactly twice as old as a child aged {young}?",
        f"A mother is {old} and her son is {young}. In how many years will she be twice his age?",
        f"I'm {old} and my daughter is {young}. How many years until I'm exactly twice her age?",
        f"Determine when someone aged {old} will be double the age of someone aged {young}."]


def _f_area(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(3)
    if kind == 0:
        ln, w = r.randint(3, 12), r.randint(2, 9)
        return f"tiles|{ln}|{w}", [
            f"How many 50 cm square tiles cover a {ln} m by {w} m floor?",
            f"A room is {ln} m long and {w} m wide. How many square tiles of side 50 cm are needed to cover it?",
            f"I'm tiling a {ln} m × {w} m kitchen floor with 50 cm × 50 cm tiles. How many tiles do I need?",
            f"Compute the number of 0.5 m square tiles needed for a {ln} m by {w} m floor."]
    if kind == 1:
        ln, w, price = r.randint(5, 40), r.randint(4, 25), r.randint(3, 15)
        return f"fence|{ln}|{w}|{price}", [
            f"What does it cost to fence a {ln} m by {w} m garden at ${price} per metre?",
            f"A garden is a {ln} m by {w} m rectangle. Fencing costs ${price} a metre. What will fencing it cost?",
            f"I want to put a fence around my {ln} m × {w} m yard and it's ${price} per metre. What's the total?",
            f"Find the perimeter and the fencing cost of a {ln} m by {w} m plot at ${price}/m."]
    side, path = r.randint(6, 20), r.randint(1, 2)
    return f"path|{side}|{path}", [
        f"What is the area of a {path} m wide path around a square lawn of side {side} m?",
        f"A square lawn of side {side} m has a path {path} m wide all the way around it. "
        f"What is the area of the path?",
        f"My lawn is a {side} m square and I'm laying a {path} m gravel path around the outside. "
        f"How many square metres of gravel path is that?",
        f"Calculate the area of a {path}-metre border around a {side} m by {side} m square."]


_RATE_PAIRS = [(3, 6), (4, 12), (6, 12), (10, 15), (12, 24), (20, 30), (6, 3), (12, 4), (15, 10), (5, 20),
               (8, 24), (9, 18), (30, 20), (24, 8)]


def _f_work(r: random.Random) -> tuple[str, list[str]]:
    if r.random() < 0.6:
        a, b = r.choice(_RATE_PAIRS)
        (x, _), (y, _) = _person(r), _person(r)
        job, unit = r.choice([("paint the fence", "hours"), ("fill the pool", "hours"),
                              ("sort the library donations", "hours"), ("clear the field", "days")])
        return f"together|{job}|{a}|{b}", [
            f"How long do {x} and {y} take to {job} together if {x} alone needs {a} {unit} and {y} alone {b}?",
            f"{x} can {job} in {a} {unit}; {y} can do it in {b} {unit}. Working together, how long will it take?",
            f"It takes me {a} {unit} to {job} and my friend {b} {unit}. If we work together, how long will it take?",
            f"Work out the combined time to {job} when one person takes {a} {unit} and another {b}."]
    k, d = r.choice([2, 3, 4, 6, 8, 12]), r.choice([3, 4, 5, 6, 10, 12])
    m = r.choice([x for x in range(2, 25) if x != k and k * d % x == 0])  # a whole number of days
    return f"crew|{k}|{d}|{m}", [
        f"How many days do {m} workers need for a job that {k} workers finish in {d} days?",
        f"{k} builders finish a wall in {d} days. How long would {m} builders take, working at the same rate?",
        f"Our team of {k} usually takes {d} days for this job. If we had {m} people, how many days would it take?",
        f"Find how long {m} workers need if {k} workers need {d} days."]


def _f_interest(r: random.Random) -> tuple[str, list[str]]:
    p, rate, years = 500 * r.randint(1, 20), r.choice([2, 3, 4, 5, 6, 8]), r.randint(2, 6)
    if r.random() < 0.6:
        return f"simple|{p}|{rate}|{years}", [
            f"How much simple interest does ${p} earn at {rate}% a year over {years} years?",
            f"${p} is invested at {rate}% simple interest per year. How much interest is earned after {years} "
            f"years, and what is the total?",
            f"If I put ${p} in an account paying {rate}% simple interest, how much will I have after {years} years?",
            f"Calculate the simple interest on ${p} at {rate}% per year for {years} years."]
    p, rate = 1000 * r.randint(1, 10), r.choice([5, 10])
    return f"compound|{p}|{rate}|{years}", [
        f"What does ${p} grow to in {years} years at {rate}% compound interest per year?",
        f"${p} is invested at {rate}% a year, compounded annually. What is it worth after {years} years?",
        f"I'm leaving ${p} in a savings account at {rate}% a year, compounded yearly. How much will be there "
        f"after {years} years?",
        f"Compute the value of ${p} after {years} years of {rate}% annual compound interest."]


def _f_units(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(4)
    if kind == 0:
        h, m = r.randint(1, 9), r.choice([0, 10, 15, 20, 30, 45])
        return f"seconds|{h}|{m}", [
            f"How many seconds are there in {h} hours and {m} minutes?",
            f"A film lasts {h} hours and {m} minutes. How long is that in seconds?",
            f"My run took {h} h {m} min. What's that in seconds?",
            f"Convert {h} hours {m} minutes into seconds."]
    if kind == 1:
        litres, glass = r.choice([1, 2, 3, 5]), r.choice([200, 250, 500])
        return f"glasses|{litres}|{glass}", [
            f"How many {glass} ml glasses can be filled from {litres} litres of juice?",
            f"A jug holds {litres} litres. How many glasses of {glass} ml can it fill?",
            f"I have {litres} litres of lemonade for the party. How many {glass} ml cups is that?",
            f"Divide {litres} litres into {glass} ml servings and say how many there are."]
    if kind == 2:
        c = r.choice([100, 120, 150, 160, 180, 200, 220, 250])
        return f"oven|{c}", [
            f"What is {c} °C in Fahrenheit?",
            f"My recipe says to bake at {c} °C but my oven uses Fahrenheit. What should I set it to?",
            f"An oven is set to {c} degrees Celsius. What temperature is that in Fahrenheit?",
            f"Convert {c} °C to °F using F = C × 9/5 + 32."]
    pace, dist = r.randint(4, 8), r.choice([5, 10, 21, 42])
    return f"pace|{pace}|{dist}", [
        f"How long does a {dist} km run take at {pace} minutes per km?",
        f"A runner keeps a pace of {pace} minutes per kilometre. How long does a {dist} km race take, "
        f"in hours and minutes?",
        f"I run about {pace} minutes per km. If I enter a {dist} km race, how long will I be out there?",
        f"Work out the finishing time for {dist} km at a steady {pace} min/km."]


def _f_probability(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(3)
    if kind == 0:
        s = r.randint(3, 11)
        return f"dice|{s}", [
            f"What is the probability that two fair dice add up to {s}?",
            f"Two fair six-sided dice are rolled. What is the probability that their sum is {s}?",
            f"If I roll two dice, what are the chances the total is {s}?",
            f"Find the probability of rolling a total of {s} with two dice."]
    if kind == 1:
        n = r.randint(2, 5)
        k = r.randint(1, n)
        return f"coins|{n}|{k}", [
            f"What is the probability of exactly {k} heads in {n} fair coin flips?",
            f"A fair coin is tossed {n} times. What is the probability of getting exactly {k} heads?",
            f"I flip a coin {n} times. What are the odds of exactly {k} heads?",
            f"Compute P(exactly {k} heads) for {n} tosses of a fair coin."]
    red, blue = r.randint(2, 8), r.randint(2, 8)
    return f"marbles|{red}|{blue}", [
        f"What is the probability that two marbles drawn without replacement from a bag of {red} red and "
        f"{blue} blue are both red?",
        f"A bag has {red} red and {blue} blue marbles. Two are drawn without replacement. "
        f"What is the probability that both are red?",
        f"My kid's bag has {red} red and {blue} blue marbles. If she grabs two without looking, how likely is "
        f"it that they're both red?",
        f"Find the probability of drawing two red marbles in a row (no replacement) from {red} red and "
        f"{blue} blue."]


def _f_sequence(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(3)
    if kind == 0:
        name, they = _person(r)
        a, d, k = r.randint(2, 20), r.randint(1, 5), r.randint(5, 12)
        return f"savings|{a}|{d}|{k}", [
            f"How much does {name} save in week {k}, and in total, starting with ${a} and adding ${d} more each "
            f"week than the week before?",
            f"{name} saves ${a} in the first week and ${d} more each week after that. How much does {they} save "
            f"in week {k}, and how much altogether over {k} weeks?",
            f"I'm saving ${a} this week and plan to add ${d} more every week. How much will I put away in week "
            f"{k}, and what's my total by then?",
            f"Find the week-{k} amount and the {k}-week total for savings of ${a}, ${a + d}, ${a + 2 * d}, …"]
    if kind == 1:
        n0, h = r.choice([50, 100, 200, 500, 1000]), r.choice([1, 2, 3, 4])
        t = h * r.randint(3, 8)
        return f"doubling|{n0}|{h}|{t}", [
            f"How many bacteria are there after {t} hours if a colony of {n0} doubles every {h} hours?",
            f"A colony of {n0} bacteria doubles every {h} hours. How many bacteria are there after {t} hours?",
            f"I started a culture with {n0} cells and they double every {h} hours. How many will I have after "
            f"{t} hours?",
            f"Compute the population after {t} hours: {n0} initially, doubling every {h} hours."]
    a, d = r.randint(1, 30), r.randint(2, 9)
    return f"terms|{a}|{d}", [
        f"What comes next in {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, …, and what is the 20th term?",
        f"The sequence {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, … continues the same way. What is the next "
        f"number, and the 20th?",
        f"There's a pattern in {a}, {a + d}, {a + 2 * d}, {a + 3 * d}. What's the next number, and what would "
        f"the 20th one be?",
        f"Find the rule, the next term and the 20th term of {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, …"]


def _f_average(r: random.Random) -> tuple[str, list[str]]:
    while True:
        scores, target = [r.randint(55, 98) for _ in range(3)], r.randint(70, 92)
        need = 4 * target - sum(scores)
        if 0 <= need <= 100:
            break
    s = ", ".join(map(str, scores[:2])) + f" and {scores[2]}"
    return f"average|{scores}|{target}", [
        f"What score do I need on the fourth test to average {target}, if the first three were {s}?",
        f"A student scored {s} on three tests. What must the fourth score be for an average of {target}?",
        f"So far my test results are {s}. What do I need on the last test to finish with an average of {target}?",
        f"Find the fourth score that makes the average of {s} and it equal to {target}."]


def _f_clock(r: random.Random) -> tuple[str, list[str]]:
    h, m, dh, dm = r.randint(7, 20), r.choice([0, 5, 10, 15, 20, 30, 40, 45, 50]), r.randint(1, 3), r.randint(5, 55)
    if r.random() < 0.5:
        what = r.choice(["movie", "concert", "flight", "exam", "football match"])
        return f"ends|{h}|{m}|{dh}|{dm}", [
            f"What time does a {what} end if it starts at {h}:{m:02d} and lasts {dh} h {dm} min?",
            f"A {what} starts at {h}:{m:02d} and runs for {dh} hours and {dm} minutes. When does it finish?",
            f"The {what} I'm going to starts at {h}:{m:02d} and it's {dh} h {dm} min long. What time will it be over?",
            f"Add {dh} hours {dm} minutes to {h}:{m:02d} and give the end time of the {what}."]
    name, they = _person(r)
    wage, hours, days = r.randint(12, 40), r.randint(4, 9), r.randint(3, 6)
    return f"wage|{wage}|{hours}|{days}", [
        f"How much does {name} earn in a week working {hours} hours a day, {days} days a week, at ${wage} an hour?",
        f"{name} earns ${wage} per hour and works {hours} hours a day, {days} days a week. What does {they} "
        f"earn in a week, and in four weeks?",
        f"My job pays ${wage} an hour and I do {hours}-hour shifts {days} days a week. What's my weekly pay?",
        f"Calculate weekly and four-weekly earnings at ${wage}/hour for {hours} hours a day, {days} days a week."]


_FRAMES: dict[str, Callable[[random.Random], tuple[str, list[str]]]] = {
    "shopping": _f_shopping, "travel": _f_travel, "recipe": _f_recipe, "percent": _f_percent, "ages": _f_ages,
    "area": _f_area, "work": _f_work, "interest": _f_interest, "units": _f_units,
    "probability": _f_probability, "sequence": _f_sequence, "average": _f_average, "clock": _f_clock}


def _math_items(seed: int) -> Iterator[NaturalItem]:
    """Unbounded stream of word problems; unit = frame/seed/index, source = the problem's facts."""
    frames = sorted(_FRAMES)
    i = 0
    while True:
        for frame in frames:
            unit = f"math/{frame}/{seed}/{i}"
            r = _rng(unit)
            facts, phrasings = _FRAMES[frame](r)
            text = r.choice(phrasings) + r.choice(_SUFFIX)
            yield NaturalItem(Prompt(text, "math"), unit, source_key(f"{frame}|{facts}"))
        i += 1
