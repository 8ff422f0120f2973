"""README's install without a package index names every dependency pyproject.toml declares."""
import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_index_install_lists_every_dependency():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    readme = open(os.path.join(ROOT, "README.md")).read()
    para = readme[readme.index("Without a package index"):]
    para = para[:para.index("\n\n")]
    listed = set(re.findall(r"`([^`]+)`", para))
    missing = [d for d in deps if d not in listed and re.split(r"[<>=!~\[ ]", d)[0] not in listed]
    assert not missing, f"README's no-index install omits {missing}"
