"""The GPU check's correctness sections: logprobs and greedy tokens against transformers,
greedy equality with the cache and CUDA graphs on and off, the overlapped loop against the
synchronous one."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from gpu_check_common import (
    GREEDY,
    Check,
    corpus_prompts,
    free_memory,
    hf_generate,
    instruct_models,
    load_hf,
)


def correctness(check: Check) -> dict[str, Any]:
    """Logprobs of every prompt and output token against transformers' forward of the same
    sequence, and greedy tokens against its `generate`.

    In float32 the two agree to 1e-3. In bfloat16 either side's rounding moves a logprob
    as far from the other's as from float32 (random-weight models are sensitive to it: the
    first GPU run measured transformers' own bfloat16 forward 0.43 from its float32 one on
    "small"), so there each side is measured against transformers' float32 forward of the
    same sequences: the engine's distance within 1.25x (mean) and 1.5x (max) of
    transformers' bfloat16 forward's own."""
    models = ["tiny"] if check.smoke else ["tiny", "small", *instruct_models()]
    new_tokens = 8 if check.smoke else 16
    dtypes = [check.dtype] if check.smoke else [check.dtype, "float32"]
    out: dict[str, Any] = {}
    for name in models:
        prompts = [p[:n] for p, n in zip(corpus_prompts(name, 4, 48), (5, 17, 31, 48))]
        hf = {dtype: load_hf(name, dtype, check.device) for dtype in {*dtypes, "float32"}}
        for dtype in dtypes:
            reference = [hf_generate(hf[dtype], [p], new_tokens)[0] for p in prompts]
            for backend in check.backends():
                with check.engine(name, dtype=dtype, attention_backend=backend) as engine:
                    graphs = engine.runner.graphs is not None
                    results = engine.generate(
                        input_ids=prompts,
                        sampling_params={"max_new_tokens": new_tokens, **GREEDY},
                        return_logprob=True,
                        logprob_start_len=0,
                    )
                seqs = [p + r["output_ids"] for p, r in zip(prompts, results)]
                ours = [lp for r in results for lp in _engine_logprobs(r)]
                same_dtype = _diff_stats(ours, _sequences_logprobs(hf[dtype], seqs))
                same = [r["output_ids"] == ref for r, ref in zip(results, reference)]
                entry: dict[str, Any] = {
                    "max_logprob_diff": same_dtype["max"],
                    "mean_logprob_diff": same_dtype["mean"],
                    "greedy_identical_prompts": f"{sum(same)}/{len(same)}",
                    "cuda_graphs": graphs,
                }
                if dtype == "float32":
                    entry["tolerance"] = 1e-3
                    entry["within_tolerance"] = same_dtype["max"] <= 1e-3
                else:
                    exact = _sequences_logprobs(hf["float32"], seqs)
                    engine = _diff_stats(ours, exact)
                    theirs = _diff_stats(_sequences_logprobs(hf[dtype], seqs), exact)
                    entry["engine_vs_float32"] = engine
                    entry["transformers_vs_float32"] = theirs
                    entry["within_tolerance"] = (
                        engine["mean"] <= 1.25 * theirs["mean"] + 1e-3
                        and engine["max"] <= 1.5 * theirs["max"] + 1e-3
                    )
                out[f"{name}/{backend}/{dtype}"] = entry
        del hf
        free_memory()
    return out


def _engine_logprobs(result: dict[str, Any]) -> list[float]:
    """The engine's logprob of each prompt token after the first and each output token."""
    meta = result["meta_info"]
    return [lp for lp, *_ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]


def _sequences_logprobs(hf: Any, seqs: list[list[int]]) -> list[float]:
    """Transformers' logprob of each token after the first of each of `seqs`."""
    out = []
    for seq in seqs:
        with torch.inference_mode():
            logits = hf(torch.tensor([seq], device=hf.device)).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)  # [len, vocab]; row i scores token i + 1
        out += [float(ref[i - 1, seq[i]]) for i in range(1, len(seq))]
    return out


def _diff_stats(got: list[float], want: list[float]) -> dict[str, float]:
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs)}


