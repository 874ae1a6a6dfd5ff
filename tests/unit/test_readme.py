"""The README stays a front page true to the code: its set-up commands come first, it stays short, and every
setting is documented (in docs/settings.md, which tests/unit/test_docs.py keeps equal to the generator's output)."""

from __future__ import annotations

import re

from serving import REPO

from imgserve.config import Settings

README = (REPO / "README.md").read_text()
MAX_LINES = 220


def test_first_screen_has_the_two_setup_commands() -> None:
    first_screen = "\n".join(README.splitlines()[:20])
    assert re.search(r"^make serve\b", first_screen, re.M) and re.search(r"^make test\b", first_screen, re.M)
    assert re.search(r"^curl .*/predict", first_screen, re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert (REPO / ".ci" / "run").read_text().strip().endswith("make test")


def test_readme_is_a_front_page() -> None:
    lines = len(README.splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines: move the detail into a page under docs/"


def test_every_setting_is_in_the_settings_page() -> None:
    settings_page = (REPO / "docs" / "settings.md").read_text()
    missing = [name for name in Settings.model_fields if f"`IMGSERVE_{name.upper()}`" not in settings_page]
    assert missing == [], "run `make docs`"
