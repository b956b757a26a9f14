"""The `lmprog` command: run a program over a dataset file, or complete plain prompts.

    lmprog run programs.py:triage --input tickets.jsonl --output out.parquet \\
        --model smollm2-135m-instruct --id-column id --resume --set temperature=0
    lmprog generate --input prompts.txt --output completions.jsonl --set max_new_tokens=64

A thin layer over `Function.map`: it loads the program, builds one Engine, and turns the
options into `map` arguments; everything about rows, resume and errors is `map`'s.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import keyword
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmprog.api import assistant, gen, user
from lmprog.datasets.mapping import check_data
from lmprog.datasets.sinks import check_output
from lmprog.datasets.sources import RowSource, count_lines, open_source
from lmprog.function import Function
from lmprog.ops import SAMPLING_KEYS
from lmprog.run_options import split_kwargs

_EPILOG = """\
The output is JSONL or Parquet: the input columns, one column per program variable,
ret_value and error (set for a row that failed; the other rows go on). Rows are written as
they finish; after a crash or Ctrl-C, run the same command with --resume to skip the rows
already written (matched by --id-column, or by row position when rows have no id).
Exit status: 0 when every row this run ran succeeded, 1 when some failed (add
--retry-errors to a --resume to run them again), 2 for bad input, 130 on Ctrl-C.
"""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            program = load_program(args.program)
            data: Any = args.input
        else:
            program, data = _generate_program(args)
        program, defaults = _apply_settings(program, args.set)
        # Said before the model loads: the output path, the input file and its columns.
        if args.retry_errors and not args.resume:
            raise ValueError(
                "--retry-errors runs the failed rows of a resumed output: add --resume"
            )
        check_output(args.output, args.resume)
        check_data(
            program,
            data,
            id_column=args.id_column,
            include_text=args.text,
            include_usage=args.usage,
        )
        from lmprog_runtime import Engine

        engine = Engine(args.model, **_parse_pairs(args.engine, "--engine"))
        try:
            run = program.map(
                data,
                output=args.output,
                id_column=args.id_column,
                resume=args.resume,
                retry_errors=args.retry_errors,
                ordered=not args.unordered,
                include_text=args.text,
                include_usage=args.usage,
                window=args.window,
                num_threads=args.threads,
                progress=not args.quiet,
                backend=engine,
                **defaults,
            )
            summary = run.run()
        finally:  # (stops a compile still running at once: the exit waited for it)
            engine.shutdown()
    except (ValueError, TypeError, OSError, ImportError, AttributeError) as error:
        parser.exit(2, f"lmprog: error: {error}\n")
    except KeyboardInterrupt:
        parser.exit(130, "lmprog: interrupted; run the same command with --resume to go on\n")
    skipped_errors = (
        f", {summary.num_skipped_errors} of them with errors" if summary.num_skipped_errors else ""
    )
    print(
        f"lmprog: {summary.num_rows} rows ({summary.num_errors} with errors, "
        f"{summary.num_skipped} already done{skipped_errors}) -> {args.output} in "
        f"{summary.seconds:.1f} s",
        file=sys.stderr,
    )
    # (every row is written; a script still sees that some failed, this run or the one
    # that a plain --resume went on from: once, the output's errors were not seen)
    if summary.num_errors or summary.num_skipped_errors:
        print(
            "lmprog: some rows failed (their error column says why); once that is "
            "mended, the same command with --resume --retry-errors runs them again",
            file=sys.stderr,
        )
        return 1
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


_positive_int.__name__ = "positive integer"  # (argparse: "invalid positive integer value")


def load_program(spec: str) -> Function:
    """`path/to/file.py:name` or `package.module:name` -> the `@lp.function` it names."""
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name:
        raise ValueError(f"program {spec!r} must be FILE.py:FUNCTION or MODULE:FUNCTION")
    if location.endswith(".py") or Path(location).is_file():
        path = Path(location)
        if not path.is_file():
            raise FileNotFoundError(f"program file {location!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))  # its own imports, as `python FILE`
        try:
            module_spec.loader.exec_module(module)
        except SyntaxError as error:  # bad input, as a one-line message (exit 2)
            raise ValueError(f"program file {error.filename}:{error.lineno}: {error.msg}") from None
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            # The current directory's modules, as `python -m lmprog` finds them (the
            # console script's path starts at its own directory instead).
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(location)
    program = getattr(module, name, None)
    if not isinstance(program, Function):
        raise TypeError(f"{spec!r} is not an @lp.function (got {type(program).__name__})")
    return program


def _generate_program(args: argparse.Namespace) -> tuple[Function, Any]:
    """A one-gen program whose argument is the prompt column; `.txt` is one prompt a line."""
    column = args.prompt_column

    def complete(s, /, **row: Any) -> None:
        if column not in row:
            raise KeyError(f"row has no prompt column {column!r}")
        if args.chat:
            s += user(row[column])
            s += assistant(gen("completion"))
        else:
            s += row[column] + gen("completion")

    data: Any = args.input
    state = "state" if column == "s" else "s"  # (the state's name must not be the column's)
    params = [inspect.Parameter(state, inspect.Parameter.POSITIONAL_ONLY)]
    if column.isidentifier() and not keyword.iskeyword(column):
        # The prompt as a named argument: map checks the column up front, and sorts rows by
        # prompt (cache-aware order).
        params.append(inspect.Parameter(column, inspect.Parameter.KEYWORD_ONLY))
    else:  # any other name: the program takes every column (`**row`)
        params.append(inspect.Parameter("row", inspect.Parameter.VAR_KEYWORD))
        columns = None if _is_txt(args.input) else open_source(args.input).columns
        if columns is not None and column not in columns:
            raise ValueError(f"--prompt-column {column!r} is not a column of {args.input}")
    complete.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    if _is_txt(args.input):
        if not Path(args.input).is_file():
            raise FileNotFoundError(f"input file {args.input!r} does not exist")
        # (its lines counted first: the progress bar's total)
        data = RowSource(_lines(Path(args.input), column), num_rows=count_lines(Path(args.input)))
    return Function(complete), data


def _is_txt(path: str) -> bool:
    return Path(path).suffix.lower() == ".txt"


def _lines(path: Path, column: str) -> Iterator[dict[str, str]]:
    from lmprog.datasets.sources import decode_error

    with path.open(encoding="utf-8-sig") as f:
        try:
            for line in f:
                if line.strip():
                    yield {column: line.rstrip("\n")}
        except UnicodeDecodeError as error:  # (said with the file and line)
            raise decode_error(path, error) from None


def _apply_settings(program: Function, pairs: list[str]) -> tuple[Function, dict[str, Any]]:
    """`--set`: sampling options become defaults for every gen, the rest (and any the
    program has a parameter for) fix arguments."""
    settings = _parse_pairs(pairs, "--set")
    try:
        defaults, arguments = split_kwargs(settings, program.keyword_names)
    except (TypeError, ValueError) as error:  # (a default gen refuses)
        raise ValueError(f"--set: {error}") from None
    _check_sampling(defaults)
    return (program.bind(**arguments) if arguments else program), defaults


def _check_sampling(defaults: dict[str, Any]) -> None:
    """The engine checks sampling values per request, so a bad one would be every row's
    error (and a resume would skip those rows): here it is said once, up front."""
    from lmprog_runtime.sampling_params import SamplingParams

    params = {SAMPLING_KEYS[k]: v for k, v in defaults.items() if k in SAMPLING_KEYS}
    if isinstance(params.get("min_new_tokens"), int) and "max_new_tokens" not in params:
        # (gens may give their own max_tokens: the default of 128 is no bound here)
        params["max_new_tokens"] = params["min_new_tokens"]
    try:
        SamplingParams.from_dict(params)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--set: {error}") from None


def _parse_pairs(pairs: list[str], flag: str) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text  # a bare string
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmprog",
        description="Run lmprog programs over datasets on an in-process engine.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run an @lp.function once per row of a dataset file",
        description="Run an @lp.function once per row of a JSONL, CSV or Parquet file.\n"
        "Columns named like the program's arguments are passed to it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("program", help="the program: FILE.py:FUNCTION or MODULE:FUNCTION")
    run.add_argument("--input", required=True, help="rows: a .jsonl, .csv or .parquet file")
    generate = commands.add_parser(
        "generate",
        help="complete plain prompts (one a line, or a column)",
        description="Complete each prompt of a .txt file (one prompt a line) or of the\n"
        "prompt column of a JSONL, CSV or Parquet file; the output's `completion`\n"
        "column holds the generated text.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("--input", required=True, help="prompts: .txt, .jsonl, .csv, .parquet")
    generate.add_argument(
        "--prompt-column", default="prompt", help="the column holding the prompt (default: prompt)"
    )
    generate.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message (chat template)"
    )
    for sub in (run, generate):
        sub.add_argument("--output", required=True, help="results: a .jsonl or .parquet file")
        sub.add_argument(
            "--model",
            default=None,
            help="a named model (smollm2-135m-instruct, small, tiny), a Hugging Face "
            "directory, a .gguf file or a Hub id (default: the built-in tiny random model)",
        )
        sub.add_argument(
            "--engine",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="an Engine option, e.g. --engine max_total_tokens=65536 (repeatable)",
        )
        sub.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a sampling default for every gen (temperature=0, max_new_tokens=64) or a "
            "fixed program argument; values are JSON, else strings (repeatable)",
        )
        sub.add_argument("--id-column", default=None, help="the column identifying each row")
        sub.add_argument(
            "--resume", action="store_true", help="skip the rows the output already holds"
        )
        sub.add_argument(
            "--retry-errors",
            action="store_true",
            help="with --resume, run the rows whose output holds an error again",
        )
        sub.add_argument(
            "--unordered", action="store_true", help="write rows as they finish, not in input order"
        )
        sub.add_argument("--text", action="store_true", help="add each row's full text")
        sub.add_argument(
            "--usage", action="store_true", help="add prompt/cached/completion token counts"
        )
        sub.add_argument(
            "--window", type=_positive_int, default=1024, help="rows read and sorted at once"
        )
        sub.add_argument(
            "--threads", type=_positive_int, default=128, help="programs running at once"
        )
        sub.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


if __name__ == "__main__":
    sys.exit(main())
