"""What the documentation says of the code, held to the code."""

import inspect
import os
import re

import pytest

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


PAPER_COMMAND = ["plan", "--objective", "comm", "--cluster", "a800-ib", "--nodes", "128", "--gpus-per-node", "8",
                 "--gpu-memory-gb", "80", "--seq-len", "4096", "--micro-batch-size", "1", "--grad-accum", "1",
                 "--grad-accum-dtype", "fp32", "--format", "json"]


def test_the_paper_table_in_the_planner_doc_is_what_lins_ds_plan_prints(capsys):
    import json

    from lins_ds.cli import main
    from lins_ds.plan import Layout

    doc = read("docs", "planner.md")
    assert "`lins-ds plan " + " ".join(PAPER_COMMAND[1:-2]) + " --model llama-7b`" in doc.replace("\n", " ")
    counts = []
    for size in ("7B", "13B", "30B"):
        assert main(PAPER_COMMAND + ["--model", f"llama-{size.lower()}"]) == 0
        out = json.loads(capsys.readouterr().out)
        k, n = out["activation_checkpointing_units"], out["num_layers"]
        plan = str(Layout.from_json(out["plan"])) + (f", {k} of {n} layer units checkpointed" if k else "")
        row = f"| {plan} | {out['memory_gb_per_gpu']:.2f} | {out['predicted_comm_s_per_step']:.3f} s |"
        assert f"| {size} |" in doc and row in doc, row
        counts.append(f"{out['candidates_considered']:,}")
    assert f"{counts[0]}, {counts[1]} and {counts[2]} candidates" in doc, counts


@pytest.mark.slow
def test_the_sharded_build_snippet_runs_as_written(tmp_path):
    """docs/usage.md's lins_ds.init example, copied out of the page and run as its first line says."""
    pytest.importorskip("transformers")
    from helpers import launch, torchrun

    page = read("docs", "usage.md")
    code = next(block for block in page.split("```python\n")[1:] if block.startswith("# sharded_build.py"))
    script = tmp_path / "sharded_build.py"
    script.write_text(code.split("```")[0])
    out = launch(torchrun(2) + [str(script)], cwd=tmp_path)
    assert out.count("built sharded: this rank holds") == 2, out[-3000:]