def greedy_equality(check: Check) -> dict[str, Any]:
    name = "tiny" if check.smoke else "small"
    groups = 2 if check.smoke else 4
    shared = corpus_prompts(name, groups, 64 if check.smoke else 256)
    tails = corpus_prompts(name, groups * 4, 8, offset=5000)
    # 13 of 16 (no bucket size: the graphs pad), of three lengths (not all multiples of
    # the decode runs' 4: runs stop and continue, the last ones shorter, step by step).
    prompts = [shared[i // 4] + tails[i] for i in range(groups * 4)][:13]
    longest = 8 if check.smoke else 32
    params = [{"max_new_tokens": longest - 3 * (i % 3), **GREEDY} for i in range(len(prompts))]
    # float32: the identity holds there by design (in bfloat16 a graph's padded batch or a
    # cache hit's extend shape may pick other kernel tiles and move a token).
    base = {"dtype": "float32"}
    variants = {"cache_on": base, "cache_off": {**base, "disable_radix_cache": True}}
    if not check.smoke:
        variants["cuda_graphs_off"] = {**base, "disable_cuda_graph": True}
    # Decode runs of 4 (on a GPU, full runs of plain greedy steps are one replay of the
    # run's graph), overlapped and synchronous.
    variants["decode_runs"] = {**base, "decode_steps": 4}
    variants["decode_runs_synchronous"] = {**base, "decode_steps": 4, "overlap_schedule": False}
    tokens: dict[str, list[list[int]]] = {}
    out: dict[str, Any] = {"dtype": "float32"}
    for label, config in variants.items():
        with check.engine(name, **config) as engine:
            tokens[label] = [
                r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)
            ]
            if label == "cache_on":
                warm = engine.generate(input_ids=prompts, sampling_params=params)
                tokens["cache_on_warm"] = [r["output_ids"] for r in warm]
                out["cached_tokens_warm"] = sum(r["meta_info"]["cached_tokens"] for r in warm)
                out["cuda_graphs"] = engine.runner.graphs is not None
            if label.startswith("decode_runs"):
                graphs = engine.runner.graphs
                out[f"{label}_run_graphs"] = graphs is not None and graphs.run_steps > 0
                out[f"{label}_runs"] = engine.stats()["decode_runs"]
    base = tokens["cache_on"]
    for label, got in tokens.items():
        if label != "cache_on":
            same = sum(a == b for a, b in zip(got, base))
            out[f"identical_{label}_vs_cache_on"] = f"{same}/{len(base)}"
    return out


def overlap_equality(check: Check) -> dict[str, Any]:
    """The overlapped loop (the next tokens kept on the device, drawn by the forward
    worker, queued on the loop's stream) against the synchronous one, on the same requests: greedy and seeded
    draws, top-k / top-p, penalties, min_new_tokens, stop strings, logprobs and (with
    outlines-core) regexes; float32, so that a batch's shape moves no token. Figures: the
    outputs identical between the loops, the largest logprob difference on identical
    tokens, the top-2 lists' tokens identical there, and what any output breaks of its request (a placeholder id left, a length
    out of bounds, a stop string in the text, a regex not matched). Then overlapped
    decode runs against the synchronous loop, on requests of the same kinds."""
    kinds = [
        {"temperature": 0, "ignore_eos": True},
        {"temperature": 0.9, "seed": 11, "ignore_eos": True},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 12},
        {"temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"temperature": 0.7, "seed": 13, "min_new_tokens": 12},
        {"temperature": 0, "stop": ["e", "a"]},
    ]
    num = 6 if check.smoke else 18
    params = [{"max_new_tokens": 6 + 3 * i, **kinds[i % len(kinds)]} for i in range(num)]
    if importlib.util.find_spec("outlines_core") is not None:
        regex = r"[a-z]{2,8}-[0-9]{2,4}( ok)?"
        params[-1] = {"max_new_tokens": 32, "temperature": 0, "regex": regex}
        params[-2] = {"max_new_tokens": 32, "temperature": 0.9, "seed": 14, "regex": regex}
    logprobs = [i % 3 == 0 for i in range(num)]
    prompts = corpus_prompts("tiny", num, 12)
    outs: dict[str, list[dict[str, Any]]] = {}
    out: dict[str, Any] = {"requests": num, "regex": "regex" in params[-1]}
    for label, overlap in (("overlapped", True), ("synchronous", False)):
        with check.engine("tiny", dtype="float32", overlap_schedule=overlap) as engine:
            outs[label] = engine.generate(
                input_ids=prompts,
                sampling_params=params,
                return_logprob=logprobs,
                top_logprobs_num=[2 * (i % 2) for i in range(num)],  # (none, or two)
            )
            out[f"{label}_loop_overlaps"] = engine._worker is not None
    got, want = outs["overlapped"], outs["synchronous"]
    out["identical_outputs"] = (
        f"{sum(a['output_ids'] == b['output_ids'] for a, b in zip(got, want))}/{num}"
    )
    out |= _logprob_agreement(got, want)
    out["problems"] = [
        f"{label} {i}: {problem}"
        for label, results in outs.items()
        for i, (result, p) in enumerate(zip(results, params))
        for problem in _request_problems(result, p)
    ]

    # Decode runs of 4, overlapped (as on CUDA by default), against the synchronous loop:
    # the same kinds of requests (penalties and logprobs run ahead), those that cannot
    # (regexes) shorter, and one long greedy request, so that the loop goes from
    # overlapped steps to runs.
    def blocks(p: dict[str, Any]) -> bool:
        return "regex" in p

    mixed = [
        {**p, "max_new_tokens": min(p["max_new_tokens"], 12)} if blocks(p) else p for p in params
    ]
    mixed.append({"max_new_tokens": 64, "temperature": 0, "ignore_eos": True})
    mixed_logprobs = [*logprobs, True]
    mixed_tops = [2 * (i % 2) for i in range(len(mixed))]
    mixed_prompts = prompts + corpus_prompts("tiny", 1, 12, offset=1000)
    mixed_outs = {}
    for label, config in (
        ("runs", {"decode_steps": 4, "overlap_schedule": True}),
        ("single", {"overlap_schedule": False}),
    ):
        with check.engine("tiny", dtype="float32", **config) as engine:
            mixed_outs[label] = engine.generate(
                input_ids=mixed_prompts,
                sampling_params=mixed,
                return_logprob=mixed_logprobs,
                top_logprobs_num=mixed_tops,
            )
            if label == "runs":
                out["decode_runs"] = engine.stats()["decode_runs"]
    runs, single = mixed_outs["runs"], mixed_outs["single"]
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(runs, single))
    out["decode_runs_identical_outputs"] = f"{same}/{len(mixed)}"
    out |= {f"decode_runs_{k}": v for k, v in _logprob_agreement(runs, single).items()}
    out["problems"] += [
        f"decode_runs {i}: {problem}"
        for i, (result, p) in enumerate(zip(runs, mixed))
        for problem in _request_problems(result, p)
    ]
    return out


