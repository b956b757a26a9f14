"""A ReAct-style loop: Python control flow on generated values.

    .venv/bin/python examples/react_loop.py

Each step the model picks an action with select; the program runs the tool in Python and
appends the observation; the loop ends on "finish" or after a few steps. Every step's
prompt extends the previous one, so the prefix cache serves all but the newest tokens.
"""

from __future__ import annotations

import lmprog as lp

TOOLS = {
    "lookup_order": lambda: "Order 1042: shipped on Monday, carrier ParcelCo.",
    "check_refund": lambda: "No refund has been requested for order 1042.",
}


@lp.function
def support_agent(s, question, max_steps=3):
    s += "You help customers. Tools: lookup_order, check_refund. Say finish when done.\n"
    s += f"Customer: {question}\n"
    for step in range(max_steps):
        s += f"Thought {step}:" + lp.gen(f"thought_{step}", max_tokens=12, stop="\n") + "\n"
        s += "Action: " + lp.select(f"action_{step}", choices=[*TOOLS, "finish"]) + "\n"
        action = s[f"action_{step}"]  # a concrete value: the program branches on it
        if action == "finish":
            break
        s += f"Observation: {TOOLS[action]()}\n"
    s += "Final answer:" + lp.gen("answer", max_tokens=24, stop="\n")


def main() -> None:
    with lp.Engine() as engine:
        lp.set_default_backend(engine)
        state = support_agent.run(question="Where is my order 1042?", temperature=0)
        print(state.text())
        print("cached prompt tokens:", int(engine.stats()["cached_tokens"]))


if __name__ == "__main__":
    main()
