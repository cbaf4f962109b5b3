"""Templates of the text-copying built-in workloads: `code-edit` and `rag`.

`code-edit` asks for a small change to a given Python function (a rename, a new parameter, a
rewritten loop), so the answer copies most of the function. `rag` gives a document of several
paragraphs and asks a question whose answer quotes it. Both draw from small word lists (see
specdec/bench/workloads_json.py for the shared ones) and compose.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from specdec.bench.workloads_json import CITIES, COMPANIES, MONTHS, PEOPLE, PRODUCTS

# (plural, singular, a numeric attribute, a label attribute)
DOMAINS = [("orders", "order", "total", "customer"), ("readings", "reading", "value", "sensor"),
           ("invoices", "invoice", "amount", "client"), ("packets", "packet", "size", "source"),
           ("students", "student", "score", "cohort"), ("shipments", "shipment", "weight", "carrier"),
           ("tickets", "ticket", "priority", "assignee"), ("trees", "tree", "height", "species")]

# Each function: (name, code, a variable to rename, an "add a parameter" and a "rewrite" request),
# with {p} plural, {s} singular, {n} numeric attribute, {l} label attribute.
FUNCTIONS: list[tuple[str, str, str, str, str]] = [
    ("sum_large_{p}",
     "def sum_large_{p}({p}, limit):\n    total = 0\n    for {s} in {p}:\n"
     "        if {s}.{n} > limit:\n            total += {s}.{n}\n    return total\n",
     "total",
     "Add a parameter `scale` with default 1.0 and multiply each {n} by it before adding it.",
     "Rewrite the loop as one call to sum() over a generator expression."),
    ("group_{p}_by_{l}",
     "def group_{p}_by_{l}({p}):\n    groups = {{}}\n    for {s} in {p}:\n"
     "        key = {s}.{l}\n        if key not in groups:\n            groups[key] = []\n"
     "        groups[key].append({s})\n    return groups\n",
     "groups",
     "Add a parameter `key_function` with default None; when it is given, group by "
     "key_function({s}) instead of {s}.{l}.",
     "Rewrite the loop body to use dict.setdefault instead of the if statement."),
    ("top_{p}",
     "def top_{p}({p}, count):\n"
     "    ranked = sorted({p}, key=lambda {s}: {s}.{n}, reverse=True)\n    result = []\n"
     "    for {s} in ranked[:count]:\n        result.append(({s}.{l}, {s}.{n}))\n"
     "    return result\n",
     "ranked",
     "Add a parameter `ascending` with default False and use it to choose the sort order.",
     "Rewrite the for loop as a list comprehension."),
    ("describe_{p}",
     "def describe_{p}({p}):\n    values = [{s}.{n} for {s} in {p}]\n    if not values:\n"
     "        return None\n    mean = sum(values) / len(values)\n"
     "    spread = max(values) - min(values)\n"
     "    return {{\"count\": len(values), \"mean\": mean, \"spread\": spread}}\n",
     "spread",
     "Add a parameter `digits` with default 2 and round the mean and the spread to that many "
     "digits.",
     "Rewrite the list comprehension as an explicit for loop that appends to values."),
    ("load_{p}",
     "def load_{p}(path):\n    {p} = []\n    with open(path) as handle:\n"
     "        for line in handle:\n            line = line.strip()\n"
     "            if not line or line.startswith(\"#\"):\n                continue\n"
     "            {l}, {n} = line.split(\",\")\n            {p}.append(({l}, float({n})))\n"
     "    return {p}\n",
     "handle",
     "Add a parameter `separator` with default \",\" and split each line on it.",
     "Rewrite it to return a dict from {l} to {n} instead of a list of pairs."),
    ("fetch_{s}",
     "def fetch_{s}(client, {s}_id, attempts):\n    for attempt in range(attempts):\n"
     "        try:\n            return client.get(\"/{p}/\" + str({s}_id))\n"
     "        except TimeoutError:\n            time.sleep(2 ** attempt)\n"
     "    raise RuntimeError(\"gave up on {s} \" + str({s}_id))\n",
     "attempt",
     "Add a parameter `base_delay` with default 1.0 and sleep base_delay * 2 ** attempt.",
     "Rewrite the for loop as a while loop with an explicit counter."),
]
EDIT_KINDS = ["rename function", "rename variable", "add parameter", "rewrite", "type hints"]
NEW_VERBS = ["collect", "gather", "compute", "build", "select", "tally"]
NEW_VARIABLES = ["accumulated", "buckets", "ordered", "width", "stream", "tries"]


def _max_tokens_for(code: str) -> int:
    """About the function's length in tokens (3 characters each) plus room for the change,
    in steps of 32 between 128 and 256."""
    return max(128, min(256, -(-(len(code) // 3 + 48) // 32) * 32))


def code_edit_lines(rng: random.Random, count: int) -> list[dict[str, Any]]:
    combos = list(itertools.product(range(len(FUNCTIONS)), range(len(DOMAINS)), EDIT_KINDS))
    lines = []
    for function_index, domain_index, kind in rng.sample(combos, count):
        name, code, variable, add, rewrite = FUNCTIONS[function_index]
        p, s, n, label = DOMAINS[domain_index]
        fields = {"p": p, "s": s, "n": n, "l": label}
        name, code = name.format(**fields), code.format(**fields)
        if kind == "rename function":
            new = f"{rng.choice(NEW_VERBS)}_{name.split('_', 1)[1]}"
            request = f"Rename the function {name} to {new}."
        elif kind == "rename variable":
            request = (f"Rename the variable `{variable}` to "
                       f"`{NEW_VARIABLES[function_index]}` everywhere in the function.")
        elif kind == "add parameter":
            request = add.format(**fields)
        elif kind == "rewrite":
            request = rewrite.format(**fields)
        else:
            request = "Add type hints to every parameter and to the return value."
        content = (f"Here is a Python function:\n\n```python\n{code}```\n\n{request} Reply with "
                   "the whole updated function in a code block and nothing else.")
        lines.append({"messages": [{"role": "user", "content": content}],
                      "max_tokens": _max_tokens_for(code)})
    return lines


# ------------------------------------------------------------------ rag

TRADES = ["salt merchant", "shipwright", "clockmaker", "wool trader", "surveyor", "glassblower"]
INDUSTRIES = ["herring fishing", "peat cutting", "flax weaving", "slate quarrying", "barley malting"]
RIVERS = ["Ondel", "Varrow", "Kessa", "Lume", "Brannoch", "Idris"]
FESTIVALS = ["Lantern Regatta", "Salt Fair", "Night of Bells", "Harvest Rowing Race", "Kite Week"]


def _document(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """A town, and its paragraphs as (topic, text), in the order drawn."""
    town, elsewhere, farther = rng.sample(CITIES, 3)
    founder, mayor = rng.sample(PEOPLE, 2)
    company, product = rng.choice(COMPANIES), rng.choice(PRODUCTS)
    founded = rng.randint(1180, 1790)
    river = rng.choice(RIVERS)
    paragraphs = [
        ("history", f"{town} was founded in {founded} by {founder}, a {rng.choice(TRADES)} from "
         f"{elsewhere}. For its first century the settlement lived from "
         f"{rng.choice(INDUSTRIES)}, and by {founded + rng.randint(120, 200)} it had "
         f"{rng.randint(8, 40) * 100} inhabitants. The old toll house on {river} Street dates "
         "from that time and is the oldest building still standing."),
        ("geography", f"The town lies where the {river} meets the sea, {rng.randint(12, 90)} "
         f"kilometres {rng.choice(['north', 'south', 'east', 'west'])} of {farther}. Its "
         f"harbour can freeze in {rng.choice(['January', 'February'])} during hard winters, "
         f"and the marshes upriver flood most springs. The highest point, "
         f"{rng.choice(['Gallow', 'Crane', 'Beacon', 'Thorn'])} Hill, rises to "
         f"{rng.randint(60, 240)} metres."),
        ("economy", f"Today the largest employer is {company}, whose works on the east quay "
         f"make the {product} sold under the town's name and employ {rng.randint(180, 900)} "
         f"people. Tourism comes second: about {rng.randint(20, 95)} thousand visitors arrive "
         "each summer, most of them for a single day."),
        ("culture", f"Every {rng.choice(MONTHS)} the town holds the {rng.choice(FESTIVALS)}, "
         f"first recorded in {founded + rng.randint(40, 300)}. The small museum above the "
         f"library keeps {rng.randint(3, 12)} ship models and the founder's ledger, which "
         "visitors may read on the first Sunday of each month."),
        ("transport", f"A ferry leaves for {elsewhere} every {rng.choice([20, 30, 45, 60])} "
         f"minutes in summer and every {rng.choice([90, 120])} minutes in winter. The railway "
         f"reached the town in {rng.randint(1850, 1910)}; the line to {farther} closed in "
         f"{rng.randint(1955, 1985)} and is now a cycle path."),
        ("council", f"The town council has {rng.choice([9, 11, 13, 15])} seats. The current "
         f"mayor, {mayor}, was elected in {rng.randint(2012, 2025)} after promising to "
         "rebuild the sea wall, which work began the following year."),
    ]
    rng.shuffle(paragraphs)
    return town, paragraphs[:rng.randint(5, 6)]


QUESTIONS = {
    "history": ["Who founded {town}, and when? Quote the sentence that says so.",
                "What is the oldest building still standing in {town}? Quote the text."],
    "geography": ["Where does {town} lie? Answer with the sentence from the document.",
                  "What happens to the harbour of {town} in hard winters? Quote the text."],
    "economy": ["Who is the largest employer in {town}, and what do they make? Quote the text.",
                "How many visitors come to {town} each summer? Quote the sentence."],
    "culture": ["Which festival does {town} hold, and since when? Quote the text.",
                "What does the museum in {town} keep? Answer with the sentences about it."],
    "transport": ["How often does the ferry leave {town}? Quote the sentence that says so.",
                  "What became of the railway line from {town}? Quote the text."],
    "council": ["Who is the mayor of {town}, and what did they promise? Quote the text.",
                "How many seats does the council of {town} have? Quote the sentence."],
}


def rag_lines(rng: random.Random, count: int) -> list[dict[str, Any]]:
    lines = []
    for _ in range(count):
        town, paragraphs = _document(rng)
        topic = rng.choice(paragraphs)[0]
        question = rng.choice(QUESTIONS[topic]).format(town=town)
        document = "\n\n".join(text for _, text in paragraphs)
        content = ("Answer the question using only the document below, quoting it word for "
                   f"word where you can.\n\nDocument:\n{document}\n\nQuestion: {question}")
        lines.append({"messages": [{"role": "user", "content": content}], "max_tokens": 96})
    return lines
