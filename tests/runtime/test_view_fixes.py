"""What an engine shows of itself: the radix cache as text with each control character
escaped once, and a shut-down engine that says so instead of looking idle.
"""

from __future__ import annotations

from lmprog_runtime import Engine


def test_radix_tree_text_escapes_a_newline_once(engine):
    """The label was escaped for the SVG and then `repr`-ed again: `\\n` showed as
    `\\\\n`. The expectation is written out by hand, not computed with `repr`."""
    engine.flush_cache()
    engine.generate("alpha\nbeta", {"max_new_tokens": 1, "temperature": 0})
    text = str(engine.radix_tree())
    (line,) = [line for line in text.splitlines() if "alpha" in line]
    # The literal characters: quote, alpha, backslash, n, beta, quote.
    assert line.endswith("'alpha" + "\\" + "n" + "beta'"), line
    assert "\\" + "\\" not in text and "\n" not in line


def test_a_shut_down_engine_says_so(tiny_path):
    """`running=0` after a shutdown read as an idle engine ready for requests."""
    engine = Engine(tiny_path, max_total_tokens=1024)
    assert "running=0, waiting=0" in repr(engine) and "shut down" not in repr(engine)
    assert "0 running" in engine._repr_html_()
    engine.shutdown()
    text, page = repr(engine), engine._repr_html_()
    assert text.startswith("Engine(model=") and text.endswith("shut down)"), text
    assert "running" not in text and "waiting" not in text
    assert "lmprog Engine (shut down)" in page and "none: shut down" in page
    assert "0 running" not in page
