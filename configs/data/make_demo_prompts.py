"""Write configs/data/demo_prompts.jsonl: the bundled demo corpus (deterministic, stdlib only).

    python configs/data/make_demo_prompts.py [--num-prompts 1200] [--seed 0] [--output PATH]

Rows are text prompts ({"id", "prompt"}) or chats ({"id", "messages": [{"role", "content"}]}),
about a third chats (some with a system prompt, some multi-turn), from a few words to ~150 words:
questions, instructions and short tasks (arithmetic word problems, summaries, translations, code,
rewriting, classification). The first 16 rows are the original demo rows, ids demo-00..demo-15.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOPICS = [
    "the moon", "a river", "prime numbers", "the printing press", "a lighthouse", "jazz", "compilers", "honeybees",
    "the Roman roads", "origami", "volcanoes", "chess openings", "glaciers", "tidal energy", "bread", "photosynthesis",
    "black holes", "the water cycle", "coral reefs", "the steam engine", "migratory birds", "sourdough", "bicycles",
    "the Silk Road", "solar panels", "octopuses", "the immune system", "hash tables", "earthquakes", "tea",
    "the violin", "recycling", "the Great Wall", "rainbows", "sea turtles", "vaccines", "binary search",
    "the telescope", "mushrooms", "the Olympic Games", "clouds", "electric cars", "the alphabet", "penguins",
    "maps", "windmills", "the human heart", "bridges", "deserts", "libraries",
]
PAIRS = [
    ("a list", "a tuple"), ("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"),
    ("a lake", "a pond"), ("RAM", "disk storage"), ("an alligator", "a crocodile"), ("a comet", "an asteroid"),
    ("baking soda", "baking powder"), ("a process", "a thread"), ("TCP", "UDP"), ("a poem", "a song"),
]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
SENTENCES = [
    "The town council met on Tuesday to discuss the new park.",
    "Several residents asked for more benches and a small playground.",
    "The budget for the project is smaller than last year's.",
    "A local bakery offered to sponsor a weekly market in the park.",
    "Volunteers planted two hundred trees along the northern path.",
    "The river that runs beside the park floods every few springs.",
    "Engineers proposed a raised boardwalk to keep the path dry.",
    "Some people worried that the boardwalk would spoil the view.",
    "The mayor promised a public vote before any work begins.",
    "Children from the primary school painted a mural for the entrance.",
    "The library will lend board games at the weekend market.",
    "Birdwatchers counted thirty species near the pond last month.",
    "A new bus stop will make the park easier to reach.",
    "Night lighting was the most requested change in the survey.",
    "The first stage of the work should finish before winter.",
    "Local musicians plan a free concert to celebrate the opening.",
    "The old fountain will be repaired rather than replaced.",
    "Dogs must be kept on a lead near the playground.",
    "The council will publish the final plan online next week.",
    "Everyone agreed that the park should stay free to enter.",
]
REVIEWS = [
    "The soup was cold and the waiter ignored us for twenty minutes.",
    "Lovely little hotel, friendly staff and a great breakfast.",
    "The book started slowly but the ending made it worth it.",
    "I returned the headphones after two days because they kept disconnecting.",
    "Best pizza in town, and the prices are fair.",
    "The film was far too long and the jokes fell flat.",
    "Setup took five minutes and it has worked perfectly ever since.",
    "The tour guide was funny, patient and knew every corner of the city.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "computes the factorial of n", "finds the largest element in a list", "converts Celsius to Fahrenheit",
    "checks whether a word is a palindrome", "flattens a nested list", "counts word frequencies in a text",
]
CODE_LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "C"]
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kemi", "Luca"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells"]
SYSTEMS = [
    "You are a helpful assistant.", "You are a patient teacher who explains things simply.",
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a friendly tutor for primary school students.", "You are an expert software engineer.",
]


def paragraph(rng: random.Random, max_words: int) -> str:
    """A few consecutive sentences from SENTENCES, at most `max_words` words."""
    start = rng.randrange(len(SENTENCES))
    out: list[str] = []
    for k in range(rng.randint(2, 12)):
        sentence = SENTENCES[(start + k) % len(SENTENCES)]
        if sum(len(s.split()) for s in out) + len(sentence.split()) > max_words:
            break
        out.append(sentence)
    return " ".join(out)


def word_problem(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 9)
    return rng.choice([
        f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        f"{name} has {a + b} {item} and gives {b} to a friend. How many are left?",
        f"A box holds {c} {item}. How many {item} are there in {a} boxes?",
        f"{name} shares {a * c} {item} equally among {c} friends. How many does each friend get?",
        f"{name} saves {b} dollars a week for {c} weeks, then spends {b + c} dollars. How much money is left? "
        "Show your working step by step.",
    ])


def task(rng: random.Random) -> str:
    """One user request of a random kind."""
    topic = rng.choice(TOPICS)
    kind = rng.randrange(11)
    if kind == 0:
        return f"Write two sentences about {topic}."
    if kind == 1:
        return word_problem(rng)
    if kind == 2:
        return f"Summarise the following text in one sentence:\n\n{paragraph(rng, 135)}"
    if kind == 3:
        return f"Translate into {rng.choice(LANGUAGES)}: \"{rng.choice(SENTENCES)}\""
    if kind == 4:
        return f"Write a {rng.choice(CODE_LANGUAGES)} function that {rng.choice(CODE_TASKS)}."
    if kind == 5:
        a, b = rng.choice(PAIRS)
        return f"What is the difference between {a} and {b}?"
    if kind == 6:
        return f"List {rng.choice(['three', 'four', 'five'])} facts about {topic}."
    if kind == 7:
        return f"Explain {topic} to a child."
    if kind == 8:
        return f"Is this review positive or negative? Answer with one word.\n\nReview: {rng.choice(REVIEWS)}"
    if kind == 9:
        return f"Rewrite this in a more formal tone: {rng.choice(SENTENCES).lower()}"
    return f"Write a short poem about {topic}."


def reply(rng: random.Random, request: str) -> str:
    """A canned assistant turn (the multi-turn chats need one; its quality does not matter)."""
    return rng.choice([
        "Sure. Here is a first attempt; tell me if you want it shorter or longer.",
        "Here is my answer. I kept it brief, but I can add more detail.",
        "Done. Let me know if anything is unclear.",
        f"I answered \"{' '.join(request.split()[:6])} ...\" as best I could.",
    ])


def chat(rng: random.Random, max_words: int = 120) -> list[dict[str, str]]:
    """A chat of at most `max_words` words in all (long ones are drawn again), ending on a user turn.

    The bound keeps every demo prompt under ~480 tokens of the tiny-llama preset's tokenizer, so
    `make demo` (engine.max_seq_len=512, 32 new tokens) accepts them all.
    """
    while True:
        messages = draw_chat(rng)
        if sum(len(m["content"].split()) for m in messages) <= max_words:
            return messages


def draw_chat(rng: random.Random) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(rng.choice([1, 1, 2, 3])):  # about half of the chats are multi-turn
        if messages and messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": reply(rng, messages[-1]["content"])})
        follow_up = rng.choice(["Now make it shorter.", "Can you give an example?", "Explain that more simply."])
        messages.append({"role": "user", "content": task(rng) if len(messages) < 2 else rng.choice([task(rng), follow_up])})
    return messages


ORIGINAL_WRITE = ["the moon", "a river", "prime numbers", "the printing press", "a lighthouse", "jazz", "compilers",
                  "honeybees", "the Roman roads", "origami", "volcanoes", "chess openings"]
ORIGINAL_EXPLAIN = ["photosynthesis", "glaciers", "tidal energy", "bread"]


def original_rows() -> list[dict]:
    """The 16 rows the demo corpus started with, ids and text unchanged: every fourth is a chat."""
    write, explain = iter(ORIGINAL_WRITE), iter(ORIGINAL_EXPLAIN)
    rows = []
    for i in range(16):
        row_id = f"demo-{i:02d}"
        if i % 4 == 3:
            rows.append({"id": row_id, "messages": [{"role": "user", "content": f"Explain {next(explain)} to a child."}]})
        else:
            rows.append({"id": row_id, "prompt": f"Write two sentences about {next(write)}."})
    return rows


def make_rows(num_prompts: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = original_rows()
    for i in range(len(rows), num_prompts):
        row_id = f"demo-{i:02d}"
        if rng.random() < 1 / 3:
            rows.append({"id": row_id, "messages": chat(rng)})
        else:
            rows.append({"id": row_id, "prompt": task(rng)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("demo_prompts.jsonl"))
    args = parser.parse_args()
    rows = make_rows(args.num_prompts, args.seed)
    args.output.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {args.output}")


if __name__ == "__main__":
    main()
