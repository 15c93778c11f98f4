"""Every Python example in the README runs as written (in order, in one namespace)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    ns = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README block {i + 1}", "exec"), ns)
    ca = ns["ca"]
    # the custom policy example behaves as documented
    m = ca.Manager(fast="8MiB", slow="64MiB", policy=ns["LargeToSlow"](threshold=1 << 20))
    small = ca.zeros(1000, manager=m)
    big = ca.zeros(1 << 18, manager=m)
    assert small.device == "fast" and big.device == "slow"
    m.close()
