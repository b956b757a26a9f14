"""Names of unnamed gens (`AutoNames`) across forks, against a reference that knows which
names each state's family holds at its join: a state's name never repeats one its
ancestors or its own branches took (the join would lose or overwrite a value), and sibling
branches that take names alike get the same names (the join gathers them as one)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmprog.ir import AutoNames


def test_a_fork_then_the_parent_then_the_branches():
    """The parent's gen after the fork took the branches' name; the join overwrote it."""
    root = AutoNames()
    assert root.take() == "gen_0"
    branches = [root.fork(), root.fork()]
    assert root.take() == "gen_1"
    assert [b.take() for b in branches] == ["gen_2", "gen_2"]
    assert root.take() == "gen_3"


def test_interleaved_takes_stay_apart_and_siblings_alike():
    root = AutoNames()
    branches = [root.fork(), root.fork()]
    assert [b.take() for b in branches] == ["gen_0", "gen_0"]
    assert root.take() == "gen_1"
    assert [b.take() for b in branches] == ["gen_2", "gen_2"]
    inner = [branches[0].fork() for _ in range(3)]
    assert [b.take() for b in inner] == ["gen_3"] * 3
    assert branches[0].take() == "gen_4" and root.take() == "gen_5"
    assert branches[1].take() == "gen_6"  # (past the parent's, not its sibling's own)


@given(st.lists(st.tuples(st.sampled_from(["fork", "take"]), st.integers(0, 99)), max_size=60))
def test_no_state_repeats_a_name_of_its_ancestors_or_branches(ops):
    nodes, parents, taken = [AutoNames()], [None], [[]]
    for op, pick in ops:
        i = pick % len(nodes)
        if op == "fork":
            nodes.append(nodes[i].fork())
            parents.append(i)
            taken.append([])
        else:
            taken[i].append(nodes[i].take())

    def lineage(i):  # i and its ancestors
        while i is not None:
            yield i
            i = parents[i]

    for i in range(len(nodes)):
        assert len(set(taken[i])) == len(taken[i])  # (a state never repeats its own)
        for j in range(len(nodes)):
            if i != j and j in set(lineage(i)):  # j is an ancestor of i
                assert not set(taken[i]) & set(taken[j]), (i, j, taken)
