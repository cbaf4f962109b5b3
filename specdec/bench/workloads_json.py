"""Templates of the JSON-shaped built-in workloads: `agent` (a tool loop) and `extract`.

Each generator takes a seeded `random.Random` and returns dataset lines (dicts as
specdec/bench/serve_requests.py reads them). The entities are drawn from small word lists and
composed, so requests vary while their shapes (the system prompt, the tool schemas, the JSON
of calls and results) repeat across requests as they do in real agent and extraction traffic.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

PEOPLE = ["Mirela Voss", "Tobiah Quenell", "Asha Okonkwo", "Jarrah Feld", "Ines Marquardt",
          "Oskar Lindqvist", "Priya Raman", "Dmitri Solano", "Wren Abernathy", "Keiko Hasegawa",
          "Luca Benedetti", "Amara Nwosu", "Silas Grieve", "Noor Haddad", "Elodie Fairbanks"]
CITIES = ["Port Evander", "Halvorsen", "Quillmoor", "Ashgrove", "Bellwater", "Drummore",
          "Kestrel Bay", "Orvieto Falls", "Marrowfield", "Sundholm", "Tarnwick", "Velloran"]
COMPANIES = ["Brightloom Textiles", "Corvid Analytics", "Fennick & Daughters", "Halcyon Freight",
             "Juniper Robotics", "Larkspur Dental", "Mossbank Bakery", "Northwind Optics",
             "Pelham Grain Co.", "Quarry Lane Studios", "Saltmarsh Energy", "Tidewell Insurance"]
PRODUCTS = ["ceramic kettle", "trail backpack", "desk lamp", "wool blanket", "espresso grinder",
            "folding bicycle", "noise-cancelling headset", "cast-iron skillet", "standing desk",
            "rain jacket", "label printer", "garden hose reel"]
MONTHS = ["March", "April", "May", "June", "July", "September", "October", "November"]

AGENT_SYSTEM_INTRO = (
    "You are Relay, an operations assistant that acts only through tools. At every turn, reply "
    "with exactly one JSON object of the form {\"name\": TOOL_NAME, \"arguments\": {...}} that "
    "calls the next tool, and nothing else: no prose, no code fences. Use the values the user "
    "and earlier tool results give; never invent identifiers. When the task is complete, call "
    "finish with a one-sentence summary.\n\nTools (OpenAI function schemas):\n")


def _tool(name: str, description: str, properties: dict[str, Any],
          required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
TOOLS = [
    _tool("search_flights", "Flights between two cities on a date, cheapest first.",
          {"origin": _STR, "destination": _STR, "date": {"type": "string", "format": "date"}},
          ["origin", "destination", "date"]),
    _tool("book_flight", "Book a seat on a flight for a passenger.",
          {"flight_id": _STR, "passenger": _STR}, ["flight_id", "passenger"]),
    _tool("lookup_order", "An order's items, amount, status and customer email.",
          {"order_id": _STR}, ["order_id"]),
    _tool("issue_refund", "Refund all or part of an order.",
          {"order_id": _STR, "amount": _NUM, "reason": _STR}, ["order_id", "amount", "reason"]),
    _tool("get_weather", "The forecast for a city on a date.",
          {"city": _STR, "date": {"type": "string", "format": "date"},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "date"]),
    _tool("create_event", "Create a calendar event.",
          {"title": _STR, "date": {"type": "string", "format": "date"}, "start": _STR,
           "duration_minutes": _INT, "attendees": {"type": "array", "items": _STR}},
          ["title", "date", "start", "duration_minutes"]),
    _tool("send_email", "Send an email.",
          {"to": _STR, "subject": _STR, "body": _STR}, ["to", "subject", "body"]),
    _tool("finish", "End the task.", {"summary": _STR}, ["summary"]),
]
AGENT_SYSTEM = AGENT_SYSTEM_INTRO + json.dumps(TOOLS)

Step = tuple[dict[str, Any], dict[str, Any]]  # (the call, its result)


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def _email(person: str) -> str:
    first, last = person.lower().split(" ", 1)
    return f"{first}.{last.replace(' ', '')}@example.org"


def _date(rng: random.Random) -> str:
    return f"2027-{rng.randint(3, 11):02d}-{rng.randint(1, 28):02d}"


def _travel(rng: random.Random) -> tuple[str, list[Step]]:
    origin, destination = rng.sample(CITIES, 2)
    person, date = rng.choice(PEOPLE), _date(rng)
    flights: list[dict[str, Any]] = [
        {"flight_id": f"{rng.choice('KQRTVX')}{rng.choice('AELMNP')}{rng.randint(100, 989)}",
         "departs": f"{hour:02d}:{rng.choice(['05', '20', '35', '50'])}",
         "price": rng.randint(89, 420)} for hour in sorted(rng.sample(range(6, 22), 3))]
    cheapest = min(flights, key=lambda flight: flight["price"])
    code = f"{rng.randint(0, 0xFFFFFF):06X}"
    task = (f"Book the cheapest flight from {origin} to {destination} on {date} for {person}, "
            f"then email them the confirmation at {_email(person)}.")
    return task, [
        (_call("search_flights", origin=origin, destination=destination, date=date),
         {"flights": sorted(flights, key=lambda flight: flight["price"])}),
        (_call("book_flight", flight_id=cheapest["flight_id"], passenger=person),
         {"status": "confirmed", "confirmation": code, "flight_id": cheapest["flight_id"]}),
        (_call("send_email", to=_email(person), subject=f"Your flight to {destination}",
               body=f"Booked {cheapest['flight_id']} on {date}, confirmation {code}."),
         {"status": "sent"}),
    ]


def _refund(rng: random.Random) -> tuple[str, list[Step]]:
    order_id = f"ORD-{rng.randint(10000, 99999)}"
    person, product = rng.choice(PEOPLE), rng.choice(PRODUCTS)
    price = round(rng.randint(1500, 24000) / 100, 2)
    reason = rng.choice(["arrived damaged", "is the wrong colour", "never arrived", "stopped working"])
    task = (f"Order {order_id}: the customer says the {product} {reason}. Refund it in full and "
            "tell the customer by email.")
    return task, [
        (_call("lookup_order", order_id=order_id),
         {"order_id": order_id, "items": [{"product": product, "price": price}],
          "amount": price, "status": "delivered", "customer_email": _email(person)}),
        (_call("issue_refund", order_id=order_id, amount=price, reason=reason),
         {"status": "refunded", "refund_id": f"RF-{rng.randint(100000, 999999)}"}),
        (_call("send_email", to=_email(person), subject=f"Refund for order {order_id}",
               body=f"We refunded {price:.2f} for the {product} that {reason}."),
         {"status": "sent"}),
    ]


def _meeting(rng: random.Random) -> tuple[str, list[Step]]:
    city, date = rng.choice(CITIES), _date(rng)
    host, guest = rng.sample(PEOPLE, 2)
    title = f"{rng.choice(['Site visit', 'Planning walk', 'Supplier lunch', 'Team offsite'])} in {city}"
    weather = rng.choice(["light rain", "sunny", "overcast", "windy", "snow showers"])
    start = f"{rng.randint(9, 15):02d}:{rng.choice(['00', '30'])}"
    task = (f"Check the weather in {city} on {date}; if it suits, schedule '{title}' at {start} "
            f"for 90 minutes with {guest}, and email {guest} the plan.")
    return task, [
        (_call("get_weather", city=city, date=date, unit="celsius"),
         {"city": city, "date": date, "summary": weather, "high": rng.randint(4, 29),
          "low": rng.randint(-3, 12), "precipitation_mm": rng.randint(0, 14)}),
        (_call("create_event", title=title, date=date, start=start, duration_minutes=90,
               attendees=[_email(host), _email(guest)]),
         {"status": "created", "event_id": f"EV-{rng.randint(1000, 9999)}"}),
        (_call("send_email", to=_email(guest), subject=title,
               body=f"{title} on {date} at {start}; forecast: {weather}."),
         {"status": "sent"}),
    ]


_TASKS: list[Callable[[random.Random], tuple[str, list[Step]]]] = [_travel, _refund, _meeting]


def agent_lines(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Tool loops cut after 0-3 steps: the model is asked for the next JSON call (the calls
    after the last step are finish). The model writes its calls as JSON text, not as
    OpenAI `tool_calls`, so the tool results carry no `tool_call_id`: one would answer no
    call, which the gateway refuses as OpenAI does."""
    lines = []
    for index in range(count):
        task, steps = _TASKS[index % len(_TASKS)](rng)
        done = rng.randint(0, len(steps))
        messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task}]
        for call, result in steps[:done]:
            messages.append({"role": "assistant", "content": json.dumps(call)})
            messages.append({"role": "tool", "content": json.dumps(result)})
        lines.append({"messages": messages, "max_tokens": 96})
    return lines


