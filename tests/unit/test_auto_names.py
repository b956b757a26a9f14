"""Names of unnamed gens (`AutoNames`) across forks, against a reference that knows which
names each state's join can meet: two states share a name only where they are branches
(or below branches) of one fork, which the join gathers as one; every other pair (a state
and its ancestors or descendants, branches of different forks) never does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmprog.ir import AutoNames


def test_a_fork_then_the_parent_then_the_branches():
    """The parent's gen after the fork took the branches' name; the join overwrote it."""
    root = AutoNames()
    assert root.take() == "gen_0"
    branches = root.fork(2)
    assert root.take() == "gen_1"
    assert [b.take() for b in branches] == ["gen_2", "gen_2"]
    assert root.take() == "gen_3"


def test_interleaved_takes_stay_apart_and_siblings_alike():
    root = AutoNames()
    branches = root.fork(2)
    assert [b.take() for b in branches] == ["gen_0", "gen_0"]
    assert root.take() == "gen_1"
    assert [b.take() for b in branches] == ["gen_2", "gen_2"]
    inner = branches[0].fork(3)
    assert [b.take() for b in inner] == ["gen_3"] * 3
    assert branches[0].take() == "gen_4" and root.take() == "gen_5"
    assert branches[1].take() == "gen_6"  # (past the parent's, not its sibling's own)


def test_forks_one_after_another_or_open_together_name_apart():
    """Each fork named its gen `gen_0`: the second join found the name taken and lost its
    values, and of two open forks the second join overwrote the first's."""
    root = AutoNames()
    for expected in ("gen_0", "gen_1"):  # fork, gen, join; then again
        assert [b.take() for b in root.fork(2)] == [expected] * 2
    first, second = root.fork(2), root.fork(2)
    assert [b.take() for b in first] == ["gen_2"] * 2
    assert [b.take() for b in second] == ["gen_3"] * 2


@given(st.lists(st.tuples(st.sampled_from(["fork", "take"]), st.integers(0, 99)), max_size=60))
def test_only_branches_of_one_fork_share_names(ops):
    # Each state's path from the root: (fork number, branch index) pairs.
    nodes, paths, taken = [AutoNames()], [()], [[]]
    forks = 0
    for op, pick in ops:
        i = pick % len(nodes)
        if op == "fork":
            for b, names in enumerate(nodes[i].fork(1 + pick % 3)):
                nodes.append(names)
                paths.append((*paths[i], (forks, b)))
                taken.append([])
            forks += 1
        else:
            taken[i].append(nodes[i].take())

    for i in range(len(nodes)):
        assert len(set(taken[i])) == len(taken[i])  # (a state never repeats its own)
        for j in range(i + 1, len(nodes)):
            a, b = paths[i], paths[j]
            k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            parallel = k is not None and a[k][0] == b[k][0]  # (one fork, two branches)
            if not parallel:
                assert not set(taken[i]) & set(taken[j]), (paths[i], paths[j], taken)
