"""Write the embedded instruction dataset (src/layerstream/data/tiny_instructions.jsonl).

Small, deterministic, and made of tasks a byte-level model can learn a little of in a
minute on a CPU: reversing, upper-casing, counting letters, adding small numbers.
    python scripts/make_tiny_dataset.py
"""

import json
import random
from pathlib import Path

WORDS = (
    "stream layer slot cache copy host device model token train adapter weight pinned "
    "prefetch kernel tensor matrix vector batch epoch"
).split()


def rows(count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        word = rng.choice(WORDS)
        kind = rng.randrange(4)
        if kind == 0:
            yield {"instruction": f"Reverse the word: {word}", "response": word[::-1]}
        elif kind == 1:
            yield {"instruction": f"Write in capitals: {word}", "response": word.upper()}
        elif kind == 2:
            yield {"instruction": f"How many letters are in {word}?", "response": str(len(word))}
        else:
            a, b = rng.randrange(10), rng.randrange(10)
            yield {"instruction": f"Add {a} and {b}.", "response": str(a + b)}


def main():
    path = Path(__file__).resolve().parents[1] / "src" / "layerstream" / "data" / "tiny_instructions.jsonl"
    with open(path, "w") as handle:
        for row in rows(400):
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
