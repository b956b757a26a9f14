"""The one runtime configuration: a frozen dataclass validated on construction.

Every component receives the `RuntimeConfig` it needs explicitly. Sizes that are only known
at run time (the number of KV slots actually allocated) live on the component that computes
them, never written back here. Environment variables are read in `env.py` only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass
from typing import Literal

ATTENTION_BACKENDS = ("auto", "torch", "triton", "native")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("int8", "int4", "w8a8_int8")
DEVICE_PATTERN = re.compile(r"(cpu|cuda)(:[0-9]+)?")
# The most steps of a decode run with `decode_steps="auto"` (`run_choice.py`).
AUTO_DECODE_STEPS = 8


# The settings of each type (checked by `RuntimeConfig._check_types`).
INT_SETTINGS = (
    "max_running_requests",
    "max_prefill_tokens",
    "chunked_prefill_size",
    "page_size",
    "grammar_cache_size",
    "grammar_cache_mib",
)
OPTIONAL_INT_SETTINGS = (
    "max_total_tokens",
    "context_len",
    "max_queued_requests",
    "num_threads",
    "random_seed",
)
NUMBER_SETTINGS = ("mem_fraction", "grammar_compile_timeout_s", "schedule_conservativeness")
FLAG_SETTINGS = (
    "disable_radix_cache",
    "disable_jump_forward",
    "disable_mixed_batches",
    "disable_cuda_graph",
    "disable_amx_linears",
    "disable_input_major_weights",
    "gc_freeze",
)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the in-process runtime is built.

    Example:
        >>> RuntimeConfig(max_total_tokens=8192, max_running_requests=32).device
        'cpu'
    """

    model_path: str | None = None
    device: str = "cpu"
    # "auto": on CUDA bfloat16 (float16 on GPUs without it), whatever the checkpoint holds;
    # on a CPU bfloat16 where it computes in bfloat16 natively (AMX or AVX512-BF16) and the
    # checkpoint is 16-bit, else float32.
    dtype: str = "auto"
    # Quantization of the linear layers (CPU): None; weight-only "int8" (llama.cpp's Q8_0
    # blocks) or "int4" (Q4_1 blocks); or "w8a8_int8" (int8 weights per output channel and
    # activations rounded to int8 per token, int32 products: SGLang's w8a8_int8, the LM head
    # included). The LM head is Q8_0 with the weight-only methods.
    quantization: str | None = None
    # "auto": Triton kernels on CUDA; the native C++ kernels for float32 or bfloat16 on CPU
    # (torch if they cannot be built); the torch reference elsewhere.
    attention_backend: str = "auto"
    # KV pool size in tokens; None = derived from `mem_fraction` of free memory.
    max_total_tokens: int | None = None
    mem_fraction: float = 0.3
    max_running_requests: int = 128
    # Token budget of one prefill (extend) forward.
    max_prefill_tokens: int = 8192
    # Longer prompts are prefilled in chunks of this many tokens, alternating with decode
    # steps of the running requests; <= 0 disables chunking.
    chunked_prefill_size: int = 4096
    # Override of the model's context length (max_position_embeddings).
    context_len: int | None = None
    schedule_policy: str = "lpm"
    page_size: int = 1
    disable_radix_cache: bool = False
    eviction_policy: str = "lru"
    # Constrained requests append the text their pattern forces in one extend step.
    disable_jump_forward: bool = False
    # Running requests decode in the same forward as the prompts being admitted (one
    # forward per step instead of an extend step that makes every decode wait).
    disable_mixed_batches: bool = False
    # On CUDA, decode steps replay CUDA graphs captured at startup for padded batch sizes
    # (with an attention backend that supports it; see `cuda_graph.py`).
    disable_cuda_graph: bool = False
    # A regex / JSON schema that takes longer than this to compile is refused.
    grammar_compile_timeout_s: float = 60.0
    # Compiled grammars kept for reuse, least recently used dropped first (over a 49k-token
    # vocabulary about 0.14 MiB a small regex, 1.4 MiB a small JSON schema); 0 keeps none
    # beyond the requests using them.
    grammar_cache_size: int = 64
    # ... and fewer, where they would hold more MiB than this (a regex of bounded free
    # text, `[^\n]{1,150}`, holds about 170 MiB over a 49k-token vocabulary); one larger
    # alone is not kept (each `generate` call compiles it again); 0 keeps none.
    grammar_cache_mib: int = 1024
    # Scales the share of future output tokens reserved at admission: 0 admits as much as
    # fits now (more retractions under pressure), larger values are more cautious.
    schedule_conservativeness: float = 1.0
    # At most this many requests may wait to be admitted; a submit beyond it raises
    # `QueueFull` at once. None: unbounded.
    max_queued_requests: int | None = 65536
    # Seeds the requests that give none; None: seeded from the OS (as SGLang's None).
    random_seed: int | None = 0
    # On CPUs with AMX or AVX512-BF16, bfloat16 linear layers keep a second copy of their
    # weights packed for AMX tiles and multiply decode batches (up to 32 rows) with it on the
    # tiles or by AVX512-BF16 dot products, 1.5-3x as fast as torch's matmul there
    # (`models/amx_linear.py`); the copy costs the weights' memory once more (skipped when
    # over a quarter of the free memory, or with this set).
    disable_amx_linears: bool = False
    # float32 on a CPU: linear weights are stored input-major (a transposed view, same
    # values) for each layer shape where a probe at load finds its BLAS multiplies decode
    # batches faster so,
    # 1.5-6x per layer at 8-32 rows on MKL (`models/weight_layout.py`); a tied LM head gets
    # its own copy. Set this to keep torch's layout.
    disable_input_major_weights: bool = False
    # Threads for torch's CPU ops; None leaves torch's default.
    num_threads: int | None = None
    # Overlap scheduling: the loop checks a step's tokens (stop strings, detokenizing,
    # streaming, finishing) while the next step's forward runs. None: on CUDA only (on a
    # CPU the forward and the loop share the cores, so overlapping gains nothing).
    overlap_schedule: bool | None = None
    # Decode runs (SGLang's num_continuous_decode_steps): when every request of a decode
    # step can run ahead (no grammar), up to this many decode steps run back to back from
    # one scheduling, each step's tokens fed to the next on the device, each step checked
    # as its tokens arrive; off a CPU the next run is launched before a run is checked
    # (`decode_run.py`). Less host work per token; new requests, aborts and deadlines wait
    # up to two runs (an abort is taken between the steps of a run committed step by
    # step, a streamed request's). 1: off. With overlap scheduling on, the batches that
    # cannot run ahead (and prompts) are overlapped as usual. "auto": runs of up to 8
    # while the overlapped loop finds the device waiting for the host, single steps while
    # it finds the host waiting for the device (`run_choice.py`).
    decode_steps: int | Literal["auto"] = 1
    # While requests decode, admitting waiting ones may wait up to this many steps (a
    # decode run counts as one) so that several are admitted in one step: on CUDA a step
    # that admits runs eagerly, where a decode step replays one graph. The rule, with what
    # it never holds back: `admission_wait.AdmissionWait.holds`. None: 8 where decode
    # steps replay CUDA graphs, else 0 (admitted at once; with decode runs too, whose
    # admissions wait for a run's end; with "auto" decode steps, 8 there where the loop
    # overlaps, and no wait while it takes runs).
    admission_wait_steps: int | None = None
    # While the engine has work (or a caller waits in `generate`), freeze the objects
    # alive when it took it up (the modules an engine imports: ~370,000), so that the
    # collector's full passes, which stop every thread, walk only what was made since
    # (`gc_freeze.py`; unfrozen once nothing works, garbage then collected about as
    # CPython's own schedule would).
    gc_freeze: bool = True

    def __post_init__(self) -> None:
        device = self.device
        if type(device).__module__ == "torch" and type(device).__name__ == "device":
            object.__setattr__(self, "device", str(device))  # (a torch.device, as its name)
        elif not isinstance(device, str):
            raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {device!r}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(
                f"device must be 'cpu', 'cuda' or 'cuda:N' (the devices the runtime runs "
                f"on), got {self.device!r}"
            )
        if self.device.startswith("cpu:"):  # (torch's name of its one CPU device)
            object.__setattr__(self, "device", "cpu")
        self._check_types()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.eviction_policy not in ("lru", "lfu"):
            raise ValueError(
                f"eviction_policy must be 'lru' or 'lfu', got {self.eviction_policy!r}"
            )
        for name in ("schedule_conservativeness", "grammar_compile_timeout_s"):
            if not math.isfinite(getattr(self, name)):  # nan passes every comparison below
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        # (Bounded above: 1e308 overflowed to inf in admission, and a timeout of 1e12 s
        # failed every constrained request with an OverflowError.)
        if not 0 <= self.schedule_conservativeness <= 100:
            raise ValueError(
                "schedule_conservativeness must be in [0, 100], got "
                f"{self.schedule_conservativeness}"
            )
        if not 0 < self.grammar_compile_timeout_s <= 86400:
            raise ValueError(
                "grammar_compile_timeout_s must be > 0 and at most 86400 (a day), got "
                f"{self.grammar_compile_timeout_s}"
            )
        if self.grammar_cache_size < 0:
            raise ValueError(f"grammar_cache_size must be >= 0, got {self.grammar_cache_size}")
        if self.grammar_cache_mib < 0:
            raise ValueError(f"grammar_cache_mib must be >= 0, got {self.grammar_cache_mib}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError("quantization runs on the CPU only (device='cpu')")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.context_len is not None and self.context_len < 2:
            raise ValueError(f"context_len must be >= 2, got {self.context_len}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 4 * self.page_size:
            raise ValueError("max_total_tokens must hold at least 4 pages")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be >= 1 or None, got {self.max_queued_requests}"
            )
        if self.num_threads is not None and not 1 <= self.num_threads <= 4096:
            raise ValueError(f"num_threads must be in [1, 4096], got {self.num_threads}")
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise TypeError(
                f"overlap_schedule must be True, False or None, got {self.overlap_schedule!r}"
            )
        steps = self.decode_steps
        if steps != "auto" and (isinstance(steps, bool) or not isinstance(steps, int)):
            raise TypeError(f"decode_steps must be an int or 'auto', got {steps!r}")
        if steps != "auto" and steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {steps}")
        wait = self.admission_wait_steps
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int)):
            raise TypeError(f"admission_wait_steps must be an int or None, got {wait!r}")
        if wait is not None and wait < 0:
            raise ValueError(f"admission_wait_steps must be >= 0 or None, got {wait}")

    def _check_types(self) -> None:
        """TypeError naming a setting of the wrong type (a str or a float where an int is
        meant once failed deep inside torch, and "no" turned a flag on)."""
        for name in (*INT_SETTINGS, *OPTIONAL_INT_SETTINGS):
            value = getattr(self, name)
            if value is None and name in OPTIONAL_INT_SETTINGS:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                none = " or None" if name in OPTIONAL_INT_SETTINGS else ""
                raise TypeError(f"{name} must be an int{none}, got {value!r}")
        for name in NUMBER_SETTINGS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
        for name in FLAG_SETTINGS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def run_steps(self) -> int:
        """The most decode steps a run takes: `decode_steps`, or "auto"'s
        (`AUTO_DECODE_STEPS`); 1: no runs."""
        return AUTO_DECODE_STEPS if self.decode_steps == "auto" else self.decode_steps

    @property
    def is_overlapped(self) -> bool:
        """Whether the engine loop overlaps its work with the forwards (`overlap_schedule`;
        None: on CUDA)."""
        if self.overlap_schedule is None:
            return self.device.startswith("cuda")
        return self.overlap_schedule

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))
