"""Wave execution of traced programs.

All states of all programs (the roots and every fork branch) advance through their
constant nodes; every `gen` and `select` that is then ready, across all branches and all
programs, goes to the runtime in one wave, so it sees them as co-scheduled batches. Forks
commit their parent's text before their branches' first wave; joins wait for every branch.
`run_batch` commits the constant prefix the programs share once, before the first wave.
"""

from __future__ import annotations

from typing import Any

from lmprog.backend import Backend
from lmprog.interpreter import ExecState, ProgramOps, gathered_variables, score_requests
from lmprog.ir import Argument, Expr, Fork, ForkItem, Gen, Join, Select, VarRef
from lmprog.traced import TracedProgram
from lmprog.tracer import Path


class _Stream:
    def __init__(self, nodes: list[tuple[int, Expr]], state: ExecState) -> None:
        self.nodes = nodes
        self.pos = 0
        self.state = state
        # fork id -> (the parent's variables, the length of its text) at the fork
        self.forks: dict[int, tuple[set[str], int]] = {}
        self.done = False


class _Run:
    def __init__(self, program: TracedProgram, ops: ProgramOps) -> None:
        self.program = program
        self.ops = ops
        self.streams: dict[Path, _Stream] = {(): _Stream(program.stream(()), ExecState())}
        self.error: BaseException | None = None

    @property
    def root(self) -> _Stream:
        return self.streams[()]


def run_waves(
    backend: Backend,
    defaults: dict[str, Any],
    programs: list[TracedProgram],
    shared_prefix: bool = True,
) -> list[tuple[ExecState, BaseException | None]]:
    """Execute complete traces together; returns each program's final state and error."""
    runs = [_Run(p, ProgramOps(backend, defaults)) for p in programs]
    if shared_prefix and len(runs) > 1:
        _commit_shared_prefix(backend, programs)
    while True:
        commits: list[list[int]] = []
        gens: list[tuple[_Run, _Stream, Gen, list[int], dict]] = []
        selects: list[tuple[_Run, _Stream, Select, Any]] = []
        progressed = False
        for run in runs:
            if run.error is not None:
                continue
            try:
                for path in list(run.streams):
                    progressed |= _advance(run, path, commits)
                for stream in run.streams.values():
                    node = None if stream.done else stream.nodes[stream.pos][1]
                    if isinstance(node, Gen):
                        ids, params = run.ops.gen_request(stream.state, node)
                        gens.append((run, stream, node, ids, params))
                    elif isinstance(node, Select):
                        selects.append((run, stream, node, run.ops.select_plan(stream.state, node)))
            except Exception as error:  # noqa: BLE001 - this program fails, the others go on
                run.error = error
        if commits:
            backend.generate(
                commits, [{"max_new_tokens": 0}] * len(commits), group=len(commits) > 1
            )
        if gens or selects:
            _send_wave(backend, gens, selects)
        elif not (commits or progressed):
            break
    results = []
    for run in runs:
        if run.error is None and not run.root.done:
            run.error = RuntimeError("the program stopped making progress (a join waits forever)")
        results.append((run.root.state, run.error))
    return results


def _send_wave(backend: Backend, gens: list, selects: list) -> None:
    if gens:
        outs = backend.generate([g[3] for g in gens], [g[4] for g in gens])
        for (run, stream, node, _, _), out in zip(gens, outs):
            _finish(run, stream, run.ops.finish_gen, stream.state, node, out)
    if selects:
        requests = [run.ops.select_requests(plan) for run, _, _, plan in selects]
        for (run, stream, node, plan), outs in zip(selects, score_requests(backend, requests)):
            _finish(run, stream, run.ops.finish_select, stream.state, node, plan, outs)


def _finish(run: _Run, stream: _Stream, apply: Any, *args: Any) -> None:
    """Apply one result; an error there fails its program only."""
    try:
        apply(*args)
        stream.pos += 1
    except Exception as error:  # noqa: BLE001 - this program fails, the others go on
        run.error = error


def _advance(run: _Run, path: Path, commits: list[list[int]]) -> bool:
    """Apply constant nodes until a gen / select, an unfinished join, or the end.
    Returns whether the stream moved."""
    stream = run.streams[path]
    st = stream.state
    start = stream.pos
    while not stream.done:
        if stream.pos >= len(stream.nodes):
            stream.done = True
            return True
        _, node = stream.nodes[stream.pos]
        if isinstance(node, (Gen, Select)):
            return stream.pos != start
        if isinstance(node, Fork):
            if st.text:
                commits.append(run.ops.backend.encode(st.text))
            stream.forks[node.fork_id] = (set(st.variables), len(st.text))
            for i in range(node.num_branches):
                child = path + ((node.fork_id, i),)
                run.streams[child] = _Stream(run.program.stream(child), st.copy())
        elif isinstance(node, Join):
            children = [
                s
                for p, s in run.streams.items()
                if p and p[:-1] == path and p[-1][0] == node.fork_id
            ]
            if not all(c.done for c in children):
                return stream.pos != start
            _join(stream, node, children)
        elif isinstance(node, Argument):
            raise ValueError(f"argument {node.name!r} has no value: pass it to run()")
        elif not isinstance(node, ForkItem):
            run.ops.apply_constant(st, node)
        stream.pos += 1
    return stream.pos != start


def _join(parent: _Stream, node: Join, children: list[_Stream]) -> None:
    st = parent.state
    before, fork_len = parent.forks[node.fork_id]
    if node.mode == "gather_variable":
        st.variables.update(gathered_variables(before, [c.state for c in children]))
        return
    for child in children:
        st.emit(child.state.text[fork_len:])


def _commit_shared_prefix(backend: Backend, programs: list[TracedProgram]) -> None:
    """Prefill the constant text every program starts with, once, before fanning out."""
    prefixes = [p.prefix for p in programs]
    common = prefixes[0]
    for other in prefixes[1:]:
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    if common:
        backend.commit_prefix(backend.encode(common))


def resolve(value: Any, variables: dict[str, Any]) -> Any:
    """A traced return value with its variable references replaced by their values."""
    if isinstance(value, VarRef):
        return variables[value.name]
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(v, variables) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, variables) for k, v in value.items()}
    return value
