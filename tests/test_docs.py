"""What the documentation says of the code, held to the code."""

import inspect
import os
import re

from helpers import ROOT


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def test_readme_key_table_is_the_configs_own():
    from lins_ds.runtime.config import key_table

    assert key_table() in read("README.md"), "regenerate README's table: python -c " \
        "'from lins_ds.runtime.config import key_table; print(key_table())'"


def test_readme_stays_short():
    assert len(read("README.md").encode()) <= 8 * 1024


def test_design_lists_the_methods_lins_engine_overrides():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from lins_ds.integrations.engine import LinsEngine

    overridden = {n for n, v in vars(LinsEngine).items()
                  if inspect.isfunction(v) and hasattr(DeepSpeedEngine, n) and n != "__init__"}
    section = read("docs", "design.md").split("## 6.")[1].split("## 7.")[0]
    overrides = section.split("`LinsEngine` overrides")[1].split("; everything else")[0]
    listed = set(re.findall(r"`(\w+)`", re.sub(r"\([^()]*\)", "", overrides)))  # names outside the remarks
    assert listed == overridden, (sorted(listed - overridden), sorted(overridden - listed))


def test_every_doc_the_readme_links_exists():
    for link in re.findall(r"\]\(([^)#]+\.md)\)", read("README.md")):
        assert os.path.exists(os.path.join(ROOT, link)), link
