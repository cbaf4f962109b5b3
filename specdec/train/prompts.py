"""Instruction sets for self-distillation, kept apart from the prompts used for measuring.

*Training prompts* are generated from templates x subjects (`training_prompts`), varied on
purpose: explanations, lists, stories, code, maths, rewriting, advice, comparisons. The
*held-out chat prompts* (`specdec/prompts/heldout_chat.jsonl`, read by `heldout_prompts`)
are hand-written and used only by `python -m specdec bench`; `bench serve` uses
`specdec/prompts/builtin.jsonl`. `tests/service/test_train.py` checks that no training prompt equals
or contains one of either set, and that no held-out prompt names a training subject in a
training template.
"""

from __future__ import annotations

import json
import random
from importlib import resources

_TEMPLATES: tuple[str, ...] = (
    "Explain {s} in simple terms.",
    "What is {s}? Answer in a short paragraph.",
    "Give me three interesting facts about {s}.",
    "Write a short poem about {s}.",
    "Write a short story that involves {s}.",
    "List five key points someone should know about {s}.",
    "Describe {s} to a curious eight-year-old.",
    "What are the advantages and disadvantages of {s}?",
    "Write a tweet-length summary about {s}.",
    "Write a blog post introduction about {s}.",
    "How would you teach a beginner about {s}? Give a step-by-step plan.",
    "Write a friendly email to a colleague about {s}.",
    "Give a brief history of {s}.",
    "What are common misconceptions about {s}?",
    "Write a short dialogue between two friends discussing {s}.",
    "Create a multiple-choice quiz question about {s} with the answer.",
    "Summarise the most important ideas about {s} in bullet points.",
    "Why does {s} matter? Give two reasons.",
    "Write a product-style description of {s}.",
    "Compare {s} with {t} in a few sentences.",
    "Write a haiku about {s}.",
    "Give me a fun fact about {s} and explain why it is true.",
    "Write an encouraging message for a student learning about {s}.",
    "What questions would an expert ask about {s}?",
    "Outline a five-minute presentation on {s}.",
    "Write a limerick about {s}.",
    "Describe a typical day for someone who works with {s}.",
    "What would the world be like without {s}?",
)

_CODE_TEMPLATES: tuple[str, ...] = (
    "Write a Python function that {c}.",
    "Write a JavaScript function that {c}.",
    "Show how to {c} in Python, and explain the code.",
    "Write a short C program that {c}.",
    "Write a Python class with a method that {c}, and add a docstring.",
    "Explain, step by step, an algorithm that {c}.",
)

_MATH_TEMPLATES: tuple[str, ...] = (
    "What is {a} plus {b}? Show your steps.",
    "What is {a} times {b}? Explain how you got the answer.",
    "If a shop sells {a} apples a day, how many does it sell in {b} days?",
    "A train travels {a} kilometres in {b} hours. What is its average speed?",
    "Is {a} a prime number? Explain.",
    "What is {b} percent of {a}?",
)

_REWRITE_TEMPLATES: tuple[str, ...] = (
    "Rewrite this sentence to sound more formal: '{w}'",
    "Translate into Spanish: '{w}'",
    "Correct the grammar of this sentence: '{w}'",
    "Make this sentence shorter: '{w}'",
    "Turn this sentence into a question: '{w}'",
    "Explain the meaning of this sentence: '{w}'",
)

_SUBJECTS: tuple[str, ...] = (
    "photosynthesis", "volcanoes", "the Roman Empire", "black holes", "honeybees", "the moon",
    "machine learning", "climate change", "the human heart", "earthquakes", "the internet",
    "electric cars", "the printing press", "rainforests", "the Great Wall of China", "penguins",
    "recycling", "the stock market", "vaccines", "solar panels", "coral reefs", "chess",
    "the Olympic Games", "coffee", "chocolate", "the piano", "jazz music", "dinosaurs",
    "the ocean tides", "gravity", "the immune system", "democracy", "ancient Egypt",
    "the French Revolution", "renewable energy", "meditation", "time management", "gardening",
    "bicycles", "airplanes", "the solar system", "DNA", "bread baking", "the water cycle",
    "public libraries", "video games", "friendship", "volunteering", "mountains", "deserts",
    "the Amazon river", "elephants", "owls", "sharks", "butterflies", "the seasons",
    "cloud computing", "cybersecurity", "open source software", "databases", "robots",
    "smartphones", "social media", "online learning", "budgeting", "healthy eating",
    "running", "yoga", "sleep", "learning a new language", "public speaking", "teamwork",
    "leadership", "the theory of evolution", "magnets", "rainbows", "lightning", "snowflakes",
    "the periodic table", "vitamins", "bacteria", "the brain", "memory", "habits",
    "urban planning", "trains", "bridges", "skyscrapers", "the Renaissance", "Shakespeare",
    "poetry", "museums", "photography", "painting with watercolours", "origami",
    "camping", "fishing", "the Arctic", "glaciers", "wind turbines", "nuclear power",
    "the metric system", "prime numbers", "fractions", "probability", "statistics",
    "geometry", "the speed of light", "sound waves", "telescopes", "satellites", "Mars",
    "the International Space Station", "tea", "cheese making", "pizza", "spices", "tomatoes",
    "houseplants", "cats", "dogs", "horses", "wolves", "whales", "the Sahara", "islands",
    "maps", "compasses", "clocks", "calendars", "money", "banks", "inflation", "taxes",
    "entrepreneurship", "marketing", "customer service", "job interviews", "resumes",
    "remote work", "email etiquette", "note taking", "reading books", "writing essays",
    "the scientific method", "critical thinking", "kindness", "patience", "curiosity",
)

