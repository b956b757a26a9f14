"""What an eager forward launches on CUDA, counted on a CPU: its aten ops and its Triton
kernels, per forward mode.

On CUDA a step no decode graph takes (a prompt's, or a mixed prefill+decode one) runs
eagerly, and each launch costs the host time (about 15 us an eager op on the H200 machine,
`gpu_check.py`'s `host_costs`). Here the model runs with the CUDA set (the Triton attention
backend and the fused Triton ops) under the Triton interpreter, a `TorchDispatchMode`
counting the aten ops that launch work (views, the interpreter's own copies and dtype
queries apart) and the interpreter's kernel launches, for a prompt's forward, a decode
step's and a mixed one's. Counts, not timings: they do not move with the machine.

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/count_eager_launches.py [--model small]
"""

from __future__ import annotations

import argparse
import collections
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # (before Triton decorates any kernel)

# Not the model's launches: the interpreter moves tensors with the first four as it runs
# a kernel, and the last two compute nothing on a device (a dtype, a flag).
NOT_LAUNCHES = frozenset(
    {
        "aten.set_",
        "aten.empty",
        "aten.new_empty",
        "aten.copy_",
        "aten.promote_types",
        "aten.detach_",
    }
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    args = parser.parse_args(argv)

    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    from lmprog_runtime import Engine, default_model_path
    from lmprog_runtime.forward_batch import ForwardMode
    from lmprog_runtime.models.triton_ops import TritonOps

    kernels: collections.Counter[str] = collections.Counter()
    launch = interpreter.InterpretedFunction.run

    def counted_launch(self, *a, **k):
        kernels[self.fn.__name__] += 1
        return launch(self, *a, **k)

    interpreter.InterpretedFunction.run = counted_launch

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if not func.is_view and name not in NOT_LAUNCHES:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    config = {"attention_backend": "triton", "max_running_requests": 8, "max_total_tokens": 4096}
    with Engine(default_model_path(args.model), **config) as engine:
        runner = engine.runner
        runner.model.ops = TritonOps()  # (as the runner sets them on CUDA)
        run, seen = runner.run, {}

        def counted_run(fb):
            kernels.clear()
            with CountOps() as counter:
                out = run(fb)
            mixed = fb.mode is ForwardMode.EXTEND and fb.num_decodes > 0
            kind = "mixed" if mixed else fb.mode.name.lower()
            seen.setdefault(kind, (dict(counter.ops), dict(kernels)))
            return out

        runner.run = counted_run
        prompts = [[5 + i + j for j in range(8)] for i in range(4)]
        params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        engine.submit(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 12})
        while engine.stats()["decode_tokens"] == 0:  # (it decodes: the next prompts mix in)
            time.sleep(0.01)
        engine.generate(input_ids=prompts[1:], sampling_params=params)
    print(f"{args.model}: launches of one eager forward (Triton backend and fused ops)")
    for kind, (ops, launched) in seen.items():
        total = sum(ops.values()) + sum(launched.values())
        print(f"  {kind:7}: {total} = {sum(ops.values())} aten ops {ops}")
        print(f"           + {sum(launched.values())} Triton kernels {launched}")


if __name__ == "__main__":
    main()