def _logprob_agreement(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    """Where two loops' outputs are identical: the largest difference of the drawn tokens'
    logprobs, and how many top lists list the same tokens."""
    same = [
        (a["meta_info"], b["meta_info"])
        for a, b in zip(got, want)
        if a["output_ids"] == b["output_ids"]
    ]
    diffs = [
        abs(x[0] - y[0])
        for a, b in same
        for x, y in zip(a.get("output_token_logprobs", []), b.get("output_token_logprobs", []))
    ]
    tops = [
        [t for _, t, _ in x] == [t for _, t, _ in y]
        for a, b in same
        for x, y in zip(a.get("output_top_logprobs", []), b.get("output_top_logprobs", []))
    ]
    return {
        "max_logprob_diff_on_identical": max(diffs, default=None),
        "top_logprob_tokens_identical": f"{sum(tops)}/{len(tops)}",
    }


def _request_problems(result: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """What an output breaks of its request's parameters."""
    import re

    ids, text = result["output_ids"], result["text"]
    problems = []
    if any(token < 0 for token in ids):
        problems.append("a placeholder id in the output")
    if not params.get("min_new_tokens", 0) <= len(ids) <= params["max_new_tokens"]:
        problems.append(f"{len(ids)} tokens")
    problems += [
        f"stop string {stop!r} in the text" for stop in params.get("stop", ()) if stop in text
    ]
    stopped = result["meta_info"]["finish_reason"]["type"] == "stop"
    if "regex" in params and stopped and not re.fullmatch(params["regex"], text):
        problems.append(f"{text!r} does not match the regex")
    return problems