_CODE_TASKS: tuple[str, ...] = (
    "checks whether a string is a palindrome", "counts the vowels in a sentence",
    "finds the largest number in a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "computes the n-th Fibonacci number",
    "sorts a list of words by length", "reads a text file and counts its words",
    "merges two sorted lists", "checks whether a year is a leap year",
    "returns the factorial of a number", "flattens a nested list",
    "counts how often each word appears in a text", "validates a simple email address",
    "finds the second smallest number in a list", "capitalises the first letter of every word",
    "computes the average of the numbers in a list", "reverses the words in a sentence",
    "checks whether two strings are anagrams", "converts a binary string to an integer",
    "generates a multiplication table", "finds all even numbers in a range",
    "implements binary search", "returns the greatest common divisor of two numbers",
)

_SENTENCES: tuple[str, ...] = (
    "me and him goes to the market every sunday", "The meeting was moved to next week.",
    "I think that we should probably try to maybe finish the project soon.",
    "The cat sat on the warm windowsill all afternoon.", "She don't like cold weather.",
    "Our team finished the report ahead of schedule.", "Can you send me the file tomorrow?",
    "The river flows quietly through the old town.", "He have been working here since 2019.",
    "Reading every day makes your vocabulary richer.", "The children played in the park.",
    "We was late because the bus broke down.", "Fresh bread smells wonderful in the morning.",
    "Please remember to water the plants while I am away.",
)


_HOWTO_TEMPLATES: tuple[str, ...] = (
    "How do I {h}?",
    "Give me some tips to {h}.",
    "What is the best way to {h}?",
    "What mistakes should I avoid when I try to {h}?",
    "I want to {h}. Where should I start?",
    "Write a short checklist for anyone who wants to {h}.",
    "My friend wants to {h}. What advice would you give?",
    "Explain, in numbered steps, how to {h}.",
)

_ACTIVITIES: tuple[str, ...] = (
    "learn to swim as an adult", "plan a family road trip", "write a cover letter",
    "save money for a new bicycle", "organise a small kitchen", "start jogging",
    "cook fluffy rice", "prepare for a history exam", "make friends in a new city",
    "fix a flat bicycle tyre", "grow herbs on a windowsill", "clean a laptop keyboard",
    "choose a novel to read", "write a good summary of an article", "give constructive feedback",
    "keep a daily journal", "reduce my screen time", "improve my handwriting",
    "bake chocolate chip cookies", "brew a good cup of tea", "set up a home office",
    "host a dinner party", "learn to draw faces", "take better photos with a phone",
    "memorise a short speech", "back up my computer files", "paint a bedroom wall",
    "learn the guitar", "write a short mystery story", "train for a five kilometre race",
    "keep houseplants alive", "negotiate a higher salary", "prepare a healthy lunch box",
    "run an efficient team meeting", "learn basic sign language", "start a vegetable garden",
    "write clean Python code", "debug a program that crashes", "choose a laptop for college",
    "declutter a wardrobe", "make a monthly budget", "care for a pet goldfish",
    "improve my chess game", "teach a child to ride a bike", "write a good essay introduction",
    "speak more confidently in class", "organise a neighbourhood clean-up", "make homemade soup",
)


def _subject_prompts(rng: random.Random) -> list[str]:
    prompts = []
    for subject in _SUBJECTS:
        for template in _TEMPLATES:
            other = rng.choice([s for s in _SUBJECTS if s != subject])
            prompts.append(template.format(s=subject, t=other))
    return prompts


def training_prompts(seed: int = 0) -> list[str]:
    """Every training instruction, deduplicated, shuffled with `seed` (about five thousand)."""
    rng = random.Random(seed)
    prompts = _subject_prompts(rng)
    prompts += [template.format(h=activity) for activity in _ACTIVITIES for template in _HOWTO_TEMPLATES]
    prompts += [template.format(c=task) for task in _CODE_TASKS for template in _CODE_TEMPLATES]
    for _ in range(120):
        a, b = rng.randint(3, 999), rng.randint(2, 99)
        prompts.append(rng.choice(_MATH_TEMPLATES).format(a=a, b=b))
    prompts += [template.format(w=sentence) for sentence in _SENTENCES for template in _REWRITE_TEMPLATES]
    prompts = list(dict.fromkeys(prompts))
    rng.shuffle(prompts)
    return prompts


def _read_jsonl(name: str) -> list[str]:
    text = resources.files("specdec").joinpath(f"prompts/{name}").read_text("utf-8")
    return [json.loads(line)["messages"][-1]["content"] for line in text.splitlines() if line.strip()]


def heldout_prompts() -> list[str]:
    """The held-out chat prompts `python -m specdec bench` measures on (never trained on)."""
    return _read_jsonl("heldout_chat.jsonl")
