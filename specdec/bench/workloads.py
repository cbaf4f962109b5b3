"""The built-in workloads of `bench serve --dataset NAME`, generated from templates.

Six traffic shapes, each 48 requests drawn with a fixed seed from small word lists and
composed (deterministic: the same lines on every machine and Python 3 version):

- `agent`: a tool loop: one system prompt with OpenAI tool schemas (as text), a task, earlier
  JSON tool calls and their results as turns; the model writes the next JSON call;
- `code-edit`: rename, add a parameter or rewrite a loop in a given function (the answer
  copies most of it);
- `rag`: a document of several paragraphs and a question answered by quoting it;
- `extract`: a text and a JSON schema; chat requests carry it as `response_format`;
- `multi-turn`: chats whose later user turns quote earlier turns;
- `chat`: open questions with short answers.

specdec ships the generated lines as specdec/prompts/NAME.jsonl (tests/service/test_bench_workloads.py
checks the files match this generator); `python -m specdec.bench.workloads` rewrites them.
Every line has "messages" and its own "max_tokens"; for the completions endpoint
`load_requests` sends the conversation as plain text (`transcript`).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.cli import DefaultsHelpFormatter
from specdec.bench.workloads_json import PEOPLE, agent_lines, extract_lines
from specdec.bench.workloads_text import code_edit_lines, rag_lines

NUM_REQUESTS = 48
SEED = 20261202

# ------------------------------------------------------------------ chat

CHAT_FORMS: list[tuple[str, list[str]]] = [
    ("In one or two sentences, what is {}?",
     ["a sundial", "a sea shanty", "compound interest", "a haiku", "a watershed",
      "a sourdough starter", "a solar eclipse", "a crossword cryptic clue", "a tide pool",
      "a metronome"]),
    ("Briefly, why {}?",
     ["do onions make people cry", "do cats knead blankets", "does bread go stale",
      "do leaves change colour in autumn", "do we get hiccups", "does popcorn pop",
      "do boats float", "does ice float on water", "do owls hunt at night",
      "do mirrors swap left and right"]),
    ("Give me one practical tip for {}. Keep it short.",
     ["remembering people's names", "keeping basil alive indoors", "packing a suitcase",
      "writing a thank-you note", "practising the guitar every day", "sleeping on a train",
      "learning to juggle", "cooking rice on a stove", "running in the rain",
      "sharpening a kitchen knife"]),
    ("Name three {}, one per line.",
     ["board games for two players", "birds that cannot fly", "instruments in a brass band",
      "vegetables that grow in shade", "famous bridges", "kinds of cloud",
      "uses for baking soda", "card games for a rainy day", "shapes of pasta",
      "stretches for a stiff neck"]),
    ("Suggest a name for {}, with one sentence on why.",
     ["a bakery by the sea", "a grey kitten", "a hiking club", "a rowing boat",
      "a podcast about maps", "a tabletop game about trains", "a community garden",
      "a robot vacuum", "a jazz trio", "a bookshop café"]),
]


def chat_lines(rng: random.Random, count: int) -> list[dict[str, Any]]:
    prompts = [form.format(filler) for form, fillers in CHAT_FORMS for filler in fillers]
    return [{"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.choice([32, 48, 64])}
            for prompt in rng.sample(prompts, count)]


# ------------------------------------------------------------------ multi-turn

# A question per topic and the sentences an earlier assistant turn is built from.
TOPICS: list[tuple[str, list[str]]] = [
    ("How do I keep a sourdough starter healthy?",
     ["Feed it equal weights of flour and water once a day while it lives on the counter.",
      "A starter kept in the fridge only needs feeding once a week.",
      "Grey liquid on top is only alcohol, so pour it off and feed the starter.",
      "It is ready to bake with when it doubles within six hours of a feed."]),
    ("I want to learn to swim as an adult. Where do I start?",
     ["Start in water shallow enough to stand in, so fear never takes over.",
      "Practise breathing out slowly through your nose with your face in the water.",
      "Floating on your back comes before any stroke, because it teaches you to relax.",
      "Two short sessions a week beat one long one while you are learning."]),
    ("How should I plan a small vegetable garden?",
     ["Put the beds where they get at least six hours of sun.",
      "Grow what you actually eat rather than what looks good in catalogues.",
      "Keep each bed narrow enough to reach the middle without stepping on the soil.",
      "Plant lettuce and radishes between slower crops to use the space twice."]),
    ("How do I train for my first 10k run?",
     ["Build up over eight weeks with three runs a week.",
      "Most of your runs should be slow enough to hold a conversation.",
      "Add one longer run each week, a little further than the week before.",
      "Take a rest day after every hard session so your legs can recover."]),
    ("My houseplants keep dying. What am I doing wrong?",
     ["Overwatering kills more houseplants than anything else.",
      "Water only when the top two centimetres of soil feel dry.",
      "Check that every pot has a drainage hole, so roots never sit in water.",
      "Most leafy plants want bright light but not direct afternoon sun."]),
    ("How do I start keeping a monthly budget?",
     ["Write down every expense for one month before setting any limits.",
      "Split spending into fixed costs, everyday costs and occasional costs.",
      "Move money into savings on payday, before you can spend it.",
      "Review the budget at the end of each month and adjust one category at a time."]),
    ("What is a good way to get better at chess?",
     ["Play longer games, because fast games teach habits more than thinking.",
      "After each game, look for the move where the evaluation changed.",
      "Solve a few tactics puzzles every day to train pattern recognition.",
      "Learn the ideas behind one opening instead of memorising many lines."]),
    ("How should I set up a small home office?",
     ["Put the desk near a window but not facing it, to avoid glare.",
      "Raise the screen so its top edge sits at eye height.",
      "Choose a chair that lets your feet rest flat on the floor.",
      "Keep cables bundled behind the desk so the floor stays clear."]),
]
FOLLOW_UPS = ["You said: \"{quote}\" Why is that?",
              "Can you explain this part of your answer in more detail: \"{quote}\"",
              "About \"{quote}\" - what happens if I ignore that?",
              "I'm not sure I understood \"{quote}\" Could you give me an example?"]
CALLBACKS = ["Going back to my first question, \"{question}\" - which of your tips matters most?",
             "To sum up what I asked at the start, \"{question}\" - give me a three-step plan.",
             "You also said \"{quote}\" How does that fit with the rest of your advice?"]


def multi_turn_lines(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """3 or 5 messages; each later user turn quotes an earlier turn word for word."""
    lines = []
    for index in range(count):
        question, sentences = TOPICS[index % len(TOPICS)]
        opener = f"Hi, I'm {rng.choice(PEOPLE).split()[0]}. {question}"
        answer = rng.sample(sentences, 3)
        messages = [{"role": "user", "content": opener},
                    {"role": "assistant", "content": " ".join(answer)},
                    {"role": "user", "content": rng.choice(FOLLOW_UPS).format(quote=answer[0])}]
        if rng.random() < 0.5:
            messages.append({"role": "assistant", "content": "It matters because the other "
                             f"steps build on it. For example: {answer[1]}"})
            messages.append({"role": "user", "content": rng.choice(CALLBACKS).format(
                question=question, quote=answer[2])})
        lines.append({"messages": messages, "max_tokens": rng.choice([96, 128])})
    return lines


# ------------------------------------------------------------------ the registry

WORKLOADS: dict[str, Callable[[random.Random, int], list[dict[str, Any]]]] = {
    "agent": agent_lines, "code-edit": code_edit_lines, "rag": rag_lines,
    "extract": extract_lines, "multi-turn": multi_turn_lines, "chat": chat_lines,
}


def transcript(messages: list[dict[str, Any]]) -> str:
    """A conversation as plain text for the completions endpoint, ending where the assistant
    speaks next."""
    turns = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
    return "\n\n".join([*turns, "Assistant:"])


def generate(name: str, count: int = NUM_REQUESTS, seed: int = SEED) -> list[dict[str, Any]]:
    """The dataset lines of workload `name`: "messages", "max_tokens" (and
    "response_format" for extract). Raises ValueError when the templates cannot give `count`
    distinct prompts."""
    rng = random.Random(f"{seed}-{name}")  # each workload its own stream: adding one moves no other
    lines = WORKLOADS[name](rng, count)
    if len({json.dumps(line["messages"]) for line in lines}) != count:
        raise ValueError(f"workload {name}: the templates repeat a prompt; widen the word lists")
    return lines


def to_jsonl(lines: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def shipped_path(name: str) -> Path:
    return Path(__file__).resolve().parent.parent / "prompts" / f"{name}.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.workloads",
                                     formatter_class=DefaultsHelpFormatter,
                                     description="Rewrite specdec/prompts/NAME.jsonl from the templates.")
    parser.add_argument("names", nargs="*", help=f"of {', '.join(WORKLOADS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads: {', '.join(unknown)}")
    for name in args.names or WORKLOADS:
        path = shipped_path(name)
        path.write_text(to_jsonl(generate(name)), "utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
