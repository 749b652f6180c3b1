"""torpor.textout: the CLI's and the demo's text output (the progress line)."""

from __future__ import annotations


def test_progress_rewrites_one_line_on_a_terminal_only() -> None:
    """On a TTY the progress line is rewritten in place and cleared; on a pipe nothing is written."""
    import io

    from torpor.textout import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = Progress(tty, total=4)
    bar.step("sleep level 1")
    bar.advance()
    bar.step("wake")
    bar.clear()
    text = tty.getvalue()
    assert text.count("\r") == 4 and "\n" not in text  # two steps, then the clear (\r, blanks, \r)
    assert "0/4 sleep level 1" in text and "1/4 wake" in text and text.endswith("\r")
    pipe = io.StringIO()
    Progress(pipe, total=4).step("sleep level 1")
    assert pipe.getvalue() == ""
