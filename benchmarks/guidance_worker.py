"""guidance's side of `bench_guidance.py`, run with the guidance environment's Python.

guidance 0.3 pins transformers 4.53, so it runs in an environment of its own (`make
bench-guidance` builds `.venv-guidance`); this worker imports guidance, transformers and
torch only. It loads the model directory once, then answers JSON lines on stdin with JSON
lines on stdout:

    {"cmd": "run", "workload": "sheets" | "records", "items": [...], "spec": {...}}
        -> {"ok": true, "seconds": s, "outputs": [{variable: value, ..., "text": ...}]}
    {"cmd": "stop"}

The programs are the ones `bench_guidance.py` runs on lmprog, written in guidance's own
words; `spec` carries their shared constants. Programs run one after another: a guidance
model object holds one KV cache and one token stream (its usual use). The seconds are
timed here, around the programs only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import guidance
import torch
from guidance import assistant, gen, select, system, user


def load(model_dir: str, dtype: str) -> Any:
    """guidance's Transformers model on the checkpoint, with its fast tokenizer built from
    `tokenizer.json` (the directory's `tokenizer_config.json` names a transformers 5 class)
    and ChatML roles, the template the checkpoint's own renders for these messages."""
    from guidance import models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    special = ("bos_token", "eos_token", "pad_token", "unk_token")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(model_dir, "tokenizer.json"),
        **{k: config[k] for k in special if k in config},
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype))
    return models.Transformers(
        model, tokenizer, echo=False, chat_template=guidance.chat.ChatMLTemplate
    )


@guidance.guidance
def sheet(lm, topic, spec):
    with system():
        lm += spec["system"]
    with user():
        lm += f"Write a character sheet for a {topic}."
    with assistant():
        lm += "Name: " + gen("name", stop="\n", max_tokens=spec["name_tokens"], temperature=0)
        lm += "\nClass: " + select(spec["classes"], name="class")
        lm += "\nAge: " + gen("age", regex=spec["age_regex"], temperature=0)
        lm += "\nWeapon: " + gen(
            "weapon", stop="\n", max_tokens=spec["weapon_tokens"], temperature=0
        )
        lm += "\nMotto: " + gen("motto", stop="\n", max_tokens=spec["motto_tokens"], temperature=0)
    return lm


@guidance.guidance
def order(lm, document, spec):
    with system():
        lm += spec["system"]
    with user():
        lm += document
    with assistant():
        lm += gen("order", regex=spec["regex"], max_tokens=spec["max_tokens"], temperature=0)
    return lm


PROGRAMS = {"sheets": sheet, "records": order}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()

    import transformers

    torch.set_num_threads(args.threads)
    base = load(args.model_dir, args.dtype)
    reply = {
        "ok": True,
        "guidance": guidance.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(reply), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "stop":
            return
        try:
            program = PROGRAMS[command["workload"]]
            spec, outputs = command["spec"], []
            start = time.perf_counter()
            for item in command["items"]:
                lm = base + program(item, spec)
                outputs.append({name: lm[name] for name in spec["variables"]} | {"text": str(lm)})
            seconds = time.perf_counter() - start
            print(json.dumps({"ok": True, "seconds": seconds, "outputs": outputs}), flush=True)
        except Exception as error:  # noqa: BLE001 - reported to the parent, which stops
            print(json.dumps({"ok": False, "error": repr(error)}), flush=True)


if __name__ == "__main__":
    main()
