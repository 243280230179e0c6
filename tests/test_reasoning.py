"""A reasoning model's thinking kept apart from its answer (issue 49): which templates think, and the split of the
text as it streams, whatever the deltas' boundaries."""

from __future__ import annotations

import itertools

import pytest

from tether.engines.reasoning import ReasoningFormat, Splitter, detect, opens_in_prompt

pytestmark = [pytest.mark.timeout(30)]

FMT = ReasoningFormat()
# a Qwen3-style template's essentials: it names the closing tag and reads enable_thinking
SWITCHABLE = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"


def split(pieces: list[str], inside: bool = False) -> tuple[str, str]:
    splitter = Splitter(FMT, inside)
    thought, said = "", ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        thought, said = thought + r, said + a
    r, a = splitter.flush()
    return thought + r, said + a


def every_cut(text: str) -> list[list[str]]:
    """``text`` cut into two and three pieces at every place (and one piece per character)."""
    cuts = [[text], list(text)]
    for i in range(len(text) + 1):
        cuts.append([text[:i], text[i:]])
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        cuts.append([text[:i], text[i:j], text[j:]])
    return cuts


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        ("<think>I should greet.</think>\n\nHello!", False, ("I should greet.", "Hello!")),
        ("\n<think>\nhm\n</think>Hi", False, ("\nhm\n", "Hi")),
        ("Hello, no thinking.", False, ("", "Hello, no thinking.")),
        ("  Hello <think>x</think>", False, ("", "  Hello <think>x</think>")),  # a later tag is the answer's text
        ("I think it is Paris.</think>\nParis.", True, ("I think it is Paris.", "Paris.")),  # the prompt opened it
        ("cut short inside the thinking </thi", True, ("cut short inside the thinking </thi", "")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),
        ("<thinking>not the tag", False, ("", "<thinking>not the tag")),
        ("", True, ("", "")),
    ],
)
def test_the_split_is_the_same_whatever_the_deltas_boundaries(text: str, inside: bool, expected: tuple[str, str]) -> None:
    for pieces in every_cut(text):
        assert split(pieces, inside) == expected, pieces


def test_nothing_is_held_back_longer_than_a_tag_could_need() -> None:
    splitter = Splitter(FMT, inside=True)
    assert splitter.feed("step one, </") == ("step one, ", "")
    assert splitter.feed("b> and on") == ("</b> and on", "")
    assert splitter.feed("</think>") == ("", "")
    assert splitter.feed("\n\nThe answer") == ("", "The answer")


def test_a_template_thinks_when_it_names_the_closing_tag_and_is_switchable_when_it_reads_enable_thinking() -> None:
    assert detect(None) is None and detect("{{ messages }}") is None
    assert detect("{{ '<think>\\n' }} ... </think>") == ReasoningFormat(switchable=False)
    assert detect(SWITCHABLE) == ReasoningFormat(switchable=True)
    assert opens_in_prompt("<|im_start|>assistant\n<think>\n", FMT)
    assert not opens_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n", FMT)
    assert not opens_in_prompt("<|im_start|>assistant\n", FMT)
