"""Every Python example in the README runs as written, each on its own, in README order.

Each ```python block runs in a fresh namespace, so a block that uses a name must define or
import it itself; a failure is reported under the block's line number and first line.
"""

import pathlib
import re

import pytest

import cachedarrays as ca

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, match.start(1)) + 1
        code = match.group(1)
        first = next((s.strip() for s in code.splitlines() if s.strip()), "")
        blocks.append(pytest.param(line, code, id=f"line {line}: {first[:60]}"))
    return blocks


BLOCKS = _blocks()


def _run(line, code):
    ns = {"__name__": "__main__"}        # as a script: a block's main guard runs
    exec(compile(code, f"README.md block at line {line}", "exec"), ns)
    return ns


def _close_managers(ns):
    for value in list(ns.values()):
        if isinstance(value, ca.Manager):
            value.close()


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("line,code", BLOCKS)
def test_readme_block_runs_as_written(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = _run(line, code)
    _close_managers(ns)


def test_the_custom_policy_example_behaves_as_documented(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line, code = next(p.values for p in BLOCKS if "class LargeToSlow" in p.values[1])
    ns = _run(line, code)
    _close_managers(ns)
    with ca.Manager(fast="8MiB", slow="64MiB", policy=ns["LargeToSlow"](threshold=1 << 20)) as m:
        small = ca.zeros(1000, manager=m)
        big = ca.zeros(1 << 18, manager=m)
        assert small.device == "fast" and big.device == "slow"
