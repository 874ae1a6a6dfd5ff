"""The README stays true to the code: its two set-up commands exist and every setting is documented."""

from __future__ import annotations

import re

from serving import REPO

from service.config import Settings

README = (REPO / "README.md").read_text()


def test_first_screen_has_the_two_setup_commands() -> None:
    first_screen = "\n".join(README.splitlines()[:20])
    assert re.search(r"^make serve\b", first_screen, re.M) and re.search(r"^make test\b", first_screen, re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^serve:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert (REPO / ".ci" / "run").read_text().strip().endswith("make test")


def test_every_setting_is_in_the_settings_table() -> None:
    missing = [name for name in Settings.model_fields if f"`IMGSERVE_{name.upper()}`" not in README]
    assert missing == []
