"""Plain helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import threading

import torch

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Question: What is 17 plus 25? Answer:",
    "Dear customer, thank you for writing to us about your parcel",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    '{"name": "Alice", "age": 31, "city":',
    "def add(a, b):\n    return a + b\n\nprint(add(2,",
    "The weather report for Monday says that the morning will be cloudy with light rain, "
    "and the afternoon will bring sunshine across most of the region before",
]


# The shape of the tiny random checkpoints built per architecture (logits and GGUF tests).
TINY_ARCH_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=256,
)
# Llama 3.1 frequency-dependent RoPE scaling, with a short original context so it matters.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def random_hf_model(model_type: str, **config):
    """A transformers model of `model_type` with weights re-drawn at a scale that makes its
    logits far from constant (default initialisation gives near-uniform logits, which would
    make logits comparisons vacuous). Eager attention: a path independent of ours (SDPA)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1:  # biases
                p.copy_(0.5 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / p.shape[1] ** 0.5)
    return model


def edit_config(path, **changes) -> None:
    """Change a checkpoint's config.json: each key set, or removed where given None."""
    import json
    from pathlib import Path

    file = Path(path) / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    file.write_text(json.dumps(config))


def hf_greedy_ids(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` on token ids, one prompt at a time (no padding)."""
    outs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        outs.append(out[0, len(ids) :].tolist())
    return outs


def hf_greedy(hf_tiny, prompt: str, max_new_tokens: int) -> list[int]:
    model, tokenizer = hf_tiny
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def decode_batch(table, rows: list[int], seq_lens: list[int]):
    """A DECODE ForwardBatch: each request's newest token (position seq_len - 1) is new."""
    from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode

    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(rows), dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens]),
        out_cache_loc=torch.stack([table.table[r, n - 1] for r, n in zip(rows, seq_lens)]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=list(seq_lens),
        prefix_lens=[n - 1 for n in seq_lens],
        logits_indices=torch.arange(len(rows)),
    )


def run_backend(name: str, layout, pool, table, batch, q, k, v):
    """One attention layer of `batch` through backend `name`."""
    from lmprog_runtime.attention import create_attention_backend

    backend = create_attention_backend(name, layout, pool, table)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, 0, batch)


# Operations a CUDA graph capture refuses: each waits for the device (a value read back or
# an output shape that depends on values) or copies Python data in from pageable memory.
_UNCAPTURABLE_OPS = {
    "aten::_local_scalar_dense",  # .item(), int(t), bool(t)
    "aten::item",  # the same under inference mode, where it is not decomposed
    "aten::is_nonzero",
    "aten::equal",
    "aten::allclose",
    "aten::nonzero",
    "aten::nonzero_numpy",  # nonzero(as_tuple=True) under inference mode
    "aten::argwhere",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::bincount",
    "aten::lift_fresh",  # torch.tensor(python data)
}
_HOST_READS = ("tolist", "numpy")  # Tensor methods no dispatch mode sees
_guard_state = threading.local()  # .depth: forbid_host_syncs blocks open on this thread
_hooks_lock = threading.Lock()
_hooks_installed = False


def _guard_depth() -> int:
    return getattr(_guard_state, "depth", 0)


def _install_guard_hooks() -> None:
    """Once per process: `Tensor.tolist` / `numpy` refuse on a thread with a guard open, and
    the Triton interpreter's launches run outside it. Elsewhere both act as before (so
    guards on several threads, opened and closed in any order, never undo each other)."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)

            def method(self, *args, _name=name, _original=original, **kwargs):
                if _guard_depth():
                    raise AssertionError(f"Tensor.{_name}() reads device values on the host")
                return _original(self, *args, **kwargs)

            setattr(torch.Tensor, name, method)
        try:
            from triton.runtime import interpreter
        except ImportError:
            interpreter = None
        if interpreter is not None:
            from torch.utils._python_dispatch import _disable_current_modes

            launch = interpreter.GridExecutor.__call__

            def exempt_launch(self, *args, **kwargs):
                depth = _guard_depth()
                if not depth:
                    return launch(self, *args, **kwargs)
                _guard_state.depth = 0
                try:
                    with _disable_current_modes():
                        return launch(self, *args, **kwargs)
                finally:
                    _guard_state.depth = depth

            interpreter.GridExecutor.__call__ = exempt_launch
        _hooks_installed = True


@contextlib.contextmanager
def forbid_host_syncs(python_data: bool = False):
    """Raise, on this thread, on what a CUDA graph cannot capture and a CPU can see: host
    reads of values (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.numpy()`, `equal`,
    `allclose`), outputs whose shape depends on values (`nonzero`, `argwhere`, one-argument
    `where`, boolean indexing, `masked_select`, unique, `repeat_interleave` without
    `output_size`) and, unless `python_data`, tensors made from Python data (outside a
    graph a pinned copy of them waits for nothing). (A `.cpu()` copy cannot be told from
    a no-op on a CPU.) Triton kernels run by the interpreter are exempt: on a GPU each is
    one launch (the interpreter itself reads its arguments into numpy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Guard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func._schema.name
            if name in _UNCAPTURABLE_OPS and not (python_data and name == "aten::lift_fresh"):
                raise AssertionError(f"{func} cannot be captured in a CUDA graph")
            if name == "aten::where" and len(args) == 1:
                raise AssertionError("where(condition) cannot be captured in a CUDA graph")
            if name == "aten::index" and any(
                t is not None and t.dtype == torch.bool for t in args[1]
            ):
                raise AssertionError("boolean indexing cannot be captured in a CUDA graph")
            if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
                raise AssertionError("repeat_interleave needs output_size in a CUDA graph")
            return func(*args, **kwargs)

    _install_guard_hooks()
    with Guard():
        _guard_state.depth = _guard_depth() + 1
        try:
            yield
        finally:
            _guard_state.depth -= 1


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace, a decoder that strips the text's first
    space), built by hand: its decode of `▁Hi` first in a text is "Hi", its bytes " Hi"."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁", "H", "i", "!", "▁H", "▁Hi", "▁Hi!"]
    merges = [("▁", "H"), ("▁H", "i"), ("▁Hi", "!")]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.add_special_tokens([AddedToken(s, special=True) for s in pieces[:3]])
    tk.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def byte_fallback_tokenizer(extra: tuple[str, ...] = ()):
    """A Llama-2-style tokenizer (SentencePiece BPE with byte fallback), built by hand:
    characters outside its few words (and the `extra` pieces) are `<0xNN>` byte pieces, and
    its decoder reads a run of them together (`ByteFallback`): one not valid UTF-8 gives one
    U+FFFD per byte. Its decode strips the text's first space, as Llama-2's does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", *extra]
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence(  # (Llama-2's: the text's first space is stripped)
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tk.add_special_tokens([AddedToken(s, special=True) for s in pieces[:3]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