# ------------------------------------------------------------------ extract

def _obj(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _contact(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    person, company, city = rng.choice(PEOPLE), rng.choice(COMPANIES), rng.choice(CITIES)
    phone = f"+{rng.randint(30, 49)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    role = rng.choice(["head of procurement", "office manager", "lead engineer", "buyer"])
    text = (f"Hi, this is {person}, {role} at {company} in {city}. We met at the trade fair and "
            f"I would like a quote for next quarter. Best to reach me on {phone} or at "
            f"{_email(person)} - I am out of office on Fridays.")
    schema = _obj({"name": _STR, "role": _STR, "company": _STR, "city": _STR, "phone": _STR,
                   "email": _STR})
    return "contact", schema, text


def _order(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    items = rng.sample(PRODUCTS, rng.randint(2, 3))
    quantities = [rng.randint(1, 6) for _ in items]
    prices = [round(rng.randint(900, 15000) / 100, 2) for _ in items]
    order_id = f"PO-{rng.randint(2000, 8999)}"
    listed = "; ".join(f"{q} x {item} at {p:.2f} each" for item, q, p in zip(items, quantities, prices))
    text = (f"Purchase order {order_id} from {rng.choice(COMPANIES)}, to ship to "
            f"{rng.choice(CITIES)} by {rng.randint(1, 28)} {rng.choice(MONTHS)}: {listed}. "
            f"Currency: {rng.choice(['EUR', 'GBP', 'USD'])}. Payment within 30 days.")
    item_schema = _obj({"product": _STR, "quantity": _INT, "unit_price": _NUM})
    schema = _obj({"order_id": _STR, "buyer": _STR, "ship_to": _STR, "deadline": _STR,
                   "currency": {"type": "string", "enum": ["EUR", "GBP", "USD"]},
                   "items": {"type": "array", "items": item_schema}})
    return "purchase_order", schema, text


def _event(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    host, *guests = rng.sample(PEOPLE, rng.randint(3, 4))
    city = rng.choice(CITIES)
    topic = rng.choice(["the spring catalogue", "warehouse safety", "the new billing system",
                        "supplier contracts", "the autumn fair"])
    text = (f"{host} invites {', '.join(guests[:-1])} and {guests[-1]} to a review of {topic} "
            f"on {rng.randint(1, 28)} {rng.choice(MONTHS)} at {rng.randint(9, 16)}:00 in the "
            f"{rng.choice(['Harbour', 'Cedar', 'Lantern', 'Granary'])} room of the {city} office. "
            f"Expect about {rng.choice([45, 60, 90])} minutes; bring last quarter's figures.")
    schema = _obj({"organiser": _STR, "attendees": {"type": "array", "items": _STR},
                   "topic": _STR, "date": _STR, "time": _STR, "location": _STR,
                   "duration_minutes": _INT})
    return "meeting", schema, text


def _job(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    company, city = rng.choice(COMPANIES), rng.choice(CITIES)
    title = rng.choice(["Warehouse Team Lead", "Data Analyst", "Field Technician",
                        "Junior Accountant", "Customer Success Manager", "Pastry Chef"])
    low = rng.randint(28, 70) * 1000
    remote = rng.choice([True, False])
    text = (f"{company} is hiring a {title} for its {city} site. Salary {low:,} to "
            f"{low + rng.randint(5, 20) * 1000:,} a year, "
            f"{'fully remote possible' if remote else 'on site five days a week'}. "
            f"Requires {rng.randint(1, 6)} years of experience. Apply by {rng.randint(1, 28)} "
            f"{rng.choice(MONTHS)} to {_email(rng.choice(PEOPLE))}.")
    schema = _obj({"company": _STR, "title": _STR, "city": _STR, "salary_min": _INT,
                   "salary_max": _INT, "remote": {"type": "boolean"},
                   "years_experience": _INT, "apply_to": _STR})
    return "job_posting", schema, text


_EXTRACTIONS = [_contact, _order, _event, _job]


def extract_lines(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """A text and a JSON schema; the chat request also carries the schema as OpenAI's
    `response_format` (json_schema, strict)."""
    lines = []
    for index in range(count):
        name, schema, text = _EXTRACTIONS[index % len(_EXTRACTIONS)](rng)
        content = ("Extract the information in the text below as one JSON object matching this "
                   f"JSON schema. Reply with the JSON only.\n\nSchema:\n{json.dumps(schema)}\n\n"
                   f"Text:\n{text}")
        lines.append({"messages": [{"role": "user", "content": content}], "max_tokens": 160,
                      "response_format": {"type": "json_schema", "json_schema": {
                          "name": name, "schema": schema, "strict": True}}})
    return lines
