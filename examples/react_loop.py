"""A ReAct-style loop: Python control flow on generated values.

    .venv/bin/python examples/react_loop.py

Each step the model picks a tool with select; the program runs it in Python and appends
the result; the loop ends on "answer now" or when no tool is left. Every step's prompt
extends the previous one, so the prefix cache serves all but the newest tokens.
"""

from __future__ import annotations

import lmprog as lp

TOOLS = {
    "track the parcel": lambda: (
        "Order 1042 was shipped on Monday with ParcelCo and arrives on Thursday."
    ),
    "check the refund": lambda: "No refund has been requested for order 1042.",
}


@lp.function
def support_agent(s, question):
    tool_list = ", ".join(TOOLS)
    s += lp.system(
        f"You are a support agent. Before answering, pick a tool: {tool_list}, or answer now."
    )
    s += lp.user(question)
    facts, tools = [], list(TOOLS)
    while tools:
        step = f"action_{len(facts)}"
        s += lp.assistant("Next step: " + lp.select(step, choices=[*tools, "answer now"]))
        if s[step] == "answer now":  # a concrete value: the program branches on it
            break
        tools.remove(s[step])
        facts.append(TOOLS[s[step]]())
        s += lp.user(f"Result: {facts[-1]}")
    info = " ".join(facts)
    s += lp.user(
        f"Information: {info}\nCustomer question: {question}\n"
        "Write the reply to the customer in one sentence."
    )
    s += lp.assistant(lp.gen("answer", max_tokens=40, stop="\n"))


def main() -> None:
    with lp.Engine("smollm2-135m-instruct") as engine:
        lp.set_default_backend(engine)
        for question in ["Where is my parcel for order 1042?", "Did I ask for a refund?"]:
            state = support_agent.run(question=question, temperature=0)
            steps = [state[f"action_{i}"] for i in range(len(TOOLS) + 1) if f"action_{i}" in state]
            print(f"{question}\n  steps: {steps}\n  answer: {state['answer'].strip()}")
        print("cached prompt tokens:", int(engine.stats()["cached_tokens"]))


if __name__ == "__main__":
    main()
